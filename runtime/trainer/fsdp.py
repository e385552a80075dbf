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


def shard_fsdp2(model: nn.Module, device: torch.device, bf16: bool) -> nn.Module:
    """FSDP2: shard every decoder layer, then the root, over the default process group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs: dict[str, Any] = {"mp_policy": mp} if mp is not None else {}
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is not None:
        for layer in layers:
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
