"""vLLM on the CPU is sized from the spec (no VLLM_CPU_KVCACHE_SPACE needed), a plan that cannot fit
is refused before vLLM starts naming the field, `rlkube doctor --rljob` checks the same, and
model.maxPositionEmbeddings reaches vLLM's model config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from rlkube.api import load_rljob, resolve
from rlkube.runtime.doctor import collect
from rlkube.runtime.errors import UserError
from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams
from rlkube.runtime.rollout.sizing import GiB, HostMemory, cpu_memory_problem, parse_bytes
from rlkube.runtime.trainer.engines import build_engine

from .conftest import write_job


def test_quantities_and_plans(monkeypatch: Any) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # vLLM's legacy override of the spec
    assert parse_bytes("256Mi") == 256 * 2**20 and parse_bytes("1.5G") == 1_500_000_000
    node = HostMemory(total=24 * GiB, available=17 * GiB, limit=None)
    msg = cpu_memory_problem(0.92, None, node)
    assert msg is not None and "rollout.gpuMemoryUtilization 0.92" in msg and "rollout.kvCacheMemory" in msg
    assert cpu_memory_problem(0.6, None, node) is None
    pod = HostMemory(total=24 * GiB, available=17 * GiB, limit=4 * GiB)
    assert "pod's memory limit" in (cpu_memory_problem(0.6, None, pod) or "")
    assert cpu_memory_problem(0.6, "1Gi", pod) is None
    assert "rollout.kvCacheMemory" in (cpu_memory_problem(0.6, "8Gi", pod) or "")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")  # what vLLM will really use is checked
    assert "VLLM_CPU_KVCACHE_SPACE" in (cpu_memory_problem(0.6, "1Gi", pod) or "")


def _vllm_job(tmp_path: Path, task: Any, **rollout: Any) -> Any:
    return resolve(load_rljob(write_job(tmp_path / "job.yaml", task, rollout={"engine": "vllm", **rollout})))


def test_a_cpu_plan_that_cannot_fit_is_refused_naming_the_field(
    tmp_path: Path, tiny_task: Any, monkeypatch: Any
) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    job = _vllm_job(tmp_path, tiny_task, gpuMemoryUtilization=1.0)
    with pytest.raises(UserError, match=r"rollout\.gpuMemoryUtilization 1\.0"):
        build_engine(job.spec)
    rep = collect(rljob=job)
    assert rep["vllm_cpu"]["source"] == "rljob" and not rep["ok"]
    problem = next(p for p in rep["problems"] if p["code"] == "VLLM_CPU_MEMORY")
    assert problem["severity"] == "error" and "rollout.kvCacheMemory" in problem["fix"]
    ok = collect(rljob=_vllm_job(tmp_path, tiny_task, kvCacheMemory="256Mi"))
    assert "VLLM_CPU_MEMORY" not in {p["code"] for p in ok["problems"]}


@pytest.mark.vllm
def test_vllm_cpu_engine_is_sized_and_configured_by_the_spec(
    tmp_path: Path, tiny_task: Any, monkeypatch: Any
) -> None:
    """No VLLM_CPU_KVCACHE_SPACE: rollout.kvCacheMemory sizes the KV cache. The model's config says 8
    positions, less than prompt + response (12): only model.maxPositionEmbeddings lets vLLM start."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    model = tmp_path / "model"
    shutil.copytree(tiny_task.model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = 8
    (model / "config.json").write_text(json.dumps(cfg))
    job = resolve(
        load_rljob(
            write_job(
                tmp_path / "job.yaml",
                tiny_task,
                model={"path": str(model), "maxPositionEmbeddings": 64},
                rollout={"engine": "vllm", "kvCacheMemory": "256Mi", "maxNumSeqs": 8},
            )
        )
    )
    eng = build_engine(job.spec)
    try:
        vc = eng.llm.llm_engine.vllm_config
        assert vc.cache_config.kv_cache_memory_bytes == 256 * 2**20
        assert vc.model_config.hf_config.max_position_embeddings == 64
        assert vc.model_config.max_model_len == 12
        out = eng.generate([RolloutRequest("r", [1, 2, 3], SamplingParams(n=2, max_tokens=4, seed=1))])
        assert len(out) == 2 and all(len(c.token_ids) >= 1 for c in out)
    finally:
        eng.shutdown()
