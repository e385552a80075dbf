"""Chart tests share the operator tests' fixtures (CRD install, `rlkube-operator` subprocess) and add an
installed release."""

import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from chart_helpers import CHART, helm, set_args
from optest_fixtures import operator_factory, pytest_runtest_makereport, rljob_crd

from rlkube.devcluster.testing import Kubectl

__all__ = ["operator_factory", "pytest_runtest_makereport", "release", "rljob_crd"]


@pytest.fixture
def release(
    kubectl: Kubectl, rljob_crd: None, namespace: str, request: pytest.FixtureRequest
) -> Iterator[dict[str, Any]]:
    """`helm install` into a fresh namespace, serving a second fresh namespace `jobs`.

    `request.param` holds extra `--set` values; JOBS in them becomes the jobs namespace, NAME the
    release name. Uninstalled (and the jobs namespace deleted) afterwards.
    """
    name = f"rlk{secrets.token_hex(3)}"
    jobs_ns = f"{namespace}-jobs"[:63].rstrip("-")
    kubectl("create", "namespace", jobs_ns)
    values = {"watchNamespaces": "{JOBS}", **dict(getattr(request, "param", {}))}
    fill = lambda t: t.replace("JOBS", jobs_ns).replace("NAME", name)  # noqa: E731
    values = {fill(k): fill(v) for k, v in values.items()}
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
    if values.get("policy.admission") != "false":
        _wait_for_admission_policies(kubectl, jobs_ns)
    try:
        yield {
            "name": name,
            "fullname": f"{name}-rlkube",
            "namespace": namespace,
            "jobs": jobs_ns,
            "sa": f"{name}-rlkube",
            "who": f"system:serviceaccount:{namespace}:{name}-rlkube",
            "values": values,
        }
    finally:
        helm("uninstall", name, "-n", namespace, "--wait", kubeconfig=kubectl.kubeconfig, check=False)
        # The operator is gone: nothing would remove its finalizers, and a cluster-wide operator of a
        # later test would pick the RLJobs up while their namespace is terminating.
        for ns in (jobs_ns, namespace):
            for job in kubectl("-n", ns, "get", "rljobs", "-o", "name", check=False).stdout.split():
                unfinalize = '{"metadata":{"finalizers":null}}'
                kubectl("-n", ns, "patch", job, "--type=merge", "-p", unfinalize, check=False)
            kubectl("-n", ns, "delete", "rljobs", "--all", "--wait=true", check=False, timeout=60)
        kubectl("delete", "namespace", jobs_ns, "--wait=false", check=False)


def _wait_for_admission_policies(kubectl: Kubectl, ns: str) -> None:
    """A new ValidatingAdmissionPolicy is enforced once the API server's informer has it (about 1 s)."""
    from optest_helpers import small_rljob

    from rlkube.devcluster.testing import wait_for

    probe = yaml.safe_dump(small_rljob("admission-probe", serviceAccountName="not-allowed-probe"))

    def refused() -> bool:
        out = kubectl("-n", ns, "apply", "--dry-run=server", "-f", "-", input=probe, check=False)
        return out.returncode != 0 and "denied request" in out.stderr

    wait_for(refused, 30, what="the admission policies to be enforced")
