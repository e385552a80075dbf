"""Attacks on an installed chart, as issue 12 made them, on the real control plane.

A user with RLJob rights only (`alice`, bound to the chart's <release>-edit ClusterRole in one namespace,
acting through impersonation) tries to get node root or another ServiceAccount's token through an
RLJob; the operator's own token tries to reach kube-system and objects it does not own. Each must be
refused with a message naming the field and the policy (or the rule) that refused it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CLUSTER, can_i_list
from optest_helpers import REPO, small_rljob, token_kubeconfig

from rlkube.api.models import RLJob
from rlkube.devcluster.testing import Kubectl
from rlkube.operator.policy import PolicySet, check_policy

WaitFor = Callable[..., Any]
ALICE = "alice@example.com"


def as_user(kubectl: Kubectl, user: str, *args: str, body: dict[str, Any] | None = None) -> Any:
    extra = ["-f", "-"] if body is not None else []
    return kubectl(
        f"--as={user}", *args, *extra, input=yaml.safe_dump(body) if body is not None else None, check=False
    )


def bind_alice(kubectl: Kubectl, rel: dict[str, Any]) -> None:
    kubectl(
        "-n",
        rel["jobs"],
        "create",
        "rolebinding",
        "alice-rljobs",
        f"--clusterrole={rel['fullname']}-edit",
        f"--user={ALICE}",
    )


def denial(proc: Any) -> str:
    """The admission policy's message in a refused kubectl call."""
    assert proc.returncode != 0, proc.stdout
    assert "denied request: " in proc.stderr, proc.stderr
    return str(proc.stderr.split("denied request: ", 1)[1].strip())


