"""The modes on Ray: one actor per trainer rank and one per rollout engine, placed by placement groups.

``run_on_ray`` (the driver: the RayJob's entrypoint, or a local Ray it starts) lays the job out as
``rlkube.api.layout`` says: ``trainer.replicas x gpusPerReplica`` trainer ranks in one
torch.distributed world (FSDP2), ``rollout devices / tensorParallelSize`` engines behind one
balancer, weight groups joining trainer ranks and engine workers. Placement groups put each rank
and engine on its pod (``rlkube.runtime.distributed.placement``). Rank 0 runs the mode driver and
the run loop (it owns metrics, status and checkpoints) and calls the other ranks for each step's
model work. The driver waits for rank 0 and, at the same time, for any actor to die: a rank or
engine that dies fails the job within seconds with its name, never a hang; everything the driver
started is killed on the way out, and a local Ray it started is shut down.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rlkube.api import RLJob, total_gpus
from rlkube.api.contract import ENV_RLJOB_NAME, ENV_RLJOB_NAMESPACE
from rlkube.runtime.distributed.ranks import TrainerRank
from rlkube.runtime.distributed.remote import EngineHost
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
LAYOUT_FILE = "layout.json"


class JobFailed(RuntimeError):
    """The job stopped because a rank or an engine died or raised; the message names which."""


def _scrub_sys_path() -> None:
    """Drop a checkout root (it has an ``operator/`` folder shadowing the stdlib module) from sys.path."""
    for p in list(sys.path):
        root = Path(p or ".").resolve()
        if (root / "operator" / "__init__.py").exists() and (root / "pyproject.toml").exists():
            sys.path.remove(p)


def _threads() -> None:
    import torch

    # A native crash (SIGSEGV, SIGABRT from a corrupted heap) prints every thread's Python stack
    # into the actor's log before the process dies; the driver repeats that log's tail (_Job._died).
    faulthandler.enable(all_threads=True)

    torch.set_num_threads(int(os.environ.get("RLKUBE_TORCH_THREADS", "1")))
    from rlkube.runtime.train import configure_logging

    configure_logging()  # an actor's INFO lines (resume, fallbacks) reach the driver's terminal


class _Watched:
    """What every actor of the job answers: ``watch`` never returns while the actor lives, so the
    driver learns of a death the moment Ray does (it runs in its own concurrency group)."""

    def watch(self) -> None:
        threading.Event().wait()


class RankActor(TrainerRank, _Watched):
    """A trainer rank in a Ray actor; rank 0 also runs the job (:meth:`run`)."""

    def __init__(self, rank: int, world_size: int, device: str | None = None) -> None:
        _scrub_sys_path()
        _threads()
        super().__init__(rank, world_size, device, freeze_heap=True)

    def run(
        self,
        job: RLJob,
        engines: list[tuple[Any, str]],
        peers: list[Any],
        output_dir: str,
        max_steps: int | None,
        collective: bool,
    ) -> dict[str, Any]:
        """Rank 0: the Trainer over every rank, the mode driver over the engine pool, the run loop."""
        from rlkube.runtime.distributed.pool import EnginePool
        from rlkube.runtime.distributed.remote import RemoteEngine
        from rlkube.runtime.trainer.core import Trainer
        from rlkube.runtime.trainer.local import checkpoint_dir, make_driver
        from rlkube.runtime.trainer.loop import run_loop

        trainer = Trainer(job, learner=self.learner, peers=peers)
        pool = EnginePool([RemoteEngine(h, n) for h, n in engines], [n for _, n in engines])
        pool.collective_ready = collective
        driver = make_driver(trainer, [pool])
        out = Path(output_dir)
        res = run_loop(
            trainer,
            driver,
            out,
            max_steps=max_steps,
            checkpoint_dir=checkpoint_dir(job, out),
            num_gpus=total_gpus(job.spec) if trainer.actor.device.type != "cpu" else 0,
            freeze_heap=True,  # this actor's process is the rank's own
        )
        return {
            "output_dir": str(res.output_dir),
            "steps_run": res.steps_run,
            "final_step": res.final_step,
            "metrics_path": str(res.metrics_path),
            "curve_path": str(res.curve_path) if res.curve_path else None,
            "resumed_from": res.resumed_from,
        }


class EngineActor(EngineHost, _Watched):
    """A rollout engine in a Ray actor."""

    def __init__(self, name: str, build: Any) -> None:
        _scrub_sys_path()
        _threads()
        super().__init__(name, build)


def actor_env() -> dict[str, str]:
    env = {"PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update({k: os.environ[k] for k in _PASS_ENV if k in os.environ})
    return env


def _start_ray(resources: dict[str, float], num_cpus: int) -> bool:
    """Join RAY_ADDRESS or start a local Ray advertising ``resources``; True when started here."""
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": actor_env()}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
        return False
    # Ray gives its raylet a fixed 30 s to register; on a loaded machine that can be too short, so a
    # failed start is cleaned up and retried.
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
            return True
        except Exception as e:
            ray.shutdown()  # a half-started local Ray (GCS up, raylet not) must not outlive us
            if attempt == 2:
                raise
            log.warning("local Ray did not start (%s); retrying", e)
            time.sleep(5)
    return True


class _Job:
    """The actors of one run, by label (``trainer rank 1``, ``rollout engine rollout-0``)."""

    def __init__(self) -> None:
        self.actors: dict[str, Any] = {}
        self.watches: dict[Any, str] = {}
        self.groups: list[Any] = []
        self.where: dict[str, dict[str, Any]] = {}  # pid and node by label, once the actors said

    def add(self, label: str, actor: Any) -> Any:
        self.actors[label] = actor
        self.watches[actor.watch.options(concurrency_group="watch").remote()] = label
        return actor

    def get(self, refs: list[Any], timeout_s: float | None = None) -> list[Any]:
        """``ray.get`` that fails as soon as any actor of the job dies, naming it."""
        import ray

        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, _ = ray.wait([*pending, *self.watches], num_returns=1, timeout=left)
            if not ready:
                raise JobFailed(f"timed out after {timeout_s:.0f} s waiting for the job's actors")
            for r in ready:
                if r in self.watches:
                    raise JobFailed(self._died(r))
                pending.remove(r)
        try:
            return list(ray.get(list(refs)))
        except Exception as e:
            dead = self.dead()
            raise JobFailed(f"{'; '.join(dead) + ': ' if dead else ''}{_cause(e)}") from e

    def _died(self, ref: Any) -> str:
        import ray

        label = self.watches[ref]
        try:
            ray.get(ref)
            cause = "exited"
        except Exception as e:
            cause = _cause(e)
        tail = _log_tail(self.where.get(label, {}))
        if tail:  # a crash's own words (faulthandler's stacks, glibc's abort message), kept apart
            # from the one-line reason, which is what the RLJob's status shows
            log.error("the last lines %s wrote before it died:\n%s", label, tail)
        return f"{label} died: {cause}"

    def dead(self) -> list[str]:
        """Labels of actors that are gone (checked without waiting on busy ones)."""
        import ray

        ready, _ = ray.wait(list(self.watches), num_returns=len(self.watches), timeout=2.0)
        return [self._died(r) for r in ready]

    def kill(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors.values():
            try:
                ray.kill(a, no_restart=True)
            except Exception as e:
                log.debug("kill actor: %s", e)
        for g in self.groups:
            try:
                remove_placement_group(g)
            except Exception as e:
                log.debug("remove placement group: %s", e)


def _log_tail(where: dict[str, Any], lines: int = 40) -> str:
    """The end of the stderr log Ray keeps for an actor's worker process (``where``: its pid and
    node), when it ran on the driver's node (a dead actor's last words: Ray forwards them to the
    driver only until the job fails)."""
    pid = where.get("pid")
    if pid is None:
        return ""
    try:
        import ray

        if where.get("node_id") != ray.get_runtime_context().get_node_id():
            return ""  # its log is on another node (the pod's own logs keep it)
        node: Any = ray._private.worker.global_worker.node  # this driver's Ray node
        logs = Path(node.get_logs_dir_path())
        found = sorted(logs.glob(f"worker-*-{pid}.err"), key=lambda f: f.stat().st_mtime)
        if not found:
            return ""
        with found[-1].open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except Exception as e:  # another node's worker, or a Ray without these internals
        log.debug("no log tail for pid %s: %s", pid, e)
        return ""
    kept = [x for x in text.splitlines() if x.strip()][-lines:]
    return "\n".join(kept)


def _cause(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    return lines[-1] if lines else type(e).__name__


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

    from rlkube.runtime.distributed.placement import (
        actor_options,
        create_placement_groups,
        engine_env,
        plan_placement,
    )
    from rlkube.runtime.trainer.engines import build_engine
    from rlkube.runtime.weights.collective import DEFAULT_TIMEOUT_S, weight_group_specs

    spec = job.spec
    plan = plan_placement(spec)
    lay = plan.layout
    started = _start_ray(plan.local_resources(), num_cpus)
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run = _Job()
    backend = "nccl" if plan.gpus and device != "cpu" else "gloo"
    t_start = time.monotonic()
    try:
        pg_trainer, pg_rollout = create_placement_groups(plan)
        run.groups = [pg_trainer] if pg_rollout is pg_trainer else [pg_trainer, pg_rollout]
        watched: Any = ray.remote(concurrency_groups={"watch": 1}, max_concurrency=1)  # type: ignore[call-overload]
        ranks = [
            run.add(
                f"trainer rank {r}",
                watched(RankActor)
                .options(**actor_options(pg_trainer, plan.rank_bundle(r), plan.rank_resources()))
                .remote(r, lay.trainer_ranks, device),
            )
            for r in range(lay.trainer_ranks)
        ]
        names = [f"rollout-{e}" for e in range(lay.engines)]
        engine_group = pg_trainer if lay.colocated else pg_rollout
        envs: list[dict[str, str]] = [{} for _ in names]
        if lay.colocated and plan.gpus:  # each engine sees exactly its trainer ranks' devices
            devices = [
                w.get("accelerators", {}).get("GPU", []) for w in run.get([r.where.remote() for r in ranks])
            ]
            var = _visible_devices_var(spec.gpu.vendor)
            envs = [engine_env(var, [devices[r] for r in plan.colocated_ranks(e)]) for e in range(len(names))]
        hosts = [
            run.add(
                f"rollout engine {n}",
                watched(EngineActor)
                .options(
                    **actor_options(engine_group, plan.engine_bundle(e), plan.engine_resources()),
                    **({"runtime_env": {"env_vars": envs[e]}} if envs[e] else {}),
                )
                .remote(n, functools.partial(build_engine, spec)),
            )
            for e, n in enumerate(names)
        ]
        # Engines load while the ranks meet; built in a method, not the constructor, so a user
        # error (model.path, vLLM sizing) keeps its type through Ray and rlkube-train exits 2.
        engines_started = [h.start.remote() for h in hosts]
        host, port = run.get([ranks[0].rendezvous.remote()])[0]
        run.get([r.join.remote(host, port, backend, DEFAULT_TIMEOUT_S) for r in ranks])
        run.get([r.build.remote(spec) for r in ranks])
        run.get(engines_started)
        caps = run.get([h.get.remote("capabilities") for h in hosts])
        workers = run.get([h.get.remote("weight_workers") for h in hosts])
        collective = all(c.distributed_weights for c in caps) and all(w > 0 for w in workers)
        if collective:
            whost, wport = run.get([ranks[0].rendezvous.remote()])[0]
            sources = list(range(lay.trainer_ranks)) if spec.weight_sync.method == "delta_sharded" else [0]
            specs = weight_group_specs(whost, wport, sources, sum(workers), backend, DEFAULT_TIMEOUT_S)
            firsts = [1 + sum(workers[:i]) for i in range(len(hosts))]
            run.get(
                [h.call.remote("join_weight_groups", specs, f) for h, f in zip(hosts, firsts, strict=True)]
                + [r.call.remote("join_weight_groups", specs) for r in ranks]
            )
        where = run.get([a.where.remote() for a in [*ranks, *hosts]])
        run.where = dict(zip(run.actors, where, strict=True))
        _write_layout(out / LAYOUT_FILE, spec, lay, where, backend, collective)
        log.info(
            "%d trainer rank(s), %d rollout engine(s) (%s weight sync) up in %.1f s",
            lay.trainer_ranks,
            lay.engines,
            "collective" if collective else "object-store",
            time.monotonic() - t_start,
        )
        left = None if timeout_s is None else max(timeout_s - (time.monotonic() - t_start), 1.0)
        res = run.get(
            [
                ranks[0].run.remote(
                    job, list(zip(hosts, names, strict=True)), ranks[1:], str(out), max_steps, collective
                )
            ],
            left,
        )[0]
        run.get([h.call.remote("shutdown") for h in hosts], 60.0)
    finally:
        run.kill()
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


def _visible_devices_var(vendor: str) -> str | None:
    """The visible-devices variable of the platform that serves ``vendor``."""
    from rlkube.runtime.platform import registered_platforms

    for cls in registered_platforms().values():
        if cls.vendor == vendor:
            return cls.visible_devices_var
    return None


def _write_layout(
    path: Path, spec: Any, lay: Any, where: list[dict[str, Any]], backend: str, collective: bool
) -> None:
    """``layout.json``: every rank's and engine's pid, node and devices (what ran where)."""
    doc = {
        "mode": spec.training.mode,
        "trainer_ranks": lay.trainer_ranks,
        "ranks_per_pod": lay.ranks_per_pod,
        "engines": lay.engines,
        "tensor_parallel_size": lay.tp,
        "backend": backend,
        "weight_sync": "collective" if collective else "object_store",
        "ranks": where[: lay.trainer_ranks],
        "rollout": where[lay.trainer_ranks :],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)
