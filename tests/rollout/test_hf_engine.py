"""The hf engine on the CPU in fp32: exact against plain transformers, async paths for real."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from rlkube.runtime.rollout import RolloutRequest, SamplingParams, UnsupportedCapability, make_engine
from rlkube.runtime.rollout.base import Completion
from rlkube.runtime.rollout.hf import HFEngine, teacher_forced_logprobs

from .conftest import abort_midway, hf_greedy, hf_model

# fp32 on the CPU: the engine's own forward vs transformers' forward differ only by summation order.
LOGPROB_ATOL = 1e-4

PROMPTS = [[1, 5, 6, 14, 7], [1, 9], [1, 4, 4, 4, 4, 4, 4, 4, 4, 12, 13]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFEngine:
    # flag_lag=1 as on a GPU: aborts, resumes and weight updates meet chunks whose flags were read early
    eng = make_engine(
        "hf", tiny_model_dir, device="cpu", dtype="float32", num_slots=16, max_seq_len=512, flag_lag=1
    )
    assert isinstance(eng, HFEngine)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> torch.nn.Module:
    return hf_model(tiny_model_dir)


def _requests(**kw: object) -> list[RolloutRequest]:
    return [RolloutRequest(f"r{i}", p, SamplingParams(**kw)) for i, p in enumerate(PROMPTS)]  # type: ignore[arg-type]


def test_logprobs_match_teacher_forced_forward(engine: HFEngine, ref: torch.nn.Module) -> None:
    out = engine.generate(_requests(n=3, temperature=1.0, max_tokens=40, seed=7))
    assert [(c.request_id, c.sample_index) for c in out] == [(f"r{i}", k) for i in range(3) for k in range(3)]
    for c in out:
        assert len(c.token_ids) == len(c.logprobs) == 40 and c.finish_reason == "length"
        tf = teacher_forced_logprobs(ref, c.prompt_ids, c.token_ids)
        err = (tf - torch.tensor(c.logprobs)).abs().max().item()
        assert err < LOGPROB_ATOL, err
        assert c.token_versions == [0] * 40 and c.policy_version == 0


def test_greedy_equals_transformers_generate(engine: HFEngine, ref: torch.nn.Module) -> None:
    out = engine.generate(_requests(temperature=0.0, max_tokens=30))
    for c, p in zip(out, PROMPTS, strict=True):
        assert c.token_ids == hf_greedy(ref, p, 30)


def test_tiny_top_p_is_greedy(engine: HFEngine) -> None:
    greedy = engine.generate(_requests(temperature=0.0, max_tokens=12))
    nucleus = engine.generate(_requests(temperature=1.0, top_p=1e-6, max_tokens=12, seed=3))
    assert [c.token_ids for c in nucleus] == [c.token_ids for c in greedy]


def test_seeds_reproduce_and_samples_differ(engine: HFEngine) -> None:
    a = engine.generate(_requests(n=2, max_tokens=16, seed=11))
    b = engine.generate(_requests(n=2, max_tokens=16, seed=11))
    c = engine.generate(_requests(n=2, max_tokens=16, seed=12))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert a[0].token_ids != a[1].token_ids  # the n samples of one prompt are independent


def test_sampling_follows_the_temperature_distribution(engine: HFEngine, ref: torch.nn.Module) -> None:
    prompt, temp, n = PROMPTS[0], 0.7, 3000
    params = SamplingParams(n=n, temperature=temp, max_tokens=1)
    out = engine.generate([RolloutRequest("dist", prompt, params)])
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0, -1]
    expected = torch.softmax(logits / temp, -1)
    freq = Counter(c.token_ids[0] for c in out)
    empirical = torch.tensor([freq.get(i, 0) / n for i in range(expected.numel())])
    assert 0.5 * (empirical - expected).abs().sum() < 0.05  # total variation; ~0.02 expected from noise


def test_stop_tokens_end_the_sample(engine: HFEngine, ref: torch.nn.Module) -> None:
    free = engine.generate([RolloutRequest("s", PROMPTS[0], SamplingParams(n=4, max_tokens=40, seed=5))])
    # Stop on a token the unconstrained samples do produce.
    stop = free[0].token_ids[3]
    params = SamplingParams(n=4, max_tokens=40, seed=5, stop_token_ids=(stop,))
    out = engine.generate([RolloutRequest("s", PROMPTS[0], params)])
    assert out[0].finish_reason == "stop"
    for c, f in zip(out, free, strict=True):
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == stop and stop not in c.token_ids[:-1]
            assert c.token_ids == f.token_ids[: len(c.token_ids)]  # same stream, cut at the stop
        else:
            assert stop not in c.token_ids and len(c.token_ids) == 40


def test_submit_poll_is_asynchronous(engine: HFEngine) -> None:
    engine.submit(_requests(n=2, max_tokens=20, seed=1))
    got: list[Completion] = []
    deadline = time.monotonic() + 60
    while len(got) < 6 and time.monotonic() < deadline:
        got += engine.poll()
        time.sleep(0.02)
    assert len(got) == 6 and engine.num_in_flight() == 0
    assert all(len(c.token_ids) == 20 for c in got)


def test_abort_then_resume_under_new_weights(
    engine: HFEngine, tiny_model_dir: Path, perturbed_state: dict[str, torch.Tensor], ref: torch.nn.Module
) -> None:
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    max_tokens = 400
    partials = abort_midway(engine, _requests(n=2, max_tokens=max_tokens, seed=2), max_tokens, 6, wait_s=0.2)
    assert len(partials) == 6 and all(p.finish_reason == "abort" for p in partials)
    assert engine.num_in_flight() == 0
    for p in partials:  # the kept tokens are what version 0 produced
        assert len(p.token_ids) == len(p.logprobs) and p.token_versions == [0] * len(p.token_ids)
        if p.token_ids:
            tf = teacher_forced_logprobs(ref, p.prompt_ids, p.token_ids)
            assert torch.allclose(torch.tensor(p.logprobs), tf, atol=LOGPROB_ATOL)

    new = hf_model(tiny_model_dir, perturbed_state)
    engine.load_weights(perturbed_state.items(), version=1)
    try:
        engine.resume(partials)
        deadline = time.monotonic() + 120
        done: list[Completion] = []
        while len(done) < 6 and time.monotonic() < deadline:
            done += engine.poll()
            time.sleep(0.05)
        assert len(done) == 6
        for c in done:
            k = sum(v == 0 for v in c.token_versions)
            assert len(c.token_ids) == max_tokens and c.finish_reason == "length"
            assert c.policy_version == 0 and c.token_versions == [0] * k + [1] * (max_tokens - k)
            assert c.resumed_versions == [1]
            # Continuation logprobs are under the new weights, with the old tokens as prompt.
            tf = teacher_forced_logprobs(new, c.prompt_ids + c.token_ids[:k], c.token_ids[k:])
            assert torch.allclose(torch.tensor(c.logprobs[k:]), tf, atol=LOGPROB_ATOL)
        assert engine.flag_reads["early"] > 0  # the chunks ran with the flags read a step early
    finally:
        engine.abort_all()  # a failed assertion must not leave samples that block the next test
        engine.poll()
        engine.load_weights(original.items(), version=2)


def test_loaded_weights_decode_exactly_like_pytorch(
    engine: HFEngine, tiny_model_dir: Path, perturbed_state: dict[str, torch.Tensor]
) -> None:
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    before = engine.generate(_requests(temperature=0.0, max_tokens=24))
    new = hf_model(tiny_model_dir, perturbed_state)
    engine.load_weights(perturbed_state.items(), version=5)
    try:
        assert engine.policy_version == 5
        after = engine.generate(_requests(temperature=0.0, max_tokens=24))
        assert [c.token_ids for c in after] != [c.token_ids for c in before]
        for c, p in zip(after, PROMPTS, strict=True):
            assert c.token_ids == hf_greedy(new, p, 24)
            assert c.policy_version == 5 and set(c.token_versions) == {5}
            tf = teacher_forced_logprobs(new, p, c.token_ids)
            assert torch.allclose(torch.tensor(c.logprobs), tf, atol=LOGPROB_ATOL)
    finally:
        engine.load_weights(original.items(), version=6)
    assert [c.token_ids for c in engine.generate(_requests(temperature=0.0, max_tokens=24))] == [
        c.token_ids for c in before
    ]


def test_weights_cannot_change_under_running_samples(engine: HFEngine) -> None:
    engine.submit(_requests(max_tokens=400, seed=4))
    time.sleep(0.05)
    try:
        if engine.num_in_flight():
            with pytest.raises(RuntimeError, match="abort_all"):
                engine.load_weights(list(engine.model.state_dict().items())[:1], version=9)
    finally:
        engine.abort_all()


def test_capabilities_are_honest(engine: HFEngine) -> None:
    caps = engine.capabilities
    assert caps.engine == "hf" and caps.abort_resume and not caps.sleep and caps.logprobs_mode == "raw"
    with pytest.raises(UnsupportedCapability):
        engine.sleep(1)


def test_bad_requests_are_refused(engine: HFEngine) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([RolloutRequest("big", [1] * 500, SamplingParams(max_tokens=100))])
    with pytest.raises(ValueError, match="duplicate"):
        engine.generate([RolloutRequest("x", [1]), RolloutRequest("x", [1])])
    assert engine.generate([RolloutRequest("z", [1, 2], SamplingParams(max_tokens=0))])[0].token_ids == []


def test_delta_buckets_make_engine_weights_bit_identical(engine: HFEngine, tiny_model_dir: Path) -> None:
    from rlkube.runtime.weights import WeightSender, WeightSyncError

    trainer = hf_model(tiny_model_dir)
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    sender = WeightSender(bucket_megabytes=0.25)
    try:
        engine.update_weights(list(sender.full(trainer.named_parameters(), version=10)), version=10)
        g = torch.Generator().manual_seed(0)
        for step in (11, 12):
            with torch.no_grad():  # a sparse "optimizer step": ~2% of elements move
                for p in trainer.parameters():
                    mask = torch.rand(p.shape, generator=g) < 0.02
                    p.add_(mask * torch.randn(p.shape, generator=g) * 0.1)
            buckets = list(sender.delta(trainer.named_parameters(), version=step))
            assert all(b.kind == "delta" for b in buckets)
            changed = engine.update_weights(buckets, version=step)
            assert changed and engine.policy_version == step
            held = engine.model.state_dict()
            assert all(torch.equal(held[n], p) for n, p in trainer.named_parameters())
        greedy = engine.generate(_requests(temperature=0.0, max_tokens=16))
        assert [c.token_ids for c in greedy] == [hf_greedy(trainer, p, 16) for p in PROMPTS]

        # A corrupted payload is refused and leaves the engine on its previous weights.
        with torch.no_grad():
            next(trainer.parameters()).add_(1.0)
        bad = list(sender.delta(trainer.named_parameters(), version=13))
        bad[0].payload[100] ^= 0xFF
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        with pytest.raises(WeightSyncError):
            engine.update_weights(bad, version=13)
        assert engine.policy_version == 12
        assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    finally:
        engine.load_weights(original.items(), version=14)


def test_fused_weights_are_views_so_a_weight_update_needs_no_recopy() -> None:
    model = _tiny_qwen2_for_fused_test()
    with HFEngine(model=model, num_slots=2, max_seq_len=32) as eng:
        dec = eng.decoder
        layer = dec.layers[0]
        qkv, _, gu = dec._fused[0]
        assert layer.self_attn.q_proj.weight.data_ptr() == qkv.data_ptr()
        assert layer.mlp.up_proj.weight.data_ptr() == gu[layer.mlp.gate_proj.weight.shape[0] :].data_ptr()
        new = {k: v + 0.01 for k, v in model.state_dict().items()}
        eng.load_weights(new.items(), version=1)
        nq = layer.self_attn.q_proj.weight.shape[0]
        nk = layer.self_attn.k_proj.weight.shape[0]
        assert torch.equal(qkv[nq : nq + nk], new["model.layers.0.self_attn.k_proj.weight"])
        assert eng.last_load_stats is not None and eng.last_load_stats.version == 1
        # a weight replaced by a new tensor (not written in place) is copied back into the fused storage
        replacement = torch.randn_like(layer.self_attn.v_proj.weight)
        layer.self_attn.v_proj.weight.data = replacement.clone()
        dec.refresh_fused()
        assert torch.equal(qkv[nq + nk :], replacement)
        assert layer.self_attn.v_proj.weight.data_ptr() == qkv[nq + nk :].data_ptr()
        # ... and so is one re-pointed between two syncs: the next load_weights notices the move,
        # re-fuses, and writes the new values where decoding reads them.
        layer.self_attn.v_proj.weight.data = torch.zeros_like(replacement)
        eng.load_weights(new.items(), version=2)
        assert torch.equal(qkv[nq + nk :], new["model.layers.0.self_attn.v_proj.weight"])
        assert layer.self_attn.v_proj.weight.data_ptr() == qkv[nq + nk :].data_ptr()
        assert eng._copier.replans == 1  # re-fused to the same addresses: the first plan still holds


def test_compile_step_auto_is_eager_on_cpu_and_bad_values_are_refused() -> None:
    with HFEngine(model=_tiny_qwen2_for_fused_test(), num_slots=2, max_seq_len=32) as eng:
        assert eng.decoder.compiled is False and eng.decoder.compile_error is None
    with pytest.raises(ValueError, match="compile_step must be True, False, 'auto' or 'max-autotune'"):
        HFEngine(model=_tiny_qwen2_for_fused_test(), num_slots=2, max_seq_len=32, compile_step="yes")


@pytest.mark.parametrize("compiled_prefill", [False, True], ids=["eager-prefill", "compiled-prefill"])
def test_a_failing_compile_falls_back_to_eager_with_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch, compiled_prefill: bool
) -> None:
    """Fault injection: torch.compile raising (as inductor does without a compiler) is simulated;
    it fails first in the decode step, or, with the prefill on the compiled functions, there."""
    from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams

    def broken_compile(fn: Any, **_: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            raise RuntimeError("inductor: no C++ compiler")

        return run

    req = [RolloutRequest("r", [1, 2, 3], SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5))]
    with HFEngine(model=_tiny_qwen2_for_fused_test(), num_slots=2, max_seq_len=32) as eager:
        want = sorted(tuple(c.token_ids) for c in eager.generate(req))
    monkeypatch.setattr(torch, "compile", broken_compile)
    with HFEngine(model=_tiny_qwen2_for_fused_test(), num_slots=2, max_seq_len=32, compile_step=True) as eng:
        eng.decoder.compiled_prefill = compiled_prefill
        got = sorted(tuple(c.token_ids) for c in eng.generate(req))
        assert eng.decoder.compiled is False
        assert eng.decoder.compile_error is not None and "no C++ compiler" in eng.decoder.compile_error
    assert got == want


# inductor's CPU backend still calls torch.jit.script_method, which warns in torch 2.13
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_max_autotune_compile_setting_decodes_the_same_tokens() -> None:
    """``compile_step="max-autotune"`` (the GEMM-autotune A/B of the GPU benches) really compiles
    (here inductor's CPU backend) and changes no token."""
    from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams

    req = [RolloutRequest("r", [1, 2, 3], SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5))]
    with HFEngine(model=_tiny_qwen2_for_fused_test(), num_slots=2, max_seq_len=32) as eager:
        want = [c.token_ids for c in eager.generate(req)]
    with HFEngine(
        model=_tiny_qwen2_for_fused_test(), num_slots=2, max_seq_len=32, compile_step="max-autotune"
    ) as eng:
        got = [c.token_ids for c in eng.generate(req)]
        assert eng.decoder.compiled is True and eng.decoder.compile_error is None
    assert got == want


