"""Contract tests of the SGLang adapter against FakeSGLangServer (recorded protocol, not the engine).

They check what the adapter sends and how it reads SGLang's documented responses; they say
nothing about the real engine, which cannot run on these machines.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from rlkube.runtime.rollout import RolloutRequest, SamplingParams, UnsupportedCapability, make_engine
from rlkube.runtime.rollout.sglang import SGLangEngine, SGLangError, launch_command

from .fake_sglang import FakeSGLangServer, fake_token


@pytest.fixture
def server() -> Iterator[FakeSGLangServer]:
    with FakeSGLangServer() as s:
        yield s


@pytest.fixture
def engine(server: FakeSGLangServer) -> Iterator[SGLangEngine]:
    eng = make_engine("sglang", base_url=server.url, tensor_serializer=lambda named: f"ser:{len(named)}")
    assert isinstance(eng, SGLangEngine)
    yield eng
    eng.shutdown()


def test_sglang_contract_generate_request_and_response(
    server: FakeSGLangServer, engine: SGLangEngine
) -> None:
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, max_tokens=5, seed=3)
    out = engine.generate([RolloutRequest("q", [1, 2, 3], params)])
    sent = server.calls("/generate")
    assert len(sent) == 2  # one SGLang request per sample
    for body in sent:
        assert body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True
        sp = body["sampling_params"]
        assert (sp["temperature"], sp["top_p"], sp["max_new_tokens"]) == (0.8, 0.9, 5)
        assert sp["ignore_eos"] is True and sp["no_stop_trim"] is True
    assert len({b["sampling_params"]["sampling_seed"] for b in sent}) == 2  # per-sample seeds
    assert [c.sample_index for c in out] == [0, 1]
    for c in out:
        assert c.token_ids == [fake_token([1, 2, 3], i) for i in range(5)]
        assert c.logprobs == [-0.25 - 0.01 * (t % 5) for t in c.token_ids]
        assert c.finish_reason == "length" and c.token_versions == [0] * 5


def test_sglang_contract_stop_token(server: FakeSGLangServer, engine: SGLangEngine) -> None:
    expected = [fake_token([7], i) for i in range(10)]
    stop = expected[3]
    c = engine.generate([RolloutRequest("s", [7], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))])[0]
    assert c.finish_reason == "stop" and c.token_ids == expected[: expected.index(stop) + 1]
    assert server.calls("/generate")[0]["sampling_params"]["stop_token_ids"] == [stop]


def test_sglang_contract_abort_keeps_partial_and_resume_continues() -> None:
    with FakeSGLangServer(token_delay_s=0.02) as server:
        eng = SGLangEngine(server.url)
        try:
            eng.submit([RolloutRequest("a", [5, 5], SamplingParams(n=2, max_tokens=200))])
            time.sleep(0.3)
            partials = eng.abort_all()
            assert len(partials) == 2 and all(p.finish_reason == "abort" for p in partials)
            assert {b["rid"] for b in server.calls("/abort_request")} == {
                b["rid"] for b in server.calls("/generate")
            }
            assert all(0 < len(p.token_ids) < 200 for p in partials)
            assert eng.num_in_flight() == 0
            eng._version = 1  # as after a weight sync
            server.token_delay_s = 0.0
            eng.resume(partials)
            deadline = time.monotonic() + 30
            done = []
            while len(done) < 2 and time.monotonic() < deadline:
                done += eng.poll()
                time.sleep(0.02)
            assert len(done) == 2
            resumed = server.calls("/generate")[2:]
            for c in done:
                k = c.token_versions.count(0)
                assert len(c.token_ids) == 200 and c.resumed_versions == [1]
                body = next(b for b in resumed if b["input_ids"] == [5, 5, *c.token_ids[:k]])
                assert body["sampling_params"]["max_new_tokens"] == 200 - k
        finally:
            eng.shutdown()


def test_sglang_contract_weight_and_memory_endpoints(server: FakeSGLangServer, engine: SGLangEngine) -> None:
    engine.load_weights([("w", object()), ("b", object())], version=4)
    body = server.calls("/update_weights_from_tensor")[0]
    assert body["serialized_named_tensors"] == ["ser:2"] and body["flush_cache"] is True
    assert engine.policy_version == 4
    engine.init_weights_update_group("10.0.0.1", 29500, rank_offset=1, world_size=2)
    init = server.calls("/init_weights_update_group")[0]
    assert init == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    engine.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 3]], version=5)
    upd = server.calls("/update_weights_from_distributed")[0]
    assert (upd["names"], upd["dtypes"], upd["shapes"]) == (["w"], ["bfloat16"], [[2, 3]])
    engine.sleep(2)
    engine.wake()
    engine.flush_cache()
    assert server.calls("/release_memory_occupation")[0]["tags"] == ["kv_cache", "weights"]
    assert len(server.calls("/resume_memory_occupation")) == 1 and len(server.calls("/flush_cache")) == 1
    with pytest.raises(UnsupportedCapability):
        engine.update_weights([], version=6)  # no checksum-verified delta path in SGLang


def test_sglang_contract_failure_is_an_error(server: FakeSGLangServer, engine: SGLangEngine) -> None:
    server.fail_next["/update_weights_from_distributed"] = "shape mismatch"
    with pytest.raises(SGLangError, match="shape mismatch"):
        engine.update_weights_from_distributed(["w"], ["bfloat16"], [[1]], version=1)
    assert engine.policy_version == 0  # a refused update does not advance the version


def test_sglang_launch_command_has_rocm_defaults() -> None:
    argv, env = launch_command("/models/m", port=31000, vendor="amd")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"] and "--skip-tokenizer-init" in argv
    assert argv[argv.index("--attention-backend") + 1] == "triton" and "--disable-custom-all-reduce" in argv
    assert env["SGLANG_ATTENTION_BACKEND"] == "triton" and env["SGLANG_USE_AITER"] == "0"
    assert "--attention-backend" not in launch_command("/m", vendor="nvidia")[0]
