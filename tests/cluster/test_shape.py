"""A test session gets the cluster shape it needs, whatever `make demo` (or anyone) left running.

Issue 11: `make demo` then `make test` failed three node tests because the session reused the demo's
one-GPU-node cluster. A running cluster of another shape is now never reused: `up` refuses it by
name, and a test session starts its own beside it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlkube.devcluster.cluster import ClusterConfig, DevCluster, ShapeMismatch
from rlkube.devcluster.testing import Kubectl, open_test_cluster

pytestmark = pytest.mark.cluster


def test_session_gets_mi300x_and_mi355x_nodes_beside_a_one_node_cluster(tmp_path: Path) -> None:
    left_running = DevCluster(tmp_path / "c", ClusterConfig(gpu_nodes=1, kuberay=False, real_node="off"))
    left_running.up(owner="demo")
    try:
        wanted = ClusterConfig(kuberay=False, real_node="off")
        with pytest.raises(ShapeMismatch, match="gpu_nodes 1 \\(wanted 4\\)"):
            DevCluster(tmp_path / "c", wanted).up()
        session = open_test_cluster(wanted, state_dir=tmp_path / "c")
        try:
            assert session.kubeconfig != left_running.kubeconfig
            nodes = Kubectl(session.kubeconfig).json("get", "nodes")["items"]
            products = [n["metadata"]["labels"].get("amd.com/gpu.product-name") for n in nodes]
            assert products.count("AMD_Instinct_MI300X_OAM") == 2, products
            assert products.count("AMD_Instinct_MI355X_OAM") == 2, products
            assert left_running.healthy(), "the cluster someone else left running must be left alone"
        finally:
            session.close()
        assert not (tmp_path / "c-pytest" / "state.json").exists(), "the session's own cluster stops with it"
    finally:
        left_running.down()
