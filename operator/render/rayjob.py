"""The RayJob child: its RayCluster's CPU-only head and one (`actor`) or two (`trainer`, `rollout`)
GPU worker groups, with the AMD/KubeRay details (visibility env, Ray resources, /dev/shm) right."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rlkube.api import RenderDefaults, RLJobSpec, colocated, ray_resource_name
from rlkube.api import worker_groups as group_names
from rlkube.api.contract import (
    CHECKPOINT_MOUNT,
    CHECKPOINT_VOLUME,
    CONFIG_DIR,
    CONFIG_PATH,
    CONFIG_VOLUME,
    ENTRYPOINT,
    ENV_RAY_GROUP,
    ENV_RLJOB_FILE,
    ENV_RLJOB_NAME,
    ENV_RLJOB_NAMESPACE,
    FORBIDDEN_ENV,
    GROUP_LABEL,
    SHM_PATH,
    SHM_VOLUME,
)
from rlkube.api.defaults import FALLBACK_IMAGE
from rlkube.api.platform_env import ray_container_env

from .names import ray_job_name
from .objects import Owner, job_labels, object_meta, passthrough_labels

HEAD_GROUP = "head"


@dataclass(frozen=True)
class PodContext:
    """What every Ray pod of one RLJob is rendered from (the resolved spec and the admin defaults)."""

    spec: RLJobSpec
    owner: Owner
    config_map: str
    service_account: str
    defaults: RenderDefaults


@dataclass(frozen=True)
class WorkerGroup:
    """One Ray worker group: its pods' size, and whether it mounts the checkpoint claim (training only)."""

    name: str
    replicas: int
    gpus: int
    cpus: int
    memory: str
    shm_size: str | None
    checkpoints: bool


def _training_group(spec: RLJobSpec, name: str) -> WorkerGroup:
    """The group the trainer runs in (`actor` when it shares its GPUs with the rollout)."""
    t = spec.trainer
    return WorkerGroup(name, t.replicas, t.gpus_per_replica, t.cpus_per_replica, t.memory, t.shm_size, True)


def worker_groups(spec: RLJobSpec) -> list[WorkerGroup]:
    """`actor` when trainer and rollout share GPUs, else `trainer` and `rollout` (separate_async).

    The names are the API's (`rlkube.api.worker_groups`): the runtime places its actors by them.
    """
    names = group_names(spec)
    if colocated(spec):
        return [_training_group(spec, names[0])]
    r = spec.rollout
    rollout = WorkerGroup(
        names[1], r.replicas, r.gpus_per_replica or 0, r.cpus_per_replica, r.memory, r.shm_size, False
    )
    return [_training_group(spec, names[0]), rollout]


def container_env(ctx: PodContext, group: str) -> list[dict[str, str]]:
    """Env of every Ray container: platform < admin defaults < spec.env < rlkube's identity vars.

    ROCR_VISIBLE_DEVICES never appears, whoever asked for it (Ray refuses it next to HIP/CUDA masks).
    """
    spec = ctx.spec
    env: dict[str, str] = dict(ray_container_env(spec.gpu.vendor, spec.rollout.engine))
    env.update(ctx.defaults.extra_env)
    env.update({e.name: e.value for e in spec.env})
    env.update(
        {
            ENV_RLJOB_NAME: ctx.owner.name,
            ENV_RLJOB_NAMESPACE: ctx.owner.namespace,
            ENV_RLJOB_FILE: CONFIG_PATH,
            ENV_RAY_GROUP: group,
        }
    )
    env.pop(FORBIDDEN_ENV, None)
    return [{"name": k, "value": v} for k, v in env.items()]


def _cpu_request(cpus: int, defaults: RenderDefaults) -> str:
    """The CPU request for a limit of `cpus` cores under the admin's cpuRequestPercent."""
    if defaults.cpu_request_percent >= 100:
        return str(cpus)
    return f"{max(1, cpus * 10 * defaults.cpu_request_percent)}m"


def _ray_params(values: dict[str, Any]) -> dict[str, str]:
    """KubeRay requires every rayStartParams value to be a string."""
    return {k: str(v) for k, v in values.items()}


