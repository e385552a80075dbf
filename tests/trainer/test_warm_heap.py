"""A trainer rank's process freezes its warm heap (``rlkube.runtime.heap``) once it is warm."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from rlkube.api import load_rljob, resolve
from rlkube.runtime import heap
from rlkube.runtime.distributed.pool import EnginePool
from rlkube.runtime.trainer.core import Trainer
from rlkube.runtime.trainer.engines import build_engine
from rlkube.runtime.trainer.local import make_driver
from rlkube.runtime.trainer.loop import run_loop

from .conftest import write_job


def test_the_run_loop_freezes_the_warm_heap_after_its_first_step_and_thaws_it_at_the_end(
    tmp_path: Path, tiny_task: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full collection walks every live object (~0.5M in a warm trainer process), a pause that
    leaves the GPU idle. A rank's own process (a Ray actor, with no engine to freeze it) asks the
    loop to move them out of the collector's reach after the first step, when models, optimiser
    state and compiled code exist; every later step runs frozen, and the loop gives them back at
    its end. Here the engine is told not to freeze, so the loop is the only one that does."""
    monkeypatch.setattr(heap, "_frozen", False)
    gc.unfreeze()
    job = resolve(load_rljob(write_job(tmp_path / "job.yaml", tiny_task, training={"totalSteps": 3})))
    trainer = Trainer(job)
    engine = build_engine(job.spec, freeze_heap=False)
    driver = make_driver(trainer, [EnginePool([engine], ["rollout-0"])])
    frozen_before_step: list[int] = []
    step = driver.step

    def counted_step() -> dict[str, float]:
        frozen_before_step.append(gc.get_freeze_count())
        return step()

    driver.step = counted_step
    try:
        res = run_loop(trainer, driver, tmp_path / "out", freeze_heap=True, tensorboard=False)
        assert res.steps_run == 3
        assert frozen_before_step[0] == 0  # cold: nothing frozen
        assert all(n > 10_000 for n in frozen_before_step[1:])  # torch, transformers, the models
        assert gc.get_freeze_count() == 0  # thawed when the loop ended
    finally:
        engine.shutdown()
        gc.unfreeze()
