"""KL estimators (Schulman's k1/k2/k3), KL in reward, and the KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from rlkube.runtime.algos import (
    AdaptiveKLController,
    FixedKLController,
    kl_in_reward,
    kl_penalty,
    make_kl_controller,
)

torch.set_num_threads(1)
LN2 = math.log(2.0)

# policy p = 0.5, reference q = 0.25 on the sampled token: log p - log q = ln 2
LOGP = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
REF = torch.tensor([[math.log(0.25)]], dtype=torch.float64)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("kl", LN2),
        ("k1", LN2),
        ("abs", LN2),
        ("mse", 0.5 * LN2**2),
        ("k2", 0.5 * LN2**2),
        ("low_var_kl", 0.5 + LN2 - 1.0),  # r = q/p = 0.5: (r - 1) - ln r
        ("k3", 0.5 + LN2 - 1.0),
    ],
)
def test_estimators_by_hand(kind: str, expected: float) -> None:
    assert kl_penalty(LOGP, REF, kind).item() == pytest.approx(expected)


def test_k1_can_be_negative_k3_cannot() -> None:
    assert kl_penalty(REF, LOGP, "kl").item() == pytest.approx(-LN2)
    assert kl_penalty(REF, LOGP, "abs").item() == pytest.approx(LN2)
    assert kl_penalty(REF, LOGP, "low_var_kl").item() == pytest.approx(2.0 - LN2 - 1.0)  # r = 2


def test_low_var_kl_is_clamped_to_ten() -> None:
    out = kl_penalty(torch.tensor([[0.0]]), torch.tensor([[30.0]]), "low_var_kl")
    assert out.item() == 10.0


def test_straight_through_keeps_value_and_takes_the_k2_gradient() -> None:
    logp = LOGP.clone().requires_grad_(True)
    value = kl_penalty(logp, REF, "k3+")
    assert value.item() == pytest.approx(0.5 + LN2 - 1.0)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    assert grad.item() == pytest.approx(LN2)  # d/dlogp of (logp - ref)^2 / 2


def test_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGP, REF, "full")


def test_kl_in_reward() -> None:
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4]], requires_grad=True)
    out = kl_in_reward(r, kl, 0.5, mask=torch.tensor([[1, 1, 1, 0]]))
    assert out.tolist()[0] == pytest.approx([-0.05, -0.1, 0.85, 0.0])
    assert not out.requires_grad


def test_adaptive_controller_follows_ziegler() -> None:
    c = AdaptiveKLController(0.1, target_kl=1.0, horizon=10)
    c.update(current_kl=2.0, n_steps=5)  # error 1.0 clipped to 0.2 -> x(1 + 0.2 * 5/10)
    assert c.value == pytest.approx(0.11)
    c.update(current_kl=0.5, n_steps=10)  # error -0.5 clipped to -0.2 -> x0.8
    assert c.value == pytest.approx(0.088)
    c.update(current_kl=1.05, n_steps=10)  # error 0.05 -> x1.05
    assert c.value == pytest.approx(0.0924)
    restored = AdaptiveKLController(1.0, target_kl=9.0, horizon=1)
    restored.load_state_dict(c.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (c.value, 1.0, 10)


def test_fixed_controller_and_factory() -> None:
    f = FixedKLController(0.001)
    f.update(100.0, 1000)
    assert f.value == 0.001
    assert isinstance(make_kl_controller("fixed", 0.2), FixedKLController)
    assert isinstance(make_kl_controller("adaptive", 0.2, target_kl=6.0, horizon=10000), AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", 0.2)
