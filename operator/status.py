"""Derive an RLJob's phase and conditions from what KubeRay and the kubelet report.

Pure: no I/O, no clock (``now`` is passed in), inputs are plain API dicts (RayJob, RayCluster, pods,
Warning events). KubeRay's RayJob has no conditions and never surfaces pod-level failures, so this is
where "why is my job not running" gets its answer: the scheduler's Unschedulable message, image-pull
and crash-loop reasons from container statuses, deadline expiry from the RayJob's own reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from rlkube.api import Condition
from rlkube.api.contract import ConditionStatus, Phase, rfc3339

# Container waiting reasons that mean "this pod will not start without a change", most specific first.
_IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
_CONFIG_REASONS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
# KubeRay v1.5 jobDeploymentStatus values.
_DEPLOYMENT_FAILED = ("Failed", "ValidationFailed")
_DEPLOYMENT_SUSPENDED = ("Suspending", "Suspended")
# The kubelet alternates these two while it backs off a failing pull: one problem, one reason.
_PULL_RETRY_REASONS = ("ErrImagePull", "ImagePullBackOff")
# The spec field that sizes each Ray group's pods (the pod label rlkube.io/group), for OOM messages.
_MEMORY_FIELDS = {
    "head": "spec.head.memory",
    "actor": "spec.trainer.memory",
    "trainer": "spec.trainer.memory",
    "rollout": "spec.rollout.memory",
}
GROUP_LABEL = "rlkube.io/group"
# Ray's job message when the entrypoint exits non-zero; the driver's last log lines follow it.
_ENTRYPOINT_FAILED = re.compile(r"Job entrypoint command failed with exit code (-?\d+)")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(: |$)")
_RAY_OOM = ("OutOfMemoryError", "running low on memory")
MAX_MESSAGE = 1000
# Events worth carrying to the RLJob when pod status alone says nothing (e.g. quota, mounts).
_EVENT_REASONS = ("FailedScheduling", "FailedMount", "FailedAttachVolume", "FailedCreate", "FailedCreatePod")
# KubeRay's own Warning events when the API server refuses what it creates (pods, the submitter Job, the
# RayCluster); the message carries the API server's reason (quota, PodSecurity, PriorityClass, invalid).
_KUBERAY_CREATE_REASONS = (
    "FailedToCreateHeadPod",
    "FailedToCreateWorkerPod",
    "FailedToCreateRayJobSubmitter",
    "FailedToCreateRayCluster",
)
# The API server's refusal of a pod (or any object), as a reason users can alert on: first match wins.
REFUSAL_REASONS: tuple[tuple[str, str], ...] = (
    ("exceeded quota", "QuotaExceeded"),
    # A ResourceQuota whose usage the quota controller has not computed yet refuses every object it
    # counts ("status unknown for quota: q"); the user's remedy is the same quota.
    ("status unknown for quota", "QuotaExceeded"),
    ("violates PodSecurity", "PodSecurityRefused"),
    ("no PriorityClass with name", "PriorityClassNotFound"),
    ("is invalid", "InvalidPodSpec"),
    ("denied request", "AdmissionRefused"),
)
CREATE_REFUSED = "CreateRefused"


def condition_dict(c: Condition) -> dict[str, Any]:
    """One entry of ``status.conditions`` as the API writes it (keyed by type; no nulls)."""
    return c.model_dump(by_alias=True, exclude_none=True)


@dataclass(frozen=True)
class Problem:
    """A pod-level (or KubeRay-level) reason the cluster cannot become ready."""

    reason: str
    message: str


@dataclass(frozen=True)
class Observed:
    """Everything the status is derived from, gathered by the operator's watch cache."""

    generation: int
    suspend: bool = False
    # None: not validated yet; []: valid; else one message per field error (field named, fix said).
    validation_errors: Sequence[str] | None = None
    kueue_managed: bool = False
    ray_job_name: str = ""
    ray_job: Mapping[str, Any] | None = None
    ray_cluster: Mapping[str, Any] | None = None
    pods: Sequence[Mapping[str, Any]] = ()
    events: Sequence[Mapping[str, Any]] = ()
    # metadata.generation the children were last rendered from; None until the first apply.
    applied_generation: int | None = None
    # Why the spec is not valid: InvalidSpec (the API's rules) or PolicyViolation (the admin policy).
    validation_reason: str = "InvalidSpec"
    # Why the last spec reconcile wrote no children (ChildConflict, or the API's refusal of one).
    child_problem: Problem | None = None


