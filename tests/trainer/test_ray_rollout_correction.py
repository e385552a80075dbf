"""separate_async on a real local Ray with algorithm.rolloutCorrection: every step reports the
rollout_corr/* metrics, computed from the log-probs the rollout actors' engines sent with each sample."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

from rlkube.api import load_rljob, resolve
from rlkube.runtime.metrics import read_jsonl
from rlkube.runtime.trainer.ray_runtime import run_on_ray

from .conftest import write_job

METRICS = ("rollout_corr/is_weight_mean", "rollout_corr/is_clip_frac", "rollout_corr/logprob_diff_mean")


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_separate_async_with_rollout_correction_reports_its_metrics(
    tmp_path: Path, tiny_task: Any, mode: str, monkeypatch: Any
) -> None:
    over: dict[str, Any] = {
        "training": {"mode": "separate_async", "totalSteps": 4, "trainBatchSize": 4, "miniBatchSize": 4},
        "async": {"stalenessThreshold": 1.0, "parameterSyncStep": 1, "partialRollout": True},
        "rollout": {"engine": "hf", "replicas": 1},
        "algorithm": {"name": "grpo", "groupSize": 4, "rolloutCorrection": {"mode": mode, "threshold": 2.0}},
    }
    job = resolve(load_rljob(write_job(tmp_path / "job.yaml", tiny_task, **over)))
    monkeypatch.setenv("RLKUBE_RAY_TMPDIR", f"/tmp/rlk{os.getpid()}rc{mode}")
    res = run_on_ray(job, tmp_path / "out", num_cpus=2, timeout_s=600)
    rows = [r for r in read_jsonl(res.metrics_path) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["staleness/max"] == 0  # step 1 trains on samples of the initial weights
    for r in rows:
        assert all(k in r and math.isfinite(r[k]) for k in METRICS), r
        assert 0.0 < r["rollout_corr/is_weight_mean"] <= 2.0
        assert 0.0 <= r["rollout_corr/is_clip_frac"] <= 1.0
        assert r["actor/old_logprob_pass"] == 1.0
        if r["staleness/max"] == 0:
            # Fresh samples: the engine sampled with the trainer's own weights (fp32 on this CPU), so
            # both sides agree up to the engine's numerics (its logprob tolerance is 1e-4 per token).
            # One optimizer step per sync (parameterSyncStep 1) makes that true of the whole step:
            # with 2, the step's second mini-batch is scored after an update, though its staleness,
            # counted in syncs, is still 0 (measured: 4e-8 on the first, 6e-3 on the second).
            assert abs(r["rollout_corr/logprob_diff_mean"]) < 1e-3, r