def _ray_resources(resources: dict[str, int]) -> str:
    """rayStartParams `resources`: single-quoted JSON, the form KubeRay itself writes and re-parses."""
    return "'" + json.dumps(resources, sort_keys=True) + "'"


def _volumes_and_mounts(
    ctx: PodContext, shm_size: str, *, checkpoints: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = ctx.spec
    volumes: list[dict[str, Any]] = [
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
        {"name": CONFIG_VOLUME, "configMap": {"name": ctx.config_map}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": SHM_VOLUME, "mountPath": SHM_PATH},
        {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True},
    ]
    if checkpoints and spec.checkpoint.persistent_volume_claim:
        volumes.append(
            {
                "name": CHECKPOINT_VOLUME,
                "persistentVolumeClaim": {"claimName": spec.checkpoint.persistent_volume_claim},
            }
        )
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": spec.checkpoint.path or CHECKPOINT_MOUNT})
    for m in spec.mounts:
        if m.persistent_volume_claim:
            source: dict[str, Any] = {
                "persistentVolumeClaim": {"claimName": m.persistent_volume_claim, "readOnly": m.read_only}
            }
        else:
            source = {"hostPath": {"path": m.host_path, "type": "Directory"}}
        volumes.append({"name": m.name, **source})
        mounts.append({"name": m.name, "mountPath": m.mount_path, "readOnly": m.read_only})
    return volumes, mounts


def _image(ctx: PodContext) -> tuple[str, str]:
    spec, defaults = ctx.spec, ctx.defaults
    image = spec.image or defaults.image or defaults.vendor_images.get(spec.gpu.vendor) or FALLBACK_IMAGE
    return image, spec.image_pull_policy or defaults.image_pull_policy


def _container(
    ctx: PodContext, *, name: str, group: str, resources: dict[str, Any], mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    image, pull = _image(ctx)
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": pull,
        "env": container_env(ctx, group),
        "resources": resources,
        "volumeMounts": mounts,
    }


def _pod_template(
    ctx: PodContext,
    *,
    group: str,
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
    node_selector: dict[str, str],
    tolerations: list[dict[str, Any]],
) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "serviceAccountName": ctx.service_account,
        "containers": [container],
        "volumes": volumes,
    }
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    if ctx.defaults.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in ctx.defaults.image_pull_secrets]
    if ctx.spec.priority_class_name:
        pod["priorityClassName"] = ctx.spec.priority_class_name
    return {"metadata": {"labels": {**job_labels(ctx.owner), GROUP_LABEL: group}}, "spec": pod}


def render_worker_group(ctx: PodContext, group: WorkerGroup) -> dict[str, Any]:
    """One Ray worker group whose containers[0] limits the GPUs and advertises `rlkube_<group>`."""
    spec = ctx.spec
    resource = spec.gpu.resource_name  # resolved: None only for vendor cpu
    params: dict[str, Any] = {"num-cpus": group.cpus}
    if resource is None:
        params["num-gpus"] = 0
    elif not resource.endswith("gpu"):
        # KubeRay maps only limits ending in "gpu" to Ray GPUs; partitions (amd.com/cpx_nps4) need this.
        params["num-gpus"] = group.gpus
    params["resources"] = _ray_resources({ray_resource_name(group.name): max(group.gpus, 1)})
    limits: dict[str, Any] = {"cpu": str(group.cpus), "memory": group.memory}
    if resource is not None and group.gpus > 0:
        limits[resource] = str(group.gpus)
    volumes, mounts = _volumes_and_mounts(
        ctx, group.shm_size or ctx.defaults.shm_size, checkpoints=group.checkpoints
    )
    container = _container(
        ctx,
        name="ray-worker",
        group=group.name,
        resources={
            "requests": {"cpu": _cpu_request(group.cpus, ctx.defaults), "memory": group.memory},
            "limits": limits,
        },
        mounts=mounts,
    )
    node_selector = dict(spec.gpu.node_selector)
    if spec.gpu.product_name:
        node_selector["amd.com/gpu.product-name"] = spec.gpu.product_name
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.gpu.tolerations or []]
    return {
        "groupName": group.name,
        "replicas": group.replicas,
        "minReplicas": group.replicas,
        "maxReplicas": group.replicas,
        "rayStartParams": _ray_params(params),
        "template": _pod_template(
            ctx,
            group=group.name,
            container=container,
            volumes=volumes,
            node_selector=node_selector,
            tolerations=tolerations,
        ),
    }


