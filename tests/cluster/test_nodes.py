"""The fake GPU nodes look to the scheduler and to kubectl like nodes the AMD device plugin and
node labeller have published."""

from __future__ import annotations

from typing import Any

from rlkube.devcluster import MI300X, MI355X
from rlkube.devcluster.testing import Kubectl


def _gpu_nodes(kubectl: Kubectl) -> list[dict[str, Any]]:
    nodes = kubectl.json("get", "nodes")["items"]
    return [n for n in nodes if "amd.com/gpu" in n["status"].get("allocatable", {})]


def test_gpu_nodes_ready_with_allocatable_gpus_and_amd_labels(kubectl: Kubectl) -> None:
    gpu_nodes = _gpu_nodes(kubectl)
    assert len(gpu_nodes) >= 2, "expected at least one MI300X and one MI355X node"
    seen_models = set()
    for node in gpu_nodes:
        name = node["metadata"]["name"]
        conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conditions.get("Ready") == "True", f"{name} not Ready: {conditions}"
        assert node["status"]["allocatable"]["amd.com/gpu"] == "8", name
        labels = node["metadata"]["labels"]
        profile = {p.device_id: p for p in (MI300X, MI355X)}[labels["amd.com/gpu.device-id"]]
        seen_models.add(profile.model)
        for key, value in profile.labels().items():
            assert labels.get(key) == value, f"{name}: label {key}={labels.get(key)!r}, want {value!r}"
    assert seen_models == {"MI300X", "MI355X"}


def test_kubectl_selects_nodes_by_labeller_labels(kubectl: Kubectl) -> None:
    out = kubectl(
        "get", "nodes", "-l", "amd.com/gpu.product-name=AMD_Instinct_MI355X_OAM", "-o", "name"
    ).stdout
    names = out.split()
    assert names and all("mi355x" in n for n in names), out
    table = kubectl("get", "nodes").stdout
    assert " Ready " in table


def test_kubectl_talks_to_the_real_server(kubectl: Kubectl) -> None:
    version = kubectl.json("version")
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
