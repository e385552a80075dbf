"""FSDP2 over the trainer's process group: who this rank is, and sharding a model across ranks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_fsdp2(model: nn.Module, device: torch.device, bf16: bool, replicate: int = 1) -> nn.Module:
    """FSDP2: shard every decoder layer, then the root, over the default process group.

    ``replicate > 1`` is HSDP: the world is a ``replicate x (world / replicate)`` mesh, parameters
    sharded within each row (one pod's ranks, contiguous) and replicated across rows, so the
    parameter all-gathers stay inside a pod and only the gradient all-reduce crosses pods.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs: dict[str, Any] = {"mp_policy": mp} if mp is not None else {}
    if replicate > 1:
        from torch.distributed.device_mesh import init_device_mesh

        _, size = world()
        if size % replicate:
            raise ValueError(f"HSDP: {size} ranks cannot form {replicate} equal replica groups")
        kwargs["mesh"] = init_device_mesh(
            device.type, (replicate, size // replicate), mesh_dim_names=("replicate", "shard")
        )
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is not None:
        for layer in layers:
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
