"""Real kube-scheduler decisions on fake nodes: GPU requests are placed, or left Pending, for real."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from rlkube.devcluster.testing import Kubectl

MAX_GPUS_PER_NODE = 8


@pytest.fixture
def core(kube_api: Any) -> Any:
    return client.CoreV1Api(kube_api)


def _gpu_pod(name: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "tolerations": [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [
                {
                    "name": "main",
                    "image": "rocm/pytorch:latest",
                    "resources": {"limits": {"amd.com/gpu": str(gpus)}},
                }
            ],
        },
    }


def test_pod_wanting_more_gpus_than_any_node_stays_unschedulable(
    kubectl: Kubectl, core: Any, namespace: str, wait_for: Callable[..., Any]
) -> None:
    kubectl.apply(_gpu_pod("too-big", MAX_GPUS_PER_NODE + 1), "-n", namespace)

    def unschedulable() -> bool:
        pod = core.read_namespaced_pod("too-big", namespace)
        conds = {c.type: c for c in pod.status.conditions or []}
        cond = conds.get("PodScheduled")
        return bool(cond and cond.status == "False" and cond.reason == "Unschedulable")

    wait_for(unschedulable, 30, describe=lambda: core.read_namespaced_pod("too-big", namespace))
    pod = core.read_namespaced_pod("too-big", namespace)
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None
    assert "amd.com/gpu" in pod.status.conditions[0].message


def test_pod_with_gpus_is_bound_to_a_gpu_node_and_runs(
    kubectl: Kubectl, core: Any, namespace: str, wait_for: Callable[..., Any]
) -> None:
    kubectl.apply(_gpu_pod("fits", 4), "-n", namespace)
    pod = wait_for(
        lambda: (p := core.read_namespaced_pod("fits", namespace)).status.phase == "Running" and p,
        30,
        describe=lambda: core.read_namespaced_pod("fits", namespace),
    )
    node = core.read_node(pod.spec.node_name)
    assert int(node.status.allocatable["amd.com/gpu"]) >= 4
