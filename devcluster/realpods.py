"""What the demo and the real-pod tests share: images into the node, the operator as a pod, and
failure reports that name the pod and its last events.

Real pods on two loaded cores are slow and fail in many ways (an image missing from the node, a
crash-looping container, a pod that never schedules); every wait here has a generous timeout and,
when it runs out, says which pod, in which state, with its last events and log lines.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .binaries import REPO_ROOT, cache_dir, module_version
from .errors import DevClusterError
from .images import IMAGES, Builder, build_image, import_layout
from .node import REAL_NODE_LABEL, RUN_DIR
from .testing import Kubectl

T = TypeVar("T")
CHART = REPO_ROOT / "charts" / "rlkube"
RUNTIME_IMAGE = IMAGES["runtime-cpu"].name
OPERATOR_IMAGE = IMAGES["operator"].name
# Tolerated by every pod meant for the real node (its taint keeps all others on the fake nodes).
REAL_NODE_TOLERATION = {"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
EVENT_LINES = 8
LOG_LINES = 25


class RealPodsError(DevClusterError):
    """A real-pod step failed; the message names the pod, its state, events and log tail."""


# ------------------------------------------------------------------------------------------- images


def load_images(log: Callable[[str], None] = print) -> dict[str, str]:
    """Build (cached by layer) and import the runtime and operator images into the node's containerd.

    Logs one line per image (build and import time); returns `{image name: manifest digest}`.
    """
    builder = Builder()
    ctr = ["ctr", "--address", str(RUN_DIR / "containerd.sock"), "-n", "k8s.io"]
    digests = {}
    for which in ("runtime-cpu", "operator"):
        t0 = time.monotonic()
        layout, _ = build_image(which, builder)
        built = time.monotonic() - t0
        t1 = time.monotonic()
        fresh = import_layout(layout, ctr)
        digests[IMAGES[which].name] = (layout / "manifest-digest").read_text().strip()
        log(
            f"{IMAGES[which].name}: built in {built:.0f} s, "
            + (f"imported in {time.monotonic() - t1:.0f} s" if fresh else "already in the node's containerd")
        )
    log(f"layers built {len(builder.built)}, reused {len(builder.reused)}")
    return digests


def share_with_pods(root: Path) -> None:
    """Make a host folder mounted into pods readable by their user (uid 1000, not root): some
    writers (safetensors) create files 0600."""
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        path.chmod(mode | (0o755 if path.is_dir() else 0o444))


# ----------------------------------------------------------------------------------------- operator


def helm_binary() -> Path:
    path = cache_dir() / f"helm-{module_version('helm')}" / "bin" / "helm"
    if not os.access(path, os.X_OK):
        raise RealPodsError(f"{path} missing: run `make cluster-build`")
    return path


@dataclass(frozen=True)
class HostDirs:
    """The node directories the devcluster's RLJobs mount: `read` read-only, `write` writable."""

    read: tuple[str, ...]
    write: tuple[str, ...] = ()

    @classmethod
    def of_rljob(cls, rljob: dict[str, Any]) -> HostDirs:
        """Exactly the hostPath mounts an RLJob asks for (readOnly unless it says false)."""
        mounts = [m for m in rljob["spec"].get("mounts") or () if m.get("hostPath")]
        return cls(
            tuple(str(m["hostPath"]) for m in mounts if m.get("readOnly", True)),
            tuple(str(m["hostPath"]) for m in mounts if m.get("readOnly") is False),
        )


def devcluster_policy(dirs: HostDirs) -> dict[str, Any]:
    """The admin policy the devcluster's chart installs opt into, and no more: the real node's
    toleration and label, the images it builds (rlkube/*), the one env var the tiny RLJobs set, and
    the node directories they mount (read-only except the outputs). Lists replace the chart's
    defaults, so the defaults are restated. This is the example of an admin opting in
    (docs/operator.md, "Security")."""
    from rlkube.operator.policy import Policy

    base = Policy()
    return {
        "tolerationKeys": [*base.toleration_keys, REAL_NODE_LABEL],
        "nodeSelectorKeys": [*base.node_selector_keys, REAL_NODE_LABEL],
        "images": [RUNTIME_IMAGE.split("/", 1)[0] + "/*"],
        "envNames": ["RLKUBE_OUTPUT_DIR"],
        "hostPath": {
            "enabled": True,
            "paths": sorted({*dirs.read, *dirs.write}),
            "writablePaths": sorted(set(dirs.write)),
        },
    }


