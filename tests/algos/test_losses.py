"""PPO policy loss (clip, clip-higher, dual clip), value loss, entropy and log-probs, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlkube.runtime.algos import entropy_from_logits, logprobs_from_logits, ppo_policy_loss, value_loss

torch.set_num_threads(1)


def _lp(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, old_logp) float64 pairs with exp(logp - old_logp) = ratio."""
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    return logp, torch.zeros_like(logp)


def test_the_four_quadrants_of_the_clipped_surrogate() -> None:
    # ratio 1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped above)
    # ratio 1.5, A=-1: max( 1.5,  1.2) =  1.5 (pessimistic bound: not clipped)
    # ratio 0.5, A=-1: max( 0.5,  0.8) =  0.8 (clipped below)
    # ratio 0.5, A=+1: max(-0.5, -0.8) = -0.5
    logp, old = _lp([1.5, 1.5, 0.5, 0.5])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    loss, met = ppo_policy_loss(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx((-1.2 + 1.5 + 0.8 - 0.5) / 4)
    assert met.clip_frac.item() == pytest.approx(0.5)
    assert met.clip_frac_upper.item() == pytest.approx(0.25)
    assert met.clip_frac_lower.item() == pytest.approx(0.25)
    assert met.dual_clip_frac.item() == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp of -A*r is -A*r/4 where unclipped, 0 where a bound took over.
    assert grad.tolist()[0] == pytest.approx([0.0, 1.5 / 4, 0.0, -0.5 / 4])


def test_clip_higher_widens_only_the_upper_bound() -> None:
    logp, old = _lp([1.25, 0.75])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, met = ppo_policy_loss(logp, old, adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.28)
    # 1.25 < 1.28: unclipped -1.25; 0.75 < 0.8 with A<0: clipped to 0.8
    assert loss.item() == pytest.approx((-1.25 + 0.8) / 2)
    assert met.clip_frac_upper.item() == 0.0 and met.clip_frac_lower.item() == pytest.approx(0.5)


@pytest.mark.parametrize(("ratio", "adv"), [(1.25, 1.0), (0.75, -1.0)])
def test_ratio_exactly_on_the_bound_is_not_clipped_and_keeps_its_gradient(ratio: float, adv: float) -> None:
    logp, old = _lp([ratio])
    assert torch.exp(logp - old).item() == ratio  # precondition: exactly on the bound in float64
    a = torch.tensor([[adv]], dtype=torch.float64)
    loss, met = ppo_policy_loss(logp, old, a, torch.ones(1, 1), clip_low=0.25, clip_high=0.25)
    (grad,) = torch.autograd.grad(loss, logp)
    assert met.clip_frac.item() == 0.0
    assert loss.item() == pytest.approx(-adv * ratio)
    assert grad.item() == pytest.approx(-adv * ratio)


@pytest.mark.parametrize(("ratio", "adv"), [(1.25 + 1e-6, 1.0), (0.75 - 1e-6, -1.0)])
def test_ratio_just_past_the_bound_is_clipped_and_has_no_gradient(ratio: float, adv: float) -> None:
    logp, old = _lp([ratio])
    a = torch.tensor([[adv]], dtype=torch.float64)
    loss, met = ppo_policy_loss(logp, old, a, torch.ones(1, 1), clip_low=0.25, clip_high=0.25)
    (grad,) = torch.autograd.grad(loss, logp)
    assert met.clip_frac.item() == 1.0
    assert loss.item() == pytest.approx(-adv * (1.25 if adv > 0 else 0.75))
    assert grad.item() == 0.0


def test_dual_clip_caps_negative_advantages_only() -> None:
    # ratio 5, A=-1: vanilla loss 5, dual clip -> min(5, 3) = 3 (no gradient)
    # ratio 5, A=+1: vanilla -1.2, dual clip does not apply
    # ratio 2, A=-1: loss 2 < 3, dual clip inactive
    logp, old = _lp([5.0, 5.0, 2.0])
    adv = torch.tensor([[-1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, met = ppo_policy_loss(logp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2, clip_c=3.0)
    assert loss.item() == pytest.approx((3.0 - 1.2 + 2.0) / 3)
    assert met.dual_clip_frac.item() == pytest.approx(1 / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist()[0] == pytest.approx([0.0, 0.0, 2.0 / 3])
    no_dual, _ = ppo_policy_loss(logp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2)
    assert no_dual.item() == pytest.approx((5.0 - 1.2 + 2.0) / 3)


def test_dual_clip_constant_must_exceed_one() -> None:
    logp, old = _lp([1.0])
    with pytest.raises(ValueError, match="clip_c"):
        ppo_policy_loss(logp, old, torch.ones(1, 1), torch.ones(1, 1), clip_c=1.0)


def test_padding_does_not_touch_loss_or_metrics() -> None:
    # The padded token has a wild ratio (e^10) and advantage; it must not count anywhere.
    logp = torch.tensor([[math.log(1.1), 10.0]], dtype=torch.float64)
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, -50.0]], dtype=torch.float64)
    loss, met = ppo_policy_loss(logp, old, adv, torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(-1.1)
    assert met.clip_frac.item() == 0.0
    assert met.ratio_max.item() == pytest.approx(1.1) and met.ratio_mean.item() == pytest.approx(1.1)
    assert met.approx_kl.item() == pytest.approx(-math.log(1.1))


def test_sequence_level_advantages_broadcast_over_tokens() -> None:
    logp, old = _lp([1.1, 0.9, 1.3, 0.7])
    logp2 = logp.detach().reshape(2, 2)
    old2 = old.reshape(2, 2)
    seq = torch.tensor([1.0, -2.0], dtype=torch.float64)
    tok = torch.tensor([[1.0, 1.0], [-2.0, -2.0]], dtype=torch.float64)
    a, _ = ppo_policy_loss(logp2, old2, seq, torch.ones(2, 2))
    b, _ = ppo_policy_loss(logp2, old2, tok, torch.ones(2, 2))
    assert a.item() == b.item()
    # ratio 1.1, A=+1 -> -1.1; 0.9, A=+1 -> -0.9; 1.3, A=-2 -> 2.6; 0.7, A=-2 -> max(1.4, 1.6) = 1.6
    assert a.item() == pytest.approx((-1.1 - 0.9 + 2.6 + 1.6) / 4)


def test_policy_loss_aggregation_mode_is_applied() -> None:
    logp2 = torch.zeros(2, 3, dtype=torch.float64)  # ratio 1 everywhere: loss = -A per token
    adv = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    tm, _ = ppo_policy_loss(logp2, torch.zeros_like(logp2), adv, mask, agg_mode="token-mean")
    sm, _ = ppo_policy_loss(logp2, torch.zeros_like(logp2), adv, mask, agg_mode="seq-mean-token-mean")
    half, _ = ppo_policy_loss(logp2, torch.zeros_like(logp2), adv, mask, global_tokens=8)
    assert tm.item() == pytest.approx(-7 / 4)
    assert sm.item() == pytest.approx(-(1 + 4) / 2)
    assert half.item() == pytest.approx(-7 / 8)
    norm, _ = ppo_policy_loss(
        logp2, torch.zeros_like(logp2), adv, mask, agg_mode="seq-mean-token-sum-norm", norm_constant=14
    )
    assert norm.item() == pytest.approx(-7 / (14 * 2))  # / H / B


def test_value_loss_clipped() -> None:
    old = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    ret = torch.tensor([[2.0, 2.0, 2.0, 2.0]])
    v = torch.tensor([[1.5, 1.1, 3.0, 0.0]], requires_grad=True)
    loss, met = value_loss(v, old, ret, torch.tensor([[1, 1, 1, 0]]), clip_range=0.2)
    # 1.5: max(.25, (1.2-2)^2=.64) = .64 (clip bites); 1.1: inside the range, .81; 3.0: max(1, .64) = 1
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 1.0) / 3)
    assert met.clip_frac.item() == pytest.approx(1 / 3)
    (grad,) = torch.autograd.grad(loss, v)
    # 0.5 * 2 (v - R) / 3 where the unclipped branch is used, 0 where the clipped one is.
    assert grad.tolist()[0] == pytest.approx([0.0, (1.1 - 2.0) / 3, (3.0 - 2.0) / 3, 0.0])


def test_value_loss_unclipped() -> None:
    loss, met = value_loss(
        torch.tensor([[3.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), None
    )
    assert loss.item() == pytest.approx(2.0)
    assert met.clip_frac.item() == 0.0


def test_entropy_by_hand_and_stable() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]]])
    # uniform over 4 -> ln 4; p = (.25, .75) -> -(.25 ln .25 + .75 ln .75)
    h = entropy_from_logits(logits[:, :, :2].contiguous())
    assert h.tolist()[0] == pytest.approx([math.log(2.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])
    assert entropy_from_logits(logits[:, :1]).item() == pytest.approx(math.log(4.0))
    big = entropy_from_logits(torch.tensor([[[1000.0, 0.0, -1000.0]]]))
    assert torch.isfinite(big).all() and big.item() == pytest.approx(0.0, abs=1e-6)


def test_logprobs_gather_by_hand_stable_and_chunked() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [1000.0, 0.0]]])
    lp = logprobs_from_logits(logits, torch.tensor([[1, 1]]))
    assert lp.tolist()[0] == pytest.approx([math.log(0.75), -1000.0])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 11, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 11, (3, 5), generator=g)
    full = logprobs_from_logits(x, ids)
    assert full.dtype == torch.float32
    assert torch.allclose(full, logprobs_from_logits(x, ids, chunk_size=4))
    assert torch.allclose(entropy_from_logits(x), entropy_from_logits(x, chunk_size=4))
    ref = torch.log_softmax(x.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(full, ref, atol=1e-5)


def test_logprobs_gradient_matches_log_softmax() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 7, generator=g, requires_grad=True)
    ids = torch.randint(0, 7, (2, 3), generator=g)
    (ga,) = torch.autograd.grad(logprobs_from_logits(x, ids, chunk_size=2).sum(), x)
    (gb,) = torch.autograd.grad(torch.log_softmax(x, -1).gather(-1, ids.unsqueeze(-1)).sum(), x)
    assert torch.allclose(ga, gb, atol=1e-6)


def test_logprobs_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="disagree"):
        logprobs_from_logits(torch.zeros(1, 3, 4), torch.zeros(1, 2, dtype=torch.long))
