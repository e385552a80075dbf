"""What a user sees on the RLJob when real pods fail, and that nothing is left behind or duplicated.

Every job runs in real containers on the devcluster's real node: KubeRay starts Ray in the head and
worker pods, its submitter runs `ray job submit`, `rlkube-train` runs on the head. The operator is
the helm-installed pod (tests/realpods/conftest.py). Waits are generous (two loaded cores) and a
failed wait prints the RLJob, its Events and every pod with its last events and log lines.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from realpods_helpers import (
    JOB_LABEL,
    RealPods,
    pods_in,
    rljob,
    rljob_report,
    status,
    wait_job_pods_ready,
    wait_status,
)

from rlkube.devcluster.realpods import pods_report, poll
from rlkube.devcluster.testing import Kubectl

pytestmark = [pytest.mark.realpods, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1200)]

CHILD_KINDS = ("rayjob", "raycluster", "configmap", "serviceaccount", "role", "rolebinding")


def children(kubectl: Kubectl, ns: str, name: str) -> dict[str, list[str]]:
    """`{kind: [uid, ...]}` of every child labelled with the RLJob (RayCluster by KubeRay's label)."""
    out: dict[str, list[str]] = {}
    for kind in CHILD_KINDS:
        selector = f"{JOB_LABEL}={name}"
        items = kubectl.json("-n", ns, "get", kind, "-l", selector)["items"]
        out[kind] = sorted(i["metadata"]["uid"] for i in items)
    return out


def rljob_events(kubectl: Kubectl, ns: str, name: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.kind=RLJob,involvedObject.name={name}"
    return list(kubectl.json("-n", ns, "get", "events", "--field-selector", selector)["items"])


def pod_uids(kubectl: Kubectl, ns: str) -> dict[str, str]:
    return {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in pods_in(kubectl, ns)
        if not p["metadata"].get("deletionTimestamp")
    }


def no_pods_left(kubectl: Kubectl, ns: str, timeout: float, what: str, selector: str = "") -> None:
    """Wait until no pod (matching `selector`) is left in `ns`; on timeout report every pod."""
    args = ["-n", ns, "get", "pods"] + (["-l", selector] if selector else [])
    try:
        poll(
            lambda: not kubectl.json(*args)["items"],
            timeout,
            what,
            interval=3,
            on_timeout=lambda: pods_report(kubectl, ns, selector),
        )
    except Exception as exc:
        pytest.fail(str(exc), pytrace=False)


# ----------------------------------------------------------------------------------------- failures


def test_entrypoint_crash_fails_the_rljob_with_the_containers_own_message(
    realpods: RealPods, rp_namespace: str
) -> None:
    kubectl, ns = realpods.kubectl, rp_namespace
    kubectl.apply(rljob("crash", ns, reward="rlkube_no_such_reward_module:score"))

    st = wait_status(kubectl, ns, "crash", lambda s: s.get("phase") in ("Failed", "Succeeded"), 900, "an end")
    assert st["phase"] == "Failed", rljob_report(kubectl, ns, "crash")
    # The container's own words (rlkube-train's ImportError), not only "the Ray job failed".
    assert "No module named 'rlkube_no_such_reward_module'" in st["message"], st["message"]
    assert "rlkube_no_such_reward_module:score" in st["message"], st["message"]
    assert len(st["message"]) <= 2000, "the full log belongs in the pod's log, not the status"
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "EntrypointFailed", failed
    # No retry and no crash loop: one RayJob, never retried; the Ray pods go away and KubeRay's
    # submitter ran once and stays finished (its Job is kept, like a Kubernetes Job, until the RLJob
    # is deleted).
    rayjob = kubectl.json("-n", ns, "get", "rayjob", "-l", f"{JOB_LABEL}=crash")["items"]
    assert len(rayjob) == 1 and int(rayjob[0]["status"].get("failed") or 0) <= 1, rayjob
    no_pods_left(kubectl, ns, 300, "the failed job's Ray pods to go away", selector="ray.io/cluster")
    submitters = pods_in(kubectl, ns)
    assert len(submitters) == 1, pods_report(kubectl, ns, "")
    assert submitters[0]["status"]["phase"] in ("Succeeded", "Failed"), pods_report(kubectl, ns, "")
    assert not any(c.get("restartCount") for c in submitters[0]["status"].get("containerStatuses") or ())


def test_missing_image_shows_the_pull_error_without_a_retry_storm(
    realpods: RealPods, rp_namespace: str
) -> None:
    kubectl, ns = realpods.kubectl, rp_namespace
    image = "rlkube/no-such-image:0.0.0"
    kubectl.apply(rljob("noimage", ns, image=image))

    pull = ("ErrImagePull", "ImagePullBackOff")
    st = wait_status(kubectl, ns, "noimage", lambda s: s.get("reason") in pull, 300, "the image pull error")
    assert image in st["message"], st["message"]
    assert st["phase"] == "Provisioning", st
    cluster = next(c for c in st["conditions"] if c["type"] == "ClusterReady")
    assert cluster["status"] == "False" and cluster["reason"] in pull, cluster

    # No retry storm: over a minute of kubelet back-off, the same pods and the same children stay
    # (no new RayCluster, no recreated pods), the reason does not flap, and the RLJob gets one
    # Warning event for it, not one per pull attempt.
    before_pods, before_children = pod_uids(kubectl, ns), children(kubectl, ns, "noimage")
    reasons = set()
    for _ in range(12):
        time.sleep(5)
        reasons.add(status(kubectl, ns, "noimage").get("reason"))
    assert pod_uids(kubectl, ns) == before_pods
    assert children(kubectl, ns, "noimage") == before_children
    assert len(reasons) == 1, f"the RLJob's reason flapped: {reasons}"
    events = rljob_events(kubectl, ns, "noimage")
    pull_events = [e for e in events if e.get("reason") in pull]
    assert len(pull_events) == 1 and int(pull_events[0].get("count") or 1) == 1, json.dumps(pull_events)


def test_too_small_memory_limit_shows_oomkilled(realpods: RealPods, rp_namespace: str) -> None:
    kubectl, ns = realpods.kubectl, rp_namespace
    # An idle Ray head (GCS, raylet, dashboard, agents) takes about 750 MiB; 500Mi still passes Ray's
    # own start-up check (object store >= 75 MiB), so the kernel kills it at the limit.
    kubectl.apply(rljob("oom", ns, head_memory="500Mi"))

    st = wait_status(kubectl, ns, "oom", lambda s: s.get("reason") == "OOMKilled", 600, "OOMKilled")
    msg = st["message"]
    assert "OOMKilled" in msg and "500Mi" in msg and "raise spec.head.memory" in msg, msg
    events = rljob_events(kubectl, ns, "oom")
    assert any(e.get("reason") == "OOMKilled" and e.get("type") == "Warning" for e in events), events


# ------------------------------------------------------------------------------------------ lifecycle


def test_suspend_removes_every_pod_and_resume_brings_them_back(realpods: RealPods, rp_namespace: str) -> None:
    kubectl, ns = realpods.kubectl, rp_namespace
    kubectl.apply(rljob("pause", ns, steps=10000))
    first = wait_job_pods_ready(kubectl, ns, "pause")

    kubectl("-n", ns, "patch", "rljob", "pause", "--type=merge", "-p", '{"spec": {"suspend": true}}')
    wait_status(kubectl, ns, "pause", lambda s: s.get("phase") == "Suspended", 300, "Suspended")
    no_pods_left(kubectl, ns, 300, "every pod of the suspended job to go")
    assert not kubectl.json("-n", ns, "get", "raycluster")["items"], "the RayCluster outlived the suspend"

    kubectl("-n", ns, "patch", "rljob", "pause", "--type=merge", "-p", '{"spec": {"suspend": false}}')
    old_cluster = first[0]["metadata"]["labels"]["ray.io/cluster"]
    again = wait_job_pods_ready(kubectl, ns, "pause", not_cluster=old_cluster)
    assert {p["metadata"]["uid"] for p in again}.isdisjoint({p["metadata"]["uid"] for p in first})
    wait_status(kubectl, ns, "pause", lambda s: s.get("phase") in ("Provisioning", "Running"), 120, "resumed")


def test_delete_removes_every_pod_and_child(realpods: RealPods, rp_namespace: str) -> None:
    kubectl, ns = realpods.kubectl, rp_namespace
    kubectl.apply(rljob("gone", ns, steps=10000))
    wait_job_pods_ready(kubectl, ns, "gone")
    assert all(children(kubectl, ns, "gone").values()), children(kubectl, ns, "gone")

    kubectl("-n", ns, "delete", "rljob", "gone", "--wait=true", "--timeout=180s", timeout=200)
    no_pods_left(kubectl, ns, 300, "every pod of the deleted job to go")
    poll(
        lambda: not any(children(kubectl, ns, "gone").values()),
        180,
        "every child of the deleted RLJob to go",
        on_timeout=lambda: json.dumps(children(kubectl, ns, "gone")),
    )
    assert not kubectl.json("-n", ns, "get", "jobs")["items"], "KubeRay's submitter Job outlived the RLJob"


def test_operator_pod_deleted_mid_job_makes_no_duplicate_children(
    realpods: RealPods, rp_namespace: str
) -> None:
    kubectl, ns = realpods.kubectl, rp_namespace
    kubectl.apply(rljob("steady", ns, steps=10000))
    wait_job_pods_ready(kubectl, ns, "steady")
    kids, pods = children(kubectl, ns, "steady"), pod_uids(kubectl, ns)
    assert all(len(uids) == 1 for uids in kids.values()), kids

    old = realpods.operator_pod()
    kubectl("-n", realpods.operator_namespace, "delete", "pod", old, "--wait=true", timeout=120)
    new = poll(
        lambda: p if (p := realpods.operator_pod()) != old else None,
        300,
        "a new operator pod",
        on_timeout=lambda: pods_report(kubectl, realpods.operator_namespace, ""),
    )

    # The new pod resumes the job (re-applies its children: a no-op) ...
    def resumed() -> bool:
        log = kubectl("-n", realpods.operator_namespace, "logs", new, check=False).stdout
        return f"RLJob {ns}/steady" in log

    poll(resumed, 180, "the new operator to resume the RLJob", on_timeout=lambda: pods_report(
        kubectl, realpods.operator_namespace, ""))  # fmt: skip
    time.sleep(10)
    # ... and nothing was created twice or recreated: same children, same pods.
    assert children(kubectl, ns, "steady") == kids
    assert pod_uids(kubectl, ns).items() >= pods.items(), (pods, pod_uids(kubectl, ns))
    assert status(kubectl, ns, "steady").get("phase") in ("Provisioning", "Running"), rljob_report(
        kubectl, ns, "steady"
    )


# ------------------------------------------------------------------------------------- least privilege

TOKEN_PROBE = """
import json, sys
from kubernetes import client, config
config.load_incluster_config()
ns, own, other = sys.argv[1:4]
core, custom = client.CoreV1Api(), client.CustomObjectsApi()
crd = ("rlkube.io", "v1alpha1", ns, "rljobs")
progress, suspend = {"status": {"progress": {"step": 0}}}, {"spec": {"suspend": True}}
def code(call, *args):
    try:
        call(*args)
        return 200
    except client.ApiException as exc:
        return exc.status
print(json.dumps({
    "list_secrets": code(core.list_namespaced_secret, ns),
    "read_secret": code(core.read_namespaced_secret, "probe", ns),
    "patch_other_status": code(custom.patch_namespaced_custom_object_status, *crd, other, progress),
    "patch_other_spec": code(custom.patch_namespaced_custom_object, *crd, other, suspend),
    "patch_own_spec": code(custom.patch_namespaced_custom_object, *crd, own, suspend),
    "patch_own_status": code(custom.patch_namespaced_custom_object_status, *crd, own, progress),
}))
"""


def test_job_pod_token_cannot_read_secrets_nor_patch_another_rljob(
    realpods: RealPods, rp_namespace: str
) -> None:
    kubectl, ns = realpods.kubectl, rp_namespace
    kubectl.apply(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "probe"}, "stringData": {"k": "v"}},
        "-n",
        ns,
    )
    kubectl.apply(rljob("other", ns, suspend=True))  # suspended: no pods, just an object to attack
    kubectl.apply(rljob("mine", ns, steps=10000))
    pods = wait_job_pods_ready(kubectl, ns, "mine")
    head = next(p for p in pods if p["metadata"]["labels"].get("ray.io/node-type") == "head")
    name = head["metadata"]["name"]

    probe = ["python", "-c", TOKEN_PROBE, ns, "mine", "other"]
    out = kubectl("-n", ns, "exec", name, "-c", "ray-head", "--", *probe, check=False, timeout=120)
    assert out.returncode == 0, f"the probe failed in pod {name}:\n{out.stdout}\n{out.stderr}"
    codes: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert codes["list_secrets"] == 403 and codes["read_secret"] == 403, codes
    assert codes["patch_other_status"] == 403 and codes["patch_other_spec"] == 403, codes
    assert codes["patch_own_spec"] == 403, codes
    # The positive control: the same token does what the runtime needs (its own status.progress).
    assert codes["patch_own_status"] == 200, codes
    assert (status(kubectl, ns, "other").get("progress") or {}).get("step") is None
