"""Loading the Hugging Face causal LM a worker trains, and what its forward signature accepts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_causal_lm(
    path: str,
    *,
    device: torch.device,
    gradient_checkpointing: bool = False,
    config_overrides: dict[str, Any] | None = None,
) -> nn.Module:
    """fp32 master weights (bf16 compute comes from autocast / FSDP2 mixed precision).

    ``config_overrides`` replace config.json fields (``model.maxPositionEmbeddings``).
    """
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **(config_overrides or {}))
    model = model.to(device)
    if gradient_checkpointing and device.type != "cpu":
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM (``model.model.layers``)."""
    inner = getattr(_unwrap(model), "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def compile_decoder_layers(model: nn.Module) -> int:
    """torch.compile each decoder layer in place (regional compilation); returns how many.

    The layers share their code, so one compile of the forward and backward graphs (inductor
    fuses each norm, RoPE, SiLU-gate and residual chain into a few kernels) serves every layer;
    a micro-batch of a new width recompiles once with dynamic shapes, then reuses it. The LM head,
    the embedding and the loss stay eager (the loss has its own kernels).
    """
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose ``forward`` signature matters: through torch.compile / DDP wrappers."""
    for attr in ("_orig_mod", "module"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module):
            return _unwrap(inner)
    return model


_KEEPS_LOGITS: dict[type, bool] = {}


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether the (unwrapped) model's forward takes HF's ``logits_to_keep`` (cached per class)."""
    inner = _unwrap(model)
    cls = type(inner)
    if cls not in _KEEPS_LOGITS:
        import inspect

        try:
            params = inspect.signature(inner.forward).parameters
            _KEEPS_LOGITS[cls] = "logits_to_keep" in params
        except (TypeError, ValueError):
            _KEEPS_LOGITS[cls] = False
    return _KEEPS_LOGITS[cls]
