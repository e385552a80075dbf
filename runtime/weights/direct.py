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
_Fingerprint = tuple[tuple[object, ...], ...]


@dataclass(frozen=True)
class _Plan:
    """A validated copy as positions into (destination items, source items), one entry per group."""

    groups: list[tuple[list[int], list[int]]]
    nbytes: int
    tensors: int
    covers_all: bool


def _validate(
    dst_items: list[tuple[str, torch.Tensor]], src_items: list[tuple[str, torch.Tensor]], require_all: bool
) -> _Plan:
    index = {n: i for i, (n, _) in enumerate(dst_items)}
    groups: dict[tuple[torch.device, torch.dtype, torch.device, torch.dtype], tuple[list[int], list[int]]]
    groups = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    covered: set[str] = set()
    nbytes = 0
    for j, (name, s) in enumerate(src_items):
        i = index.get(name)
        if i is None:
            raise WeightSyncError(f"receiver has no parameter {name!r}")
        d = dst_items[i][1]
        if tuple(d.shape) != tuple(s.shape):
            raise WeightSyncError(f"{name}: receiver holds {tuple(d.shape)}, sender has {tuple(s.shape)}")
        if d.dtype != s.dtype and not (d.dtype.is_floating_point and s.dtype.is_floating_point):
            raise WeightSyncError(f"{name}: cannot copy {s.dtype} into {d.dtype}")
        covered.add(name)
        key_ptr = (d.data_ptr(), tuple(d.shape))
        if key_ptr in seen:  # tied weights listed under two names: written once
            continue
        seen.add(key_ptr)
        g = groups.setdefault((d.device, d.dtype, s.device, s.dtype), ([], []))
        g[0].append(i)
        g[1].append(j)
        nbytes += d.numel() * d.element_size()
    missing = sorted(n for n, _ in dst_items if n not in covered)
    if require_all and missing:
        raise WeightSyncError(f"full sync misses {len(missing)} parameters, e.g. {missing[:3]}")
    plan_groups = list(groups.values())
    return _Plan(plan_groups, nbytes, sum(len(di) for di, _ in plan_groups), not missing)


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
    dst_items = list(dst.items())
    src_items = [(n, t.detach()) for n, t in src]
    plan = _validate(dst_items, src_items, require_all)
    return [([dst_items[i][1] for i in di], [src_items[j][1] for j in sj]) for di, sj in plan.groups]


def _receiver_key(items: list[tuple[str, torch.Tensor]]) -> _Fingerprint:
    # What a plan depends on, receiver side: names (positions), shapes (validation), dtype and device
    # (grouping), and addresses (tied weights are found by address).
    return tuple((n, t.data_ptr(), t.shape, t.dtype, t.device) for n, t in items)


def _sender_key(items: list[tuple[str, torch.Tensor]]) -> _Fingerprint:
    # Sender side the address does not matter: the copy reads whatever tensors are passed this time.
    return tuple((n, t.shape, t.dtype, t.device) for n, t in items)


class DirectCopier:
    """:func:`copy_direct` that remembers the last validated plan.

    Re-syncing the same tensors into the same engine is the common case (a trainer's parameters
    and an engine's weights both stay where they are), and there validating and grouping cost more
    host time than a small model's copy takes on a GPU. The plan is reused while every name, shape,
    dtype and device on both sides, and every receiver address, is unchanged; anything else
    re-validates. It keeps positions, not tensors, so a sender whose tensors are new every sync
    (gathered shards) keeps no memory alive here.
    """

    def __init__(self) -> None:
        self._key: tuple[_Fingerprint, _Fingerprint] | None = None
        self._plan: _Plan | None = None
        self.replans = 0

    def __call__(
        self,
        dst: Mapping[str, torch.Tensor],
        src: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        require_all: bool = False,
    ) -> DirectCopyStats:
        """Copy ``src`` into ``dst`` in place (validated first); returns timing and bytes written."""
        t0 = time.perf_counter()
        dst_items = list(dst.items())
        src_items = list(src)  # read under no_grad below: no detach needed
        key = (_receiver_key(dst_items), _sender_key(src_items))
        plan = self._plan
        if plan is None or key != self._key or (require_all and not plan.covers_all):
            self._plan = self._key = None  # a failed validation leaves no stale plan behind
            plan = _validate(dst_items, src_items, require_all)
            self._plan, self._key = plan, key
            self.replans += 1
        devices: set[torch.device] = set()
        with torch.no_grad():
            for di, sj in plan.groups:
                dsts = [dst_items[i][1] for i in di]
                torch._foreach_copy_(dsts, [src_items[j][1] for j in sj], non_blocking=True)
                devices.add(dsts[0].device)
            for dev in devices:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
        return DirectCopyStats(
            version, time.perf_counter() - t0, plan.nbytes / 1e6, plan.tensors, len(plan.groups)
        )


def copy_direct(
    dst: Mapping[str, torch.Tensor],
    src: Iterable[tuple[str, torch.Tensor]],
    version: int,
    *,
    require_all: bool = False,
) -> DirectCopyStats:
    """Copy ``src`` into ``dst`` in place (validated first); returns timing and bytes written.

    One-shot: validates every call. Hold a :class:`DirectCopier` to reuse the plan across syncs.
    """
    return DirectCopier()(dst, src, version, require_all=require_all)
