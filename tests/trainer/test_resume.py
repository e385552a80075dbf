"""A run SIGKILLed mid-flight resumes from its last checkpoint: no step repeated or skipped, the prompt
stream continues where the checkpoint left it, and the result equals an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlkube.api import load_rljob, resolve
from rlkube.runtime.metrics import read_jsonl
from rlkube.runtime.trainer.checkpoint import list_checkpoints
from rlkube.runtime.trainer.local import run_local

from .conftest import write_job

TOTAL = 10


def _train_cmd(job: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "rlkube.runtime.train", "--rljob", str(job), "--output", str(out)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}


def test_sigkill_then_resume_has_every_step_once(tmp_path: Path, tiny_task: Any) -> None:
    job = write_job(
        tmp_path / "job.yaml", tiny_task, training={"totalSteps": TOTAL}, checkpoint={"intervalSteps": 3}
    )
    out = tmp_path / "out"
    proc = subprocess.Popen(
        _train_cmd(job, out), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    killed_after = None
    while time.monotonic() < deadline and proc.poll() is None:
        rows = read_jsonl(metrics) if metrics.exists() else []
        if rows and rows[-1]["step"] >= 5:  # past the step-3 checkpoint, before the step-6 one (or during it)
            proc.send_signal(signal.SIGKILL)
            killed_after = rows[-1]["step"]
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert killed_after is not None, (
        f"run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    )
    assert proc.returncode == -signal.SIGKILL
    ckpts = [int(p.name.split("-")[1]) for p in list_checkpoints(out / "checkpoints")]
    assert ckpts and max(ckpts) < TOTAL

    done = subprocess.run(_train_cmd(job, out), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from checkpoint at step {max(ckpts)}" in done.stderr
    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))  # each step exactly once
    batch = 4
    assert [r["data/prompts_drawn"] for r in rows] == [batch * s for s in range(1, TOTAL + 1)]

    # Same trajectory as a run that was never interrupted (deterministic on one CPU thread).
    ref = run_local(resolve(load_rljob(job)), tmp_path / "ref")
    ref_rows = read_jsonl(ref.metrics_path)
    for a, b in zip(rows, ref_rows, strict=True):
        assert abs(a["reward/mean"] - b["reward/mean"]) < 1e-9, (
            a["step"],
            a["reward/mean"],
            b["reward/mean"],
        )
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) < 1e-4
