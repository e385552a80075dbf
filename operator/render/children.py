"""RLJob -> Kubernetes children, as plain dicts. Pure: no API calls, no clock, no randomness.

The operator server-side applies what this returns; unit tests inspect it without a cluster.
Children: a ConfigMap with the resolved spec (mounted at /etc/rlkube, read by the entrypoint),
a ServiceAccount + Role + RoleBinding that may only get/patch this RLJob's status, and one
KubeRay RayJob whose RayCluster has a CPU-only head and one GPU worker group (`actor`) or two
(`trainer`, `rollout`) depending on the mode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from rlkube.api.load import dump_resolved, resolve
from rlkube.api.models import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    RLJob,
    RLJobSpec,
    colocated,
    ray_resource_name,
)
from rlkube.api.validation import FORBIDDEN_ENV, InvalidRLJob, validate_rljob
from rlkube.runtime.platform.env import ray_container_env

from .names import child_name, ray_job_name

CONFIG_DIR = "/etc/rlkube"
CONFIG_FILE = "rljob.yaml"
ENTRYPOINT = f"rlkube-train --rljob {CONFIG_DIR}/{CONFIG_FILE}"
MANAGED_BY = {"app.kubernetes.io/managed-by": "rlkube"}
JOB_LABEL = f"{GROUP}/rljob"
GROUP_LABEL = f"{GROUP}/group"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Labels of the RLJob that schedulers read from the RayJob (Kueue) or its pods (Volcano).
PASSTHROUGH_PREFIXES = ("kueue.x-k8s.io/", "volcano.sh/", "ray.io/scheduler-name")
CHECKPOINT_MOUNT = "/checkpoints"


class RenderDefaults(BaseModel):
    """Admin-owned defaults (the Helm chart's `runtimeDefaults`); a user's RLJob wins where both set.

    Kubeflow Trainer v2's persona split: platform admins decide images, pull secrets, head size and
    shared-memory size once; users write short RLJobs.
    """

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    image: str | None = Field(
        default=None, description="Runtime image for every vendor (overrides vendorImages)."
    )
    vendor_images: dict[str, str] = Field(
        default_factory=lambda: {
            "amd": "rlkube/runtime-rocm:0.1.0",
            "nvidia": "rlkube/runtime-cuda:0.1.0",
            "cpu": "rlkube/runtime-cpu:0.1.0",
        },
        description="Default runtime image per gpu.vendor.",
    )
    image_pull_policy: str = Field(default="IfNotPresent", description="Default pull policy.")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Pull secrets on every pod.")
    head_cpu: int = Field(default=2, ge=1, description="Ray head CPU cores (also its Ray num-cpus).")
    head_memory: str = Field(default="8Gi", description="Ray head memory.")
    head_shm_size: str = Field(default="2Gi", description="/dev/shm size on the head.")
    shm_size: str = Field(
        default="16Gi", description="/dev/shm size on workers unless the RLJob sets shmSize."
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


@dataclass
class Children:
    """Everything one RLJob owns. `manage_suspend` is False when Kueue owns RayJob.spec.suspend."""

    config_map: dict[str, Any]
    service_account: dict[str, Any]
    role: dict[str, Any]
    role_binding: dict[str, Any]
    ray_job: dict[str, Any]
    manage_suspend: bool = True
    warnings: list[str] = field(default_factory=list)

    def all(self) -> list[dict[str, Any]]:
        """Children in apply order: RBAC and config before the RayJob that uses them."""
        return [self.service_account, self.role, self.role_binding, self.config_map, self.ray_job]


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """The controller reference that makes the RLJob's deletion garbage-collect the child."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(
    name: str, namespace: str, job: str, uid: str, extra_labels: dict[str, str] | None = None
) -> dict[str, Any]:
    labels = {**MANAGED_BY, JOB_LABEL: job, **(extra_labels or {})}
    return {
        "name": name,
        "namespace": namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(job, uid)],
    }


def passthrough_labels(labels: dict[str, str]) -> dict[str, str]:
    """The RLJob labels that go onto the RayJob for queueing/gang scheduling (Kueue, Volcano)."""
    return {k: v for k, v in labels.items() if k.startswith(PASSTHROUGH_PREFIXES)}


