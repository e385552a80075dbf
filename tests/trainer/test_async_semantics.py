"""The async modes' contract on the tiny task (in-process engines; the drivers are the ones Ray runs):
verl's stalenessThreshold (a fraction of each batch may come from the previous policy, nothing
thrown away for it) and DAPO dynamic sampling (zero-variance groups dropped, generation continues)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from rlkube.api import load_rljob, resolve
from rlkube.runtime.algos import DynamicSamplingExhaustedError
from rlkube.runtime.metrics import progress_from_metrics, read_jsonl
from rlkube.runtime.trainer.local import run_local
from rlkube.runtime.trainer.modes import group_capacity, staleness_bound

from .conftest import write_job

STEPS = 6
B = 4  # trainBatchSize (groups)


def _separate(tmp_path: Path, task: Any, **over: Any) -> Path:
    return write_job(
        tmp_path / "job.yaml",
        task,
        training={"mode": "separate_async", "totalSteps": STEPS, "trainBatchSize": B, "miniBatchSize": 2},
        rollout={"engine": "hf", "replicas": 1},
        checkpoint={"intervalSteps": 100},
        **over,
    )


def test_staleness_threshold_has_verls_meaning() -> None:
    assert [staleness_bound(t) for t in (0.0, 0.25, 0.5, 1.0, 1.5, 2.0)] == [0, 1, 1, 1, 2, 2]
    assert [group_capacity(t, 32) for t in (0.0, 0.5, 1.0)] == [32, 48, 64]


@pytest.mark.parametrize("policy", ["drop", "wait"])
def test_separate_async_trains_on_the_carried_over_groups_instead_of_dropping_them(
    tmp_path: Path, tiny_task: Any, policy: str
) -> None:
    """threshold 0.5: the rollout runs ahead by half a batch per version, and those groups are
    trained one version later (staleness 1, at most half of a batch); almost nothing is dropped."""
    job = resolve(
        load_rljob(
            _separate(
                tmp_path,
                tiny_task,
                **{"async": {"stalenessThreshold": 0.5, "parameterSyncStep": 2, "stalePolicy": policy}},
            )
        )
    )
    res = run_local(job, tmp_path / "out")
    rows = [r for r in read_jsonl(res.metrics_path) if r["step"] > 0]
    assert len(rows) == STEPS
    assert all(r["staleness/max"] <= 1 for r in rows)
    assert all(r["staleness/stale_fraction"] <= 0.5 for r in rows)  # verl: <= threshold of each batch
    assert any(r["staleness/stale_fraction"] > 0 for r in rows), "the rollout never ran ahead"
    last = rows[-1]
    trained = STEPS * B
    dropped = last["staleness/dropped_groups_total"]
    capacity = math.ceil(1.5 * B)
    # every prompt drawn was trained, dropped, or is still within the async buffer
    assert last["data/prompts_drawn"] <= trained + dropped + capacity
    if policy == "wait":
        assert dropped == 0
    else:
        assert dropped <= B // 2, f"{dropped} groups dropped for {trained} trained"
    assert last["replay/capacity_groups"] == capacity
    status = progress_from_metrics(STEPS, STEPS, last)
    assert status.metrics["staleness_dropped_groups_total"] == dropped
    assert status.metrics["data_prompts_drawn"] == last["data/prompts_drawn"]


def test_colocate_async_trains_the_interrupted_groups_of_the_previous_step(
    tmp_path: Path, tiny_task: Any
) -> None:
    """threshold 0.5: half a batch more is sampled, interrupted at the end of sampling, resumed
    under the new weights and trained first in the next step (staleness 1), not thrown away."""
    path = write_job(
        tmp_path / "job.yaml",
        tiny_task,
        training={"mode": "colocate_async", "totalSteps": STEPS, "trainBatchSize": B, "miniBatchSize": 2},
        checkpoint={"intervalSteps": 100},
        **{"async": {"stalenessThreshold": 0.5}},
    )
    res = run_local(resolve(load_rljob(path)), tmp_path / "out")
    rows = [r for r in read_jsonl(res.metrics_path) if r["step"] > 0]
    assert all(r["staleness/max"] <= 1 and r["staleness/stale_fraction"] <= 0.5 for r in rows)
    assert any(r["staleness/stale_fraction"] > 0 for r in rows), "nothing carried over was trained"
    last = rows[-1]
    # drawn = trained + dropped + at most the (1 + t) x batch budget still in flight
    assert last["data/prompts_drawn"] <= STEPS * B + last["staleness/dropped_groups_total"] + math.ceil(
        1.5 * B
    )
    assert last["staleness/dropped_groups_total"] <= B // 2


def _dynamic(**over: Any) -> dict[str, Any]:
    return {
        "data": {"reward": "trainer._rewards:alternating"},
        "algorithm": {"name": "dapo", "groupSize": 4, "dynamicSampling": {"maxGenBatches": 10}},
        **over,
    }


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_dynamic_sampling_trains_only_groups_with_reward_variance(
    tmp_path: Path, tiny_task: Any, mode: str
) -> None:
    if mode == "separate_async":
        path = _separate(
            tmp_path, tiny_task, **_dynamic(**{"async": {"stalenessThreshold": 0.5, "parameterSyncStep": 2}})
        )
    else:
        path = write_job(
            tmp_path / "job.yaml",
            tiny_task,
            training={"mode": mode, "totalSteps": STEPS, "trainBatchSize": B, "miniBatchSize": 2},
            checkpoint={"intervalSteps": 100},
            **_dynamic(**{"async": {"stalenessThreshold": 0.5}}),
        )
    res = run_local(resolve(load_rljob(path)), tmp_path / "out")
    rows = [r for r in read_jsonl(res.metrics_path) if r["step"] > 0]
    assert len(rows) == STEPS
    # Every trained group holds two 1s of four samples: any zero-variance group would pull it below.
    assert all(r["reward/mean"] == pytest.approx(0.5) for r in rows), [r["reward/mean"] for r in rows]
    dropped = sum(r["dynamic_sampling/dropped_groups"] for r in rows)
    assert dropped > 0
    # the run total also holds what the rollouter judged after the last step's window closed
    assert rows[-1]["dynamic_sampling/dropped_groups_total"] >= dropped
    # about half the prompts are degenerate: about two groups judged per group trained
    assert sum(r["dynamic_sampling/gen_batches"] for r in rows) / len(rows) > 1.2
    status = progress_from_metrics(STEPS, STEPS, rows[-1])
    assert status.metrics["dynamic_sampling_dropped_groups_total"] > 0


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_dynamic_sampling_gives_up_with_a_clear_error(tmp_path: Path, tiny_task: Any, mode: str) -> None:
    over = _dynamic()
    over["data"] = {"reward": "trainer._rewards:constant"}
    over["algorithm"]["dynamicSampling"] = {"maxGenBatches": 1}
    if mode == "separate_async":
        path = _separate(tmp_path, tiny_task, **over, **{"async": {"parameterSyncStep": 2}})
    else:
        path = write_job(
            tmp_path / "job.yaml",
            tiny_task,
            training={"mode": mode, "totalSteps": STEPS, "trainBatchSize": B, "miniBatchSize": 2},
            **over,
        )
    with pytest.raises(DynamicSamplingExhaustedError, match="maxGenBatches 1"):
        run_local(resolve(load_rljob(path)), tmp_path / "out")
