"""A bounded replay buffer of complete prompt groups, each sample stamped with its policy version."""

from __future__ import annotations

from collections import deque

from rlkube.runtime.trainer.batch import Sample


class ReplayBuffer:
    """FIFO of groups (all samples of one prompt), at most ``capacity`` groups.

    ``put`` never blocks: the rollouter checks ``len`` before issuing work, so the bound is enforced
    at admission (a group already generated is never thrown away for lack of room).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._q: deque[list[Sample]] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def num_groups(self) -> int:
        return len(self._q)

    def put(self, group: list[Sample]) -> None:
        if group:
            self._q.append(list(group))

    def take(self, n: int) -> list[list[Sample]]:
        """The ``n`` oldest groups."""
        if n > len(self._q):
            raise ValueError(f"buffer holds {len(self._q)} groups, asked for {n}")
        return [self._q.popleft() for _ in range(n)]

    def drop_stale(self, version: int, max_staleness: int) -> int:
        """Remove groups whose oldest sample is more than ``max_staleness`` versions behind; count samples."""
        keep: deque[list[Sample]] = deque()
        dropped = 0
        for g in self._q:
            if max(version - s.policy_version for s in g) > max_staleness:
                dropped += len(g)
            else:
                keep.append(g)
        self._q = keep
        return dropped

    def groups(self) -> list[list[Sample]]:
        return [list(g) for g in self._q]
