"""Advantage estimators: GRPO, RLOO, REINFORCE++ (outcome rewards) and GAE (with a critic).

Sequence-level estimators take one scalar score per response and a group id per response (all
responses sampled from the same prompt share an id); they return one advantage per response, which
the registered token-level form broadcasts over the response tokens.

``ESTIMATORS`` maps each name the API accepts (``algorithm.advantageEstimator``) to a function of one
shared keyword signature (:class:`AdvantageFn`) returning token-level ``(advantages, returns)``;
:func:`compute_advantages` dispatches on it. A new estimator is one decorated function here plus its
name in ``rlkube.api.algorithms``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from rlkube.runtime.algos.core import masked_whiten


class AdvantageFn(Protocol):
    """Token-level ``(advantages, returns)``, both ``[B, T]`` and zero on padding."""

    def __call__(
        self,
        *,
        mask: Tensor,
        scores: Tensor | None,
        group_index: Tensor | None,
        token_rewards: Tensor | None,
        values: Tensor | None,
        gamma: float,
        lam: float,
        norm_by_std: bool,
        whiten: bool,
        eps: float,
    ) -> tuple[Tensor, Tensor]: ...


# name -> function, filled by @register_estimator below. The names are the API's
# (rlkube.api.algorithms.ADVANTAGE_ESTIMATORS; a test checks both agree).
ESTIMATORS: dict[str, AdvantageFn] = {}


def register_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register a token-level advantage estimator under ``name`` (verl's ``register_adv_est``)."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ESTIMATORS[name] = fn
        return fn

    return deco


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sample group size, group mean, unbiased group std (0 for singletons) and whether every
    reward of the group is the same (exactly: max == min, so no rounding of the mean can leak in)."""
    if rewards.ndim != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            "rewards and group_index must both be [B]; "
            f"got {tuple(rewards.shape)} and {tuple(group_index.shape)}"
        )
    r = rewards.to(torch.float64)
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).scatter_add_(
        0, inverse, torch.ones_like(r)
    )
    total = torch.zeros(n_groups, dtype=torch.float64, device=r.device).scatter_add_(0, inverse, r)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=torch.float64, device=r.device).scatter_add_(
        0, inverse, (r - mean[inverse]) ** 2
    )
    var = sq / (count - 1).clamp(min=1.0)
    hi = torch.full((n_groups,), -torch.inf, dtype=torch.float64, device=r.device)
    lo = torch.full((n_groups,), torch.inf, dtype=torch.float64, device=r.device)
    hi = hi.scatter_reduce(0, inverse, r, reduce="amax")
    lo = lo.scatter_reduce(0, inverse, r, reduce="amin")
    return count[inverse], mean[inverse], var.sqrt()[inverse], (hi == lo)[inverse]


def grpo_advantages(
    rewards: Tensor, group_index: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO outcome advantage ``(r_i - mean(group)) / (std(group) + eps)`` (Shao et al. 2024, sec. 4.1.2).

    ``std`` is the unbiased sample std, as ``torch.std``. ``norm_by_std=False`` gives the Dr. GRPO
    variant (Liu et al. 2025) that only subtracts the mean. A group of one response has no baseline
    to compare against, so its advantage is 0. A group whose rewards are all equal gets exactly 0
    whatever ``eps`` and the rewards' scale (verl divides the float residue of ``r - mean`` by
    ``std + eps``, which is not 0 for, e.g., seven rewards of 0.99999 and a tiny ``eps``).
    """
    count, mean, std, equal = _group_stats(rewards, group_index)
    adv = rewards.to(torch.float64) - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where((count > 1) & ~equal, adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """REINFORCE leave-one-out: ``r_i - mean_{j != i} r_j`` (Kool et al. 2019; Ahmadian et al. 2024).

    Equal to ``n/(n-1) * (r_i - mean(group))``. Singleton groups and all-equal groups get exactly 0.
    """
    count, mean, _, equal = _group_stats(rewards, group_index)
    r = rewards.to(torch.float64)
    adv = (r - mean) * count / (count - 1).clamp(min=1.0)
    adv = torch.where((count > 1) & ~equal, adv, torch.zeros_like(r))
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over the valid tokens only (padding is skipped)."""
    m = mask.to(token_rewards.dtype)
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        new = token_rewards[:, t] + gamma * running
        running = torch.where(m[:, t] > 0, new, running)
        out[:, t] = running * m[:, t]
    return out


def reinforce_pp_advantages(
    token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns, whitened across the whole batch; no critic, no groups.

    Returns ``(advantages, returns)``, both ``[B, T]`` and zero on padding.
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


def gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    *,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, eq. 16) over the response tokens.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where
    ``t+1`` means the next *valid* token (padding, even in the middle, is skipped) and the value after
    the last valid token is 0 (the episode ends). ``returns = A + V`` (the critic's regression target)
    is computed before the optional whitening of the advantages. Both outputs are 0 on padding.
    """
    if not (token_rewards.shape == values.shape == mask.shape):
        raise ValueError(
            f"token_rewards, values and mask must share a shape; got {tuple(token_rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    m = mask.to(values.dtype)
    adv = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        valid = m[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        cur = delta + gamma * lam * last_gae
        last_gae = torch.where(valid, cur, last_gae)
        next_value = torch.where(valid, values[:, t], next_value)
        adv[:, t] = cur * m[:, t]
    returns = (adv + values) * m
    if whiten:
        adv = masked_whiten(adv, m)
    return adv, returns


def scores_to_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's scalar score on its last valid response token (outcome reward for GAE)."""
    m = mask.to(torch.long)
    out = torch.zeros(m.shape, dtype=scores.dtype if scores.is_floating_point() else torch.float32)
    out = out.to(scores.device)
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    has = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has]
    out[rows, last[has]] = scores[has].to(out.dtype)
    return out