# inductor's CPU backend still calls torch.jit.script_method, which warns in torch 2.13
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.slow
def test_a_compiled_step_compiles_nothing_more_for_a_second_batch_bucket() -> None:
    """Cold compiles are most of an engine's first call on a GPU (twelve batch buckets at 512
    slots). The batch rows are dynamic from each function's first compile, so a bucket the step
    has not run before costs no compile (torch's default recompiles once more), and the tokens
    are the eager step's. Here inductor's CPU backend compiles."""
    from torch._dynamo.utils import counters

    from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams

    def requests(budgets: list[int]) -> list[RolloutRequest]:
        return [
            RolloutRequest(f"r{i}", [1, 2, 3 + i], SamplingParams(n=8, max_tokens=m, temperature=1.0, seed=i))
            for i, m in enumerate(budgets)
        ]

    same, mixed = requests([4, 4, 4]), requests([2, 5, 9])  # 24 rows throughout; 24 then 8
    with HFEngine(model=_tiny_qwen2_for_fused_test(), num_slots=24, max_seq_len=32) as eager:
        want = [sorted(tuple(c.token_ids) for c in eager.generate(r)) for r in (same, mixed)]
    with HFEngine(model=_tiny_qwen2_for_fused_test(), num_slots=24, max_seq_len=32, compile_step=True) as eng:
        d = eng.decoder
        assert d.compiled and d.dynamic_rows
        got = [sorted(tuple(c.token_ids) for c in eng.generate(same))]
        assert set(d.steps_by_bucket) == {24}
        graphs = counters["stats"]["unique_graphs"]
        got.append(sorted(tuple(c.token_ids) for c in eng.generate(mixed)))
        assert min(d.steps_by_bucket) < 24  # a smaller bucket ran ...
        assert counters["stats"]["unique_graphs"] == graphs  # ... and compiled nothing
        assert d.compiled and d.compile_error is None
    assert got == want


