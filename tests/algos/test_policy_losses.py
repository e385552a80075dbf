"""GSPO and CISPO against hand-computed cases and their papers' equations, and rollout-correction
weights in every registered policy loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from rlkube.runtime.algos import (
    POLICY_LOSSES,
    aggregate_loss,
    cispo_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
)

torch.set_num_threads(1)


def _logp(log_ratios: list[list[float]]) -> tuple[Tensor, Tensor]:
    """(logp requiring grad, old_logp = 0): the log-ratio per token is logp itself."""
    lr = torch.tensor(log_ratios, dtype=torch.float64)
    return lr.clone().requires_grad_(True), torch.zeros_like(lr)


# ---- GSPO (Zheng et al. 2025, arXiv 2507.18071) ------------------------------------------------


def test_gspo_clips_whole_sequences_by_their_geometric_mean_ratio() -> None:
    # seq 0: log-ratios 0.1, 0.3 -> s = e^0.2 = 1.2214 > 1.2, A = +1 -> clipped: -1.2
    # seq 1: one real token, log-ratio -0.5 -> s = e^-0.5 = 0.6065 < 0.8, A = -1 -> clipped: +0.8
    # (the second column of seq 1 is padding holding junk). seq-mean-token-mean: (-1.2 + 0.8) / 2.
    logp, old = _logp([[0.1, 0.3], [-0.5, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, met = gspo_policy_loss(logp, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.abs().max().item() == 0.0  # both responses clipped: no gradient at all
    assert met.clip_frac.item() == 1.0
    assert met.clip_frac_lower.item() == pytest.approx(1 / 3) and met.clip_frac_upper.item() == pytest.approx(
        2 / 3
    )
    assert met.ratio_max.item() == pytest.approx(math.exp(0.2)) and met.ratio_min.item() == pytest.approx(
        math.exp(-0.5)
    )


def test_gspo_gradient_by_hand_inside_the_range() -> None:
    # seq 0: log-ratios +0.05, -0.05 -> s0 = 1; seq 1: 0.1 -> s1 = e^0.1. A = (1, 1), G = 2.
    # L = -(s0 + s1) / 2; dL/dlogp_it = -A_i s_i / (G |y_i|): seq 0 -> -1/4 per token, seq 1 -> -e^0.1 / 2.
    logp, old = _logp([[0.05, -0.05], [0.1, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = gspo_policy_loss(logp, old, torch.ones(2, dtype=torch.float64), mask)
    assert loss.item() == pytest.approx(-(1.0 + math.exp(0.1)) / 2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.flatten().tolist() == pytest.approx([-0.25, -0.25, -math.exp(0.1) / 2, 0.0])


def _gspo_eq5(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, eps_lo: float, eps_hi: float) -> Tensor:
    """The paper's sequence-level objective (eq. 5 with s_i of eq. 7), negated, written directly."""
    m = mask.to(logp.dtype)
    s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1))
    return -torch.minimum(s * adv, s.clamp(1 - eps_lo, 1 + eps_hi) * adv).mean()