def operator_values(
    watch_namespaces: list[str] | None = None, image_digest: str = "", host_dirs: HostDirs | None = None
) -> dict[str, Any]:
    """Chart values for the devcluster: the locally built images, and the real node for the operator,
    the Ray heads and KubeRay's submitters. `watch_namespaces` limits the operator (so a second
    operator, e.g. a test session's own, never reconciles the same RLJobs). The image's digest goes
    into a pod annotation: the tag stays, so a rebuilt image must still roll the Deployment.
    `host_dirs`: the admin policy of the watched namespaces opts into what the devcluster's RLJobs
    need (`devcluster_policy`); without it the chart's defaults (no hostPath, no real-node toleration)."""
    repo, tag = OPERATOR_IMAGE.rsplit(":", 1)
    namespaces = list(watch_namespaces or [])
    policy: dict[str, Any] = {}
    if host_dirs is not None:
        allowed = devcluster_policy(host_dirs)
        policy = {"namespaces": dict.fromkeys(namespaces, allowed)} if namespaces else {"default": allowed}
    return {
        "policy": policy,
        "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
        "podAnnotations": {"rlkube.io/image-digest": image_digest} if image_digest else {},
        "watchNamespaces": namespaces,
        "nodeSelector": {REAL_NODE_LABEL: "true"},
        "tolerations": [REAL_NODE_TOLERATION],
        "resources": {
            "requests": {"cpu": "50m", "memory": "128Mi"},
            "limits": {"cpu": "1", "memory": "512Mi"},
        },
        "runtimeDefaults": {
            "vendorImages": {"cpu": RUNTIME_IMAGE},
            "imagePullPolicy": "IfNotPresent",
            "headNodeSelector": {REAL_NODE_LABEL: "true"},
            "headTolerations": [REAL_NODE_TOLERATION],
            # Two real cores: requests at a quarter of the limits so head, worker, submitter and
            # operator fit; Ray still sees each pod's full CPU limit.
            "cpuRequestPercent": 25,
        },
    }


