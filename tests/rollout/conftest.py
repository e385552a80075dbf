"""Shared fixtures: one tiny Qwen2 (head_dim 64, so vLLM's CPU kernel accepts it) per session."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlkube.runtime.models.tiny import make_tiny_qwen2

VOCAB = "0123456789+-*= \n"

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), vocab=VOCAB, seed=0)


@pytest.fixture(scope="session")
def perturbed_state(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    """A second set of weights for the same architecture: every tensor moved by a seeded offset."""
    from safetensors.torch import load_file

    state = load_file(tiny_model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(123)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def hf_model(path: Path, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """The trainer's view of the model: plain transformers, fp32, optionally with other weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model.generate(  # type: ignore[operator]
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def abort_midway(
    engine: Any, requests: list[Any], max_tokens: int, expected: int, wait_s: float
) -> list[Any]:
    """Submit, wait, abort, until every sample was caught in flight and at least one mid-sample.

    Machines here are noisy: a wait can be too short (no tokens yet) or too long (some samples
    already finished). Finished samples are drained from ``poll`` so they never leak into a later
    assertion, and the wait adapts in both directions.
    """
    for _ in range(30):
        engine.submit(requests)
        time.sleep(wait_s)
        partials = engine.abort_all()
        finished = engine.poll()
        if finished:  # too slow a wait: some samples completed before the abort
            wait_s /= 2
            continue
        if len(partials) == expected and any(0 < len(p.token_ids) < max_tokens for p in partials):
            return partials
        wait_s *= 1.5  # nothing generated yet
    raise AssertionError(f"never caught {expected} samples in flight mid-generation")
