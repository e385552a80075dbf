"""PPO clipped policy loss (with DAPO clip-higher and dual clip), clipped value loss, entropy and
per-token log-probabilities from logits."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from rlkube.runtime.algos.core import aggregate_loss, masked_mean


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


def _masked_extreme(x: Tensor, mask: Tensor, largest: bool) -> Tensor:
    valid = mask > 0
    if not bool(valid.any()):
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[valid].max() if largest else x[valid].min()


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
) -> tuple[Tensor, PolicyLossMetrics]:
    """PPO-clip surrogate (Schulman et al. 2017, eq. 7), negated to be minimised.

    Per token, with ``r = exp(logp - old_logp)``: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``.
    ``clip_high > clip_low`` is DAPO's clip-higher (Yu et al. 2025, eq. 10). With ``clip_c`` (> 1) the
    dual clip of Ye et al. 2020 (eq. 5) caps the loss of *negative*-advantage tokens at ``-A * clip_c``,
    so a huge ratio on a bad token cannot blow up the update; positive advantages are untouched.
    ``advantages`` may be ``[B]`` (sequence-level, broadcast over tokens) or ``[B, T]``. At a ratio exactly
    on a clip bound the loss is unclipped and the gradient still flows; it stops just past the bound.
    ``agg_mode``, ``global_tokens``, ``global_seqs`` and ``norm_constant`` go to :func:`aggregate_loss`.
    """
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"dual-clip constant clip_c must be > 1, got {clip_c}")
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logp)
    m = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # guard exp() against overflow
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logp.dtype)
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
        loss, m, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, norm_constant=norm_constant
    )

    with torch.no_grad():
        fm = m.detach()
        metrics = PolicyLossMetrics(
            clip_frac=masked_mean(clipped.to(fm.dtype), fm),
            clip_frac_lower=masked_mean((clipped & negative).to(fm.dtype), fm),
            clip_frac_upper=masked_mean((clipped & ~negative).to(fm.dtype), fm),
            dual_clip_frac=masked_mean(dual.to(fm.dtype), fm),
            approx_kl=masked_mean(-log_ratio.detach(), fm),
            ratio_mean=masked_mean(ratio.detach(), fm),
            ratio_min=_masked_extreme(ratio.detach(), fm, largest=False),
            ratio_max=_masked_extreme(ratio.detach(), fm, largest=True),
        )
    return pg_loss, metrics


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
