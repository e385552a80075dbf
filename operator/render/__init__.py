"""Pure rendering of a resolved RLJob into its Kubernetes children (ConfigMap, RBAC, KubeRay RayJob).

One builder module per child kind (`config`, `rbac`, `rayjob`), composed by `children`.
"""

from .children import SUSPEND_IGNORED, Children, SpecWarning, render_children
from .names import MAX_RAYJOB_NAME, child_name, ray_job_name
from .objects import Owner, owner_reference, passthrough_labels
from .rayjob import PodContext, WorkerGroup, container_env, worker_groups

__all__ = [
    "MAX_RAYJOB_NAME",
    "SUSPEND_IGNORED",
    "Children",
    "Owner",
    "PodContext",
    "SpecWarning",
    "WorkerGroup",
    "child_name",
    "container_env",
    "owner_reference",
    "passthrough_labels",
    "ray_job_name",
    "render_children",
    "worker_groups",
]
