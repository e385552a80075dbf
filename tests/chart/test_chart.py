"""The Helm chart: what it renders in each mode, lint, server-side dry-run, install, and RBAC proven by use.

After `helm install`, the operator runs on the host as the chart's Deployment runs it (its flags, its
policy file, a token of its ServiceAccount; kwok runs no containers, so the Deployment's pod is only a
fake) and drives a whole RLJob lifecycle: if the chart's RBAC lacked anything, a step would fail with 403.
It must not be able to read Secrets.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, CLUSTER, NAMESPACED, PEERED, helm, of_kind, render, set_args, start_as_chart
from optest_fixtures import OperatorProcess
from optest_helpers import REPO, condition, rljob, small_rljob, token_kubeconfig

from rlkube.devcluster.testing import Kubectl
from rlkube.operator.policy import PolicySet, load_policy

WaitFor = Callable[..., Any]
POLICY_TEAM_A = {
    "policy.namespaces.team-a.serviceAccounts": "{trainer}",
    "policy.namespaces.team-a.hostPath.enabled": "true",
    "policy.namespaces.team-a.hostPath.paths": "{/data}",
    "policy.namespaces.team-a.persistentVolumeClaims": "false",
}


@pytest.mark.parametrize(
    "values",
    [NAMESPACED, CLUSTER, PEERED, {**CLUSTER, **PEERED}, POLICY_TEAM_A],
    ids=["namespaced", "cluster", "peered", "cluster-peered", "namespace-policy"],
)
def test_helm_lint(values: dict[str, str]) -> None:
    out = helm("lint", str(CHART), *set_args(values))
    assert "0 chart(s) failed" in out.stdout


def test_values_schema_refuses_unsafe_combinations() -> None:
    def refused(*args: str) -> str:
        proc = helm("template", "r", str(CHART), *args, check=False)
        assert proc.returncode != 0, args
        return proc.stderr

    assert "peering" in refused("--set", "replicaCount=2")
    assert "watchNamespaces" in refused("--set", "watchNamespaces=null")
    assert "namespacedOnly" in refused("--set", "rbac.namespacedOnly=true")  # the old key is gone, loudly
    assert "mode" in refused("--set", "mode=clusterwide")
    refused("--set", "metrics.prot=1")
    refused("--set", "policy.default.hostPath.paths={data}")  # a relative host path
    refused("--set", "policy.default.serviceAcounts={a}")  # a typo never widens the policy silently


def _operator_roles(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d
        for d in docs
        if d["kind"] in ("Role", "ClusterRole") and not d["metadata"]["name"].endswith(("-edit", "-view"))
    ]


@pytest.mark.parametrize("values", [NAMESPACED, CLUSTER], ids=["namespaced", "cluster"])
def test_operator_rbac_is_least_privilege(values: dict[str, str]) -> None:
    docs = render({**values, "watchNamespaces": "{jobs-a,jobs-b}", **PEERED})
    roles = _operator_roles(docs)
    assert roles
    for role in roles:
        for rule in role["rules"]:
            res, verbs = set(rule["resources"]), set(rule["verbs"])
            assert "secrets" not in res and "*" not in res and "*" not in verbs, rule
            assert not {"escalate", "bind", "impersonate", "deletecollection"} & verbs, rule
            assert "update" not in verbs or res == {"rljobs/finalizers"}, rule
            # delete only undoes a refused attempt, on the kinds written before the RayJob
            assert "delete" not in verbs or res <= {"configmaps", "serviceaccounts", "roles", "rolebindings"}
            if "pods" in res:
                assert verbs == {"list", "watch"}, rule  # pods read-only
    bindings = of_kind(docs, "ClusterRoleBinding")
    if values is NAMESPACED:
        assert {d["metadata"]["namespace"] for d in roles} == {"jobs-a", "jobs-b"}
        assert not bindings  # nothing cluster-wide for the operator
        assert not of_kind(docs, "ClusterKopfPeering")
        assert {
            (d["metadata"]["namespace"], d["metadata"]["name"]) for d in of_kind(docs, "KopfPeering")
        } == {
            ("jobs-a", "rlkube"),
            ("jobs-b", "rlkube"),
        }
    else:
        assert [d["roleRef"]["name"] for d in bindings] == ["r-rlkube"]
        assert not of_kind(docs, "KopfPeering") and len(of_kind(docs, "ClusterKopfPeering")) == 1


def _args(docs: list[dict[str, Any]]) -> list[str]:
    dep = of_kind(docs, "Deployment")[0]
    return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])


def test_cluster_mode_never_serves_system_namespaces_or_its_own_unless_asked() -> None:
    args = _args(render(CLUSTER, namespace="rlkube-system"))
    assert "--all-namespaces" in args and not [a for a in args if a.startswith("--namespace")]
    excluded = {a.split("=", 1)[1] for a in args if a.startswith("--exclude-namespace=")}
    assert excluded == {"kube-system", "kube-public", "kube-node-lease", "rlkube-system"}
    asked = _args(
        render(
            {
                **CLUSTER,
                "clusterMode.includeReleaseNamespace": "true",
                "clusterMode.excludeNamespaces": "null",
            }
        )
    )
    assert not [a for a in asked if a.startswith("--exclude-namespace")]
    guard = next(d for d in render(CLUSTER) if d["metadata"]["name"] == "r-rlkube-operator-guard-rayjobs")
    excl = next(v for v in guard["spec"]["variables"] if v["name"] == "excluded")
    assert set(yaml.safe_load(excl["expression"])) == excluded  # the admission guard says the same


def test_namespaced_mode_is_the_default_and_serves_only_the_listed_namespaces() -> None:
    docs = render({})
    args = _args(docs)
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=default"]
    assert "--all-namespaces" not in args and "--standalone" in args


@pytest.mark.parametrize("values", [NAMESPACED, CLUSTER], ids=["namespaced", "cluster"])
def test_replicas_never_tie_and_peer_through_the_object_of_their_mode(values: dict[str, str]) -> None:
    docs = render({**values, **PEERED})
    dep = of_kind(docs, "Deployment")[0]
    args = _args(docs)
    assert "--peering=rlkube" in args and "--priority=auto" in args and "--peering-lifetime=15" in args
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in env
    kinds = {d["kind"] for d in docs}
    assert ("KopfPeering" in kinds) is (values is NAMESPACED)
    assert ("ClusterKopfPeering" in kinds) is (values is CLUSTER)


def test_notes_point_at_files_that_exist() -> None:
    out = helm("install", "r", str(CHART), "--dry-run=client", "-n", "rlkube-system").stdout
    notes = out.split("NOTES:", 1)[1]
    paths = re.findall(r"examples/[\w.-]+\.yaml", notes)
    assert paths and all((REPO / p).is_file() for p in paths), paths
    assert "r-rlkube-edit" in notes and "Serving (namespaced mode): default" in notes


def test_user_roles_aggregate_into_the_builtin_roles() -> None:
    roles = {d["metadata"]["name"]: d for d in of_kind(render({}), "ClusterRole")}
    edit, view = roles["r-rlkube-edit"], roles["r-rlkube-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {r for rule in edit["rules"] for r in rule["resources"]} == {"rljobs", "rljobs/status"}
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in view["rules"])


def test_policy_values_reach_the_operator_and_the_admission_policy_alike() -> None:
    docs = render(POLICY_TEAM_A)
    cm = next(d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"] == "r-rlkube-defaults")
    policy = PolicySet.model_validate(yaml.safe_load(cm["data"]["policy.yaml"]))
    assert policy.default == PolicySet().default
    scope, team = policy.for_namespace("team-a")
    assert scope == "namespaces.team-a" and team.service_accounts == ["trainer"]
    assert team.host_path.enabled and team.host_path.paths == ["/data"]
    assert team.persistent_volume_claims is False  # a false override replaces a true default
    assert team.toleration_keys == policy.default.toleration_keys  # keys not given stay the default's
    vaps = {d["metadata"]["name"]: d for d in of_kind(docs, "ValidatingAdmissionPolicy")}
    guards = {f"r-rlkube-operator-guard-{k}" for k in ("children", "roles", "rolebindings", "rayjobs")}
    assert set(vaps) == {"r-rlkube-rljob-policy", "r-rlkube-rljob-policy-team-a", *guards}
    variables = {
        v["name"]: v["expression"] for v in vaps["r-rlkube-rljob-policy-team-a"]["spec"]["variables"]
    }
    assert variables["serviceAccountsExact"] == '["trainer"]' and variables["hostPathEnabled"] == "true"
    assert variables["scope"] == '"namespaces.team-a"'

    def selector(docs: list[dict[str, Any]], name: str) -> Any:
        binds = {d["metadata"]["name"]: d for d in of_kind(docs, "ValidatingAdmissionPolicyBinding")}
        return binds[name]["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]

    # The default policy covers the namespaces this release serves and no others (namespaced mode: the
    # watched ones; cluster mode: all), less those with their own policy.
    name = "kubernetes.io/metadata.name"
    assert selector(docs, "r-rlkube-rljob-policy") == [{"key": name, "operator": "In", "values": ["default"]}]
    assert selector(docs, "r-rlkube-rljob-policy-team-a") == [
        {"key": name, "operator": "In", "values": ["team-a"]}
    ]
    served = render({**POLICY_TEAM_A, "watchNamespaces": "{team-a,team-b}"})
    assert selector(served, "r-rlkube-rljob-policy") == [
        {"key": name, "operator": "In", "values": ["team-b"]}
    ]
    only_team_a = render({**POLICY_TEAM_A, "watchNamespaces": "{team-a}"})
    assert "r-rlkube-rljob-policy" not in {
        d["metadata"]["name"] for d in of_kind(only_team_a, "ValidatingAdmissionPolicy")
    }
    everywhere = render({**CLUSTER, **POLICY_TEAM_A})
    assert selector(everywhere, "r-rlkube-rljob-policy") == [
        {"key": name, "operator": "NotIn", "values": ["team-a"]}
    ]


def test_runtime_defaults_values_reach_the_renderer(tmp_path: Path) -> None:
    """The chart's runtimeDefaults ConfigMap is what `--render-defaults` parses into RenderDefaults."""
    from rlkube.operator.main import load_render_defaults

    docs = render({"runtimeDefaults.shmSize": "32Gi", "runtimeDefaults.headCpu": "4"})
    cm = of_kind(docs, "ConfigMap")[0]
    path = tmp_path / "render-defaults.yaml"
    path.write_text(cm["data"]["render-defaults.yaml"])
    defaults = load_render_defaults(path)
    assert (defaults.shm_size, defaults.head_cpu) == ("32Gi", 4)
    assert defaults.vendor_images["amd"] == "rlkube/runtime-rocm:0.1.0"
    policy = tmp_path / "policy.yaml"
    policy.write_text(cm["data"]["policy.yaml"])
    assert load_policy(policy) == PolicySet()
    bad = helm("template", "r", str(CHART), "--set", "runtimeDefaults.headCPU=4", check=False)
    assert bad.returncode != 0  # a typo is refused by values.schema.json, not silently ignored


