"""Masked reductions and loss aggregation over ``[batch, response_len]`` tensors.

Every tensor here is laid out as ``[B, T]`` with a 0/1 (or bool) response mask that marks the real
response tokens; padding never contributes to a mean, a variance or a loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor


class AggregationFn(Protocol):
    """Reduce a per-token loss ``[B, T]`` to a scalar (see :func:`aggregate_loss` for the counts)."""

    def __call__(
        self,
        loss_mat: Tensor,
        mask: Tensor,
        *,
        global_tokens: float | None,
        global_seqs: int | None,
        norm_constant: float | None,
    ) -> Tensor: ...


# name -> function, filled by @register_aggregation below. The names are the API's
# (rlkube.api.algorithms.LOSS_AGGREGATIONS; a test checks both agree), not imported: the maths needs
# neither pydantic nor the API.
AGG_MODES: dict[str, AggregationFn] = {}


def register_aggregation(name: str) -> Callable[[AggregationFn], AggregationFn]:
    """Register a loss aggregation under ``name`` (one of ``rlkube.api.algorithms.LOSS_AGGREGATIONS``)."""

    def deco(fn: AggregationFn) -> AggregationFn:
        if name in AGG_MODES:
            raise ValueError(f"loss aggregation {name!r} is registered twice")
        AGG_MODES[name] = fn
        return fn

    return deco


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


def _n_seqs(mask: Tensor, global_seqs: int | None) -> float:
    return float(max(mask.shape[0] if global_seqs is None else global_seqs, 1))


@register_aggregation("token-mean")
def token_mean(
    loss_mat: Tensor,
    mask: Tensor,
    *,
    global_tokens: float | None = None,
    global_seqs: int | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """``sum(loss * mask) / sum(mask)`` (DAPO, Yu et al. 2025 eq. 8): every token weighs the same, so a
    long response is not down-weighted against a short one."""
    m = mask.to(loss_mat.dtype)
    if global_tokens is not None:
        return masked_sum(loss_mat, m) / max(float(global_tokens), 1.0)
    return masked_sum(loss_mat, m) / m.sum().clamp(min=1.0)


@register_aggregation("token-sum")
def token_sum(
    loss_mat: Tensor,
    mask: Tensor,
    *,
    global_tokens: float | None = None,
    global_seqs: int | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """``sum(loss * mask)``: no normalisation at all (the gradient grows with the batch's token count;
    pair it with a learning rate chosen for that). Micro-batch sums add up to the batch sum as they are."""
    return masked_sum(loss_mat, mask.to(loss_mat.dtype))


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_mat: Tensor,
    mask: Tensor,
    *,
    global_tokens: float | None = None,
    global_seqs: int | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """``(1/B) sum_i sum_t loss_it``: per-sequence token sum, then the mean over the ``B`` sequences."""
    return masked_sum(loss_mat, mask.to(loss_mat.dtype)) / _n_seqs(mask, global_seqs)


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_mat: Tensor,
    mask: Tensor,
    *,
    global_tokens: float | None = None,
    global_seqs: int | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """``(1/B) sum_i (1/|o_i|) sum_t loss_it`` (original GRPO, Shao et al. 2024 eq. 3). A sequence with no
    tokens contributes 0 but still counts in ``B``."""
    m = mask.to(loss_mat.dtype)
    seq = masked_sum(loss_mat, m, dim=-1) / m.sum(dim=-1).clamp(min=1.0)
    return seq.sum() / _n_seqs(mask, global_seqs)


@register_aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_mat: Tensor,
    mask: Tensor,
    *,
    global_tokens: float | None = None,
    global_seqs: int | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """``(1/B) sum_i sum_t loss_it / H`` (Dr. GRPO, Liu et al. 2025, eq. 2's ``1/G sum_i sum_t`` with
    no ``1/|o_i|``), ``H`` = ``norm_constant``, by default ``T = mask.shape[-1]``.

    Dividing by a constant ``H`` (the maximum response length: pass it, since batches are padded only to
    their longest response) keeps the scale near token-mean's without any length bias.
    """
    m = mask.to(loss_mat.dtype)
    horizon = float(m.shape[-1]) if norm_constant is None else float(norm_constant)
    return masked_sum(loss_mat, m) / (horizon * _n_seqs(mask, global_seqs))


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: int | float | None = None,
    global_seqs: int | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar with the aggregation registered as ``mode``
    (verl's ``loss_agg_mode`` names; each function above says its formula and source).

    Gradient accumulation: pass the token count of the whole (mini-)batch as ``global_tokens``
    (token-mean) or its sequence count as ``global_seqs`` (seq-mean-*); the per-micro-batch losses then
    *sum* to the full-batch loss. Across data-parallel ranks that average gradients, divide those
    counts by the world size (and multiply a token-sum loss by it).
    """
    try:
        fn = AGG_MODES[mode]
    except KeyError:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}"
        ) from None
    return fn(
        loss_mat,
        mask,
        global_tokens=None if global_tokens is None else float(global_tokens),
        global_seqs=global_seqs,
        norm_constant=norm_constant,
    )
