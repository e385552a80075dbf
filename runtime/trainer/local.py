"""All modes in one process (no Ray): the trainer and in-process engines share this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkube.api import RLJob
from rlkube.api.layout import rollout_engines, trainer_ranks
from rlkube.runtime.distributed.pool import EnginePool
from rlkube.runtime.trainer.core import Trainer
from rlkube.runtime.trainer.engines import build_engine
from rlkube.runtime.trainer.loop import RunResult, run_loop
from rlkube.runtime.trainer.modes import ColocateAsyncDriver, SeparateAsyncDriver, SyncDriver


def make_driver(trainer: Trainer, engines: list[Any]) -> Any:
    mode = trainer.spec.training.mode
    if mode == "sync":
        return SyncDriver(trainer, engines)
    if mode == "colocate_async":
        return ColocateAsyncDriver(trainer, engines)
    return SeparateAsyncDriver(trainer, engines)


def checkpoint_dir(job: RLJob, out: Path) -> Path:
    """spec.checkpoint.path (the PVC mount in a pod), else <output>/checkpoints."""
    return Path(job.spec.checkpoint.path) if job.spec.checkpoint.path else out / "checkpoints"


def run_local(
    job: RLJob, output_dir: str | Path, *, max_steps: int | None = None, device: str | None = None
) -> RunResult:
    ranks = trainer_ranks(job.spec)
    if ranks > 1:
        raise ValueError(
            f"this spec asks for {ranks} trainer ranks (trainer.replicas x trainer.gpusPerReplica); "
            "one process runs one: run it on Ray (rlkube-train without --no-ray)"
        )
    out = Path(output_dir)
    trainer = Trainer(job, device=device)
    n = rollout_engines(job.spec)
    engines = [build_engine(job.spec) for _ in range(n)]
    try:
        driver = make_driver(trainer, [EnginePool(engines, [f"rollout-{i}" for i in range(n)])])
        return run_loop(
            trainer,
            driver,
            out,
            max_steps=max_steps,
            checkpoint_dir=checkpoint_dir(job, out),
            num_gpus=1 if trainer.actor.device.type != "cpu" else 0,
        )
    finally:
        for e in engines:
            e.shutdown()
