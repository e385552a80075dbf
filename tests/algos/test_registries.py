"""One algorithm, one place: the API's names and the runtime's registries agree both ways, the CRD's
enums are those names, and every registered estimator is reachable by its name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import yaml

from rlkube.api import algorithms as api
from rlkube.api.crd import CRD_FILE, repo_root
from rlkube.runtime.algos import (
    AGG_MODES,
    ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_MODES,
    compute_advantages,
    register_aggregation,
    register_estimator,
    register_policy_loss,
)

PAIRS = [
    ("advantageEstimator", api.ADVANTAGE_ESTIMATORS, ESTIMATORS),
    ("policyLoss", api.POLICY_LOSSES, POLICY_LOSSES),
    ("lossAggregation", api.LOSS_AGGREGATIONS, AGG_MODES),
]


@pytest.mark.parametrize(("field", "names", "registry"), PAIRS, ids=[p[0] for p in PAIRS])
def test_api_names_and_runtime_registry_agree_both_ways(field: str, names: tuple, registry: dict) -> None:
    assert not set(names) - set(registry), f"{field}: the API offers names with no function"
    assert not set(registry) - set(names), f"{field}: functions the API cannot select"
    assert len(names) == len(set(names))


def test_rollout_correction_modes_agree() -> None:
    assert set(api.ROLLOUT_CORRECTION_MODES) == set(ROLLOUT_CORRECTION_MODES)


def _algorithm_schema() -> dict[str, Any]:
    crd = yaml.safe_load((repo_root() / "crds" / CRD_FILE).read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["algorithm"]["properties"]


@pytest.mark.parametrize(("field", "names", "registry"), PAIRS, ids=[p[0] for p in PAIRS])
def test_the_committed_crd_enum_is_the_registry(field: str, names: tuple, registry: dict) -> None:
    assert _algorithm_schema()[field]["enum"] == list(names)
    assert set(_algorithm_schema()[field]["enum"]) == set(registry)


def test_every_algorithm_default_is_registered() -> None:
    assert set(api.DEFAULT_ESTIMATOR) == set(api.ALGORITHMS)
    assert set(api.DEFAULT_ESTIMATOR.values()) <= set(ESTIMATORS)
    assert set(api.DEFAULT_POLICY_LOSS.values()) <= set(POLICY_LOSSES)
    assert set(api.POLICY_LOSS_AGGREGATION) <= set(POLICY_LOSSES)
    assert set(api.POLICY_LOSS_AGGREGATION.values()) <= set(AGG_MODES)
    assert set(api.GROUP_ESTIMATORS) | set(api.CRITIC_ESTIMATORS) <= set(ESTIMATORS)


@pytest.mark.parametrize("register", [register_estimator, register_policy_loss, register_aggregation])
def test_a_name_cannot_be_registered_twice(register: Any) -> None:
    taken = {register_estimator: "grpo", register_policy_loss: "vanilla", register_aggregation: "token-mean"}
    with pytest.raises(ValueError, match="registered twice"):
        register(taken[register])(lambda *a, **k: None)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_estimator_is_reachable_by_name(name: str) -> None:
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    adv, ret = compute_advantages(
        name,
        mask=mask,
        scores=torch.tensor([1.0, 0.0, 0.5, 0.0]),
        group_index=torch.tensor([0, 0, 1, 1]),
        values=torch.zeros(4, 2),
    )
    assert adv.shape == ret.shape == (4, 2)
    assert adv[1, 1].item() == 0.0 and torch.isfinite(adv).all()
    assert adv.abs().sum().item() > 0


def test_rloo_and_reinforce_pp_are_their_own_estimators() -> None:
    mask = torch.ones(4, 1)
    scores = torch.tensor([1.0, 0.0, 3.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1])
    grpo, _ = compute_advantages("grpo", mask=mask, scores=scores, group_index=groups)
    rloo, _ = compute_advantages("rloo", mask=mask, scores=scores, group_index=groups)
    rpp, _ = compute_advantages("reinforce_pp", mask=mask, scores=scores, group_index=groups)
    h = 1 / 2**0.5
    assert grpo[:, 0].tolist() == pytest.approx([h, -h, h, -h], abs=1e-5)  # z-score within each group
    assert rloo[:, 0].tolist() == pytest.approx([1.0, -1.0, 1.0, -1.0])  # r_i - mean of the others
    # REINFORCE++ ignores groups: z-score over the batch (mean 1.5, unbiased std sqrt(5/3)).
    z = [(x - 1.5) / (5 / 3) ** 0.5 for x in (1.0, 0.0, 3.0, 2.0)]
    assert rpp[:, 0].tolist() == pytest.approx(z, abs=1e-4)
