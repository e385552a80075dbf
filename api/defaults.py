"""Admin-owned render defaults: the Helm chart's `runtimeDefaults`, read by the operator's renderer.

Kubeflow Trainer v2's persona split: platform admins decide images, pull secrets, head size and
shared-memory size once; users write short RLJobs, and a user's RLJob wins where both set a value.
It lives in the shared contract because the chart, the docs and the renderer all read it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from .models import BYTES_PATTERN, IMAGE_PATTERN

# The image of last resort when neither the RLJob nor the admin names one for the vendor.
FALLBACK_IMAGE = "rlkube/runtime-rocm:0.1.0"


class RenderDefaults(BaseModel):
    """Admin-owned defaults (the chart's `runtimeDefaults`, camelCase keys, unknown keys refused)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    image: str | None = Field(
        default=None,
        pattern=IMAGE_PATTERN,
        description="Runtime image for every vendor (overrides vendorImages).",
    )
    vendor_images: dict[str, str] = Field(
        default_factory=lambda: {
            "amd": FALLBACK_IMAGE,
            "nvidia": "rlkube/runtime-cuda:0.1.0",
            "cpu": "rlkube/runtime-cpu:0.1.0",
        },
        description="Default runtime image per gpu.vendor.",
    )
    image_pull_policy: str = Field(default="IfNotPresent", description="Default pull policy.")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Pull secrets on every pod.")
    head_cpu: int = Field(default=2, ge=1, description="Ray head CPU cores (also its Ray num-cpus).")
    head_memory: str = Field(default="8Gi", pattern=BYTES_PATTERN, description="Ray head memory.")
    head_shm_size: str = Field(default="2Gi", pattern=BYTES_PATTERN, description="/dev/shm size on the head.")
    shm_size: str = Field(
        default="16Gi",
        pattern=BYTES_PATTERN,
        description="/dev/shm size on workers unless the RLJob sets shmSize.",
    )
    extra_env: dict[str, str] = Field(
        default_factory=dict,
        description="Env on every Ray container, over the platform values, under spec.env.",
    )
    head_node_selector: dict[str, str] = Field(default_factory=dict, description="Node selector of the head.")
    head_tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="Tolerations of the head (and of KubeRay's submitter pod)."
    )
    cpu_request_percent: int = Field(
        default=100,
        ge=1,
        le=100,
        description="CPU requests as a percent of the CPU limits (overcommit, as OpenShift's "
        "ClusterResourceOverride does); Ray's num-cpus stays the limit.",
    )
    ray_version: str | None = Field(default=None, description="rayClusterSpec.rayVersion, when set.")
