"""Start, check and stop a real local Kubernetes control plane with fake AMD GPU nodes.

Real: etcd, kube-apiserver (TLS, RBAC, token auth), kube-controller-manager, kube-scheduler, the
KubeRay operator and its CRD schemas. Simulated: the nodes (kwok marks them Ready and bound pods
Running; no container ever runs). Every process runs in its own process group on free 127.0.0.1
ports, logs to `<state>/logs/<component>.log`, and is recorded in `<state>/state.json` so that
`down` stops exactly what `up` started, even from another process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .binaries import REPO_ROOT, Binaries, find_binaries
from .errors import DevClusterError
from .kubeapi import ApiError, KubeApi, bearer_kubeconfig
from .node import (
    DNS_SERVICE_IP,
    NODE_IP,
    NODE_NAME,
    RealNode,
    holder_state_dir,
    mode_from_env,
    node_binaries,
    why_not,
)
from .nodes import KWOK_ANNOTATION, MANAGED_LABEL, node_manifests

# kwok Stage files (upstream defaults, cached by build.sh) this cluster does not load: see _start().
KWOK_STAGES_LEFT_OUT = frozenset({"pod-complete.yaml"})

_YamlLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
STATE_VERSION = 1
LOG_TAIL_LINES = 40
# Start order; `down` stops in reverse so clients go before the API server and etcd.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "containerd",
    "kubelet",
    "kube-proxy",
    "coredns",
    "ray-operator",
)
# Controllers that need a cloud provider, a cluster CIDR or a signing CA this cluster does not have.
DISABLED_CONTROLLERS = (
    "cloud-node-lifecycle-controller",
    "service-lb-controller",
    "node-route-controller",
    "node-ipam-controller",
    "certificatesigningrequest-signing-controller",
)


def default_state_dir() -> Path:
    """`$RLKUBE_DEVCLUSTER_DIR`, else `.devcluster` at the repository root."""
    env = os.environ.get("RLKUBE_DEVCLUSTER_DIR")
    return Path(env).resolve() if env else REPO_ROOT / ".devcluster"


@dataclass
class ClusterConfig:
    """What to start. Defaults: 4 GPU nodes x 8 amd.com/gpu (half MI300X, half MI355X) + 1 CPU node."""

    gpu_nodes: int = 4
    gpus_per_node: int = 8
    cpu_nodes: int = 1
    gpu_taint: bool = False
    kuberay: bool = True
    # "auto": a real CPU node when this machine allows it and no other runs here; "on": required;
    # "off": kwok only. None: $RLKUBE_REAL_NODE (0/1/auto), default auto.
    real_node: str | None = None
    timeout_s: float = 120.0
    # Extra command-line flags per component (e.g. to inject a fault in a test).
    extra_args: dict[str, list[str]] = field(default_factory=dict)


SHAPE_KEYS = ("gpu_nodes", "gpus_per_node", "cpu_nodes", "gpu_taint", "kuberay")


def shape_of(config: dict[str, Any] | ClusterConfig) -> dict[str, Any]:
    """The node layout a caller relies on (what a reused cluster must match)."""
    d = asdict(config) if isinstance(config, ClusterConfig) else config
    return {k: d.get(k) for k in SHAPE_KEYS}


class ShapeMismatch(DevClusterError):
    """A healthy cluster runs in the state dir, but with other nodes than the caller needs."""


@dataclass
class Component:
    """One started process, as recorded in state.json."""

    name: str
    pid: int
    binary: str
    log: str
    ports: list[int]


def _free_ports(n: int) -> list[int]:
    """n distinct free 127.0.0.1 ports (all held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as err:
        return f"(no log: {err})"
    return "\n".join(text.splitlines()[-lines:])


def _pid_alive(pid: int) -> bool:
    """True if `pid` runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _pid_runs(pid: int, binary: str) -> bool:
    """True if `pid` is alive and still runs `binary` (guards against pid reuse)."""
    if not _pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return False
    return argv0 == binary


def listening_sockets(ports: list[int]) -> set[tuple[int, int]]:
    """(port, socket inode) of every listening TCP socket on one of `ports` (from /proc/net/tcp*).

    The inode names one socket: a port that a stopped process released and another process bound
    again (ports come from the ephemeral range, where any `bind(0)` may land) has a new inode.
    """
    wanted = set(ports)
    found: set[tuple[int, int]] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A":  # TCP_LISTEN
                        port = int(cols[1].rsplit(":", 1)[1], 16)
                        if port in wanted:
                            found.add((port, int(cols[9])))
        except OSError:
            continue
    return found


def listening_ports(ports: list[int]) -> list[int]:
    """Which of `ports` have a listening TCP socket on this machine, whoever holds it."""
    return sorted({port for port, _ in listening_sockets(ports)})


def _sockets_of(pid: int) -> set[int] | None:
    """Inodes of the sockets process `pid` holds open; None where its fds cannot be read."""
    inodes: set[int] = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    except OSError:
        return None
    return inodes


def _http_ok(url: str, timeout: float = 2.0, token: str | None = None) -> bool:
    ctx = ssl._create_unverified_context()
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            return bool(resp.status == 200)
    except (OSError, ValueError):
        return False


class DevCluster:
    """Controls one local cluster living in `state_dir` (default `.devcluster`)."""

    def __init__(self, state_dir: Path | str | None = None, config: ClusterConfig | None = None) -> None:
        self.state_dir = Path(state_dir).resolve() if state_dir else default_state_dir()
        self.config = config or ClusterConfig()
        # Only a caller that named a shape has one to check a running cluster against.
        self._shape_given = config is not None
        self.logs_dir = self.state_dir / "logs"
        self.state_file = self.state_dir / "state.json"
        self.kubeconfig = self.state_dir / "kubeconfig"
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._components: list[Component] = []
        self.timings: dict[str, float] = {}
        self.real_node_reason = ""
        self._node: RealNode | None = None
        self._node_sysctls: dict[str, str] | None = None

    # ---------------------------------------------------------------- state

    def read_state(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self.state_file.read_text()))
        except (OSError, ValueError):
            return None

    def _write_state(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    @contextlib.contextmanager
    def lock(self, timeout_s: float = 300.0) -> Iterator[None]:
        """Serialise up/down/attach across processes (`<state>/.lock`, which `down` keeps)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / ".lock"
        with path.open("a") as f:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as err:
                    if err.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() > deadline:
                        raise DevClusterError(
                            f"timed out after {timeout_s:.0f} s waiting for {path}"
                        ) from None
                    time.sleep(0.2)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def healthy(self) -> bool:
        """True if every recorded process still runs and the API server answers /readyz."""
        state = self.read_state()
        if not state or state.get("version") != STATE_VERSION:
            return False
        if not all(_pid_runs(c["pid"], c["binary"]) for c in state["components"]):
            return False
        return _http_ok(state["server"] + "/readyz", token=state["token"])

    def status(self) -> dict[str, Any]:
        """A JSON-able summary: running or not, each component's pid/liveness, ports, kubeconfig."""
        state = self.read_state()
        if not state:
            return {"running": False, "state_dir": str(self.state_dir)}
        comps = {
            c["name"]: {"pid": c["pid"], "alive": _pid_runs(c["pid"], c["binary"]), "ports": c["ports"]}
            for c in state["components"]
        }
        return {
            "running": self.healthy(),
            "state_dir": str(self.state_dir),
            "server": state["server"],
            "kubeconfig": state["kubeconfig"],
            "owner": state.get("owner"),
            "config": state.get("config"),
            "components": comps,
            "timings": state.get("timings"),
        }

    # ------------------------------------------------------------------ up

    def up(self, owner: str = "python") -> dict[str, Any]:
        """Start everything and wait until all nodes are Ready; returns the state. Idempotent.

        On any failure (a crashed component, a timeout) the processes started so far are stopped
        and a DevClusterError carrying the failing component's log tail is raised.
        """
        with self.lock():
            if self.healthy():
                state = self.read_state()
                assert state is not None
                self._check_shape(state)
                if owner == "cli" and state.get("owner") != "cli":
                    state["owner"] = "cli"
                    self._write_state(state)
                return state
            self._stop_recorded()
            try:
                return self._start(owner)
            except BaseException:
                self._stop_started()
                raise

    def _check_shape(self, state: dict[str, Any]) -> None:
        """Refuse to reuse a running cluster whose nodes differ from what this caller asked for."""
        if not self._shape_given:
            return
        have, want = shape_of(state.get("config") or {}), shape_of(self.config)
        if have != want:
            diff = ", ".join(f"{k} {have[k]} (wanted {want[k]})" for k in SHAPE_KEYS if have[k] != want[k])
            raise ShapeMismatch(f"the cluster running in {self.state_dir} has {diff}")
        if self._real_mode() == "on" and not (state.get("real_node") or {}).get("enabled"):
            raise ShapeMismatch(f"the cluster running in {self.state_dir} has no real node (required)")

    def _real_mode(self) -> str:
        mode = self.config.real_node or mode_from_env()
        if mode not in ("auto", "on", "off"):
            raise DevClusterError(f"real_node={mode!r}: use auto, on or off")
        return mode

    def _decide_real_node(self) -> RealNode | None:
        """A RealNode when this cluster gets one; else None, with one line saying why on stderr."""
        mode = self._real_mode()
        if mode == "off":
            why = "real_node=off" if self.config.real_node else "RLKUBE_REAL_NODE=0"
            self.real_node_reason = f"off ({why})"
            print(f"[devcluster] kwok-only: real node off ({why})", file=sys.stderr, flush=True)
            return None
        reason = why_not(self.state_dir)
        if reason is None:
            bins, _ = node_binaries()
            assert bins is not None
            return RealNode(self.state_dir, bins)
        if mode == "on":
            raise DevClusterError(f"a real node is required (RLKUBE_REAL_NODE=1) but {reason}")
        self.real_node_reason = reason
        print(f"[devcluster] kwok-only (no real node): {reason}", file=sys.stderr, flush=True)
        return None

    def _start(self, owner: str) -> dict[str, Any]:
        t0 = time.monotonic()
        deadline = t0 + self.config.timeout_s
        bins = find_binaries()
        self._wipe(keep_logs=False)
        for sub in ("logs", "certs", "etcd"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        node = self._decide_real_node()
        lock_fd: int | None = None
        if node is not None:
            lock_fd = node.claim()
            self._node = node

        names = [
            "etcd",
            "etcd-peer",
            "apiserver",
            "kcm",
            "scheduler",
            "kwok",
            "kuberay-metrics",
            "kuberay-probe",
            "kubelet-healthz",
            "kube-proxy-healthz",
            "kube-proxy-metrics",
            "coredns-health",
            "coredns-ready",
        ]
        ports = dict(zip(names, _free_ports(len(names)), strict=True))
        token = secrets.token_hex(24)
        # With a real node the API server listens on the node address, which pods reach (through
        # the `kubernetes` Service) and which exists only on this machine; else on loopback.
        host = NODE_IP if node is not None else "127.0.0.1"
        server = f"https://{host}:{ports['apiserver']}"
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "owner": owner,
            "created": time.time(),
            "server": server,
            "token": token,
            "kubeconfig": str(self.kubeconfig),
            "ports": ports,
            "config": asdict(self.config),
            "binaries": {k: str(v) for k, v in asdict(bins).items()},
            "components": [],
            "real_node": {"enabled": False, "reason": self.real_node_reason},
        }
        self._write_state(state)
        node_tokens: dict[str, str] = {}
        if node is not None:
            state["real_node"] = {"enabled": True, "name": NODE_NAME, "sysctls": {}}
            self._write_state(state)
            state["real_node"]["sysctls"] = self._node_sysctls = node.prepare_host()
            self._write_state(state)
            node_tokens = {"kubelet": secrets.token_hex(24), "kube-proxy": secrets.token_hex(24)}
        self._make_credentials(token, node_tokens)

        certs = self.state_dir / "certs"
        self._spawn(
            "etcd",
            bins.etcd,
            [
                f"--name=devcluster-{ports['etcd']}",
                f"--data-dir={self.state_dir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--advertise-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--listen-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
                f"--initial-cluster=devcluster-{ports['etcd']}=http://127.0.0.1:{ports['etcd-peer']}",
                "--unsafe-no-fsync",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ],
            [ports["etcd"], ports["etcd-peer"]],
            state,
        )
        # The API server retries etcd on its own, so both start at once.
        self._spawn(
            "kube-apiserver",
            bins.kube_apiserver,
            [
                f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
                f"--bind-address={host}",
                f"--advertise-address={host}",
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={certs}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={certs / 'sa.pub'}",
                f"--service-account-signing-key-file={certs / 'sa.key'}",
                "--authorization-mode=Node,RBAC",
                f"--token-auth-file={certs / 'tokens.csv'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--allow-privileged=true",
                # kwok-only: the `kubernetes` Service would point at loopback, which no pod can use.
                # With a real node it points at the node address (pods' in-cluster clients use it).
                f"--endpoint-reconciler-type={'lease' if node is not None else 'none'}",
                "--profiling=false",
                *(
                    [
                        f"--kubelet-client-certificate={certs / 'kubelet-client.crt'}",
                        f"--kubelet-client-key={certs / 'kubelet-client.key'}",
                        "--kubelet-preferred-address-types=InternalIP",
                    ]
                    if node is not None
                    else []
                ),
            ],
            [ports["apiserver"]],
            state,
        )
        self._wait(deadline, "kube-apiserver /readyz", lambda: _http_ok(f"{server}/readyz", token=token))
        self.timings["apiserver_ready_s"] = time.monotonic() - t0

        ca_pem = (certs / "apiserver.crt").read_text()
        self._write_kubeconfig(server, token, ca_pem)
        api = KubeApi(server, token, ca_pem)
        kc = str(self.kubeconfig)
        auth = [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}"]
        self._spawn(
            "kube-controller-manager",
            bins.kube_controller_manager,
            [
                *auth,
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['kcm']}",
                f"--service-account-private-key-file={certs / 'sa.key'}",
                f"--root-ca-file={certs / 'apiserver.crt'}",
                "--use-service-account-credentials=true",
                "--controllers=*," + ",".join("-" + c for c in DISABLED_CONTROLLERS),
                "--kube-api-qps=200",
                "--kube-api-burst=400",
            ],
            [ports["kcm"]],
            state,
        )
        self._spawn(
            "kube-scheduler",
            bins.kube_scheduler,
            [
                *auth,
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['scheduler']}",
            ],
            [ports["scheduler"]],
            state,
        )
        self._spawn(
            "kwok",
            bins.kwok,
            [
                f"--kubeconfig={kc}",
                # Upstream's default stages: nodes turn Ready (leases heartbeat), bound pods Running,
                # deleted pods go away. Not pod-complete: it ends every Job's pod at once, and KubeRay's
                # submitter (a Job) runs until its Ray job ends; "completed" at once, KubeRay fails the
                # RayJob ("Submitter completed but Ray job not found") before any test can drive it.
                *(
                    f"--config={p}"
                    for p in sorted(bins.kwok_stages.glob("*.yaml"))
                    if p.name not in KWOK_STAGES_LEFT_OUT
                ),
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                "--cidr=10.244.0.1/16",
                "--node-ip=10.0.0.1",
                "--node-lease-duration-seconds=40",
                f"--server-address=127.0.0.1:{ports['kwok']}",
            ],
            [ports["kwok"]],
            state,
        )

        # CRDs (POSTed: too large for client-side apply's annotation) and nodes go in concurrently,
        # while the controllers start.
        crd_docs = self._load_crds(bins) if self.config.kuberay else []
        crds = [d["metadata"]["name"] for d in crd_docs]
        manifests = node_manifests(
            self.config.gpu_nodes, self.config.gpus_per_node, self.config.cpu_nodes, self.config.gpu_taint
        )
        posts = [("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", d) for d in crd_docs]
        posts += [("/api/v1/nodes", n) for n in manifests]
        if posts:  # a control plane alone (--nodes 0 --cpu-nodes 0 --no-kuberay) posts nothing
            with ThreadPoolExecutor(max_workers=min(16, len(posts))) as pool:
                list(pool.map(lambda p: api.create(*p), posts))
        self.timings["objects_created_s"] = time.monotonic() - t0

        if node is not None:
            assert lock_fd is not None
            self._start_node(node, api, certs, server, ports, token, node_tokens, state, deadline, lock_fd)
            self.timings["real_node_ready_s"] = time.monotonic() - t0

        if self.config.kuberay:
            self._wait(deadline, "KubeRay CRDs Established", lambda: self._crds_established(api, crds))
            env = {"KUBECONFIG": kc}
            # With a real node the KubeRay operator must resolve cluster names (it dials the Ray
            # head's service): it runs in its own mount namespace whose resolv.conf names the
            # cluster DNS, leaving the host's resolver alone.
            wrapper = None
            if node is not None:
                resolv = self.state_dir / "node" / "operator-resolv.conf"
                resolv.write_text(f"nameserver {NODE_IP}\nsearch svc.cluster.local cluster.local\n")
                wrapper = [
                    "unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                    f'mount --bind {resolv} /etc/resolv.conf && exec "$0" "$@"',
                ]  # fmt: skip
            self._spawn(
                "ray-operator",
                bins.ray_operator,
                [
                    f"--metrics-addr=127.0.0.1:{ports['kuberay-metrics']}",
                    f"--health-probe-bind-address=127.0.0.1:{ports['kuberay-probe']}",
                    "--enable-leader-election=false",
                    f"--kubeconfig={kc}",
                ],
                [ports["kuberay-metrics"], ports["kuberay-probe"]],
                state,
                env=env,
                wrapper=wrapper,
            )
        if node is not None:
            node.release()  # the node processes hold the machine-wide lock from here on

        expected = len(manifests) + (1 if node is not None else 0)
        self._wait(deadline, f"{expected} nodes Ready", lambda: self._ready_nodes(api) >= expected)
        self.timings["nodes_ready_s"] = time.monotonic() - t0
        self._wait(
            deadline,
            "ServiceAccount default/default",
            lambda: self._exists(api, "/api/v1/namespaces/default/serviceaccounts/default"),
        )
        probes = {
            "kube-controller-manager /healthz": f"https://127.0.0.1:{ports['kcm']}/healthz",
            "kube-scheduler /healthz": f"https://127.0.0.1:{ports['scheduler']}/healthz",
        }
        if self.config.kuberay:
            probes["ray-operator /readyz"] = f"http://127.0.0.1:{ports['kuberay-probe']}/readyz"
        for what, url in probes.items():
            self._wait(deadline, what, functools.partial(_http_ok, url))
        api.close()
        self.timings["up_s"] = time.monotonic() - t0
        state["timings"] = {k: round(v, 2) for k, v in self.timings.items()}
        self._write_state(state)
        return state

    def _start_node(
        self,
        node: RealNode,
        api: KubeApi,
        certs: Path,
        server: str,
        ports: dict[str, int],
        token: str,
        node_tokens: dict[str, str],
        state: dict[str, Any],
        deadline: float,
        lock_fd: int,
    ) -> None:
        """containerd, the sandbox image, kubelet, kube-proxy, CoreDNS and the kube-dns Service."""
        from .images import import_layout, pause_layout

        node.write_configs(certs, server, ports, {**node_tokens, "coredns": token})
        fds = (lock_fd,)
        self._spawn("containerd", Path(shutil.which("containerd") or "containerd"), node.containerd_args(),
                    [], state, env=node.containerd_env(), pass_fds=fds)  # fmt: skip
        self._wait(deadline, "containerd's socket", lambda: node.ctr("version").returncode == 0)
        import_layout(pause_layout(node.bins.pause), ["ctr", "--address", str(node.sock), "-n", "k8s.io"])
        api.create(
            "/api/v1/namespaces/kube-system/services",
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": "kube-dns",
                    "namespace": "kube-system",
                    "labels": {"k8s-app": "kube-dns"},
                },
                "spec": {
                    "clusterIP": DNS_SERVICE_IP,
                    "ports": [
                        {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                        {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53},
                    ],
                },
            },
        )
        api.create(
            "/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices",
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": "kube-dns-node",
                    "namespace": "kube-system",
                    "labels": {
                        "kubernetes.io/service-name": "kube-dns",
                        "endpointslice.kubernetes.io/managed-by": "rlkube-devcluster",
                    },
                },
                "addressType": "IPv4",
                "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}}],
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                ],
            },
        )
        self._spawn("kubelet", node.bins.kubelet, node.kubelet_args(), [ports["kubelet-healthz"]], state,
                    pass_fds=fds)  # fmt: skip
        self._spawn("kube-proxy", node.bins.kube_proxy, node.kube_proxy_args(),
                    [ports["kube-proxy-healthz"], ports["kube-proxy-metrics"]], state,
                    pass_fds=fds)  # fmt: skip
        self._spawn("coredns", node.bins.coredns, node.coredns_args(),
                    [ports["coredns-health"], ports["coredns-ready"]], state, pass_fds=fds)  # fmt: skip
        self._wait(deadline, f"real node {NODE_NAME} Ready", lambda: self._node_ready(api, NODE_NAME))
        for what, url in {
            "kube-proxy /healthz": f"http://127.0.0.1:{ports['kube-proxy-healthz']}/healthz",
            "coredns /ready": f"http://127.0.0.1:{ports['coredns-ready']}/ready",
        }.items():
            self._wait(deadline, what, functools.partial(_http_ok, url))

    @staticmethod
    def _node_ready(api: KubeApi, name: str) -> bool:
        node = api.get(f"/api/v1/nodes/{name}")
        conds = {c["type"]: c["status"] for c in (node.get("status") or {}).get("conditions") or []}
        return conds.get("Ready") == "True"

    def _make_credentials(self, token: str, node_tokens: dict[str, str] | None = None) -> None:
        """One RSA key signs and verifies service-account tokens; a static token is the admin.

        With a real node: static tokens for the kubelet (`system:node:<name>`, so the Node
        authorizer and NodeRestriction apply) and kube-proxy (`system:kube-proxy`, bound to
        system:node-proxier by default), and a small CA whose client certificate the API server
        presents to the kubelet (the kubelet accepts no anonymous requests).
        """
        certs = self.state_dir / "certs"
        key, pub = certs / "sa.key", certs / "sa.pub"
        argvs = [
            ["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key)],
            ["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(pub)],
        ]
        if node_tokens:
            c = str(certs)
            argvs += [
                ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30",
                 "-subj", "/CN=rlkube-devcluster-node-ca",
                 "-keyout", f"{c}/node-ca.key", "-out", f"{c}/node-ca.crt"],
                ["openssl", "req", "-newkey", "rsa:2048", "-nodes",
                 "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client",
                 "-keyout", f"{c}/kubelet-client.key", "-out", f"{c}/kubelet-client.csr"],
                ["openssl", "x509", "-req", "-in", f"{c}/kubelet-client.csr", "-CA", f"{c}/node-ca.crt",
                 "-CAkey", f"{c}/node-ca.key", "-CAcreateserial", "-days", "30",
                 "-out", f"{c}/kubelet-client.crt"],
            ]  # fmt: skip
        for argv in argvs:
            try:
                subprocess.run(argv, check=True, capture_output=True, timeout=30)
            except FileNotFoundError as err:
                raise DevClusterError("openssl is needed to make the service-account key") from err
            except subprocess.CalledProcessError as err:
                raise DevClusterError(f"{' '.join(argv)} failed: {err.stderr.decode()}") from err
        tokens = certs / "tokens.csv"
        lines = [f'{token},admin,admin,"system:masters"']
        if node_tokens:
            lines.append(f'{node_tokens["kubelet"]},system:node:{NODE_NAME},kubelet,"system:nodes"')
            lines.append(f"{node_tokens['kube-proxy']},system:kube-proxy,kube-proxy,")
        tokens.write_text("\n".join(lines) + "\n")
        for path in (key, tokens):
            path.chmod(0o600)

    def _write_kubeconfig(self, server: str, token: str, ca_pem: str) -> None:
        config = bearer_kubeconfig(server, token, ca_pem, "admin")
        tmp = self.kubeconfig.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        tmp.chmod(0o600)
        tmp.replace(self.kubeconfig)

    @staticmethod
    def _load_crds(bins: Binaries) -> list[dict[str, Any]]:
        """The KubeRay CRDs as dicts; parsed once from YAML (1 s/MB) then kept as JSON in the cache."""
        docs: list[dict[str, Any]] = []
        for path in sorted(bins.kuberay_crds.glob("ray.io_*.yaml")):
            cached = path.with_suffix(".json")
            if not cached.exists() or cached.stat().st_mtime < path.stat().st_mtime:
                loaded = [d for d in yaml.load_all(path.read_text(), Loader=_YamlLoader) if d]
                tmp = cached.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(loaded))
                tmp.replace(cached)
            docs.extend(
                d for d in json.loads(cached.read_text()) if d.get("kind") == "CustomResourceDefinition"
            )
        if not docs:
            raise DevClusterError(f"no CRDs found in {bins.kuberay_crds}")
        return docs

    @staticmethod
    def _crds_established(api: KubeApi, names: list[str]) -> bool:
        for name in names:
            crd = api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            conds = {c["type"]: c["status"] for c in (crd.get("status") or {}).get("conditions") or []}
            if conds.get("Established") != "True":
                return False
        return True

    @staticmethod
    def _ready_nodes(api: KubeApi) -> int:
        nodes = api.get("/api/v1/nodes", labelSelector=f"{MANAGED_LABEL}=true")
        ready = 0
        for node in nodes["items"]:
            conds = {c["type"]: c["status"] for c in (node.get("status") or {}).get("conditions") or []}
            ready += conds.get("Ready") == "True"
        return ready

    @staticmethod
    def _exists(api: KubeApi, path: str) -> bool:
        try:
            api.get(path)
            return True
        except ApiError as err:
            if err.status == 404:
                return False
            raise

    def _spawn(
        self,
        name: str,
        binary: Path,
        args: list[str],
        ports: list[int],
        state: dict[str, Any],
        env: dict[str, str] | None = None,
        wrapper: list[str] | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        """Start one component in its own process group and record it before anything else runs.

        `wrapper` runs first and must exec the binary (so the recorded pid is the component's);
        `pass_fds` are inherited (the real node's machine-wide lock).
        """
        log = self.logs_dir / f"{name}.log"
        argv = [*(wrapper or []), str(binary), *args, *self.config.extra_args.get(name, [])]
        child_env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        child_env.update(env or {})
        with log.open("ab") as out:
            out.write(f"# {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
                cwd=self.state_dir,
                pass_fds=pass_fds,
            )
        self._procs[proc.pid] = proc
        comp = Component(name=name, pid=proc.pid, binary=str(binary), log=str(log), ports=ports)
        self._components.append(comp)
        state["components"].append(asdict(comp))
        self._write_state(state)

    def _check_crashes(self) -> None:
        for comp in self._components:
            proc = self._procs.get(comp.pid)
            if proc is not None and proc.poll() is not None:
                raise DevClusterError(
                    f"{comp.name} exited with status {proc.returncode} during start; "
                    f"last lines of {comp.log}:\n{_tail(Path(comp.log))}"
                )

    def _wait(self, deadline: float, what: str, ready: Callable[[], bool]) -> None:
        """Poll `ready` until true; raise with log tails on a crash or at the deadline."""
        last_err: Exception | None = None
        while True:
            self._check_crashes()
            try:
                if ready():
                    return
            except (ApiError, OSError, KeyError) as err:
                last_err = err
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {c.name} ({c.log}):\n{_tail(Path(c.log), 15)}" for c in self._components
                )
                raise DevClusterError(
                    f"timed out after {self.config.timeout_s:.0f} s waiting for {what}"
                    + (f" (last error: {last_err})" if last_err else "")
                    + f"\n{tails}"
                )
            time.sleep(0.2)

    # ---------------------------------------------------------------- down

    def down(self) -> list[str]:
        """Stop every recorded process, assert their ports are closed, remove the state (logs stay).

        Returns the names of the components that were still running.
        """
        with self.lock():
            stopped = self._stop_recorded()
            return stopped

    def _stop_recorded(self) -> list[str]:
        state = self.read_state()
        comps = [Component(**c) for c in state["components"]] if state else []
        node_state = (state or {}).get("real_node") or {}
        # The node is this cluster's to tear down unless another cluster holds it now: this one's
        # processes died (a killed session) and a later `up` took the free node over.
        holder = holder_state_dir() if node_state.get("enabled") else None
        node_ours = bool(node_state.get("enabled")) and holder in (None, self.state_dir)
        held = self._held_sockets(comps)
        if node_ours:
            # The kubelet first (it would restart containers), then every container while
            # containerd still runs, then the processes, then what the node left on the host.
            self._terminate([c for c in comps if c.name == "kubelet"])
            RealNode.stop_containers()
        stopped = self._terminate(comps)
        if node_ours:
            RealNode.teardown(node_state.get("sysctls") or {})
        # A process counts as stopped once its main thread is a zombie, but its other threads can
        # still hold its sockets while the kernel tears it down: seconds for the API server on a
        # loaded 2-core machine (one CI run timed out at 5 s here). A socket of ours still open
        # after 30 s is a process that did not stop. The port alone says nothing: once released,
        # any other process's `bind(0)` may take it (Ray's, in one CI run).
        deadline = time.monotonic() + 30
        while (still := held & listening_sockets([port for port, _ in held])) and time.monotonic() < deadline:
            time.sleep(0.1)
        if still:
            ports = sorted({port for port, _ in still})
            raise DevClusterError(f"ports {ports} still listen after stopping {self.state_dir}")
        self._wipe(keep_logs=True)
        return stopped

    @staticmethod
    def _held_sockets(comps: list[Component]) -> set[tuple[int, int]]:
        """The listening sockets on the recorded ports that the live components hold themselves.

        Only processes that still run: a dead cluster's ports may be another's now."""
        live = [c for c in comps if _pid_runs(c.pid, c.binary)]
        listening = listening_sockets([p for c in live for p in c.ports])  # one read of the tables
        held: set[tuple[int, int]] = set()
        for comp in live:
            own = _sockets_of(comp.pid)
            held |= {(p, ino) for p, ino in listening if p in comp.ports and (own is None or ino in own)}
        return held

    def _stop_started(self) -> None:
        """Best-effort cleanup after a failed start (keeps the logs for the error message)."""
        with contextlib.suppress(DevClusterError):
            if self._node is not None:
                self._terminate([c for c in self._components if c.name == "kubelet"], grace_s=2.0)
                RealNode.stop_containers()
            self._terminate(list(self._components), grace_s=2.0)
        if self._node is not None:
            RealNode.teardown(self._node_sysctls or {})
            self._node.release()
            self._node = None
        self._wipe(keep_logs=True)

    def _terminate(self, comps: list[Component], grace_s: float = 8.0) -> list[str]:
        """Stop live process groups newest first (clients before the API server before etcd, so none
        hangs on a dependency that is already gone): SIGTERM, then SIGKILL after `grace_s`."""
        for proc in self._procs.values():
            proc.poll()  # reap children that already died, so they are not mistaken for live ones
        live = [c for c in reversed(comps) if _pid_runs(c.pid, c.binary)]
        for comp in live:
            for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(comp.pid, sig)
                deadline = time.monotonic() + wait_s
                while self._running(comp) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not self._running(comp):
                    break
            else:
                raise DevClusterError(f"could not stop {comp.name} (pid {comp.pid})")
        self._procs.clear()
        self._components.clear()
        return [c.name for c in live]

    def _running(self, comp: Component) -> bool:
        proc = self._procs.get(comp.pid)
        if proc is not None:  # our own child: reap it so it does not linger as a zombie
            return proc.poll() is None
        return _pid_alive(comp.pid)

    def _wipe(self, keep_logs: bool) -> None:
        if not self.state_dir.exists():
            return
        for entry in self.state_dir.iterdir():
            if entry.name == ".lock" or (keep_logs and entry.name == "logs"):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    # ------------------------------------------------------------- sharing

    def attach(self, user: str) -> bool:
        """Use the cluster from a test session: start it unless healthy; True if this call started it.

        Every attached user leaves a file in `<state>/users/`; `detach` stops a cluster only when it
        was started for tests (not by `rlkube-devcluster up`) and no other live user remains.
        """
        with self.lock():
            started = not self.healthy()
            if not started:
                state = self.read_state()
                assert state is not None
                self._check_shape(state)
            if started:
                self._stop_recorded()
                try:
                    self._start("pytest")
                except BaseException:
                    self._stop_started()
                    raise
            users = self.state_dir / "users"
            users.mkdir(exist_ok=True)
            (users / user).write_text(str(os.getpid()))
            return started

    def detach(self, user: str) -> bool:
        """Drop `user`; returns True if this was the last user of a test-started cluster and it stopped."""
        with self.lock():
            users = self.state_dir / "users"
            (users / user).unlink(missing_ok=True)
            others = []
            if users.is_dir():
                for f in users.iterdir():
                    try:
                        alive = _pid_alive(int(f.read_text()))
                    except (OSError, ValueError):
                        alive = False
                    if alive:
                        others.append(f.name)
                    else:
                        f.unlink(missing_ok=True)
            state = self.read_state()
            if state is None or state.get("owner") != "pytest" or others:
                return False
            self._stop_recorded()
            return True
