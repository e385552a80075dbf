"""The wire format of weight sync: bounded buckets of dense ranges or (position, value) pairs.

A bucket is ONE contiguous uint8 payload plus a small header, so any transport moves it with a
single copy or collective (pinned host buffer, D2D copy, NCCL/RCCL/gloo broadcast), and one
checksum covers everything the receiver will write.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["dense", "delta"]

# Entries start on this byte boundary so typed views into the payload are aligned.
ALIGN_BYTES = 64
# Payloads are padded to a whole number of checksum rows (CHECKSUM_ROW_WORDS int64 words).
CHECKSUM_ROW_WORDS = 512
PAD_BYTES = CHECKSUM_ROW_WORDS * 8
CHECKSUM_ALGO = "sum64"


class WeightSyncError(RuntimeError):
    """A sync that must not be applied: corrupt payload, wrong shapes, missing buckets, stale base."""


@dataclass(frozen=True)
class BucketEntry:
    """One parameter's share of a bucket, located by byte offsets into the payload.

    dense: `count` elements of the flattened parameter starting at flat element `start`.
    delta: `count` (position, value) pairs; positions are flat indices into the full parameter.
    """

    name: str
    shape: tuple[int, ...]  # full (unsharded) parameter shape
    dtype: torch.dtype  # value dtype on the wire, equal to the receiver's
    kind: Kind
    count: int
    values_offset: int  # byte offset of the values in the payload
    start: int = 0  # dense only
    positions_offset: int = 0  # delta only
    index_dtype: torch.dtype | None = None  # delta only: int32 when the parameter has < 2**31 elements

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def end_byte(self) -> int:
        """One past the last payload byte this entry uses."""
        v = self.values_offset + self.count * _itemsize(self.dtype)
        if self.kind == "delta":
            assert self.index_dtype is not None
            v = max(v, self.positions_offset + self.count * _itemsize(self.index_dtype))
        return v


@dataclass(frozen=True)
class BucketHeader:
    """Everything of a bucket but its payload: what a transport sends ahead of the bytes."""

    version: int
    kind: Kind
    entries: tuple[BucketEntry, ...]
    checksum: str
    payload_bytes: int
    index: int = 0
    final: bool = True
    base_version: int | None = None


@dataclass(frozen=True)
class WeightBucket:
    """One bounded transfer unit.

    `version` is the policy version after applying; `base_version` (delta syncs) is the version the
    receiver must already hold, so a lost or refused sync can never be silently built upon.
    `index`/`final` let a receiver check it got the whole sync before applying any of it.
    """

    version: int
    kind: Kind
    entries: tuple[BucketEntry, ...]
    payload: torch.Tensor  # 1-D uint8, length a multiple of PAD_BYTES
    checksum: str
    index: int = 0
    final: bool = True
    base_version: int | None = None

    @property
    def nbytes(self) -> int:
        return int(self.payload.numel())

    def values(self, entry: BucketEntry) -> torch.Tensor:
        """Typed view of an entry's values (no copy)."""
        n = entry.count * _itemsize(entry.dtype)
        return self.payload[entry.values_offset : entry.values_offset + n].view(entry.dtype)

    def positions(self, entry: BucketEntry) -> torch.Tensor:
        """Typed view of a delta entry's flat positions (no copy)."""
        if entry.kind != "delta" or entry.index_dtype is None:
            raise ValueError(f"{entry.name}: a dense entry has no positions")
        n = entry.count * _itemsize(entry.index_dtype)
        return self.payload[entry.positions_offset : entry.positions_offset + n].view(entry.index_dtype)

    def header(self) -> BucketHeader:
        return BucketHeader(
            self.version,
            self.kind,
            self.entries,
            self.checksum,
            self.nbytes,
            self.index,
            self.final,
            self.base_version,
        )

    @classmethod
    def from_header(cls, header: BucketHeader, payload: torch.Tensor) -> WeightBucket:
        return cls(
            header.version,
            header.kind,
            header.entries,
            payload,
            header.checksum,
            header.index,
            header.final,
            header.base_version,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False, pin: bool = False) -> WeightBucket:
        """The same bucket with its payload on `device` (pinned host memory when `pin`)."""
        if pin and torch.device(device).type == "cpu":
            dst = torch.empty(self.payload.numel(), dtype=torch.uint8, pin_memory=True)
            dst.copy_(self.payload, non_blocking=non_blocking)
            return dataclasses.replace(self, payload=dst)
        return dataclasses.replace(self, payload=self.payload.to(device, non_blocking=non_blocking))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def payload_checksum(payload: torch.Tensor) -> str:
    """Position-weighted 64-bit sums over the payload, computed where the payload lives.

    Any single corrupted word changes the plain sum (the difference is non-zero mod 2**64) and
    swapped or shifted rows change the weighted one. It runs as two reductions on the GPU (no
    host copy of dense data) and at memory speed on the CPU; integer arithmetic wraps identically
    on every device, so sender and receiver agree wherever each computes it. Not cryptographic:
    it guards against transport and staging bugs, not adversaries.
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() % PAD_BYTES:
        raise ValueError("payload must be 1-D uint8 padded to PAD_BYTES")
    n = payload.numel()
    if n == 0:
        return f"{CHECKSUM_ALGO}:0:0:0"
    rows = payload.view(torch.int64).view(-1, CHECKSUM_ROW_WORDS).sum(dim=1)
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=payload.device) * 2 + 1
    s1, s2 = torch.stack([rows.sum(), (rows * weights).sum()]).tolist()
    mask = (1 << 64) - 1
    return f"{CHECKSUM_ALGO}:{n}:{s1 & mask:016x}:{s2 & mask:016x}"


def verify_checksum(bucket: WeightBucket) -> None:
    """Raise WeightSyncError unless the payload matches the bucket's checksum."""
    if not bucket.checksum.startswith(CHECKSUM_ALGO + ":"):
        raise WeightSyncError(f"bucket {bucket.index}: unknown checksum algorithm in {bucket.checksum!r}")
    got = payload_checksum(bucket.payload) if bucket.payload.numel() % PAD_BYTES == 0 else "bad-length"
    if got != bucket.checksum:
        raise WeightSyncError(
            f"bucket {bucket.index} of version {bucket.version}: checksum mismatch "
            f"(expected {bucket.checksum}, payload gives {got}); nothing was applied"
        )


