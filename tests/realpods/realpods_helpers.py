"""Real-pod tests: RLJobs run in real containers on the devcluster's real node.

The session's cluster must have the real node (`make test` and CI start it; RLKUBE_REAL_NODE=1
makes its absence an error at start-up); these tests fail, never skip, without it. The images are
built (cached) and imported, and the operator runs as a pod from `helm install charts/rlkube`
(release `rlkube-realpods`) watching only the session's `rp-<hex>` namespace, so it never meets the
RLJobs of other tests (which run their own operator on the host) or of `make demo`. The tests share
that namespace (one watch per resource, not one per test), use distinct RLJob names, and the
namespace is emptied after each test.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlkube.devcluster.node import NODE_NAME, REAL_NODE_LABEL
from rlkube.devcluster.realpods import (
    OPERATOR_IMAGE,
    REAL_NODE_TOLERATION,
    RUNTIME_IMAGE,
    HostDirs,
    install_operator,
    load_images,
    poll,
    rljob_report,
    rljob_status,
    share_with_pods,
    uninstall_operator,
)
from rlkube.devcluster.testing import Kubectl, TestCluster

OPERATOR_NAMESPACE = "rlkube-realpods"
RELEASE = "rlkube-realpods"
NAMESPACE_PREFIX = "rp-"  # + a hex per session
WORK_DIR = Path("/tmp/rlkube-realpods")
TASK_DIR = WORK_DIR / "task"
OUTPUT_DIR = WORK_DIR / "outputs"
JOB_LABEL = "rlkube.io/rljob"


@dataclass
class RealPods:
    """The session's real-pod setup: kubectl, the operator pod, the tiny task on the node."""

    kubectl: Kubectl
    operator_namespace: str
    release: str
    namespace: str  # the one namespace the operator pod watches; the tests' RLJobs have distinct names

    def operator_pod(self) -> str:
        from rlkube.devcluster.realpods import wait_operator_ready

        return wait_operator_ready(self.kubectl, self.operator_namespace, self.release)


