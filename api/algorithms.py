"""Names of the RL building blocks an RLJob can pick, and what each `algorithm.name` implies.

The maths lives in `rlkube.runtime.algos`, whose registries (`ESTIMATORS`, `POLICY_LOSSES`,
`AGG_MODES`) hold one function per name listed here; a test checks that both sides agree, both ways.
The names live here, not there, because the API (and the CRD enums generated from these Literals)
must not import the runtime or torch. Adding an estimator, loss or aggregation: add its name here,
register its function there, `make crds`.
"""

from __future__ import annotations

from typing import Literal, get_args

AlgorithmName = Literal["grpo", "dapo", "ppo"]
AdvantageEstimatorName = Literal["gae", "grpo", "rloo", "reinforce_pp"]
PolicyLossName = Literal["vanilla", "gspo", "cispo"]
LossAggregationName = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
RolloutCorrectionMode = Literal["off", "tis", "mis"]

ALGORITHMS: tuple[str, ...] = get_args(AlgorithmName)
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimatorName)
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLossName)
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregationName)
ROLLOUT_CORRECTION_MODES: tuple[str, ...] = get_args(RolloutCorrectionMode)

# What `algorithm.name` means when `advantageEstimator` / `policyLoss` are left out.
DEFAULT_ESTIMATOR: dict[str, str] = {"grpo": "grpo", "dapo": "grpo", "ppo": "gae"}
DEFAULT_POLICY_LOSS: dict[str, str] = {"grpo": "vanilla", "dapo": "vanilla", "ppo": "vanilla"}
# `lossAggregation` left out: token-mean, except GSPO, whose objective is a mean over sequences of
# the per-token mean (GSPO eq. 5; verl forces it for gspo).
DEFAULT_LOSS_AGGREGATION = "token-mean"
POLICY_LOSS_AGGREGATION: dict[str, str] = {"gspo": "seq-mean-token-mean"}
# Estimators that compare responses of one prompt, so need algorithm.groupSize >= 2.
GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")
# The estimator that needs a critic (a value model is trained alongside the policy).
CRITIC_ESTIMATORS: tuple[str, ...] = ("gae",)


def estimator_for(name: str, advantage_estimator: str | None = None) -> str:
    """The advantage estimator in force: the explicit one, else the algorithm's default."""
    if advantage_estimator is not None:
        return advantage_estimator
    try:
        return DEFAULT_ESTIMATOR[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; expected one of {', '.join(sorted(DEFAULT_ESTIMATOR))}"
        ) from None


def policy_loss_for(name: str, policy_loss: str | None = None) -> str:
    """The policy loss in force: the explicit one, else the algorithm's default."""
    if policy_loss is not None:
        return policy_loss
    return DEFAULT_POLICY_LOSS.get(name.lower(), "vanilla")


def loss_aggregation_for(policy_loss: str, loss_aggregation: str | None = None) -> str:
    """The loss aggregation in force: the explicit one, else the policy loss's own default."""
    if loss_aggregation is not None:
        return loss_aggregation
    return POLICY_LOSS_AGGREGATION.get(policy_loss, DEFAULT_LOSS_AGGREGATION)
