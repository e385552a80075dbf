"""Masked reductions and loss aggregation over ``[batch, response_len]`` tensors.

Every tensor here is laid out as ``[B, T]`` with a 0/1 (or bool) response mask that marks the real
response tokens; padding never contributes to a mean, a variance or a loss.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set (all of it when ``dim`` is None)."""
    prod = values * mask.to(values.dtype)
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over the masked entries; an all-masked slice yields 0 rather than NaN."""
    m = mask.to(values.dtype)
    total = masked_sum(values, m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1.0)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance over all masked entries (Bessel-corrected by default, like ``torch.var``)."""
    m = mask.to(values.dtype)
    mean = masked_mean(values, m)
    n = m.sum()
    var = masked_sum((values - mean) ** 2, m) / n.clamp(min=1.0)
    if unbiased:
        if n <= 1:
            return torch.zeros((), dtype=values.dtype, device=values.device)
        var = var * n / (n - 1)
    return var


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise to zero mean / unit variance over the masked entries (PPO advantage whitening).

    With ``shift_mean=False`` only the scale changes and the mean is added back, so the sign of
    every entry is kept (used for values/returns). Padded entries come back as 0.
    """
    m = mask.to(values.dtype)
    mean = masked_mean(values, m)
    var = masked_var(values, m)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * m


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: int | float | None = None,
    global_seqs: int | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar, following verl's ``loss_agg_mode`` semantics.

    - ``token-mean`` (DAPO, Yu et al. 2025 eq. 8): ``sum(loss*mask) / sum(mask)``. Every token weighs
      the same, so long responses are not down-weighted.
    - ``seq-mean-token-sum``: per-sequence token sum, then mean over the ``B`` sequences.
    - ``seq-mean-token-mean`` (original GRPO, Shao et al. 2024 eq. 3): per-sequence token mean, then mean
      over sequences. A sequence with no tokens contributes 0 (its denominator is clamped to 1).
    - ``seq-mean-token-sum-norm`` (Dr. GRPO, Liu et al. 2025): ``sum(loss*mask) / norm_constant``, the
      constant defaulting to ``T = mask.shape[-1]`` (pad to the max response length to keep it fixed).
      Like verl, there is no division by ``B``.

    Gradient accumulation: pass the token count of the whole (mini-)batch as ``global_tokens``
    (token-mean) or its sequence count as ``global_seqs`` (seq-mean-*); the per-micro-batch losses then
    *sum* to the full-batch loss. Across data-parallel ranks that average gradients, also multiply by the
    world size.
    """
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        if global_tokens is not None:
            return masked_sum(loss_mat, m) / max(float(global_tokens), 1.0)
        return masked_sum(loss_mat, m) / m.sum().clamp(min=1.0)
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        seq = masked_sum(loss_mat, m, dim=-1)
        if mode == "seq-mean-token-mean":
            seq = seq / m.sum(dim=-1).clamp(min=1.0)
        n_seqs = seq.shape[0] if global_seqs is None else global_seqs
        return seq.sum() / max(n_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        const = float(m.shape[-1]) if norm_constant is None else float(norm_constant)
        return masked_sum(loss_mat, m) / const
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
