"""A real local Kubernetes control plane with fake AMD GPU nodes (see docs/devcluster.md)."""

from .binaries import Binaries, find_binaries, module_version
from .cluster import ClusterConfig, DevCluster, default_state_dir, listening_ports, listening_sockets
from .errors import DevClusterError
from .nodes import GPU_RESOURCE, MI300X, MI355X, GpuProfile

__all__ = [
    "GPU_RESOURCE",
    "MI300X",
    "MI355X",
    "Binaries",
    "ClusterConfig",
    "DevCluster",
    "DevClusterError",
    "GpuProfile",
    "default_state_dir",
    "find_binaries",
    "listening_ports",
    "listening_sockets",
    "module_version",
]
