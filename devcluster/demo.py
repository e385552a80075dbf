"""`make demo`: the README's main job on a machine with no cluster and no GPU.

It starts (or reuses) the local control plane, runs the operator, prepares the tiny arithmetic task,
applies `examples/tiny-arith.yaml` and waits for the operator's RayJob and KubeRay's RayCluster.
kwok fakes the pods (no container ever runs), so the demo then does what the Ray head would: it
runs the RayJob's rendered entrypoint on this host with the rendered config from the ConfigMap and
the RLJob's own ServiceAccount token, so `status.progress` goes through the same RBAC a pod has.
Finally it reports the outcome on the RayJob as KubeRay's submitter would, and the operator turns
that into the RLJob's `Succeeded` (or `Failed`) phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rlkube.api.contract import (
    CONFIG_DIR,
    CONFIG_FILE,
    CONFIG_VOLUME,
    CRD_NAME,
    ENV_RLJOB_NAME,
    ENV_RLJOB_NAMESPACE,
    PLURAL,
)

from .binaries import REPO_ROOT
from .cluster import ClusterConfig, DevCluster, default_state_dir
from .errors import DevClusterError
from .testing import Kubectl, KubectlError, token_kubeconfig

T = TypeVar("T")
DEFAULT_EXAMPLE = REPO_ROOT / "examples" / "tiny-arith.yaml"
DEFAULT_NAMESPACE = "rlkube-demo"
CRD_FILE = REPO_ROOT / "crds" / f"{CRD_NAME}.yaml"
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


# ------------------------------------------------------------------------------------------ operator


class Operator:
    """`rlkube-operator` as a subprocess watching one namespace, as the chart's Deployment runs it."""

    def __init__(self, kubeconfig: Path, namespace: str, log_path: Path) -> None:
        binary = Path(sys.executable).parent / "rlkube-operator"
        if not binary.is_file():
            raise DemoError(f"{binary} missing: run `make venv`")
        self.log_path = log_path
        self.liveness_port = _free_port()
        argv = [
            str(binary),
            f"--namespace={namespace}",
            "--standalone",
            f"--liveness=http://127.0.0.1:{self.liveness_port}/healthz",
            "--log-format=plain",
        ]
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONSAFEPATH": "1"}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as out:
            out.write(f"# {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_live(self, timeout: float = 90) -> None:
        """Until the liveness endpoint answers: the operator has logged in and its watches run."""

        def live() -> bool:
            if self.proc.poll() is not None:
                raise DemoError(
                    f"rlkube-operator exited {self.proc.returncode}; last lines of {self.log_path}:\n"
                    + _tail(self.log_path)
                )
            try:
                url = f"http://127.0.0.1:{self.liveness_port}/healthz"
                with urllib.request.urlopen(url, timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        deadline = time.monotonic() + timeout
        while not live():
            if time.monotonic() > deadline:
                raise DemoError(f"rlkube-operator not live after {timeout:.0f} s:\n{_tail(self.log_path)}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


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


def _rayjob_status(kubectl: Kubectl, ns: str, rayjob: str, status: dict[str, Any]) -> None:
    """Write RayJob.status the way KubeRay does (kwok runs no submitter, so no one else will)."""
    kubectl(
        "-n", ns, "patch", "rayjob", rayjob, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


def _retire_fake_submitter(kubectl: Kubectl, ns: str, rayjob: str) -> None:
    """Keep KubeRay from failing the RayJob because kwok finished its submitter at once.

    In K8sJobMode KubeRay's submitter Job runs `ray job submit`, which follows the Ray job until it
    ends. kwok completes every Job pod as soon as it runs, and KubeRay v1.5 marks a RayJob Failed 30 s
    after its submitter finished without a terminal Ray job status
    (JobDeploymentStatusTransitionGracePeriodExceeded). So once that fake completion shows, the demo
    deletes the submitter Job; KubeRay then keeps the RayJob Running (it retries the lookup) and the
    demo reports the job's outcome on the RayJob itself, as the submitter would have.
    """
    selector = f"ray.io/originated-from-crd=RayJob,ray.io/originated-from-cr-name={rayjob}"

    def submitter() -> dict[str, Any] | None:
        items = kubectl.json("-n", ns, "get", "jobs", "-l", selector)["items"]
        return dict(items[0]) if items else None

    job = _poll(submitter, 60, "KubeRay's submitter Job", interval=0.5)
    name = job["metadata"]["name"]

    def finished() -> bool:
        conds = (submitter() or {}).get("status", {}).get("conditions") or []
        return any(c["type"] in ("Complete", "Failed") and c["status"] == "True" for c in conds)

    with contextlib.suppress(DemoError):  # a submitter kept running (no fake completion) is left alone
        _poll(finished, 10, "the submitter Job to finish", interval=0.5)
    if not finished():
        say(f"    KubeRay's submitter Job {name} is running; it stays")
        return
    kubectl("-n", ns, "delete", "job", name, "--cascade=background", "--wait=false")
    say(
        f"    kwok completed KubeRay's submitter Job {name} at once (a real one runs `ray job submit` until "
        "the Ray job ends, and KubeRay would fail the RayJob 30 s after it finished): the demo deleted it "
        "and reports the job's state on the RayJob itself"
    )


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
    conds = (kubectl.json("get", "crd", CRD_NAME).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conds)


class RowPrinter:
    """Prints `kubectl get rljobs` with the header once, then only the rows."""

    def __init__(self, kubectl: Kubectl, ns: str) -> None:
        self.kubectl, self.ns, self.header_shown = kubectl, ns, False

    def show(self) -> None:
        out = self.kubectl("-n", self.ns, "get", PLURAL, check=False, timeout=20)
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


def _entrypoint_argv(rayjob: dict[str, Any], cm: dict[str, Any], workdir: Path) -> tuple[list[str], Path]:
    """The RayJob's entrypoint with the ConfigMap's mount path replaced by a local copy of the file."""
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mount = next(
        m["mountPath"] for m in head["containers"][0].get("volumeMounts", []) if m["name"] == CONFIG_VOLUME
    )
    config_dir = workdir / "etc-rlkube"
    config_dir.mkdir(parents=True, exist_ok=True)
    for key, text in (cm.get("data") or {}).items():
        (config_dir / key).write_text(text)
    entry = str(rayjob["spec"]["entrypoint"]).replace(mount.rstrip("/"), str(config_dir))
    return shlex.split(entry), config_dir


def _container_env(rayjob: dict[str, Any], config_dir: Path, mount: str = CONFIG_DIR) -> dict[str, str]:
    """The head container's rendered env (identity vars, platform vars) with local config paths."""
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return {e["name"]: str(e.get("value", "")).replace(mount, str(config_dir)) for e in head.get("env", [])}


def run_demo(args: argparse.Namespace) -> int:
    """Steps 1-7 of the demo; returns the exit status."""
    state_dir = Path(args.state_dir).resolve() if args.state_dir else default_state_dir()
    example_path = Path(args.example).resolve()
    example = yaml.safe_load(example_path.read_text())
    name = example["metadata"]["name"]
    ns = args.namespace
    workdir = Path(args.workdir).resolve()
    total_steps = int(example["spec"]["training"]["totalSteps"])

    # 1. control plane
    cluster = DevCluster(
        state_dir, ClusterConfig(gpu_nodes=1, gpus_per_node=8, cpu_nodes=1, timeout_s=args.timeout)
    )
    user = f"demo-{os.getpid()}"
    reused = cluster.healthy()
    if reused:
        say(f"1/7 reusing the local control plane that already runs in {state_dir}")
    else:
        say(
            f"1/7 starting a local Kubernetes control plane in {state_dir}: real etcd, kube-apiserver, "
            "controller-manager, scheduler and KubeRay operator as plain processes; kwok fakes one "
            "8-GPU AMD node and one CPU node (10-60 s)"
        )
    try:
        state = cluster.up(owner="demo")
        cluster.attach(user)  # marks it in use, so a finishing pytest session leaves it running
    except DevClusterError as err:
        raise DemoError(f"the control plane did not start:\n{err}") from err
    kubectl = Kubectl(cluster.kubeconfig)
    say(f"    API server {state['server']}; kubeconfig {cluster.kubeconfig}")
    started_here = not reused
    operator: Operator | None = None
    trainer: subprocess.Popen[bytes] | None = None
    ok = False
    try:
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
        _poll(lambda: _crd_established(kubectl), 60, "the RLJob CRD to be Established", interval=0.3)
        kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        # 2. operator
        op_log = cluster.logs_dir / "operator.log"
        say(f"2/7 starting the rlkube operator, watching namespace {ns} (log: {op_log})")
        operator = Operator(cluster.kubeconfig, ns, op_log)
        operator.wait_live()
        say("    operator is live")
        if _exists(kubectl, ns, "rljob", name):  # after the operator is up: its finalizer must run
            say(f"    deleting the RLJob {ns}/{name} left from an earlier run (and its children)")
            kubectl("-n", ns, "delete", "rljob", name, "--wait=true", "--timeout=90s", timeout=120)
        _poll(lambda: not _exists(kubectl, ns, "rayjob", name), 120, "an earlier run's RayJob to go away")

        # 3. task
        say(
            f"3/7 preparing the tiny task under {Path(example['spec']['model']['path']).parent}: a small "
            "Qwen2-shaped model with a short supervised warm start, and arithmetic train/held-out prompts"
        )
        warm = prepare_task(example)
        if warm is not None:
            say(f"    warm-started model answers {warm:.0%} of the held-out prompts (greedy)")

        # 4. apply
        say(f"4/7 kubectl -n {ns} apply -f {example_path.relative_to(REPO_ROOT)}")
        out = kubectl("-n", ns, "apply", "-f", str(example_path))
        say("    " + out.stdout.strip())

        # 5. RayJob, RayCluster, pods
        say("5/7 waiting for the operator's RayJob, KubeRay's RayCluster and its pods")
        rj_name = str(_poll(lambda: _phase(kubectl, ns, name).get("rayJobName"), 90, "the RayJob"))
        say(f"    operator created RayJob {ns}/{rj_name} (+ ConfigMap, ServiceAccount, Role, RoleBinding)")
        rc_name = str(
            _poll(
                lambda: kubectl.json("-n", ns, "get", "rayjob", rj_name)["status"].get("rayClusterName"),
                90,
                "KubeRay to create the RayCluster",
            )
        )
        say(f"    KubeRay created RayCluster {rc_name}")
        placed = _poll(lambda: _pods_running(kubectl, ns, rc_name), 120, "the Ray pods to be Running")
        for p in placed:
            say(f"    pod {p}: Running")
        _poll(
            lambda: any(
                c["type"] == "ClusterReady" and c["status"] == "True"
                for c in _phase(kubectl, ns, name).get("conditions") or []
            ),
            60,
            "the RLJob's ClusterReady condition",
        )
        _retire_fake_submitter(kubectl, ns, rj_name)
        rows = RowPrinter(kubectl, ns)
        rows.show()
        say(
            "    kwok fakes the pods: no container runs here, so the demo now executes the RayJob's "
            "rendered entrypoint on this host with its rendered config"
        )
        rayjob = kubectl.json("-n", ns, "get", "rayjob", rj_name)
        head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
        cm_name = next(v["configMap"]["name"] for v in head["volumes"] if v["name"] == CONFIG_VOLUME)
        cm = kubectl.json("-n", ns, "get", "configmap", cm_name)
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        argv, config_dir = _entrypoint_argv(rayjob, cm, workdir)
        resolved = yaml.safe_load((config_dir / CONFIG_FILE).read_text())
        ckpt = ((resolved.get("spec") or {}).get("checkpoint") or {}).get("path")
        if ckpt and Path(ckpt).exists():
            shutil.rmtree(ckpt)  # a finished earlier run's checkpoint would make this one resume at the end
        sa = head.get("serviceAccountName") or f"{name}-runtime"
        sa_config = workdir / "runtime-kubeconfig"
        token_kubeconfig(kubectl, sa_config, ns, sa)
        as_sa = Kubectl(sa_config)
        can_patch = as_sa("auth", "can-i", "patch", f"{CRD_NAME}/{name}", "--subresource=status",
                          check=False).stdout.strip()  # fmt: skip
        can_delete = as_sa("auth", "can-i", "delete", CRD_NAME, check=False).stdout.strip()
        say(
            f"    credentials: a token of ServiceAccount {ns}/{sa} (may patch rljob/{name} status: "
            f"{can_patch}; may delete RLJobs: {can_delete})"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
        env.update(_container_env(rayjob, config_dir))
        env.update(
            {
                ENV_RLJOB_NAME: env.get(ENV_RLJOB_NAME, name),
                ENV_RLJOB_NAMESPACE: env.get(ENV_RLJOB_NAMESPACE, ns),
                "KUBECONFIG": str(sa_config),
                "RLKUBE_KUBECONFIG": str(sa_config),
                "PYTHONSAFEPATH": "1",
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            }
        )
        train_log = workdir / "train.log"
        say(f"    $ {' '.join(shlex.quote(a) for a in argv)}   (cwd {workdir}, log {train_log})")

        # 6. run, watch, report as KubeRay would
        say(f"6/7 training {total_steps} steps; playing KubeRay's part: RayJob jobStatus RUNNING")
        _rayjob_status(
            kubectl,
            ns,
            rj_name,
            {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running", "message": "entrypoint runs on host"},
        )
        start = time.monotonic()
        with train_log.open("wb") as log:
            trainer = subprocess.Popen(
                argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        while trainer.poll() is None:
            try:
                trainer.wait(args.interval)
            except subprocess.TimeoutExpired:
                rows.show()
        rc = trainer.returncode
        took = time.monotonic() - start
        rows.show()
        if rc != 0:
            say(f"    the entrypoint exited {rc} after {took:.0f} s; last lines of {train_log}:")
            print(_tail(train_log), flush=True)
            say("    playing KubeRay's part: RayJob jobStatus FAILED")
            _rayjob_status(
                kubectl,
                ns,
                rj_name,
                {
                    "jobStatus": "FAILED",
                    "jobDeploymentStatus": "Failed",
                    "reason": "AppFailed",
                    "message": f"entrypoint exited {rc}",
                },
            )
            with contextlib.suppress(DemoError):
                _poll(lambda: _phase_if(kubectl, ns, name, "Failed"), 30, "phase Failed")
            rows.show()
            return 1
        say(
            f"    the entrypoint exited 0 after {took:.0f} s; playing KubeRay's part: the submitter reports "
            "jobStatus SUCCEEDED, jobDeploymentStatus Complete on the RayJob"
        )
        _rayjob_status(
            kubectl,
            ns,
            rj_name,
            {
                "jobStatus": "SUCCEEDED",
                "jobDeploymentStatus": "Complete",
                "message": "Job finished successfully.",
            },
        )
        final = _poll(lambda: _phase_if(kubectl, ns, name, "Succeeded"), 60, "phase Succeeded")
        rows.show()
        step = (final.get("progress") or {}).get("step")
        say(f"    RLJob {ns}/{name} is Succeeded; status.progress.step = {step}/{total_steps}")
        ok = True

        # 7. results
        out_dir = _output_dir(train_log, workdir, name)
        results = _report(out_dir, cluster, started_here and args.down)
        if args.summary:
            rljob = kubectl.json("-n", ns, "get", "rljob", name)
            summary = {
                "rljob": rljob,
                "took_s": round(time.monotonic() - _T0, 1),
                "cluster_ports": sorted(state["ports"].values()),
                **results,
            }
            Path(args.summary).write_text(json.dumps(summary, indent=2))
        return 0
    finally:
        if trainer is not None and trainer.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(trainer.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                trainer.wait(20)
        if operator is not None:
            say("    stopping the operator")
            operator.stop()
        if cluster.detach(user):  # a pytest-started cluster whose sessions are all gone stops here
            say("    the control plane was started by a pytest session that has ended: stopped it")
        elif args.down:
            if started_here:
                say("    --down: stopping the control plane")
                cluster.down()
            else:
                say("    --down: the control plane was already running before the demo; left running")
        elif ok:
            say(f"the control plane keeps running ({cluster.kubeconfig})")
            say(f"stop it with `{stop_command(cluster)}`")


def _output_dir(train_log: Path, workdir: Path, name: str) -> Path:
    """Where the trainer wrote: the path it printed, else its default `outputs/<name>`."""
    for line in reversed(_tail(train_log, 200).splitlines()):
        if "metrics " in line and line.startswith("rlkube-train:"):
            metrics = line.split("metrics ", 1)[1].split(";", 1)[0].strip()
            p = Path(metrics)
            return (p if p.is_absolute() else workdir / p).parent
    return workdir / "outputs" / name


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
    p.add_argument(
        "--workdir", type=Path, default=Path("/tmp/rlkube-demo/run"),
        help="where the entrypoint runs: rendered config, SA kubeconfig, train.log, outputs/ (wiped first)",
    )  # fmt: skip
    p.add_argument("--interval", type=float, default=5.0, help="seconds between `kubectl get rljobs`")
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
