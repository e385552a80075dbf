"""A trainer rank crashing natively (SIGSEGV) or a rollout engine SIGKILLed mid-run: ``rlkube-train``
exits non-zero within 60 s naming which one (a crashed rank's own last words, every thread's Python
stack, in its log), leaves no process behind, and a rerun resumes from the last DCP checkpoint with
every step exactly once (two trainer ranks, two hf engines, separate_async, on a real local Ray)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlkube.runtime.metrics import read_jsonl
from rlkube.runtime.trainer.checkpoint import list_checkpoints
from rlkube.runtime.trainer.ray_runtime import LAYOUT_FILE

from .conftest import write_job
from .test_ray_modes import wait_gone

TOTAL = 8
VICTIMS = {
    "trainer rank 1": ("ranks", 1, signal.SIGSEGV),  # as a native crash in torch or gloo would
    "rollout engine rollout-1": ("rollout", 1, signal.SIGKILL),  # as the OOM killer would
}


def _train(job: Path, out: Path, ray_tmp: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1", "RLKUBE_RAY_TMPDIR": ray_tmp}
    cmd = [sys.executable, "-m", "rlkube.runtime.train", "--rljob", str(job), "--output", str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.ray
@pytest.mark.parametrize("victim", list(VICTIMS))
def test_a_killed_rank_or_engine_fails_the_job_by_name_and_a_rerun_resumes(
    tmp_path: Path, tiny_task: Any, victim: str
) -> None:
    job = write_job(
        tmp_path / "job.yaml",
        tiny_task,
        training={"mode": "separate_async", "totalSteps": TOTAL, "trainBatchSize": 4, "miniBatchSize": 2},
        **{"async": {"stalenessThreshold": 1.0, "parameterSyncStep": 2}},
        trainer={"gpusPerReplica": 2},
        rollout={"engine": "hf", "replicas": 2},
        checkpoint={"intervalSteps": 2},
    )
    out = tmp_path / "out"
    ray_tmp = f"/tmp/rlkf{os.getpid()}{victim[0]}"
    proc = _train(job, out, ray_tmp)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    killed_at = None
    while time.monotonic() < deadline and proc.poll() is None:
        rows = read_jsonl(metrics) if metrics.exists() else []
        if rows and rows[-1]["step"] >= 3:  # past the step-2 checkpoint
            layout = json.loads((out / LAYOUT_FILE).read_text())
            kind, index, sig = VICTIMS[victim]
            pids = [w["pid"] for w in layout["ranks"] + layout["rollout"]]
            os.kill(layout[kind][index]["pid"], sig)
            killed_at = time.monotonic()
            break
        time.sleep(0.1)
    assert killed_at is not None, f"the run ended before the kill: {proc.communicate()[1][-3000:]}"
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"rlkube-train still running 60 s after {victim} was killed")
    took = time.monotonic() - killed_at
    assert proc.returncode != 0
    assert took < 60, took
    assert victim in err, err[-3000:]
    if sig == signal.SIGSEGV:  # the driver repeats the rank's last words: where each thread was
        assert f"the last lines {victim} wrote before it died" in err, err[-3000:]
        assert "Fatal Python error: Segmentation fault" in err and "File " in err, err[-3000:]
    left = wait_gone(ray_tmp, pids)
    assert not left, left
    done_steps = [r["step"] for r in read_jsonl(metrics)]
    ckpts = [int(p.name.split("-")[1]) for p in list_checkpoints(out / "checkpoints")]
    assert ckpts and max(ckpts) < TOTAL, (ckpts, done_steps)

    rerun = _train(job, out, ray_tmp + "r")
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-3000:]
    assert f"resumed from checkpoint at step {max(ckpts)}" in err
    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))  # each step exactly once
    assert all(r["policy_version"] == r["step"] and r["trainer/world_size"] == 2 for r in rows)