def _sequence_scores(name: str, mask: Tensor, scores: Tensor | None, token_rewards: Tensor | None) -> Tensor:
    if scores is not None:
        return scores
    if token_rewards is None:
        raise ValueError(f"{name} advantages need scores [B] or token_rewards [B, T]")
    return (token_rewards * mask.to(token_rewards.dtype)).sum(dim=-1)


def _need_groups(name: str, group_index: Tensor | None) -> Tensor:
    if group_index is None:
        raise ValueError(f"{name} advantages need group_index (one group id per response)")
    return group_index


def _token_rewards(name: str, mask: Tensor, scores: Tensor | None, token_rewards: Tensor | None) -> Tensor:
    if token_rewards is not None:
        return token_rewards
    if scores is None:
        raise ValueError(f"{name} advantages need token_rewards [B, T] or scores [B]")
    return scores_to_token_rewards(scores.to(torch.float32), mask)


@register_estimator("grpo")
def grpo_estimator(
    *,
    mask: Tensor,
    scores: Tensor | None = None,
    group_index: Tensor | None = None,
    token_rewards: Tensor | None = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """:func:`grpo_advantages` of the sequence scores (or the masked sum of ``token_rewards``, so a KL
    penalty placed on tokens counts), broadcast over the valid tokens; returns = advantages."""
    groups = _need_groups("grpo", group_index)
    seq = grpo_advantages(
        _sequence_scores("grpo", mask, scores, token_rewards), groups, norm_by_std=norm_by_std, eps=eps
    )
    adv = seq.to(torch.float32).unsqueeze(-1) * mask.to(torch.float32)
    return adv, adv.clone()


@register_estimator("rloo")
def rloo_estimator(
    *,
    mask: Tensor,
    scores: Tensor | None = None,
    group_index: Tensor | None = None,
    token_rewards: Tensor | None = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """:func:`rloo_advantages` of the sequence scores, broadcast over the valid tokens."""
    groups = _need_groups("rloo", group_index)
    seq = rloo_advantages(_sequence_scores("rloo", mask, scores, token_rewards), groups)
    adv = seq.to(torch.float32).unsqueeze(-1) * mask.to(torch.float32)
    return adv, adv.clone()


@register_estimator("reinforce_pp")
def reinforce_pp_estimator(
    *,
    mask: Tensor,
    scores: Tensor | None = None,
    group_index: Tensor | None = None,
    token_rewards: Tensor | None = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """:func:`reinforce_pp_advantages` of ``token_rewards`` (or the scores on the last token)."""
    return reinforce_pp_advantages(
        _token_rewards("reinforce_pp", mask, scores, token_rewards), mask, gamma=gamma
    )


@register_estimator("gae")
def gae_estimator(
    *,
    mask: Tensor,
    scores: Tensor | None = None,
    group_index: Tensor | None = None,
    token_rewards: Tensor | None = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """:func:`gae` over ``token_rewards`` (or the scores on the last token) and the critic's ``values``."""
    rewards = _token_rewards("gae", mask, scores, token_rewards)
    if values is None:
        raise ValueError("gae advantages need values [B, T] from the critic")
    return gae(rewards, values, mask, gamma, lam, whiten=whiten)


def estimator_for_algorithm(algorithm: str) -> str:
    """Advantage estimator an algorithm name implies (grpo/dapo -> grpo, ppo -> gae); an estimator's own
    name maps to itself. The table is the API's (``rlkube.api.algorithms.DEFAULT_ESTIMATOR``)."""
    from rlkube.api.algorithms import DEFAULT_ESTIMATOR  # lazy: the maths itself needs no pydantic

    name = algorithm.lower()
    if name in DEFAULT_ESTIMATOR:
        return DEFAULT_ESTIMATOR[name]
    if name in ESTIMATORS:
        return name
    raise ValueError(
        f"unknown algorithm {algorithm!r}; expected one of "
        f"{', '.join(sorted({*DEFAULT_ESTIMATOR, *ESTIMATORS}))}"
    )


def compute_advantages(
    estimator: str,
    *,
    mask: Tensor,
    scores: Tensor | None = None,
    group_index: Tensor | None = None,
    token_rewards: Tensor | None = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Token-level ``(advantages, returns)``, both ``[B, T]`` and zero on padding, from the estimator
    registered as ``estimator`` (an algorithm name, grpo/dapo/ppo, selects its default estimator).

    - grpo / rloo need ``group_index`` and either ``scores`` [B] or ``token_rewards`` [B, T] (summed over
      the valid tokens, so penalties placed on tokens, e.g. KL in reward, count). Returns = advantages.
    - reinforce_pp needs ``token_rewards`` (or ``scores``, placed on the last token).
    - gae (PPO) needs ``values`` and ``token_rewards`` (or ``scores``, placed on the last token).
    """
    name = estimator.lower()
    fn = ESTIMATORS.get(name)
    if fn is None:
        try:
            fn = ESTIMATORS[estimator_for_algorithm(name)]
        except (ValueError, KeyError):
            raise ValueError(
                f"unknown advantage estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}"
            ) from None
    return fn(
        mask=mask,
        scores=scores,
        group_index=group_index,
        token_rewards=token_rewards,
        values=values,
        gamma=gamma,
        lam=lam,
        norm_by_std=norm_by_std,
        whiten=whiten,
        eps=eps,
    )
