"""Rank 0's handle on every trainer rank, and how a batch is split over them.

FSDP2 is SPMD: every rank must run the same forward/backward passes in the same order. Rank 0
owns the algorithm (prompts, rewards, advantages, versions) and calls each step's model work on
all ranks at once: its own :class:`~rlkube.runtime.trainer.learner.Learner` in-process, the others
through their Ray actors (:class:`TrainerRank`). A rank that dies surfaces as :class:`RankFailed`
naming it, never as a hang: Ray reports a dead actor to whoever waits on it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

# What rank 0 may call on a peer's Learner (the SPMD steps, weights, checkpoints).
LEARNER_CALLS = frozenset(
    {
        "prepare",
        "update",
        "save_shards",
        "load_shards",
        "send_weights",
        "iterate_full_parameters",
        "delta_buckets",
        "join_weight_groups",
    }
)


class RankFailed(RuntimeError):
    """A trainer rank died or raised; the message names it."""


class SplitError(ValueError):
    """A batch that cannot be split over the ranks (no mini-batch to split)."""


PAD = -1  # a padding row in a rank's plan: a copy of a real row with no response tokens


def split_rows(group_rows: Sequence[Sequence[int]], num_mini: int, world_size: int) -> list[list[int]]:
    """Row indices per rank for a batch of groups already in training order.

    Mini-batch ``m`` is groups ``[m * n / num_mini, (m + 1) * n / num_mini)``; each rank takes
    whole groups of every mini-batch, so the union of the ranks' ``m``-th slices is exactly
    mini-batch ``m``. With equal groups that divide evenly, rank ``k`` takes the ``k``-th equal
    slice (one rank: every row in order). A batch that does not divide (groups shortened by
    ``data.nonFiniteReward: skip``, or fewer groups than planned) is balanced group by group onto
    the rank with the fewest rows, and every slice is padded with :data:`PAD` rows to one width:
    FSDP2 needs the same passes on every rank, a worker cuts mini-batches by row count, and a
    padding row (no response tokens, no sequence) changes no loss or gradient. So one rank and N
    ranks make the same mini-batches of whole groups, even or not.
    """
    n = len(group_rows)
    if num_mini < 1 or n < 1:
        raise SplitError(f"{n} prompt groups in {num_mini} mini-batch(es): nothing to split over ranks")
    even = len({len(r) for r in group_rows}) == 1 and n % num_mini == 0 and (n // num_mini) % world_size == 0
    out: list[list[int]] = [[] for _ in range(world_size)]
    if even:
        per_mini, per_rank = n // num_mini, n // num_mini // world_size
        for m in range(num_mini):
            for k in range(world_size):
                start = m * per_mini + k * per_rank
                for g in group_rows[start : start + per_rank]:
                    out[k].extend(g)
        return out
    slices: list[list[list[int]]] = []  # [mini][rank] -> rows
    for m in range(num_mini):
        share: list[list[int]] = [[] for _ in range(world_size)]
        for g in group_rows[m * n // num_mini : (m + 1) * n // num_mini]:
            k = min(range(world_size), key=lambda r: (len(share[r]), r))
            share[k].extend(g)
        slices.append(share)
    width = max(len(rows) for share in slices for rows in share)
    for share in slices:
        for k, rows in enumerate(share):
            out[k].extend([*rows, *[PAD] * (width - len(rows))])
    return out


class LearnerGroup:
    """Every rank's Learner as one: ``local`` (rank 0, this process) and ``peers`` (rank actors)."""

    def __init__(self, local: Any, peers: Sequence[Any] = ()) -> None:
        self.local = local
        self.peers = list(peers)

    @property
    def world_size(self) -> int:
        return 1 + len(self.peers)

    def call(self, method: str, per_rank: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """``method`` on every rank at once with its own arguments; results in rank order."""
        if len(per_rank) != self.world_size:
            raise ValueError(f"{len(per_rank)} argument sets for {self.world_size} ranks")
        refs = [p.call.remote(method, *a, **kw) for p, (a, kw) in zip(self.peers, per_rank[1:], strict=True)]
        args, kwargs = per_rank[0]
        mine = getattr(self.local, method)(*args, **kwargs)
        return [mine, *self._wait(refs)]

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` with the same arguments on every rank."""
        return self.call(method, [(args, kwargs)] * self.world_size)

    def start_peers(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Start ``method`` on every peer without waiting (pair with :meth:`wait`)."""
        return [p.call.remote(method, *args, **kwargs) for p in self.peers]

    def wait(self, refs: Sequence[Any]) -> list[Any]:
        return self._wait(refs)

    def _wait(self, refs: Sequence[Any]) -> list[Any]:
        """Results of peer calls: Ray refs, or futures (``.result()``) from another transport."""
        out = []
        for k, ref in enumerate(refs, start=1):
            if hasattr(ref, "result"):
                try:
                    out.append(ref.result())
                except Exception as e:
                    raise RankFailed(f"trainer rank {k} failed: {_cause(e)}") from e
                continue
            import ray

            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as e:
                raise RankFailed(f"trainer rank {k} died: {_cause(e)}") from e
            except ray.exceptions.RayTaskError as e:
                raise RankFailed(f"trainer rank {k} failed: {_cause(e)}") from e
        return out


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


class TrainerRank:
    """A trainer rank in its own Ray actor: joins the trainer world, holds a Learner, and (rank 0)
    runs the job. Plain class: ``ray.remote`` wraps it in the runtime, tests may use it directly."""

    def __init__(
        self, rank: int, world_size: int, device: str | None = None, freeze_heap: bool = False
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = device
        self.learner: Any = None
        # freeze the process's warm heap after the first update (``rlkube.runtime.heap``): the
        # rank's own process (a Ray actor) asks for it, a rank built inside another process not
        self._freeze_heap_pending = freeze_heap

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> dict[str, Any]:
        """Node, pid and accelerator ids of this rank (for placement checks and error messages)."""
        from rlkube.runtime.distributed.groups import where_am_i

        return where_am_i(rank=self.rank)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: this node's address and a free port for the trainer world."""
        from rlkube.runtime.distributed.groups import free_port, node_address

        return node_address(), free_port()

    def join(self, host: str, port: int, backend: str, timeout_s: float) -> None:
        """Join the trainer world (every rank at once)."""
        from rlkube.runtime.distributed.groups import Rendezvous, init_trainer_world, local_device

        dev = local_device(self.device)
        if self.world_size > 1:
            init_trainer_world(Rendezvous(host, port, self.world_size, backend, timeout_s), self.rank, dev)
        self.device = str(dev)

    def build(self, spec: Any) -> None:
        """Load this rank's models (after :meth:`join`: FSDP2 shards over the world)."""
        from rlkube.runtime.trainer.learner import Learner

        self.learner = Learner(spec, device=self.device)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method not in LEARNER_CALLS:
            raise AttributeError(f"{method!r} is not a learner call")
        out = getattr(self.learner, method)(*args, **kwargs)
        if method == "update" and self._freeze_heap_pending:
            from rlkube.runtime.heap import freeze_warm_heap

            self._freeze_heap_pending = False
            freeze_warm_heap()  # for the process's life: it ends with the actor
        return out
