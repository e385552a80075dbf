"""The real node: a container really runs, and `down` leaves nothing on the host.

Runs first in a session (tests/conftest.py orders it), with its own cluster: the machine has one
real node, so a cluster left in this checkout's default state dir with no live user (e.g. by
`make demo`) is stopped first; the session's cluster starts again when a later test needs it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from rlkube.devcluster import node as real
from rlkube.devcluster.cluster import ClusterConfig, DevCluster, default_state_dir
from rlkube.devcluster.testing import Kubectl, wait_for

pytestmark = [pytest.mark.realnode_lifecycle, pytest.mark.realpods, pytest.mark.timeout(600)]


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
        chains[binary] = sorted(
            line for line in out.splitlines() if line.startswith(":") or "KUBE" in line or "RLKUBE" in line
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
    """Stop this checkout's idle cluster if it holds the machine's real node; else fail saying who does."""
    reason = real.why_not(Path("."))
    if reason is None or "in use by" not in reason:
        return
    default = DevCluster(default_state_dir())
    state = default.read_state() or {}
    users = (
        [u for u in (default.state_dir / "users").glob("*")] if (default.state_dir / "users").is_dir() else []
    )
    live = [
        u
        for u in users
        if u.read_text().strip().isdigit() and Path(f"/proc/{u.read_text().strip()}").exists()
    ]
    if (state.get("real_node") or {}).get("enabled") and not live:
        default.down()
        return
    pytest.fail(f"the real node lifecycle test needs this machine's real node, but {reason}", pytrace=False)


def test_a_real_pod_runs_and_cluster_down_leaves_nothing_behind(tmp_path: Path) -> None:
    _free_the_real_node()
    before = host_snapshot()
    cluster = DevCluster(
        tmp_path / "c", ClusterConfig(gpu_nodes=1, kuberay=False, real_node="on", timeout_s=300)
    )
    try:
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

        pod = wait_for(running, 120, lambda: kubectl.json("get", "pod", "sandbox"), what="the pod Running")
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
    after = host_snapshot()
    for key in before:
        assert after[key] == before[key], f"{key} changed by up + down (down took {took:.0f} s)"
