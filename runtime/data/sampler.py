"""A deterministic, resumable prompt sampler."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlkube.runtime.data.records import Record


class PromptSampler:
    """Yields batches of records, epoch after epoch; resumable via ``state_dict``/``load_state_dict``."""

    def __init__(
        self, records: Sequence[Record], batch_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        self.records = list(records)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def next_batch(self) -> list[Record]:
        """The next ``batch_size`` records (a batch may span an epoch boundary)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError
