"""How much memory a rollout engine may take, from the spec, on every platform.

vLLM sizes its KV cache from ``gpu_memory_utilization`` (a fraction of the device's memory; on its
CPU backend, of the NUMA node's RAM, checked against what is free at start) unless
``kv_cache_memory_bytes`` is given. rlkube passes ``rollout.gpuMemoryUtilization`` and
``rollout.kvCacheMemory`` through on GPUs and CPUs alike, and checks a CPU plan against this
machine (and the pod's cgroup limit, which vLLM does not look at) before starting the engine, so a
plan that cannot fit fails with the field to change, not a vLLM stack trace. ``rlkube doctor
--rljob`` runs the same check.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkube.api import RLJobSpec

GiB = 1024**3
_SUFFIX = {
    "": 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
    "Ei": 1024**6,
}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def parse_bytes(quantity: str) -> int:
    """A Kubernetes quantity (``2Gi``, ``512Mi``, ``1.5G``) in bytes."""
    m = _QUANTITY.match(quantity.strip())
    if not m:
        raise ValueError(f"not a quantity: {quantity!r} (use e.g. 2Gi or 512Mi)")
    return int(float(m.group(1)) * _SUFFIX[m.group(2) or ""])


def vllm_memory_options(spec: RLJobSpec) -> dict[str, Any]:
    """vLLM engine arguments that size the engine (passed on every platform)."""
    opts: dict[str, Any] = {"gpu_memory_utilization": spec.rollout.gpu_memory_utilization}
    if spec.rollout.kv_cache_memory:
        opts["kv_cache_memory_bytes"] = parse_bytes(spec.rollout.kv_cache_memory)
    return opts


@dataclass(frozen=True)
class HostMemory:
    total: int  # bytes of RAM on this node
    available: int  # bytes free now (MemAvailable)
    limit: int | None  # the cgroup (pod) memory limit, None when unlimited


def host_memory(proc_meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup") -> HostMemory:
    """RAM of this node and the cgroup limit of this process (cgroup v2, then v1)."""
    info: dict[str, int] = {}
    for line in Path(proc_meminfo).read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            info[key] = int(parts[0]) * 1024
    limit = None
    for f in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            raw = Path(cgroup_root, f).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < info.get("MemTotal", 1 << 62):
            limit = int(raw)
        break
    return HostMemory(info.get("MemTotal", 0), info.get("MemAvailable", 0), limit)


def cpu_plan_problem(spec: RLJobSpec, mem: HostMemory | None = None) -> str | None:
    """Why vLLM on the CPU cannot start with this spec here (naming the field to change), or None."""
    return cpu_memory_problem(spec.rollout.gpu_memory_utilization, spec.rollout.kv_cache_memory, mem)


def cpu_memory_problem(util: float, kv_cache_memory: str | None, mem: HostMemory | None = None) -> str | None:
    """``cpu_plan_problem`` on the two rollout fields (``rlkube doctor`` checks the defaults too)."""
    mem = mem or host_memory()
    gib = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    env_kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if kv_cache_memory or env_kv:
        if env_kv:  # vLLM's legacy variable wins over the spec inside vLLM: check what it will use
            kv, field = int(env_kv) * GiB, "VLLM_CPU_KVCACHE_SPACE"
        else:
            kv, field = parse_bytes(str(kv_cache_memory)), "rollout.kvCacheMemory"
        room = mem.available if mem.limit is None else min(mem.available, mem.limit)
        if kv > room:
            return (
                f"{field} asks vLLM (CPU) for a {gib(kv)} KV cache but only {gib(room)} is free on this "
                f"node{'' if mem.limit is None else ' within the pod memory limit'}: lower {field}"
            )
        return None
    want = int(mem.total * util)
    if want > mem.available:
        return (
            f"rollout.gpuMemoryUtilization {util} makes vLLM (CPU) reserve {gib(want)} of this node's "
            f"{gib(mem.total)} RAM but only {gib(mem.available)} is free: lower it or set "
            "rollout.kvCacheMemory (e.g. 1Gi)"
        )
    if mem.limit is not None and want > mem.limit:
        return (
            f"rollout.gpuMemoryUtilization {util} makes vLLM (CPU) reserve {gib(want)} of the node's RAM, "
            f"more than the pod's memory limit {gib(mem.limit)}: set rollout.kvCacheMemory (e.g. 1Gi)"
        )
    return None
