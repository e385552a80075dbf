"""Policy losses (PPO-clip with DAPO clip-higher and dual clip, GSPO, CISPO), the clipped value loss,
entropy and per-token log-probabilities from logits.

``POLICY_LOSSES`` maps each name the API accepts (``algorithm.policyLoss``) to a function of one shared
signature (:class:`PolicyLossFn`): ``(logp, old_logp, advantages, mask, *, clip_low, clip_high, clip_c,
agg_mode, global_tokens, global_seqs, norm_constant, is_weights) -> (loss, PolicyLossMetrics)``. A new
loss is one decorated function here plus its name in ``rlkube.api.algorithms``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
from torch import Tensor

from rlkube.runtime.algos.core import aggregate_loss, masked_mean, masked_sum


@dataclass(frozen=True)
class PolicyLossMetrics:
    """Diagnostics of one policy-loss call, as detached 0-dim tensors (no device sync until read).

    Fractions are over the valid response tokens. ``clip_frac = clip_frac_lower + clip_frac_upper``:
    tokens whose loss a clip bound took over (their gradient is zero); ``dual_clip_frac``: negative-
    advantage tokens whose loss the dual-clip constant took over.
    """

    clip_frac: Tensor
    clip_frac_lower: Tensor
    clip_frac_upper: Tensor
    dual_clip_frac: Tensor
    approx_kl: Tensor
    ratio_mean: Tensor
    ratio_min: Tensor
    ratio_max: Tensor

    def as_dict(self) -> dict[str, float]:
        """Plain floats for logging."""
        return {k: float(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class ValueLossMetrics:
    """Diagnostics of one value-loss call (detached 0-dim tensors)."""

    clip_frac: Tensor
    vpred_mean: Tensor

    def as_dict(self) -> dict[str, float]:
        """Plain floats for logging."""
        return {k: float(v) for k, v in asdict(self).items()}


class PolicyLossFn(Protocol):
    """A policy loss: per-token surrogate, times ``is_weights`` when given, aggregated by ``agg_mode``."""

    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        clip_c: float | None = None,
        agg_mode: str = "token-mean",
        global_tokens: int | float | None = None,
        global_seqs: int | None = None,
        norm_constant: float | None = None,
        is_weights: Tensor | None = None,
    ) -> tuple[Tensor, PolicyLossMetrics]: ...


# name -> function, filled by @register_policy_loss below. The names are the API's
# (rlkube.api.algorithms.POLICY_LOSSES; a test checks both agree).
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under ``name`` (verl's ``register_policy_loss``)."""

    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def _masked_extreme(x: Tensor, mask: Tensor, largest: bool) -> Tensor:
    valid = mask > 0
    if not bool(valid.any()):
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[valid].max() if largest else x[valid].min()


def _token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(-1).expand_as(like)
    return advantages.to(like.dtype)


def _weighted(loss: Tensor, is_weights: Tensor | None) -> Tensor:
    """Per-token loss times the (detached) rollout-correction weights, when there are any."""
    return loss if is_weights is None else loss * is_weights.detach().to(loss.dtype)


def _ratio_metrics(
    clipped: Tensor,
    lower: Tensor,
    dual: Tensor,
    log_ratio: Tensor,
    ratio: Tensor,
    mask: Tensor,
) -> PolicyLossMetrics:
    """Metrics shared by every loss: fractions over the valid tokens, k1 of old vs new, ratio stats."""
    with torch.no_grad():
        fm = mask.detach()
        c = clipped.to(fm.dtype)
        low = (clipped & lower).to(fm.dtype)
        return PolicyLossMetrics(
            clip_frac=masked_mean(c, fm),
            clip_frac_lower=masked_mean(low, fm),
            clip_frac_upper=masked_mean(c - low, fm),
            dual_clip_frac=masked_mean(dual.to(fm.dtype), fm),
            approx_kl=masked_mean(-log_ratio.detach(), fm),
            ratio_mean=masked_mean(ratio.detach(), fm),
            ratio_min=_masked_extreme(ratio.detach(), fm, largest=False),
            ratio_max=_masked_extreme(ratio.detach(), fm, largest=True),
        )


