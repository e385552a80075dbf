"""The algorithm section: estimator, policy loss and aggregation names, their defaults from
`algorithm.name`, and rollout correction, as the API parses, validates and resolves them."""

from __future__ import annotations

import pydantic
import pytest
from specs import merge, minimal

from rlkube.api import parse_rljob, resolve, validate
from rlkube.api.algorithms import (
    ADVANTAGE_ESTIMATORS,
    DEFAULT_ESTIMATOR,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
)


def _algo(**algorithm: object) -> pydantic.BaseModel:
    return parse_rljob(merge(minimal(), {"algorithm": algorithm})).spec


@pytest.mark.parametrize(("name", "estimator"), sorted(DEFAULT_ESTIMATOR.items()))
def test_the_algorithm_name_sets_the_estimator_and_the_loss(name: str, estimator: str) -> None:
    spec = _algo(name=name)
    assert spec.algorithm.advantage_estimator is None  # absent stays absent on the wire
    assert spec.algorithm.effective_advantage_estimator == estimator
    assert spec.algorithm.effective_policy_loss == "vanilla"
    assert spec.algorithm.effective_loss_aggregation == "token-mean"
    resolved = resolve(parse_rljob(merge(minimal(), {"algorithm": {"name": name}}))).spec.algorithm
    assert (resolved.advantage_estimator, resolved.policy_loss, resolved.loss_aggregation) == (
        estimator,
        "vanilla",
        "token-mean",
    )


def test_explicit_choices_win_over_the_name() -> None:
    spec = _algo(name="ppo", advantageEstimator="rloo", policyLoss="cispo", lossAggregation="token-sum")
    a = spec.algorithm
    assert (a.effective_advantage_estimator, a.effective_policy_loss, a.effective_loss_aggregation) == (
        "rloo",
        "cispo",
        "token-sum",
    )
    assert validate(spec) == []


def test_gspo_defaults_to_its_papers_aggregation() -> None:
    spec = _algo(policyLoss="gspo")
    assert spec.algorithm.effective_loss_aggregation == "seq-mean-token-mean"
    assert validate(spec) == []
    assert validate(_algo(policyLoss="gspo", lossAggregation="seq-mean-token-mean")) == []


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp"])
def test_estimators_without_groups_accept_a_group_of_one(estimator: str) -> None:
    assert validate(_algo(name="grpo", advantageEstimator=estimator, groupSize=1)) == []


def test_the_grpo_estimator_still_needs_two_responses_under_ppo() -> None:
    errors = validate(_algo(name="ppo", advantageEstimator="grpo", groupSize=1))
    assert [e.field for e in errors] == ["spec.algorithm.groupSize"]
    assert "advantageEstimator gae or reinforce_pp" in errors[0].message


@pytest.mark.parametrize(
    ("field", "value"),
    [("advantageEstimator", "vtrace"), ("policyLoss", "ppo"), ("lossAggregation", "seq-mean")],
)
def test_unknown_names_are_refused_with_the_choices(field: str, value: str) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        _algo(**{field: value})
    text = str(err.value)
    assert f"spec.algorithm.{field}\n" in text
    choices = {"advantageEstimator": ADVANTAGE_ESTIMATORS, "policyLoss": POLICY_LOSSES}.get(
        field, LOSS_AGGREGATIONS
    )
    assert all(c in text for c in choices)


def test_rollout_correction_present_means_tis_at_two() -> None:
    rc = _algo(rolloutCorrection={}).algorithm.effective_rollout_correction
    assert (rc.mode, rc.threshold) == ("tis", 2.0)
    assert _algo().algorithm.effective_rollout_correction.mode == "off"
    assert _algo(rolloutCorrection={"mode": "mis", "threshold": 5}).algorithm.rollout_correction.mode == "mis"


@pytest.mark.parametrize("threshold", [1.0, 0.5, 0])
def test_rollout_correction_threshold_must_exceed_one(threshold: float) -> None:
    with pytest.raises(pydantic.ValidationError, match="threshold"):
        _algo(rolloutCorrection={"mode": "tis", "threshold": threshold})
