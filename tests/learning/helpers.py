"""RLJob for the learning runs and the assertions every mode shares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlkube.runtime.metrics import read_jsonl


def learning_job(path: Path, task: Any, mode: str, **over: Any) -> Path:
    spec: dict[str, Any] = {
        "model": {"path": str(task.model_dir), "dtype": "float32", "gradientCheckpointing": False},
        "data": {
            "train": str(task.train_path),
            "validation": str(task.heldout_path),
            "reward": "arith",
            "maxPromptLength": 8,
            "maxResponseLength": 4,
        },
        "algorithm": {"name": "grpo", "groupSize": 8, "temperature": 1.0},
        "training": {
            "mode": mode,
            "totalSteps": 150,
            "trainBatchSize": 32,
            "miniBatchSize": 16,
            "microBatchSize": 128,
            "learningRate": 5.0e-4,
            "warmupSteps": 5,
            "lrSchedule": "cosine",
            "evalIntervalSteps": 10,
        },
        "trainer": {"gpusPerReplica": 0},
        "rollout": {"engine": "hf"},
        "gpu": {"vendor": "cpu"},
        "checkpoint": {"intervalSteps": 50},
    }
    for k, v in over.items():
        spec[k] = {**spec[k], **v} if isinstance(v, dict) and isinstance(spec.get(k), dict) else v
    doc = {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": f"learn-{mode}"},
        "spec": spec,
    }
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
