"""sync GRPO, one process, hf engine: held-out reward on the tiny arithmetic task rises to >= 0.8."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlkube.api import load_rljob, resolve
from rlkube.runtime.trainer.local import run_local

from .helpers import assert_learned, learning_job


@pytest.mark.slow
@pytest.mark.timeout(1800)  # beside the cluster tests in `make test`: slower than alone
def test_sync_grpo_learns_arithmetic(tmp_path: Path, learn_task: Any) -> None:
    job = resolve(load_rljob(learning_job(tmp_path / "job.yaml", learn_task, "sync")))
    res = run_local(job, tmp_path / "out")
    curve = assert_learned(res.metrics_path)
    assert res.curve_path is not None and res.curve_path.stat().st_size > 1000
    print("held-out reward curve (sync):", curve)
