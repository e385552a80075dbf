"""Hypothesis properties that must hold for any input (complementing the hand-computed cases).

The examples are derandomized (tests/conftest.py loads that profile): the same ones on every run.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkube.runtime.algos import gae, grpo_advantages, ppo_policy_loss, rloo_advantages

torch.set_num_threads(1)

rewards_and_groups = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0]), min_size=n, max_size=n),
        st.lists(st.integers(0, 3), min_size=n, max_size=n),
    )
)


@settings(max_examples=60, deadline=None)
@given(rewards_and_groups)
def test_group_advantages_sum_to_zero_within_each_group(rg: tuple[list[float], list[int]]) -> None:
    r = torch.tensor(rg[0], dtype=torch.float64)
    g = torch.tensor(rg[1])
    for adv in (grpo_advantages(r, g), rloo_advantages(r, g)):
        for gid in set(rg[1]):
            assert adv[g == gid].sum().item() == pytest.approx(0.0, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(rewards_and_groups, st.floats(0.5, 4.0), st.floats(-3.0, 3.0))
def test_grpo_is_invariant_to_affine_reward_changes(
    rg: tuple[list[float], list[int]], scale: float, shift: float
) -> None:
    # z-scores do not change under r -> a*r + b (a > 0); eps is made negligible. An all-equal group is
    # exactly 0 on both sides (not a float residue divided by a ~1e-16 std + eps).
    r = torch.tensor(rg[0], dtype=torch.float64)
    g = torch.tensor(rg[1])
    a = grpo_advantages(r, g, eps=1e-12)
    b = grpo_advantages(r * scale + shift, g, eps=1e-12)
    assert torch.allclose(a, b, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 12),
    st.floats(-1e6, 1e6, allow_nan=False),
    st.floats(1e-3, 1e3),
    st.floats(-1e3, 1e3),
    st.sampled_from([0.0, 1e-12, 1e-6, 0.1]),
)
def test_an_all_equal_group_gets_exactly_zero(
    n: int, r: float, scale: float, shift: float, eps: float
) -> None:
    rewards = torch.full((n,), r, dtype=torch.float64) * scale + shift
    g = torch.zeros(n, dtype=torch.long)
    assert grpo_advantages(rewards, g, eps=eps).abs().max().item() == 0.0
    assert rloo_advantages(rewards, g).abs().max().item() == 0.0


def test_the_reported_all_equal_case_is_exactly_zero() -> None:
    # Seven rewards of 0.99999 with eps 1e-12 gave -1e-4 (a float std of ~1e-16 survived the division).
    r = torch.full((7,), 0.99999, dtype=torch.float64)
    g = torch.zeros(7, dtype=torch.long)
    for scale, shift in ((1.0, 0.0), (0.5, -3.0), (4.0, 3.0)):
        assert grpo_advantages(r * scale + shift, g, eps=1e-12).tolist() == [0.0] * 7
    assert grpo_advantages(r.float(), g, eps=1e-12).tolist() == [0.0] * 7


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(0, 1000), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_ignores_whatever_sits_under_padding(t: int, seed: int, gamma: float, lam: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(2, t, generator=gen, dtype=torch.float64)
    v = torch.randn(2, t, generator=gen, dtype=torch.float64)
    # Interleave a padded column after every real one, holding junk.
    m = torch.tensor([[1, 0] * t] * 2)
    junk = torch.full((2, t), 1e3, dtype=torch.float64)
    rp = torch.stack([r, junk], dim=-1).reshape(2, 2 * t)
    vp = torch.stack([v, -junk], dim=-1).reshape(2, 2 * t)
    a0, ret0 = gae(r, v, torch.ones(2, t), gamma, lam, whiten=False)
    a1, ret1 = gae(rp, vp, m, gamma, lam, whiten=False)
    assert torch.allclose(a1[:, ::2], a0) and torch.allclose(ret1[:, ::2], ret0)
    assert a1[:, 1::2].abs().max().item() == 0.0


@settings(max_examples=60, deadline=None)
@given(st.floats(-3.0, 3.0), st.floats(-2.0, 2.0))
def test_clip_is_pessimistic_and_dual_clip_caps_negative_advantages(log_ratio: float, adv: float) -> None:
    # PPO's objective is a lower bound of the unclipped one: loss >= -A * r. The dual clip may only
    # lower the loss of a negative-advantage token, to min(loss, -A * c).
    lp = torch.tensor([[log_ratio]], dtype=torch.float64)
    a = torch.tensor([[adv]], dtype=torch.float64)
    ratio = torch.exp(lp).item()
    plain, _ = ppo_policy_loss(lp, torch.zeros_like(lp), a, torch.ones(1, 1))
    dual, _ = ppo_policy_loss(lp, torch.zeros_like(lp), a, torch.ones(1, 1), clip_c=3.0)
    assert plain.item() >= -adv * ratio - 1e-12
    if adv >= 0:
        assert dual.item() == plain.item()
    else:
        assert dual.item() == pytest.approx(min(plain.item(), -adv * 3.0))
