"""Fake node manifests: GPU nodes carry what the AMD device plugin and node labeller would publish.

kwok takes over every Node annotated `kwok.x-k8s.io/node: fake` and keeps it Ready; the scheduler
sees exactly the capacity and labels written here, so placement logic is tested for real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
MANAGED_LABEL = "rlkube.io/devcluster"
POOL_LABEL = "rlkube.io/node-pool"
GPU_RESOURCE = "amd.com/gpu"
GPU_TAINT = {"key": "amd.com/gpu", "value": "present", "effect": "NoSchedule"}


@dataclass(frozen=True)
class GpuProfile:
    """What the AMD node labeller reports for one Instinct model."""

    model: str
    device_id: str
    product_name: str
    vram: str
    cu_count: int
    simd_count: int
    family: str = "AI"

    def labels(self) -> dict[str, str]:
        return {
            "amd.com/gpu.family": self.family,
            "amd.com/gpu.device-id": self.device_id,
            "amd.com/gpu.product-name": self.product_name,
            "amd.com/gpu.vram": self.vram,
            "amd.com/gpu.cu-count": str(self.cu_count),
            "amd.com/gpu.simd-count": str(self.simd_count),
            "amd.com/compute-memory-partition": "spx_nps1",
            "amd.com/compute-partitioning-supported": "true",
        }


# PCI device ids: MI300X 0x74a1, MI355X 0x75a3 (the labeller prints them as lower-case hex).
MI300X = GpuProfile("MI300X", "74a1", "AMD_Instinct_MI300X_OAM", "192G", 304, 1216)
MI355X = GpuProfile("MI355X", "75a3", "AMD_Instinct_MI355X_OAM", "288G", 256, 1024)
PROFILES = (MI300X, MI355X)


def _node(name: str, labels: dict[str, str], capacity: dict[str, str], taints: list[dict[str, str]]) -> dict:
    base_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        MANAGED_LABEL: "true",
    }
    spec: dict[str, Any] = {"taints": taints} if taints else {}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {**base_labels, **labels},
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": spec,
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "fake",
                "kernelVersion": "fake",
                "osImage": "kwok",
                "containerRuntimeVersion": "kwok",
            },
        },
    }


def gpu_node(name: str, profile: GpuProfile, gpus: int, taint: bool) -> dict:
    """A GPU node with `gpus` allocatable amd.com/gpu and the labeller's labels for `profile`."""
    capacity = {
        "cpu": "192",
        "memory": "2048Gi",
        "ephemeral-storage": "4Ti",
        "pods": "256",
        GPU_RESOURCE: str(gpus),
    }
    labels = {
        **profile.labels(),
        POOL_LABEL: "gpu",
        "node.kubernetes.io/instance-type": f"fake-{profile.model}",
    }
    return _node(name, labels, capacity, [dict(GPU_TAINT)] if taint else [])


def cpu_node(name: str) -> dict:
    """A CPU-only node, the natural home of Ray head pods."""
    capacity = {"cpu": "64", "memory": "256Gi", "ephemeral-storage": "1Ti", "pods": "256"}
    return _node(name, {POOL_LABEL: "cpu", "node.kubernetes.io/instance-type": "fake-cpu"}, capacity, [])


def node_manifests(gpu_nodes: int, gpus_per_node: int, cpu_nodes: int, taint: bool) -> list[dict]:
    """All fake nodes: the first half of the GPU nodes are MI300X, the rest MI355X."""
    manifests: list[dict] = []
    half = (gpu_nodes + 1) // 2
    for i in range(gpu_nodes):
        profile = MI300X if i < half else MI355X
        manifests.append(gpu_node(f"gpu-{profile.model.lower()}-{i:03d}", profile, gpus_per_node, taint))
    manifests.extend(cpu_node(f"cpu-{i:03d}") for i in range(cpu_nodes))
    return manifests