def container_env(
    spec: RLJobSpec, *, job: str, namespace: str, defaults: RenderDefaults, group: str
) -> list[dict[str, str]]:
    """Env of every Ray container: platform < admin defaults < spec.env < rlkube's identity vars.

    ROCR_VISIBLE_DEVICES never appears, whoever asked for it (Ray refuses it next to HIP/CUDA masks).
    """
    env: dict[str, str] = dict(ray_container_env(spec.gpu.vendor, spec.rollout.engine))
    env.update(defaults.extra_env)
    env.update({e.name: e.value for e in spec.env})
    env.update(
        {
            "RLKUBE_RLJOB_NAME": job,
            "RLKUBE_RLJOB_NAMESPACE": namespace,
            "RLKUBE_RLJOB_FILE": f"{CONFIG_DIR}/{CONFIG_FILE}",
            "RLKUBE_RAY_GROUP": group,
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
    spec: RLJobSpec, config_map: str, shm_size: str, *, checkpoints: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
        {"name": "rljob-config", "configMap": {"name": config_map}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "rljob-config", "mountPath": CONFIG_DIR, "readOnly": True},
    ]
    if checkpoints and spec.checkpoint.persistent_volume_claim:
        volumes.append(
            {
                "name": "checkpoints",
                "persistentVolumeClaim": {"claimName": spec.checkpoint.persistent_volume_claim},
            }
        )
        mounts.append({"name": "checkpoints", "mountPath": spec.checkpoint.path or CHECKPOINT_MOUNT})
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


def _image(spec: RLJobSpec, defaults: RenderDefaults) -> tuple[str, str]:
    image = (
        spec.image
        or defaults.image
        or defaults.vendor_images.get(spec.gpu.vendor)
        or "rlkube/runtime-rocm:0.1.0"
    )
    return image, spec.image_pull_policy or defaults.image_pull_policy


def _pod_spec(
    spec: RLJobSpec,
    *,
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
    service_account: str,
    defaults: RenderDefaults,
    node_selector: dict[str, str],
    tolerations: list[dict[str, Any]],
) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "serviceAccountName": service_account,
        "containers": [container],
        "volumes": volumes,
    }
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    if defaults.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in defaults.image_pull_secrets]
    if spec.priority_class_name:
        pod["priorityClassName"] = spec.priority_class_name
    return pod


def _worker_group(
    spec: RLJobSpec,
    *,
    group: str,
    replicas: int,
    gpus: int,
    cpus: int,
    memory: str,
    shm_size: str | None,
    checkpoints: bool,
    job: str,
    namespace: str,
    config_map: str,
    service_account: str,
    defaults: RenderDefaults,
) -> dict[str, Any]:
    """One Ray worker group whose containers[0] limits the GPUs and advertises `rlkube_<group>`."""
    resource = spec.gpu.resource_name  # resolved: None only for vendor cpu
    params: dict[str, Any] = {"num-cpus": cpus}
    if resource is None:
        params["num-gpus"] = 0
    elif not resource.endswith("gpu"):
        # KubeRay maps only limits ending in "gpu" to Ray GPUs; partitions (amd.com/cpx_nps4) need this.
        params["num-gpus"] = gpus
    params["resources"] = _ray_resources({ray_resource_name(group): max(gpus, 1)})
    limits: dict[str, Any] = {"cpu": str(cpus), "memory": memory}
    if resource is not None and gpus > 0:
        limits[resource] = str(gpus)
    volumes, mounts = _volumes_and_mounts(
        spec, config_map, shm_size or defaults.shm_size, checkpoints=checkpoints
    )
    image, pull = _image(spec, defaults)
    container = {
        "name": "ray-worker",
        "image": image,
        "imagePullPolicy": pull,
        "env": container_env(spec, job=job, namespace=namespace, defaults=defaults, group=group),
        "resources": {"requests": {"cpu": _cpu_request(cpus, defaults), "memory": memory}, "limits": limits},
        "volumeMounts": mounts,
    }
    node_selector = dict(spec.gpu.node_selector)
    if spec.gpu.product_name:
        node_selector["amd.com/gpu.product-name"] = spec.gpu.product_name
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.gpu.tolerations or []]
    return {
        "groupName": group,
        "replicas": replicas,
        "minReplicas": replicas,
        "maxReplicas": replicas,
        "rayStartParams": _ray_params(params),
        "template": {
            "metadata": {"labels": {**MANAGED_BY, JOB_LABEL: job, GROUP_LABEL: group}},
            "spec": _pod_spec(
                spec,
                container=container,
                volumes=volumes,
                service_account=service_account,
                defaults=defaults,
                node_selector=node_selector,
                tolerations=tolerations,
            ),
        },
    }


def _head_group(
    spec: RLJobSpec,
    *,
    job: str,
    namespace: str,
    config_map: str,
    service_account: str,
    defaults: RenderDefaults,
) -> dict[str, Any]:
    """The CPU-only head: runs the driver (the entrypoint), never a model; Ray num-gpus is 0."""
    cpus = spec.head.cpu or defaults.head_cpu
    memory = spec.head.memory or defaults.head_memory
    volumes, mounts = _volumes_and_mounts(spec, config_map, defaults.head_shm_size, checkpoints=False)
    image, pull = _image(spec, defaults)
    container = {
        "name": "ray-head",
        "image": image,
        "imagePullPolicy": pull,
        "env": container_env(spec, job=job, namespace=namespace, defaults=defaults, group="head"),
        "resources": {
            "requests": {"cpu": _cpu_request(cpus, defaults), "memory": memory},
            "limits": {"cpu": str(cpus), "memory": memory},
        },
        "volumeMounts": mounts,
    }
    return {
        "rayStartParams": _ray_params({"num-gpus": 0, "num-cpus": cpus, "dashboard-host": "0.0.0.0"}),
        "template": {
            "metadata": {"labels": {**MANAGED_BY, JOB_LABEL: job, GROUP_LABEL: "head"}},
            "spec": _pod_spec(
                spec,
                container=container,
                volumes=volumes,
                service_account=service_account,
                defaults=defaults,
                node_selector=dict(defaults.head_node_selector),
                tolerations=list(defaults.head_tolerations),
            ),
        },
    }