@register_policy_loss("vanilla")
def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg_mode: str = "token-mean",
    global_tokens: int | float | None = None,
    global_seqs: int | None = None,
    norm_constant: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, PolicyLossMetrics]:
    """PPO-clip surrogate (Schulman et al. 2017, eq. 7), negated to be minimised (verl's ``vanilla``).

    Per token, with ``r = exp(logp - old_logp)``: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``.
    ``clip_high > clip_low`` is DAPO's clip-higher (Yu et al. 2025, eq. 10). With ``clip_c`` (> 1) the
    dual clip of Ye et al. 2020 (eq. 5) caps the loss of *negative*-advantage tokens at ``-A * clip_c``,
    so a huge ratio on a bad token cannot blow up the update; positive advantages are untouched.
    ``advantages`` may be ``[B]`` (sequence-level, broadcast over tokens) or ``[B, T]``. At a ratio exactly
    on a clip bound the loss is unclipped and the gradient still flows; it stops just past the bound.
    ``is_weights`` (rollout correction, detached) multiply the per-token loss before aggregation.
    ``agg_mode``, ``global_tokens``, ``global_seqs`` and ``norm_constant`` go to :func:`aggregate_loss`.
    """
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"dual-clip constant clip_c must be > 1, got {clip_c}")
    m = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # guard exp() against overflow
    ratio = torch.exp(log_ratio)
    adv = _token_advantages(advantages, logp)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    negative = adv < 0
    if clip_c is not None:
        loss_dual = -adv * clip_c
        dual = negative & (loss > loss_dual)
        loss = torch.where(negative, torch.minimum(loss, loss_dual), loss)
    else:
        dual = torch.zeros_like(clipped)
    pg_loss = aggregate_loss(
        _weighted(loss, is_weights),
        m,
        agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_constant=norm_constant,
    )
    return pg_loss, _ratio_metrics(clipped, negative, dual, log_ratio, ratio, m)


