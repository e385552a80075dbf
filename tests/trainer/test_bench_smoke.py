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
        [sys.executable, str(TOP / "bench/gpu/trainer_gpu.py"), "--smoke", "--compile", "off"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "trainer-gpu.json").read_text())
    r = data["results"][0]["rlkube"]
    assert len(r["steps"]) == 3
    # after the warm-up, the rank-group update path (the trainer's) and the direct one alternate
    assert [s["update_path"] for s in r["steps"]] == ["direct", "group", "direct"]
    assert set(r["update_paths"]) == {"update_group_s", "update_direct_s", "group_over_direct"}
    m = r["mean_after_warmup"]
    assert m["rollout_tokens_per_s"] > 0 and m["train_tokens_per_s"] > 0 and m["step_s"] > 0
    assert all(s["completion_tokens"] == 2 * 2 * 8 for s in r["steps"])  # no stop ids: full length
    # one epoch x one mini-batch: the update's own detached log-probs are pi_old, no extra pass
    assert r["old_logprob_pass"] is False and all(s["old_logprob_s"] == 0.0 for s in r["steps"])
    assert "engine_compiled" in r and r["engine_compiled"] in (None, False)  # --compile off
