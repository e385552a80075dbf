"""The real node: a container really runs, `down` leaves nothing on the host, and a node whose
processes were killed (a session stopped mid-run) is cleared by the next `up` without touching a
node another cluster runs.

Runs first in a session (tests/conftest.py orders it), with its own clusters: the machine has one
real node, so a cluster left in this checkout's default state dir with no live user (e.g. by
`make demo`) is stopped first, and what a killed earlier run left is cleared before the host is
read; the session's cluster starts again when a later test needs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlkube.devcluster import node as real
from rlkube.devcluster.cluster import ClusterConfig, DevCluster, default_state_dir
from rlkube.devcluster.testing import Kubectl, wait_for

pytestmark = [pytest.mark.realnode_lifecycle, pytest.mark.realpods, pytest.mark.timeout(600)]


BUILTIN_CHAINS = ("INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING")


def _is_default_builtin_chain(line: str) -> bool:
    """`:INPUT ACCEPT [0:0]`-style line of a built-in chain left at its default policy."""
    name, policy = line[1:].split()[:2]
    return name in BUILTIN_CHAINS and policy == "ACCEPT"


def host_snapshot() -> dict[str, object]:
    """What a real node may change on the host, read from the kernel."""
    mounts = sorted(
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if any(p in line for p in (str(real.RUN_DIR), str(real.VAR_DIR), "containerd", "kubelet", "netns"))
    )
    links = sorted(p.name for p in Path("/sys/class/net").iterdir())
    chains = {}
    for binary in ("iptables-save", "ip6tables-save"):
        out = subprocess.run([binary], capture_output=True, text=True, check=True).stdout
        # A table's built-in chains with the default ACCEPT policy and no rules are what the kernel
        # creates on any first use of iptables (nf_tables backend), the same as no table at all: a
        # fresh machine has none before the first node, and they stay after it. Our chains, changed
        # policies and our rules are what must not stay.
        chains[binary] = sorted(
            line
            for line in out.splitlines()
            if (line.startswith(":") and not _is_default_builtin_chain(line)) or "KUBE" in line
        )
    names = ("containerd", "containerd-shim-runc-v2", "kubelet", "kube-proxy", "coredns", "pause")
    procs = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                exe = os.path.basename(os.readlink(p / "exe"))
            except OSError:
                continue
            if exe in names:
                procs.append(f"{p.name}:{exe}")
    cgroups = sorted(str(p) for p in Path("/sys/fs/cgroup").glob("*/kubepods"))
    return {
        "mounts": mounts,
        "links": links,
        "iptables": chains,
        "sysctls": real.read_sysctls(),
        "processes": sorted(procs),
        "cgroups": cgroups,
        "routes": subprocess.run(["ip", "route"], capture_output=True, text=True).stdout,
        "dirs": [str(d) for d in (real.RUN_DIR, real.VAR_DIR) if d.exists()],
    }


def _free_the_real_node() -> None:
    """Stop this checkout's idle cluster if it holds the machine's real node, else fail saying who
    does; then clear what a killed earlier node left (the host as it was before that node)."""
    reason = real.why_not(Path("."))
    if reason is not None and "in use by" in reason:
        default = DevCluster(default_state_dir())
        state = default.read_state() or {}
        users_dir = default.state_dir / "users"
        users = list(users_dir.glob("*")) if users_dir.is_dir() else []
        live = [
            u
            for u in users
            if u.read_text().strip().isdigit() and Path(f"/proc/{u.read_text().strip()}").exists()
        ]
        if not (state.get("real_node") or {}).get("enabled") or live:
            pytest.fail(f"the real node lifecycle test needs this machine's real node, but {reason}", False)
        default.down()
    assert real.holder_state_dir() is None
    real.RealNode.clear_crashed_run()


def _real_node_cluster(state_dir: Path) -> DevCluster:
    return DevCluster(state_dir, ClusterConfig(gpu_nodes=1, kuberay=False, real_node="on", timeout_s=300))


def _run_sandbox_pod(cluster: DevCluster) -> dict:
    """Start the cluster, run the pause image on the real node; the Running pod."""
    cluster.up()
    kubectl = Kubectl(cluster.kubeconfig)
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "sandbox", "namespace": "default"},
            "spec": {
                "nodeSelector": {real.REAL_NODE_LABEL: "true"},
                "tolerations": [{"key": real.REAL_NODE_LABEL, "operator": "Exists"}],
                "containers": [{"name": "c", "image": real.SANDBOX_IMAGE, "imagePullPolicy": "Never"}],
            },
        }
    )

    def running() -> dict | None:
        pod = kubectl.json("get", "pod", "sandbox")
        return pod if pod["status"].get("phase") == "Running" else None

    return wait_for(running, 120, lambda: kubectl.json("get", "pod", "sandbox"), what="the pod Running")


def _assert_host_restored(before: dict[str, object], took: float) -> None:
    after = host_snapshot()
    for key in before:
        assert after[key] == before[key], f"{key} changed by up + down (down took {took:.0f} s)"


def test_a_real_pod_runs_and_cluster_down_leaves_nothing_behind(tmp_path: Path) -> None:
    _free_the_real_node()
    before = host_snapshot()
    cluster = _real_node_cluster(tmp_path / "c")
    try:
        pod = _run_sandbox_pod(cluster)
        assert pod["spec"]["nodeName"] == real.NODE_NAME
        assert pod["status"]["podIP"].startswith("10.250.0.")
        # A real process in a real cgroup: the kubelet's pod cgroup holds the pause process.
        uid = pod["metadata"]["uid"]
        assert list(Path("/sys/fs/cgroup/memory/kubepods").rglob(f"*{uid}*")), "no pod cgroup on the host"
        # The pod's network is the bridge; nothing was masqueraded, forwarding off-bridge is dropped.
        nat = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True).stdout
        assert "MASQUERADE" not in "\n".join(ln for ln in nat.splitlines() if real.POD_CIDR in ln)
        isolate = subprocess.run(["iptables", "-S", "RLKUBE-ISOLATE"], capture_output=True, text=True).stdout
        assert f"-A RLKUBE-ISOLATE -i {real.BRIDGE} -j DROP" in isolate
    finally:
        t0 = time.monotonic()
        cluster.down()
        took = time.monotonic() - t0
    _assert_host_restored(before, took)


def _kill_like_a_stopped_session(cluster: DevCluster) -> None:
    """SIGKILL every process the cluster started, its containers' shims and the containers, as
    when the session running it is stopped: no `down` runs, the kernel keeps the mounts."""
    state = json.loads((cluster.state_dir / "state.json").read_text())
    for comp in state["components"]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(comp["pid"], signal.SIGKILL)
    for pid in real._shim_pids() | real._pids_in_cgroups("kubepods"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: real.holder_state_dir() is None, 30, what="the lock freed by the dead node")


def test_a_killed_node_is_cleared_by_the_next_up_and_its_stale_down_spares_the_new_node(
    tmp_path: Path,
) -> None:
    _free_the_real_node()
    before = host_snapshot()
    crashed = _real_node_cluster(tmp_path / "crashed")
    fresh = _real_node_cluster(tmp_path / "fresh")
    try:
        _run_sandbox_pod(crashed)
        _kill_like_a_stopped_session(crashed)
        left = host_snapshot()
        assert left["mounts"] != before["mounts"] and left["links"] != before["links"], "no leftovers"
        # The next `up` clears the dead node's pods, mounts, bridge and rules and runs a pod.
        pod = _run_sandbox_pod(fresh)
        kubectl = Kubectl(fresh.kubeconfig)
        # `down` of the dead cluster's stale state must not tear down the node the fresh one runs.
        crashed.down()
        assert real.holder_state_dir() == fresh.state_dir
        still = kubectl.json("get", "pod", "sandbox")
        assert still["metadata"]["uid"] == pod["metadata"]["uid"] and still["status"]["phase"] == "Running"
        assert Path(f"/sys/class/net/{real.BRIDGE}").exists()
    finally:
        t0 = time.monotonic()
        try:
            crashed.down()
        finally:
            fresh.down()
        took = time.monotonic() - t0
    _assert_host_restored(before, took)