class BucketBuilder:
    """Packs entries into one bounded payload allocated on `device`."""

    def __init__(self, capacity_bytes: int, device: torch.device) -> None:
        self.capacity = max(PAD_BYTES, capacity_bytes - capacity_bytes % PAD_BYTES)
        self.device = device
        self._payload: torch.Tensor | None = None  # allocated on first use, fresh after each finish()
        self.cursor = 0
        self.entries: list[BucketEntry] = []

    @property
    def payload(self) -> torch.Tensor:
        if self._payload is None:
            self._payload = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        return self._payload

    def _aligned(self) -> int:
        return -(-self.cursor // ALIGN_BYTES) * ALIGN_BYTES

    def room(self, per_element_bytes: int, slots: int = 1) -> int:
        """How many elements of `per_element_bytes` still fit (with `slots` aligned arrays)."""
        free = self.capacity - self._aligned() - ALIGN_BYTES * slots
        return max(0, free // per_element_bytes)

    def _place(self, src: torch.Tensor) -> int:
        start = self._aligned()
        if start > self.cursor:
            self.payload[self.cursor : start].zero_()
        nbytes = src.numel() * src.element_size()
        self.payload[start : start + nbytes].view(src.dtype).copy_(src, non_blocking=True)
        self.cursor = start + nbytes
        return start

    def add_dense(self, name: str, shape: tuple[int, ...], start: int, values: torch.Tensor) -> None:
        off = self._place(values)
        self.entries.append(BucketEntry(name, shape, values.dtype, "dense", values.numel(), off, start=start))

    def add_delta(
        self, name: str, shape: tuple[int, ...], positions: torch.Tensor, values: torch.Tensor
    ) -> None:
        poff = self._place(positions)
        voff = self._place(values)
        self.entries.append(
            BucketEntry(
                name,
                shape,
                values.dtype,
                "delta",
                values.numel(),
                voff,
                positions_offset=poff,
                index_dtype=positions.dtype,
            )
        )

    def finish(self, version: int, base_version: int | None) -> WeightBucket:
        """Seal the bucket (zero the padding, checksum it) and start an empty one."""
        end = -(-self.cursor // PAD_BYTES) * PAD_BYTES
        if end == 0:
            payload = torch.empty(0, dtype=torch.uint8, device=self.device)
        else:
            if end > self.cursor:
                self.payload[self.cursor : end].zero_()
            payload = self.payload[:end]
            if end <= self.capacity // 2:  # do not hold a mostly empty buffer for the bucket's lifetime
                payload = payload.clone()
        kind: Kind = "dense" if all(e.kind == "dense" for e in self.entries) else "delta"
        bucket = WeightBucket(
            version,
            kind,
            tuple(self.entries),
            payload,
            payload_checksum(payload),
            base_version=base_version,
        )
        self._payload, self.cursor, self.entries = None, 0, []
        return bucket
