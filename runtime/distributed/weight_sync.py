"""Pushing a new weights version from the trainer ranks to the rollout engines, by the best transport.

- ``direct``: engines in the trainer's own process with ``capabilities.direct_weights`` and a full
  sync: tensors copied straight in (no buckets).
- ``collective``: engines that joined the job's weight groups (``EnginePool.collective``): rank 0
  streams the full tensors, or every rank the delta of its own shard, over the collective backend
  (gloo on the CPU, nccl/RCCL on GPUs); every engine worker receives at once.
- (``ipc``, colocated engines taking each bucket by CUDA IPC handle from the rank on their GPU, is
  not chosen yet: the primitive is ``rlkube.runtime.weights.ipc``, measured on an H200.)
- ``object_store``: anything else (an engine without the weight-group protocol): checksummed buckets
  handed to each engine through Ray's object store.

Every sync's metrics say which one ran (``weight_sync/transport``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

TRANSPORTS = ("direct", "collective", "object_store")


def choose_transport(trainer: Any, engines: Sequence[Any]) -> str:
    """The transport this trainer and these engines use (see the module docstring)."""
    method = trainer.spec.weight_sync.method
    caps = [getattr(e, "capabilities", None) for e in engines]
    if (
        method == "full"
        and trainer.world_size == 1
        and all(getattr(c, "direct_weights", False) for c in caps)
    ):
        return "direct"
    if engines and all(getattr(e, "collective_ready", False) for e in engines):
        return "collective"
    return "object_store"


def push_weights(trainer: Any, engines: Sequence[Any], version: int) -> dict[str, Any]:
    """Ship ``version`` of the trainer's weights to every engine; returns the sync's metrics."""
    t0 = time.perf_counter()
    transport = choose_transport(trainer, engines)
    method = trainer.spec.weight_sync.method
    if transport == "direct":
        params = list(trainer.actor.full_named_parameters())
        for e in engines:
            e.load_weights(params, version)
        m = trainer.direct_sync_stats([getattr(e, "last_load_stats", None) for e in engines])
    elif transport == "collective":
        m = _push_over_groups(trainer, engines, version, method)
    else:
        buckets = trainer.weight_buckets(version)
        for e in engines:
            e.update_weights(buckets, version)
        m = trainer.sync_stats()
    dt = time.perf_counter() - t0
    if dt > 0 and "weight_sync/payload_mb" in m:
        m["weight_sync/mb_per_s"] = m["weight_sync/payload_mb"] * len(engines) / dt
    out: dict[str, Any] = dict(m)
    out["weight_sync/transport"] = transport
    return out


def _push_over_groups(trainer: Any, engines: Sequence[Any], version: int, method: str) -> dict[str, float]:
    """Engines start receiving, every trainer rank sends its part, then everyone is waited for."""
    kind = "delta" if method == "delta_sharded" else "full"
    pending = [e.start_receive(version, kind) for e in engines]
    learners = trainer.learners
    peers = learners.start_peers("send_weights", version, method)
    stats = [learners.local.send_weights(version, method), *learners.wait(peers)]
    for e, p in zip(engines, pending, strict=True):
        e.finish_receive(p)
    return combine_stats(stats)


def combine_stats(stats: Sequence[dict[str, float]]) -> dict[str, float]:
    """Every sending rank's sender statistics as one sync's metrics."""
    done = [s for s in stats if s]
    if not done:
        return {}
    elements = sum(s["elements"] for s in done)
    return {
        "weight_sync/payload_mb": sum(s["payload_mb"] for s in done),
        "weight_sync/changed_ratio": sum(s["changed_elements"] for s in done) / elements if elements else 0.0,
        "weight_sync/buckets": sum(s["buckets"] for s in done),
        "weight_sync/sources": float(len(done)),
    }
