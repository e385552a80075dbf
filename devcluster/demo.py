"""`make demo`: the README's main job in real pods on a machine with no GPU and no Docker.

It starts (or reuses) the local cluster with its real CPU node, builds the runtime and operator
images from the project's Dockerfiles (cached) into the node's containerd, installs the operator
with `helm install charts/rlkube` (a pod with the chart's ServiceAccount and RBAC), prepares the
tiny arithmetic task on the node, and applies `examples/tiny-arith.yaml`. From there nothing is
played by the demo: KubeRay starts Ray in the head and worker pods, its submitter pod runs
`ray job submit`, `rlkube-train` trains on the Ray head and pushes `status.progress` with the job's
own ServiceAccount token, and the operator turns KubeRay's outcome into the RLJob's phase. The demo
watches `kubectl get rljobs` and prints where the results are (written by the pod onto the node).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .binaries import REPO_ROOT, cache_dir, module_version
from .cluster import ClusterConfig, DevCluster, default_state_dir
from .errors import DevClusterError
from .images import IMAGES, Builder, build_image, import_layout
from .node import REAL_NODE_LABEL, RUN_DIR
from .testing import Kubectl, KubectlError

T = TypeVar("T")
DEFAULT_EXAMPLE = REPO_ROOT / "examples" / "tiny-arith.yaml"
DEFAULT_NAMESPACE = "rlkube-demo"
CHART = REPO_ROOT / "charts" / "rlkube"
OPERATOR_NAMESPACE = "rlkube-system"
LOG_TAIL_LINES = 40


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and what was seen."""


_T0 = time.monotonic()


