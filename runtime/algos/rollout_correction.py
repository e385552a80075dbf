"""Rollout correction: importance weights between the engine that sampled and the trainer's pi_old.

The tokens were sampled by the rollout engine (another kernel stack, another precision, and in the
async modes possibly older or mixed weights), but the PPO ratio is taken against the trainer's own
``old_logp``. Off-policy correction reweights each token by ``rho_t = pi_old(y_t) / pi_rollout(y_t)``
(Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training";
Liu, Li et al. 2025, "When Speed Kills Stability"), with its variance bounded by a threshold ``C``:

- ``tis`` (truncated IS): weight ``min(rho_t, C)``; every token stays in the loss.
- ``mis`` (masked IS): tokens with ``rho_t`` outside ``[1/C, C]`` leave the loss (mask 0, so they
  drop out of token-mean's count too); the others keep weight ``rho_t``, bounded by ``C`` by
  construction (verl: token-level IS weights with ``token_k1`` rejection at ``[1/C, C]``).

Both are token-level (a partially resumed sample mixes policy versions token by token, and each token
carries the log-prob of the weights that sampled it). Weights are detached: they change the measure,
not the objective. The weights multiply the per-token policy loss (every registered policy loss takes
``is_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlkube.runtime.algos.core import masked_mean

ROLLOUT_CORRECTION_MODES: tuple[str, ...] = ("off", "tis", "mis")
_LOG_BOUND = 20.0  # exp(+-20) keeps a wild ratio finite before the threshold acts


@dataclass(frozen=True)
class RolloutCorrection:
    """Per-token weights ``[B, T]`` (0 on padding and on masked tokens), the loss mask to train with,
    and the metrics ``rollout_corr/{is_weight_mean, is_clip_frac, logprob_diff_mean}``.

    ``is_weight_mean``: mean weight over the tokens left in the loss; ``is_clip_frac``: share of the
    valid tokens the threshold acted on (truncated for tis, masked for mis); ``logprob_diff_mean``:
    mean of ``old_logp - rollout_logp`` over the valid tokens (0 when both sides agree; the k1 estimate
    of ``-KL(pi_rollout || pi_old)``).
    """

    weights: Tensor
    mask: Tensor
    metrics: dict[str, Tensor]

    def as_dict(self) -> dict[str, float]:
        """Plain floats for logging."""
        return {k: float(v) for k, v in self.metrics.items()}


def rollout_correction(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str, threshold: float = 2.0
) -> RolloutCorrection:
    """Truncated (``tis``) or masked (``mis``) importance weights of ``old_logp`` over ``rollout_logp``.

    All ``[B, T]``; ``threshold`` is ``C > 1``. ``mode="off"`` returns weights of 1 on the valid tokens
    and the mask unchanged (metrics still say how far the two sides are apart).
    """
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(
            f"unknown rollout correction mode {mode!r}; expected one of {', '.join(ROLLOUT_CORRECTION_MODES)}"
        )
    if not threshold > 1.0:
        raise ValueError(f"rollout correction threshold must be > 1, got {threshold}")
    if not (old_logp.shape == rollout_logp.shape == mask.shape):
        raise ValueError(
            f"old_logp, rollout_logp and mask must share a shape; got {tuple(old_logp.shape)}, "
            f"{tuple(rollout_logp.shape)}, {tuple(mask.shape)}"
        )
    with torch.no_grad():
        m = mask.to(torch.float32)
        valid = m > 0
        log_rho = (old_logp.float() - rollout_logp.float()) * m
        rho = torch.exp(log_rho.clamp(-_LOG_BOUND, _LOG_BOUND))
        if mode == "tis":
            acted = valid & (rho > threshold)
            weights = rho.clamp(max=threshold) * m
            new_mask = m
        elif mode == "mis":
            acted = valid & ((rho > threshold) | (rho < 1.0 / threshold))
            new_mask = m * (~acted).to(m.dtype)
            weights = rho * new_mask
        else:
            acted = torch.zeros_like(valid)
            weights = m.clone()
            new_mask = m
        metrics = {
            "rollout_corr/is_weight_mean": masked_mean(weights, new_mask),
            "rollout_corr/is_clip_frac": masked_mean(acted.to(m.dtype), m),
            "rollout_corr/logprob_diff_mean": masked_mean(log_rho, m),
        }
    return RolloutCorrection(weights=weights, mask=new_mask.to(mask.dtype), metrics=metrics)
