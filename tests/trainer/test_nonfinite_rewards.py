"""A NaN/inf reward never ends a run "successfully" with nothing trained: by default it stops the job
naming the reward function and the sample; with ``data.nonFiniteReward: skip`` the sample is left out,
counted in the metrics and in status.progress, and training goes on."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from rlkube.api import load_rljob, resolve
from rlkube.runtime.errors import NonFiniteRewardError
from rlkube.runtime.metrics import progress_from_metrics, read_jsonl
from rlkube.runtime.trainer.local import run_local

from .conftest import write_job

NAN_REWARD = "trainer._rewards:nan_on_degenerate"


@pytest.mark.parametrize("mode", ["sync", "separate_async"])
def test_a_nan_reward_stops_the_job_naming_the_function_and_the_sample(
    tmp_path: Path, tiny_task: Any, mode: str
) -> None:
    over: dict[str, Any] = {"data": {"reward": NAN_REWARD}, "training": {"mode": mode, "totalSteps": 3}}
    if mode == "separate_async":
        over["training"].update(trainBatchSize=4, miniBatchSize=2)
        over["async"] = {"parameterSyncStep": 2}
    job = resolve(load_rljob(write_job(tmp_path / "job.yaml", tiny_task, **over)))
    with pytest.raises(NonFiniteRewardError) as err:
        run_local(job, tmp_path / "out")
    msg = str(err.value)
    assert f"reward function {NAN_REWARD!r} returned nan for sample p" in msg
    assert "prompt '" in msg and "data.nonFiniteReward: skip" in msg
    rows = (
        read_jsonl(tmp_path / "out" / "metrics.jsonl")
        if (tmp_path / "out" / "metrics.jsonl").exists()
        else []
    )
    assert not [r for r in rows if r["step"] > 0], "no step may be recorded on NaN rewards"


def test_skip_leaves_nan_samples_out_counts_them_and_still_trains(tmp_path: Path, tiny_task: Any) -> None:
    job = resolve(
        load_rljob(
            write_job(
                tmp_path / "job.yaml",
                tiny_task,
                data={"reward": NAN_REWARD, "nonFiniteReward": "skip"},
                training={"totalSteps": 4},
            )
        )
    )
    res = run_local(job, tmp_path / "out")
    rows = [r for r in read_jsonl(res.metrics_path) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    counts = [r["reward/nonfinite_total"] for r in rows]
    assert counts[-1] > 0 and counts == sorted(counts)
    assert all(math.isfinite(r["reward/mean"]) and r["actor/updates"] > 0 for r in rows)
    # fewer samples than groupSize x batch where NaN samples were left out
    assert min(r["batch/samples"] for r in rows) < 4 * 4
    assert progress_from_metrics(4, 4, rows[-1]).metrics["reward_nonfinite_total"] == counts[-1]
