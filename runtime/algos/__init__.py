"""Pure RL algorithm pieces (advantages, losses, KL, DAPO tricks, rollout correction) on ``[batch,
response_len]`` tensors.

Three registries, name -> function, one function per name the RLJob API accepts
(``rlkube.api.algorithms``): ``ESTIMATORS`` (``algorithm.advantageEstimator``), ``POLICY_LOSSES``
(``algorithm.policyLoss``) and ``AGG_MODES`` (``algorithm.lossAggregation``).
"""

from rlkube.runtime.algos.advantages import (
    ESTIMATORS,
    AdvantageFn,
    compute_advantages,
    discounted_returns,
    estimator_for_algorithm,
    gae,
    grpo_advantages,
    register_estimator,
    reinforce_pp_advantages,
    rloo_advantages,
    scores_to_token_rewards,
)
from rlkube.runtime.algos.core import (
    AGG_MODES,
    AggregationFn,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    register_aggregation,
)
from rlkube.runtime.algos.dapo import (
    DynamicSamplingBuffer,
    DynamicSamplingExhaustedError,
    dynamic_sampling_keep,
    overlong_penalty,
)
from rlkube.runtime.algos.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    kl_in_reward,
    kl_penalty,
    make_kl_controller,
)
from rlkube.runtime.algos.losses import (
    POLICY_LOSSES,
    PolicyLossFn,
    PolicyLossMetrics,
    ValueLossMetrics,
    cispo_policy_loss,
    entropy_from_logits,
    gspo_policy_loss,
    logprobs_from_logits,
    ppo_policy_loss,
    register_policy_loss,
    value_loss,
)
from rlkube.runtime.algos.rollout_correction import (
    ROLLOUT_CORRECTION_MODES,
    RolloutCorrection,
    rollout_correction,
)

__all__ = [
    "AGG_MODES",
    "ESTIMATORS",
    "KL_KINDS",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTION_MODES",
    "AdaptiveKLController",
    "AdvantageFn",
    "AggregationFn",
    "DynamicSamplingBuffer",
    "DynamicSamplingExhaustedError",
    "FixedKLController",
    "KLController",
    "PolicyLossFn",
    "PolicyLossMetrics",
    "RolloutCorrection",
    "ValueLossMetrics",
    "aggregate_loss",
    "cispo_policy_loss",
    "compute_advantages",
    "discounted_returns",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "estimator_for_algorithm",
    "gae",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_in_reward",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "ppo_policy_loss",
    "register_aggregation",
    "register_estimator",
    "register_policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "rollout_correction",
    "scores_to_token_rewards",
    "value_loss",
]