@dataclass(frozen=True)
class DerivedStatus:
    """The operator-owned part of ``status`` (never ``progress``: the runtime owns that)."""

    phase: Phase
    reason: str
    message: str
    conditions: tuple[Condition, ...]
    observed_generation: int | None
    ray_job_name: str = ""
    ray_cluster_name: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    def to_status(self) -> dict[str, Any]:
        """The ``status`` body for a merge patch (lists replace, ``progress`` untouched)."""
        out: dict[str, Any] = {
            "phase": self.phase,
            "reason": self.reason,
            "message": self.message,
            "conditions": [condition_dict(c) for c in self.conditions],
        }
        if self.observed_generation is not None:
            out["observedGeneration"] = self.observed_generation
        if self.ray_job_name:
            out["rayJobName"] = self.ray_job_name
        if self.ray_cluster_name:
            out["rayClusterName"] = self.ray_cluster_name
        out.update(self.extra)
        return out


@dataclass(frozen=True)
class Transition:
    """An Event the operator posts because a phase or condition changed."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


# --------------------------------------------------------------------------------------------- pods


def _pod_name(pod: Mapping[str, Any]) -> str:
    return str(pod.get("metadata", {}).get("name", "?"))


def _container_statuses(pod: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    st = pod.get("status") or {}
    yield from st.get("initContainerStatuses") or ()
    yield from st.get("containerStatuses") or ()


def _memory_limit(pod: Mapping[str, Any], container: str) -> str:
    for c in (pod.get("spec") or {}).get("containers") or ():
        if c.get("name") == container:
            return str(((c.get("resources") or {}).get("limits") or {}).get("memory") or "")
    return ""


def _oom_problem(pod: Mapping[str, Any]) -> Problem | None:
    """A container the kernel killed at its memory limit (now or at its last exit), with the fix."""
    for cs in _container_statuses(pod):
        for term in (
            (cs.get("state") or {}).get("terminated"),
            (cs.get("lastState") or {}).get("terminated"),
        ):
            if not term or term.get("reason") != "OOMKilled":
                continue
            name = str(cs.get("name", "?"))
            limit = _memory_limit(pod, name) or "none"
            group = str(((pod.get("metadata") or {}).get("labels") or {}).get(GROUP_LABEL, ""))
            field = _MEMORY_FIELDS.get(group, "the memory of this pod's group")
            return Problem(
                "OOMKilled",
                f"pod {_pod_name(pod)} container {name} was OOMKilled at its memory limit {limit} "
                f"(exit code {term.get('exitCode', 137)}, restarted {cs.get('restartCount', 0)} times): "
                f"raise {field}",
            )
    return None


def _pull_error(image: str, message: str) -> str:
    """The pull's own error: the back-off message repeats it after `ErrImagePull: ` (kubelet 1.31+)."""
    _, sep, tail = message.partition("ErrImagePull: ")
    err = tail if sep else message
    return (
        f"cannot pull image {image}: {err}" if err and image not in err else (err or f"cannot pull {image}")
    )


def _waiting_problem(pod: Mapping[str, Any]) -> Problem | None:
    if (oom := _oom_problem(pod)) is not None:
        return oom
    for cs in _container_statuses(pod):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason") or ""
        msg = waiting.get("message") or ""
        where = f"pod {_pod_name(pod)} container {cs.get('name', '?')}"
        if reason in _PULL_RETRY_REASONS:
            # One reason while the kubelet retries (no flapping, one Event), the pull's own error.
            return Problem("ImagePullBackOff", f"{where}: {_pull_error(str(cs.get('image', '')), msg)}")
        if reason in _IMAGE_PULL_REASONS:
            return Problem(reason, f"{where}: {msg or 'cannot pull image ' + str(cs.get('image', ''))}")
        term = (cs.get("lastState") or {}).get("terminated") or {}
        restarts = int(cs.get("restartCount", 0) or 0)
        if reason == "CrashLoopBackOff" or (restarts and term and not cs.get("ready")):
            # Between two back-offs the container runs (not ready) for a moment: the same crash loop,
            # so the same reason and a message without the kubelet's changing back-off text (no
            # flapping, one Event per loop, not one per restart).
            last = ""
            if term:
                last = f" (last exit code {term.get('exitCode')}, reason {term.get('reason', 'Error')})"
            return Problem("CrashLoopBackOff", f"{where} restarted {restarts} times{last}")
        if reason in _CONFIG_REASONS:
            return Problem(reason, f"{where}: {msg}")
    return None