ATTACKS: dict[str, dict[str, Any]] = {
    "service-account": {"serviceAccountName": "powerful"},
    "priority-class": {"priorityClassName": "system-node-critical"},
    "tolerate-all": {"gpu": {"tolerations": [{"operator": "Exists"}]}},
    "host-root-rw": {"mounts": [{"name": "root", "mountPath": "/host", "hostPath": "/", "readOnly": False}]},
    "node-selector": {"gpu": {"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}},
}


@pytest.mark.parametrize("release", [{}], indirect=True, ids=["namespaced"])
def test_a_user_with_rljob_rights_only_gets_nothing_more_through_an_rljob(
    kubectl: Kubectl, release: dict[str, Any]
) -> None:
    ns = release["jobs"]
    bind_alice(kubectl, release)
    kubectl("-n", ns, "create", "serviceaccount", "powerful")
    for verb, res in (("create", "pods"), ("create", "rayjobs.ray.io"), ("get", "secrets")):
        assert as_user(kubectl, ALICE, "auth", "can-i", verb, res, "-n", ns).stdout.strip() == "no"
    assert (
        as_user(kubectl, ALICE, "auth", "can-i", "create", "rljobs.rlkube.io", "-n", ns).stdout.strip()
        == "yes"
    )

    everything = small_rljob("attack", **{k: v for a in ATTACKS.values() for k, v in a.items() if k != "gpu"})
    everything["spec"]["gpu"] = {"tolerations": [{"operator": "Exists"}]}
    msg = denial(as_user(kubectl, ALICE, "-n", ns, "apply", body=everything))
    assert msg.startswith(
        'spec.serviceAccountName: "powerful" is not allowed by the rlkube admin policy (default'
    )
    expected = {
        "service-account": 'spec.serviceAccountName: "powerful"',
        "priority-class": 'spec.priorityClassName: "system-node-critical"',
        "tolerate-all": "spec.gpu.tolerations: a toleration of every taint (no key)",
        "host-root-rw": "spec.mounts[root].hostPath: a node directory is not allowed by the rlkube admin "
        "policy (default: hostPath.enabled is false)",
        "node-selector": 'spec.gpu.nodeSelector: label key "node-role.kubernetes.io/control-plane"',
    }
    for name, spec in ATTACKS.items():
        msg = denial(as_user(kubectl, ALICE, "-n", ns, "apply", body=small_rljob(name, **spec)))
        assert msg.startswith(expected[name]), (name, msg)
    assert not kubectl.json("-n", ns, "get", "rljobs")["items"]  # nothing got in
    # A plain RLJob is fine, and editing only metadata of one the policy would refuse today still works.
    ok = as_user(kubectl, ALICE, "-n", ns, "apply", body=small_rljob("fine"))
    assert ok.returncode == 0, ok.stderr


# The same specs meet both enforcers: the admission policy's first refusal is the operator's first.
DIFFERENTIAL: list[tuple[str, dict[str, Any]]] = [
    ("plain", {}),
    *ATTACKS.items(),
    ("gpu-toleration", {"gpu": {"tolerations": [{"key": "amd.com/gpu", "operator": "Exists"}]}}),
    ("env-nccl", {"env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}]}),
    ("env-preload", {"env": [{"name": "LD_PRELOAD", "value": "/x.so"}]}),
    ("image-elsewhere", {"image": "docker.io/someone/evil:1"}),
    ("image-ours", {"image": "registry.example.com/rl/runtime:1"}),
    ("pvc", {"mounts": [{"name": "m", "mountPath": "/m", "persistentVolumeClaim": "models"}]}),
    ("ckpt-pvc", {"checkpoint": {"persistentVolumeClaim": "ckpt"}}),
    ("host-data-ro", {"mounts": [{"name": "d", "mountPath": "/d", "hostPath": "/data/gsm8k"}]}),
    ("host-data-rw", {"mounts": [{"name": "d", "mountPath": "/d", "hostPath": "/data", "readOnly": False}]}),
    ("host-escape", {"mounts": [{"name": "d", "mountPath": "/d", "hostPath": "/data/../etc"}]}),
    ("host-prefix", {"mounts": [{"name": "d", "mountPath": "/d", "hostPath": "/database"}]}),
    (
        "host-out-rw",
        {"mounts": [{"name": "o", "mountPath": "/o", "hostPath": "/data/out/1", "readOnly": False}]},
    ),
    ("sa-team", {"serviceAccountName": "team-trainer"}),
]
TEAM_POLICY = {
    "watchNamespaces": "{JOBS,default}",
    "policy.namespaces.JOBS.serviceAccounts": "{team-*}",
    "policy.namespaces.JOBS.images": "{registry.example.com/*}",
    "policy.namespaces.JOBS.envNames": "{NCCL_*}",
    "policy.namespaces.JOBS.persistentVolumeClaims": "false",
    "policy.namespaces.JOBS.hostPath.enabled": "true",
    "policy.namespaces.JOBS.hostPath.paths": "{/data/}",
    "policy.namespaces.JOBS.hostPath.writablePaths": "{/data/out}",
}


@pytest.mark.parametrize("release", [TEAM_POLICY], indirect=True, ids=["namespace-policy"])
def test_admission_and_operator_enforce_the_same_policy_in_the_same_words(
    kubectl: Kubectl, release: dict[str, Any], tmp_path: Path
) -> None:
    ns = release["jobs"]
    cm = kubectl.json("-n", release["namespace"], "get", "configmap", f"{release['fullname']}-defaults")
    scope, policy = PolicySet.model_validate(yaml.safe_load(cm["data"]["policy.yaml"])).for_namespace(ns)
    assert scope == f"namespaces.{ns}"
    verdicts = {}
    for name, spec in DIFFERENTIAL:
        body = small_rljob(name, **spec)
        if "image" not in spec:
            del body["spec"]["image"]  # the platform default, which the policy does not judge
        proc = kubectl(
            "-n", ns, "apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(body), check=False
        )
        admitted = None if proc.returncode == 0 else denial(proc)
        errors = check_policy(RLJob.model_validate(body).spec, policy, scope)
        python = str(errors[0]) if errors else None
        assert admitted == python, name
        verdicts[name] = python is None
    assert verdicts == {
        "plain": True,
        "service-account": False,
        "priority-class": False,
        "tolerate-all": False,
        "host-root-rw": False,
        "node-selector": False,
        "gpu-toleration": True,
        "env-nccl": True,
        "env-preload": False,
        "image-elsewhere": False,
        "image-ours": True,
        "pvc": False,
        "ckpt-pvc": False,
        "host-data-ro": True,
        "host-data-rw": False,
        "host-escape": False,
        "host-prefix": False,
        "host-out-rw": True,
        "sa-team": True,
    }
    # Another served namespace keeps the default policy (no hostPath at all); a namespace this release
    # does not serve is not its business (another release, or none, decides there).
    host = yaml.safe_dump(small_rljob("d", **dict(DIFFERENTIAL)["host-data-ro"]))
    dry_run = ("apply", "--dry-run=server", "-f", "-")
    other = kubectl("-n", "default", *dry_run, input=host, check=False)
    assert "(default: hostPath.enabled is false)" in denial(other)
    unserved = kubectl("-n", release["namespace"], *dry_run, input=host, check=False)
    assert unserved.returncode == 0, unserved.stderr


def _operator_token(kubectl: Kubectl, rel: dict[str, Any], tmp_path: Path) -> Kubectl:
    return token_kubeconfig(kubectl, tmp_path / "op.kubeconfig", rel["namespace"], rel["sa"])


def _owned(name: str, uid: str = "00000000-0000-0000-0000-000000000001") -> dict[str, Any]:
    return {
        "name": name,
        "labels": {"rlkube.io/rljob": "x"},
        "ownerReferences": [
            {"apiVersion": "rlkube.io/v1alpha1", "kind": "RLJob", "name": "x", "uid": uid, "controller": True}
        ],
    }


PRIVILEGED_RAYJOB = {
    "apiVersion": "ray.io/v1",
    "kind": "RayJob",
    "metadata": _owned("gc"),
    "spec": {
        "entrypoint": "sleep 1",
        "rayClusterSpec": {
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {
                    "spec": {
                        "serviceAccountName": "generic-garbage-collector",
                        "hostPID": True,
                        "containers": [{"name": "h", "image": "x", "securityContext": {"privileged": True}}],
                        "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
                    }
                },
            }
        },
    },
}


@pytest.mark.parametrize("release", [{}, CLUSTER], indirect=True, ids=["namespaced", "cluster"])
def test_the_operators_token_cannot_reach_system_namespaces_or_objects_it_does_not_own(
    kubectl: Kubectl, release: dict[str, Any], tmp_path: Path
) -> None:
    op = _operator_token(kubectl, release, tmp_path)
    jobs = release["jobs"]

    def apply(ns: str, body: dict[str, Any]) -> Any:
        return op(
            "-n",
            ns,
            "apply",
            "--server-side",
            "--field-manager=rlkube-operator",
            "--force-conflicts",
            "-f",
            "-",
            input=yaml.safe_dump(body),
            check=False,
        )

    # kube-system: no RBAC there (namespaced mode); the guard refuses it (cluster mode).
    in_system = apply("kube-system", PRIVILEGED_RAYJOB)
    assert in_system.returncode != 0
    if release["values"].get("mode") == "cluster":
        assert "may not write in namespace kube-system (clusterMode.excludeNamespaces)" in in_system.stderr
        mine = apply(release["namespace"], {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _owned("c")})
        assert f"may not write in namespace {release['namespace']}" in mine.stderr
    else:
        assert 'cannot patch resource "rayjobs"' in in_system.stderr and "kube-system" in in_system.stderr
    # In a served namespace: no privileged, host-namespace or host-directory pods, whoever asks.
    privileged = apply(jobs, PRIVILEGED_RAYJOB)
    assert "never renders privileged or host-namespace pods" in privileged.stderr, privileged.stderr
    # No taking over an object it did not create (a coredns-like ConfigMap, a Role) and no foreign ones.
    kubectl("-n", jobs, "create", "configmap", "victim-config", "--from-literal=Corefile=.:53")
    takeover = apply(
        jobs,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _owned("victim-config"),
            "data": {"Corefile": "evil"},
        },
    )
    assert "writes only its own children" in takeover.stderr, takeover.stderr
    assert kubectl.json("-n", jobs, "get", "configmap", "victim-config")["data"] == {"Corefile": ".:53"}
    unlabelled = apply(jobs, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "loose"}})
    assert "writes only its own children" in unlabelled.stderr
    wide_role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _owned("wide"),
        # rights the operator holds (so RBAC's escalation check lets it grant them), but not RLJob-only
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}],
    }
    refused = apply(jobs, wide_role)
    assert "may only grant access to named RLJobs" in refused.stderr, refused.stderr
    for verb, res in (
        ("get", "secrets"),
        ("create", "pods"),
        ("delete", "rayjobs.ray.io"),
        ("delete", "pods"),
        ("update", "rljobs.rlkube.io"),
    ):
        assert (
            kubectl(
                "auth", "can-i", verb, res, "-n", jobs, f"--as={release['who']}", check=False
            ).stdout.strip()
            == "no"
        )


