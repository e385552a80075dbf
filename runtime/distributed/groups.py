"""The trainer ranks' process group and the rendezvous every group of a job meets at.

The **trainer world** is torch.distributed's default group over the trainer ranks (FSDP2 shards,
gradient reduce-scatter, metric reductions): nccl on GPUs (RCCL answers to the name on ROCm), gloo
on the CPU. Rank 0 picks its node's address and a free port and the Ray driver hands them to every
rank (no fixed ports, nothing to configure). The weight groups (trainer rank + engine workers) are
stateless groups of their own: ``rlkube.runtime.weights.collective``.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlkube.runtime.weights.collective import DEFAULT_TIMEOUT_S


def node_address() -> str:
    """This node's address as other pods reach it (Ray's view when Ray is up, else the hostname's)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def free_port(host: str = "") -> int:
    """A TCP port free on this node right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Rendezvous:
    """Where a group meets: rank 0's address and a port it reserved, and the group's size."""

    host: str
    port: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @staticmethod
    def here(world_size: int, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> Rendezvous:
        """A rendezvous hosted by this process's node (call it on rank 0)."""
        return Rendezvous(node_address(), free_port(), world_size, backend, timeout_s)


def backend_for(device_type: str) -> str:
    """nccl on CUDA/ROCm devices (RCCL answers to the name), gloo on the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_trainer_world(rdv: Rendezvous, rank: int, device: torch.device | None = None) -> None:
    """Join the trainer ranks' default group (blocks until every rank has joined)."""
    if dist.is_initialized():
        raise RuntimeError("this process already has a default process group")
    kwargs: dict[str, Any] = {}
    if rdv.backend == "nccl" and device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(
        rdv.backend,
        init_method=rdv.init_method,
        rank=rank,
        world_size=rdv.world_size,
        timeout=datetime.timedelta(seconds=rdv.timeout_s),
        **kwargs,
    )


def leave_trainer_world() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def local_device(device: str | None = None) -> torch.device:
    """This rank's device: the one asked for, else its accelerator (Ray made it the only visible
    one, reconciled through the platform layer's visibility rules), else the CPU."""
    if device is not None:
        return torch.device(device)
    from rlkube.runtime.platform import current_platform

    platform = current_platform()
    platform.apply_visible_devices()
    if platform.device_name == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def where_am_i(**labels: Any) -> dict[str, Any]:
    """``labels`` plus this process's pid and, inside a Ray actor, its node and accelerator ids
    (what ``layout.json`` records and error messages name)."""
    info: dict[str, Any] = {**labels, "pid": os.getpid()}
    try:
        import ray

        ctx = ray.get_runtime_context()
        info["node_id"] = ctx.get_node_id()
        info["accelerators"] = {k: list(v) for k, v in ctx.get_accelerator_ids().items() if v}
    except Exception:  # outside Ray: pid only
        pass
    return info
