"""A resolved RLJob -> its Kubernetes children, as plain dicts. Pure: no API calls, no clock, no randomness.

The operator validates and resolves the RLJob once, at the edge, then server-side applies what this
returns; unit tests inspect it without a cluster. One builder per child kind, as KubeRay's are:
`config` (the ConfigMap with the resolved spec), `rbac` (ServiceAccount + Role + RoleBinding that may
only get/patch this RLJob's status) and `rayjob` (the RayJob with its head and worker groups).
This module composes them and alone decides the labels, Kueue's ownership of `suspend`, and the
warnings a user should see as Events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlkube.api import RenderDefaults, RLJob, is_resolved
from rlkube.api.contract import KUEUE_QUEUE_LABEL

from .config import config_map_name, render_config_map
from .objects import Owner
from .rayjob import PodContext, render_ray_job
from .rbac import render_runtime_rbac, runtime_rbac_name


@dataclass(frozen=True)
class SpecWarning:
    """Something in the spec that renders but does not do what it says (posted as a Warning Event)."""

    reason: str
    message: str


SUSPEND_IGNORED = SpecWarning(
    "SuspendIgnored", f"spec.suspend is ignored while {KUEUE_QUEUE_LABEL} is set: Kueue owns suspend"
)


@dataclass
class Children:
    """Everything one RLJob owns. `manage_suspend` is False when Kueue owns RayJob.spec.suspend.

    `warnings` are about the spec as written (e.g. a setting that has no effect); the operator posts
    each as a Warning Event on the RLJob.
    """

    config_map: dict[str, Any]
    service_account: dict[str, Any]
    role: dict[str, Any]
    role_binding: dict[str, Any]
    ray_job: dict[str, Any]
    manage_suspend: bool = True
    warnings: list[SpecWarning] = field(default_factory=list)

    def all(self) -> list[dict[str, Any]]:
        """Children in apply order: RBAC and config before the RayJob that uses them."""
        return [self.service_account, self.role, self.role_binding, self.config_map, self.ray_job]


def render_children(job: RLJob, defaults: RenderDefaults | None = None) -> Children:
    """Render every child of `job`: the output of `rlkube.api.resolve` of a valid RLJob whose metadata
    carries the live object's name, namespace, uid and labels.

    Raises ValueError for a job that was not resolved (validation and defaults happen once, at the edge).
    """
    if not is_resolved(job):
        raise ValueError("render_children takes rlkube.api.resolve(job) of a validated RLJob")
    defaults = defaults or RenderDefaults()
    owner = Owner.of(job)
    spec = job.spec
    service_account = spec.service_account_name or runtime_rbac_name(owner)
    rbac = render_runtime_rbac(owner, service_account)
    ctx = PodContext(
        spec=spec,
        owner=owner,
        config_map=config_map_name(owner),
        service_account=service_account,
        defaults=defaults,
    )
    warnings: list[SpecWarning] = []
    if owner.kueue_managed and spec.suspend:
        warnings.append(SUSPEND_IGNORED)
    return Children(
        config_map=render_config_map(job, owner),
        service_account=rbac.service_account,
        role=rbac.role,
        role_binding=rbac.role_binding,
        ray_job=render_ray_job(ctx),
        manage_suspend=not owner.kueue_managed,
        warnings=warnings,
    )