def test_an_aborted_graph_capture_leaves_the_engine_decoding_without_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection (no GPU here): CUDA aborts the capture of the decode step, as it does when
    something in the step syncs with the host. The engine keeps why, stops trying graphs and
    decodes the same tokens; the failed attempt advances no request. On a GPU the bench's
    ``capture_failure`` check repeats this with a real aborted capture and then draws random
    numbers on the device (``bench/gpu/decode_step_gpu.py``)."""
    import contextlib

    from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams

    class Stream:
        def wait_stream(self, other: Any) -> None:
            pass

    captures = []

    def aborted_capture(*args: Any, **kwargs: Any) -> Any:
        captures.append(args)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    req = [RolloutRequest("r", [1, 2, 3], SamplingParams(n=2, max_tokens=9, temperature=1.0, seed=5))]
    with HFEngine(model=_tiny_qwen2_for_fused_test(), num_slots=2, max_seq_len=32) as eager:
        want = [c.token_ids for c in eager.generate(req)]
    for name, fake in {
        "Stream": Stream,
        "current_stream": Stream,
        "stream": lambda s: contextlib.nullcontext(),
        "CUDAGraph": object,
        "graph_pool_handle": lambda: None,
        "graph": aborted_capture,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    with HFEngine(model=_tiny_qwen2_for_fused_test(), num_slots=2, max_seq_len=32) as eng:
        eng.decoder.use_graphs = True  # as on a GPU
        got = [c.token_ids for c in eng.generate(req)]
        assert len(captures) == 1 and eng.decoder.use_graphs is False  # tried once, then off
        assert "not permitted when stream is capturing" in (eng.decoder.graph_error or "")
    assert got == want


def test_cuda_graphs_on_a_cpu_model_are_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA or ROCm GPU, not cpu"):
        HFEngine(model=_tiny_qwen2_for_fused_test(), num_slots=2, max_seq_len=32, cuda_graphs=True)


def _tiny_qwen2_for_fused_test() -> Any:
    from transformers import AutoModelForCausalLM

    from rlkube.runtime.models.tiny import tiny_qwen2_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config(40, hidden_size=64, num_heads=1)).eval()


def test_the_engine_freezes_the_warm_heap_once_before_its_first_call_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full garbage collection walks every live object (~0.5M in a warm engine's process, a pause
    of the decode loop); the engine moves them out of its reach once its first call is done, before
    that call returns (so no later call pays for it), not when told not to, one engine at a time,
    and gives them back at shutdown (so a dropped engine's reference cycles can be freed)."""
    import gc

    from rlkube.runtime import heap

    monkeypatch.setattr(heap, "_frozen", False)
    freezes = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (freezes.append(1), real_freeze()))
    gc.unfreeze()
    model = _tiny_qwen2_for_fused_test()
    req = [RolloutRequest("a", [1, 2, 3], SamplingParams(n=2, max_tokens=4, seed=0))]
    try:
        with HFEngine(model=model, num_slots=2, max_seq_len=32, freeze_heap=False) as eng:
            eng.generate(req)
        assert gc.get_freeze_count() == 0
        with HFEngine(model=model, num_slots=2, max_seq_len=32) as eng:
            assert gc.get_freeze_count() == 0  # not while cold
            eng.generate(req)
            assert gc.get_freeze_count() > 10_000  # torch, transformers, the model: all of it
            eng.generate(req)
            with HFEngine(model=model, num_slots=2, max_seq_len=32) as other:
                other.generate(req)
            assert len(freezes) == 1 and gc.get_freeze_count() > 10_000  # one at a time
        assert gc.get_freeze_count() == 0  # thawed at shutdown
        with HFEngine(model=model, num_slots=2, max_seq_len=32) as eng:
            eng.generate(req)
            assert len(freezes) == 2
    finally:
        gc.unfreeze()