def _unschedulable(pod: Mapping[str, Any]) -> Problem | None:
    for cond in (pod.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            reason = cond.get("reason") or "Unschedulable"
            msg = cond.get("message") or "the scheduler found no node for this pod"
            return Problem(reason, f"pod {_pod_name(pod)}: {msg}")
    return None


def refusal_reason(message: str) -> str:
    """QuotaExceeded, PodSecurityRefused, ... for an API server refusal message; CreateRefused otherwise."""
    return next((reason for needle, reason in REFUSAL_REASONS if needle in message), CREATE_REFUSED)


def _event_problem(events: Sequence[Mapping[str, Any]]) -> Problem | None:
    """The newest Warning event with a reason worth showing (events list is oldest first).

    A refusal of something KubeRay or the Job controller creates (FailedToCreate*, FailedCreate) gets the
    alertable reason of the API server's message (QuotaExceeded, PodSecurityRefused, ...).
    """
    for ev in reversed(events):
        reason = str(ev.get("reason") or "")
        if ev.get("type") != "Warning" or reason not in (*_EVENT_REASONS, *_KUBERAY_CREATE_REASONS):
            continue
        obj = ev.get("involvedObject") or {}
        who = f"{str(obj.get('kind', '')).lower()} {obj.get('name', '')}".strip()
        message = str(ev.get("message") or "")
        if reason in _KUBERAY_CREATE_REASONS or reason in ("FailedCreate", "FailedCreatePod"):
            return Problem(refusal_reason(message), f"{who}: {reason}: {message}")
        return Problem(reason, f"{who}: {message}")
    return None


def _replica_failure(cluster: Mapping[str, Any] | None) -> Problem | None:
    """KubeRay's ReplicaFailure condition: the API server refused a pod of the RayCluster."""
    for cond in ((cluster or {}).get("status") or {}).get("conditions") or ():
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            name = ((cluster or {}).get("metadata") or {}).get("name", "")
            message = str(cond.get("message") or "")
            return Problem(
                refusal_reason(message),
                f"raycluster {name}: {cond.get('reason', 'ReplicaFailure')}: {message}",
            )
    return None


def diagnose(
    pods: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    cluster: Mapping[str, Any] | None = None,
) -> Problem | None:
    """The most actionable reason these pods are not all running, or None.

    Order: container errors (image pull, crash loop, bad config) beat scheduling, which beats a pod the
    API server refused to create (KubeRay's ReplicaFailure), which beats events, because a pod that has a
    node and still fails is the more specific story.
    """
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    for pod in live:
        if (problem := _waiting_problem(pod)) is not None:
            return problem
    for pod in live:
        if (problem := _unschedulable(pod)) is not None:
            return problem
    for pod in live:
        if (pod.get("status") or {}).get("phase") == "Failed":
            st = pod.get("status") or {}
            return Problem(
                "PodFailed", f"pod {_pod_name(pod)}: {st.get('reason', '')} {st.get('message', '')}"
            )
    return _replica_failure(cluster) or _event_problem(events)


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    st = pod.get("status") or {}
    if st.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or ())


# ------------------------------------------------------------------------------------------ cluster


def _cluster_condition(cluster: Mapping[str, Any], type_: str) -> str | None:
    for cond in (cluster.get("status") or {}).get("conditions") or ():
        if cond.get("type") == type_:
            return str(cond.get("status"))
    return None


def _quantity(value: Any) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0


def spec_gpus(cluster: Mapping[str, Any]) -> int:
    """GPUs the RayCluster's spec asks for: replicas x hosts x the GPU limits of each pod's
    containers (resources named ``*gpu``, as KubeRay counts them), head included.

    Why: KubeRay fills ``status.desiredGPU`` in a later reconcile than the one that sees the pods
    ready, so the summary would lack the count for a moment; the spec has it from the start.
    """
    spec = cluster.get("spec") or {}
    groups = [(spec.get("headGroupSpec") or {}, 1)]
    groups += [
        (g, int(g.get("replicas", 0) or 0) * int(g.get("numOfHosts", 1) or 1))
        for g in spec.get("workerGroupSpecs") or ()
    ]
    total = 0
    for group, pods in groups:
        containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or ()
        for c in containers:
            res = c.get("resources") or {}
            wanted = res.get("limits") or res.get("requests") or {}
            total += pods * sum(_quantity(v) for k, v in wanted.items() if str(k).lower().endswith("gpu"))
    return total


