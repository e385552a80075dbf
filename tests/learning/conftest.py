"""The learning tests' task: tiny Qwen2 warm-started to a low held-out reward (devcluster.tiny_task)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

torch.set_num_threads(1)

# 65 supervised steps leave the model answering in format but mostly wrong (held-out ~0.2).
SFT_STEPS = 65


@pytest.fixture(scope="session")
def learn_task(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rlkube.devcluster.tiny_task import prepare_tiny_task

    return prepare_tiny_task(tmp_path_factory.mktemp("learn"), sft_steps=SFT_STEPS)
