"""What the trainer pushes to in-process engines: a direct copy for full sync, buckets for delta."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import write_job


@pytest.mark.parametrize("method", ["full", "delta_sharded"])
def test_pushed_weights_equal_the_trainers_and_report_how_they_travelled(
    tmp_path: Path, tiny_task: Any, method: str
) -> None:
    from rlkube.api import load_rljob, resolve
    from rlkube.runtime.trainer.core import Trainer
    from rlkube.runtime.trainer.engines import build_engine
    from rlkube.runtime.trainer.modes import SyncDriver

    job = resolve(load_rljob(write_job(tmp_path / "job.yaml", tiny_task, weightSync={"method": method})))
    trainer = Trainer(job, device="cpu")
    engine = build_engine(job.spec)
    try:
        driver = SyncDriver(trainer, [engine])
        with torch.no_grad():  # move the trainer's weights so the sync has something to carry
            for p in trainer.actor.model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        m = driver.push_weights({})
        served = engine.named_parameters()
        for name, t in trainer.actor.full_named_parameters():
            assert torch.equal(served[name], t.to(served[name].dtype)), name
        assert engine.policy_version == trainer.version == 1
        assert m["weight_sync/payload_mb"] > 0
        if method == "full":
            assert m["weight_sync/buckets"] == 0.0 and m["weight_sync/direct_copy_s"] > 0
        else:
            assert m["weight_sync/buckets"] >= 1.0 and "weight_sync/direct_copy_s" not in m
    finally:
        engine.shutdown()