# ------------------------------------------------------------------------------------- on the server


@pytest.mark.parametrize(
    "values",
    [NAMESPACED, {**CLUSTER, **PEERED}, {**PEERED, **POLICY_TEAM_A}],
    ids=["namespaced", "cluster-peered", "namespaced-peered-policy"],
)
def test_helm_template_is_accepted_by_the_api_server(
    kubectl: Kubectl, rljob_crd: None, namespace: str, values: dict[str, str]
) -> None:
    rendered = helm(
        "template",
        "r",
        str(CHART),
        "-n",
        namespace,
        "--set",
        f"watchNamespaces={{{namespace}}}",
        *set_args(values),
    ).stdout
    out = kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)
    assert "deployment.apps/r-rlkube created (server dry run)" in out.stdout
    assert (
        "validatingadmissionpolicy.admissionregistration.k8s.io/r-rlkube-rljob-policy created" in out.stdout
    )


def _lifecycle_with_chart_sa(
    kubectl: Kubectl,
    rel: dict[str, Any],
    operator_factory: Callable[..., OperatorProcess],
    wait_for: WaitFor,
    tmp_path: Path,
) -> OperatorProcess:
    jobs = rel["jobs"]
    op = start_as_chart(kubectl, operator_factory, rel, tmp_path)
    kubectl(
        "-n",
        jobs,
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(small_rljob("viasa", mode="separate_async", gpus=1)),
    )

    def cond(type_: str, status: str) -> Callable[[], bool]:
        return lambda: condition(rljob(kubectl, jobs, "viasa"), type_).get("status") == status

    show = lambda: rljob(kubectl, jobs, "viasa")  # noqa: E731
    wait_for(cond("ClusterReady", "True"), 90, show)
    kubectl("-n", jobs, "patch", "rljob", "viasa", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_for(lambda: rljob(kubectl, jobs, "viasa")["status"]["phase"] == "Suspended", 60, show)
    kubectl("-n", jobs, "patch", "rljob", "viasa", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    wait_for(cond("ClusterReady", "True"), 90, show)
    kubectl("-n", jobs, "delete", "configmap", "viasa-config")  # recreated: needs create on configmaps
    wait_for(lambda: kubectl("-n", jobs, "get", "configmap", "viasa-config", check=False).returncode == 0, 60)
    kubectl("-n", jobs, "delete", "rljob", "viasa", "--wait=true", timeout=90)
    wait_for(lambda: not kubectl.json("-n", jobs, "get", "rayjobs")["items"], 60, what="RayJob GC'd")
    assert op.metric("rlkube_reconcile_errors_total") == 0
    assert op.metric("rlkube_api_requests_total", code="403") == 0, op.log()[-3000:]
    assert "Forbidden" not in op.log()

    # No Secrets: RBAC says so and the API server refuses for real.
    for verb in ("get", "list", "watch"):
        out = kubectl("auth", "can-i", verb, "secrets", "-n", jobs, f"--as={rel['who']}", check=False)
        assert out.stdout.strip() == "no", (verb, out.stdout)
    sa_kubectl = token_kubeconfig(kubectl, tmp_path / "operator-sa.kubeconfig", rel["namespace"], rel["sa"])
    denied = sa_kubectl("-n", jobs, "get", "secrets", check=False)
    assert denied.returncode != 0 and 'cannot list resource "secrets"' in denied.stderr
    return op


# HTTP requests the operator makes -> the RBAC verb they need (a server-side apply answered 201 created).
def _rbac_verb(verb: str, code: str) -> str:
    if verb == "PATCH" and code == "201":
        return "create"
    return {"WATCH": "watch", "LIST": "list", "GET": "get", "POST": "create", "PUT": "update"}.get(
        verb, verb.lower()
    )


# Held though this cluster never asks for them: blockOwnerDeletion is checked only where the
# OwnerReferencesPermissionEnforcement admission plugin is on (the devcluster runs the defaults).
HELD_FOR_ADMISSION = {("rljobs/finalizers", "update")}


def _used_verbs(op: OperatorProcess) -> set[tuple[str, str]]:
    used = set()
    for line in op.metrics().splitlines():
        if line.startswith("rlkube_api_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels["code"].startswith("2"):
                used.add((labels["resource"], _rbac_verb(labels["verb"], labels["code"])))
    return used


def _granted(kubectl: Kubectl, who: str, ns: str) -> set[tuple[str, str]]:
    from chart_helpers import can_i_list

    out = set()
    for res, verbs in can_i_list(kubectl, who, ns).items():
        if res.startswith("self"):
            continue  # the API server's own grants to everyone
        plural, _, rest = res.partition(".")
        sub = rest.partition("/")[2] if "/" in rest else ""
        out |= {(plural + (f"/{sub}" if sub else ""), v) for v in verbs}
    return out


@pytest.mark.parametrize("release", [{}], indirect=True, ids=["namespaced"])
def test_installed_namespaced_chart_drives_a_whole_lifecycle(
    kubectl: Kubectl,
    release: dict[str, Any],
    operator_factory: Callable[..., OperatorProcess],
    wait_for: WaitFor,
    tmp_path: Path,
) -> None:
    dep = kubectl.json("-n", release["namespace"], "get", "deployment", release["fullname"])
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    who = release["who"]
    out = kubectl("auth", "can-i", "list", "rljobs.rlkube.io", "--all-namespaces", f"--as={who}", check=False)
    assert out.stdout.strip() == "no"  # only the watched namespace
    assert (
        kubectl(
            "auth", "can-i", "list", "rljobs.rlkube.io", "-n", release["jobs"], f"--as={who}"
        ).stdout.strip()
        == "yes"
    )
    assert (
        kubectl(
            "auth", "can-i", "create", "rayjobs.ray.io", "-n", "kube-system", f"--as={who}", check=False
        ).stdout.strip()
        == "no"
    )
    op = _lifecycle_with_chart_sa(kubectl, release, operator_factory, wait_for, tmp_path)

    # A refused attempt too (its rollback is the only use of delete), then: every granted verb was used.
    jobs = release["jobs"]
    kubectl("-n", jobs, "create", "quota", "no-rayjobs", "--hard=count/rayjobs.ray.io=0")
    kubectl("-n", jobs, "apply", "-f", "-", input=yaml.safe_dump(small_rljob("refused", gpus=1)))
    wait_for(
        lambda: condition(rljob(kubectl, jobs, "refused"), "ClusterReady").get("reason") == "QuotaExceeded",
        30,
    )
    granted = _granted(kubectl, who, jobs)
    unused = granted - _used_verbs(op) - HELD_FOR_ADMISSION
    assert not unused, f"granted but never used: {sorted(unused)}"
    assert ("rljobs", "patch") in granted and ("configmaps", "delete") in granted


@pytest.mark.parametrize("release", [CLUSTER], indirect=True, ids=["cluster"])
def test_installed_cluster_chart_drives_a_whole_lifecycle(
    kubectl: Kubectl,
    release: dict[str, Any],
    operator_factory: Callable[..., OperatorProcess],
    wait_for: WaitFor,
    tmp_path: Path,
) -> None:
    args = kubectl.json("-n", release["namespace"], "get", "deployment", release["fullname"])["spec"][
        "template"
    ]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args and f"--exclude-namespace={release['namespace']}" in args
    op = _lifecycle_with_chart_sa(kubectl, release, operator_factory, wait_for, tmp_path)
    # Cluster-wide, yet the excluded namespaces never reach it: an RLJob in its own namespace is ignored.
    kubectl(
        "-n", release["namespace"], "apply", "-f", "-", input=yaml.safe_dump(small_rljob("ignored", gpus=1))
    )
    mine = small_rljob("served", gpus=1)
    kubectl("-n", release["jobs"], "apply", "-f", "-", input=yaml.safe_dump(mine))
    wait_for(lambda: (rljob(kubectl, release["jobs"], "served").get("status") or {}).get("phase"), 60)
    ignored = rljob(kubectl, release["namespace"], "ignored")
    assert not ignored.get("status") and not ignored["metadata"].get("finalizers"), ignored
    kubectl("-n", release["namespace"], "delete", "rljob", "ignored", "--wait=false")
    assert op.alive()