def _require_real_node(devcluster: TestCluster, kubectl: Kubectl) -> None:
    nodes = kubectl.json("get", "nodes", "-l", f"{REAL_NODE_LABEL}=true")["items"]
    ready = [
        n
        for n in nodes
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions") or ())
    ]
    if ready:
        return
    why = "no Ready node labelled " + REAL_NODE_LABEL
    if devcluster.local is not None:
        state = devcluster.local.read_state() or {}
        reason = (state.get("real_node") or {}).get("reason")
        if reason:
            why += f" (the cluster started kwok-only: {reason})"
    pytest.fail(
        f"real-pod tests need the devcluster's real node: {why}. Run as root after `make cluster-build`; "
        "RLKUBE_REAL_NODE=1 makes this an error when the cluster starts.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def realpods(devcluster: TestCluster, kubectl: Kubectl) -> Iterator[RealPods]:
    """Images in the node, the tiny task on it, the session's `rp-*` namespace and the operator as a
    pod watching only it (both removed at the end)."""
    _require_real_node(devcluster, kubectl)
    digests = load_images(lambda _m: None)
    from rlkube.devcluster.tiny_task import prepare_tiny_task

    prepare_tiny_task(TASK_DIR)
    share_with_pods(TASK_DIR)
    namespace = f"{NAMESPACE_PREFIX}{secrets.token_hex(3)}"
    kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    outputs = OUTPUT_DIR / namespace  # this session's results and checkpoints (nothing to resume from)
    outputs.mkdir(parents=True, exist_ok=True)
    for path in (OUTPUT_DIR, outputs):
        path.chmod(0o1777)  # the pods run as uid 1000
    try:
        install_operator(
            kubectl,
            OPERATOR_NAMESPACE,
            release=RELEASE,
            watch_namespaces=[namespace],
            image_digest=digests[OPERATOR_IMAGE],
            # The admin's opt-in for exactly what these RLJobs mount: the task read-only, outputs writable.
            host_dirs=HostDirs(read=(str(WORK_DIR),), write=(str(OUTPUT_DIR),)),
        )
        yield RealPods(kubectl, OPERATOR_NAMESPACE, RELEASE, namespace)
    finally:
        _empty(kubectl, namespace)
        uninstall_operator(kubectl, OPERATOR_NAMESPACE, RELEASE)
        kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def pods_in(kubectl: Kubectl, namespace: str) -> list[dict[str, Any]]:
    return list(kubectl.json("-n", namespace, "get", "pods")["items"])


def _empty(kubectl: Kubectl, namespace: str) -> None:
    """Delete every RLJob (their children go by garbage collection) and Secret, and wait for the pods."""
    delete = ["-n", namespace, "delete", "rljobs", "--all", "--wait=true", "--timeout=180s"]
    kubectl(*delete, check=False, timeout=200)
    kubectl("-n", namespace, "delete", "secrets", "--all", check=False)
    deadline = time.monotonic() + 240
    while pods_in(kubectl, namespace) and time.monotonic() < deadline:
        time.sleep(3)


@pytest.fixture
def rp_namespace(realpods: RealPods) -> Iterator[str]:
    """The session's `rp-*` namespace (the one the operator pod watches), emptied after each test:
    RLJobs and Secrets deleted and the pods awaited, so the next test has the node to itself."""
    try:
        yield realpods.namespace
    finally:
        _empty(realpods.kubectl, realpods.namespace)


def rljob(
    name: str,
    namespace: str,
    *,
    steps: int = 2,
    image: str = RUNTIME_IMAGE,
    reward: str = "arith",
    trainer_memory: str = "1Gi",
    head_memory: str = "2Gi",
    suspend: bool = False,
) -> dict[str, Any]:
    """The tiny RLJob (`tiny_rljob`, the one every test starts from) made small and placed on the real
    node: one head, one worker; results and checkpoints in this namespace's own outputs folder."""
    from rlkube.devcluster.tiny_task import TinyTask, tiny_rljob

    task = TinyTask(TASK_DIR / "model", TASK_DIR / "train.jsonl", TASK_DIR / "heldout.jsonl", 0.0)
    outputs = OUTPUT_DIR / namespace
    job = tiny_rljob(
        task,
        name=name,
        steps=steps,
        trainer={
            "replicas": 1,
            "gpusPerReplica": 0,
            "cpusPerReplica": 1,
            "memory": trainer_memory,
            "shmSize": "64Mi",
        },
        image=image,
        data={"reward": reward},
        algorithm={"groupSize": 4},
        training={"trainBatchSize": 8, "miniBatchSize": 8, "microBatchSize": 32, "evalIntervalSteps": 0},
        gpu={
            "vendor": "cpu",
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "tolerations": [REAL_NODE_TOLERATION],
        },
        head={"cpu": 1, "memory": head_memory},
        env=[{"name": "RLKUBE_OUTPUT_DIR", "value": str(outputs)}],
        mounts=[
            {"name": "task", "hostPath": str(WORK_DIR), "mountPath": str(WORK_DIR)},
            {"name": "outputs", "hostPath": str(outputs), "mountPath": str(outputs), "readOnly": False},
        ],
        checkpoint={"intervalSteps": 0},
        ttlSecondsAfterFinished=0,
        suspend=suspend,
    )
    job["metadata"]["namespace"] = namespace
    return job


def status(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    return rljob_status(kubectl, namespace, name)


def wait_status(
    kubectl: Kubectl,
    namespace: str,
    name: str,
    check: Callable[[dict[str, Any]], bool],
    timeout: float,
    what: str,
) -> dict[str, Any]:
    """Poll the RLJob's status until `check(status)`; on timeout fail with the RLJob and pod report."""
    try:
        return poll(
            lambda: st if check(st := status(kubectl, namespace, name)) else None,
            timeout,
            f"rljob {namespace}/{name}: {what}",
            interval=3,
            on_timeout=lambda: rljob_report(kubectl, namespace, name),
        )
    except Exception as exc:
        pytest.fail(str(exc), pytrace=False)


def wait_job_pods_ready(
    kubectl: Kubectl, namespace: str, name: str, timeout: float = 600, *, not_cluster: str = ""
) -> list[dict[str, Any]]:
    """The RLJob's Ray pods (head + worker) once all are Ready on the real node; `not_cluster`: wait
    for a RayCluster other than that one (KubeRay makes a new one when a suspended job resumes)."""
    from rlkube.devcluster.realpods import wait_ray_pods_ready

    def new_cluster(s: dict[str, Any]) -> bool:
        return bool(s.get("rayClusterName")) and s.get("rayClusterName") != not_cluster

    st = wait_status(kubectl, namespace, name, new_cluster, 300, "a RayCluster")
    try:
        pods = wait_ray_pods_ready(kubectl, namespace, st["rayClusterName"], timeout=timeout)
    except Exception as exc:
        pytest.fail(f"{exc}\n{rljob_report(kubectl, namespace, name)}", pytrace=False)
    assert all(p["spec"].get("nodeName") == NODE_NAME for p in pods), [
        p["spec"].get("nodeName") for p in pods
    ]
    return pods
