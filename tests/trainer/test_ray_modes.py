"""The three modes on a real local Ray: trainer and rollout actors placed by the worker-group
resources, staleness bounded in the async modes, and nothing left running afterwards."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from rlkube.api import load_rljob, resolve
from rlkube.runtime.metrics import read_jsonl
from rlkube.runtime.trainer.ray_runtime import placement, run_on_ray

from .conftest import write_job

MODES = {
    "sync": {},
    "colocate_async": {"async": {"stalenessThreshold": 1.0}},
    "separate_async": {
        "async": {"stalenessThreshold": 1.0, "parameterSyncStep": 2},
        "training": {"trainBatchSize": 4, "miniBatchSize": 2},
        "rollout": {"engine": "hf", "replicas": 2},
    },
}


def _leftovers(marker: str) -> list[str]:
    """Live processes whose command line mentions this test's Ray temp dir."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(f"{pid}: {cmd[:120]}")
    return out


@pytest.mark.ray
@pytest.mark.parametrize("mode", list(MODES))
def test_mode_runs_on_ray_and_shuts_down_clean(
    tmp_path: Path, tiny_task: Any, mode: str, monkeypatch: Any
) -> None:
    over: dict[str, Any] = {"training": {"mode": mode, "totalSteps": 3}, **MODES[mode]}
    if "training" in MODES[mode]:
        over["training"] = {**MODES[mode]["training"], "mode": mode, "totalSteps": 3}
    job = resolve(load_rljob(write_job(tmp_path / "job.yaml", tiny_task, **over)))
    resources, t_opts, r_opts = placement(job)
    if mode == "separate_async":
        assert resources == {"rlkube_trainer": 1.0, "rlkube_rollout": 2.0}
        assert t_opts["resources"] == {"rlkube_trainer": 1.0} and r_opts["resources"] == {
            "rlkube_rollout": 1.0
        }
    else:
        assert set(resources) == {"rlkube_actor"} and set(t_opts["resources"]) == {"rlkube_actor"}
    ray_tmp = Path("/tmp") / f"rlk{os.getpid()}{mode[:3]}"  # short: Ray's socket paths have a length limit
    monkeypatch.setenv("RLKUBE_RAY_TMPDIR", str(ray_tmp))
    res = run_on_ray(job, tmp_path / "out", num_cpus=2, timeout_s=600)
    rows = read_jsonl(res.metrics_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["policy_version"] == r["step"] for r in rows)  # one weight push per step
    thr = job.spec.async_.staleness_threshold if job.spec.async_ else 0.0
    assert all(r["staleness/max"] <= thr for r in rows if "staleness/max" in r)
    for _ in range(50):
        left = _leftovers(str(ray_tmp))
        if not left:
            break
        time.sleep(0.2)
    assert not left, left


def _tensorboard_points(logdir: Path, tag: str) -> list[int]:
    """Steps of every scalar event for ``tag`` across all event files (what a reader plots)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for f in sorted(logdir.glob("events.out.tfevents.*")):
        for ev in EventFileLoader(str(f)).Load():
            for v in ev.summary.value:
                if v.tag == tag:
                    steps.append(int(ev.step))
    return sorted(steps)


@pytest.mark.ray
def test_resume_on_ray_says_so_and_plots_each_step_once(
    tmp_path: Path, tiny_task: Any, monkeypatch: Any
) -> None:
    """Stop after step 3 with the last checkpoint at 2, run again: step 3 runs twice, but the Ray
    trainer actor logs the resume and TensorBoard ends up with steps 1..4 exactly once."""
    path = write_job(
        tmp_path / "job.yaml", tiny_task, training={"totalSteps": 4}, checkpoint={"intervalSteps": 2}
    )
    job = resolve(load_rljob(path))
    ray_tmp = Path("/tmp") / f"rlk{os.getpid()}res"
    monkeypatch.setenv("RLKUBE_RAY_TMPDIR", str(ray_tmp))
    out = tmp_path / "out"
    first = run_on_ray(job, out, max_steps=3, num_cpus=2, timeout_s=600)
    assert first.final_step == 3
    assert _tensorboard_points(out / "tensorboard", "reward/mean") == [1, 2, 3]
    second = run_on_ray(job, out, num_cpus=2, timeout_s=600)
    assert second.resumed_from == 2 and second.final_step == 4
    assert [r["step"] for r in read_jsonl(second.metrics_path) if r["step"] > 0] == [1, 2, 3, 4]
    assert _tensorboard_points(out / "tensorboard", "reward/mean") == [1, 2, 3, 4]
    logs = "".join(p.read_text(errors="replace") for p in ray_tmp.glob("session_*/logs/worker-*.err"))
    assert "resumed from checkpoint at step 2 (version 2)" in logs


@pytest.mark.ray
def test_a_user_error_inside_a_ray_actor_is_one_line_and_exit_2(tmp_path: Path, tiny_task: Any) -> None:
    import subprocess
    import sys

    job = write_job(
        tmp_path / "job.yaml",
        tiny_task,
        model={"path": str(tmp_path / "no-model")},
        training={"mode": "colocate_async"},
        **{"async": {"stalenessThreshold": 1.0}},
    )
    ray_tmp = f"/tmp/rlk{os.getpid()}ue"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1", "RLKUBE_RAY_TMPDIR": ray_tmp}
    proc = subprocess.run(
        [sys.executable, "-m", "rlkube.runtime.train", "--rljob", str(job), "--output", str(tmp_path / "o")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("rlkube-train: error:")]
    assert errors == [
        f"rlkube-train: error: model.path: {tmp_path / 'no-model'} is not a directory on this machine/pod; "
        "point it at a Hugging Face model directory (config.json, weights, tokenizer) or mount one there"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for _ in range(50):
        if not _leftovers(ray_tmp):
            break
        time.sleep(0.2)
    assert not _leftovers(ray_tmp)
