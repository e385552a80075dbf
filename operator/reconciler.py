"""The two reconciles: spec (validate, render, server-side apply) and status (derive, patch, Events).

The spec reconcile runs from Kopf's create/update/resume handlers. The status reconcile runs from a
small work queue fed by every watch event on an RLJob or its children, so bursts of pod events for one
job collapse into one derivation and at most one status patch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from rlkube.api import RenderDefaults, RLJob, resolve, total_gpus, validate_rljob
from rlkube.api.contract import KUEUE_QUEUE_LABEL, TERMINAL_PHASES, now_rfc3339, parse_rfc3339
from rlkube.operator.render import SpecWarning, render_children

from . import metrics
from .apply import ChildConflict, ChildRefused, apply_children
from .cache import Cache, JobState, Key
from .kube import Kube, KubeError
from .policy import PolicySet, check_policy
from .status import Observed, Problem, derive, operator_status_view, refusal_reason, transitions

FIELD_MANAGER = "rlkube-operator"

log = logging.getLogger("rlkube.operator")


def format_field_error(err: Any) -> str:
    """One line naming the field and the fix, whatever shape the API's FieldError has."""
    path = getattr(err, "field", None) or getattr(err, "path", None) or getattr(err, "loc", None)
    if isinstance(path, list | tuple):
        path = ".".join(str(p) for p in path)
    msg = getattr(err, "message", None) or getattr(err, "msg", None)
    fix = getattr(err, "fix", None) or getattr(err, "hint", None)
    if path and msg:
        text = f"{path}: {msg}"
        return f"{text} ({fix})" if fix and str(fix) not in text else text
    return str(err)


def validate_body(body: Mapping[str, Any]) -> tuple[RLJob | None, list[str]]:
    """(the parsed RLJob or None, error lines). Structural errors from pydantic count as field errors.

    The one validation an RLJob gets: the renderer takes the resolved result and checks nothing again.
    """
    try:
        job = RLJob.model_validate(dict(body))
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            loc = (
                ".".join(str(p) for p in ("spec", *e["loc"][1:]))
                if e["loc"][:1] == ("spec",)
                else ".".join(map(str, e["loc"]))
            )
            lines.append(f"{loc}: {e['msg']}")
        return None, lines
    return job, [format_field_error(e) for e in validate_rljob(job)]


@dataclass
class Config:
    """What the CLI decides and the handlers read (Kopf's ``memo``)."""

    render_defaults: RenderDefaults | None = None
    field_manager: str = FIELD_MANAGER
    status_workers: int = 4
    status_delay_s: float = 0.5
    # False when watching an explicit namespace list: then Kopf needs no cluster-scoped reads at all.
    scan_cluster: bool = True
    # The admin policy: what RLJobs may ask for, per namespace.
    policy: PolicySet = field(default_factory=PolicySet)
    # Cluster-wide mode: namespaces never served (every watch filters them out server-side).
    exclude_namespaces: tuple[str, ...] = ()


