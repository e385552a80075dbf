"""One real node beside kwok's fake ones: containerd + runc, kubelet, kube-proxy, CoreDNS, bridge CNI.

The node's resources are host-wide (the bridge, iptables, sysctls, cgroups, the kubelet's ports), so
one real node runs per machine: `/run/rlkube-real-node.lock` is held (flock) by the node's own
processes for as long as they live, and a second cluster falls back to kwok-only and says why.
`RLKUBE_REAL_NODE=0` turns the real node off, `=1` requires it (an error instead of a fallback).

Network boundaries: pods live on the bridge `rlkube0` (10.250.0.0/24, the node's address is
10.250.0.1). The API server, the kubelet and CoreDNS listen on that address only, never on eth0;
containerd's streaming server listens on loopback. Forwarding between the bridge and any other
interface is dropped, pods reach only the node address on the host, nothing is masqueraded, and
the service range is routed onto the bridge so an un-NATed service packet never leaves the machine.
`teardown` undoes every change: containers, mounts, network namespaces, the bridge, the route,
iptables rules and chains, cgroups and the sysctls the kubelet and the setup changed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .binaries import cache_dir, module_version
from .errors import DevClusterError
from .kubeapi import bearer_kubeconfig

REAL_NODE_ENV = "RLKUBE_REAL_NODE"
NODE_NAME = "real-cpu-000"
REAL_NODE_LABEL = "rlkube.io/real-node"
# Only pods that tolerate this land on the real node; everything else stays on the fake nodes.
REAL_NODE_TAINT = {"key": REAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}
BRIDGE = "rlkube0"
POD_CIDR = "10.250.0.0/24"
NODE_IP = "10.250.0.1"
SERVICE_CIDR = "10.96.0.0/16"
DNS_SERVICE_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
KUBELET_PORT = 10250
LOCK_FILE = Path("/run/rlkube-real-node.lock")
RUN_DIR = Path("/run/rlkube-node")  # containerd state + sockets, runc root, netns, CNI leases
VAR_DIR = Path("/var/lib/rlkube-node")  # kubelet root (pod volumes), wiped on teardown
SANDBOX_IMAGE = "registry.k8s.io/pause:3.10"
# Nothing listens on port 1 of loopback: containerd's registry traffic goes nowhere.
NO_PULL_PROXY = "http://127.0.0.1:1"
CNI_BIN_DIR = Path("/usr/lib/cni")
# Host programs the node needs (Debian packages: see devcluster/tools/node-packages.sh).
HOST_PROGRAMS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "ip6tables", "ip")
# Sysctls the kubelet (setupKernelTunables), kube-proxy and this module may change; restored on teardown.
SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
    "net.ipv4.conf.all.route_localnet",
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.netfilter.nf_conntrack_max",
    "net.netfilter.nf_conntrack_tcp_timeout_established",
    "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
)
IPTABLES_TABLES = ("filter", "nat", "mangle")
# Chains the kubelet, kube-proxy, the CNI plugins and this module create.
CHAIN_PREFIXES = ("KUBE-", "CNI-", "RLKUBE-")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def mode_from_env() -> str:
    """`RLKUBE_REAL_NODE`: 0/off -> "off", 1/on -> "on" (required), unset/auto -> "auto"."""
    raw = os.environ.get(REAL_NODE_ENV, "auto").strip().lower()
    if raw in ("0", "off", "false", "no"):
        return "off"
    if raw in ("1", "on", "true", "yes", "required"):
        return "on"
    if raw in ("", "auto"):
        return "auto"
    raise DevClusterError(f"{REAL_NODE_ENV}={raw!r}: use 0 (off), 1 (required) or auto")


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    kube_proxy: Path
    coredns: Path
    pause: Path


def node_binaries() -> tuple[NodeBinaries | None, list[str]]:
    """The node's programs from the build cache, or the missing paths."""
    root = cache_dir()
    version = module_version("kubernetes")
    paths = {
        "kubelet": root / f"kubernetes-node-{version}" / "bin" / "kubelet",
        "kube_proxy": root / f"kubernetes-node-{version}" / "bin" / "kube-proxy",
        "coredns": root / f"coredns-{module_version('coredns')}" / "bin" / "coredns",
        "pause": root / f"pause-{version}" / "bin" / "pause",
    }
    missing = [str(p) for p in paths.values() if not os.access(p, os.X_OK)]
    return (None if missing else NodeBinaries(**paths)), missing


