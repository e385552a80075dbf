"""`up`/`down` of a second, separate cluster: reuse and explicit selection work, down leaves no
process and no listening port, and a component that crashes while starting is reported with its
log instead of hanging."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlkube.devcluster import ClusterConfig, DevCluster, DevClusterError, listening_ports, listening_sockets
from rlkube.devcluster.testing import TEST_KUBECONFIG_ENV, Kubectl, open_test_cluster

CLI = [sys.executable, "-P", "-m", "rlkube.devcluster.cli"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_cli_down_stops_every_process_and_closes_every_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "dc"
    cluster = DevCluster(state_dir, ClusterConfig(gpu_nodes=1, cpu_nodes=0, timeout_s=120, real_node="off"))
    state = cluster.up()
    try:
        pids = [c["pid"] for c in state["components"]]
        ports = [p for c in state["components"] for p in c["ports"]]
        names = [c["name"] for c in state["components"]]
        assert names == [
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
            "ray-operator",
        ]
        assert all(_alive(p) for p in pids)
        assert state["ports"]["apiserver"] in listening_ports(ports)
        # The cluster's own sockets: once released, a port may be bound again by anyone.
        sockets = listening_sockets(ports)

        # A test session reuses a healthy cluster someone started and leaves it running.
        other = DevCluster(state_dir)
        assert other.attach("pytest-reuser") is False
        assert other.detach("pytest-reuser") is False
        assert other.healthy()

        # An explicit RLKUBE_TEST_KUBECONFIG selects that cluster; an ambient KUBECONFIG is ignored.
        monkeypatch.setenv(TEST_KUBECONFIG_ENV, str(state_dir / "kubeconfig"))
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nonexistent-kubeconfig"))
        external = open_test_cluster()
        assert external.external and external.kubeconfig == state_dir / "kubeconfig"
        nodes = Kubectl(external.kubeconfig)("get", "nodes", "-o", "name").stdout.split()
        assert nodes == ["node/gpu-mi300x-000"]
        external.close()
        assert cluster.healthy(), "closing an external cluster must not stop it"
        monkeypatch.setenv(TEST_KUBECONFIG_ENV, str(tmp_path / "missing"))
        with pytest.raises(DevClusterError, match="no such file"):
            open_test_cluster()
        monkeypatch.delenv("KUBECONFIG")

        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        status = subprocess.run(
            [*CLI, "--state-dir", str(state_dir), "status"], capture_output=True, text=True, env=env
        )
        assert status.returncode == 0, status.stderr
        shell_env = subprocess.run(
            [*CLI, "--state-dir", str(state_dir), "env"], capture_output=True, text=True, env=env
        )
        assert shell_env.stdout.strip() == f"export KUBECONFIG={state_dir / 'kubeconfig'}"

        down = subprocess.run(
            [*CLI, "--state-dir", str(state_dir), "down"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert down.returncode == 0, down.stderr
    finally:
        cluster.down()  # no-op when the CLI already stopped it; cleans up if an assert failed
    assert [p for p in pids if _alive(p)] == []
    assert listening_sockets(ports) & sockets == set()
    assert not (state_dir / "state.json").exists()
    assert not (state_dir / "kubeconfig").exists()
    assert (state_dir / "logs" / "kube-apiserver.log").exists(), "logs are kept for post-mortems"
    after = subprocess.run(
        [*CLI, "--state-dir", str(state_dir), "status"], capture_output=True, text=True, env=env
    )
    assert after.returncode == 1


def test_component_crashing_at_start_is_reported_with_its_log_not_a_hang(tmp_path: Path) -> None:
    config = ClusterConfig(
        gpu_nodes=1, cpu_nodes=0, timeout_s=60, real_node="off", extra_args={"etcd": ["--no-such-flag"]}
    )
    cluster = DevCluster(tmp_path / "dc", config)
    start = time.monotonic()
    with pytest.raises(DevClusterError) as err:
        cluster.up()
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert "etcd exited" in message
    assert "no-such-flag" in message, message
    assert cluster.read_state() is None
    assert not cluster.healthy()


def test_cli_up_with_no_nodes_and_no_kuberay_starts_a_bare_control_plane(tmp_path: Path) -> None:
    """`up --nodes 0 --cpu-nodes 0 --no-kuberay` has nothing to post: it used to crash with
    `max_workers must be greater than 0`."""
    state_dir = tmp_path / "bare"
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    argv = [*CLI, "--state-dir", str(state_dir)]
    try:
        up = subprocess.run(
            [
                *argv,
                "up",
                "--nodes",
                "0",
                "--cpu-nodes",
                "0",
                "--no-kuberay",
                "--real-node",
                "off",
                "--timeout",
                "120",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert up.returncode == 0, up.stderr[-3000:]
        assert "max_workers" not in up.stderr
        kubectl = Kubectl(state_dir / "kubeconfig")
        assert kubectl("get", "nodes", "-o", "name").stdout.split() == []
        crds = kubectl("get", "crd", "-o", "name").stdout.split()
        assert not [c for c in crds if "ray.io" in c]
    finally:
        subprocess.run([*argv, "down"], capture_output=True, env=env, timeout=120)
    assert not (state_dir / "state.json").exists()


def test_down_succeeds_when_another_process_binds_a_port_the_cluster_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ports come from the ephemeral range: once the API server lets go of its port, any
    `bind(0)` on the machine may take it (a Ray worker did, during one CI run). `down` waits for the
    cluster's own sockets to close, so a stranger's socket on the same port is not a failure, and it
    is left alone. The race is injected: the stranger binds right after the processes stop."""
    bare = ClusterConfig(gpu_nodes=0, cpu_nodes=0, kuberay=False, real_node="off", timeout_s=120)
    cluster = DevCluster(tmp_path / "dc", bare)
    state = cluster.up()
    port = state["ports"]["apiserver"]
    stranger = socket.socket()
    real_terminate = DevCluster._terminate

    def terminate_then_rebind(self: DevCluster, comps: list, grace_s: float = 8.0) -> list[str]:
        stopped = real_terminate(self, comps, grace_s)
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        stranger.bind(("127.0.0.1", port))
        stranger.listen()
        return stopped

    monkeypatch.setattr(DevCluster, "_terminate", terminate_then_rebind)
    try:
        start = time.monotonic()
        assert "kube-apiserver" in cluster.down()
        assert time.monotonic() - start < 25, "down waited for a socket that is not the cluster's"
        assert listening_ports([port]) == [port], "the stranger's socket stays open"
        assert not (tmp_path / "dc" / "state.json").exists()
    finally:
        stranger.close()
