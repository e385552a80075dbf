"""RLJob for the learning runs and the assertions every mode shares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlkube.devcluster.tiny_task import tiny_rljob
from rlkube.runtime.metrics import read_jsonl


def learning_job(path: Path, task: Any, mode: str, **over: Any) -> Path:
    """The tiny RLJob for a learning run: 150 steps, the API's default trainer resources."""
    doc = tiny_rljob(task, name=f"learn-{mode}", mode=mode, trainer={"gpusPerReplica": 0}, **over)
    path.write_text(yaml.safe_dump(doc))
    return path


def eval_curve(metrics_path: Path) -> list[tuple[int, float]]:
    return [
        (int(r["step"]), float(r["eval/reward_mean"]))
        for r in read_jsonl(metrics_path)
        if "eval/reward_mean" in r
    ]


def assert_learned(
    metrics_path: Path, start_max: float = 0.3, end_min: float = 0.8
) -> list[tuple[int, float]]:
    """Held-out greedy reward starts low and ends high (best of the last two evals, for noise)."""
    curve = eval_curve(metrics_path)
    assert curve and curve[0][0] == 0, curve
    assert curve[0][1] <= start_max, f"starts too high for an RL gain: {curve}"
    assert max(v for _, v in curve[-2:]) >= end_min, f"did not learn: {curve}"
    return curve