def _lock_info() -> dict[str, Any] | None:
    """What the lock file records of its holder (state dir, pid); None if unreadable."""
    try:
        info = json.loads(LOCK_FILE.read_text() or "{}")
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def lock_holder() -> str:
    """Who holds the machine's real node (from the lock file), for the fallback message."""
    info = _lock_info()
    if info is None:
        return "another cluster"
    return f"the cluster in {info.get('state_dir', '?')} (pid {info.get('pid', '?')})"


def holder_state_dir() -> Path | None:
    """The state dir of the cluster whose node holds the machine-wide lock now; None if it is free."""
    try:
        with LOCK_FILE.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
            return None
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES):
            raise DevClusterError(f"cannot open {LOCK_FILE}: {err}") from err
    return Path((_lock_info() or {}).get("state_dir") or "?")


def why_not(state_dir: Path) -> str | None:
    """None if this machine can run the real node now, else one line saying why not."""
    if os.name != "posix" or os.geteuid() != 0:
        return "not root (the real node needs root for containers, the bridge and iptables)"
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError:
        filesystems = ""
    if "overlay" not in filesystems:
        return "the kernel has no overlayfs"
    if not (CGROUP_ROOT / "memory").is_dir() and not (CGROUP_ROOT / "cgroup.controllers").is_file():
        return "no memory cgroup controller"
    missing = [p for p in HOST_PROGRAMS if shutil.which(p) is None]
    if not (CNI_BIN_DIR / "bridge").is_file():
        missing.append(str(CNI_BIN_DIR / "bridge"))
    if missing:
        return f"missing {', '.join(missing)} (run `make cluster-build`, which installs the Debian packages)"
    bins, absent = node_binaries()
    if bins is None:
        return f"node programs not built: {', '.join(absent)} (run `make cluster-build`)"
    try:
        holder = holder_state_dir()
    except DevClusterError as err:
        return str(err)
    return None if holder is None else f"this machine's real node is in use by {lock_holder()}"


def _run(
    argv: list[str], check: bool = True, timeout: float = 60, **kw: Any
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise DevClusterError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def read_sysctls() -> dict[str, str]:
    """Current values of SYSCTLS (absent keys are left out)."""
    out = {}
    for key in SYSCTLS:
        with contextlib.suppress(OSError):
            out[key] = _sysctl_path(key).read_text().strip()
    return out


def _write_sysctl(key: str, value: str) -> None:
    with contextlib.suppress(OSError):
        _sysctl_path(key).write_text(value)


def iptables_chains() -> dict[str, list[str]]:
    """`{"<binary>/<table>": [chain, ...]}` for the chains this node's programs create."""
    found: dict[str, list[str]] = {}
    for binary in ("iptables", "ip6tables"):
        if shutil.which(binary) is None:
            continue
        for table in IPTABLES_TABLES:
            proc = _run([binary, "-w", "5", "-t", table, "-S"], check=False)
            chains = [
                line.split()[1]
                for line in proc.stdout.splitlines()
                if line.startswith("-N ") and line.split()[1].startswith(CHAIN_PREFIXES)
            ]
            if chains:
                found[f"{binary}/{table}"] = chains
    return found


def _remove_chains() -> None:
    """Drop every rule that jumps to one of our chains, then flush and delete the chains."""
    for binary in ("iptables", "ip6tables"):
        if shutil.which(binary) is None:
            continue
        for table in IPTABLES_TABLES:
            rules = _run([binary, "-w", "5", "-t", table, "-S"], check=False).stdout.splitlines()
            ours = [
                r.split()[1] for r in rules if r.startswith("-N ") and r.split()[1].startswith(CHAIN_PREFIXES)
            ]
            for rule in rules:
                words = shlex.split(rule)
                if words[:1] == ["-A"] and words[1] not in ours and any(w in ours for w in words[2:]):
                    _run([binary, "-w", "5", "-t", table, "-D", *words[1:]], check=False)
            for chain in ours:
                _run([binary, "-w", "5", "-t", table, "-F", chain], check=False)
            for chain in ours:
                _run([binary, "-w", "5", "-t", table, "-X", chain], check=False)


def _mounts_under(prefixes: tuple[str, ...]) -> list[str]:
    """Mount points under any of `prefixes`, deepest first."""
    points = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefixes):
                points.append(point)
    return sorted(set(points), key=lambda p: (-p.count("/"), p))