@settings(max_examples=40)
@given(st.integers(0, 10_000), st.integers(1, 6), st.integers(1, 5))
def test_gspo_token_form_equals_the_sequence_objective(seed: int, rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logp = (0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, cols, generator=g) > 0.3).long()
    mask[:, 0] = 1
    ours, _ = gspo_policy_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.15)
    paper = _gspo_eq5(logp, old, adv, mask, 0.1, 0.15)
    (g_ours,) = torch.autograd.grad(ours, logp)
    (g_paper,) = torch.autograd.grad(paper, logp)
    assert ours.item() == pytest.approx(paper.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(g_ours * mask, g_paper * mask, atol=1e-12)


def test_gspo_equals_ppo_for_one_token_responses() -> None:
    # |y_i| = 1: the sequence ratio is the token ratio, so GSPO is PPO-clip (no dual clip).
    logp, old = _logp([[0.3], [-0.4], [0.05]])
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    mask = torch.ones(3, 1)
    a, _ = gspo_policy_loss(logp, old, adv, mask)
    b, _ = ppo_policy_loss(logp, old, adv, mask, agg_mode="seq-mean-token-mean")
    assert a.item() == pytest.approx(b.item())


# ---- CISPO (MiniMax-M1, arXiv 2506.13585) ---------------------------------------------------------


def test_cispo_weights_reinforce_by_the_clipped_detached_ratio() -> None:
    # ratios 1.5, 0.5, 1.0 with bounds [0.8, 1.28] -> weights 1.28, 0.8, 1.0; A = 1, 1, -1.
    logp, old = _logp([[math.log(1.5), math.log(0.5), 0.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, met = cispo_policy_loss(logp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.28)
    # value: -w * A * logp, token-mean over 3 tokens
    assert loss.item() == pytest.approx((-1.28 * math.log(1.5) - 0.8 * math.log(0.5) + 0.0) / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    # the gradient is -w * A / N: the ratio-1.5 token keeps a gradient (PPO-clip would give it none)
    assert grad.tolist()[0] == pytest.approx([-1.28 / 3, -0.8 / 3, 1.0 / 3])
    ppo, _ = ppo_policy_loss(logp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.28)
    (g_ppo,) = torch.autograd.grad(ppo, logp)
    assert g_ppo[0, 0].item() == 0.0
    assert met.clip_frac.item() == pytest.approx(2 / 3)
    assert met.clip_frac_lower.item() == pytest.approx(1 / 3) and met.clip_frac_upper.item() == pytest.approx(
        1 / 3
    )


@settings(max_examples=40)
@given(st.integers(0, 10_000), st.integers(1, 5), st.integers(1, 6))
def test_cispo_gradient_is_the_papers(seed: int, rows: int, cols: int) -> None:
    # eq. 4: grad J = (1 / sum_i |o_i|) sum_i sum_t sg(r_hat_it) A_it grad log pi(o_it); we minimise -J.
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(rows, cols, generator=g, dtype=torch.float64) - 1).requires_grad_(True)
    old = torch.randn(rows, cols, generator=g, dtype=torch.float64) - 1
    adv = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, cols, generator=g) > 0.3).to(torch.float64)
    mask[0, 0] = 1.0
    loss, _ = cispo_policy_loss(logp, old, adv, mask, clip_low=1.0, clip_high=0.28)  # no lower bound
    (grad,) = torch.autograd.grad(loss, logp)
    r_hat = torch.exp(logp.detach() - old).clamp(max=1.28)
    assert torch.allclose(grad, -r_hat * adv * mask / mask.sum(), atol=1e-12)


# ---- rollout-correction weights, in every registered loss -----------------------------------------


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_is_weights_scale_each_tokens_loss(name: str) -> None:
    fn = POLICY_LOSSES[name]
    g = torch.Generator().manual_seed(0)
    logp = (0.1 * torch.randn(3, 4, generator=g, dtype=torch.float64) - 1).requires_grad_(True)
    old = 0.1 * torch.randn(3, 4, generator=g, dtype=torch.float64) - 1
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    w = torch.tensor([[0.5, 2.0, 1.0, 0.0], [1.5, 0.25, 9.0, 9.0], [3.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
    agg = "seq-mean-token-mean" if name == "gspo" else "token-mean"
    weighted, _ = fn(logp, old, adv, mask, agg_mode=agg, is_weights=w)
    ones, _ = fn(logp, old, adv, mask, agg_mode=agg, is_weights=torch.ones_like(w))
    plain, _ = fn(logp, old, adv, mask, agg_mode=agg)
    assert ones.item() == pytest.approx(plain.item(), rel=1e-12)
    # Recover the per-token loss from the gradient-free case: weights multiply it before aggregation.
    per_token = torch.stack(
        [
            torch.stack(
                [
                    fn(
                        logp.detach(),
                        old,
                        adv,
                        mask,
                        agg_mode="token-sum",
                        is_weights=torch.nn.functional.one_hot(torch.tensor(i * 4 + t), 12).reshape(3, 4),
                    )[0]
                    for t in range(4)
                ]
            )
            for i in range(3)
        ]
    )
    assert weighted.item() == pytest.approx(aggregate_loss(per_token * w, mask, agg).item(), rel=1e-10)
    (gw,) = torch.autograd.grad(weighted, logp)
    assert gw[0, 3].item() == 0.0  # a zero weight removes the token's gradient


def test_every_registered_loss_shares_one_signature_and_trains() -> None:
    g = torch.Generator().manual_seed(1)
    for name, fn in POLICY_LOSSES.items():
        logp = (0.1 * torch.randn(2, 3, generator=g) - 1).requires_grad_(True)
        loss, met = fn(
            logp,
            logp.detach() - 0.05,
            torch.tensor([1.0, -1.0]),
            torch.ones(2, 3),
            clip_low=0.2,
            clip_high=0.28,
            clip_c=3.0,
            agg_mode="token-mean",
            global_tokens=6,
            global_seqs=2,
            norm_constant=3.0,
            is_weights=None,
        )
        loss.backward()
        assert logp.grad is not None and torch.isfinite(logp.grad).all(), name
        assert set(met.as_dict()) >= {"clip_frac", "approx_kl", "ratio_max"}, name