def operator_pods(kubectl: Kubectl, namespace: str, release: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/name=rlkube,app.kubernetes.io/instance={release}"
    pods = kubectl.json("-n", namespace, "get", "pods", "-l", selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def install_operator(
    kubectl: Kubectl,
    namespace: str,
    *,
    release: str = "rlkube",
    watch_namespaces: list[str] | None = None,
    image_digest: str = "",
    host_dirs: HostDirs | None = None,
    timeout: float = 300,
) -> str:
    """`helm upgrade --install` of charts/rlkube; returns the operator pod once it is Ready and stays up.

    A pod that turns Ready and then crashes (a bad flag, a bad environment) fails here with its log,
    not minutes later as a job that never starts.
    """
    values = Path(kubectl.kubeconfig).parent / f"{release}-values.yaml"
    values.write_text(yaml.safe_dump(operator_values(watch_namespaces, image_digest, host_dirs)))
    argv = [
        str(helm_binary()), "upgrade", "--install", release, str(CHART), "--namespace", namespace,
        "--create-namespace", "--values", str(values), "--kubeconfig", str(kubectl.kubeconfig), "--wait",
        "--timeout", f"{int(timeout)}s",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 60)
    if proc.returncode != 0:
        report = pods_report(kubectl, namespace, f"app.kubernetes.io/instance={release}")
        raise RealPodsError(f"helm install failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}\n{report}")
    return wait_operator_ready(kubectl, namespace, release, timeout=timeout)


def wait_operator_ready(kubectl: Kubectl, namespace: str, release: str, timeout: float = 300) -> str:
    """The one live operator pod's name once it is Ready and has not restarted for 5 s."""

    def steady() -> str | None:
        pods = operator_pods(kubectl, namespace, release)
        if len(pods) != 1 or not pod_ready(pods[0]):
            return None
        name = str(pods[0]["metadata"]["name"])
        if restarts(pods[0]):
            raise RealPodsError(
                f"operator pod {namespace}/{name} restarted:\n{pod_report(kubectl, namespace, name)}"
            )
        return name

    first = poll(
        steady,
        timeout,
        f"the operator pod in {namespace} to be Ready",
        on_timeout=lambda: pods_report(kubectl, namespace, f"app.kubernetes.io/instance={release}"),
    )
    time.sleep(5)
    again = steady()
    if again != first:
        raise RealPodsError(
            f"operator pod {namespace}/{first} did not stay Ready:\n{pods_report(kubectl, namespace, '')}"
        )
    return first


def uninstall_operator(kubectl: Kubectl, namespace: str, release: str) -> None:
    argv = [str(helm_binary()), "uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s",
            "--kubeconfig", str(kubectl.kubeconfig)]  # fmt: skip
    subprocess.run(argv, capture_output=True, text=True, timeout=180)


# -------------------------------------------------------------------------------------------- pods


def pod_ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or ()
    )


def restarts(pod: dict[str, Any]) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or ()
    return sum(int(c.get("restartCount", 0)) for c in statuses)


def _container_line(cs: dict[str, Any]) -> str:
    state = cs.get("state") or {}
    kind = next(iter(state), "unknown")
    detail = state.get(kind) or {}
    text = f"{cs.get('name')}: {kind}"
    if detail.get("reason"):
        text += f" ({detail['reason']}"
        if "exitCode" in detail:
            text += f", exit {detail['exitCode']}"
        text += ")"
    if detail.get("message"):
        text += f": {str(detail['message']).strip()[:300]}"
    last = (cs.get("lastState") or {}).get("terminated")
    if last:
        text += f"; last exit {last.get('exitCode')} ({last.get('reason')})"
    return text + f"; restarts {cs.get('restartCount', 0)}"


def pod_report(kubectl: Kubectl, namespace: str, name: str) -> str:
    """One pod: phase, node, container states, its last events and log lines."""
    try:
        pod = kubectl.json("-n", namespace, "get", "pod", name)
    except Exception as exc:
        return f"pod {namespace}/{name}: cannot read ({exc})"
    st = pod.get("status") or {}
    lines = [
        f"pod {namespace}/{name}: {st.get('phase')} on {pod['spec'].get('nodeName') or '(not scheduled)'}"
        + (f", {st.get('reason')}: {st.get('message')}" if st.get("reason") else "")
    ]
    for cond in st.get("conditions") or ():
        if cond.get("status") != "True" and cond.get("message"):
            lines.append(f"  condition {cond['type']}={cond['status']}: {cond['message']}")
    for cs in [*(st.get("initContainerStatuses") or ()), *(st.get("containerStatuses") or ())]:
        lines.append("  container " + _container_line(cs))
    events = kubectl(
        "-n", namespace, "get", "events", "--field-selector", f"involvedObject.name={name}",
        "--sort-by=.lastTimestamp", "-o", "custom-columns=LAST:.lastTimestamp,TYPE:.type,REASON:.reason,"
        "COUNT:.count,MESSAGE:.message", "--no-headers", check=False, timeout=30,
    ).stdout.strip().splitlines()  # fmt: skip
    if events:
        lines.append("  last events:")
        lines += [f"    {e[:300]}" for e in events[-EVENT_LINES:]]
    for cs in st.get("containerStatuses") or ():
        if "running" in (cs.get("state") or {}) or (cs.get("state") or {}).get("terminated"):
            log = kubectl("-n", namespace, "logs", name, "-c", cs["name"], f"--tail={LOG_LINES}",
                          check=False, timeout=30).stdout.rstrip()  # fmt: skip
            if log:
                lines.append(f"  last log lines of {cs['name']}:")
                lines += [f"    {line[:300]}" for line in log.splitlines()]
    return "\n".join(lines)


def pods_report(kubectl: Kubectl, namespace: str, selector: str) -> str:
    """`pod_report` of every pod matching `selector` (all pods of the namespace for "")."""
    args = ["-n", namespace, "get", "pods"] + (["-l", selector] if selector else [])
    try:
        pods = kubectl.json(*args)["items"]
    except Exception as exc:
        return f"pods in {namespace} ({selector or 'all'}): cannot list ({exc})"
    if not pods:
        return f"no pods in {namespace} match {selector or '(all)'}"
    return "\n".join(pod_report(kubectl, namespace, p["metadata"]["name"]) for p in pods)


def rljob_status(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    """The RLJob's status (phase, reason, message, conditions, progress, child names)."""
    return dict(kubectl.json("-n", namespace, "get", "rljob", name).get("status") or {})


def rljob_report(kubectl: Kubectl, namespace: str, name: str, selector: str = "") -> str:
    """The RLJob's phase, reason, message and conditions, its Events, and its namespace's pods
    (matching `selector`) with their states, events and logs: what a failed wait shows."""
    try:
        st = rljob_status(kubectl, namespace, name)
    except Exception as exc:
        return f"rljob {namespace}/{name}: cannot read ({exc})"
    lines = [
        f"rljob {namespace}/{name}: phase {st.get('phase')} ({st.get('reason')}): {st.get('message', '')}"
    ]
    lines += [
        f"  {c['type']}={c['status']} ({c.get('reason')}): {str(c.get('message', ''))[:300]}"
        for c in st.get("conditions") or ()
    ]
    events = kubectl(
        "-n", namespace, "get", "events", "--field-selector", f"involvedObject.name={name}",
        "--sort-by=.lastTimestamp", "--no-headers", check=False,
    ).stdout.strip()  # fmt: skip
    if events:
        lines += ["  events:", *(f"    {e[:300]}" for e in events.splitlines()[-EVENT_LINES:])]
    return "\n".join(lines) + "\n" + pods_report(kubectl, namespace, selector)


def poll(
    fn: Callable[[], T | None],
    timeout: float,
    what: str,
    *,
    interval: float = 2.0,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll `fn` until truthy. A RealPodsError from `fn` ends the wait at once (a known failure);
    a timeout raises RealPodsError naming `what`, the last error and `on_timeout()`'s report."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            result = fn()
            if result:
                return result
        except RealPodsError:
            raise
        except Exception as exc:  # not created yet, a transient API error: keep polling
            last = exc
        if time.monotonic() > deadline:
            parts = [f"timed out after {timeout:.0f} s waiting for {what}"]
            if last is not None:
                parts.append(f"last error: {type(last).__name__}: {last}")
            if on_timeout is not None:
                try:
                    parts.append(on_timeout())
                except Exception as exc:
                    parts.append(f"(no report: {exc})")
            raise RealPodsError("\n".join(parts))
        time.sleep(interval)


def ray_pods(kubectl: Kubectl, namespace: str, ray_cluster: str) -> list[dict[str, Any]]:
    pods = kubectl.json("-n", namespace, "get", "pods", "-l", f"ray.io/cluster={ray_cluster}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def wait_ray_pods_ready(
    kubectl: Kubectl, namespace: str, ray_cluster: str, timeout: float = 600
) -> list[dict[str, Any]]:
    """The RayCluster's pods once the head and every desired worker are Ready (they ran `ray start`)."""

    def ready() -> list[dict[str, Any]] | None:
        rc = kubectl.json("-n", namespace, "get", "raycluster", ray_cluster)
        want = 1 + sum(int(g.get("replicas") or 0) for g in rc["spec"].get("workerGroupSpecs") or ())
        pods = ray_pods(kubectl, namespace, ray_cluster)
        if len(pods) == want and all(pod_ready(p) for p in pods):
            return pods
        return None

    return poll(
        ready,
        timeout,
        f"the pods of RayCluster {namespace}/{ray_cluster} to be Ready",
        on_timeout=lambda: pods_report(kubectl, namespace, f"ray.io/cluster={ray_cluster}"),
    )