def render_head_group(ctx: PodContext) -> dict[str, Any]:
    """The CPU-only head: runs the driver (the entrypoint), never a model; Ray num-gpus is 0."""
    cpus = ctx.spec.head.cpu or ctx.defaults.head_cpu
    memory = ctx.spec.head.memory or ctx.defaults.head_memory
    volumes, mounts = _volumes_and_mounts(ctx, ctx.defaults.head_shm_size, checkpoints=False)
    size = {"cpu": str(cpus), "memory": memory}
    container = _container(
        ctx,
        name="ray-head",
        group=HEAD_GROUP,
        resources={"requests": {**size, "cpu": _cpu_request(cpus, ctx.defaults)}, "limits": size},
        mounts=mounts,
    )
    return {
        "rayStartParams": _ray_params({"num-gpus": 0, "num-cpus": cpus, "dashboard-host": "0.0.0.0"}),
        "template": _pod_template(
            ctx,
            group=HEAD_GROUP,
            container=container,
            volumes=volumes,
            node_selector=dict(ctx.defaults.head_node_selector),
            tolerations=list(ctx.defaults.head_tolerations),
        ),
    }


def render_submitter_template(head: dict[str, Any]) -> dict[str, Any]:
    """KubeRay's submitter pod (it runs `ray job submit`), placed where the head goes.

    KubeRay's default has no placement, so it could land on any node (a GPU node, or one the head
    cannot be reached from); its command and env stay KubeRay's (left unset here).
    """
    head_spec = head["template"]["spec"]
    container = head_spec["containers"][0]
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "ray-job-submitter",
                "image": container["image"],
                "imagePullPolicy": container["imagePullPolicy"],
                "resources": {
                    "requests": {"cpu": "100m", "memory": "200Mi"},
                    "limits": {"cpu": "1", "memory": "1Gi"},
                },
            }
        ],
    }
    for key in ("nodeSelector", "tolerations", "imagePullSecrets", "priorityClassName"):
        if key in head_spec:
            pod[key] = head_spec[key]
    return {"spec": pod}


def render_ray_job(ctx: PodContext) -> dict[str, Any]:
    """The RayJob. Under Kueue (`owner.kueue_managed`) `spec.suspend` is left out: Kueue owns it."""
    spec = ctx.spec
    cluster_spec: dict[str, Any] = {
        "headGroupSpec": render_head_group(ctx),
        "workerGroupSpecs": [render_worker_group(ctx, g) for g in worker_groups(spec)],
    }
    if ctx.defaults.ray_version:
        cluster_spec = {"rayVersion": ctx.defaults.ray_version, **cluster_spec}
    ray_spec: dict[str, Any] = {
        "entrypoint": ENTRYPOINT,
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": spec.ttl_seconds_after_finished,
        "backoffLimit": spec.backoff_limit,
    }
    if spec.active_deadline_seconds is not None:
        ray_spec["activeDeadlineSeconds"] = spec.active_deadline_seconds
    ray_spec["submitterPodTemplate"] = render_submitter_template(cluster_spec["headGroupSpec"])
    if not ctx.owner.kueue_managed:
        # With a Kueue queue label, Kueue alone toggles suspend: leaving it out of the applied manifest
        # means rlkube's field manager never owns it, so the two never fight.
        ray_spec["suspend"] = spec.suspend
    ray_spec["rayClusterSpec"] = cluster_spec
    owner = ctx.owner
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": object_meta(ray_job_name(owner.name), owner, passthrough_labels(owner.labels)),
        "spec": ray_spec,
    }
