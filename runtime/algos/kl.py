"""KL estimators between the policy and a reference policy, and KL-coefficient controllers.

The estimators are the per-token ones of Schulman, "Approximating KL Divergence" (2020,
http://joschu.net/blog/kl-approx.html), with ``log r = ref_logp - logp`` on tokens sampled from the
policy: k1 = -log r (unbiased, high variance, can be negative), k2 = (log r)^2 / 2 (biased, low
variance), k3 = (r - 1) - log r (unbiased, low variance, always >= 0).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

KL_KINDS: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def _kl_forward(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    diff = logp - ref_logp
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        log_r = (-diff).clamp(-20.0, 20.0)
        # Clamped to [-10, 10] as done in practice: one token with a huge ratio must not dominate.
        return (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)
    raise ValueError(
        f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_KINDS)} (optionally with '+')"
    )


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL(policy || reference) estimate, ``[B, T]``.

    kinds: ``kl``/``k1``, ``abs``, ``mse``/``k2``, ``low_var_kl``/``k3``. A trailing ``+`` (e.g. ``k3+``)
    keeps the forward value of that estimator but takes the gradient of k2, whose gradient is the
    true KL gradient in expectation (Schulman's note; k1/k3 are unbiased in value, not in gradient).
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    value = _kl_forward(logp, ref_logp, base)
    if straight_through:
        k2 = _kl_forward(logp, ref_logp, "k2")
        value = value.detach() + k2 - k2.detach()
    return value


def kl_in_reward(token_rewards: Tensor, kl: Tensor, coef: float, mask: Tensor | None = None) -> Tensor:
    """Token rewards with the KL penalty folded in: ``r_t - coef * kl_t`` (Ziegler et al. 2019, eq. 2).

    ``kl`` is detached (it is part of the reward, not a loss). Padding stays 0 when ``mask`` is given.
    """
    out = token_rewards - coef * kl.detach()
    return out * mask.to(out.dtype) if mask is not None else out


class KLController(Protocol):
    """A KL coefficient that may change with the measured KL."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (sec. 2.2).

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``: the
    coefficient grows when the measured KL is above target and shrinks when below, at most 20% per
    horizon's worth of samples.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl} and {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust the coefficient after ``n_steps`` samples whose mean KL was ``current_kl``."""
        if not math.isfinite(current_kl):
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": float(self.horizon)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


def make_kl_controller(
    kind: str, kl_coef: float, *, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """``fixed`` or ``adaptive`` (which needs ``target_kl`` and ``horizon``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("an adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; expected 'fixed' or 'adaptive'")
