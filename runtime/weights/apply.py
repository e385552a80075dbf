"""The receiver side: verify everything, then write; never leave half-applied or wrong weights."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

import torch

from rlkube.runtime.weights.bucket import WeightBucket, WeightSyncError, verify_checksum


def verify_buckets(
    state: MutableMapping[str, torch.Tensor],
    buckets: Sequence[WeightBucket],
    complete: bool = True,
) -> None:
    """Every check `apply_buckets` makes, without writing. Raises WeightSyncError."""
    if not buckets:
        return
    versions = {b.version for b in buckets}
    bases = {b.base_version for b in buckets}
    if len(versions) != 1 or len(bases) != 1:
        raise WeightSyncError(f"buckets from different syncs mixed: versions {versions}, bases {bases}")
    if complete:
        idx = [b.index for b in buckets]
        if idx != list(range(len(buckets))) or not buckets[-1].final:
            raise WeightSyncError(
                f"incomplete sync of version {buckets[0].version}: got bucket indices {idx[:8]}"
                f"{'...' if len(idx) > 8 else ''}, final={buckets[-1].final}"
            )
    for b in buckets:
        verify_checksum(b)
        nbytes = b.nbytes
        for e in b.entries:
            if e.name not in state:
                raise WeightSyncError(f"bucket {b.index}: receiver has no parameter {e.name!r}")
            t = state[e.name]
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise WeightSyncError(
                    f"{e.name}: receiver holds {tuple(t.shape)} {t.dtype}, sync carries {e.shape} {e.dtype}"
                )
            if not t.is_contiguous():
                raise WeightSyncError(f"{e.name}: receiver tensor is not contiguous")
            if e.end_byte > nbytes or e.count < 0:
                raise WeightSyncError(f"{e.name}: entry runs past the payload of bucket {b.index}")
            if e.kind == "dense":
                if e.start < 0 or e.start + e.count > e.numel:
                    raise WeightSyncError(
                        f"{e.name}: dense range [{e.start}, {e.start + e.count}) out of bounds"
                    )
            elif e.count:
                pos = b.positions(e)
                lo, hi = torch.aminmax(pos)
                if int(lo) < 0 or int(hi) >= e.numel:
                    raise WeightSyncError(
                        f"{e.name}: positions [{int(lo)}, {int(hi)}] out of bounds {e.numel}"
                    )


def apply_buckets(
    state: MutableMapping[str, torch.Tensor],
    buckets: Sequence[WeightBucket],
    complete: bool = True,
) -> set[str]:
    """Write the buckets into `state` in place; return the names of the parameters written.

    Verifies EVERY checksum, name, shape, dtype and bound first and raises WeightSyncError with
    `state` untouched on any mismatch. `complete=True` also requires the whole sync (indices
    0..n-1, the last marked final); pass False to apply a stream bucket by bucket (then only
    each bucket is atomic). Version bookkeeping across syncs is `WeightReceiver`'s job.
    """
    verify_buckets(state, buckets, complete)
    changed: set[str] = set()
    with torch.no_grad():
        for b in buckets:
            for e in b.entries:
                flat = state[e.name].view(-1)
                values = b.values(e)
                if e.kind == "dense":
                    flat[e.start : e.start + e.count].copy_(values, non_blocking=True)
                elif e.count:
                    pos = b.positions(e).to(device=flat.device, dtype=torch.int64, non_blocking=True)
                    flat.index_copy_(0, pos, values.to(flat.device, non_blocking=True))
                changed.add(e.name)
    return changed


class WeightReceiver:
    """A receiver's weights plus the version they are at.

    Refuses a delta whose base is not the version held (a missed or refused sync), so deltas are
    never stacked on the wrong weights; the sender then has to `reset()` and send dense.
    """

    def __init__(self, state: MutableMapping[str, torch.Tensor], version: int | None = None) -> None:
        self.state = state
        self.version = version

    def apply(self, buckets: Sequence[WeightBucket]) -> set[str]:
        if not buckets:
            return set()
        b0 = buckets[0]
        if b0.base_version is not None and b0.base_version != self.version:
            raise WeightSyncError(
                f"delta to version {b0.version} is against version {b0.base_version}, "
                f"but this receiver holds {self.version}: the sender must reset() and sync dense"
            )
        changed = apply_buckets(self.state, buckets)
        self.version = b0.version
        return changed