def _pids_in_cgroups(top: str) -> set[int]:
    pids: set[int] = set()
    for ctrl_dir in CGROUP_ROOT.iterdir() if CGROUP_ROOT.is_dir() else ():
        base = ctrl_dir / top
        if not base.is_dir():
            continue
        for procs in base.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(x) for x in procs.read_text().split())
    return pids


def _remove_cgroups(top: str) -> None:
    for ctrl_dir in CGROUP_ROOT.iterdir() if CGROUP_ROOT.is_dir() else ():
        base = ctrl_dir / top
        if not base.is_dir():
            continue
        dirs = sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for d in [*dirs, base]:
            with contextlib.suppress(OSError):
                d.rmdir()


def _shim_pids() -> set[int]:
    """containerd-shim processes serving this node's containerd (their argv names our socket)."""
    pids = set()
    sock = str(RUN_DIR / "containerd.sock")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and sock.encode() in argv:
                pids.add(int(proc.name))
    return pids


class RealNode:
    """Config, start arguments and teardown of the machine's one real node."""

    def __init__(self, state_dir: Path, bins: NodeBinaries) -> None:
        self.state_dir = state_dir
        self.dir = state_dir / "node"
        self.bins = bins
        self.containerd_root = cache_dir() / "containerd"  # images persist across clusters
        self.sock = RUN_DIR / "containerd.sock"
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------ claim + host setup

    def claim(self) -> int:
        """Take the machine-wide lock; the returned fd is passed to every node process."""
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            raise DevClusterError(f"this machine's real node is in use by {lock_holder()}") from err
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"state_dir": str(self.state_dir), "pid": os.getpid()}).encode())
        os.set_inheritable(fd, True)
        self._lock_fd = fd
        return fd

    def release(self) -> None:
        """Close this process's copy of the lock fd (the node processes keep theirs)."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def prepare_host(self) -> dict[str, str]:
        """Record the sysctls, clear leftovers of a crashed run, create the bridge, route and rules.

        Returns the sysctl values to restore (saved in state.json too, so a later `down` restores them).
        """
        self.clear_crashed_run()
        saved = read_sysctls()
        saved_file = RUN_DIR / "sysctls.json"
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        saved_file.write_text(json.dumps(saved))
        for sub in ("cni/net.d", "certs", "kubelet", "logs"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        # A service IP that kube-proxy has not NATed (yet) goes onto the bridge, never out of eth0.
        _run(["ip", "route", "add", SERVICE_CIDR, "dev", BRIDGE, "src", NODE_IP])
        _write_sysctl("net.ipv4.ip_forward", "1")
        _write_sysctl("net.bridge.bridge-nf-call-iptables", "1")
        ipt = ["iptables", "-w", "5"]
        _run([*ipt, "-N", "RLKUBE-ISOLATE"])
        for rule in (
            ["-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"],
            ["-i", BRIDGE, "-j", "DROP"],  # pods -> anything beyond the bridge (eth0 included)
            ["-o", BRIDGE, "-j", "DROP"],  # anything else -> pods
        ):
            _run([*ipt, "-A", "RLKUBE-ISOLATE", *rule])
        _run([*ipt, "-I", "FORWARD", "1", "-j", "RLKUBE-ISOLATE"])
        _run([*ipt, "-N", "RLKUBE-INPUT"])
        # From pods, the host answers only on the node address (API server, kubelet, DNS).
        _run([*ipt, "-A", "RLKUBE-INPUT", "-i", BRIDGE, "!", "-d", NODE_IP, "-j", "DROP"])
        _run([*ipt, "-I", "INPUT", "1", "-j", "RLKUBE-INPUT"])
        return saved

    # ------------------------------------------------------------------ config files

    def write_configs(self, certs: Path, server: str, ports: dict[str, int], tokens: dict[str, str]) -> None:
        """containerd, CNI, kubelet, kube-proxy and CoreDNS configs under `<state>/node`."""
        d = self.dir
        (d / "containerd.toml").write_text(self._containerd_toml())
        (d / "cni/net.d/10-rlkube.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": "rlkube",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            "ipMasq": False,  # never masquerade pod traffic out of the machine
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                                "dataDir": str(RUN_DIR / "cni-ipam"),
                            },
                        },
                        {"type": "loopback"},
                    ],
                },
                indent=2,
            )
        )
        ca = (certs / "apiserver.crt").read_text()
        for user, token in tokens.items():
            self._kubeconfig(d / f"{user}.kubeconfig", server, token, ca)
        (d / "kubelet.yaml").write_text(
            json.dumps(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "address": NODE_IP,
                    "port": KUBELET_PORT,
                    "readOnlyPort": 0,
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": ports["kubelet-healthz"],
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": True},
                        "x509": {"clientCAFile": str(certs / "node-ca.crt")},
                    },
                    "authorization": {"mode": "Webhook"},
                    "cgroupDriver": "cgroupfs",
                    "failCgroupV1": False,
                    "failSwapOn": False,
                    "containerRuntimeEndpoint": f"unix://{self.sock}",
                    "clusterDNS": [DNS_SERVICE_IP],
                    "clusterDomain": CLUSTER_DOMAIN,
                    "resolvConf": str(d / "pod-resolv.conf"),
                    "podCIDR": POD_CIDR,
                    "maxPods": 40,
                    "registerWithTaints": [REAL_NODE_TAINT],
                    "serializeImagePulls": False,
                    "imageGCHighThresholdPercent": 99,
                    "imageGCLowThresholdPercent": 98,
                    "evictionHard": {
                        "memory.available": "300Mi",
                        "nodefs.available": "2%",
                        "imagefs.available": "2%",
                    },
                    "enforceNodeAllocatable": ["pods"],
                    "containerLogMaxSize": "20Mi",
                    "volumeStatsAggPeriod": "1m",
                }
            )
        )
        # Pods with dnsPolicy Default get this; ClusterFirst pods get the cluster DNS. No upstream.
        (d / "pod-resolv.conf").write_text(f"nameserver {DNS_SERVICE_IP}\n")
        (d / "kube-proxy.yaml").write_text(
            json.dumps(
                {
                    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                    "kind": "KubeProxyConfiguration",
                    "clientConnection": {"kubeconfig": str(d / "kube-proxy.kubeconfig")},
                    "mode": "iptables",
                    "hostnameOverride": NODE_NAME,
                    "bindAddress": NODE_IP,
                    "healthzBindAddress": f"127.0.0.1:{ports['kube-proxy-healthz']}",
                    "metricsBindAddress": f"127.0.0.1:{ports['kube-proxy-metrics']}",
                    "clusterCIDR": POD_CIDR,
                    "nodePortAddresses": [f"{NODE_IP}/32"],
                    # 0 = leave the host's conntrack sysctls alone.
                    "conntrack": {
                        "maxPerCore": 0,
                        "min": 0,
                        "tcpEstablishedTimeout": "0s",
                        "tcpCloseWaitTimeout": "0s",
                    },
                    "iptables": {"localhostNodePorts": False, "masqueradeAll": False},
                }
            )
        )
        (d / "Corefile").write_text(
            f""".:53 {{
    bind {NODE_IP}
    errors
    health 127.0.0.1:{ports["coredns-health"]}
    ready 127.0.0.1:{ports["coredns-ready"]}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {d / "coredns.kubeconfig"}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 30
    loop
}}
"""
        )

    def _containerd_toml(self) -> str:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""version = 2
root = "{self.containerd_root}"
state = "{RUN_DIR / "containerd"}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{self.sock}"

[ttrpc]
  address = "{self.sock}.ttrpc"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{VAR_DIR / "opt"}"

[{cri}]
  sandbox_image = "{SANDBOX_IMAGE}"
  # root here lacks CAP_SYS_RESOURCE: without this every pod fails in runc (oom_score_adj EPERM)
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  netns_mounts_under_state_dir = true
  enable_selinux = false
  disable_apparmor = true
  max_container_log_line_size = 16384

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
  discard_unpacked_layers = false

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{RUN_DIR / "runc"}"

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{self.dir / "cni/net.d"}"
"""

    @staticmethod
    def _kubeconfig(path: Path, server: str, token: str, ca_pem: str) -> None:
        path.write_text(json.dumps(bearer_kubeconfig(server, token, ca_pem, path.stem)))
        path.chmod(0o600)

    # ------------------------------------------------------------------ processes

    def containerd_args(self) -> list[str]:
        return ["--config", str(self.dir / "containerd.toml"), "--log-level", "warn"]

    @staticmethod
    def containerd_env() -> dict[str, str]:
        """Every registry pull goes to a proxy that is not there, so a pull fails at once and nothing
        leaves the machine (images come from the local builder; a missing one is the pod's ErrImagePull)."""
        return {"HTTP_PROXY": NO_PULL_PROXY, "HTTPS_PROXY": NO_PULL_PROXY, "NO_PROXY": "", "no_proxy": ""}

    def kubelet_args(self) -> list[str]:
        return [
            f"--config={self.dir / 'kubelet.yaml'}",
            f"--kubeconfig={self.dir / 'kubelet.kubeconfig'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}",
            f"--root-dir={VAR_DIR / 'kubelet'}",
            f"--cert-dir={self.dir / 'kubelet'}",
            f"--node-labels={REAL_NODE_LABEL}=true,rlkube.io/node-pool=cpu,rlkube.io/devcluster=true",
            "--v=1",
        ]

    def kube_proxy_args(self) -> list[str]:
        return [f"--config={self.dir / 'kube-proxy.yaml'}", "--v=1"]

    def coredns_args(self) -> list[str]:
        return ["-conf", str(self.dir / "Corefile")]

    def ctr(self, *args: str, check: bool = False, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return _run(["ctr", "--address", str(self.sock), "-n", "k8s.io", *args], check=check, timeout=timeout)

    def import_image(self, archive: Path) -> None:
        """Import an OCI/docker archive into the node's containerd (k8s.io namespace)."""
        self.ctr("images", "import", "--no-unpack", str(archive), check=True, timeout=900)

    # ------------------------------------------------------------------ teardown

    @staticmethod
    def stop_containers() -> None:
        """Kill and delete every container task while containerd still runs (kubelet already stopped)."""
        sock = RUN_DIR / "containerd.sock"
        if not sock.exists():
            return

        def ctr(*args: str) -> subprocess.CompletedProcess[str]:
            return _run(["ctr", "--address", str(sock), "-n", "k8s.io", *args], check=False, timeout=30)

        listed = ctr("tasks", "ls", "-q")
        tasks = listed.stdout.split() if listed.returncode == 0 else []
        for task in tasks:
            ctr("tasks", "kill", "-s", "SIGKILL", task)
        deadline = time.monotonic() + 15
        for task in tasks:
            while time.monotonic() < deadline:
                if ctr("tasks", "rm", "-f", task).returncode == 0:
                    break
                time.sleep(0.3)
        listed = ctr("containers", "ls", "-q")
        for container in listed.stdout.split() if listed.returncode == 0 else []:
            ctr("containers", "rm", container)

    @staticmethod
    def clear_crashed_run() -> list[str]:
        """Remove what a node whose processes died (a killed session, a crash) left on the host.

        Only for a free node: the caller holds the lock, or has seen that no one does. The sysctls
        the dead node recorded at its start are the machine's true originals, so they are restored.
        """
        saved_file = RUN_DIR / "sysctls.json"
        try:
            saved = json.loads(saved_file.read_text()) if saved_file.is_file() else {}
        except (OSError, ValueError):
            saved = {}
        return RealNode.teardown(saved)

    @staticmethod
    def teardown(saved_sysctls: dict[str, str]) -> list[str]:
        """Remove everything the node left on the host; returns what had to be cleaned (for logs)."""
        notes: list[str] = []
        # Processes: container processes still in the kubelet's cgroups, then leftover shims.
        for _ in range(3):
            pids = _pids_in_cgroups("kubepods") | _shim_pids()
            pids.discard(os.getpid())
            if not pids:
                break
            notes.append(f"killed {len(pids)} leftover container processes")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        # Mounts: container rootfs, pod volumes, network namespaces (all under our own dirs).
        prefixes = (str(RUN_DIR), str(VAR_DIR), str(cache_dir() / "containerd"))
        for point in _mounts_under(prefixes):
            if _run(["umount", point], check=False).returncode != 0:
                _run(["umount", "-l", point], check=False)
            notes.append(f"unmounted {point}")
        _remove_cgroups("kubepods")
        # Network: our chains and the jumps to them, the service route, the bridge.
        if shutil.which("iptables"):
            _remove_chains()
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            _run(["ip", "route", "del", SERVICE_CIDR, "dev", BRIDGE], check=False)
            _run(["ip", "link", "del", BRIDGE], check=False)
            notes.append(f"deleted bridge {BRIDGE}")
        for key, value in saved_sysctls.items():
            if _sysctl_path(key).exists() and _sysctl_path(key).read_text().strip() != value:
                _write_sysctl(key, value)
                notes.append(f"restored {key}={value}")
        for path in (RUN_DIR, VAR_DIR):
            if path.exists() and not _mounts_under((str(path),)):
                shutil.rmtree(path, ignore_errors=True)
        return notes
