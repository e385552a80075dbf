"""``get_reward_fn(name)``: the built-in rewards by name, or a user function as ``module:function``."""

from __future__ import annotations

import importlib
import importlib.util
import numbers
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlkube.runtime.rewards.base import RewardFn, RewardResult, check_batch
from rlkube.runtime.rewards.math_reward import MathReward
from rlkube.runtime.rewards.tasks import arith_reward, dapo_reward, geo3k_reward, gsm8k_reward

REWARD_NAMES: tuple[str, ...] = ("gsm8k", "math", "dapo", "geo3k", "arith")


def _coerce(value: Any, spec: str, i: int) -> RewardResult:
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, bool | numbers.Real):
        return RewardResult(score=float(value), accuracy=float(value))
    if isinstance(value, Mapping) and "score" in value:
        acc = value.get("accuracy", value.get("acc", value["score"]))
        extra = {k: v for k, v in value.items() if k not in ("score", "accuracy", "acc")}
        return RewardResult(score=float(value["score"]), accuracy=acc, extra=extra)
    raise TypeError(
        f"reward function {spec!r} returned {type(value).__name__} for item {i}; "
        "expected a RewardResult, a number, or a dict with 'score'"
    )


class CustomReward:
    """A user's batched function ``fn(prompts, responses, ground_truths) -> list[...]``.

    Items may be :class:`RewardResult`, numbers/bools (score = accuracy), or dicts with ``score`` (and
    optionally ``accuracy``/``acc``; other keys go to ``extra``).
    """

    def __init__(self, spec: str, fn: Callable[..., Any]) -> None:
        self.spec = spec
        self.fn = fn

    def __call__(
        self, prompts: list[str], responses: list[str], ground_truths: list[str]
    ) -> list[RewardResult]:
        check_batch(prompts, responses, ground_truths)
        raw = list(self.fn(prompts, responses, ground_truths))
        if len(raw) != len(responses):
            raise ValueError(
                f"reward function {self.spec!r} returned {len(raw)} results for {len(responses)} items"
            )
        return [_coerce(v, self.spec, i) for i, v in enumerate(raw)]


def _import_custom(spec: str) -> CustomReward:
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"custom reward {spec!r} must be 'module:function' or 'path/to/file.py:function'")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ImportError(f"custom reward {spec!r}: file {path} not found")
        mod_spec = importlib.util.spec_from_file_location(f"rlkube_custom_reward_{path.stem}", path)
        if mod_spec is None or mod_spec.loader is None:
            raise ImportError(f"custom reward {spec!r}: cannot load {path}")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ImportError(f"custom reward {spec!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise AttributeError(f"custom reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise TypeError(f"custom reward {spec!r}: {attr!r} is not callable")
    return CustomReward(spec, fn)


def get_reward_fn(name: str, **options: Any) -> RewardFn:
    """The built-in reward called ``name`` (see :data:`REWARD_NAMES`), or one imported from
    ``module:function`` / ``file.py:function``. ``options`` go to :class:`MathReward` for ``math``
    (``workers``, ``timeout_s``, ``use_math_verify``)."""
    simple: dict[str, RewardFn] = {
        "gsm8k": gsm8k_reward,
        "dapo": dapo_reward,
        "geo3k": geo3k_reward,
        "arith": arith_reward,
    }
    if name == "math":
        return MathReward(**options)
    if options:
        raise TypeError(f"reward {name!r} takes no options, got {sorted(options)}")
    if name in simple:
        return simple[name]
    if ":" in name:
        return _import_custom(name)
    raise ValueError(
        f"unknown reward {name!r}; expected one of {', '.join(REWARD_NAMES)} or 'module:function'"
    )
