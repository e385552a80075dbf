"""Moving buckets between processes over torch.distributed (NCCL/RCCL on GPUs, gloo on CPU).

Each bucket is a pickled header (broadcast_object_list) followed by one collective on its payload,
so the number of collectives is two per bucket regardless of how many parameters it packs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlkube.runtime.weights.bucket import BucketHeader, WeightBucket


def comm_device(group: Any = None) -> torch.device:
    """Where payloads must live for the group's backend: the current GPU for NCCL, else the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_buckets(
    buckets: Iterable[WeightBucket] | None,
    src: int = 0,
    group: Any = None,
    device: torch.device | None = None,
) -> Iterator[WeightBucket]:
    """On `src`, send `buckets`; elsewhere, receive them. Every rank yields each bucket in order.

    Receivers get payloads on `device` (default: the backend's device). Ranks must call this
    collectively; the stream ends with a `None` header.
    """
    rank = dist.get_rank()
    dev = device or comm_device(group)
    if rank == src:
        if buckets is None:
            raise ValueError("the source rank must pass its buckets")
        for b in buckets:
            dist.broadcast_object_list([b.header()], src=src, group=group, device=dev)
            payload = b.payload if b.payload.device == dev else b.payload.to(dev)
            if payload.numel():
                dist.broadcast(payload, src=src, group=group)
            yield b
        dist.broadcast_object_list([None], src=src, group=group, device=dev)
        return
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=src, group=group, device=dev)
        header = box[0]
        if header is None:
            return
        assert isinstance(header, BucketHeader)
        payload = torch.empty(header.payload_bytes, dtype=torch.uint8, device=dev)
        if payload.numel():
            dist.broadcast(payload, src=src, group=group)
        yield WeightBucket.from_header(header, payload)


def gather_buckets(
    buckets: Iterable[WeightBucket],
    dst: int = 0,
    group: Any = None,
    device: torch.device | None = None,
) -> list[WeightBucket]:
    """Collect every rank's buckets (e.g. each FSDP shard's delta) on `dst`, in rank order.

    Returns the full list on `dst` and [] elsewhere. Bucket indices are renumbered 0..n-1 over the
    gathered list and only the last is final, so `dst` can apply or re-broadcast it as one sync.
    """
    import dataclasses

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = device or comm_device(group)
    mine = list(buckets)
    headers: list[Any] = [None] * world if rank == dst else []
    dist.gather_object(
        [b.header() for b in mine], headers if rank == dst else None, dst=_global(dst, group), group=group
    )
    if rank != dst:
        for b in mine:
            if b.nbytes:
                payload = b.payload if b.payload.device == dev else b.payload.to(dev)
                dist.send(payload.contiguous(), dst=_global(dst, group), group=group)
        return []
    out: list[WeightBucket] = []
    for r in range(world):
        if r == dst:
            out.extend(mine)
            continue
        for h in headers[r]:
            payload = torch.empty(h.payload_bytes, dtype=torch.uint8, device=dev)
            if payload.numel():
                dist.recv(payload, src=_global(r, group), group=group)
            out.append(WeightBucket.from_header(h, payload))
    # Shards were numbered per rank; the gathered list is one sync.
    out = [b for b in out if b.entries] or out[-1:]
    return [dataclasses.replace(b, index=i, final=i == len(out) - 1) for i, b in enumerate(out)]


def _global(rank_in_group: int, group: Any) -> int:
    if group is None:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)
