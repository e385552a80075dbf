"""The trainer side: full and delta (sharded) syncs as streams of bounded buckets."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlkube.runtime.weights.bucket import BucketBuilder, WeightBucket

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class LocalShard:
    """A rank's contiguous slice of a parameter: elements [flat_start, flat_start + numel) of the full one."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    flat_start: int = 0


@dataclass(frozen=True)
class SyncStats:
    """What one sync cost. `changed_ratio` = elements shipped / elements held by this sender."""

    kind: str  # "full" or "delta"
    version: int
    seconds: float
    payload_mb: float  # bytes shipped / 1e6, padding and positions included
    changed_ratio: float
    changed_elements: int
    elements: int
    buckets: int
    dense_params: int  # params shipped dense (first sync, or where a delta would be larger)


def local_shard(t: torch.Tensor) -> LocalShard:
    """Plain tensor -> itself; FSDP2 DTensor sharded on dim 0 -> its local rows and their offset."""
    if not hasattr(t, "to_local") or not hasattr(t, "placements"):
        return LocalShard(t, tuple(t.shape), 0)
    from torch.distributed.tensor import Replicate, Shard

    dt: Any = t  # a DTensor
    local = dt.to_local()
    gshape = tuple(t.shape)
    row = 1
    for s in gshape[1:]:
        row *= s
    start_row = 0
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank holds nothing of it
        return LocalShard(local.new_empty(0), gshape, 0)
    rows_left = gshape[0] if gshape else 1
    for mesh_dim, placement in enumerate(dt.placements):
        if isinstance(placement, Replicate):
            continue
        if not (isinstance(placement, Shard) and placement.dim == 0):
            raise NotImplementedError(f"only Shard(0)/Replicate placements supported, got {dt.placements}")
        size = mesh.size(mesh_dim)
        chunk = -(-rows_left // size)  # torch.chunk semantics, as DTensor uses
        start_row += min(chunk * coord[mesh_dim], rows_left)
        rows_left = max(0, min(chunk, rows_left - chunk * coord[mesh_dim]))
    return LocalShard(local, gshape, start_row * row)


def is_sending_replica(t: torch.Tensor) -> bool:
    """False on ranks that hold a replica another rank already sends (coordinate > 0 on a Replicate dim)."""
    if not hasattr(t, "placements"):
        return True
    from torch.distributed.tensor import Replicate

    dt: Any = t  # a DTensor
    coord = dt.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(coord[i] == 0 for i, p in enumerate(dt.placements) if isinstance(p, Replicate))


class WeightSender:
    """Turns the trainer's (sharded) parameters into buckets; remembers what the receiver got.

    `full()` ships everything dense. `delta()` diffs every shard bitwise against a snapshot of what
    was last shipped and ships only changed (position, value) pairs; a parameter without a
    snapshot (the first sync) or whose delta would be larger than itself goes dense. Both are
    lazy generators: buckets are built as the consumer pulls them (peak ~2 buckets), and
    `last_stats` is set when the stream is exhausted, so its `seconds` covers packing plus
    whatever the consumer did in between (transport, apply): the end-to-end sync time.

    If a receiver refuses a sync (WeightSyncError), call `reset()`: snapshots already advanced,
    so the next sync must be dense; receivers also refuse deltas against a base they lack.
    """

    def __init__(
        self,
        bucket_megabytes: float = 256.0,
        dtype: torch.dtype | None = None,
        snapshot_device: str = "cpu",
        pin_memory: bool | None = None,
        keep_snapshots: bool = True,
    ) -> None:
        """`dtype`: wire dtype (the receiver's), e.g. bf16 from fp32 master weights; None keeps each
        param's dtype. `snapshot_device`: "cpu" (pinned when CUDA is up) or "device" (next to the
        params: fastest diff, costs device memory). `keep_snapshots=False`: full syncs only, no
        snapshot memory."""
        if snapshot_device not in ("cpu", "device"):
            raise ValueError("snapshot_device must be 'cpu' or 'device'")
        self.bucket_bytes = int(bucket_megabytes * 2**20)
        self.dtype = dtype
        self.snapshot_device = snapshot_device
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.keep_snapshots = keep_snapshots
        self.version: int | None = None  # last version shipped
        self.last_stats: SyncStats | None = None
        self._snap: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """Forget snapshots and version: the next delta is dense."""
        self._snap.clear()
        self.version = None

    def snapshot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._snap.values())

    # -- public streams ----------------------------------------------------------------------
    def full(
        self, named_params: Iterable[tuple[str, torch.Tensor | LocalShard]], version: int
    ) -> Iterator[WeightBucket]:
        """Every parameter dense, in bounded buckets."""
        return self._stream(named_params, version, delta=False)

    def delta(
        self, named_params: Iterable[tuple[str, torch.Tensor | LocalShard]], version: int
    ) -> Iterator[WeightBucket]:
        """Only what changed since the last sync (dense where there is no snapshot yet)."""
        if not self.keep_snapshots:
            raise ValueError("delta syncs need keep_snapshots=True")
        return self._stream(named_params, version, delta=True)

    # -- internals ---------------------------------------------------------------------------
    def _stream(
        self, named_params: Iterable[tuple[str, torch.Tensor | LocalShard]], version: int, delta: bool
    ) -> Iterator[WeightBucket]:
        t0 = time.perf_counter()
        base = self.version if delta else None
        counters = {"elements": 0, "shipped": 0, "dense_params": 0}
        index = 0
        shipped_bytes = 0
        pending: WeightBucket | None = None
        device: torch.device | None = None
        for bucket in self._buckets(named_params, version, base, delta, counters):
            device = bucket.payload.device
            if pending is not None:
                shipped_bytes += pending.nbytes
                yield dataclasses.replace(pending, index=index, final=False)
                index += 1
            pending = bucket
        if pending is None:  # nothing to send: still one (empty) final bucket, so receivers advance
            pending = BucketBuilder(0, torch.device("cpu")).finish(version, base)
        shipped_bytes += pending.nbytes
        self.version = version
        yield dataclasses.replace(pending, index=index, final=True)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        elements = counters["elements"]
        self.last_stats = SyncStats(
            kind="delta" if delta else "full",
            version=version,
            seconds=time.perf_counter() - t0,
            payload_mb=shipped_bytes / 1e6,
            changed_ratio=counters["shipped"] / elements if elements else 0.0,
            changed_elements=counters["shipped"],
            elements=elements,
            buckets=index + 1,
            dense_params=counters["dense_params"],
        )

    def _buckets(
        self,
        named_params: Iterable[tuple[str, torch.Tensor | LocalShard]],
        version: int,
        base: int | None,
        delta: bool,
        counters: dict[str, int],
    ) -> Iterator[WeightBucket]:
        builder: BucketBuilder | None = None
        for name, item in named_params:
            shard = item if isinstance(item, LocalShard) else local_shard(item)
            flat = self._wire_flat(shard.tensor)
            n = flat.numel()
            counters["elements"] += n
            if n == 0:
                continue
            if builder is None or builder.device != flat.device:
                if builder is not None and builder.entries:
                    yield builder.finish(version, base)
                builder = BucketBuilder(self.bucket_bytes, flat.device)
            snap = self._snap.get(name) if delta else None
            if snap is not None and (snap.numel() != n or snap.dtype != flat.dtype):
                snap = None  # reshaped/resharded: ship dense
            positions = None
            if snap is not None:
                positions = self._changed(flat, snap, shard.flat_start, _index_dtype(shard.global_shape))
                if (
                    positions.numel() * (positions.element_size() + flat.element_size())
                    >= n * flat.element_size()
                ):
                    positions = None  # the delta would not be smaller than the tensor
                    counters["shipped"] += n
                else:
                    counters["shipped"] += positions.numel()
            else:
                counters["shipped"] += n
            if positions is None:
                counters["dense_params"] += 1
                yield from self._pack_dense(builder, name, shard, flat, version, base)
                if self.keep_snapshots:
                    self._remember(name, flat)
            elif positions.numel():
                local = positions.to(torch.int64)
                if shard.flat_start:
                    local -= shard.flat_start
                values = flat[local]
                yield from self._pack_delta(builder, name, shard, positions, values, version, base)
                assert snap is not None
                if snap.device == flat.device:  # scatter only what changed
                    snap.index_copy_(0, local, values)
                else:  # host snapshot of a device tensor: one async bulk copy beats a host scatter
                    snap.copy_(flat, non_blocking=True)
        if builder is not None and builder.entries:
            yield builder.finish(version, base)

    def _wire_flat(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if self.dtype is not None and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t.contiguous().view(-1)

    def _changed(
        self, flat: torch.Tensor, snap: torch.Tensor, flat_start: int, idx_dtype: torch.dtype
    ) -> torch.Tensor:
        """Global flat positions where `flat` differs bitwise from `snap`, computed on flat's device."""
        bits = _BITS[flat.element_size()]
        ref = snap if snap.device == flat.device else snap.to(flat.device, non_blocking=True)
        pos = torch.ne(flat.view(bits), ref.view(bits)).nonzero().view(-1)
        if flat_start:
            pos = pos + flat_start
        return pos.to(idx_dtype)

    def _remember(self, name: str, flat: torch.Tensor) -> None:
        """Set the snapshot to what was just shipped dense (allocating it on first use)."""
        snap = self._snap.get(name)
        if snap is None or snap.numel() != flat.numel() or snap.dtype != flat.dtype:
            if self.snapshot_device == "device":
                snap = torch.empty_like(flat)
            else:
                pin = self.pin_memory and flat.is_cuda
                snap = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=pin)
            self._snap[name] = snap
        snap.copy_(flat, non_blocking=True)

    def _pack_dense(
        self,
        builder: BucketBuilder,
        name: str,
        shard: LocalShard,
        flat: torch.Tensor,
        version: int,
        base: int | None,
    ) -> Iterator[WeightBucket]:
        done, n, isz = 0, flat.numel(), flat.element_size()
        while done < n:
            take = min(n - done, builder.room(isz))
            if take == 0:
                yield builder.finish(version, base)
                continue
            builder.add_dense(name, shard.global_shape, shard.flat_start + done, flat[done : done + take])
            done += take

    def _pack_delta(
        self,
        builder: BucketBuilder,
        name: str,
        shard: LocalShard,
        positions: torch.Tensor,
        values: torch.Tensor,
        version: int,
        base: int | None,
    ) -> Iterator[WeightBucket]:
        done, n = 0, positions.numel()
        per = positions.element_size() + values.element_size()
        while done < n:
            take = min(n - done, builder.room(per, slots=2))
            if take == 0:
                yield builder.finish(version, base)
                continue
            builder.add_delta(
                name, shard.global_shape, positions[done : done + take], values[done : done + take]
            )
            done += take


def _index_dtype(shape: tuple[int, ...]) -> torch.dtype:
    n = 1
    for s in shape:
        n *= s
    return torch.int32 if n < 2**31 else torch.int64