def cluster_ready(cluster: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]]) -> tuple[bool, str]:
    """Whether the RayCluster's head and every desired worker are ready, with a one-line summary.

    Uses the pods themselves, not only KubeRay's sticky RayClusterProvisioned: a worker that starts
    crash-looping after provisioning makes the cluster not ready again.
    """
    if cluster is None:
        return False, "waiting for KubeRay to create the RayCluster"
    st = cluster.get("status") or {}
    heads = [p for p in pods if (p.get("metadata") or {}).get("labels", {}).get("ray.io/node-type") == "head"]
    workers = [
        p for p in pods if (p.get("metadata") or {}).get("labels", {}).get("ray.io/node-type") == "worker"
    ]
    desired = st.get("desiredWorkerReplicas")
    if desired is None:
        desired = sum(
            int(g.get("replicas", 0) or 0) for g in (cluster.get("spec") or {}).get("workerGroupSpecs", ())
        )
    head_ready = any(_pod_ready(p) for p in heads) or (
        not heads and _cluster_condition(cluster, "HeadPodReady") == "True"
    )
    ready_workers = (
        sum(1 for p in workers if _pod_ready(p)) if workers else int(st.get("readyWorkerReplicas", 0) or 0)
    )
    gpus = st.get("desiredGPU")
    if gpus in (None, ""):
        gpus = str(spec_gpus(cluster))
    summary = f"head {'ready' if head_ready else 'not ready'}, {ready_workers}/{desired} workers ready"
    if gpus != "0":
        summary += f", {gpus} GPUs"
    return head_ready and ready_workers >= int(desired), summary


# ------------------------------------------------------------------------------------------- derive


def _merge_time(new: Condition, previous: Mapping[str, Mapping[str, Any]], now: str) -> Condition:
    """Keep lastTransitionTime when the condition's status did not change."""
    old = previous.get(new.type)
    if old is not None and old.get("status") == new.status and old.get("lastTransitionTime"):
        return new.model_copy(update={"last_transition_time": str(old["lastTransitionTime"])})
    return new.model_copy(update={"last_transition_time": now})


