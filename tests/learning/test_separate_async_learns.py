"""separate_async GRPO on a real local Ray with two FSDP2 trainer ranks and two hf engines: the
engines stream groups into the replay buffer while the ranks update, weights go over the collective
backend; held-out reward rises from <= 0.3 to >= 0.7, at most half of each batch comes from the
previous policy (verl's stalenessThreshold 0.5) and almost nothing is thrown away."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from rlkube.api import load_rljob, resolve
from rlkube.runtime.metrics import read_jsonl
from rlkube.runtime.trainer.ray_runtime import run_on_ray

from .helpers import assert_learned, learning_job

# 0.5 (verl's meaning): the rollouter runs ahead by half a batch per version and those groups are
# trained one version later: staleness <= 1 version, at most half of a batch stale.
THRESHOLD = 0.5
# Half of every batch is one version old, so it needs more steps than sync (helpers.LEARNING_STEPS).
STEPS = 250
# Unlike the sync runs this one is not reproducible: which engine's groups fill which batch depends
# on timing. Final held-out reward (best of the last two evals, 60 prompts) measured on this machine:
# 0.85, 0.87, 0.88 idle; 0.75, 0.78 beside other heavy work (CI, a real-node test). The bar sits below
# that spread and far above the 0.22 start; sync, which is reproducible, keeps 0.8.
END_MIN = 0.7


@pytest.mark.slow
@pytest.mark.timeout(1800)  # beside the cluster tests in `make test`: slower than alone
@pytest.mark.ray
def test_separate_async_grpo_learns_with_bounded_staleness(
    tmp_path: Path, learn_task: Any, monkeypatch: Any
) -> None:
    path = learning_job(
        tmp_path / "job.yaml",
        learn_task,
        "separate_async",
        training={"totalSteps": STEPS},
        **{"async": {"stalenessThreshold": THRESHOLD, "parameterSyncStep": 2, "partialRollout": True}},
        trainer={"gpusPerReplica": 2},  # two FSDP2 trainer ranks (gloo)
        rollout={"engine": "hf", "replicas": 2},  # two hf engines behind the balancer
    )
    job = resolve(load_rljob(path))
    monkeypatch.setenv("RLKUBE_RAY_TMPDIR", f"/tmp/rlkl{os.getpid()}")
    res = run_on_ray(job, tmp_path / "out", num_cpus=2, timeout_s=1500)
    curve = assert_learned(res.metrics_path, end_min=END_MIN)
    rows = [r for r in read_jsonl(res.metrics_path) if r["step"] > 0]
    assert len(rows) == job.spec.training.total_steps
    assert max(r["staleness/max"] for r in rows) <= 1
    assert max(r["staleness/stale_fraction"] for r in rows) <= THRESHOLD
    mean_stale = sum(r["staleness/mean"] for r in rows) / len(rows)
    assert mean_stale <= THRESHOLD
    # Really asynchronous: stale groups were trained (not dropped), and almost nothing was wasted.
    assert mean_stale > 0
    b = job.spec.training.train_batch_size
    trained = b * job.spec.training.total_steps
    assert rows[-1]["staleness/dropped_groups_total"] <= 0.02 * trained
    assert rows[-1]["data/prompts_drawn"] <= trained + rows[-1]["staleness/dropped_groups_total"] + 1.5 * b
    assert all(r["trainer/world_size"] == 2 and r["rollout/engines"] == 2 for r in rows)
    assert all(r["weight_sync/transport"] == "collective" for r in rows)
    assert res.curve_path is not None and res.curve_path.exists()
    print("held-out reward curve (separate_async):", curve, "mean staleness", round(mean_stale, 3))
