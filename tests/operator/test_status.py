"""Status derivation from hand-built RayJob/RayCluster/pod/event objects (pure, no cluster).

The shapes are the ones KubeRay v1.5 and the kubelet write; the cluster tests check the same paths
against the real API server.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rlkube.operator.status import (
    Observed,
    Problem,
    condition_dict,
    derive,
    operator_status_view,
    transitions,
)

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def ray_job(
    deploy: str = "Initializing", job: str = "", reason: str = "", message: str = "", **spec: Any
) -> dict:
    st: dict[str, Any] = {"jobDeploymentStatus": deploy, "rayClusterName": "j-abcde"}
    if job:
        st["jobStatus"] = job
    if reason:
        st["reason"] = reason
    if message:
        st["message"] = message
    return {"metadata": {"name": "j"}, "spec": dict(spec), "status": st}


def cluster(workers: int = 1, gpus: str = "8") -> dict:
    return {
        "metadata": {"name": "j-abcde"},
        "spec": {"workerGroupSpecs": [{"groupName": "trainer", "replicas": workers}]},
        "status": {"desiredWorkerReplicas": workers, "desiredGPU": gpus},
    }


def pod(name: str, kind: str = "worker", *, ready: bool = True, **status: Any) -> dict:
    st: dict[str, Any] = {"phase": "Running" if ready else "Pending", "conditions": []}
    if ready:
        st["conditions"].append({"type": "Ready", "status": "True"})
    st.update(status)
    return {"metadata": {"name": name, "labels": {"ray.io/node-type": kind}}, "status": st}


def obs(**kw: Any) -> Observed:
    base: dict[str, Any] = dict(generation=1, validation_errors=[], ray_job_name="j", applied_generation=1)
    base.update(kw)
    return Observed(**base)


def conds(d: Any) -> dict[str, tuple[str, str, str]]:
    return {c.type: (c.status, c.reason, c.message) for c in d.conditions}


def test_pending_before_the_rayjob_exists() -> None:
    d = derive(obs(), now=NOW)
    assert d.phase == "Pending"
    assert conds(d)["Valid"][:2] == ("True", "SpecAccepted")
    assert conds(d)["ClusterReady"][1] == "RayJobNotCreated"


def test_invalid_spec_fails_with_the_field_message_and_observes_generation() -> None:
    msg = "spec.training.trainBatchSize: must equal parameterSyncStep x miniBatchSize (set it to 128)"
    d = derive(obs(generation=3, validation_errors=[msg], applied_generation=None), now=NOW)
    assert d.phase == "Failed" and d.reason == "InvalidSpec" and msg in d.message
    assert conds(d)["Valid"] == ("False", "InvalidSpec", msg)
    assert d.observed_generation == 3
    assert any(t.type == "Warning" and t.reason == "InvalidSpec" for t in transitions(None, d))


def test_provisioning_then_cluster_ready_then_running() -> None:
    p = derive(obs(ray_job=ray_job(), ray_cluster=cluster(), pods=[pod("h", "head", ready=False)]), now=NOW)
    assert p.phase == "Provisioning" and conds(p)["ClusterReady"][1] == "PodsPending"
    r = derive(
        obs(ray_job=ray_job("Running"), ray_cluster=cluster(), pods=[pod("h", "head"), pod("w")]), now=NOW
    )
    assert r.phase == "Provisioning"
    assert conds(r)["ClusterReady"][:2] == ("True", "RayClusterReady")
    assert "8 GPUs" in conds(r)["ClusterReady"][2]
    assert conds(r)["Running"][1] == "JobPending"
    run = derive(
        obs(ray_job=ray_job("Running", "RUNNING"), ray_cluster=cluster(), pods=[pod("h", "head"), pod("w")]),
        now=NOW,
    )
    assert run.phase == "Running" and conds(run)["Running"][0] == "True"


def test_cluster_ready_counts_gpus_from_the_spec_before_kuberay_reports_them() -> None:
    """KubeRay sets status.desiredGPU a reconcile after the pods are ready; the count is there anyway."""
    c = cluster(workers=2)
    del c["status"]["desiredGPU"]
    gpu_pod = {
        "spec": {
            "containers": [{"name": "ray-worker", "resources": {"limits": {"amd.com/gpu": "4", "cpu": "8"}}}]
        }
    }
    c["spec"]["workerGroupSpecs"][0].update(template=gpu_pod)
    c["spec"]["headGroupSpec"] = {"template": {"spec": {"containers": [{"name": "ray-head"}]}}}
    d = derive(obs(ray_job=ray_job(), ray_cluster=c, pods=[pod("h", "head"), pod("w1"), pod("w2")]), now=NOW)
    assert conds(d)["ClusterReady"][:2] == ("True", "RayClusterReady")
    assert conds(d)["ClusterReady"][2].endswith("2/2 workers ready, 8 GPUs")
    c["spec"]["workerGroupSpecs"][0]["template"] = {"spec": {"containers": [{"name": "cpu-only"}]}}
    d = derive(obs(ray_job=ray_job(), ray_cluster=c, pods=[pod("h", "head"), pod("w1"), pod("w2")]), now=NOW)
    assert "GPUs" not in conds(d)["ClusterReady"][2]


def test_unschedulable_message_from_the_scheduler_reaches_the_condition() -> None:
    sched = "0/4 nodes are available: 4 Insufficient amd.com/gpu. preemption: not helpful"
    w = pod(
        "w",
        ready=False,
        conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": sched}],
    )
    d = derive(obs(ray_job=ray_job(), ray_cluster=cluster(), pods=[pod("h", "head"), w]), now=NOW)
    assert d.phase == "Provisioning" and d.reason == "Unschedulable"
    assert sched in d.message and "pod w" in d.message
    assert any(t.type == "Warning" and t.reason == "Unschedulable" for t in transitions(None, d))


def test_image_pull_beats_scheduling_and_names_the_container() -> None:
    cs = [
        {
            "name": "ray-worker",
            "state": {
                "waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "nope:1"'}
            },
        }
    ]
    d = derive(
        obs(
            ray_job=ray_job(),
            ray_cluster=cluster(),
            pods=[pod("h", "head", ready=False, containerStatuses=cs)],
        ),
        now=NOW,
    )
    assert (d.reason, d.phase) == ("ImagePullBackOff", "Provisioning")
    assert 'Back-off pulling image "nope:1"' in d.message and "ray-worker" in d.message


def test_image_pull_retries_are_one_reason_with_the_pulls_own_error() -> None:
    """The kubelet flips ErrImagePull <-> ImagePullBackOff on every retry; the RLJob does not."""
    err = 'failed to pull and unpack image "docker.io/rlkube/nope:0": connection refused'

    def derived(waiting: dict[str, str]) -> Any:
        cs = [{"name": "ray-head", "image": "rlkube/nope:0", "state": {"waiting": waiting}}]
        o = obs(
            ray_job=ray_job(),
            ray_cluster=cluster(),
            pods=[pod("h", "head", ready=False, containerStatuses=cs)],
        )
        return derive(o, now=NOW)

    first = derived({"reason": "ErrImagePull", "message": err})
    backoff = derived(
        {
            "reason": "ImagePullBackOff",
            "message": f'Back-off pulling image "rlkube/nope:0": ErrImagePull: {err}',
        }
    )
    assert first.reason == backoff.reason == "ImagePullBackOff"
    assert (
        first.message == backoff.message
        and err in first.message
        and "pod h container ray-head" in first.message
    )
    assert not transitions(first.to_status(), backoff), "a retry of the same pull posts no Event"


def test_a_crash_loop_keeps_one_reason_between_restarts() -> None:
    """While it waits and while it briefly runs again, a restarting container is one CrashLoopBackOff."""
    term = {"lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}
    waiting = {
        "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}
    }

    def derived(state: dict[str, Any], restarts: int) -> Any:
        cs = [{"name": "ray-worker", "restartCount": restarts, "ready": False, "state": state, **term}]
        pods = [pod("h", "head"), pod("w", ready=False, containerStatuses=cs)]
        return derive(obs(ray_job=ray_job(), ray_cluster=cluster(), pods=pods), now=NOW)

    looping, running = derived(waiting, 3), derived({"running": {}}, 4)
    assert looping.reason == running.reason == "CrashLoopBackOff"
    assert "restarted 3 times (last exit code 1, reason Error)" in looping.message
    assert "back-off" not in looping.message
    assert not transitions(looping.to_status(), running), "a restart of the same loop posts no Event"


def test_oomkilled_container_names_the_limit_and_the_field_to_raise() -> None:
    cs = [
        {
            "name": "ray-worker",
            "restartCount": 2,
            "state": {"running": {}},
            "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
        }
    ]
    worker = pod("w", ready=False, containerStatuses=cs)
    worker["metadata"]["labels"]["rlkube.io/group"] = "actor"
    worker["spec"] = {"containers": [{"name": "ray-worker", "resources": {"limits": {"memory": "300Mi"}}}]}
    d = derive(obs(ray_job=ray_job(), ray_cluster=cluster(), pods=[pod("h", "head"), worker]), now=NOW)
    assert (d.phase, d.reason) == ("Provisioning", "OOMKilled")
    assert "pod w container ray-worker" in d.message and "300Mi" in d.message
    assert "raise spec.trainer.memory" in d.message
    assert [t.type for t in transitions(None, d) if t.reason == "OOMKilled"] == ["Warning"]


def test_entrypoint_crash_fails_with_the_drivers_own_error_line() -> None:
    error = "ImportError: custom reward 'nope:f': cannot import module 'nope' (No module named 'nope')"
    trace = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>', error]
    logs = "\n".join(["INFO starting", *trace, "", "---------------------------------------"])
    head = "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars)"
    msg = f"{head}:\n{logs}"
    d = derive(obs(ray_job=ray_job("Complete", "FAILED", message=msg), ray_cluster=cluster()), now=NOW)
    assert (d.phase, d.reason) == ("Failed", "EntrypointFailed")
    assert d.message == (
        "rlkube-train exited with code 1: ImportError: custom reward 'nope:f': cannot import module 'nope' "
        "(No module named 'nope')"
    )
    killed_msg = msg.replace("code 1", "code -9").replace(logs, "x")
    killed = derive(
        obs(ray_job=ray_job("Complete", "FAILED", message=killed_msg), ray_cluster=cluster()), now=NOW
    )
    assert killed.reason == "EntrypointFailed" and "spec.head.memory" in killed.message


def test_failed_job_with_an_oomkilled_pod_or_rays_oom_error_says_oomkilled() -> None:
    cs = [{"name": "ray-head", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]
    head = pod("h", "head", ready=False, containerStatuses=cs)
    d = derive(obs(ray_job=ray_job("Failed", "FAILED", message="the job failed"), pods=[head]), now=NOW)
    assert (d.phase, d.reason) == ("Failed", "OOMKilled") and "pod h container ray-head" in d.message
    ray_oom = "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory."
    d = derive(obs(ray_job=ray_job("Complete", "FAILED", message=ray_oom)), now=NOW)
    assert (d.phase, d.reason) == ("Failed", "OOMKilled") and "OutOfMemoryError" in d.message


def test_failed_message_is_clipped() -> None:
    d = derive(obs(ray_job=ray_job("Failed", "FAILED", message="x" * 5000)), now=NOW)
    assert d.phase == "Failed" and len(d.message) <= 1000


def test_crash_loop_reports_exit_code_and_restarts() -> None:
    cs = [
        {
            "name": "ray-head",
            "restartCount": 5,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}},
            "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
        }
    ]
    d = derive(
        obs(
            ray_job=ray_job(),
            ray_cluster=cluster(),
            pods=[pod("h", "head", ready=False, containerStatuses=cs)],
        ),
        now=NOW,
    )
    assert d.reason == "OOMKilled"  # more specific than the crash loop it causes
    assert "137" in d.message and "OOMKilled" in d.message and "5 times" in d.message


def test_quota_event_surfaces_when_no_pod_exists() -> None:
    ev = {
        "type": "Warning",
        "reason": "FailedCreate",
        "message": 'pods "j-head" is forbidden: exceeded quota: gpu',
        "involvedObject": {"kind": "RayCluster", "name": "j-abcde"},
    }
    d = derive(obs(ray_job=ray_job(), ray_cluster=cluster(), events=[ev]), now=NOW)
    assert d.reason == "QuotaExceeded" and "FailedCreate: " in d.message and "exceeded quota" in d.message


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (
            'pods "j-head-x" is forbidden: exceeded quota: q, requested: pods=1, limited: pods=0',
            "QuotaExceeded",
        ),
        (  # a quota created just before: the quota controller has not computed its usage yet
            'pods "j-head-x" is forbidden: status unknown for quota: q, resources: pods',
            "QuotaExceeded",
        ),
        (
            'pods "j-head-x" is forbidden: violates PodSecurity "restricted:latest": privileged',
            "PodSecurityRefused",
        ),
        ('pods "j-head-x" is forbidden: no PriorityClass with name gold was found', "PriorityClassNotFound"),
        ('Pod "j-head-x" is invalid: spec.nodeSelector: Invalid value: "a b"', "InvalidPodSpec"),
        ("admission webhook x denied request: no", "AdmissionRefused"),
        ("something else", "CreateRefused"),
    ],
)
def test_a_refused_pod_reaches_the_rljob_with_the_api_message_and_an_alertable_reason(
    message: str, reason: str
) -> None:
    """KubeRay's ReplicaFailure condition (set when the API server refuses a pod) and its events."""
    refused = cluster()
    refused["status"]["conditions"] = [
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreateHeadPod", "message": message}
    ]
    d = derive(obs(ray_job=ray_job(), ray_cluster=refused), now=NOW)
    assert (d.phase, d.reason) == ("Provisioning", reason)
    assert message in d.message and "FailedCreateHeadPod" in d.message
    (tr,) = [t for t in transitions(None, d) if t.reason == reason]
    assert tr.type == "Warning"
    ev = {
        "type": "Warning",
        "reason": "FailedToCreateWorkerPod",
        "message": message,
        "involvedObject": {"kind": "RayCluster", "name": "j-abcde"},
    }
    d = derive(obs(ray_job=ray_job(), ray_cluster=cluster(), events=[ev]), now=NOW)
    assert d.reason == reason and message in d.message


