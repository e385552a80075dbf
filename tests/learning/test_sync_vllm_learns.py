"""sync GRPO, one process, the real vLLM CPU engine: held-out reward on the tiny task rises to >= 0.8."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from rlkube.api import load_rljob, resolve
from rlkube.runtime.metrics import read_jsonl
from rlkube.runtime.trainer.local import run_local

from .helpers import assert_learned, learning_job

# vLLM's CPU backend reserves this many GiB of KV cache (default 4): plenty for 12-token sequences.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.mark.slow
def test_sync_grpo_learns_arithmetic_vllm(tmp_path: Path, learn_task: Any) -> None:
    path = learning_job(tmp_path / "job.yaml", learn_task, "sync", rollout={"engine": "vllm"})
    job = resolve(load_rljob(path))
    assert job.spec.rollout.engine == "vllm"
    res = run_local(job, tmp_path / "out")
    curve = assert_learned(res.metrics_path)
    rows = read_jsonl(res.metrics_path)
    syncs = [r for r in rows if "timing_s/update_weights" in r]
    assert len(syncs) >= 100, f"weights reached the vLLM engine only {len(syncs)} times"
    assert all(r.get("weight_sync/payload_mb", 0) > 0 for r in syncs)
    assert res.curve_path is not None and res.curve_path.stat().st_size > 1000
    print("held-out reward curve (sync, vllm):", curve, f"weight syncs: {len(syncs)}")
