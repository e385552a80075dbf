"""``get_reward_fn(name)``: the built-in rewards by name, or a user function as ``module:function``."""

from __future__ import annotations

from rlkube.runtime.rewards.base import RewardFn

REWARD_NAMES: tuple[str, ...] = ("gsm8k", "math", "dapo", "geo3k", "arith")


def get_reward_fn(name: str) -> RewardFn:
    """The built-in reward called ``name`` (see :data:`REWARD_NAMES`), or one imported from
    ``module:function``."""
    raise NotImplementedError(name)
