"""Where the control plane's binaries live, keyed by the versions pinned in the wrapper modules.

`devcluster/tools/build.sh` writes them to `$RLKUBE_CACHE/<component>-<version>/bin`; this module
reads the same go.mod files so Python and the build script can never disagree about a version.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import DevClusterError

TOOLS_DIR = Path(__file__).resolve().parent / "tools"
REPO_ROOT = TOOLS_DIR.parent.parent

# component -> (wrapper dir, module whose version keys the cache, binaries it provides)
_COMPONENTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "kubernetes": (
        "kubernetes",
        "k8s.io/kubernetes",
        ("kube-apiserver", "kube-controller-manager", "kube-scheduler"),
    ),
    "etcd": ("etcd", "go.etcd.io/etcd/server/v3", ("etcd",)),
    "kwok": ("kwok", "sigs.k8s.io/kwok", ("kwok",)),
    "kuberay": ("kuberay", "github.com/ray-project/kuberay/ray-operator", ("ray-operator",)),
    "helm": ("helm", "helm.sh/helm/v4", ("helm",)),
    # The real node's programs (devcluster/node.py); kubelet/kube-proxy share kubernetes' version.
    "kubernetes-node": ("kubernetes", "k8s.io/kubernetes", ("kubelet", "kube-proxy")),
    "coredns": ("coredns", "github.com/coredns/coredns", ("coredns",)),
}


def cache_dir() -> Path:
    """The build cache root (same default as build.sh)."""
    return Path(os.environ.get("RLKUBE_CACHE", str(Path.home() / ".cache" / "rlkube")))


def module_version(component: str) -> str:
    """The version of a component's module as pinned in its wrapper go.mod."""
    wrapper, module, _ = _COMPONENTS[component]
    gomod = TOOLS_DIR / wrapper / "go.mod"
    for raw in gomod.read_text().splitlines():
        words = raw.split()
        if words[:1] == ["require"] and len(words) >= 3 and words[1] == module:
            return words[2]
        if len(words) >= 2 and words[0] == module:
            return words[1]
    raise DevClusterError(f"cannot find {module} in {gomod}")


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every program the local control plane runs."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kwok: Path
    ray_operator: Path
    kuberay_crds: Path
    kwok_stages: Path
    kubectl: Path | None

    def versions(self) -> dict[str, str]:
        return {c: module_version(c) for c in ("kubernetes", "etcd", "kwok", "kuberay")}


def find_binaries() -> Binaries:
    """Locate all binaries, failing with the exact build command when any is missing."""
    root = cache_dir()
    paths: dict[str, Path] = {}
    missing: list[str] = []
    for component in ("kubernetes", "etcd", "kwok", "kuberay"):
        version = module_version(component)
        for name in _COMPONENTS[component][2]:
            path = root / f"{component}-{version}" / "bin" / name
            paths[name] = path
            if not os.access(path, os.X_OK):
                missing.append(str(path))
    crds = root / f"kuberay-{module_version('kuberay')}" / "crds"
    if not (crds / "ray.io_rayclusters.yaml").is_file():
        missing.append(str(crds / "ray.io_rayclusters.yaml"))
    stages = root / f"kwok-{module_version('kwok')}" / "stages"
    if not (stages / "pod-ready.yaml").is_file():
        missing.append(str(stages / "pod-ready.yaml"))
    if missing:
        raise DevClusterError(
            "control-plane binaries are missing (run `make cluster-build` or "
            "`bash devcluster/tools/build.sh`):\n  " + "\n  ".join(missing)
        )
    kubectl = shutil.which("kubectl")
    return Binaries(
        etcd=paths["etcd"],
        kube_apiserver=paths["kube-apiserver"],
        kube_controller_manager=paths["kube-controller-manager"],
        kube_scheduler=paths["kube-scheduler"],
        kwok=paths["kwok"],
        ray_operator=paths["ray-operator"],
        kuberay_crds=crds,
        kwok_stages=stages,
        kubectl=Path(kubectl) if kubectl else None,
    )
