"""A bounded replay buffer of complete prompt groups, each sample stamped with its policy version."""

from __future__ import annotations

from collections import deque

from rlkube.runtime.trainer.batch import Sample


def group_version(group: list[Sample]) -> int:
    """The version that started a group: its oldest sample's (staleness is counted from there)."""
    return min(s.policy_version for s in group)


class ReplayBuffer:
    """Groups (all samples of one prompt) waiting to be trained on, at most ``capacity`` of them.

    ``put`` never blocks: the rollouter checks ``len`` before issuing work, so the bound is enforced
    at admission (a group already generated is never thrown away for lack of room). ``take`` hands
    out the groups started by the oldest policy first (first come first within a version), so
    carried-over groups are trained before they can grow staler.
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
        """The ``n`` groups started by the oldest policies (FIFO among equals)."""
        if n > len(self._q):
            raise ValueError(f"buffer holds {len(self._q)} groups, asked for {n}")
        order = sorted(range(len(self._q)), key=lambda i: group_version(self._q[i]))
        chosen = set(order[:n])
        out = [self._q[i] for i in order[:n]]
        self._q = deque(g for i, g in enumerate(self._q) if i not in chosen)
        return out

    def count_at_least_stale(self, version: int, staleness: int) -> int:
        """Groups that are already ``staleness`` (or more) versions behind ``version``."""
        return sum(1 for g in self._q if version - group_version(g) >= staleness)

    def drop_stale(self, version: int, max_staleness: int) -> list[list[Sample]]:
        """Remove and return the groups whose oldest sample is more than ``max_staleness`` behind."""
        keep: deque[list[Sample]] = deque()
        dropped = []
        for g in self._q:
            if version - group_version(g) > max_staleness:
                dropped.append(g)
            else:
                keep.append(g)
        self._q = keep
        return dropped

    def groups(self) -> list[list[Sample]]:
        return [list(g) for g in self._q]
