"""A deterministic, resumable prompt sampler."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from rlkube.runtime.data.records import Record


class PromptSampler:
    """Yields batches of records, epoch after epoch, each record exactly once per epoch.

    Epoch ``e``'s order is a permutation drawn from ``Random(f"{seed}:{e}")`` (identity without
    ``shuffle``), so the whole stream is a function of ``(seed, epoch, position)`` and
    :meth:`state_dict` / :meth:`load_state_dict` resume it exactly: no prompt repeated or skipped. A batch
    that runs past the end of an epoch continues with the next epoch's order.
    """

    def __init__(
        self, records: Sequence[Record], batch_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        if not records:
            raise ValueError("PromptSampler needs at least one record")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.records = list(records)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[Record]:
        """The next ``batch_size`` records."""
        out: list[Record] = []
        while len(out) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._order_for(self.epoch)
            take = min(self.batch_size - len(out), len(self._order) - self.position)
            out.extend(self.records[i] for i in self._order[self.position : self.position + take])
            self.position += take
        return out

    def __iter__(self) -> Iterator[list[Record]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands; JSON-serialisable."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_records": len(self.records),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; refuses one taken over a different dataset size."""
        if int(state["num_records"]) != len(self.records):
            raise ValueError(
                f"sampler state was saved over {state['num_records']} records, this dataset has "
                f"{len(self.records)}; resuming would repeat or skip prompts"
            )
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._order_for(self.epoch)
