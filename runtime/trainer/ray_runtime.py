"""The modes on Ray: one trainer actor and the rollout actors, placed by the worker-group resources.

The operator gives every worker pod a Ray logical resource named after its group (``rlkube_actor``
when trainer and rollout share GPUs, ``rlkube_trainer`` / ``rlkube_rollout`` in separate_async; see
``rlkube.api.ray_resource_name``). Actors ask for those resources, so they land on their group's pods;
locally, ``run_on_ray`` starts a Ray with the same resources so placement is exercised the same way.
The run loop lives in the trainer actor (it owns the weights and the metrics); the driver only waits
and then tears everything down, killing the actors and, if it started Ray, shutting it down.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from rlkube.api import RLJob, colocated, ray_resource_name
from rlkube.api.contract import ENV_RLJOB_NAME, ENV_RLJOB_NAMESPACE
from rlkube.runtime.trainer.loop import RunResult

log = logging.getLogger(__name__)

# Env every actor gets: never the repo root on sys.path, one thread per process on shared CPUs.
_PASS_ENV = (
    ENV_RLJOB_NAME,
    ENV_RLJOB_NAMESPACE,
    "RLKUBE_KUBECONFIG",
    "KUBECONFIG",
    "RLKUBE_PLATFORM",
    "VLLM_CPU_KVCACHE_SPACE",
    "RLKUBE_TORCH_THREADS",
    "HF_HUB_OFFLINE",
)


def _scrub_sys_path() -> None:
    """Drop a checkout root (it has an ``operator/`` folder shadowing the stdlib module) from sys.path."""
    for p in list(sys.path):
        root = Path(p or ".").resolve()
        if (root / "operator" / "__init__.py").exists() and (root / "pyproject.toml").exists():
            sys.path.remove(p)


def _threads() -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("RLKUBE_TORCH_THREADS", "1")))
    from rlkube.runtime.train import configure_logging

    configure_logging()  # an actor's INFO lines (resume, fallbacks) reach the driver's terminal


class RolloutWorker:
    """A rollout engine in its own Ray actor (the rollout interface, one method per call).

    The engine is built in ``start``, not ``__init__``: Ray keeps the exception of a failed method
    (a UserError reaches ``rlkube-train`` as one line) but only the text of a failed constructor.
    """

    def __init__(self, job: RLJob) -> None:
        _scrub_sys_path()
        _threads()
        self.job = job
        self.engine: Any = None

    def start(self) -> None:
        from rlkube.runtime.trainer.engines import build_engine

        self.engine = build_engine(self.job.spec)

    def generate(self, requests: list[Any]) -> list[Any]:
        return list(self.engine.generate(requests))

    def submit(self, requests: list[Any]) -> None:
        self.engine.submit(requests)

    def poll(self) -> list[Any]:
        return list(self.engine.poll())

    def abort_all(self) -> list[Any]:
        return list(self.engine.abort_all())

    def resume(self, partials: list[Any]) -> None:
        self.engine.resume(partials)

    def update_weights(self, buckets: list[Any], version: int) -> int:
        return len(self.engine.update_weights(buckets, version))

    def num_in_flight(self) -> int:
        return int(self.engine.num_in_flight())

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


class TrainerWorker:
    """The trainer actor: the Trainer core, the mode driver over remote engines, the run loop."""

    def __init__(self, job: RLJob, device: str | None = None) -> None:
        _scrub_sys_path()
        _threads()
        self.job = job
        self.device = device
        self.trainer: Any = None

    def start(self) -> None:
        """Load model, data and reward (in a method, so a user error keeps its type through Ray)."""
        from rlkube.runtime.trainer.core import Trainer

        self.trainer = Trainer(self.job, device=self.device)

    def pid(self) -> int:
        return os.getpid()

    def run(self, rollout_handles: list[Any], output_dir: str, max_steps: int | None) -> dict[str, Any]:
        from rlkube.runtime.trainer.engines import RayEngineProxy
        from rlkube.runtime.trainer.local import checkpoint_dir, make_driver
        from rlkube.runtime.trainer.loop import run_loop

        engines = [RayEngineProxy(h) for h in rollout_handles]
        driver = make_driver(self.trainer, engines)
        out = Path(output_dir)
        res = run_loop(
            self.trainer,
            driver,
            out,
            max_steps=max_steps,
            checkpoint_dir=checkpoint_dir(self.job, out),
            num_gpus=_gpus(self.job) if self.trainer.actor.device.type != "cpu" else 0,
        )
        return {
            "output_dir": str(res.output_dir),
            "steps_run": res.steps_run,
            "final_step": res.final_step,
            "metrics_path": str(res.metrics_path),
            "curve_path": str(res.curve_path) if res.curve_path else None,
            "resumed_from": res.resumed_from,
        }


def _gpus(job: RLJob) -> int:
    from rlkube.api import total_gpus

    return total_gpus(job.spec)


def placement(job: RLJob) -> tuple[dict[str, float], dict[str, Any], dict[str, Any]]:
    """(local Ray resources, trainer actor options, rollout actor options) for the spec's mode."""
    spec = job.spec
    unit = lambda gpus: float(max(gpus, 1))  # noqa: E731 - a pod's resource is worth its GPU count (1 on CPU)
    gpu_opts: dict[str, Any] = {}
    if spec.gpu.vendor != "cpu":
        from rlkube.runtime.platform import current_platform

        gpu_opts = current_platform().ray_options
    if colocated(spec):
        name = ray_resource_name("actor")
        total = unit(spec.trainer.gpus_per_replica) * spec.trainer.replicas
        n = max(spec.rollout.replicas, 1) if spec.training.mode != "sync" else 1
        trainer = {"resources": {name: 0.5}, "num_cpus": 0}
        rollout = {"resources": {name: 0.5 / n}, "num_cpus": 0}
        if gpu_opts:
            trainer.update(gpu_opts(0.5))  # type: ignore[operator]
            rollout.update(gpu_opts(0.5 / n))  # type: ignore[operator]
        return {name: total}, trainer, rollout
    tname, rname = ray_resource_name("trainer"), ray_resource_name("rollout")
    res = {
        tname: unit(spec.trainer.gpus_per_replica) * spec.trainer.replicas,
        rname: unit(spec.rollout.gpus_per_replica or 0) * spec.rollout.replicas,
    }
    trainer = {"resources": {tname: 1.0}, "num_cpus": 0}
    rollout = {"resources": {rname: unit(spec.rollout.gpus_per_replica or 0)}, "num_cpus": 0}
    if gpu_opts:
        trainer.update(gpu_opts(spec.trainer.gpus_per_replica))  # type: ignore[operator]
        rollout.update(gpu_opts(spec.rollout.gpus_per_replica or 0))  # type: ignore[operator]
    return res, trainer, rollout


