"""The reward-function interface: batched, string in, :class:`RewardResult` out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class RewardResult:
    """One response's reward.

    ``score`` is what the advantage estimator sees; ``accuracy`` is the task metric to report (1/0 or a
    bool: did the answer match), separate because shaping (format bonus, -1 for wrong) changes the score
    but not correctness; ``extra`` holds diagnostics such as the extracted answer.
    """

    score: float
    accuracy: float | bool
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RewardFn(Protocol):
    """Scores a batch: ``fn(prompts, responses, ground_truths) -> list[RewardResult]`` (same length)."""

    def __call__(
        self, prompts: list[str], responses: list[str], ground_truths: list[str]
    ) -> list[RewardResult]: ...


def check_batch(prompts: list[str], responses: list[str], ground_truths: list[str]) -> None:
    """Reject ragged batches early with the three lengths in the message."""
    if not (len(prompts) == len(responses) == len(ground_truths)):
        raise ValueError(
            f"reward batch is ragged: {len(prompts)} prompts, {len(responses)} responses, "
            f"{len(ground_truths)} ground truths"
        )
