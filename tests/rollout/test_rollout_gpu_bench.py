"""The GPU rollout benchmark runs end to end in --smoke mode (tiny shapes) and reports its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rollout_gpu_bench_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu/rollout_gpu.py"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "rollout-gpu.json").read_text())
    assert report["copy_bandwidth"]["rw_GBps"] > 0
    (res,) = report["results"]
    assert res["hf_engine"]["tokens"] == res["generate"]["tokens"] == 2 * 2 * 16
    assert res["hf_engine"]["tokens_per_s"] > 0 and res["generate"]["tokens_per_s"] > 0
    assert res["hf_engine"]["logprob_max_abs_err_vs_teacher_forced"] < 1e-4  # fp32 on the CPU
    assert 0 < res["fraction_of_bound_rw"] < res["fraction_of_bound_copy"]
    assert "hf_engine_error" not in res
