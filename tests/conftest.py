"""Fixtures every test can use to talk to a real Kubernetes API (see docs/devcluster.md).

`devcluster` starts the local control plane once per session (or reuses a healthy one, or uses the
external cluster named by RLKUBE_TEST_KUBECONFIG). Tests that need it fail, never skip, when it
cannot start. Tests using it are marked `cluster` automatically.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from rlkube.devcluster import DevClusterError
from rlkube.devcluster.testing import Kubectl, TestCluster, open_test_cluster
from rlkube.devcluster.testing import wait_for as _wait_for

_CLUSTER_FIXTURES = {"devcluster", "kubeconfig", "kube_api", "kubectl", "namespace"}

# Property tests draw the same examples on every run and every machine (derandomize: the seed comes
# from the test's name) and remember nothing between runs: a property test either always passes or
# always fails, never by hypothesis's luck. Loaded before any test module builds its @settings.
settings.register_profile("rlkube", derandomize=True, database=None, deadline=None, print_blob=True)
settings.load_profile("rlkube")


@pytest.fixture
def triton_interpret() -> Callable[[str], dict[str, Any]]:
    """Run a script under Triton's interpreter (``TRITON_INTERPRET=1``) in a subprocess, since the
    flag is read when a kernel is defined; returns the JSON object on its last stdout line."""

    def run(script: str) -> dict[str, Any]:
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, check=False
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    return run


# Directories whose tests drive the machine's one control plane and real node.
_CLUSTER_DIRS = ("cluster", "realnode", "realpods", "operator", "chart")
# Tests that each start a local Ray, a vLLM engine or a long training run: `make test` runs them
# (marker `heavy`) in a second pytest beside the cluster tests, which mostly wait on the cluster.
_HEAVY_MARKERS = ("ray", "vllm", "slow")


def _is_heavy(item: pytest.Item) -> bool:
    top = Path(str(item.path)).relative_to(Path(__file__).parent).parts[0]
    if top in _CLUSTER_DIRS or item.get_closest_marker("cluster"):
        return False
    return top == "learning" or any(item.get_closest_marker(m) for m in _HEAVY_MARKERS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
        if _is_heavy(item):
            item.add_marker(pytest.mark.heavy)
    # The real node's own lifecycle test needs the machine's one real node free: run it before
    # anything starts the session's cluster.
    items.sort(key=lambda item: 0 if item.get_closest_marker("realnode_lifecycle") else 1)


@pytest.fixture(scope="session")
def devcluster() -> Iterator[TestCluster]:
    """The session's cluster; torn down at the end only if this session started it and is its last user."""
    try:
        cluster = open_test_cluster()
    except DevClusterError as err:
        pytest.fail(f"the test cluster could not start:\n{err}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def kubeconfig(devcluster: TestCluster) -> Path:
    """Path of the admin kubeconfig of the session's cluster."""
    return devcluster.kubeconfig


@pytest.fixture(scope="session")
def kube_api(kubeconfig: Path) -> Iterator[Any]:
    """An official `kubernetes.client.ApiClient` for the session's cluster."""
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def kubectl(kubeconfig: Path) -> Kubectl:
    """Runs kubectl with the session's kubeconfig: `kubectl("get", "pods")` -> CompletedProcess."""
    return Kubectl(kubeconfig)


@pytest.fixture
def namespace(request: pytest.FixtureRequest, kube_api: Any) -> Iterator[str]:
    """A fresh namespace named after the test, deleted (in the background) afterwards."""
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{stem}-{secrets.token_hex(3)}"
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"rlkube.io/test": "true"}))
    )
    try:
        yield name
    finally:
        _release_rljobs(kube_api, name)
        core.delete_namespace(name, propagation_policy="Background")


def _release_rljobs(kube_api: Any, namespace: str) -> None:
    """Drop the finalizers of RLJobs left in a test namespace: their operator is gone with the test, and
    they would keep the namespace Terminating (and reach the next cluster-wide operator)."""
    from kubernetes import client

    api = client.CustomObjectsApi(kube_api)
    try:
        items = api.list_namespaced_custom_object("rlkube.io", "v1alpha1", namespace, "rljobs")["items"]
        for item in items:
            if item["metadata"].get("finalizers"):
                api.patch_namespaced_custom_object(
                    "rlkube.io",
                    "v1alpha1",
                    namespace,
                    "rljobs",
                    item["metadata"]["name"],
                    {"metadata": {"finalizers": None}},
                )
        api.delete_collection_namespaced_custom_object("rlkube.io", "v1alpha1", namespace, "rljobs")
    except client.ApiException:
        pass  # no RLJob CRD in this cluster, or already gone


@pytest.fixture
def wait_for() -> Callable[..., Any]:
    """`wait_for(fn, timeout, describe)`: poll fn until truthy; on timeout fail showing describe()'s YAML."""
    return _wait_for
