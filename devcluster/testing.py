"""Helpers shared by the pytest fixtures, benchmarks and the demo: pick the cluster, run kubectl, wait.

The cluster is chosen explicitly: `RLKUBE_TEST_KUBECONFIG=<path>` selects an external cluster (e.g.
kind with kwok GPU nodes); otherwise the local dev cluster is used (reused if healthy, else
started). A plain `KUBECONFIG` is deliberately ignored so a test run never touches a cluster by
accident.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .cluster import ClusterConfig, DevCluster, ShapeMismatch
from .errors import DevClusterError

TEST_KUBECONFIG_ENV = "RLKUBE_TEST_KUBECONFIG"
T = TypeVar("T")


@dataclass
class TestCluster:
    """The cluster a test session talks to."""

    __test__ = False  # not a pytest test class

    kubeconfig: Path
    local: DevCluster | None  # None for an external cluster
    started_here: bool
    user: str

    @property
    def external(self) -> bool:
        return self.local is None

    def close(self) -> None:
        """Release the session's use; stops the local cluster only if no one else needs it."""
        if self.local is not None:
            self.local.detach(self.user)


def open_test_cluster(config: ClusterConfig | None = None, state_dir: Path | None = None) -> TestCluster:
    """Select and, if needed, start the cluster for a test session (see module docstring)."""
    user = f"pytest-{os.getpid()}"
    external = os.environ.get(TEST_KUBECONFIG_ENV)
    if external:
        path = Path(external).expanduser().resolve()
        if not path.is_file():
            raise DevClusterError(f"{TEST_KUBECONFIG_ENV}={external}: no such file")
        probe = Kubectl(path)("version", "-o", "json", check=False, timeout=20)
        if probe.returncode != 0 or "serverVersion" not in probe.stdout:
            raise DevClusterError(f"cluster in {path} is unreachable: {probe.stderr.strip()}")
        return TestCluster(path, None, False, user)
    config = config or ClusterConfig()  # the session's shape: a running cluster must match it
    cluster = DevCluster(state_dir, config)
    try:
        started = cluster.attach(user)
    except ShapeMismatch as err:
        # e.g. a cluster left running by `make demo` with other nodes: tests get their own, beside it.
        own = cluster.state_dir.with_name(cluster.state_dir.name + "-pytest")
        print(f"[devcluster] {err}; the tests use their own cluster in {own}", file=sys.stderr, flush=True)
        cluster = DevCluster(own, config)
        started = cluster.attach(user)
    return TestCluster(cluster.kubeconfig, cluster, started, user)


class KubectlError(AssertionError):
    """kubectl failed when the caller expected success; carries its stderr."""


class Kubectl:
    """Runs the machine's kubectl against one kubeconfig (never the ambient KUBECONFIG)."""

    def __init__(self, kubeconfig: Path | str, binary: str | None = None) -> None:
        self.kubeconfig = Path(kubeconfig)
        found = binary or shutil.which("kubectl")
        if not found:
            raise DevClusterError("kubectl is not on PATH")
        self.binary = found

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """`kubectl <args>`; raises KubectlError with stderr if it fails and `check` is true."""
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        argv = [self.binary, f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout, env=env)
        if check and proc.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr.strip()}")
        return proc

    def json(self, *args: str, timeout: float = 60) -> Any:
        """`kubectl <args> -o json`, decoded."""
        return json.loads(self(*args, "-o", "json", timeout=timeout).stdout)

    def wait_established(self, crd: str, timeout: float = 60) -> None:
        """Until the CRD's Established condition is True. Not `kubectl wait`: on a CRD created a
        moment ago, before the API server wrote any condition, it fails at once (`.status.conditions
        accessor error: <nil>`) instead of waiting; under load that window was wide enough to fail
        a whole test module's fixture."""

        wait_for(
            lambda: self.crd_established(crd), timeout, lambda: self.json("get", f"crd/{crd}"),
            what=f"CRD {crd} Established",
        )  # fmt: skip

    def crd_established(self, crd: str) -> bool:
        """Whether the CRD's Established condition is True now (False while it has none)."""
        conds = (self.json("get", f"crd/{crd}").get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

    def apply(
        self, manifest: dict[str, Any] | str, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Server-side apply of one manifest (a dict or YAML text)."""
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self("apply", "--server-side", "-f", "-", *args, input=text, check=check)


def token_kubeconfig(kubectl: Kubectl, path: Path, namespace: str, sa: str, duration: str = "2h") -> Kubectl:
    """Write a kubeconfig that authenticates as ServiceAccount namespace/sa with a real bound token
    (the credentials a pod of that ServiceAccount gets) and return a kubectl that uses it."""
    token = kubectl("-n", namespace, "create", "token", sa, f"--duration={duration}").stdout.strip()
    admin = yaml.safe_load(kubectl.kubeconfig.read_text())
    ctx = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == ctx["cluster"])
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "rlkube-dev", "cluster": cluster["cluster"]}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": "rlkube-dev", "user": sa, "namespace": namespace}}],
        "current-context": sa,
    }
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o600)
    return Kubectl(path)


def to_yaml(obj: Any) -> str:
    """Render a dict, an official-client model or anything else as YAML for failure messages."""
    if hasattr(obj, "to_dict") and hasattr(obj, "openapi_types"):
        from kubernetes.client import ApiClient

        obj = ApiClient().sanitize_for_serialization(obj)
    if isinstance(obj, (dict, list)):
        return yaml.safe_dump(obj, sort_keys=False)
    return str(obj)


def wait_for(
    fn: Callable[[], T],
    timeout: float = 60,
    describe: Callable[[], Any] | None = None,
    interval: float = 0.5,
    what: str | None = None,
) -> T:
    """Poll `fn` until it returns something truthy and return that.

    On timeout, fail the test with `what`, the last exception `fn` raised (if any) and the YAML of
    `describe()` (the object being waited on), so the failure shows the state that was reached.
    """
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            result = fn()
            if result:
                return result
        except Exception as exc:  # a 404 while the object is being created is normal
            last_exc = exc
        if time.monotonic() > deadline:
            break
        time.sleep(interval)
    parts = [f"timed out after {timeout:g} s waiting for {what or getattr(fn, '__name__', 'condition')}"]
    if last_exc is not None:
        parts.append(f"last error: {type(last_exc).__name__}: {last_exc}")
    if describe is not None:
        try:
            parts.append("object:\n" + to_yaml(describe()))
        except Exception as exc:
            parts.append(f"(describe failed: {exc})")
    raise AssertionError("\n".join(parts))
