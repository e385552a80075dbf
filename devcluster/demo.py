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
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from .binaries import REPO_ROOT
from .cluster import ClusterConfig, DevCluster, default_state_dir
from .errors import DevClusterError
from .realpods import (
    OPERATOR_IMAGE,
    HostDirs,
    install_operator,
    load_images,
    pods_report,
    poll,
    rljob_report,
    rljob_status,
    share_with_pods,
    wait_ray_pods_ready,
)
from .testing import Kubectl, KubectlError

DEFAULT_EXAMPLE = REPO_ROOT / "examples" / "tiny-arith.yaml"
DEFAULT_NAMESPACE = "rlkube-demo"
OPERATOR_NAMESPACE = "rlkube-system"
LOG_TAIL_LINES = 40


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and what was seen."""


_T0 = time.monotonic()


def say(msg: str) -> None:
    """One plain-words progress line, with the seconds since the demo started."""
    print(f"[demo {time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


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
    share_with_pods(model_path.parent)
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


def _outputs_dir(example: dict[str, Any]) -> Path:
    """The RLJob's RLKUBE_OUTPUT_DIR, created writable for the pods' user (uid 1000, not root)."""
    env = {e["name"]: e["value"] for e in example["spec"].get("env") or ()}
    out = Path(env.get("RLKUBE_OUTPUT_DIR") or Path(example["spec"]["model"]["path"]).parent / "outputs")
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o1777)
    return out


# --------------------------------------------------------------------------------------- kubernetes


def _exists(kubectl: Kubectl, ns: str, kind: str, name: str) -> bool:
    return bool(kubectl("-n", ns, "get", kind, name, "--ignore-not-found", "-o", "name").stdout.strip())


class RowPrinter:
    """Prints `kubectl get rljobs` with the header once, then only rows that changed."""

    def __init__(self, kubectl: Kubectl, ns: str) -> None:
        self.kubectl, self.ns, self.header_shown = kubectl, ns, False
        self.last: list[str] = []

    def show(self) -> None:
        out = self.kubectl("-n", self.ns, "get", "rljobs", check=False, timeout=20)
        lines = out.stdout.splitlines()
        if out.returncode != 0 or not lines:
            return
        if not self.header_shown:
            print(f"    $ kubectl -n {self.ns} get rljobs", flush=True)
            print("    " + lines[0], flush=True)
            self.header_shown = True
        if lines[1:] == self.last:
            return
        self.last = lines[1:]
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
        digests = load_images(lambda m: say(f"    {m}"))

        # 3. operator, as a pod
        say(f"3/7 helm install charts/rlkube into {OPERATOR_NAMESPACE} (the operator runs as a pod with its "
            f"chart's ServiceAccount and RBAC; it watches {ns})")  # fmt: skip
        # The namespace first: in the chart's namespaced mode (the default) the operator's Role lives there.
        # The admin policy of that namespace allows what the example mounts, and no more.
        dirs = HostDirs.of_rljob(example)
        kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        pod = install_operator(
            kubectl,
            OPERATOR_NAMESPACE,
            watch_namespaces=[ns],
            image_digest=digests[OPERATOR_IMAGE],
            host_dirs=dirs,
        )
        say(f"    operator pod {OPERATOR_NAMESPACE}/{pod} is Ready")
        say(
            f"    admin policy for {ns} (chart values policy.namespaces.{ns}): the real node's toleration, "
            f"rlkube/* images, node directories {', '.join(dirs.read)} read-only and "
            f"{', '.join(dirs.write) or 'none'} writable; everything else as the chart's defaults"
        )
        if _exists(kubectl, ns, "rljob", name):
            say(f"    deleting the RLJob {ns}/{name} left from an earlier run (and its children)")
            kubectl("-n", ns, "delete", "rljob", name, "--wait=true", "--timeout=180s", timeout=200)
        poll(
            lambda: not kubectl.json("-n", ns, "get", "pods", "-l", "ray.io/cluster")["items"],
            300,
            "an earlier run's Ray pods to go away",
            on_timeout=lambda: pods_report(kubectl, ns, "ray.io/cluster"),
        )

        # 4. task
        task_dir = Path(example["spec"]["model"]["path"]).parent
        say(
            f"4/7 preparing the tiny task under {task_dir} (mounted into the pods from the node): a small "
            "Qwen2-shaped model with a short supervised warm start, arithmetic prompts"
        )
        warm = prepare_task(example)
        if warm is not None:
            say(f"    warm-started model answers {warm:.0%} of the held-out prompts (greedy)")
        out_dir = _outputs_dir(example) / name
        shutil.rmtree(out_dir, ignore_errors=True)  # this run's results only

        # 5. apply
        say(f"5/7 kubectl -n {ns} apply -f {example_path.relative_to(REPO_ROOT)}")
        say("    " + kubectl("-n", ns, "apply", "-f", str(example_path)).stdout.strip())
        rj_name = str(
            poll(
                lambda: rljob_status(kubectl, ns, name).get("rayJobName"),
                180,
                "the operator to create the RayJob",
                on_timeout=lambda: (
                    rljob_report(kubectl, ns, name, "ray.io/cluster")
                    + "\n"
                    + pods_report(kubectl, OPERATOR_NAMESPACE, "app.kubernetes.io/name=rlkube")
                ),
            )
        )
        say(
            f"    the operator created RayJob {ns}/{rj_name} (+ ConfigMap, ServiceAccount, Role, RoleBinding)"
        )
        rc_name = str(
            poll(
                lambda: kubectl.json("-n", ns, "get", "rayjob", rj_name)["status"].get("rayClusterName"),
                180,
                "KubeRay to create the RayCluster",
                on_timeout=lambda: rljob_report(kubectl, ns, name, "ray.io/cluster"),
            )
        )
        say(f"    KubeRay created RayCluster {rc_name}; waiting for its pods to run `ray start`")
        pods = wait_ray_pods_ready(kubectl, ns, rc_name, timeout=args.pods_timeout)
        placed = [f"{p['metadata']['name']} on {p['spec'].get('nodeName')}" for p in pods]
        for p in placed:
            say(f"    pod {p}: Running and Ready (a real container)")

        # 6. train, in the cluster
        say(f"6/7 KubeRay's submitter runs `ray job submit`; rlkube-train trains {total_steps} steps on the "
            "Ray head and pushes status.progress with the job's own ServiceAccount token")  # fmt: skip
        rows = RowPrinter(kubectl, ns)
        rows.show()
        start = time.monotonic()
        final: dict[str, Any] = {}
        deadline = start + args.job_timeout
        while time.monotonic() < deadline:
            final = rljob_status(kubectl, ns, name)
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
        results = _report(out_dir, cluster, started_here and args.down)
        mem = memory_peak(cluster)
        print(
            f"    memory peak: pods {mem['pods_gib']} GiB (kubepods cgroup), cluster processes "
            f"{mem['cluster_processes_gib']} GiB (sum of peak RSS)",
            flush=True,
        )
        results["memory_peak"] = mem
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


def memory_peak(cluster: DevCluster) -> dict[str, float]:
    """GiB: the pods' peak (the kubelet's kubepods memory cgroup, created with the node) and the sum
    of the peak RSS (VmHWM) of the cluster's processes; both since the cluster started."""
    pods = Path("/sys/fs/cgroup/memory/kubepods/memory.max_usage_in_bytes")
    out = {"pods_gib": 0.0, "cluster_processes_gib": 0.0}
    with contextlib.suppress(OSError, ValueError):
        out["pods_gib"] = round(int(pods.read_text()) / 2**30, 2)
    total_kib = 0
    for comp in (cluster.read_state() or {}).get("components") or ():
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{comp['pid']}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total_kib += int(line.split()[1])
    out["cluster_processes_gib"] = round(total_kib / 2**20, 2)
    return out


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
    p.add_argument(
        "--pods-timeout", type=float, default=900.0, help="seconds to wait for the Ray pods to be Ready"
    )
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
