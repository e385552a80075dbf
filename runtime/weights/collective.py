"""Weight sync across processes over weight groups.

A weight group is one trainer rank (rank 0 of the group, the source) plus every engine worker (the
pattern vLLM's and verl's NCCL weight transfer uses). Engine workers live in processes that already
own a default group (vLLM initialises one for its tensor parallelism), so weight groups are
*stateless*: a process group object built from a ``TCPStore`` (hosted by trainer rank 0) that never
touches torch.distributed's global state, used through its own methods (:class:`Collective`).
Per sync each source streams its buckets: a pickled header, then one broadcast of the payload per
bucket, then an end-of-stream marker. ``full`` has one source (trainer rank 0, which gathers the
FSDP2 shards bucket by bucket); ``delta_sharded`` has one source per trainer rank, each shipping
the changed (position, value) pairs of its own shard. Receivers verify every checksum.

Engines apply a *delta* atomically (all sources' buckets verified, then written); a *full* sync is
applied bucket by bucket as it arrives (each bucket verified before it is written), so a receiver
never holds a second copy of the model. A full sync that fails half-way leaves the engine torn:
the error names the bucket and the job fails rather than sample from mixed weights.
"""

from __future__ import annotations

import dataclasses
import datetime
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlkube.runtime.weights.bucket import BucketHeader, WeightBucket, WeightSyncError

DEFAULT_TIMEOUT_S = 300.0


class Collective:
    """A stateless process group (not torch.distributed's default) with broadcast and barrier.

    ``device`` is where payloads must live for the backend: the current GPU for nccl, the CPU for
    gloo. Objects are pickled into a uint8 tensor and broadcast as length + bytes (only between the
    job's own processes, never from outside).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        device: torch.device | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        source: int = 0,
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.source = source  # the trainer rank that sends on this group
        if backend == "nccl":
            self.device = device or torch.device("cuda", torch.cuda.current_device())
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        elif backend == "gloo":
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            raise ValueError(f"unknown collective backend {backend!r} (nccl or gloo)")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In place: ``tensor`` on ``src`` overwrites everyone else's (same shape and dtype)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` from ``src`` to every rank (returned everywhere)."""
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(size, src)
        n = int(size.item())
        buf = (
            data.to(self.device)
            if self.rank == src
            else torch.empty(n, dtype=torch.uint8, device=self.device)
        )
        self.broadcast(buf, src)
        if self.rank == src:
            return obj
        return pickle.loads(buf.cpu().numpy().tobytes())

    def barrier(self) -> None:
        t = torch.zeros(1, device=self.device)
        self.pg.allreduce([t]).wait()


@dataclass(frozen=True)
class WeightGroupSpec:
    """One weight group of a job: ``source`` is the trainer rank that sends on it (rank 0 in the
    group); engine workers take ranks 1.. in engine order (the driver hands each its first rank)."""

    host: str
    port: int
    source: int
    world_size: int  # 1 + every engine worker
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S


def weight_group_specs(
    host: str, port: int, sources: list[int], engine_workers: int, backend: str, timeout_s: float
) -> list[WeightGroupSpec]:
    """The weight groups of a job: one per sending trainer rank, all on one store."""
    return [WeightGroupSpec(host, port, s, 1 + engine_workers, backend, timeout_s) for s in sources]


