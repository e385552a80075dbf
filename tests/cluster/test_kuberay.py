"""The real KubeRay operator against the real RayCluster schema, on fake GPU nodes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from kubernetes import client

from rlkube.devcluster.testing import Kubectl

RAY_IMAGE = "rayproject/ray:2.52.0"


def _raycluster(name: str) -> dict[str, Any]:
    def container(name: str, limits: dict[str, str]) -> dict[str, Any]:
        return {"name": name, "image": RAY_IMAGE, "resources": {"limits": limits, "requests": limits}}

    tolerate_gpu = [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {
            "headGroupSpec": {
                "rayStartParams": {"num-gpus": "0"},
                "template": {
                    "spec": {
                        "nodeSelector": {"rlkube.io/node-pool": "cpu"},
                        "containers": [container("ray-head", {"cpu": "2", "memory": "4Gi"})],
                    }
                },
            },
            "workerGroupSpecs": [
                {
                    "groupName": "gpu",
                    "replicas": 2,
                    "minReplicas": 2,
                    "maxReplicas": 2,
                    "rayStartParams": {},
                    "template": {
                        "spec": {
                            "tolerations": tolerate_gpu,
                            "containers": [
                                container("ray-worker", {"cpu": "8", "memory": "64Gi", "amd.com/gpu": "4"})
                            ],
                        }
                    },
                }
            ],
        },
    }


def test_raycluster_pods_created_by_kuberay_scheduled_on_gpu_nodes_and_running(
    kubectl: Kubectl, kube_api: Any, namespace: str, wait_for: Callable[..., Any]
) -> None:
    core: Any = client.CoreV1Api(kube_api)
    custom: Any = client.CustomObjectsApi(kube_api)
    kubectl.apply(_raycluster("rc"), "-n", namespace)

    def describe() -> Any:
        return {
            "raycluster": custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", "rc"),
            "pods": [
                {"name": p.metadata.name, "node": p.spec.node_name, "phase": p.status.phase}
                for p in core.list_namespaced_pod(namespace).items
            ],
        }

    def all_running() -> list[Any]:
        pods = core.list_namespaced_pod(namespace, label_selector="ray.io/cluster=rc").items
        return pods if len(pods) == 3 and all(p.status.phase == "Running" for p in pods) else []

    pods = wait_for(all_running, 60, describe=describe, what="head + 2 GPU workers Running")
    workers = [p for p in pods if p.metadata.labels.get("ray.io/node-type") == "worker"]
    heads = [p for p in pods if p.metadata.labels.get("ray.io/node-type") == "head"]
    assert len(workers) == 2 and len(heads) == 1
    for pod in workers:
        assert pod.spec.containers[0].resources.limits["amd.com/gpu"] == "4"
        node = core.read_node(pod.spec.node_name)
        assert "amd.com/gpu.device-id" in node.metadata.labels, pod.spec.node_name
    assert "amd.com/gpu" not in core.read_node(heads[0].spec.node_name).status.allocatable

    status = wait_for(
        lambda: (
            custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", "rc").get("status")
            or {}
        ).get("desiredGPU"),
        30,
        describe=describe,
        what="status.desiredGPU",
    )
    assert status == "8"
    table = kubectl("get", "raycluster", "rc", "-n", namespace).stdout.splitlines()
    header, row = table[0], table[1]
    assert " GPUS " in header, table
    assert row[header.index(" GPUS ") + 1 :].split()[0] == "8", table


def test_raycluster_with_non_string_raystartparams_is_rejected_by_the_schema(
    kubectl: Kubectl, namespace: str
) -> None:
    bad = copy.deepcopy(_raycluster("bad"))
    bad["spec"]["headGroupSpec"]["rayStartParams"] = {"num-cpus": 1}
    result = kubectl.apply(bad, "-n", namespace, check=False)
    assert result.returncode != 0
    assert "rayStartParams" in result.stderr, result.stderr
    assert "string" in result.stderr, result.stderr
    assert kubectl("get", "raycluster", "-n", namespace, "-o", "name").stdout.strip() == ""