@dataclass
class Reconciler:
    """Shared state of one operator process."""

    config: Config
    cache: Cache = field(default_factory=Cache)
    kube: Kube | None = None
    queue: asyncio.Queue[Key] = field(default_factory=asyncio.Queue)
    queued: set[Key] = field(default_factory=set)
    busy: set[Key] = field(default_factory=set)
    again: set[Key] = field(default_factory=set)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # uids of children the operator itself is deleting (undoing a refused attempt): not "deleted by hand".
    undoing: set[str] = field(default_factory=set)

    # ----------------------------------------------------------------------------- queue

    def mark(self, key: Key | None) -> None:
        """Ask for a status reconcile of ``key`` (coalesced with any already pending)."""
        if key is None:
            return
        if key in self.busy:
            self.again.add(key)
        elif key not in self.queued:
            self.queued.add(key)
            # A short delay coalesces a burst (RayCluster + pods + events of one job) into one patch.
            asyncio.get_running_loop().call_later(self.config.status_delay_s, self.queue.put_nowait, key)

    def start(self) -> None:
        for _ in range(self.config.status_workers):
            self.tasks.append(asyncio.create_task(self._worker()))

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            self.queued.discard(key)
            self.busy.add(key)
            try:
                await self.sync_status(key)
            except asyncio.CancelledError:
                raise
            except Exception:
                metrics.RECONCILE_ERRORS.labels("status").inc()
                log.exception("status reconcile of %s/%s failed; retrying in 2s", *key)
                asyncio.get_running_loop().call_later(2.0, self.mark, key)
            finally:
                self.busy.discard(key)
                if key in self.again:
                    self.again.discard(key)
                    self.mark(key)

    # ----------------------------------------------------------------------------- spec

    async def reconcile_spec(
        self, body: Mapping[str, Any], logger: logging.Logger | logging.LoggerAdapter[Any]
    ) -> None:
        """Validate and resolve once; if valid, render and server-side apply every child.

        Never retried for bad input. The renderer's warnings are posted as Warning Events on the RLJob
        when they first appear (not again on every update).
        """
        assert self.kube is not None
        meta = body["metadata"]
        key = (str(meta["namespace"]), str(meta["name"]))
        gen = int(meta.get("generation") or 1)
        state = self.cache.jobs.setdefault(key, JobState())
        state.generation = gen
        state.kueue_managed = KUEUE_QUEUE_LABEL in (meta.get("labels") or {})
        self.cache.put_rljob(body, deleted=False)
        job, errors = validate_body(body)
        if job is not None:
            state.algorithm = job.spec.algorithm.name
            state.mode = job.spec.training.mode
            state.gpus = int(total_gpus(job.spec))
        reason = "InvalidSpec"
        if job is not None and not errors:
            # The admin policy, on what the user wrote (the chart's admission policy says the same).
            scope, policy = self.config.policy.for_namespace(key[0])
            errors = [str(e) for e in check_policy(job.spec, policy, scope)]
            reason = "PolicyViolation"
        if errors or job is None:
            first = state.validation_errors != errors
            state.validation_errors = errors
            state.validation_reason = reason
            if first:
                logger.warning(
                    "%s: %s", "refused by the admin policy" if job else "invalid spec", "; ".join(errors)
                )
            self.mark(key)
            return
        state.validation_errors = []
        children = render_children(resolve(job), self.config.render_defaults)
        objs = children.all()
        state.ray_job_name = str(children.ray_job["metadata"]["name"])
        # Three waves: the RoleBinding needs its Role to exist (RBAC checks that the binder holds the
        # Role's rules, which it cannot do for a missing Role: 404), the RayJob needs them all.
        waves = [
            [children.service_account, children.role, children.config_map],
            [children.role_binding],
            [children.ray_job],
        ]
        try:
            created = await apply_children(
                self.kube,
                waves,
                owner_uid=str(meta["uid"]),
                field_manager=self.config.field_manager,
                undoing=self.undoing,
            )
        except ChildConflict as exc:
            self._child_problem(key, state, Problem("ChildConflict", str(exc)))
            raise
        except ChildRefused as exc:
            self._child_problem(key, state, Problem(refusal_reason(exc.error.message), str(exc)))
            raise
        state.child_problem = None
        state.applied_generation = gen
        log.info(
            "applied %d children of RLJob %s/%s (generation %d, %d created)",
            len(objs),
            key[0],
            key[1],
            gen,
            len(created),
        )
        await self._post_warnings(key, body, children.warnings, state)
        self.mark(key)

    def _child_problem(self, key: Key, state: JobState, problem: Problem) -> None:
        """Remember why no children were written (the status says it within a status cycle)."""
        if state.child_problem != problem:
            log.warning("RLJob %s/%s: %s: %s", key[0], key[1], problem.reason, problem.message)
        state.child_problem = problem
        metrics.CHILD_PROBLEMS.labels(problem.reason).inc()
        self.mark(key)

    async def _post_warnings(
        self, key: Key, body: Mapping[str, Any], warnings: list[SpecWarning], state: JobState
    ) -> None:
        """One Warning Event per renderer warning that was not already in force for this job."""
        assert self.kube is not None
        new = [w for w in warnings if w not in state.spec_warnings]
        state.spec_warnings = list(warnings)
        involved = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": body["metadata"]}
        for w in new:
            try:
                await self.kube.post_event(
                    involved, type_="Warning", reason=w.reason, message=w.message, now=now_rfc3339()
                )
            except KubeError as exc:  # best-effort, like every Event
                log.warning("cannot post event on %s/%s: %s", *key, exc)

    # ----------------------------------------------------------------------------- status

    async def sync_status(self, key: Key) -> None:
        """Derive status from the cache; patch it and post Events only when something changed."""
        assert self.kube is not None
        rljob = self.cache.rljobs.get(key)
        state = self.cache.jobs.get(key)
        if rljob is None or state is None or rljob["metadata"].get("deletionTimestamp"):
            return
        t0 = time.perf_counter()
        metrics.RECONCILES.labels("status").inc()
        rj, cluster, pods, events = self.cache.children_of(key)
        spec = rljob.get("spec") or {}
        obs = Observed(
            generation=int(rljob["metadata"].get("generation") or 1),
            suspend=bool(spec.get("suspend")),
            validation_errors=state.validation_errors,
            kueue_managed=state.kueue_managed,
            ray_job_name=state.ray_job_name or (str(rj["metadata"]["name"]) if rj else ""),
            ray_job=rj,
            ray_cluster=cluster,
            pods=pods,
            events=events,
            applied_generation=state.applied_generation,
            validation_reason=state.validation_reason,
            child_problem=state.child_problem,
        )
        current = rljob.get("status") or {}
        derived = derive(obs, current.get("conditions") or (), now=datetime.now(UTC))
        new = derived.to_status()
        new.update(self._extra_status(rljob, state, derived.phase, current))
        old_view = operator_status_view(current)
        for k in ("gpus", "startTime", "completionTime"):
            if k in current:
                old_view[k] = current[k]
        if {k: v for k, v in new.items()} == old_view:
            metrics.RECONCILE_DURATION.labels("status").observe(time.perf_counter() - t0)
            return
        try:
            await self.kube.patch_status("RLJob", key[0], key[1], new)
        except KubeError as exc:
            if exc.status == 404:
                return
            raise
        # Keep our copy current so a burst of events does not re-patch before the watch echoes it.
        rljob["status"] = {**current, **new}
        # The gauges follow the status just written, not the Events below (each an API call that
        # a loaded API server answers slowly): a scrape after the status shows its phase.
        self._observe_metrics(key, rljob, state, derived.phase, current.get("phase"))
        involved = {"apiVersion": rljob["apiVersion"], "kind": rljob["kind"], "metadata": rljob["metadata"]}
        stamp = now_rfc3339()
        for tr in transitions(current if current.get("conditions") else None, derived):
            try:
                await self.kube.post_event(
                    involved, type_=tr.type, reason=tr.reason, message=tr.message, now=stamp
                )
            except KubeError as exc:  # an Event is best-effort; the status already says it
                log.warning("cannot post event on %s/%s: %s", *key, exc)
        metrics.RECONCILE_DURATION.labels("status").observe(time.perf_counter() - t0)

    def _extra_status(
        self, rljob: Mapping[str, Any], state: JobState, phase: str, current: Mapping[str, Any]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if state.gpus is not None:
            out["gpus"] = state.gpus  # requested trainer + rollout GPUs (the GPUS column)
        if phase == "Running" and not current.get("startTime"):
            out["startTime"] = now_rfc3339()
        elif current.get("startTime"):
            out["startTime"] = current["startTime"]
        if phase in TERMINAL_PHASES and state.validation_errors == [] and not current.get("completionTime"):
            out["completionTime"] = now_rfc3339()
        elif current.get("completionTime"):
            out["completionTime"] = current["completionTime"]
        return out

    def _observe_metrics(
        self, key: Key, rljob: Mapping[str, Any], state: JobState, phase: str, old_phase: str | None
    ) -> None:
        if phase == "Running" and not state.running_seen:
            state.running_seen = True
            created = rljob["metadata"].get("creationTimestamp")
            if created:
                t = parse_rfc3339(str(created))
                metrics.TIME_TO_RUNNING.observe(max(0.0, (datetime.now(UTC) - t).total_seconds()))
        if old_phase and old_phase != phase:
            with contextlib.suppress(KeyError):
                metrics.RLJOB_INFO.remove(key[0], key[1], state.algorithm, state.mode, old_phase)
        metrics.RLJOB_INFO.labels(key[0], key[1], state.algorithm, state.mode, phase).set(1)
        self.refresh_phase_gauge(key, phase)

    def refresh_phase_gauge(self, key: Key | None = None, phase: str | None = None) -> None:
        """Count the cached RLJobs by phase; ``key`` counts as ``phase``, the phase just written
        (the cache holds the body from before that status patch until its watch event arrives,
        and nothing else may follow to refresh the gauge)."""
        counts: dict[str, int] = {}
        for k, body in self.cache.rljobs.items():
            ph = phase if k == key and phase else (body.get("status") or {}).get("phase") or "Pending"
            counts[ph] = counts.get(ph, 0) + 1
        metrics.set_phase_counts(counts)

    def forget(self, key: Key, body: Mapping[str, Any]) -> None:
        """Drop a deleted RLJob's in-memory state and its info series (children go by GC)."""
        state = self.cache.jobs.get(key)
        phase = (body.get("status") or {}).get("phase")
        if state is not None and phase:
            with contextlib.suppress(KeyError):
                metrics.RLJOB_INFO.remove(key[0], key[1], state.algorithm, state.mode, phase)
        self.cache.put_rljob(body, deleted=True)
        self.refresh_phase_gauge()

    # ----------------------------------------------------------------------------- children

    def child_deleted(self, body: Mapping[str, Any]) -> Key | None:
        """The RLJob to re-apply when one of its children was deleted while it is still active."""
        uid = str((body.get("metadata") or {}).get("uid"))
        if uid in self.undoing:
            self.undoing.discard(uid)  # our own rollback; the RLJob's retry takes it from here
            return None
        for ref in (body.get("metadata") or {}).get("ownerReferences") or ():
            if ref.get("kind") != "RLJob":
                continue
            key = self.cache.rljob_by_uid.get(str(ref.get("uid")))
            if key is None:
                return None
            rljob = self.cache.rljobs.get(key)
            state = self.cache.jobs.get(key)
            if (
                rljob is None
                or state is None
                or state.validation_errors
                or rljob["metadata"].get("deletionTimestamp")
            ):
                return None
            if (rljob.get("status") or {}).get("phase") in TERMINAL_PHASES:
                return None
            return key
        return None
