"""RLJob lifecycle on the real control plane: kube-apiserver, real KubeRay v1.5, scheduler, GC, kwok nodes.

Every test drives the cluster the way a user does (kubectl apply/get/patch/delete) and asserts what the
user sees on the RLJob. kwok runs no containers, so Ray itself never starts: where a test needs a Ray job
state (RUNNING, SUCCEEDED, FAILED) it writes the RayJob status the way KubeRay would, and says so.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from optest_fixtures import OperatorProcess
from optest_helpers import (
    REPO,
    apply,
    cond_is,
    condition,
    describe,
    events_for,
    rljob,
    small_rljob,
    token_kubeconfig,
)

from rlkube.api import Progress
from rlkube.devcluster.node import REAL_NODE_LABEL
from rlkube.devcluster.realpods import HostDirs, devcluster_policy
from rlkube.devcluster.testing import Kubectl
from rlkube.runtime.metrics.status import StatusPusher

WaitFor = Callable[..., Any]


def phase_is(kubectl: Kubectl, ns: str, name: str, *phases: str) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        obj = rljob(kubectl, ns, name)
        return obj if (obj.get("status") or {}).get("phase") in phases else None

    return check


def pods(kubectl: Kubectl, ns: str, selector: str) -> list[dict[str, Any]]:
    return list(kubectl.json("-n", ns, "get", "pods", "-l", selector).get("items") or [])


def gpu_pods_running(kubectl: Kubectl, ns: str, cluster: str) -> list[dict[str, Any]]:
    items = pods(kubectl, ns, f"ray.io/cluster={cluster},ray.io/node-type=worker")
    return [
        p
        for p in items
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def ray_cluster_of(kubectl: Kubectl, ns: str, rayjob: str) -> str:
    return str(kubectl.json("-n", ns, "get", "rayjob", rayjob)["status"].get("rayClusterName") or "")


# ----------------------------------------------------------------------------------------- happy path


def test_rljob_to_rayjob_to_real_raycluster_to_running_pods(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    ns = namespace
    apply(kubectl, ns, small_rljob("sep", mode="separate_async"))
    # Pending/Provisioning first, then ClusterReady once KubeRay's pods run on the fake GPU nodes.
    wait_for(phase_is(kubectl, ns, "sep", "Pending", "Provisioning"), 30, describe(kubectl, ns, "sep"))
    ready = wait_for(
        cond_is(kubectl, ns, "sep", "ClusterReady", "True", "RayClusterReady"),
        90,
        describe(kubectl, ns, "sep"),
    )
    assert "4 GPUs" in ready["message"]
    job = rljob(kubectl, ns, "sep")
    st = job["status"]
    assert st["phase"] == "Provisioning" and st["reason"] == "JobPending"  # Ray never runs under kwok
    assert st["observedGeneration"] == job["metadata"]["generation"]
    assert st["rayJobName"] == "sep" and st["rayClusterName"].startswith("sep-")
    assert condition(job, "Valid")["status"] == "True"
    # The real KubeRay made the pods the renderer described: trainer + rollout groups on GPU nodes.
    workers = gpu_pods_running(kubectl, ns, st["rayClusterName"])
    assert sorted(p["metadata"]["labels"]["ray.io/group"] for p in workers) == ["rollout", "trainer"]
    for p in workers:
        assert p["spec"]["nodeName"].startswith("gpu-")
    # Events tell the story in order, one per transition.
    reasons = [e["reason"] for e in events_for(kubectl, ns, "sep")]
    assert "SpecAccepted" in reasons and "RayClusterReady" in reasons and "PhaseProvisioning" in reasons
    assert reasons.count("RayClusterReady") == 1


def test_kubectl_get_rljobs_columns(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    ns = namespace
    apply(kubectl, ns, small_rljob("cols", mode="separate_async", gpus=2))
    wait_for(cond_is(kubectl, ns, "cols", "ClusterReady", "True"), 90, describe(kubectl, ns, "cols"))
    head, row = kubectl("-n", ns, "get", "rljobs").stdout.splitlines()[:2]
    assert head.split() == ["NAME", "PHASE", "ALGORITHM", "MODE", "GPUS", "STEP", "REWARD", "AGE"]
    assert row.split()[:5] == ["cols", "Provisioning", "grpo", "separate_async", "4"]
    wide_head, wide_row = kubectl("-n", ns, "get", "rlj", "-o", "wide").stdout.splitlines()[:2]
    assert wide_head.split()[-2:] == ["REASON", "RAYJOB"]
    assert wide_row.split()[-2:] == ["JobPending", "cols"]
    # `kubectl get all` lists RLJobs (categories: [all]).
    assert "rljob.rlkube.io/cols" in kubectl("-n", ns, "get", "all").stdout


def test_ray_job_states_map_to_phases_driven_as_kuberay_would(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    """kwok runs no Ray, so this test writes RayJob.status itself (as KubeRay does) to check the mapping."""
    ns = namespace
    for name in ("ok", "bad"):
        apply(kubectl, ns, small_rljob(name, gpus=1))
    for name in ("ok", "bad"):
        wait_for(cond_is(kubectl, ns, name, "ClusterReady", "True"), 90, describe(kubectl, ns, name))
    status = {
        "jobDeploymentStatus": "Complete",
        "jobStatus": "SUCCEEDED",
        "message": "Job finished successfully.",
    }
    kubectl(
        "-n",
        ns,
        "patch",
        "rayjob",
        "ok",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
    done = wait_for(phase_is(kubectl, ns, "ok", "Succeeded"), 30, describe(kubectl, ns, "ok"))
    assert condition(done, "Succeeded")["status"] == "True" and done["status"].get("completionTime")
    failed = {
        "jobDeploymentStatus": "Failed",
        "jobStatus": "FAILED",
        "reason": "AppFailed",
        "message": "exit code 1",
    }
    kubectl(
        "-n",
        ns,
        "patch",
        "rayjob",
        "bad",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": failed}),
    )
    f = wait_for(phase_is(kubectl, ns, "bad", "Failed"), 30, describe(kubectl, ns, "bad"))
    assert (f["status"]["reason"], f["status"]["message"]) == ("AppFailed", "exit code 1")
    assert any(
        e["type"] == "Warning" and e["reason"] == "PhaseFailed" for e in events_for(kubectl, ns, "bad")
    )


# ------------------------------------------------------------------------------------------ bad input


def test_cel_rules_refuse_bad_input_at_kubectl_apply(
    kubectl: Kubectl, namespace: str, rljob_crd: None
) -> None:
    body = small_rljob("cel", mode="sync")
    body["spec"]["async"] = {"stalenessThreshold": 0.5}
    out = kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(body), check=False)
    assert out.returncode != 0
    assert "async settings apply only to training.mode" in out.stderr
    mega = small_rljob("mega")
    mega["spec"]["trainer"]["strategy"] = "megatron"
    out = kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(mega), check=False)
    assert out.returncode != 0 and "use strategy: fsdp2" in out.stderr


def test_non_cel_error_marks_invalid_with_warning_and_no_children(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    ns = namespace
    apply(kubectl, ns, small_rljob("inv", mounts=[{"name": "dshm", "mountPath": "/x", "hostPath": "/x"}]))
    valid = wait_for(
        cond_is(kubectl, ns, "inv", "Valid", "False", "InvalidSpec"), 30, describe(kubectl, ns, "inv")
    )
    assert "spec.mounts[0].name" in valid["message"] and "rename it" in valid["message"]
    assert rljob(kubectl, ns, "inv")["status"]["phase"] == "Failed"
    warnings = [e for e in events_for(kubectl, ns, "inv") if e["type"] == "Warning"]
    assert any(e["reason"] == "InvalidSpec" and "spec.mounts[0].name" in e["message"] for e in warnings)
    time.sleep(3)  # no retry storm: one spec reconcile, no children, no further events
    for kind in ("rayjobs", "configmaps", "serviceaccounts", "roles", "rolebindings"):
        items = kubectl.json("-n", ns, "get", kind, "-l", "rlkube.io/rljob=inv")["items"]
        assert items == [], kind
    assert operator.metric("rlkube_reconcile_total", kind="spec") == 1
    assert operator.metric("rlkube_reconcile_errors_total") == 0
    assert len(events_for(kubectl, ns, "inv")) == len(warnings) + sum(
        1 for e in events_for(kubectl, ns, "inv") if e["type"] == "Normal"
    )
    # Fixing the spec re-validates and renders. Like any edit outside the live fields it is made while
    # suspended (docs/api.md): a plain replace is refused and says how.
    fixed = small_rljob("inv")
    replace = ("-n", ns, "replace", "-f", "-")
    refused = kubectl(*replace, input=yaml.safe_dump({**fixed, "metadata": {"name": "inv"}}), check=False)
    assert refused.returncode != 0 and "set spec.suspend: true, edit" in refused.stderr, refused.stderr
    kubectl("-n", ns, "patch", "rljob", "inv", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    fixed["spec"]["suspend"] = True
    kubectl(*replace, input=yaml.safe_dump({**fixed, "metadata": {"name": "inv"}}))
    kubectl("-n", ns, "patch", "rljob", "inv", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    wait_for(cond_is(kubectl, ns, "inv", "Valid", "True"), 30, describe(kubectl, ns, "inv"))
    wait_for(lambda: kubectl.json("-n", ns, "get", "rayjobs")["items"], 30)


# ----------------------------------------------------------------------------------- pod-level failures


def test_unschedulable_message_from_the_scheduler_reaches_the_rljob(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    ns = namespace
    apply(kubectl, ns, small_rljob("huge", gpus=16))  # nodes have 8 amd.com/gpu each
    c = wait_for(
        cond_is(kubectl, ns, "huge", "ClusterReady", "False", "Unschedulable"),
        90,
        describe(kubectl, ns, "huge"),
    )
    assert "Insufficient amd.com/gpu" in c["message"], c
    job = rljob(kubectl, ns, "huge")
    assert (job["status"]["phase"], job["status"]["reason"]) == ("Provisioning", "Unschedulable")
    assert any(
        e["type"] == "Warning"
        and e["reason"] == "Unschedulable"
        and "Insufficient amd.com/gpu" in e["message"]
        for e in events_for(kubectl, ns, "huge")
    )


def _inject_container_state(
    kubectl: Kubectl, ns: str, pod: str, container: str, state: dict[str, Any], **extra: Any
) -> None:
    """Fault injection through the real API: write the kubelet's container status (kwok pulls nothing)."""
    status = {
        "phase": "Pending",
        "conditions": [{"type": "Ready", "status": "False"}, {"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [
            {
                "name": container,
                "ready": False,
                "restartCount": extra.get("restarts", 0),
                "image": "x",
                "imageID": "",
                "state": state,
                **({"lastState": extra["last"]} if "last" in extra else {}),
            }
        ],
    }
    kubectl(
        "-n",
        ns,
        "patch",
        "pod",
        pod,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def test_image_pull_and_crash_loop_reach_the_rljob(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    ns = namespace
    apply(kubectl, ns, small_rljob("faulty", mode="separate_async", gpus=1))
    wait_for(cond_is(kubectl, ns, "faulty", "ClusterReady", "True"), 90, describe(kubectl, ns, "faulty"))
    cluster = rljob(kubectl, ns, "faulty")["status"]["rayClusterName"]
    trainer = pods(kubectl, ns, f"ray.io/cluster={cluster},ray.io/group=trainer")[0]
    cname = trainer["spec"]["containers"][0]["name"]
    msg = 'Back-off pulling image "registry.invalid/rlkube:nope"'
    _inject_container_state(
        kubectl,
        ns,
        trainer["metadata"]["name"],
        cname,
        {"waiting": {"reason": "ImagePullBackOff", "message": msg}},
    )
    c = wait_for(
        cond_is(kubectl, ns, "faulty", "ClusterReady", "False", "ImagePullBackOff"),
        30,
        describe(kubectl, ns, "faulty"),
    )
    assert msg in c["message"] and trainer["metadata"]["name"] in c["message"]
    rollout = pods(kubectl, ns, f"ray.io/cluster={cluster},ray.io/group=rollout")[0]
    _inject_container_state(kubectl, ns, trainer["metadata"]["name"], cname, {"running": {}})
    _inject_container_state(
        kubectl,
        ns,
        rollout["metadata"]["name"],
        cname,
        {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
        restarts=4,
        last={"terminated": {"exitCode": 1, "reason": "Error"}},
    )
    c = wait_for(
        cond_is(kubectl, ns, "faulty", "ClusterReady", "False", "CrashLoopBackOff"),
        30,
        describe(kubectl, ns, "faulty"),
    )
    assert "exit code 1" in c["message"] and "4 times" in c["message"]
    reasons = {e["reason"] for e in events_for(kubectl, ns, "faulty") if e["type"] == "Warning"}
    assert {"ImagePullBackOff", "CrashLoopBackOff"} <= reasons


def test_active_deadline_expiry_fails_the_rljob(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    """The real KubeRay enforces activeDeadlineSeconds; its DeadlineExceeded reaches the RLJob."""
    ns = namespace
    apply(kubectl, ns, small_rljob("late", gpus=1, activeDeadlineSeconds=5))
    f = wait_for(phase_is(kubectl, ns, "late", "Failed"), 90, describe(kubectl, ns, "late"))
    assert f["status"]["reason"] == "DeadlineExceeded"
    assert condition(f, "Failed")["status"] == "True"
    assert "activeDeadlineSeconds" in condition(f, "Failed")["message"]


# ------------------------------------------------------------------------------------------- lifecycle


def test_suspend_frees_gpu_pods_and_resume_recreates_them(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    ns = namespace
    apply(kubectl, ns, small_rljob("sus", gpus=2))
    wait_for(cond_is(kubectl, ns, "sus", "ClusterReady", "True"), 90, describe(kubectl, ns, "sus"))
    kubectl("-n", ns, "patch", "rljob", "sus", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_for(phase_is(kubectl, ns, "sus", "Suspended"), 60, describe(kubectl, ns, "sus"))
    assert kubectl.json("-n", ns, "get", "rayjob", "sus")["spec"]["suspend"] is True
    wait_for(lambda: not pods(kubectl, ns, "ray.io/node-type=worker"), 60, what="GPU pods deleted")
    s = wait_for(
        cond_is(kubectl, ns, "sus", "Suspended", "True", "SuspendedByUser"), 60, describe(kubectl, ns, "sus")
    )
    assert "no GPU pods" in s["message"]
    kubectl("-n", ns, "patch", "rljob", "sus", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    wait_for(cond_is(kubectl, ns, "sus", "ClusterReady", "True"), 90, describe(kubectl, ns, "sus"))
    cluster = rljob(kubectl, ns, "sus")["status"]["rayClusterName"]
    assert gpu_pods_running(kubectl, ns, cluster)
    assert condition(rljob(kubectl, ns, "sus"), "Suspended")["status"] == "False"


def test_delete_removes_every_child_through_real_gc(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    ns = namespace
    apply(kubectl, ns, small_rljob("gone", gpus=1))
    wait_for(cond_is(kubectl, ns, "gone", "ClusterReady", "True"), 90, describe(kubectl, ns, "gone"))
    job = rljob(kubectl, ns, "gone")
    assert "rlkube.io/finalizer" in job["metadata"]["finalizers"]
    kubectl("-n", ns, "delete", "rljob", "gone", "--wait=true", timeout=60)

    def all_gone() -> bool:
        for kind in ("rayjobs", "rayclusters", "configmaps", "serviceaccounts", "roles", "rolebindings"):
            items = kubectl.json("-n", ns, "get", kind)["items"]
            if any(i["metadata"]["name"].startswith("gone") for i in items):
                return False
        return not pods(kubectl, ns, "ray.io/is-ray-node=yes")

    wait_for(all_gone, 90, what="every child of the deleted RLJob garbage-collected")


def test_child_deleted_by_hand_is_recreated(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    ns = namespace
    apply(kubectl, ns, small_rljob("heal", gpus=1))
    wait_for(cond_is(kubectl, ns, "heal", "ClusterReady", "True"), 90, describe(kubectl, ns, "heal"))
    for kind, name in (("configmap", "heal-config"), ("role", "heal-runtime"), ("rayjob", "heal")):
        uid = kubectl.json("-n", ns, "get", kind, name)["metadata"]["uid"]
        # No --wait: the operator may recreate the child (same name, new uid) before kubectl's wait
        # for deletion sees it gone, and kubectl then waits on the new object forever.
        kubectl("-n", ns, "delete", kind, name, "--wait=false", timeout=60)

        def back(kind: str = kind, name: str = name, uid: str = uid) -> bool:
            out = kubectl("-n", ns, "get", kind, name, "-o", "json", check=False)
            return out.returncode == 0 and json.loads(out.stdout)["metadata"]["uid"] != uid

        wait_for(back, 60, what=f"{kind}/{name} recreated")
    wait_for(cond_is(kubectl, ns, "heal", "ClusterReady", "True"), 90, describe(kubectl, ns, "heal"))


def test_operator_restart_mid_reconcile_creates_no_duplicates(
    kubectl: Kubectl, namespace: str, operator_factory: Callable[..., OperatorProcess], wait_for: WaitFor
) -> None:
    ns = namespace
    first = operator_factory(namespaces=[ns])
    names = [f"rs{i}" for i in range(4)]
    kubectl("-n", ns, "apply", "-f", "-", input=yaml.safe_dump_all([small_rljob(n, gpus=1) for n in names]))
    wait_for(lambda: kubectl.json("-n", ns, "get", "rayjobs")["items"], 30, what="a first RayJob")
    first.stop(signal.SIGKILL)  # no graceful shutdown: whatever was mid-apply stays mid-apply
    second = operator_factory(namespaces=[ns])
    for n in names:
        wait_for(cond_is(kubectl, ns, n, "ClusterReady", "True"), 120, describe(kubectl, ns, n))
    rayjobs = kubectl.json("-n", ns, "get", "rayjobs")["items"]
    assert sorted(r["metadata"]["name"] for r in rayjobs) == names
    clusters = kubectl.json("-n", ns, "get", "rayclusters")["items"]
    assert len(clusters) == len(names)
    for kind in ("configmaps", "serviceaccounts", "roles", "rolebindings"):
        items = kubectl.json("-n", ns, "get", kind, "-l", "rlkube.io/rljob")["items"]
        assert len(items) == len(names), kind
    assert second.metric("rlkube_reconcile_errors_total") == 0


def test_kueue_queue_label_passes_through_and_suspend_is_left_to_kueue(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    """Kueue is not installed: this test plays its admission controller with its own field manager."""
    ns = namespace
    body = small_rljob("queued", gpus=1)
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "gpu-queue"}
    apply(kubectl, ns, body)
    wait_for(lambda: kubectl("-n", ns, "get", "rayjob", "queued", check=False).returncode == 0, 30)
    rj = kubectl.json("-n", ns, "get", "rayjob", "queued", "--show-managed-fields")
    assert rj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    ours = [m for m in rj["metadata"]["managedFields"] if m["manager"] == "rlkube-operator"]
    assert ours and all("f:suspend" not in json.dumps(m.get("fieldsV1", {})) for m in ours)
    # "Kueue" suspends it (as its webhook/controller would) ...
    kubectl(
        "-n",
        ns,
        "patch",
        "rayjob",
        "queued",
        "--type=merge",
        "--field-manager=kueue",
        "-p",
        '{"spec":{"suspend":true}}',
    )
    q = wait_for(
        cond_is(kubectl, ns, "queued", "Suspended", "True", "QueuedByKueue"),
        60,
        describe(kubectl, ns, "queued"),
    )
    assert "Kueue" in q["message"]
    # ... a user edit makes the operator re-apply, and it does not un-suspend what Kueue suspended (the
    # edit is of a field that rolls out at once: the RLJob itself is not suspended, docs/api.md).
    kubectl(
        "-n", ns, "patch", "rljob", "queued", "--type=merge", "-p", '{"spec":{"activeDeadlineSeconds":7200}}'
    )
    wait_for(
        lambda: rljob(kubectl, ns, "queued")["status"].get("observedGeneration") == 2,
        30,
        describe(kubectl, ns, "queued"),
    )
    rj = kubectl.json("-n", ns, "get", "rayjob", "queued")["spec"]
    assert rj["suspend"] is True and rj["activeDeadlineSeconds"] == 7200
    # Kueue admits it: suspend false, pods come back, and the operator still does not touch it.
    kubectl(
        "-n",
        ns,
        "patch",
        "rayjob",
        "queued",
        "--type=merge",
        "--field-manager=kueue",
        "-p",
        '{"spec":{"suspend":false}}',
    )
    wait_for(cond_is(kubectl, ns, "queued", "ClusterReady", "True"), 90, describe(kubectl, ns, "queued"))
    assert operator.metric("rlkube_reconcile_errors_total") == 0


def test_suspend_under_a_kueue_queue_is_reported_as_a_warning_event_once(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    """spec.suspend does nothing while Kueue owns the RayJob: the user is told on the RLJob, once."""
    ns = namespace
    body = small_rljob("held", gpus=1, suspend=True)
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "gpu-queue"}
    apply(kubectl, ns, body)

    def ignored() -> list[dict[str, Any]]:
        return [e for e in events_for(kubectl, ns, "held") if e["reason"] == "SuspendIgnored"]

    seen = wait_for(lambda: ignored() or None, 30, describe(kubectl, ns, "held"))
    assert seen[0]["type"] == "Warning" and "Kueue owns suspend" in seen[0]["message"]
    assert seen[0]["involvedObject"]["kind"] == "RLJob"
    assert "suspend" not in kubectl.json("-n", ns, "get", "rayjob", "held")["spec"]
    # A later edit re-renders the same warning: it is not posted again.
    patch = '{"spec":{"training":{"totalSteps":20}}}'
    kubectl("-n", ns, "patch", "rljob", "held", "--type=merge", "-p", patch)
    wait_for(
        lambda: rljob(kubectl, ns, "held")["status"].get("observedGeneration") == 2,
        30,
        describe(kubectl, ns, "held"),
    )
    assert len(ignored()) == 1


# ------------------------------------------------------------------------------ progress from runtime


def test_runtime_pushes_progress_with_its_own_token_and_operator_keeps_it(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor, tmp_path: Path
) -> None:
    from kubernetes import client, config

    ns = namespace
    for n in ("mine", "other"):
        apply(kubectl, ns, small_rljob(n, gpus=1))
    for n in ("mine", "other"):
        wait_for(cond_is(kubectl, ns, n, "ClusterReady", "True"), 90, describe(kubectl, ns, n))
    runtime = token_kubeconfig(kubectl, tmp_path / "runtime.kubeconfig", ns, "mine-runtime")
    # The runtime's own pusher with the runtime's token: its Role grants patch on this RLJob's status
    # and nothing else (not even get, which `kubectl patch` would need first).
    api = client.CustomObjectsApi(config.new_client_from_config(config_file=str(runtime.kubeconfig)))
    progress = Progress(step=3, total_steps=10, step_display="3/10", reward_mean=0.31)
    assert StatusPusher("mine", ns, api=api).push(progress, force=True)
    other = StatusPusher("other", ns, api=api)
    assert not other.push(progress, force=True) and other.failures == 1
    with pytest.raises(client.ApiException) as denied:
        api.patch_namespaced_custom_object_status(
            "rlkube.io", "v1alpha1", ns, "rljobs", "other", {"status": {"progress": {"step": 1}}}
        )
    assert denied.value.status == 403
    assert "progress" not in rljob(kubectl, ns, "other")["status"]
    for what in (("get", "rljob", "mine"), ("get", "rljobs"), ("get", "secrets")):
        assert runtime(*what, check=False).returncode != 0, what  # no read, only its one patch
    # The operator writes status again (Ray job starts) and the pushed progress survives.
    kubectl(
        "-n",
        ns,
        "patch",
        "rayjob",
        "mine",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"jobStatus": "RUNNING"}}),
    )
    wait_for(cond_is(kubectl, ns, "mine", "Running", "True"), 30, describe(kubectl, ns, "mine"))
    job = rljob(kubectl, ns, "mine")
    assert job["status"]["progress"]["step"] == 3 and job["status"]["progress"]["stepDisplay"] == "3/10"
    row = kubectl("-n", ns, "get", "rljob", "mine", "--no-headers").stdout.split()
    assert row[1] == "Running" and "3/10" in row and "0.31" in row


# ----------------------------------------------------------------------------------- the process itself


def test_metrics_liveness_and_json_logs(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    import urllib.request

    ns = namespace
    apply(kubectl, ns, small_rljob("obs", gpus=1))
    wait_for(cond_is(kubectl, ns, "obs", "ClusterReady", "True"), 90, describe(kubectl, ns, "obs"))
    text = operator.metrics()
    for name in (
        "rlkube_reconcile_total",
        "rlkube_reconcile_errors_total",
        "rlkube_reconcile_duration_seconds_bucket",
        "rlkube_rljobs",
        "rlkube_time_to_running_seconds_bucket",
        "rlkube_rljob_info",
        "rlkube_api_requests_total",
    ):
        assert name in text, name
    # The gauges follow the operator's status write; the test can see that status a moment before
    # the operator's own coroutine runs again (a loaded machine), so it waits for the scrape.
    wait_for(
        lambda: operator.metric("rlkube_rljobs", phase="Provisioning") == 1,
        30,
        operator.metrics,
        what="rlkube_rljobs{phase=Provisioning} = 1",
    )
    assert operator.metric("rlkube_rljob_info", name="obs", algorithm="grpo", mode="colocate_async") == 1
    assert operator.metric("rlkube_api_requests_total", verb="PATCH", resource="rayjobs") >= 1
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.liveness_port}/healthz", timeout=5) as r:
        assert r.status == 200 and "rljobs" in r.read().decode()
    lines = [ln for ln in operator.log().splitlines() if ln.startswith("{")]
    assert lines and all(isinstance(json.loads(ln), dict) for ln in lines)
    assert any("applied 5 children" in json.loads(ln).get("message", "") for ln in lines)


def test_two_peered_replicas_never_both_act(
    kubectl: Kubectl, namespace: str, operator_factory: Callable[..., OperatorProcess], wait_for: WaitFor
) -> None:
    ns = namespace
    kubectl(
        "-n",
        ns,
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "rlkube"}}
        ),
    )
    high = operator_factory("--peering=rlkube", "--priority=100", namespaces=[ns])
    low = operator_factory("--peering=rlkube", "--priority=10", namespaces=[ns])
    time.sleep(3)  # both have announced themselves in the KopfPeering; the low one starts paused
    apply(kubectl, ns, small_rljob("peer", gpus=1))
    wait_for(cond_is(kubectl, ns, "peer", "ClusterReady", "True"), 90, describe(kubectl, ns, "peer"))
    assert high.metric("rlkube_reconcile_total", kind="spec") >= 1
    assert low.metric("rlkube_reconcile_total", kind="spec") == 0
    assert low.metric("rlkube_api_requests_total", verb="PATCH", resource="rayjobs") == 0
    # The active one goes away: the standby takes over and serves new RLJobs.
    high.stop(signal.SIGKILL)
    apply(kubectl, ns, small_rljob("peer2", gpus=1))
    wait_for(cond_is(kubectl, ns, "peer2", "ClusterReady", "True"), 150, describe(kubectl, ns, "peer2"))
    assert low.metric("rlkube_reconcile_total", kind="spec") >= 1


# --------------------------------------------------------------------------------------------- examples

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SEED_EXAMPLES = {
    "dapo-qwen25-math-7b.yaml",
    "grpo-qwen25-vl-7b-geo3k.yaml",
    "grpo-qwen3-8b-colocated.yaml",
    "grpo-qwen35-35b.yaml",
}


def provide_claim(kubectl: Kubectl, ns: str, claim: str) -> None:
    pv = f"{ns}-{claim}"[:63].rstrip("-")
    docs = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv, "labels": {"rlkube.io/test": "true"}},
            "spec": {
                "capacity": {"storage": "1Ti"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": f"/tmp/{pv}"},
                "claimRef": {"namespace": ns, "name": claim},
                "persistentVolumeReclaimPolicy": "Delete",
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": ns},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": pv,
                "resources": {"requests": {"storage": "1Ti"}},
            },
        },
    ]
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def test_the_four_seed_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= SEED_EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_applies_and_reaches_cluster_ready_on_fake_gpu_nodes(
    path: Path,
    kubectl: Kubectl,
    namespace: str,
    operator_factory: Callable[..., OperatorProcess],
    wait_for: WaitFor,
    tmp_path: Path,
) -> None:
    """kubectl apply -f examples/X.yaml -> RayJob -> real KubeRay RayCluster -> pods Running -> phases."""
    ns = namespace
    body = yaml.safe_load(path.read_text())
    name = body["metadata"]["name"]
    spec = body["spec"]
    # The seed examples pass the chart's default admin policy. The devcluster's own example (on its real
    # node, mounting node directories) runs where the admin opted in for it, as `make demo` installs.
    if REAL_NODE_LABEL in ((spec.get("gpu") or {}).get("nodeSelector") or {}):
        policy = tmp_path / "policy.yaml"
        policy.write_text(yaml.safe_dump({"namespaces": {ns: devcluster_policy(HostDirs.of_rljob(body))}}))
        operator_factory(f"--policy={policy}", namespaces=[ns])
        # It runs in real pods in tests/cluster/test_demo.py; here it is placed on the fake nodes,
        # the rest of it unchanged.
        del spec["gpu"]["nodeSelector"][REAL_NODE_LABEL]
        spec["gpu"]["tolerations"] = [
            t for t in spec["gpu"].get("tolerations") or () if t.get("key") != REAL_NODE_LABEL
        ]
    else:
        operator_factory(namespaces=[ns])
    claims = [m["persistentVolumeClaim"] for m in spec.get("mounts") or () if m.get("persistentVolumeClaim")]
    claims += (
        [spec["checkpoint"]["persistentVolumeClaim"]]
        if spec.get("checkpoint", {}).get("persistentVolumeClaim")
        else []
    )
    for claim in claims:  # the volumes a user would have provisioned, pre-bound (no storage provisioner here)
        provide_claim(kubectl, ns, claim)
    apply(kubectl, ns, body)
    seen = wait_for(phase_is(kubectl, ns, name, "Pending", "Provisioning"), 30, describe(kubectl, ns, name))
    assert condition(seen, "Valid")["status"] == "True"
    ready = wait_for(cond_is(kubectl, ns, name, "ClusterReady", "True"), 120, describe(kubectl, ns, name))
    job = rljob(kubectl, ns, name)
    assert job["status"]["phase"] == "Provisioning" and job["status"]["reason"] == "JobPending"
    cluster = job["status"]["rayClusterName"]
    mode = body["spec"].get("training", {}).get("mode", "sync")
    groups = sorted({p["metadata"]["labels"]["ray.io/group"] for p in gpu_pods_running(kubectl, ns, cluster)})
    assert groups == (["rollout", "trainer"] if mode == "separate_async" else ["actor"])
    gpus = int(job["status"]["gpus"])
    if gpus:
        assert f"{gpus} GPUs" in ready["message"]
        for p in gpu_pods_running(kubectl, ns, cluster):
            assert p["spec"]["nodeName"].startswith("gpu-")
    kubectl("-n", ns, "delete", "rljob", name, "--wait=true", timeout=90)
    wait_for(lambda: not pods(kubectl, ns, f"ray.io/cluster={cluster}"), 90, what="GPU pods freed")
    for claim in claims:
        kubectl("delete", "pv", f"{ns}-{claim}"[:63].rstrip("-"), "--wait=false", check=False)


def two_node_eight_plus_eight() -> dict[str, Any]:
    """8 trainer GPUs on one node, 8 rollout GPUs (TP 2) on another: 8 ranks, 4 engines."""
    body = small_rljob("eightplus", mode="separate_async", gpus=8)
    body["spec"]["rollout"]["tensorParallelSize"] = 2
    body["spec"]["training"].update({"trainBatchSize": 32, "miniBatchSize": 8})
    body["spec"]["async"] = {"parameterSyncStep": 4}
    return body


def test_two_node_job_gets_one_pod_per_placement_bundle_on_its_own_node(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    """The runtime's placement groups need one pod per bundle, each advertising the bundle's Ray
    resource and holding its GPUs: what KubeRay made from the render must be exactly that."""
    from rlkube.api import parse_rljob, resolve
    from rlkube.api.layout import layout
    from rlkube.runtime.distributed.placement import plan_placement

    ns = namespace
    body = two_node_eight_plus_eight()
    apply(kubectl, ns, body)
    wait_for(
        cond_is(kubectl, ns, "eightplus", "ClusterReady", "True"), 120, describe(kubectl, ns, "eightplus")
    )
    cluster = rljob(kubectl, ns, "eightplus")["status"]["rayClusterName"]
    spec = resolve(parse_rljob(body)).spec
    plan = plan_placement(spec)
    assert (layout(spec).trainer_ranks, layout(spec).engines) == (8, 4)
    workers = gpu_pods_running(kubectl, ns, cluster)
    by_group: dict[str, list[dict[str, Any]]] = {}
    for p in workers:
        by_group.setdefault(p["metadata"]["labels"]["ray.io/group"], []).append(p)
    bundles = {"trainer": plan.trainer_bundles, "rollout": plan.rollout_bundles}
    assert {g: len(ps) for g, ps in by_group.items()} == {g: len(b) for g, b in bundles.items()}
    rc = kubectl.json("-n", ns, "get", "raycluster", cluster)
    params = {g["groupName"]: g["rayStartParams"] for g in rc["spec"]["workerGroupSpecs"]}
    for group, pods_ in by_group.items():
        (bundle,) = bundles[group]
        advertised = json.loads(params[group]["resources"].strip("'"))
        assert advertised == {k: int(v) for k, v in bundle.items() if k != "GPU"}
        for p in pods_:
            assert p["spec"]["containers"][0]["resources"]["limits"]["amd.com/gpu"] == str(int(bundle["GPU"]))
    nodes = {p["spec"]["nodeName"] for p in workers}
    assert len(nodes) == 2 and all(n.startswith("gpu-") for n in nodes)  # two 8-GPU nodes, one each
    kubectl("-n", ns, "delete", "rljob", "eightplus", "--wait=true", timeout=90)
    wait_for(lambda: not pods(kubectl, ns, f"ray.io/cluster={cluster}"), 90, what="GPU pods freed")