def test_the_folded_mlp_norm_decodes_like_pytorch_after_every_kind_of_weight_update(
    tiny_model_dir: Path, ref: torch.nn.Module, perturbed_state: dict[str, torch.Tensor]
) -> None:
    """``fold_mlp_norm``: the decode step's gate/up weight is a copy with the norm's weight in it,
    so each way weights arrive (a direct load, checksummed buckets) must rebuild the copy, or the
    engine would decode with the old MLP under the new version number."""
    from rlkube.runtime.weights import WeightSender

    eng = make_engine(
        "hf", tiny_model_dir, device="cpu", dtype="float32", num_slots=8, max_seq_len=128, fold_mlp_norm=True
    )
    assert isinstance(eng, HFEngine)
    new = hf_model(tiny_model_dir, perturbed_state)

    def decodes_like(model: torch.nn.Module) -> None:
        sampled = eng.generate(_requests(n=2, temperature=1.0, max_tokens=12, seed=3))
        for c in sampled:
            tf = teacher_forced_logprobs(model, c.prompt_ids, c.token_ids)
            assert torch.allclose(torch.tensor(c.logprobs), tf, atol=LOGPROB_ATOL)
        greedy = eng.generate(_requests(temperature=0.0, max_tokens=12))
        assert [c.token_ids for c in greedy] == [hf_greedy(model, p, 12) for p in PROMPTS]

    with eng:
        assert eng.decoder.fold_mlp_norm and len(eng.decoder._gu_folded) == len(eng.decoder.layers)
        decodes_like(ref)
        eng.load_weights(perturbed_state.items(), version=1)  # the in-process direct copy
        decodes_like(new)
        buckets = list(WeightSender(bucket_megabytes=0.25).full(ref.named_parameters(), version=2))
        eng.update_weights(buckets, version=2)  # checksummed buckets, as across processes
        decodes_like(ref)
    with pytest.raises(ValueError, match="fold_mlp_norm must be True or False"):
        HFEngine(model=_tiny_qwen2_for_fused_test(), num_slots=2, max_seq_len=32, fold_mlp_norm="yes")  # type: ignore[arg-type]