def derive(
    obs: Observed,
    previous_conditions: Sequence[Mapping[str, Any]] = (),
    *,
    now: datetime,
) -> DerivedStatus:
    """Phase, reason, message and the six conditions for one RLJob."""
    gen = obs.generation
    prev = {str(c.get("type")): c for c in previous_conditions if c.get("type")}
    ts = rfc3339(now)

    def cond(type_: str, status: ConditionStatus, reason: str, message: str = "") -> Condition:
        made = Condition(type=type_, status=status, reason=reason, message=message, observed_generation=gen)
        return _merge_time(made, prev, ts)

    # Valid: decided by the operator's validation, before anything is rendered.
    if obs.validation_errors is None:
        valid = cond("Valid", "Unknown", "Validating", "the operator has not validated this spec yet")
    elif obs.validation_errors:
        valid = cond("Valid", "False", obs.validation_reason, "; ".join(obs.validation_errors))
    else:
        valid = cond("Valid", "True", "SpecAccepted", "")

    rj = obs.ray_job
    rj_spec = (rj or {}).get("spec") or {}
    rj_st = (rj or {}).get("status") or {}
    deploy = str(rj_st.get("jobDeploymentStatus") or "")
    job_status = str(rj_st.get("jobStatus") or "")
    rj_reason = str(rj_st.get("reason") or "")
    rj_message = str(rj_st.get("message") or "")
    cluster_name = str(
        rj_st.get("rayClusterName") or ((obs.ray_cluster or {}).get("metadata") or {}).get("name") or ""
    )

    succeeded = deploy == "Complete" and job_status in ("SUCCEEDED", "")
    succeeded = succeeded or (job_status == "SUCCEEDED" and deploy not in _DEPLOYMENT_FAILED)
    failed = (
        deploy in _DEPLOYMENT_FAILED or job_status in ("FAILED", "STOPPED") or rj_reason == "DeadlineExceeded"
    )
    failed = failed and not succeeded

    # Suspended: the user's spec.suspend, KubeRay's own view, or Kueue holding the RayJob in its queue.
    rj_suspended = bool(rj_spec.get("suspend")) or deploy in _DEPLOYMENT_SUSPENDED
    if obs.suspend and rj is not None and deploy == "Suspending":
        suspended = cond(
            "Suspended", "True", "Suspending", "KubeRay is deleting the RayCluster; GPUs are being freed"
        )
    elif obs.suspend:
        suspended = cond("Suspended", "True", "SuspendedByUser", "spec.suspend is true; no GPU pods are held")
    elif obs.kueue_managed and rj_suspended:
        suspended = cond(
            "Suspended", "True", "QueuedByKueue", "the RayJob is suspended until Kueue admits it"
        )
    elif rj_suspended:
        suspended = cond("Suspended", "True", deploy or "Suspended", "the RayJob is suspended")
    else:
        suspended = cond("Suspended", "False", "NotSuspended", "")

    pods = [p for p in obs.pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    problem = diagnose(pods, obs.events, obs.ray_cluster)
    ready, summary = cluster_ready(obs.ray_cluster, pods)
    if obs.child_problem is not None and valid.status == "True":
        cluster = cond("ClusterReady", "False", obs.child_problem.reason, obs.child_problem.message)
    elif rj is None:
        cluster = cond("ClusterReady", "False", "RayJobNotCreated", "the RayJob has not been created yet")
    elif suspended.status == "True":
        cluster = cond("ClusterReady", "False", "Suspended", "the RayCluster is deleted while suspended")
    elif succeeded or failed:
        cluster = cond(
            "ClusterReady", "False", "JobFinished", f"the Ray job finished ({job_status or deploy})"
        )
    elif ready:
        cluster = cond("ClusterReady", "True", "RayClusterReady", f"RayCluster {cluster_name}: {summary}")
    elif problem is not None:
        cluster = cond("ClusterReady", "False", problem.reason, problem.message)
    elif obs.ray_cluster is None:
        cluster = cond("ClusterReady", "False", "RayClusterPending", summary)
    else:
        cluster = cond("ClusterReady", "False", "PodsPending", f"RayCluster {cluster_name}: {summary}")

    if job_status == "RUNNING" and not (succeeded or failed) and suspended.status != "True":
        running = cond("Running", "True", "JobRunning", rj_message or "the Ray job is running")
    elif succeeded or failed:
        running = cond("Running", "False", "JobFinished", f"the Ray job finished ({job_status or deploy})")
    elif deploy == "Retrying":
        running = cond(
            "Running", "False", "Retrying", rj_message or "KubeRay is retrying with a new RayCluster"
        )
    elif cluster.status == "True":
        running = cond(
            "Running",
            "False",
            "JobPending",
            f"RayJob {obs.ray_job_name} is {deploy or 'Initializing'}, "
            f"Ray job {job_status or 'not submitted'}",
        )
    else:
        running = cond("Running", "False", "WaitingForCluster", cluster.message)

    if succeeded:
        succ = cond("Succeeded", "True", "JobSucceeded", rj_message or "the Ray job succeeded")
    else:
        succ = cond("Succeeded", "False", "NotFinished" if not failed else "JobFailed", "")

    if valid.status == "False":
        fail = cond("Failed", "True", valid.reason, valid.message)
    elif failed:
        reason = rj_reason or ("JobStopped" if job_status == "STOPPED" else "JobFailed")
        if deploy == "ValidationFailed" and not rj_reason:
            reason = "ValidationFailed"
        msg = rj_message or f"RayJob {obs.ray_job_name}: jobDeploymentStatus {deploy}, jobStatus {job_status}"
        if (why := failure_cause(rj_message, problem)) is not None:
            reason, msg = why
        fail = cond("Failed", "True", reason, _clip(msg))
    else:
        fail = cond("Failed", "False", "NotFailed", "")

    conditions = (valid, cluster, running, succ, fail, suspended)

    phase: Phase
    if valid.status == "False":
        phase, lead = "Failed", fail
    elif succeeded:
        phase, lead = "Succeeded", succ
    elif failed:
        phase, lead = "Failed", fail
    elif suspended.status == "True":
        phase, lead = "Suspended", suspended
    elif running.status == "True":
        phase, lead = "Running", running
    elif rj is None:
        phase, lead = "Pending", valid if valid.status != "True" else cluster
    else:
        phase, lead = "Provisioning", cluster if cluster.status != "True" else running

    return DerivedStatus(
        phase=phase,
        reason=lead.reason,
        message=lead.message,
        conditions=conditions,
        observed_generation=obs.applied_generation if valid.status != "False" else gen,
        ray_job_name=obs.ray_job_name if rj is not None else "",
        ray_cluster_name=cluster_name,
    )


def _clip(message: str) -> str:
    """Status messages stay short: the full log is the pod's (`kubectl logs`)."""
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


def entrypoint_error(message: str) -> tuple[str, str] | None:
    """(exit code, the driver's own last error line) from Ray's "entrypoint failed" job message."""
    m = _ENTRYPOINT_FAILED.search(message)
    if m is None:
        return None
    lines = [ln.strip() for ln in message[m.end() :].splitlines() if ln.strip()]
    own = next((ln for ln in reversed(lines) if _EXCEPTION_LINE.match(ln)), lines[-1] if lines else "")
    return m.group(1), own


def failure_cause(ray_message: str, problem: Problem | None) -> tuple[str, str] | None:
    """(reason, message) of a failed job when more specific than KubeRay's: memory, or the error the
    entrypoint (rlkube-train) itself printed; None keeps KubeRay's reason and message."""
    if problem is not None and problem.reason == "OOMKilled":
        return "OOMKilled", problem.message
    if any(marker in ray_message for marker in _RAY_OOM):
        line = next((ln.strip() for ln in ray_message.splitlines() if any(m in ln for m in _RAY_OOM)), "")
        return "OOMKilled", f"Ray killed a worker for memory: {line}"
    found = entrypoint_error(ray_message)
    if found is None:
        return None
    code, own = found
    if code in ("-9", "137") and not _EXCEPTION_LINE.match(own):
        return "EntrypointFailed", (
            f"rlkube-train was killed (exit code {code}), most often at the head's memory limit: "
            "raise spec.head.memory"
        )
    return "EntrypointFailed", f"rlkube-train exited with code {code}: {own}"


_BAD = {
    ("Valid", "False"),
    ("Failed", "True"),
}


def transitions(previous: Mapping[str, Any] | None, new: DerivedStatus) -> list[Transition]:
    """Events for every phase change, every condition status change, and every new problem reason.

    A Normal reason-only change (RayClusterPending -> PodsPending) is visible in the status but posts
    nothing: at 500 jobs those Events were a third of the operator's API requests.
    """
    previous = previous or {}
    out: list[Transition] = []
    old_conds = {str(c.get("type")): c for c in previous.get("conditions") or () if c.get("type")}
    for c in new.conditions:
        old = old_conds.get(c.type)
        if old is not None and old.get("status") == c.status and old.get("reason") == c.reason:
            continue
        if c.type == "Failed" and c.reason in ("InvalidSpec", "PolicyViolation"):
            continue  # Valid=False already said it
        if old is None and c.status != "True" and (c.type, c.status) not in _BAD and c.type != "ClusterReady":
            continue  # the initial False/Unknown of every condition is noise, not news
        warning = (c.type, c.status) in _BAD or (
            c.type == "ClusterReady" and c.status == "False" and c.reason in _PROBLEM_REASONS
        )
        if c.type == "ClusterReady" and c.status == "False" and not warning and old is None:
            continue
        if old is not None and old.get("status") == c.status and not warning:
            continue
        text = f"{c.type}={c.status}" + (f": {c.message}" if c.message else "")
        out.append(Transition("Warning" if warning else "Normal", c.reason, text))
    if previous.get("phase") != new.phase:
        kind: Literal["Normal", "Warning"] = "Warning" if new.phase == "Failed" else "Normal"
        was = previous.get("phase") or "none"
        out.append(
            Transition(kind, f"Phase{new.phase}", f"phase {was} -> {new.phase}: {new.message}".rstrip(": "))
        )
    return out


_PROBLEM_REASONS = frozenset(
    (
        *_IMAGE_PULL_REASONS,
        "OOMKilled",
        *_CONFIG_REASONS,
        "CrashLoopBackOff",
        "Unschedulable",
        "PodFailed",
        *_EVENT_REASONS,
        *(reason for _, reason in REFUSAL_REASONS),
        CREATE_REFUSED,
        "ChildConflict",
    )
)


def operator_status_view(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """The operator-owned keys of a live ``status`` (to compare with a derived one)."""
    status = status or {}
    keys = ("phase", "reason", "message", "conditions", "observedGeneration", "rayJobName", "rayClusterName")
    return {k: status[k] for k in keys if k in status}