def test_a_policy_refusal_is_valid_false_policy_violation() -> None:
    msg = 'spec.serviceAccountName: "x" is not allowed by the rlkube admin policy (default: ...)'
    d = derive(obs(validation_errors=[msg], validation_reason="PolicyViolation"), now=NOW)
    assert (d.phase, d.reason) == ("Failed", "PolicyViolation")
    assert conds(d)["Valid"] == ("False", "PolicyViolation", msg)
    assert [t.reason for t in transitions(None, d) if t.type == "Warning"] == [
        "PolicyViolation",
        "PhaseFailed",
    ]


def test_children_not_written_say_why_on_cluster_ready() -> None:
    problem = Problem("ChildConflict", "ConfigMap victim-config exists (no owner): not created by this RLJob")
    d = derive(obs(child_problem=problem), now=NOW)
    assert (d.phase, d.reason) == ("Pending", "ChildConflict")
    assert conds(d)["ClusterReady"] == ("False", "ChildConflict", problem.message)
    assert any(t.type == "Warning" and t.reason == "ChildConflict" for t in transitions(None, d))


def test_deadline_exceeded_is_failed_with_kuberays_message() -> None:
    rj = ray_job("Failed", "", "DeadlineExceeded", "The RayJob has passed the activeDeadlineSeconds. ...")
    d = derive(obs(ray_job=rj), now=NOW)
    assert (d.phase, d.reason) == ("Failed", "DeadlineExceeded")
    assert "activeDeadlineSeconds" in conds(d)["Failed"][2]
    assert conds(d)["Running"][:2] == ("False", "JobFinished")