def _submitter_template(head: dict[str, Any], defaults: RenderDefaults) -> dict[str, Any]:
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


def render_children(
    job: RLJob,
    *,
    name: str,
    namespace: str,
    uid: str,
    operator_image_defaults: RenderDefaults | None = None,
) -> Children:
    """Render every child of the RLJob `name` in `namespace` (owner uid `uid`).

    Raises InvalidRLJob when the spec fails validation: an invalid RLJob gets no children.
    """
    defaults = operator_image_defaults or RenderDefaults()
    metadata = {**job.metadata, "name": name, "namespace": namespace, "uid": uid}
    job = RLJob(metadata=metadata, spec=job.spec)
    errors = validate_rljob(job)
    if errors:
        raise InvalidRLJob(errors)
    resolved = resolve(job)
    spec = resolved.spec
    labels = {str(k): str(v) for k, v in (job.metadata.get("labels") or {}).items()}
    queued = KUEUE_QUEUE_LABEL in labels

    sa_name = spec.service_account_name or child_name(name, "runtime")
    rbac_name = child_name(name, "runtime")
    cm_name = child_name(name, "config")

    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(cm_name, namespace, name, uid),
        "data": {CONFIG_FILE: dump_resolved(job)},
    }
    service_account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(rbac_name, namespace, name, uid),
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(rbac_name, namespace, name, uid),
        "rules": [
            {"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": [name], "verbs": ["get"]},
            {
                "apiGroups": [GROUP],
                "resources": [f"{PLURAL}/status"],
                "resourceNames": [name],
                "verbs": ["get", "patch"],
            },
        ],
    }
    role_binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(rbac_name, namespace, name, uid),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": rbac_name},
        "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": namespace}],
    }

    def worker(**kw: Any) -> dict[str, Any]:
        return _worker_group(
            spec,
            job=name,
            namespace=namespace,
            config_map=cm_name,
            service_account=sa_name,
            defaults=defaults,
            **kw,
        )

    rollout_gpus_per_pod = spec.rollout.gpus_per_replica or 0
    if colocated(spec):
        groups = [
            worker(
                group="actor",
                replicas=spec.trainer.replicas,
                gpus=spec.trainer.gpus_per_replica,
                cpus=spec.trainer.cpus_per_replica,
                memory=spec.trainer.memory,
                shm_size=spec.trainer.shm_size,
                checkpoints=True,
            )
        ]
    else:
        groups = [
            worker(
                group="trainer",
                replicas=spec.trainer.replicas,
                gpus=spec.trainer.gpus_per_replica,
                cpus=spec.trainer.cpus_per_replica,
                memory=spec.trainer.memory,
                shm_size=spec.trainer.shm_size,
                checkpoints=True,
            ),
            worker(
                group="rollout",
                replicas=spec.rollout.replicas,
                gpus=rollout_gpus_per_pod,
                cpus=spec.rollout.cpus_per_replica,
                memory=spec.rollout.memory,
                shm_size=spec.rollout.shm_size,
                checkpoints=False,
            ),
        ]

    cluster_spec: dict[str, Any] = {
        "headGroupSpec": _head_group(
            spec,
            job=name,
            namespace=namespace,
            config_map=cm_name,
            service_account=sa_name,
            defaults=defaults,
        ),
        "workerGroupSpecs": groups,
    }
    if defaults.ray_version:
        cluster_spec = {"rayVersion": defaults.ray_version, **cluster_spec}

    ray_spec: dict[str, Any] = {
        "entrypoint": ENTRYPOINT,
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": spec.ttl_seconds_after_finished,
        "backoffLimit": spec.backoff_limit,
    }
    if spec.active_deadline_seconds is not None:
        ray_spec["activeDeadlineSeconds"] = spec.active_deadline_seconds
    ray_spec["submitterPodTemplate"] = _submitter_template(cluster_spec["headGroupSpec"], defaults)
    if not queued:
        # With a Kueue queue label, Kueue alone toggles suspend: leaving it out of the applied manifest
        # means rlkube's field manager never owns it, so the two never fight.
        ray_spec["suspend"] = spec.suspend
    ray_spec["rayClusterSpec"] = cluster_spec

    ray_job = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": _meta(ray_job_name(name), namespace, name, uid, passthrough_labels(labels)),
        "spec": ray_spec,
    }
    warnings = []
    if queued and spec.suspend:
        warnings.append("spec.suspend is ignored while kueue.x-k8s.io/queue-name is set: Kueue owns suspend")
    return Children(
        config_map=config_map,
        service_account=service_account,
        role=role,
        role_binding=role_binding,
        ray_job=ray_job,
        manage_suspend=not queued,
        warnings=warnings,
    )