def open_store(host: str, port: int, is_master: bool, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """The TCPStore the weight groups meet in (the master is trainer rank 0's process)."""
    return dist.TCPStore(
        host,
        port,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        use_libuv=True,
    )


def join_weight_group(
    store: Any, spec: WeightGroupSpec, rank: int, device: torch.device | None = None
) -> Collective:
    """Join ``spec``'s group as ``rank`` (0: its trainer rank, 1..: engine workers); blocks until
    every member has joined."""
    prefixed = dist.PrefixStore(f"rlkube/weights/{spec.source}", store)
    return Collective(prefixed, rank, spec.world_size, spec.backend, device, spec.timeout_s, spec.source)


class WeightGroupMember:
    """An engine worker's side of the job's weight groups: joins them once, then receives syncs."""

    def __init__(self) -> None:
        self.colls: list[Collective] = []
        self._store: Any = None

    @property
    def joined(self) -> bool:
        return bool(self.colls)

    def join(self, specs: list[WeightGroupSpec], rank: int, device: torch.device | None = None) -> None:
        """Join every group in ``specs`` (source order) as ``rank`` (>= 1)."""
        if not specs:
            raise ValueError("no weight groups to join")
        first = specs[0]
        self._store = open_store(first.host, first.port, is_master=False, timeout_s=first.timeout_s)
        self.colls = [join_weight_group(self._store, s, rank, device) for s in specs]

    def receive(self, kind: str, apply: Any, device: torch.device | None = None) -> set[str]:
        """One sync: a delta from every source, a full sync from trainer rank 0 (see :func:`receive_sync`)."""
        if not self.colls:
            raise RuntimeError("this engine has not joined the job's weight groups")
        colls = self.colls if kind == "delta" else [c for c in self.colls if c.source == 0]
        return receive_sync(colls, kind, apply, device)


def send_stream(coll: Any, buckets: Iterable[WeightBucket]) -> int:
    """Broadcast ``buckets`` from this process (rank 0 of ``coll``); returns the bytes sent."""
    sent = 0
    for b in buckets:
        coll.broadcast_object(b.header(), 0)
        if b.payload.numel():
            payload = b.payload if b.payload.device == coll.device else b.payload.to(coll.device)
            coll.broadcast(payload, 0)
            sent += b.nbytes
    coll.broadcast_object(None, 0)
    return sent


def receive_stream(coll: Any, device: torch.device | None = None) -> Iterator[WeightBucket]:
    """The buckets rank 0 of ``coll`` sends, in order, with payloads on ``device`` (default: the
    collective's own device)."""
    while True:
        header = coll.broadcast_object(None, 0)
        if header is None:
            return
        if not isinstance(header, BucketHeader):
            raise WeightSyncError(f"expected a bucket header, got {type(header).__name__}")
        payload = torch.empty(header.payload_bytes, dtype=torch.uint8, device=coll.device)
        if payload.numel():
            coll.broadcast(payload, 0)
        if device is not None and payload.device != device:
            payload = payload.to(device)
        yield WeightBucket.from_header(header, payload)


def as_one_sync(buckets: Sequence[WeightBucket]) -> list[WeightBucket]:
    """Several sources' streams renumbered 0..n-1 as one sync (only the last is final)."""
    out = [b for b in buckets if b.entries] or list(buckets[-1:])
    return [dataclasses.replace(b, index=i, final=i == len(out) - 1) for i, b in enumerate(out)]


def receive_sync(
    colls: Sequence[Any],
    kind: str,
    apply: Callable[[list[WeightBucket], bool], set[str]],
    device: torch.device | None = None,
) -> set[str]:
    """Receive one sync from every source in ``colls`` (in order) and apply it.

    ``apply(buckets, complete)`` writes verified buckets (``apply_buckets``'s contract). A delta
    (``kind == "delta"``) is gathered from all sources and applied once, atomically; a full sync
    is applied one bucket at a time (``complete=False``).
    """
    changed: set[str] = set()
    if kind == "delta":
        got: list[WeightBucket] = []
        for c in colls:
            got.extend(receive_stream(c, device))
        if got:
            changed |= apply(as_one_sync(got), True)
        return changed
    error: WeightSyncError | None = None
    for c in colls:
        for i, b in enumerate(receive_stream(c, device)):
            if error is not None:
                continue  # drain the stream: the sender must not block on a receiver that gave up
            try:
                changed |= apply([b], False)
            except WeightSyncError as e:
                error = WeightSyncError(f"full sync torn at bucket {i} of source {c.source}: {e}")
    if error is not None:
        raise error
    return changed
