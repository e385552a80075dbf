"""sync GRPO on a real local Ray with two FSDP2 trainer ranks and the real vLLM CPU engine (weights
into its worker over the collective backend): held-out reward on the tiny task rises to >= 0.8."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from rlkube.api import load_resolved
from rlkube.runtime.metrics import read_jsonl
from rlkube.runtime.trainer.ray_runtime import run_on_ray

from .helpers import assert_learned, learning_job

# vLLM's CPU backend reserves this many GiB of KV cache (default 4): plenty for 12-token sequences.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # beside the cluster tests in `make test`: slower than alone
@pytest.mark.ray
def test_sync_grpo_learns_arithmetic_vllm(tmp_path: Path, learn_task: Any, monkeypatch: Any) -> None:
    path = learning_job(
        tmp_path / "job.yaml",
        learn_task,
        "sync",
        trainer={"gpusPerReplica": 2},  # two FSDP2 trainer ranks (gloo)
        rollout={"engine": "vllm", "gpusPerReplica": 1},  # one vLLM engine next to rank 0
    )
    job = load_resolved(path)
    assert job.spec.rollout.engine == "vllm"
    monkeypatch.setenv("RLKUBE_RAY_TMPDIR", f"/tmp/rlkv{os.getpid()}")
    res = run_on_ray(job, tmp_path / "out", num_cpus=2, timeout_s=1200)
    curve = assert_learned(res.metrics_path)
    rows = read_jsonl(res.metrics_path)
    syncs = [r for r in rows if "timing_s/update_weights" in r]
    assert len(syncs) >= 100, f"weights reached the vLLM engine only {len(syncs)} times"
    assert all(r.get("weight_sync/payload_mb", 0) > 0 for r in syncs)
    assert all(r["weight_sync/transport"] == "collective" and r["trainer/world_size"] == 2 for r in syncs)
    assert res.curve_path is not None and res.curve_path.stat().st_size > 1000
    print("held-out reward curve (sync, vllm):", curve, f"weight syncs: {len(syncs)}")