def say(msg: str) -> None:
    """One plain-words progress line, with the seconds since the demo started."""
    print(f"[demo {time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"(no log: {err})"


def _poll(fn: Callable[[], T | None], timeout: float, what: str, interval: float = 1.0) -> T:
    """Poll `fn` until truthy; a timeout raises DemoError naming `what` and the last error seen."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            result = fn()
            if result:
                return result
        except Exception as exc:  # not created yet, a transient API error: keep polling
            last = exc
        if time.monotonic() > deadline:
            extra = f" (last error: {last})" if last else ""
            raise DemoError(f"timed out after {timeout:.0f} s waiting for {what}{extra}")
        time.sleep(interval)


# ------------------------------------------------------------------------------------- the tiny task


def prepare_task(example: dict[str, Any]) -> float | None:
    """Create the warm-started tiny model and the arith data where the example RLJob expects them.

    `prepare_tiny_task` writes `model/`, `train.jsonl`, `heldout.jsonl` into one folder; the example
    names its own paths, so those are linked to what was made. Returns the warm-start accuracy.
    """
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no tqdm bars in the demo's story
    from transformers.utils import logging as hf_logging

    from rlkube.devcluster.tiny_task import prepare_tiny_task

    hf_logging.disable_progress_bar()
    spec = example["spec"]
    model_path = Path(spec["model"]["path"])
    task = prepare_tiny_task(model_path.parent)
    links = {
        model_path: task.model_dir,
        Path(spec["data"]["train"]): task.train_path,
        Path(spec["data"]["validation"]): task.heldout_path,
    }
    for want, made in links.items():
        if want.resolve() == made.resolve():
            continue
        if want.is_symlink() or want.is_file():
            want.unlink()
        elif want.is_dir():
            shutil.rmtree(want)
        want.parent.mkdir(parents=True, exist_ok=True)
        want.symlink_to(made.resolve(), target_is_directory=made.is_dir())
    return float(task.warm_accuracy)


# --------------------------------------------------------------------------------------- kubernetes


def helm_binary() -> Path:
    path = cache_dir() / f"helm-{module_version('helm')}" / "bin" / "helm"
    if not os.access(path, os.X_OK):
        raise DemoError(f"{path} missing: run `make cluster-build`")
    return path


def operator_values() -> dict[str, Any]:
    """Chart values for the devcluster: the locally built images, and the real node for the operator,
    the Ray heads and KubeRay's submitters (its taint keeps every other pod on the fake nodes)."""
    toleration = {"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
    runtime = IMAGES["runtime-cpu"].name
    repo, tag = IMAGES["operator"].name.rsplit(":", 1)
    return {
        "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
        "nodeSelector": {REAL_NODE_LABEL: "true"},
        "tolerations": [toleration],
        "resources": {
            "requests": {"cpu": "50m", "memory": "128Mi"},
            "limits": {"cpu": "1", "memory": "512Mi"},
        },
        "runtimeDefaults": {
            "vendorImages": {"cpu": runtime},
            "imagePullPolicy": "IfNotPresent",
            "headNodeSelector": {REAL_NODE_LABEL: "true"},
            "headTolerations": [toleration],
            # Two real cores: requests at a quarter of the limits so head, worker, submitter and
            # operator fit; Ray still sees each pod's full CPU limit.
            "cpuRequestPercent": 25,
        },
    }


def install_operator(kubectl: Kubectl, namespace: str = OPERATOR_NAMESPACE) -> str:
    """`helm upgrade --install` of charts/rlkube; returns the operator pod's name once it is Ready."""
    values = Path(kubectl.kubeconfig).parent / "rlkube-values.yaml"
    values.write_text(yaml.safe_dump(operator_values()))
    argv = [
        str(helm_binary()), "upgrade", "--install", "rlkube", str(CHART), "--namespace", namespace,
        "--create-namespace", "--values", str(values), "--kubeconfig", str(kubectl.kubeconfig), "--wait",
        "--timeout", "5m",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        raise DemoError(f"helm install failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    pods = kubectl.json("-n", namespace, "get", "pods", "-l", "app.kubernetes.io/name=rlkube")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return str(live[0]["metadata"]["name"]) if live else "?"


def load_images(cluster: DevCluster) -> list[str]:
    """Build (cached) and import the runtime and operator images into the real node's containerd."""
    builder = Builder()
    loaded = []
    for which in ("runtime-cpu", "operator"):
        t0 = time.monotonic()
        layout, _ = build_image(which, builder)
        built = time.monotonic() - t0
        t1 = time.monotonic()
        fresh = import_layout(layout, ["ctr", "--address", str(RUN_DIR / "containerd.sock"), "-n", "k8s.io"])
        loaded.append(
            f"{IMAGES[which].name}: built in {built:.0f} s, "
            + (f"imported in {time.monotonic() - t1:.0f} s" if fresh else "already in the node's containerd")
        )
    say(f"    layers built {len(builder.built)}, reused {len(builder.reused)}")
    return loaded


def _pods_running(kubectl: Kubectl, ns: str, cluster: str) -> list[str] | None:
    pods = kubectl.json("-n", ns, "get", "pods", "-l", f"ray.io/cluster={cluster}")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    if not live or any(p["status"].get("phase") != "Running" for p in live):
        return None
    return [f"{p['metadata']['name']} on {p['spec'].get('nodeName')}" for p in live]


def _phase(kubectl: Kubectl, ns: str, name: str) -> dict[str, Any]:
    """The RLJob's status (phase, conditions, progress, child names)."""
    return dict(kubectl.json("-n", ns, "get", "rljob", name).get("status") or {})


def _phase_if(kubectl: Kubectl, ns: str, name: str, phase: str) -> dict[str, Any] | None:
    st = _phase(kubectl, ns, name)
    return st if st.get("phase") == phase else None


def _exists(kubectl: Kubectl, ns: str, kind: str, name: str) -> bool:
    return bool(kubectl("-n", ns, "get", kind, name, "--ignore-not-found", "-o", "name").stdout.strip())


def _crd_established(kubectl: Kubectl) -> bool:
    conds = (kubectl.json("get", "crd", "rljobs.rlkube.io").get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conds)


class RowPrinter:
    """Prints `kubectl get rljobs` with the header once, then only the rows."""

    def __init__(self, kubectl: Kubectl, ns: str) -> None:
        self.kubectl, self.ns, self.header_shown = kubectl, ns, False

    def show(self) -> None:
        out = self.kubectl("-n", self.ns, "get", "rljobs", check=False, timeout=20)
        lines = out.stdout.splitlines()
        if out.returncode != 0 or not lines:
            return
        if not self.header_shown:
            print(f"    $ kubectl -n {self.ns} get rljobs", flush=True)
            print("    " + lines[0], flush=True)
            self.header_shown = True
        for row in lines[1:]:
            print(f"    {row}    ({time.strftime('%H:%M:%S')})", flush=True)


# ------------------------------------------------------------------------------------------- the run


def run_demo(args: argparse.Namespace) -> int:
    """Steps 1-7 of the demo; returns the exit status."""
    state_dir = Path(args.state_dir).resolve() if args.state_dir else default_state_dir()
    example_path = Path(args.example).resolve()
    example = yaml.safe_load(example_path.read_text())
    name = example["metadata"]["name"]
    ns = args.namespace
    total_steps = int(example["spec"]["training"]["totalSteps"])

    # 1. control plane + real node
    cluster = DevCluster(state_dir, ClusterConfig(real_node="on", timeout_s=args.timeout))
    user = f"demo-{os.getpid()}"
    reused = cluster.healthy()
    if reused:
        say(f"1/7 reusing the local cluster that already runs in {state_dir}")
    else:
        say(
            f"1/7 starting a local Kubernetes cluster in {state_dir}: etcd, kube-apiserver, "
            "controller-manager, scheduler and the KubeRay operator as processes; one real CPU node "
            "(containerd + runc, kubelet, "
            "kube-proxy, CoreDNS); kwok fakes four 8-GPU AMD nodes (no GPU here)"
        )
    try:
        state = cluster.up(owner="demo")
        cluster.attach(user)  # marks it in use, so a finishing pytest session leaves it running
    except DevClusterError as err:
        raise DemoError(f"the cluster did not start (the demo needs the real node):\n{err}") from err
    kubectl = Kubectl(cluster.kubeconfig)
    say(f"    API server {state['server']}; kubeconfig {cluster.kubeconfig}")
    started_here = not reused
    ok = False
    try:
        # 2. images
        say("2/7 building the runtime image (Dockerfile.cpu) and the operator image (operator/Dockerfile) "
            "without Docker, cached by layer, and importing them into the node's containerd")  # fmt: skip
        for line in load_images(cluster):
            say(f"    {line}")

        # 3. operator, as a pod
        say(f"3/7 helm install charts/rlkube into {OPERATOR_NAMESPACE} (the operator runs as a pod with its "
            "chart's ServiceAccount and RBAC)")  # fmt: skip
        pod = install_operator(kubectl)
        say(f"    operator pod {OPERATOR_NAMESPACE}/{pod} is Ready")
        kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        if _exists(kubectl, ns, "rljob", name):
            say(f"    deleting the RLJob {ns}/{name} left from an earlier run (and its children)")
            kubectl("-n", ns, "delete", "rljob", name, "--wait=true", "--timeout=120s", timeout=150)
        _poll(lambda: not _exists(kubectl, ns, "rayjob", name), 120, "an earlier run's RayJob to go away")

        # 4. task
        say(
            f"4/7 preparing the tiny task under {Path(example['spec']['model']['path']).parent} "
            "(mounted into the pods): a small Qwen2-shaped model with a short supervised warm start, "
            "arithmetic prompts"
        )
        warm = prepare_task(example)
        if warm is not None:
            say(f"    warm-started model answers {warm:.0%} of the held-out prompts (greedy)")

        # 5. apply
        say(f"5/7 kubectl -n {ns} apply -f {example_path.relative_to(REPO_ROOT)}")
        say("    " + kubectl("-n", ns, "apply", "-f", str(example_path)).stdout.strip())
        rj_name = str(_poll(lambda: _phase(kubectl, ns, name).get("rayJobName"), 120, "the RayJob"))
        say(
            f"    the operator created RayJob {ns}/{rj_name} (+ ConfigMap, ServiceAccount, Role, RoleBinding)"
        )
        rc_name = str(
            _poll(
                lambda: kubectl.json("-n", ns, "get", "rayjob", rj_name)["status"].get("rayClusterName"),
                120,
                "KubeRay to create the RayCluster",
            )
        )
        say(f"    KubeRay created RayCluster {rc_name}; waiting for its pods to run `ray start`")
        placed = _poll(
            lambda: _pods_running(kubectl, ns, rc_name), 600, "the Ray pods to be Running", interval=2
        )
        for p in placed:
            say(f"    pod {p}: Running (a real container)")

        # 6. train, in the cluster
        say(f"6/7 KubeRay's submitter runs `ray job submit`; rlkube-train trains {total_steps} steps on the "
            "Ray head and pushes status.progress with the job's own ServiceAccount token")  # fmt: skip
        rows = RowPrinter(kubectl, ns)
        rows.show()
        start = time.monotonic()
        final: dict[str, Any] = {}
        deadline = start + args.job_timeout
        while time.monotonic() < deadline:
            final = _phase(kubectl, ns, name)
            if final.get("phase") in ("Succeeded", "Failed"):
                break
            time.sleep(args.interval)
            rows.show()
        rows.show()
        submitter = _submitter_log(kubectl, ns, rj_name)
        pushed = [ln for ln in submitter.splitlines() if "status.progress of rljob" in ln]
        if pushed:
            say(f"    from the job's log: {pushed[0].strip()[:160]}")
        if final.get("phase") != "Succeeded":
            say(f"    RLJob phase {final.get('phase')} after {time.monotonic() - start:.0f} s: "
                f"{final.get('reason', '')}: {final.get('message', '')}")  # fmt: skip
            print("\n".join(submitter.splitlines()[-LOG_TAIL_LINES:]), flush=True)
            return 1
        step = (final.get("progress") or {}).get("step")
        say(f"    RLJob {ns}/{name} is Succeeded after {time.monotonic() - start:.0f} s; "
            f"status.progress.step = {step}/{total_steps}")  # fmt: skip
        ok = True

        # 7. results (written by the pod onto the node's /tmp/rlkube-demo)
        out_dir = Path(example["spec"]["model"]["path"]).parent / "outputs" / name
        results = _report(out_dir, cluster, started_here and args.down)
        if args.summary:
            rljob = kubectl.json("-n", ns, "get", "rljob", name)
            summary = {
                "rljob": rljob,
                "took_s": round(time.monotonic() - _T0, 1),
                "cluster_ports": sorted(state["ports"].values()),
                "pods": placed,
                "submitter_log": submitter[-20000:],
                **results,
            }
            Path(args.summary).write_text(json.dumps(summary, indent=2))
        return 0
    finally:
        if cluster.detach(user):
            say("    the cluster was started by a pytest session that has ended: stopped it")
        elif args.down:
            if started_here:
                say("    --down: stopping the cluster")
                cluster.down()
            else:
                say("    --down: the cluster was already running before the demo; left running")
        elif ok:
            say(f"the cluster keeps running ({cluster.kubeconfig}); stop it with `{stop_command(cluster)}`")


def _submitter_log(kubectl: Kubectl, ns: str, rayjob: str) -> str:
    """The output of KubeRay's submitter (`ray job submit` follows the driver's log)."""
    selector = f"ray.io/originated-from-crd=RayJob,ray.io/originated-from-cr-name={rayjob}"
    pods = kubectl.json("-n", ns, "get", "pods", "-l", selector)["items"]
    if not pods:
        jobs = kubectl.json("-n", ns, "get", "jobs", "-l", selector)["items"]
        if not jobs:
            return ""
        return kubectl("-n", ns, "logs", f"job/{jobs[0]['metadata']['name']}", check=False).stdout
    return kubectl("-n", ns, "logs", pods[-1]["metadata"]["name"], check=False, timeout=60).stdout


def stop_command(cluster: DevCluster) -> str:
    """How to stop this cluster: `make cluster-down` for the default state dir."""
    if (
        cluster.state_dir == (REPO_ROOT / ".devcluster").resolve()
        and "RLKUBE_DEVCLUSTER_DIR" not in os.environ
    ):
        return "make cluster-down"
    return f"{Path(sys.executable).parent / 'rlkube-devcluster'} --state-dir {cluster.state_dir} down"


def _report(out_dir: Path, cluster: DevCluster, will_down: bool) -> dict[str, Any]:
    """Step 7: where the results are, and the held-out reward before and after (also returned)."""
    metrics = out_dir / "metrics.jsonl"
    rows: list[dict[str, Any]] = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    evals = [(r["step"], r["eval/reward_mean"]) for r in rows if "eval/reward_mean" in r]
    say("7/7 done. Results:")
    curve = out_dir / "reward_curve.png"
    print(f"    reward curve   {curve}{'' if curve.is_file() else '  (missing)'}", flush=True)
    print(f"    metrics JSONL  {metrics}{'' if metrics.is_file() else '  (missing)'}", flush=True)
    print(f"    TensorBoard    {out_dir / 'tensorboard'}   (tensorboard --logdir {out_dir / 'tensorboard'})")
    if len(evals) >= 2:
        (s0, r0), (s1, r1) = evals[0], evals[-1]
        print(f"    held-out reward (greedy): {r0:.3f} at step {s0} -> {r1:.3f} at step {s1}", flush=True)
    elif evals:
        print(f"    held-out reward (greedy): {evals[0][1]:.3f} at step {evals[0][0]}", flush=True)
    if not will_down:
        print(
            f"    kubectl: export KUBECONFIG={cluster.kubeconfig}; stop the cluster: {stop_command(cluster)}",
            flush=True,
        )
    return {
        "reward_curve": str(curve),
        "metrics": str(metrics),
        "tensorboard": str(out_dir / "tensorboard"),
        "heldout_reward": [{"step": s, "reward": r} for s, r in evals],
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlkube.devcluster.demo", description=__doc__)
    p.add_argument(
        "--state-dir", type=Path, default=None, help="control plane state (default: $RLKUBE_DEVCLUSTER_DIR "
        "or .devcluster)",
    )  # fmt: skip
    p.add_argument("--example", type=Path, default=DEFAULT_EXAMPLE, help="the RLJob to apply")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    p.add_argument("--interval", type=float, default=10.0, help="seconds between `kubectl get rljobs`")
    p.add_argument("--job-timeout", type=float, default=1800.0, help="seconds to wait for the RLJob to end")
    p.add_argument("--timeout", type=float, default=300.0, help="control plane start timeout (s)")
    p.add_argument("--down", action="store_true", help="stop the control plane at the end (if started here)")
    p.add_argument(
        "--summary", type=Path, default=None, help="write the final RLJob and result paths as JSON"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if shutil.which("kubectl") is None:
        print("[demo] kubectl is not on PATH", file=sys.stderr)
        return 1
    try:
        rc = run_demo(args)
    except (DemoError, DevClusterError, KubectlError) as err:
        print(f"[demo] FAILED: {err}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("[demo] interrupted", file=sys.stderr)
        return 130
    say(f"total {time.monotonic() - _T0:.0f} s" + ("" if rc == 0 else f"; exit {rc}"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
