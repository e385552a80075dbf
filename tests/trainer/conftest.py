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


# A smoke-sized job: 4 steps of 4 prompts x 4 samples, no warmup, no evaluation.
SMALL: dict[str, Any] = {
    "algorithm": {"groupSize": 4},
    "training": {
        "totalSteps": 4,
        "trainBatchSize": 4,
        "miniBatchSize": 2,
        "microBatchSize": 8,
        "learningRate": 1.0e-4,
        "warmupSteps": 0,
        "lrSchedule": "constant",
        "evalIntervalSteps": 0,
    },
    "checkpoint": {"intervalSteps": 2},
}


def write_job(path: Path, task: Any, **over: Any) -> Path:
    """An RLJob YAML for the tiny task; ``over`` merges into spec sections (e.g. training={...})."""
    from rlkube.devcluster.tiny_task import merge_spec, tiny_rljob

    doc = tiny_rljob(task, name=path.stem, trainer={"gpusPerReplica": 0}, **merge_spec(SMALL, over))
    path.write_text(yaml.safe_dump(doc))
    return path
