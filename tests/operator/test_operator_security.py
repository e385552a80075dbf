"""Issue 12 on the operator's side, on the real control plane: what the operator refuses itself (the admin
policy, even without the chart's admission policy), what it never overwrites (objects it did not create,
another RLJob's children), and that every refusal of what it or KubeRay creates reaches the RLJob within
30 s with the API server's message, a Warning Event and a reason to alert on, leaving nothing behind.

RLJobs are applied by `alice`, a user who may only create RLJobs (a Role on rljobs, impersonated).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from optest_fixtures import OperatorProcess
from optest_helpers import cond_is, describe, events_for, rljob, small_rljob

from rlkube.devcluster.testing import Kubectl
from rlkube.operator.render import ray_job_name

WaitFor = Callable[..., Any]
ALICE = "alice@example.com"
REFUSAL_BOUND_S = 30


@pytest.fixture
def alice(kubectl: Kubectl, namespace: str) -> Callable[[dict[str, Any]], Any]:
    """`alice(body)`: kubectl apply as a user bound to a Role on rljobs only."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "rljobs-only", "namespace": namespace},
        "rules": [
            {
                "apiGroups": ["rlkube.io"],
                "resources": ["rljobs"],
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
            }
        ],
    }
    kubectl("apply", "-f", "-", input=yaml.safe_dump(role))
    kubectl("-n", namespace, "create", "rolebinding", "alice", "--role=rljobs-only", f"--user={ALICE}")
    assert (
        kubectl(
            "auth", "can-i", "create", "pods", "-n", namespace, f"--as={ALICE}", check=False
        ).stdout.strip()
        == "no"
    )

    def apply(body: dict[str, Any]) -> Any:
        return kubectl(f"--as={ALICE}", "-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(body))

    return apply


def _exists(kubectl: Kubectl, ns: str, kind: str, name: str) -> bool:
    return kubectl("-n", ns, "get", kind, name, check=False).returncode == 0


def _warning(kubectl: Kubectl, ns: str, name: str, reason: str) -> dict[str, Any] | None:
    return next(
        (e for e in events_for(kubectl, ns, name) if e["type"] == "Warning" and e["reason"] == reason), None
    )


def test_the_operator_enforces_the_admin_policy_even_without_admission(
    kubectl: Kubectl,
    namespace: str,
    operator: OperatorProcess,
    alice: Callable[[dict[str, Any]], Any],
    wait_for: WaitFor,
) -> None:
    """No admission policy here (no chart): the operator alone refuses, with Valid=False and no children."""
    ns = namespace
    kubectl("-n", ns, "create", "serviceaccount", "powerful")
    attack = small_rljob(
        "attack",
        serviceAccountName="powerful",
        priorityClassName="system-node-critical",
        gpu={"tolerations": [{"operator": "Exists"}]},
        mounts=[{"name": "root", "mountPath": "/host", "hostPath": "/", "readOnly": False}],
    )
    alice(attack)  # admitted: nothing but the operator stands in the way
    c = wait_for(
        cond_is(kubectl, ns, "attack", "Valid", "False", "PolicyViolation"),
        30,
        describe(kubectl, ns, "attack"),
    )
    for text in (
        'spec.serviceAccountName: "powerful" is not allowed by the rlkube admin policy (default: '
        "serviceAccounts allows none)",
        'spec.priorityClassName: "system-node-critical" is not allowed',
        "spec.gpu.tolerations: a toleration of every taint (no key) is not allowed",
        "spec.mounts[root].hostPath: a node directory is not allowed by the rlkube admin policy (default: "
        "hostPath.enabled is false)",
    ):
        assert text in c["message"], c["message"]
    job = rljob(kubectl, ns, "attack")
    assert (job["status"]["phase"], job["status"]["reason"]) == ("Failed", "PolicyViolation")
    assert wait_for(lambda: _warning(kubectl, ns, "attack", "PolicyViolation"), 20)
    time.sleep(2)
    for kind in ("rayjobs", "configmaps", "roles", "rolebindings"):
        items = kubectl.json("-n", ns, "get", kind, "-l", "rlkube.io/rljob=attack")["items"]
        assert items == [], kind
    assert not kubectl.json("-n", ns, "get", "pods")["items"]


def test_an_rljob_never_takes_over_objects_it_did_not_create(
    kubectl: Kubectl,
    namespace: str,
    operator: OperatorProcess,
    alice: Callable[[dict[str, Any]], Any],
    wait_for: WaitFor,
) -> None:
    """Issue 12: RLJob `victim` rewrote an existing Role and ConfigMap and garbage-collected them."""
    ns = namespace
    kubectl("-n", ns, "create", "configmap", "victim-config", "--from-literal=keep=me")
    kubectl("-n", ns, "create", "serviceaccount", "victim-runtime")
    kubectl("-n", ns, "create", "role", "victim-runtime", "--verb=get", "--resource=configmaps")
    before = {
        k: kubectl.json("-n", ns, "get", k, n)
        for k, n in (("configmap", "victim-config"), ("role", "victim-runtime"))
    }

    alice(small_rljob("victim", gpus=1))
    c = wait_for(
        cond_is(kubectl, ns, "victim", "ClusterReady", "False", "ChildConflict"),
        30,
        describe(kubectl, ns, "victim"),
    )
    for obj in (
        "ConfigMap victim-config exists (no owner)",
        "ServiceAccount victim-runtime exists (no owner)",
        "Role victim-runtime exists (no owner)",
    ):
        assert obj in c["message"], c["message"]
    assert rljob(kubectl, ns, "victim")["status"]["phase"] == "Pending"
    assert wait_for(lambda: _warning(kubectl, ns, "victim", "ChildConflict"), 20)
    assert not _exists(kubectl, ns, "rayjob", "victim") and not _exists(
        kubectl, ns, "rolebinding", "victim-runtime"
    )
    for (kind, name), old in zip(
        (("configmap", "victim-config"), ("role", "victim-runtime")), before.values(), strict=True
    ):
        now = kubectl.json("-n", ns, "get", kind, name)
        assert now["metadata"]["resourceVersion"] == old["metadata"]["resourceVersion"], kind  # untouched
        assert not now["metadata"].get("ownerReferences")

    kubectl("-n", ns, "delete", "rljob", "victim", "--wait=true", timeout=60)
    time.sleep(3)  # the garbage collector had its chance
    for kind, name in (
        ("configmap", "victim-config"),
        ("role", "victim-runtime"),
        ("serviceaccount", "victim-runtime"),
    ):
        assert _exists(kubectl, ns, kind, name), (kind, name)

    # A conflict is a condition, not a dead end: with the foreign objects gone the next try proceeds.
    alice(small_rljob("victim", gpus=1))
    wait_for(cond_is(kubectl, ns, "victim", "ClusterReady", "False", "ChildConflict"), 30)
    for kind, name in (
        ("configmap", "victim-config"),
        ("role", "victim-runtime"),
        ("serviceaccount", "victim-runtime"),
    ):
        kubectl("-n", ns, "delete", kind, name)
    wait_for(lambda: _exists(kubectl, ns, "rayjob", "victim"), 60, describe(kubectl, ns, "victim"))


def test_no_rljob_can_take_the_rayjob_of_another_by_its_hashed_name(
    kubectl: Kubectl,
    namespace: str,
    operator: OperatorProcess,
    alice: Callable[[dict[str, Any]], Any],
    wait_for: WaitFor,
) -> None:
    ns = namespace
    first = small_rljob("col.a", gpus=1)
    alice(first)
    hashed = ray_job_name("col.a")
    wait_for(lambda: _exists(kubectl, ns, "rayjob", hashed), 60, describe(kubectl, ns, "col.a"))
    owner = kubectl.json("-n", ns, "get", "rayjob", hashed)["metadata"]["ownerReferences"][0]
    alice(small_rljob(hashed, gpus=1))  # literally named like the other's RayJob
    wait_for(lambda: _exists(kubectl, ns, "rayjob", ray_job_name(hashed)), 60, describe(kubectl, ns, hashed))
    assert ray_job_name(hashed) != hashed
    after = kubectl.json("-n", ns, "get", "rayjob", hashed)["metadata"]["ownerReferences"]
    assert after == [owner] and owner["name"] == "col.a"


def test_a_refused_child_rolls_back_its_attempt_and_the_rljob_says_why_within_30s(
    kubectl: Kubectl,
    namespace: str,
    operator: OperatorProcess,
    alice: Callable[[dict[str, Any]], Any],
    wait_for: WaitFor,
) -> None:
    """Issue 12: a refused child left `Pending RayJobNotCreated`, Valid=True, no Event, the rest behind."""
    ns = namespace
    kubectl("-n", ns, "create", "quota", "no-rayjobs", "--hard=count/rayjobs.ray.io=0")
    t0 = time.monotonic()
    alice(small_rljob("refused", gpus=1))
    c = wait_for(
        cond_is(kubectl, ns, "refused", "ClusterReady", "False", "QuotaExceeded"),
        REFUSAL_BOUND_S,
        describe(kubectl, ns, "refused"),
    )
    latency = time.monotonic() - t0
    sys.stderr.write(f"\n[refusal] RayJob over an object-count quota -> RLJob condition in {latency:.1f} s\n")
    assert 'rayjobs.ray.io "refused" is forbidden: exceeded quota: no-rayjobs' in c["message"], c["message"]
    for undone in (
        "ServiceAccount refused-runtime",
        "Role refused-runtime",
        "ConfigMap refused-config",
        "RoleBinding refused-runtime",
    ):
        assert undone in c["message"].split("rolled back", 1)[1], c["message"]
    job = rljob(kubectl, ns, "refused")
    assert condition_status(job, "Valid") == "True" and job["status"]["reason"] == "QuotaExceeded"
    assert wait_for(lambda: _warning(kubectl, ns, "refused", "QuotaExceeded"), 20)
    for kind, name in (
        ("configmap", "refused-config"),
        ("serviceaccount", "refused-runtime"),
        ("role", "refused-runtime"),
        ("rolebinding", "refused-runtime"),
    ):
        assert not _exists(kubectl, ns, kind, name), f"{kind} {name} was left behind"
    kubectl("-n", ns, "delete", "quota", "no-rayjobs")  # the admin raises the quota: the job proceeds
    wait_for(lambda: _exists(kubectl, ns, "rayjob", "refused"), 90, describe(kubectl, ns, "refused"))


def condition_status(obj: dict[str, Any], type_: str) -> str:
    return next((c["status"] for c in obj["status"]["conditions"] if c["type"] == type_), "")


@pytest.mark.parametrize(
    ("case", "reason", "api_says"),
    [
        ("quota", "QuotaExceeded", "exceeded quota: no-pods"),
        ("pod-security", "PodSecurityRefused", 'violates PodSecurity "restricted:latest"'),
        ("priority-class", "PriorityClassNotFound", "no PriorityClass with name gold-not-there was found"),
        ("invalid-field", "InvalidPodSpec", "spec.nodeSelector: Invalid value"),
    ],
)
def test_every_pod_creation_refusal_reaches_the_rljob_within_30s(
    kubectl: Kubectl,
    namespace: str,
    operator_factory: Callable[..., OperatorProcess],
    alice: Callable[[dict[str, Any]], Any],
    wait_for: WaitFor,
    tmp_path: Path,
    case: str,
    reason: str,
    api_says: str,
) -> None:
    """KubeRay creates the pods; the API server refuses them. Before: `PodsPending` forever."""
    ns = namespace
    policy = tmp_path / "policy.yaml"
    policy.write_text("default: {priorityClasses: [gold-not-there]}\n")
    operator_factory(f"--policy={policy}", namespaces=[ns])
    spec: dict[str, Any] = {}
    if case == "quota":
        kubectl("-n", ns, "create", "quota", "no-pods", "--hard=pods=0")
    elif case == "pod-security":
        kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    elif case == "priority-class":
        spec["priorityClassName"] = "gold-not-there"
    else:
        spec["gpu"] = {"nodeSelector": {"amd.com/gpu.family": "not a label value"}}
    t0 = time.monotonic()
    alice(small_rljob("pods", gpus=1, **spec))
    c = wait_for(
        cond_is(kubectl, ns, "pods", "ClusterReady", "False", reason),
        REFUSAL_BOUND_S,
        describe(kubectl, ns, "pods"),
    )
    latency = time.monotonic() - t0
    sys.stderr.write(f"\n[refusal] {case}: RLJob created -> ClusterReady=False/{reason} in {latency:.1f} s\n")
    assert api_says in c["message"], c["message"]
    job = rljob(kubectl, ns, "pods")
    assert (job["status"]["phase"], job["status"]["reason"]) == ("Provisioning", reason)
    ev = wait_for(lambda: _warning(kubectl, ns, "pods", reason), 20)
    assert api_says in ev["message"]
