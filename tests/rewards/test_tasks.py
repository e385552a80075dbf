"""gsm8k, dapo, geo3k and arith rewards, and the answer extraction/normalisation, on real strings."""

from __future__ import annotations

import pytest

from rlkube.runtime.rewards import RewardResult, get_reward_fn
from rlkube.runtime.rewards.extract import last_boxed, normalize_answer


def _scores(name: str, responses: list[str], truths: list[str]) -> list[float]:
    out = get_reward_fn(name)([""] * len(responses), responses, truths)
    assert all(isinstance(r, RewardResult) for r in out)
    return [r.score for r in out]


def test_gsm8k_strict_format() -> None:
    responses = [
        "Natalia sold 48/2 = 24 clips in May.\nAltogether 48+24 = 72 clips.\n#### 72",
        "So the answer is 72.",  # no '####': strict mode gives 0
        "#### 1,250",
        "First guess #### 5, then I rechecked. #### 6",  # the last one counts
        "####72",  # the strict pattern wants a space
        "#### 18.",  # a sentence-final period is not part of the number
        "#### $18",  # strict: the number must follow '#### ' directly
    ]
    truths = ["72", "72", "1250", "6", "72", "18", "18"]
    assert _scores("gsm8k", responses, truths) == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]


def test_gsm8k_accepts_the_full_reference_solution_and_wrong_numbers_fail() -> None:
    truth = "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"
    assert _scores("gsm8k", ["#### 7", "#### 8", "#### -7"], [truth] * 3) == [1.0, 0.0, 0.0]


def test_gsm8k_answer_must_be_in_the_tail() -> None:
    response = "#### 7\n" + "blah " * 100
    assert _scores("gsm8k", [response], ["7"]) == [0.0]


def test_dapo_answer_line_or_boxed_plus_minus_one() -> None:
    responses = [
        "Let me think... 2+2 is 4.\nAnswer: 4",
        "The result is \\boxed{\\frac{1}{2}}",
        "Answer: 5",
        "I am not sure.",
        "answer:   \\boxed{10}",
        "Answer: $x = 3$",
    ]
    truths = ["4", "\\dfrac12", "4", "4", "10", "3"]
    res = get_reward_fn("dapo")([""] * 6, responses, truths)
    assert [r.score for r in res] == [1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
    assert [r.accuracy for r in res] == [True, True, False, False, True, True]


def test_geo3k_accuracy_plus_format() -> None:
    responses = [
        "<think>angles sum to 180</think> The answer is \\boxed{30}",  # right and well-formed
        "The answer is \\boxed{30}",  # right, no think block
        "<think>hmm</think> \\boxed{45}",  # wrong, well-formed
        "no idea",
    ]
    res = get_reward_fn("geo3k")([""] * 4, responses, ["30"] * 4)
    assert [r.score for r in res] == pytest.approx([1.0, 0.9, 0.1, 0.0])
    assert [r.accuracy for r in res] == [1.0, 1.0, 0.0, 0.0]


def test_arith_leading_integer_exact() -> None:
    responses = ["19", " 19", "19</s>", "19 because", "190", "1 9", "x19", "", "-3", "18"]
    truths = ["19"] * 8 + ["-3", "19"]
    assert _scores("arith", responses, truths) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_ragged_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="ragged"):
        get_reward_fn("arith")(["1+1="], ["2", "3"], ["2"])


def test_last_boxed_matches_braces() -> None:
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed 5$") == "5"
    assert last_boxed("cut off \\boxed{\\frac{1}{2") is None
    assert last_boxed("nothing") is None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("\\dfrac12", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("x = 5", "5"),
        ("10^\\circ", "10"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("1,000", "1000"),
        ("5.0", "5"),
        ("\\text{5 cm}", "5"),
        ("0.5", ".5"),
        ("\\sqrt3", "\\sqrt{3}"),
    ],
)
def test_normalisation_equates(a: str, b: str) -> None:
    assert normalize_answer(a) == normalize_answer(b)


@pytest.mark.parametrize(("a", "b"), [("1/3", "1/2"), ("(1,2)", "(2,1)"), ("12", "1,2"), ("x^2", "x^3")])
def test_normalisation_keeps_different_answers_apart(a: str, b: str) -> None:
    assert normalize_answer(a) != normalize_answer(b)
