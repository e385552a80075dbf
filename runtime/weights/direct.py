"""Full sync into an engine in the same process: one validated, grouped tensor copy, no buckets.

When trainer and rollout share a process (the colocated hf engine, a one-GPU job), packing
buckets, checksumming them and unpacking them is three extra passes over memory for a transport
that does not exist: nothing crosses a wire, so nothing can be corrupted in transit. Here every
name, shape and dtype is checked first (a mismatch raises with the engine untouched), then the
copies run as ``torch._foreach_copy_`` per (device, dtype) group: a handful of kernel launches
for the whole model instead of one per tensor. Cross-process syncs keep the checksummed buckets.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from rlkube.runtime.weights.bucket import WeightSyncError


@dataclass(frozen=True)
class DirectCopyStats:
    """What one direct copy did. ``payload_mb`` counts destination bytes written."""

    version: int
    seconds: float
    payload_mb: float
    tensors: int
    groups: int


CopyGroup = tuple[list[torch.Tensor], list[torch.Tensor]]


def plan_direct_copy(
    dst: Mapping[str, torch.Tensor],
    src: Iterable[tuple[str, torch.Tensor]],
    *,
    require_all: bool = False,
) -> list[CopyGroup]:
    """Validate ``src`` against ``dst`` and group the pairs for ``_foreach_copy_``.

    Raises WeightSyncError naming the first bad parameter. Floating dtypes may differ (fp32
    master weights into a bf16 engine cast on the fly); shapes must match exactly. A destination
    reached twice (tied embeddings listed under two names) is written once. ``require_all``
    also requires every destination to be covered.
    """
    groups: dict[tuple[torch.device, torch.dtype, torch.device, torch.dtype], CopyGroup] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    covered: set[str] = set()
    for name, s in src:
        d = dst.get(name)
        if d is None:
            raise WeightSyncError(f"receiver has no parameter {name!r}")
        if tuple(d.shape) != tuple(s.shape):
            raise WeightSyncError(f"{name}: receiver holds {tuple(d.shape)}, sender has {tuple(s.shape)}")
        if d.dtype != s.dtype and not (d.dtype.is_floating_point and s.dtype.is_floating_point):
            raise WeightSyncError(f"{name}: cannot copy {s.dtype} into {d.dtype}")
        covered.add(name)
        key_ptr = (d.data_ptr(), tuple(d.shape))
        if key_ptr in seen:
            continue
        seen.add(key_ptr)
        g = groups.setdefault((d.device, d.dtype, s.device, s.dtype), ([], []))
        g[0].append(d)
        g[1].append(s.detach())
    if require_all:
        missing = sorted(set(dst) - covered)
        if missing:
            raise WeightSyncError(f"full sync misses {len(missing)} parameters, e.g. {missing[:3]}")
    return list(groups.values())


def copy_direct(
    dst: Mapping[str, torch.Tensor],
    src: Iterable[tuple[str, torch.Tensor]],
    version: int,
    *,
    require_all: bool = False,
) -> DirectCopyStats:
    """Copy ``src`` into ``dst`` in place (validated first); returns timing and bytes written."""
    t0 = time.perf_counter()
    plan = plan_direct_copy(dst, src, require_all=require_all)
    nbytes = 0
    n = 0
    with torch.no_grad():
        for dsts, srcs in plan:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            nbytes += sum(t.numel() * t.element_size() for t in dsts)
            n += len(dsts)
        for dev in {t.device for dsts, _ in plan for t in dsts}:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
    return DirectCopyStats(version, time.perf_counter() - t0, nbytes / 1e6, n, len(plan))
