"""The GPU trainer benchmark runs end to end in its CPU smoke mode (same code path, tiny shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TOP = Path(__file__).resolve().parents[2]


def test_trainer_gpu_bench_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(TOP / "bench/gpu/trainer_gpu.py"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "trainer-gpu.json").read_text())
    r = data["results"][0]["rlkube"]
    assert len(r["steps"]) == 2
    m = r["mean_after_warmup"]
    assert m["rollout_tokens_per_s"] > 0 and m["train_tokens_per_s"] > 0 and m["step_s"] > 0
    assert all(s["completion_tokens"] == 2 * 2 * 8 for s in r["steps"])  # no stop ids: full length