def test_succeeded_and_failed_mapping_of_kuberay_values() -> None:
    assert derive(obs(ray_job=ray_job("Complete", "SUCCEEDED")), now=NOW).phase == "Succeeded"
    f = derive(obs(ray_job=ray_job("Failed", "FAILED", "AppFailed", "exit 1")), now=NOW)
    assert (f.phase, f.reason, f.message) == ("Failed", "AppFailed", "exit 1")
    s = derive(obs(ray_job=ray_job("Complete", "STOPPED")), now=NOW)
    assert (s.phase, s.reason) == ("Failed", "JobStopped")
    v = derive(obs(ray_job=ray_job("ValidationFailed", message="bad spec")), now=NOW)
    assert (v.phase, v.reason) == ("Failed", "ValidationFailed")
    r = derive(obs(ray_job=ray_job("Retrying", message="attempt 2")), now=NOW)
    assert r.phase == "Provisioning" and conds(r)["Running"][1] == "Retrying"
    w = derive(obs(ray_job=ray_job("Waiting")), now=NOW)
    assert w.phase == "Provisioning"


def test_suspend_states() -> None:
    assert (
        derive(obs(suspend=True, ray_job=ray_job("Suspending", suspend=True)), now=NOW).reason == "Suspending"
    )
    d = derive(obs(suspend=True, ray_job=ray_job("Suspended", suspend=True)), now=NOW)
    assert (d.phase, d.reason) == ("Suspended", "SuspendedByUser")
    assert conds(d)["ClusterReady"][:2] == ("False", "Suspended")
    q = derive(obs(kueue_managed=True, ray_job=ray_job("Suspended", suspend=True)), now=NOW)
    assert (q.phase, q.reason) == ("Suspended", "QueuedByKueue")


