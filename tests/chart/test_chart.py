"""The Helm chart against the real API server: lint, server-side dry-run, install, and RBAC proven by use.

After `helm install`, the operator runs on the host with a token of the chart's ServiceAccount (kwok
runs no containers, so the Deployment's pod is only a fake) and drives a whole RLJob lifecycle: if
the chart's RBAC lacked anything, a step would fail with 403. It must not be able to read Secrets.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from optest_fixtures import OperatorProcess
from optest_helpers import REPO, condition, rljob, small_rljob, token_kubeconfig

from rlkube.devcluster.binaries import cache_dir, module_version
from rlkube.devcluster.testing import Kubectl

CHART = REPO / "charts" / "rlkube"
WaitFor = Callable[..., Any]


def helm_bin() -> Path:
    path = cache_dir() / f"helm-{module_version('helm')}" / "bin" / "helm"
    assert path.is_file(), f"helm missing at {path}: run `make cluster-build`"
    return path


def helm(*args: str, kubeconfig: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [str(helm_bin()), *args]
    if kubeconfig is not None:
        argv.append(f"--kubeconfig={kubeconfig}")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def set_args(values: dict[str, str]) -> list[str]:
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


NAMESPACED = {"rbac.namespacedOnly": "true", "watchNamespaces": "{jobs-a,jobs-b}"}
PEERED = {"peering.enabled": "true", "replicaCount": "2"}


@pytest.mark.parametrize(
    "values",
    [{}, NAMESPACED, PEERED, {**NAMESPACED, **PEERED}],
    ids=["cluster", "namespaced", "peered", "ns-peered"],
)
def test_helm_lint(values: dict[str, str]) -> None:
    out = helm("lint", str(CHART), *set_args(values))
    assert "0 chart(s) failed" in out.stdout


def test_values_schema_refuses_unsafe_combinations() -> None:
    two = helm("template", "r", str(CHART), "--set", "replicaCount=2", check=False)
    assert two.returncode != 0 and "peering" in two.stderr
    ns_only = helm("template", "r", str(CHART), "--set", "rbac.namespacedOnly=true", check=False)
    assert ns_only.returncode != 0 and "watchNamespaces" in ns_only.stderr
    typo = helm("template", "r", str(CHART), "--set", "metrics.prot=1", check=False)
    assert typo.returncode != 0


def test_rbac_has_no_secrets_and_no_escalation() -> None:
    for values in ({}, NAMESPACED):
        docs = [
            d for d in yaml.safe_load_all(helm("template", "r", str(CHART), *set_args(values)).stdout) if d
        ]
        roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
        assert roles
        for role in roles:
            for rule in role["rules"]:
                assert "secrets" not in rule["resources"] and "*" not in rule["resources"]
                assert not {"escalate", "bind", "impersonate", "*"} & set(rule["verbs"]), rule
                assert "delete" not in rule["verbs"], rule  # children go by GC, never by us
        if values:
            assert {d["metadata"]["namespace"] for d in roles} == {"jobs-a", "jobs-b"}
            assert not [d for d in docs if d["kind"].startswith("Cluster")]


@pytest.mark.parametrize(
    "values",
    [{}, {"rbac.namespacedOnly": "true", "watchNamespaces": "{default}", **PEERED}],
    ids=["cluster", "namespaced-peered"],
)
def test_helm_template_is_accepted_by_the_api_server(
    kubectl: Kubectl, rljob_crd: None, namespace: str, values: dict[str, str]
) -> None:
    rendered = helm("template", "r", str(CHART), "-n", namespace, *set_args(values)).stdout
    out = kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)
    assert "deployment.apps/r-rlkube created (server dry run)" in out.stdout


@pytest.fixture
def release(
    kubectl: Kubectl, rljob_crd: None, namespace: str, request: pytest.FixtureRequest
) -> Iterator[dict[str, Any]]:
    """`helm install` into a fresh namespace; `request.param` holds extra values. Uninstalled afterwards."""
    name = f"rlk{secrets.token_hex(3)}"
    jobs_ns = f"{namespace}-jobs"[:63]
    kubectl("create", "namespace", jobs_ns)
    values = dict(getattr(request, "param", {}))
    values = {k: v.replace("JOBS", jobs_ns) for k, v in values.items()}
    helm(
        "install",
        name,
        str(CHART),
        "-n",
        namespace,
        "--wait",
        "--timeout=90s",
        *set_args(values),
        kubeconfig=kubectl.kubeconfig,
    )
    try:
        yield {
            "name": name,
            "namespace": namespace,
            "jobs": jobs_ns,
            "sa": f"{name}-rlkube",
            "values": values,
        }
    finally:
        helm("uninstall", name, "-n", namespace, "--wait", kubeconfig=kubectl.kubeconfig, check=False)
        kubectl("delete", "namespace", jobs_ns, "--wait=false", check=False)


def _lifecycle_with_chart_sa(
    kubectl: Kubectl,
    rel: dict[str, Any],
    operator_factory: Callable[..., OperatorProcess],
    wait_for: WaitFor,
    tmp_path: Path,
) -> None:
    ns, jobs = rel["namespace"], rel["jobs"]
    sa_kubectl = token_kubeconfig(kubectl, tmp_path / "operator-sa.kubeconfig", ns, rel["sa"])
    op = operator_factory(namespaces=[jobs], kubeconfig_path=sa_kubectl.kubeconfig)
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
    who = f"system:serviceaccount:{ns}:{rel['sa']}"
    for verb in ("get", "list", "watch"):
        out = kubectl("auth", "can-i", verb, "secrets", "-n", jobs, f"--as={who}", check=False)
        assert out.stdout.strip() == "no", (verb, out.stdout)
    denied = sa_kubectl("-n", jobs, "get", "secrets", check=False)
    assert (
        denied.returncode != 0
        and "Forbidden" in denied.stderr
        and 'cannot list resource "secrets"' in denied.stderr
    )


@pytest.mark.parametrize("release", [{}], indirect=True, ids=["clusterrole"])
def test_installed_chart_rbac_drives_a_whole_lifecycle(
    kubectl: Kubectl,
    release: dict[str, Any],
    operator_factory: Callable[..., OperatorProcess],
    wait_for: WaitFor,
    tmp_path: Path,
) -> None:
    dep = kubectl.json("-n", release["namespace"], "get", "deployment", f"{release['name']}-rlkube")
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    args = pod["containers"][0]["args"]
    assert "--all-namespaces" in args and "--log-format=json" in args and "--standalone" in args
    assert (
        kubectl(
            "-n", release["namespace"], "get", "service", f"{release['name']}-rlkube-metrics", check=False
        ).returncode
        == 0
    )
    _lifecycle_with_chart_sa(kubectl, release, operator_factory, wait_for, tmp_path)


@pytest.mark.parametrize(
    "release",
    [{"rbac.namespacedOnly": "true", "watchNamespaces": "{JOBS}"}],
    indirect=True,
    ids=["namespaced"],
)
def test_namespaced_only_chart_rbac_drives_a_whole_lifecycle(
    kubectl: Kubectl,
    release: dict[str, Any],
    operator_factory: Callable[..., OperatorProcess],
    wait_for: WaitFor,
    tmp_path: Path,
) -> None:
    who = f"system:serviceaccount:{release['namespace']}:{release['sa']}"
    out = kubectl("auth", "can-i", "list", "rljobs.rlkube.io", "--all-namespaces", f"--as={who}", check=False)
    assert out.stdout.strip() == "no"  # only the watched namespace
    assert (
        kubectl(
            "auth", "can-i", "list", "rljobs.rlkube.io", "-n", release["jobs"], f"--as={who}"
        ).stdout.strip()
        == "yes"
    )
    args = kubectl.json("-n", release["namespace"], "get", "deployment", f"{release['name']}-rlkube")["spec"][
        "template"
    ]["spec"]["containers"][0]["args"]
    assert f"--namespace={release['jobs']}" in args
    _lifecycle_with_chart_sa(kubectl, release, operator_factory, wait_for, tmp_path)
    assert json.dumps(args)


def test_runtime_defaults_values_reach_the_renderer(tmp_path: Path) -> None:
    """The chart's runtimeDefaults ConfigMap is what `--render-defaults` parses into RenderDefaults."""
    from rlkube.operator.main import load_render_defaults

    out = helm(
        "template",
        "r",
        str(CHART),
        "--set",
        "runtimeDefaults.shmSize=32Gi",
        "--set",
        "runtimeDefaults.headCpu=4",
    )
    cm = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "ConfigMap")
    path = tmp_path / "render-defaults.yaml"
    path.write_text(cm["data"]["render-defaults.yaml"])
    defaults = load_render_defaults(path)
    assert (defaults.shm_size, defaults.head_cpu) == ("32Gi", 4)
    assert defaults.vendor_images["amd"] == "rlkube/runtime-rocm:0.1.0"
    bad = helm("template", "r", str(CHART), "--set", "runtimeDefaults.headCPU=4", check=False)
    assert bad.returncode != 0  # a typo is refused by values.schema.json, not silently ignored