def actor_env() -> dict[str, str]:
    env = {"PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update({k: os.environ[k] for k in _PASS_ENV if k in os.environ})
    return env


def run_on_ray(
    job: RLJob,
    output_dir: str | Path,
    *,
    max_steps: int | None = None,
    device: str | None = None,
    num_cpus: int = 2,
    timeout_s: float | None = None,
) -> RunResult:
    """Run the job's mode with Ray actors; start (and stop) a local Ray unless one is reachable."""
    import ray

    spec = job.spec
    resources, t_opts, r_opts = placement(job)
    started = False
    if not ray.is_initialized():
        runtime_env = {"env_vars": actor_env()}
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
        else:
            # Ray gives its raylet a fixed 30 s to register; on a loaded machine that can be too
            # short, so a failed start is cleaned up and retried.
            for attempt in range(3):
                try:
                    ray.init(
                        num_cpus=num_cpus,
                        resources=resources,
                        include_dashboard=False,
                        runtime_env=runtime_env,
                        log_to_driver=True,
                        _temp_dir=os.environ.get("RLKUBE_RAY_TMPDIR"),
                    )
                    break
                except Exception as e:
                    ray.shutdown()  # a half-started local Ray (GCS up, raylet not) must not outlive us
                    if attempt == 2:
                        raise
                    log.warning("local Ray did not start (%s); retrying", e)
                    time.sleep(5)
            started = True
    n_rollout = spec.rollout.replicas if spec.training.mode == "separate_async" else 1
    out = Path(output_dir).resolve()
    actors: list[Any] = []
    try:
        rollouts: list[Any] = [
            ray.remote(RolloutWorker).options(name=None, max_concurrency=1, **r_opts).remote(job)
            for _ in range(n_rollout)
        ]
        actors.extend(rollouts)
        trainer: Any = ray.remote(TrainerWorker).options(max_concurrency=1, **t_opts).remote(job, device)
        actors.append(trainer)
        ray.get([a.start.remote() for a in actors], timeout=timeout_s)
        res = ray.get(trainer.run.remote(rollouts, str(out), max_steps), timeout=timeout_s)
        for r in rollouts:
            ray.get(r.shutdown.remote(), timeout=60)
    finally:
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception as e:
                log.debug("kill actor: %s", e)
        if started:
            ray.shutdown()
    return RunResult(
        Path(res["output_dir"]),
        int(res["steps_run"]),
        int(res["final_step"]),
        Path(res["metrics_path"]),
        Path(res["curve_path"]) if res["curve_path"] else None,
        res["resumed_from"],
    )