def _docs_table(mode: str) -> dict[str, set[str]]:
    """The can-i table of docs/operator.md for `mode` (`namespaced` or `cluster`): resource -> verbs."""
    text = (REPO / "docs" / "operator.md").read_text()
    section = text.split(f"<!-- can-i {mode} -->", 1)[1].split("<!-- /can-i -->", 1)[0]
    table: dict[str, set[str]] = {}
    for line in section.strip().splitlines()[2:]:  # past the header and the |---| row
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        table[cells[0]] = set(cells[1].split(", "))
    return table


# What every authenticated identity may do anyway (the API server's built-in discovery/self-review roles).
BASELINE = {
    "selfsubjectreviews.authentication.k8s.io",
    "selfsubjectaccessreviews.authorization.k8s.io",
    "selfsubjectrulesreviews.authorization.k8s.io",
}


@pytest.mark.parametrize(
    ("release", "mode"),
    [
        ({"peering.enabled": "true", "replicaCount": "2"}, "namespaced"),
        ({**CLUSTER, "peering.enabled": "true", "replicaCount": "2"}, "cluster"),
    ],
    indirect=["release"],
    ids=["namespaced", "cluster"],
)
def test_can_i_list_of_the_operator_matches_the_docs_table(
    kubectl: Kubectl, release: dict[str, Any], mode: str
) -> None:
    served = {
        k: v for k, v in can_i_list(kubectl, release["who"], release["jobs"]).items() if k not in BASELINE
    }
    assert served == _docs_table(mode)
    elsewhere = {
        k: v for k, v in can_i_list(kubectl, release["who"], "kube-system").items() if k not in BASELINE
    }
    if mode == "namespaced":
        assert elsewhere == {}  # nothing outside the served namespaces
    else:
        assert elsewhere == served  # RBAC cannot say "all but": the admission guard does (test above)


@pytest.mark.parametrize("release", [{}], indirect=True, ids=["namespaced"])
def test_builtin_edit_and_view_roles_include_rljobs(
    kubectl: Kubectl, release: dict[str, Any], wait_for: WaitFor
) -> None:
    ns = release["jobs"]
    kubectl("-n", ns, "create", "rolebinding", "bob-edit", "--clusterrole=edit", "--user=bob")
    kubectl("-n", ns, "create", "rolebinding", "carol-view", "--clusterrole=view", "--user=carol")

    def can(user: str, verb: str) -> str:
        return str(
            kubectl(
                "auth", "can-i", verb, "rljobs.rlkube.io", "-n", ns, f"--as={user}", check=False
            ).stdout.strip()
        )

    wait_for(lambda: can("bob", "create") == "yes" and can("carol", "list") == "yes", 30, what="aggregation")
    assert can("carol", "create") == "no"