@register_policy_loss("gspo")
def gspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg_mode: str = "seq-mean-token-mean",
    global_tokens: int | float | None = None,
    global_seqs: int | None = None,
    norm_constant: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, PolicyLossMetrics]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): PPO-clip on the *sequence* ratio.

    ``s_i = (pi(y_i|x) / pi_old(y_i|x)) ** (1/|y_i|) = exp(mean_t(logp - old_logp))`` (eq. 7), and the
    objective ``(1/G) sum_i min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)`` (eq. 5). It is
    computed in the paper's token form, GSPO-token (eq. 13-14): ``s_it = sg[s_i] * pi(y_it) /
    sg[pi(y_it)]`` has the value ``s_i`` on every token of response ``i`` and the gradient ``s_i *
    grad log pi(y_it)``, so with sequence-level advantages and ``seq-mean-token-mean`` (the default
    here, and what the API resolves for gspo) loss and gradient equal eq. 5's. A whole response is
    clipped or not. The log of ``s_it`` is capped at 10 as verl does; ``clip_c`` (dual clip) does not apply.
    The paper's clip ranges are far narrower than PPO's (3e-4 / 4e-4).
    """
    m = mask.to(logp.dtype)
    adv = _token_advantages(advantages, logp)
    token_log_ratio = logp - old_logp
    seq_log_ratio = masked_sum(token_log_ratio, m, dim=-1) / m.sum(dim=-1).clamp(min=1.0)
    log_s = (logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_s)
    loss_unclipped = -adv * s
    loss_clipped = -adv * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    pg_loss = aggregate_loss(
        _weighted(loss, is_weights),
        m,
        agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_constant=norm_constant,
    )
    return pg_loss, _ratio_metrics(clipped, adv < 0, torch.zeros_like(clipped), token_log_ratio, s, m)


@register_policy_loss("cispo")
def cispo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg_mode: str = "token-mean",
    global_tokens: int | float | None = None,
    global_seqs: int | None = None,
    norm_constant: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, PolicyLossMetrics]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): REINFORCE weighted by a clipped, detached IS ratio.

    Per token ``-sg(r_hat) * A * logp`` with ``r = exp(logp - old_logp)`` and ``r_hat = clip(r,
    1 - clip_low, 1 + clip_high)``: the gradient is ``-r_hat * A * grad logp``. Unlike PPO-clip, a token
    whose ratio left the range keeps its gradient (only its weight is capped), so rare high-ratio
    "fork" tokens are not silently dropped from the update. The paper uses token-mean (eq. 4's
    ``1 / sum_i |o_i|``) and no effective lower bound (set ``clip_low`` to 1 for that); ``clip_c``
    does not apply. The loss *value* is not a surrogate of the return: only its gradient matters.
    """
    m = mask.to(logp.dtype)
    adv = _token_advantages(advantages, logp)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    loss = -weight * adv * logp
    lower = ratio < 1.0 - clip_low
    clipped = lower | (ratio > 1.0 + clip_high)
    pg_loss = aggregate_loss(
        _weighted(loss, is_weights),
        m,
        agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_constant=norm_constant,
    )
    return pg_loss, _ratio_metrics(clipped, lower, torch.zeros_like(clipped), log_ratio, ratio, m)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float | None = 0.2,
    agg_mode: str = "token-mean",
    *,
    global_tokens: int | float | None = None,
    global_seqs: int | None = None,
    norm_constant: float | None = None,
) -> tuple[Tensor, ValueLossMetrics]:
    """Clipped critic loss ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``.

    The value-clipping trick of the PPO reference implementation (see Engstrom et al. 2020, sec. 3):
    the new value may not move more than ``clip_range`` from the rollout-time value to reduce the loss.
    ``clip_range=None`` gives the plain ``0.5 * (V - R)^2``.
    """
    m = mask.to(values.dtype)
    unclipped = (values - returns) ** 2
    if clip_range is None:
        per_token = unclipped
        clipped = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        v_clip = torch.maximum(torch.minimum(values, old_values + clip_range), old_values - clip_range)
        clipped_loss = (v_clip - returns) ** 2
        per_token = torch.maximum(unclipped, clipped_loss)
        clipped = clipped_loss > unclipped
    loss = 0.5 * aggregate_loss(
        per_token,
        m,
        agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_constant=norm_constant,
    )
    with torch.no_grad():
        metrics = ValueLossMetrics(
            clip_frac=masked_mean(clipped.to(m.dtype), m.detach()),
            vpred_mean=masked_mean(values.detach(), m.detach()),
        )
    return loss, metrics


def _row_chunks(n: int, chunk_size: int | None) -> list[tuple[int, int]]:
    if chunk_size is None or chunk_size <= 0 or chunk_size >= n:
        return [(0, n)]
    return [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]


def entropy_from_logits(logits: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """Per-position entropy ``H = logsumexp(z) - sum softmax(z) * z`` of ``[B, T, V]`` logits -> ``[B, T]``.

    Computed in float32 without forming ``log_softmax`` (stable for large logits). ``chunk_size`` rows
    (of the flattened ``B*T``) at a time bound the float32 temporaries for big vocabularies.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for s, e in _row_chunks(flat.shape[0], chunk_size):
        z = flat[s:e].float()
        lse = torch.logsumexp(z, dim=-1)
        parts.append(lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1))
    return torch.cat(parts).reshape(logits.shape[:-1])


def logprobs_from_logits(logits: Tensor, token_ids: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """``log softmax(logits)[token_id]`` per position: ``[B, T, V]``, ``[B, T]`` -> ``[B, T]`` (float32).

    Gathers the chosen logit and subtracts ``logsumexp`` instead of materialising the full
    ``log_softmax``; ``chunk_size`` rows at a time bound the float32 temporaries.
    """
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} disagree")
    flat = logits.reshape(-1, logits.shape[-1])
    ids = token_ids.reshape(-1, 1).long()
    parts = []
    for s, e in _row_chunks(flat.shape[0], chunk_size):
        z = flat[s:e].float()
        parts.append(z.gather(-1, ids[s:e]).squeeze(-1) - torch.logsumexp(z, dim=-1))
    return torch.cat(parts).reshape(token_ids.shape)
