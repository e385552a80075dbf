"""Advantage estimators against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from rlkube.runtime.algos import (
    compute_advantages,
    discounted_returns,
    estimator_for_algorithm,
    gae,
    grpo_advantages,
    masked_mean,
    masked_var,
    reinforce_pp_advantages,
    rloo_advantages,
    scores_to_token_rewards,
)

torch.set_num_threads(1)


def close(actual: torch.Tensor, expected: list, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.to(torch.float64), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


S3 = math.sqrt(3.0)


def test_grpo_group_normalised_with_a_singleton_group() -> None:
    # group 0: rewards 1,0,1 -> mean 2/3, unbiased std sqrt(1/3); group 1 is a singleton -> 0.
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 5.0]), torch.tensor([0, 0, 0, 1]))
    assert adv.tolist() == pytest.approx([1 / S3, -2 / S3, 1 / S3, 0.0], abs=1e-5)


def test_grpo_zero_variance_group_gets_zero() -> None:
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert adv[:2].tolist() == [0.0, 0.0]
    assert adv[2:].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-5)


def test_grpo_non_contiguous_group_ids() -> None:
    # group 7: (1, 3), group 3: (2, 6); each is +-d/std with std = |d|*sqrt(2) -> +-1/sqrt(2).
    adv = grpo_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), torch.tensor([7, 3, 7, 3]))
    h = 1 / math.sqrt(2)
    assert adv.tolist() == pytest.approx([-h, -h, h, h], abs=1e-5)


def test_grpo_without_std_only_centres() -> None:
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 0]), norm_by_std=False)
    assert adv.tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3], abs=1e-6)


def test_rloo_leave_one_out_baseline() -> None:
    # 1 - mean(0, 1) = 0.5; 0 - mean(1, 1) = -1; singleton -> 0
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 1.0, 4.0]), torch.tensor([0, 0, 0, 1]))
    assert adv.tolist() == pytest.approx([0.5, -1.0, 0.5, 0.0], abs=1e-6)


def test_gae_hand_unrolled_three_steps() -> None:
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72); V = .5 .4 .3, reward 1 on the last token.
    # t2: delta = 1 - .3 = .7                      A2 = .7
    # t1: delta = .9*.3 - .4 = -.13                A1 = -.13 + .72*.7 = .374
    # t0: delta = .9*.4 - .5 = -.14                A0 = -.14 + .72*.374 = .12928
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.4, 0.3]])
    adv, ret = gae(r, v, torch.ones(1, 3), 0.9, 0.8, whiten=False)
    assert adv.tolist()[0] == pytest.approx([0.12928, 0.374, 0.7], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx([0.62928, 0.774, 1.0], abs=1e-6)


def test_gae_skips_padding_at_the_end_and_in_the_middle() -> None:
    # Same trajectory as above with pads (junk reward 5 / value 9) after t0 and at the end.
    r = torch.tensor([[0.0, 5.0, 0.0, 1.0, 5.0]])
    v = torch.tensor([[0.5, 9.0, 0.4, 0.3, 9.0]])
    m = torch.tensor([[1, 0, 1, 1, 0]])
    adv, ret = gae(r, v, m, 0.9, 0.8, whiten=False)
    assert adv.tolist()[0] == pytest.approx([0.12928, 0.0, 0.374, 0.7, 0.0], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx([0.62928, 0.0, 0.774, 1.0, 0.0], abs=1e-6)


def test_gae_with_gamma_lam_one_gives_reward_to_go_minus_value() -> None:
    r = torch.tensor([[1.0, 0.0, 2.0]])
    v = torch.tensor([[0.5, 1.0, 1.5]])
    adv, ret = gae(r, v, torch.ones(1, 3), 1.0, 1.0, whiten=False)
    assert ret.tolist()[0] == pytest.approx([3.0, 2.0, 2.0])
    assert adv.tolist()[0] == pytest.approx([2.5, 1.0, 0.5])


def test_gae_whitening_keeps_returns_and_normalises_advantages() -> None:
    r = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    v = torch.tensor([[0.1, 0.2, 7.0], [0.3, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv_raw, ret_raw = gae(r, v, m, 1.0, 1.0, whiten=False)
    adv, ret = gae(r, v, m, 1.0, 1.0, whiten=True)
    assert torch.equal(ret, ret_raw)
    assert masked_mean(adv, m).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(adv, m).item() == pytest.approx(1.0, abs=1e-4)
    assert adv[0, 2].item() == 0.0 and adv[1, 1:].abs().sum().item() == 0.0
    assert adv_raw.tolist()[0][:2] == pytest.approx([0.9, 0.8])


def test_discounted_returns_and_reinforce_pp() -> None:
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 3.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ret = discounted_returns(r, m, 0.5)
    close(ret, [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]])
    adv, ret2 = reinforce_pp_advantages(r, m, gamma=0.5)
    assert torch.equal(ret, ret2)
    assert masked_mean(adv, m).item() == pytest.approx(0.0, abs=1e-6)
    assert adv[1, 2].item() == 0.0


def test_scores_to_token_rewards_puts_the_score_on_the_last_real_token() -> None:
    m = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = scores_to_token_rewards(torch.tensor([2.0, 3.0, 4.0]), m)
    assert out.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]


def test_estimator_for_algorithm() -> None:
    assert estimator_for_algorithm("grpo") == "grpo"
    assert estimator_for_algorithm("DAPO") == "grpo"
    assert estimator_for_algorithm("ppo") == "gae"
    with pytest.raises(ValueError, match="unknown algorithm 'sac'"):
        estimator_for_algorithm("sac")


def test_compute_advantages_grpo_broadcasts_over_valid_tokens() -> None:
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv, ret = compute_advantages(
        "dapo", mask=m, scores=torch.tensor([1.0, 0.0]), group_index=torch.tensor([0, 0])
    )
    h = 1 / math.sqrt(2)
    close(adv, [[h, h, 0.0], [-h, 0.0, 0.0]])
    assert torch.equal(adv, ret)


def test_compute_advantages_grpo_sums_token_rewards_over_the_mask() -> None:
    # Scores 1 and 0 once the padded junk (9) is ignored; equal to the scores path.
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    tr = torch.tensor([[0.0, 1.0, 9.0], [0.0, 0.0, 9.0]])
    adv, _ = compute_advantages("grpo", mask=m, token_rewards=tr, group_index=torch.tensor([3, 3]))
    h = 1 / math.sqrt(2)
    close(adv, [[h, h, 0.0], [-h, -h, 0.0]])


def test_compute_advantages_ppo_places_scores_and_runs_gae() -> None:
    m = torch.ones(1, 3)
    adv, ret = compute_advantages(
        "ppo",
        mask=m,
        scores=torch.tensor([1.0]),
        values=torch.tensor([[0.5, 0.4, 0.3]]),
        gamma=0.9,
        lam=0.8,
        whiten=False,
    )
    assert adv.tolist()[0] == pytest.approx([0.12928, 0.374, 0.7], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx([0.62928, 0.774, 1.0], abs=1e-6)


def test_compute_advantages_rloo_and_reinforce_pp_dispatch() -> None:
    m = torch.ones(3, 1)
    adv, _ = compute_advantages(
        "rloo", mask=m, scores=torch.tensor([1.0, 0.0, 1.0]), group_index=torch.zeros(3)
    )
    assert adv[:, 0].tolist() == pytest.approx([0.5, -1.0, 0.5])
    _, ret = compute_advantages("reinforce_pp", mask=m, scores=torch.tensor([1.0, 0.0, 2.0]))
    assert ret[:, 0].tolist() == [1.0, 0.0, 2.0]


@pytest.mark.parametrize(
    ("estimator", "kwargs", "message"),
    [
        ("grpo", {"scores": torch.ones(2)}, "group_index"),
        ("grpo", {"group_index": torch.zeros(2)}, "scores"),
        ("gae", {"scores": torch.ones(2)}, "values"),
        ("gae", {}, "token_rewards"),
        ("vtrace", {}, "unknown advantage estimator"),
    ],
)
def test_compute_advantages_names_what_is_missing(estimator: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compute_advantages(estimator, mask=torch.ones(2, 2), **kwargs)
