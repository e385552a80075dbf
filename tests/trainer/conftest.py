"""Shared fixtures: a tiny model and task files made once per session, and RLJob YAML writers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rlkube.devcluster.tiny_task import prepare_tiny_task

    return prepare_tiny_task(tmp_path_factory.mktemp("task"), sft_steps=20)


def write_job(path: Path, task: Any, **over: Any) -> Path:
    """An RLJob YAML for the tiny task; ``over`` merges into spec sections (e.g. training={...})."""
    spec: dict[str, Any] = {
        "model": {"path": str(task.model_dir), "dtype": "float32", "gradientCheckpointing": False},
        "data": {
            "train": str(task.train_path),
            "validation": str(task.heldout_path),
            "reward": "arith",
            "maxPromptLength": 8,
            "maxResponseLength": 4,
        },
        "algorithm": {"name": "grpo", "groupSize": 4},
        "training": {
            "mode": "sync",
            "totalSteps": 4,
            "trainBatchSize": 4,
            "miniBatchSize": 2,
            "microBatchSize": 8,
            "learningRate": 1.0e-4,
        },
        "trainer": {"gpusPerReplica": 0},
        "rollout": {"engine": "hf"},
        "gpu": {"vendor": "cpu"},
        "checkpoint": {"intervalSteps": 2},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(spec.get(k), dict):
            spec[k] = {**spec[k], **v}
        else:
            spec[k] = v
    doc = {"apiVersion": "rlkube.io/v1alpha1", "kind": "RLJob", "metadata": {"name": path.stem}, "spec": spec}
    path.write_text(yaml.safe_dump(doc))
    return path
