"""Helpers of the chart tests: helm itself, rendering, the operator as the chart's Deployment runs it."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from optest_fixtures import OperatorProcess
from optest_helpers import REPO

from rlkube.devcluster.binaries import cache_dir, module_version
from rlkube.devcluster.testing import Kubectl

CHART = REPO / "charts" / "rlkube"
NAMESPACED: dict[str, str] = {}  # the default mode
CLUSTER = {"mode": "cluster"}
PEERED = {"peering.enabled": "true", "replicaCount": "2"}


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


def render(values: dict[str, str], *extra: str, namespace: str = "rlkube-system") -> list[dict[str, Any]]:
    """`helm template r` with ``--set`` values: the documents, parsed."""
    out = helm("template", "r", str(CHART), "-n", namespace, *set_args(values), *extra).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def operator_args(deployment: dict[str, Any]) -> list[str]:
    """The Deployment's operator flags, minus those that only make sense in a pod (ports, files)."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    drop = ("--liveness", "--metrics-port", "--render-defaults", "--policy", "--log-format")
    return [a for a in container["args"] if not a.startswith(drop)]


def start_as_chart(
    kubectl: Kubectl,
    operator_factory: Callable[..., OperatorProcess],
    rel: dict[str, Any],
    tmp_path: Path,
    *,
    pod: str = "",
) -> OperatorProcess:
    """Run `rlkube-operator` on the host exactly as the installed chart's Deployment runs it: its flags,
    its policy file, a token of its ServiceAccount (kwok runs no containers, so the pod itself is fake)."""
    from optest_helpers import token_kubeconfig

    ns = rel["namespace"]
    dep = kubectl.json("-n", ns, "get", "deployment", rel["fullname"])
    cm = kubectl.json("-n", ns, "get", "configmap", f"{rel['fullname']}-defaults")
    policy = tmp_path / f"policy-{pod or 'x'}.yaml"
    policy.write_text(cm["data"]["policy.yaml"])
    defaults = tmp_path / f"defaults-{pod or 'x'}.yaml"
    defaults.write_text(cm["data"]["render-defaults.yaml"])
    sa = token_kubeconfig(kubectl, tmp_path / f"sa-{pod or 'x'}.kubeconfig", ns, rel["sa"])
    args = [*operator_args(dep), f"--policy={policy}", f"--render-defaults={defaults}"]
    return operator_factory(*args, kubeconfig_path=sa.kubeconfig, env={"POD_ID": pod} if pod else None)


def can_i_list(kubectl: Kubectl, who: str, namespace: str | None) -> dict[str, set[str]]:
    """`kubectl auth can-i --list` as ``who``: resource (with group, e.g. rayjobs.ray.io) -> verbs."""
    where = ["-n", namespace] if namespace else []
    out = kubectl("auth", "can-i", "--list", *where, f"--as={who}").stdout
    table: dict[str, set[str]] = {}
    for line in out.splitlines()[1:]:
        cols = re.split(r"\s{2,}", line.strip())
        if len(cols) < 4 or cols[1] != "[]" or cols[2] != "[]":
            continue  # only resource rules without resourceNames (no non-resource URLs)
        verbs = set(cols[3].strip("[]").split())
        table.setdefault(cols[0], set()).update(verbs)
    return table
