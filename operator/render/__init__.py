"""Pure rendering of an RLJob into its Kubernetes children (ConfigMap, RBAC, KubeRay RayJob)."""

from .children import (
    CONFIG_DIR,
    CONFIG_FILE,
    ENTRYPOINT,
    GROUP_LABEL,
    JOB_LABEL,
    KUEUE_QUEUE_LABEL,
    Children,
    RenderDefaults,
    container_env,
    owner_reference,
    passthrough_labels,
    render_children,
)
from .names import MAX_RAYJOB_NAME, child_name, ray_job_name

__all__ = [
    "CONFIG_DIR",
    "CONFIG_FILE",
    "ENTRYPOINT",
    "GROUP_LABEL",
    "JOB_LABEL",
    "KUEUE_QUEUE_LABEL",
    "MAX_RAYJOB_NAME",
    "Children",
    "RenderDefaults",
    "child_name",
    "container_env",
    "owner_reference",
    "passthrough_labels",
    "ray_job_name",
    "render_children",
]
