"""Verifiable rewards (gsm8k, math, dapo, geo3k, arith, custom ``module:function``)."""

from rlkube.runtime.rewards.base import RewardFn, RewardResult
from rlkube.runtime.rewards.registry import REWARD_NAMES, get_reward_fn

__all__ = ["REWARD_NAMES", "RewardFn", "RewardResult", "get_reward_fn"]
