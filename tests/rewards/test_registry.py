"""get_reward_fn: names, ``module:function`` and ``file.py:function`` custom rewards, and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlkube.runtime.rewards import REWARD_NAMES, RewardFn, RewardResult, get_reward_fn


def test_every_builtin_name_resolves_to_a_reward_fn() -> None:
    for name in REWARD_NAMES:
        assert isinstance(get_reward_fn(name), RewardFn)


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="gsm8k"):
        get_reward_fn("gsm9k")


def test_custom_module_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(prompts, responses, truths):\n"
        "    return [len(r) / 10 for r in responses]\n"
        "def dict_reward(prompts, responses, truths):\n"
        "    return [{'score': 2.0, 'acc': r == t, 'why': 'x'} for r, t in zip(responses, truths)]\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("my_rewards:length_reward")
    assert [r.score for r in fn(["p", "p"], ["abcde", "a"], ["", ""])] == [0.5, 0.1]
    (res,) = get_reward_fn("my_rewards:dict_reward")(["p"], ["7"], ["7"])
    assert res == RewardResult(score=2.0, accuracy=True, extra={"why": "x"})
    with pytest.raises(AttributeError, match="my_rewards:missing"):
        get_reward_fn("my_rewards:missing")
    with pytest.raises(TypeError, match="not callable"):
        get_reward_fn("my_rewards:NOT_CALLABLE")


def test_custom_file_path_and_bad_specs(tmp_path: Path) -> None:
    f = tmp_path / "score.py"
    f.write_text("def fn(p, r, t):\n    return [True for _ in r]\n")
    (res,) = get_reward_fn(f"{f}:fn")(["p"], ["r"], ["t"])
    assert (res.score, res.accuracy) == (1.0, 1.0)
    with pytest.raises(ImportError, match="no_such_module_xyz:f"):
        get_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ImportError, match="not found"):
        get_reward_fn(f"{tmp_path / 'absent.py'}:fn")
    with pytest.raises(ValueError, match="module:function"):
        get_reward_fn("mod:")


def test_custom_function_returning_the_wrong_thing(tmp_path: Path) -> None:
    f = tmp_path / "bad.py"
    f.write_text("def short(p, r, t):\n    return []\ndef weird(p, r, t):\n    return ['x' for _ in r]\n")
    with pytest.raises(ValueError, match="returned 0 results for 1"):
        get_reward_fn(f"{f}:short")(["p"], ["r"], ["t"])
    with pytest.raises(TypeError, match="returned str for item 0"):
        get_reward_fn(f"{f}:weird")(["p"], ["r"], ["t"])


def test_options_only_for_math() -> None:
    with pytest.raises(TypeError, match="takes no options"):
        get_reward_fn("gsm8k", timeout_s=3)