def test_last_transition_time_kept_while_status_unchanged() -> None:
    first = derive(
        obs(ray_job=ray_job(), ray_cluster=cluster(), pods=[pod("h", "head", ready=False)]), now=NOW
    )
    prev = [condition_dict(c) for c in first.conditions]
    later = NOW + timedelta(minutes=5)
    cs = [{"name": "c", "state": {"waiting": {"reason": "ErrImagePull", "message": "x"}}}]
    second = derive(
        obs(
            ray_job=ray_job(),
            ray_cluster=cluster(),
            pods=[pod("h", "head", ready=False, containerStatuses=cs)],
        ),
        prev,
        now=later,
    )
    c1, c2 = first.condition("ClusterReady"), second.condition("ClusterReady")
    assert c1 and c2 and c1.reason != c2.reason
    assert c2.last_transition_time == c1.last_transition_time == "2026-01-01T12:00:00Z"
    ready = derive(
        obs(ray_job=ray_job("Running"), ray_cluster=cluster(), pods=[pod("h", "head"), pod("w")]),
        prev,
        now=later,
    )
    c3 = ready.condition("ClusterReady")
    assert c3 and c3.last_transition_time == "2026-01-01T12:05:00Z"


def test_no_events_when_nothing_changed_and_one_per_change() -> None:
    d = derive(
        obs(ray_job=ray_job("Running"), ray_cluster=cluster(), pods=[pod("h", "head"), pod("w")]), now=NOW
    )
    status = d.to_status()
    assert transitions(status, d) == []
    assert operator_status_view({**status, "progress": {"step": 3}}) == status
    again = derive(
        obs(ray_job=ray_job("Running", "RUNNING"), ray_cluster=cluster(), pods=[pod("h", "head"), pod("w")]),
        status["conditions"],
        now=NOW,
    )
    reasons = [t.reason for t in transitions(status, again)]
    assert reasons == ["JobRunning", "PhaseRunning"]


def test_status_patch_never_carries_progress() -> None:
    d = derive(obs(), now=NOW)
    assert "progress" not in d.to_status()


def test_the_operators_pod_cache_keeps_the_memory_limit_an_oom_message_names() -> None:
    from rlkube.operator.cache import slim_pod

    cs = {
        "name": "ray-head",
        "restartCount": 1,
        "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
    }
    full = pod("h", "head", ready=False, containerStatuses=[cs])
    full["metadata"]["labels"]["rlkube.io/group"] = "head"
    full["spec"] = {
        "containers": [
            {"name": "ray-head", "image": "x", "resources": {"limits": {"cpu": "1", "memory": "500Mi"}}}
        ]
    }
    d = derive(obs(ray_job=ray_job(), ray_cluster=cluster(), pods=[slim_pod(full)]), now=NOW)
    assert d.reason == "OOMKilled" and "memory limit 500Mi" in d.message and "spec.head.memory" in d.message
