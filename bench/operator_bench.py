"""`make bench-operator`: 500 RLJobs on a 200-node x 8-GPU local control plane, against KubeRay's own latency.

Starts a dedicated dev cluster (separate state dir, real kube-apiserver/scheduler/controller-manager,
real KubeRay v1.5, kwok nodes), runs `rlkube-operator` as a subprocess exactly as deployed, creates the
RLJobs of mixed modes, and times everything from ONE observer (this process's watch streams), so the
operator's create -> RayJob latency and KubeRay's RayJob -> RayCluster -> pods latency are measured
the same way in the same run. API requests are counted by the operator's own instrumented client
(`rlkube_api_requests_total`, which covers Kopf's requests too: one shared session).

Writes bench/results/operator.json and bench/results/operator.png.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
NS = "bench"
MODES = ("sync", "colocate_async", "separate_async")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = max(0, min(len(v) - 1, round(p / 100 * (len(v) - 1))))
    return round(v[k], 4)


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p95": pct(values, 95),
        "p99": pct(values, 99),
        "max": round(max(values), 4) if values else None,
        "mean": round(statistics.fmean(values), 4) if values else None,
    }


def rljob_body(i: int) -> dict[str, Any]:
    """Mixed modes and sizes: 1-2 GPU trainers, separate_async adds a rollout group."""
    mode = MODES[i % 3]
    gpus = 1 + (i // 3) % 2
    spec: dict[str, Any] = {
        "image": "rlkube/runtime-rocm:0.1.0",
        "model": {"path": "/models/Qwen2.5-0.5B"},
        "data": {"train": "/data/gsm8k.parquet", "reward": "gsm8k"},
        "training": {"mode": mode, "totalSteps": 100},
        "trainer": {"replicas": 1, "gpusPerReplica": gpus},
    }
    if mode == "separate_async":
        spec["rollout"] = {"replicas": 1, "gpusPerReplica": gpus}
    return {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": f"rl-{i:04d}"},
        "spec": spec,
    }


class Observer:
    """First-seen wall times of every milestone, from watch streams (the same clock for both operators)."""

    def __init__(self, api: Any) -> None:
        self.api = api
        self.lock = threading.Lock()
        self.rljob_added: dict[str, float] = {}
        self.cluster_ready: dict[str, float] = {}
        self.rayjob_added: dict[str, float] = {}
        self.raycluster_added: dict[str, float] = {}  # by RayJob name
        self.cluster_of: dict[str, str] = {}  # RayCluster -> RayJob
        self.expected_pods: dict[str, int] = {}  # RayCluster -> head + workers
        self.running: dict[str, set[str]] = {}
        self.pods_running: dict[str, float] = {}  # by RayJob name
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        from kubernetes import client

        co = client.CustomObjectsApi(self.api)
        core = client.CoreV1Api(self.api)
        streams = [
            (
                "rljobs",
                lambda **kw: co.list_namespaced_custom_object("rlkube.io", "v1alpha1", NS, "rljobs", **kw),
                self._rljob,
            ),
            (
                "rayjobs",
                lambda **kw: co.list_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", **kw),
                self._rayjob,
            ),
            (
                "rayclusters",
                lambda **kw: co.list_namespaced_custom_object("ray.io", "v1", NS, "rayclusters", **kw),
                self._raycluster,
            ),
            (
                "pods",
                lambda **kw: core.list_namespaced_pod(NS, label_selector="ray.io/cluster", **kw),
                self._pod,
            ),
        ]
        for name, fn, handler in streams:
            t = threading.Thread(target=self._run, args=(fn, handler), name=f"watch-{name}", daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self, fn: Any, handler: Any) -> None:
        from kubernetes import watch

        rv = None
        while not self.stop.is_set():
            try:
                w = watch.Watch()
                kw: dict[str, Any] = {"timeout_seconds": 60, "allow_watch_bookmarks": False}
                if rv:
                    kw["resource_version"] = rv
                for ev in w.stream(fn, **kw):
                    obj = ev["object"]
                    obj = obj if isinstance(obj, dict) else self.api.sanitize_for_serialization(obj)
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    handler(ev["type"], obj, time.time())
                    if self.stop.is_set():
                        return
            except Exception:
                rv = None
                time.sleep(0.5)

    def _rljob(self, kind: str, obj: dict[str, Any], now: float) -> None:
        name = obj["metadata"]["name"]
        with self.lock:
            self.rljob_added.setdefault(name, now)
            for c in (obj.get("status") or {}).get("conditions") or ():
                if c.get("type") == "ClusterReady" and c.get("status") == "True":
                    self.cluster_ready.setdefault(name, now)

    def _rayjob(self, kind: str, obj: dict[str, Any], now: float) -> None:
        with self.lock:
            self.rayjob_added.setdefault(obj["metadata"]["name"], now)

    def _raycluster(self, kind: str, obj: dict[str, Any], now: float) -> None:
        meta = obj["metadata"]
        owner = next(
            (r["name"] for r in meta.get("ownerReferences") or () if r.get("kind") == "RayJob"), None
        )
        if owner is None:
            return
        workers = sum(int(g.get("replicas", 0)) for g in obj["spec"].get("workerGroupSpecs") or ())
        with self.lock:
            self.raycluster_added.setdefault(owner, now)
            self.cluster_of[meta["name"]] = owner
            self.expected_pods[meta["name"]] = 1 + workers

    def _pod(self, kind: str, obj: dict[str, Any], now: float) -> None:
        meta = obj["metadata"]
        cluster = (meta.get("labels") or {}).get("ray.io/cluster")
        if not cluster or kind == "DELETED":
            return
        if (obj.get("status") or {}).get("phase") != "Running":
            return
        with self.lock:
            seen = self.running.setdefault(cluster, set())
            seen.add(meta["name"])
            owner = self.cluster_of.get(cluster)
            if owner and len(seen) >= self.expected_pods.get(cluster, 1 << 30):
                self.pods_running.setdefault(owner, now)


def proc_stats(pid: int) -> tuple[float, float]:
    """(peak RSS MB = VmHWM, CPU seconds user+system) of a live process."""
    hwm = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    return hwm, cpu


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("rlkube_") and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def api_requests(m: dict[str, float]) -> dict[str, float]:
    """rlkube_api_requests_total by verb (WATCH counted separately: long-lived streams, not per job)."""
    by: dict[str, float] = {}
    for k, v in m.items():
        if k.startswith("rlkube_api_requests_total{"):
            verb = k.split('verb="', 1)[1].split('"', 1)[0]
            res = k.split('resource="', 1)[1].split('"', 1)[0]
            by[f"{verb} {res}"] = by.get(f"{verb} {res}", 0) + v
    return by


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for every ClusterReady")
    ap.add_argument("--state-dir", type=Path, default=REPO / "bench" / "results" / "tmp" / "devcluster")
    ap.add_argument("--keep", action="store_true", help="leave the cluster running")
    args = ap.parse_args()

    from kubernetes import client, config

    from rlkube.devcluster.cluster import ClusterConfig, DevCluster

    t_up = time.monotonic()
    cluster = DevCluster(
        args.state_dir,
        ClusterConfig(
            gpu_nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            cpu_nodes=4,
            timeout_s=600,
            real_node="off",
        ),
    )
    cluster.up(owner="bench")
    print(
        f"[bench] {args.nodes} x {args.gpus_per_node} GPU nodes up in {time.monotonic() - t_up:.1f} s",
        flush=True,
    )
    kubeconfig = cluster.kubeconfig
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    kubectl = ["kubectl", f"--kubeconfig={kubeconfig}"]
    subprocess.run(
        [*kubectl, "apply", "--server-side", "-f", str(REPO / "crds" / "rljobs.rlkube.io.yaml")],
        check=True,
        env=env,
        capture_output=True,
    )
    from rlkube.devcluster.testing import Kubectl

    Kubectl(kubeconfig).wait_established("rljobs.rlkube.io")  # not `kubectl wait`: see its docstring
    subprocess.run([*kubectl, "create", "namespace", NS], env=env, capture_output=True)

    api = config.new_client_from_config(config_file=str(kubeconfig))
    api.configuration.connection_pool_maxsize = 16
    co = client.CustomObjectsApi(api)

    mport, lport = free_port(), free_port()
    log_path = RESULTS / "tmp" / "operator-bench.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    op = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "rlkube-operator"),
            f"--namespace={NS}",
            "--standalone",
            f"--metrics-port={mport}",
            "--metrics-addr=127.0.0.1",
            f"--liveness=http://127.0.0.1:{lport}/healthz",
            "--log-format=json",
        ],
        env={**env, "KUBECONFIG": str(kubeconfig), "PYTHONSAFEPATH": "1"},
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{lport}/healthz", timeout=2)
            break
        except OSError:
            if op.poll() is not None or time.monotonic() > deadline:
                print(log_path.read_text()[-3000:])
                return 1
            time.sleep(0.3)

    obs = Observer(api)
    obs.start()
    time.sleep(2)
    before = scrape(mport)
    _, cpu_before = proc_stats(op.pid)
    peak_rss = 0.0
    stop_sampling = threading.Event()

    def sample() -> None:
        nonlocal peak_rss
        while not stop_sampling.is_set():
            try:
                peak_rss = max(peak_rss, proc_stats(op.pid)[0])
            except OSError:
                return
            time.sleep(1)

    threading.Thread(target=sample, daemon=True).start()

    print(f"[bench] creating {args.jobs} RLJobs", flush=True)
    posted: dict[str, float] = {}
    t0 = time.time()

    def create(i: int) -> None:
        body = rljob_body(i)
        co.create_namespaced_custom_object("rlkube.io", "v1alpha1", NS, "rljobs", body)
        posted[body["metadata"]["name"]] = time.time()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, range(args.jobs)))
    t_created = time.time()
    print(f"[bench] created in {t_created - t0:.1f} s; waiting for ClusterReady", flush=True)

    end = time.monotonic() + args.timeout
    last = -1
    while time.monotonic() < end:
        with obs.lock:
            n_ready, n_rj, n_pods = len(obs.cluster_ready), len(obs.rayjob_added), len(obs.pods_running)
        if n_ready != last:
            print(
                f"[bench] t={time.time() - t0:6.1f}s rayjobs={n_rj} pods={n_pods} cluster-ready={n_ready}",
                flush=True,
            )
            last = n_ready
        if n_ready >= args.jobs and n_pods >= args.jobs:
            break
        time.sleep(3)
    time.sleep(3)  # let trailing status patches land before reading counters
    after = scrape(mport)
    peak_rss = max(peak_rss, proc_stats(op.pid)[0])
    _, cpu_after = proc_stats(op.pid)
    stop_sampling.set()
    obs.stop.set()

    names = [rljob_body(i)["metadata"]["name"] for i in range(args.jobs)]
    with obs.lock:
        create_to_rayjob = [
            obs.rayjob_added[n] - obs.rljob_added[n]
            for n in names
            if n in obs.rayjob_added and n in obs.rljob_added
        ]
        create_to_ready = [
            obs.cluster_ready[n] - obs.rljob_added[n]
            for n in names
            if n in obs.cluster_ready and n in obs.rljob_added
        ]
        post_to_rayjob = [
            obs.rayjob_added[n] - posted[n] for n in names if n in obs.rayjob_added and n in posted
        ]
        rayjob_to_cluster = [
            obs.raycluster_added[n] - obs.rayjob_added[n]
            for n in names
            if n in obs.raycluster_added and n in obs.rayjob_added
        ]
        cluster_to_pods = [
            obs.pods_running[n] - obs.raycluster_added[n]
            for n in names
            if n in obs.pods_running and n in obs.raycluster_added
        ]
        rayjob_to_pods = [
            obs.pods_running[n] - obs.rayjob_added[n]
            for n in names
            if n in obs.pods_running and n in obs.rayjob_added
        ]
        pods_to_ready = [
            obs.cluster_ready[n] - obs.pods_running[n]
            for n in names
            if n in obs.cluster_ready and n in obs.pods_running
        ]
        first_added = min(obs.rljob_added.values()) if obs.rljob_added else t0
        last_rayjob = max(obs.rayjob_added.values()) if obs.rayjob_added else t0
        last_ready = max(obs.cluster_ready.values()) if obs.cluster_ready else t0

    reqs_before, reqs_after = api_requests(before), api_requests(after)
    delta = {k: reqs_after.get(k, 0) - reqs_before.get(k, 0) for k in reqs_after}
    delta = {k: v for k, v in sorted(delta.items()) if v}
    non_watch = sum(v for k, v in delta.items() if not k.startswith("WATCH"))
    errors = sum(v for k, v in after.items() if k.startswith("rlkube_reconcile_errors_total"))
    spec_reconciles = after.get('rlkube_reconcile_total{kind="spec"}', 0) - before.get(
        'rlkube_reconcile_total{kind="spec"}', 0
    )
    status_reconciles = after.get('rlkube_reconcile_total{kind="status"}', 0) - before.get(
        'rlkube_reconcile_total{kind="status"}', 0
    )

    result: dict[str, Any] = {
        "setup": {
            "rljobs": args.jobs,
            "modes": {m: sum(1 for i in range(args.jobs) if MODES[i % 3] == m) for m in MODES},
            "fake_gpu_nodes": args.nodes,
            "gpus_per_node": args.gpus_per_node,
            "control_plane": "kube-apiserver/scheduler/kcm v1.36.3, etcd 3.6, kwok 0.8, KubeRay 1.5.0",
            "machine_cpus": os.cpu_count(),
            "observer": "watch streams of this process (same clock for operator and KubeRay milestones)",
        },
        "create_to_rayjob_s": summary(create_to_rayjob),
        "post_return_to_rayjob_s": summary(post_to_rayjob),
        "create_to_cluster_ready_s": summary(create_to_ready),
        "kuberay_rayjob_to_raycluster_s": summary(rayjob_to_cluster),
        "kuberay_raycluster_to_pods_running_s": summary(cluster_to_pods),
        "kuberay_rayjob_to_pods_running_s": summary(rayjob_to_pods),
        "pods_running_to_rljob_cluster_ready_s": summary(pods_to_ready),
        "rljobs_reconciled_per_s": round(len(create_to_rayjob) / max(1e-9, last_rayjob - first_added), 2),
        "rljobs_cluster_ready_per_s": round(len(create_to_ready) / max(1e-9, last_ready - first_added), 2),
        "create_wall_s": round(t_created - t0, 2),
        "operator_peak_rss_mb": round(peak_rss, 1),
        "operator_cpu_s": round(cpu_after - cpu_before, 2),
        "api_requests_per_rljob": round(non_watch / max(1, args.jobs), 2),
        "api_requests_by_verb_resource": delta,
        "reconciles": {"spec": spec_reconciles, "status": status_reconciles},
        "reconcile_errors": errors,
    }
    p99_op = result["create_to_rayjob_s"]["p99"]
    p99_kr = result["kuberay_rayjob_to_raycluster_s"]["p99"]
    result["targets"] = {
        "create_to_rayjob_p99_le_kuberay_rayjob_to_raycluster_p99": bool(
            p99_op is not None and p99_kr is not None and p99_op <= p99_kr
        ),
        "ratio_create_to_rayjob_p99_over_kuberay_p99": round(p99_op / p99_kr, 3)
        if p99_op and p99_kr
        else None,
        "peak_rss_under_200mb": peak_rss < 200,
        "zero_reconcile_errors": errors == 0,
        "all_cluster_ready": len(create_to_ready) == args.jobs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "operator.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    plot(
        {
            "create -> RayJob (rlkube)": create_to_rayjob,
            "create -> ClusterReady on RLJob (rlkube)": create_to_ready,
            "RayJob -> RayCluster (KubeRay)": rayjob_to_cluster,
            "RayJob -> pods Running (KubeRay+scheduler+kwok)": rayjob_to_pods,
        },
        RESULTS / "operator.png",
        args.jobs,
    )

    op.send_signal(signal.SIGTERM)
    try:
        op.wait(20)
    except subprocess.TimeoutExpired:
        op.kill()
    if not args.keep:
        cluster.down()
    return 0 if all(result["targets"].values()) else 2


def plot(series: dict[str, list[float]], path: Path, jobs: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, values in series.items():
        if not values:
            continue
        v = sorted(values)
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=f"{label} (p99 {pct(v, 99):.2f}s)")
    ax.set_xscale("log")
    ax.set_xlabel("seconds (log)")
    ax.set_ylabel("fraction of RLJobs")
    ax.set_title(f"rlkube operator vs KubeRay, {jobs} RLJobs, same run (CDF)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
