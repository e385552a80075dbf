"""Start, check and stop a real local Kubernetes control plane with fake AMD GPU nodes.

Real: etcd, kube-apiserver (TLS, RBAC, token auth), kube-controller-manager, kube-scheduler, the
KubeRay operator and its CRD schemas. Simulated: the nodes (kwok marks them Ready and bound pods
Running; no container ever runs). Every process runs in its own process group on free 127.0.0.1
ports, logs to `<state>/logs/<component>.log`, and is recorded in `<state>/state.json` so that
`down` stops exactly what `up` started, even from another process.
"""

from __future__ import annotations

import base64
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
from .kubeapi import ApiError, KubeApi
from .nodes import KWOK_ANNOTATION, MANAGED_LABEL, node_manifests

_YamlLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
STATE_VERSION = 1
LOG_TAIL_LINES = 40
# Start order; `down` stops in reverse so clients go before the API server and etcd.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "ray-operator")
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
    timeout_s: float = 120.0
    # Extra command-line flags per component (e.g. to inject a fault in a test).
    extra_args: dict[str, list[str]] = field(default_factory=dict)


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


def listening_ports(ports: list[int]) -> list[int]:
    """Which of `ports` have a listening TCP socket on this machine (read from /proc/net/tcp*)."""
    wanted = set(ports)
    found: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A":  # TCP_LISTEN
                        port = int(cols[1].rsplit(":", 1)[1], 16)
                        if port in wanted:
                            found.add(port)
        except OSError:
            continue
    return sorted(found)


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
        self.logs_dir = self.state_dir / "logs"
        self.state_file = self.state_dir / "state.json"
        self.kubeconfig = self.state_dir / "kubeconfig"
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._components: list[Component] = []
        self.timings: dict[str, float] = {}

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

    def _start(self, owner: str) -> dict[str, Any]:
        t0 = time.monotonic()
        deadline = t0 + self.config.timeout_s
        bins = find_binaries()
        self._wipe(keep_logs=False)
        for sub in ("logs", "certs", "etcd"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)

        names = [
            "etcd",
            "etcd-peer",
            "apiserver",
            "kcm",
            "scheduler",
            "kwok",
            "kuberay-metrics",
            "kuberay-probe",
        ]
        ports = dict(zip(names, _free_ports(len(names)), strict=True))
        token = secrets.token_hex(24)
        server = f"https://127.0.0.1:{ports['apiserver']}"
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
        }
        self._write_state(state)
        self._make_credentials(token)

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
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={certs}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={certs / 'sa.pub'}",
                f"--service-account-signing-key-file={certs / 'sa.key'}",
                "--authorization-mode=Node,RBAC",
                f"--token-auth-file={certs / 'tokens.csv'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--allow-privileged=true",
                # The in-cluster `kubernetes` Service would point at a loopback address no pod could use.
                "--endpoint-reconciler-type=none",
                "--profiling=false",
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
                # deleted pods go away.
                *(f"--config={p}" for p in sorted(bins.kwok_stages.glob("*.yaml"))),
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

        if self.config.kuberay:
            self._wait(deadline, "KubeRay CRDs Established", lambda: self._crds_established(api, crds))
            env = {"KUBECONFIG": kc}
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
            )

        expected = len(manifests)
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

    def _make_credentials(self, token: str) -> None:
        """One RSA key signs and verifies service-account tokens; a static token is the admin."""
        certs = self.state_dir / "certs"
        key, pub = certs / "sa.key", certs / "sa.pub"
        for argv in (
            ["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key)],
            ["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(pub)],
        ):
            try:
                subprocess.run(argv, check=True, capture_output=True, timeout=30)
            except FileNotFoundError as err:
                raise DevClusterError("openssl is needed to make the service-account key") from err
            except subprocess.CalledProcessError as err:
                raise DevClusterError(f"{' '.join(argv)} failed: {err.stderr.decode()}") from err
        tokens = certs / "tokens.csv"
        tokens.write_text(f'{token},admin,admin,"system:masters"\n')
        for path in (key, tokens):
            path.chmod(0o600)

    def _write_kubeconfig(self, server: str, token: str, ca_pem: str) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "rlkube-dev",
                    "cluster": {
                        "server": server,
                        "certificate-authority-data": base64.b64encode(ca_pem.encode()).decode(),
                    },
                }
            ],
            "users": [{"name": "admin", "user": {"token": token}}],
            "contexts": [{"name": "rlkube-dev", "context": {"cluster": "rlkube-dev", "user": "admin"}}],
            "current-context": "rlkube-dev",
        }
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
    ) -> None:
        """Start one component in its own process group and record it before anything else runs."""
        log = self.logs_dir / f"{name}.log"
        argv = [str(binary), *args, *self.config.extra_args.get(name, [])]
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
        stopped = self._terminate(comps)
        ports = [p for c in comps for p in c.ports]
        deadline = time.monotonic() + 5
        while (still := listening_ports(ports)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if still:
            raise DevClusterError(f"ports {still} still listen after stopping {self.state_dir}")
        self._wipe(keep_logs=True)
        return stopped

    def _stop_started(self) -> None:
        """Best-effort cleanup after a failed start (keeps the logs for the error message)."""
        with contextlib.suppress(DevClusterError):
            self._terminate(list(self._components), grace_s=2.0)
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
