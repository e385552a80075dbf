"""The three modes on a real local Ray, every trainer rank and engine in its own actor placed by
placement groups: staleness bounded in the async modes, the layout the spec asks for (the 4+4 CPU
twin of the seed's example starts 4 trainer ranks and 4 engines), weights over the collective
backend, and nothing left running afterwards."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from rlkube.api import load_resolved
from rlkube.runtime.metrics import read_jsonl
from rlkube.runtime.trainer.ray_runtime import LAYOUT_FILE, run_on_ray

from .conftest import write_job

MODES: dict[str, dict[str, Any]] = {
    # one rank, one engine: the one-GPU job's path through Ray
    "sync": {},
    # two ranks, two engines sharing their devices
    "colocate_async": {
        "async": {"stalenessThreshold": 1.0},
        "trainer": {"gpusPerReplica": 2},
    },
    # the seed's 4+4 layout on CPUs: 4 trainer ranks, 4 engines, deltas from every rank's shard
    "separate_async": {
        "async": {"stalenessThreshold": 1.0, "parameterSyncStep": 1},
        "training": {"trainBatchSize": 4, "miniBatchSize": 4},
        "trainer": {"gpusPerReplica": 4},
        "rollout": {"engine": "hf", "replicas": 1, "gpusPerReplica": 4},
        "weightSync": {"method": "delta_sharded"},
    },
}
LAYOUTS = {"sync": (1, 1), "colocate_async": (2, 2), "separate_async": (4, 4)}


def leftovers(marker: str) -> list[str]:
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


def wait_gone(marker: str, pids: list[int] | None = None, timeout_s: float = 20.0) -> list[str]:
    """Processes of this run still alive after ``timeout_s`` (none, when it cleaned up)."""
    left: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = leftovers(marker) + [f"pid {p}" for p in pids or [] if _alive(p)]
        if not left:
            break
        time.sleep(0.2)
    return left


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.ray
@pytest.mark.parametrize("mode", list(MODES))
def test_mode_runs_on_ray_and_shuts_down_clean(
    tmp_path: Path, tiny_task: Any, mode: str, monkeypatch: Any
) -> None:
    over: dict[str, Any] = {
        **MODES[mode],
        "training": {"mode": mode, "totalSteps": 3, **MODES[mode].get("training", {})},
    }
    job = load_resolved(write_job(tmp_path / "job.yaml", tiny_task, **over))
    ray_tmp = Path("/tmp") / f"rlk{os.getpid()}{mode[:3]}"  # short: Ray's socket paths have a length limit
    monkeypatch.setenv("RLKUBE_RAY_TMPDIR", str(ray_tmp))
    res = run_on_ray(job, tmp_path / "out", num_cpus=2, timeout_s=600)
    rows = read_jsonl(res.metrics_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["policy_version"] == r["step"] for r in rows)  # one weight push per step
    thr = job.spec.async_.staleness_threshold if job.spec.async_ else 0.0
    assert all(r["staleness/max"] <= thr for r in rows if "staleness/max" in r)
    ranks, engines = LAYOUTS[mode]
    layout = json.loads((res.output_dir / LAYOUT_FILE).read_text())
    pids = [w["pid"] for w in layout["ranks"] + layout["rollout"]]
    assert len(layout["ranks"]) == ranks and len(layout["rollout"]) == engines
    assert len(set(pids)) == ranks + engines  # every rank and engine its own process
    for r in rows:
        assert r["trainer/world_size"] == ranks and r["rollout/engines"] == engines
        assert r["weight_sync/transport"] == "collective"
    # the balancer gave every engine prompt groups over the run (a colocate_async step may need none:
    # partial rollouts carried over can fill it)
    assert all(sum(r[f"rollout/engine_load/rollout-{e}"] for r in rows) > 0 for e in range(engines))
    left = wait_gone(str(ray_tmp), pids)
    assert not left, left
