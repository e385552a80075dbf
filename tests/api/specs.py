"""Spec builders shared by the API and render tests (plain dicts, as a user writes YAML)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def minimal() -> dict[str, Any]:
    """The smallest valid RLJob: a model, prompts and a reward; everything else defaults."""
    return {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "job", "namespace": "ns"},
        "spec": {"model": {"path": "/models/m"}, "data": {"train": "/data/t.parquet", "reward": "gsm8k"}},
    }


def separate(**spec: Any) -> dict[str, Any]:
    """A valid separate_async 4+4 job, with `spec` merged over it (one level deep)."""
    job = minimal()
    job["spec"].update(
        {
            "training": {"mode": "separate_async", "trainBatchSize": 128, "miniBatchSize": 32},
            "trainer": {"gpusPerReplica": 4},
            "rollout": {"gpusPerReplica": 4},
            "async": {"parameterSyncStep": 4},
        }
    )
    return merge(job, spec)


def merge(job: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Copy of `job` with each `spec` block merged one level deep (None deletes the block)."""
    out = copy.deepcopy(job)
    for key, value in spec.items():
        if value is None:
            out["spec"].pop(key, None)
        elif isinstance(value, dict) and isinstance(out["spec"].get(key), dict):
            out["spec"][key] = {**out["spec"][key], **value}
        else:
            out["spec"][key] = value
    return out


def cpu(**spec: Any) -> dict[str, Any]:
    """A valid CPU-only job."""
    return merge(minimal(), {"gpu": {"vendor": "cpu"}, "trainer": {"gpusPerReplica": 0}, **spec})


# (case id, RLJob dict, the field the error must name)
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("megatron", merge(minimal(), {"trainer": {"strategy": "megatron"}}), "spec.trainer.strategy"),
    ("async-in-sync", merge(minimal(), {"async": {"stalenessThreshold": 0.5}}), "spec.async"),
    (
        "separate-batch-product",
        separate(training={"mode": "separate_async", "trainBatchSize": 96, "miniBatchSize": 32}),
        "spec.training.trainBatchSize",
    ),
    (
        "separate-default-sync-step",
        separate(**{"async": None}),
        "spec.training.trainBatchSize",
    ),
    (
        "mini-over-train",
        merge(minimal(), {"training": {"trainBatchSize": 8, "miniBatchSize": 16}}),
        "spec.training.miniBatchSize",
    ),
    (
        "train-not-multiple",
        merge(minimal(), {"training": {"trainBatchSize": 24, "miniBatchSize": 16}}),
        "spec.training.trainBatchSize",
    ),
    ("separate-no-rollout-gpus", separate(rollout={"gpusPerReplica": None}), "spec.rollout.gpusPerReplica"),
    (
        "rollout-tp",
        separate(rollout={"gpusPerReplica": 4, "tensorParallelSize": 3}),
        "spec.rollout.gpusPerReplica",
    ),
    (
        "colocated-tp",
        merge(minimal(), {"trainer": {"gpusPerReplica": 4}, "rollout": {"tensorParallelSize": 8}}),
        "spec.rollout.tensorParallelSize",
    ),
    (
        "colocated-overflow",
        merge(minimal(), {"trainer": {"gpusPerReplica": 4}, "rollout": {"replicas": 2, "gpusPerReplica": 4}}),
        "spec.rollout.gpusPerReplica",
    ),
    (
        "amd-nvidia-resource",
        merge(minimal(), {"gpu": {"vendor": "amd", "resourceName": "nvidia.com/gpu"}}),
        "spec.gpu.resourceName",
    ),
    (
        "nvidia-amd-resource",
        merge(minimal(), {"gpu": {"vendor": "nvidia", "resourceName": "amd.com/gpu"}}),
        "spec.gpu.resourceName",
    ),
    ("cpu-resource", cpu(gpu={"vendor": "cpu", "resourceName": "amd.com/gpu"}), "spec.gpu.resourceName"),
    (
        "product-on-nvidia",
        merge(minimal(), {"gpu": {"vendor": "nvidia", "productName": "MI300X"}}),
        "spec.gpu.productName",
    ),
    (
        "mini-batch-not-split-by-ranks",
        merge(
            minimal(),
            {
                "trainer": {"replicas": 2, "gpusPerReplica": 4},
                "training": {"miniBatchSize": 12, "trainBatchSize": 24},
            },
        ),
        "spec.training.miniBatchSize",
    ),
    (
        "cpu-ranks-mini-batch",
        cpu(trainer={"gpusPerReplica": 4}, training={"miniBatchSize": 6, "trainBatchSize": 12}),
        "spec.training.miniBatchSize",
    ),
    (
        "rollout-pod-not-split-by-tp",
        separate(rollout={"gpusPerReplica": 4, "tensorParallelSize": 3}),
        "spec.rollout.tensorParallelSize",
    ),
    (
        "colocated-tp-beyond-trainer-pod",
        merge(minimal(), {"trainer": {"gpusPerReplica": 2}, "rollout": {"tensorParallelSize": 4}}),
        "spec.rollout.tensorParallelSize",
    ),
    ("gpu-without-gpus", merge(minimal(), {"trainer": {"gpusPerReplica": 0}}), "spec.trainer.gpusPerReplica"),
    ("cpu-rollout-gpus", cpu(rollout={"gpusPerReplica": 2}), "spec.rollout.gpusPerReplica"),
    ("gpu-rollout-zero", merge(minimal(), {"rollout": {"gpusPerReplica": 0}}), "spec.rollout.gpusPerReplica"),
    ("cpu-sglang", cpu(rollout={"engine": "sglang"}), "spec.rollout.engine"),
    (
        "too-long-for-model",
        merge(
            minimal(),
            {"model": {"path": "/m", "maxPositionEmbeddings": 4096}, "data": {"maxResponseLength": 4096}},
        ),
        "spec.data.maxResponseLength",
    ),
    ("grpo-group-of-one", merge(minimal(), {"algorithm": {"groupSize": 1}}), "spec.algorithm.groupSize"),
    (
        "rloo-group-of-one",
        merge(minimal(), {"algorithm": {"name": "ppo", "advantageEstimator": "rloo", "groupSize": 1}}),
        "spec.algorithm.groupSize",
    ),
    (
        "gspo-token-mean",
        merge(minimal(), {"algorithm": {"policyLoss": "gspo", "lossAggregation": "token-mean"}}),
        "spec.algorithm.lossAggregation",
    ),
    (
        "overlong-buffer-too-long",
        merge(
            minimal(),
            {"algorithm": {"overlongBuffer": {"length": 2048}}, "data": {"maxResponseLength": 1024}},
        ),
        "spec.algorithm.overlongBuffer.length",
    ),
    (
        "eval-without-validation",
        merge(minimal(), {"training": {"evalIntervalSteps": 5}}),
        "spec.training.evalIntervalSteps",
    ),
    (
        "relative-ckpt-on-pvc",
        merge(minimal(), {"checkpoint": {"persistentVolumeClaim": "c", "path": "ckpt"}}),
        "spec.checkpoint.path",
    ),
    ("rocr-env", merge(minimal(), {"env": [{"name": "ROCR_VISIBLE_DEVICES", "value": "0"}]}), "spec.env"),
    ("identity-env", merge(minimal(), {"env": [{"name": "RLKUBE_RLJOB_NAME", "value": "x"}]}), "spec.env"),
    (
        "mount-two-sources",
        merge(
            minimal(),
            {"mounts": [{"name": "m", "mountPath": "/m", "hostPath": "/h", "persistentVolumeClaim": "p"}]},
        ),
        "spec.mounts",
    ),
    (
        "mount-no-source",
        merge(minimal(), {"mounts": [{"name": "m", "mountPath": "/m"}]}),
        "spec.mounts",
    ),
]

# Refused by the schema itself (patterns), by the API server and by pydantic alike. Issue 11: these were
# accepted and broke later (an unpullable pod, a 1.5-byte pod, a RoleBinding the API server refuses).
BAD_SCHEMA: list[tuple[str, dict[str, Any], str]] = [
    ("image-newline", merge(minimal(), {"image": "rlkube/runtime:1\nrm -rf /"}), "spec.image"),
    ("image-space", merge(minimal(), {"image": "rlkube/runtime 1"}), "spec.image"),
    ("memory-milli", merge(minimal(), {"trainer": {"memory": "1500m"}}), "spec.trainer.memory"),
    ("shm-milli", merge(minimal(), {"rollout": {"shmSize": "16000m"}}), "spec.rollout.shmSize"),
    ("memory-fraction", merge(minimal(), {"head": {"memory": "0.5"}}), "spec.head.memory"),
    ("sa-invalid", merge(minimal(), {"serviceAccountName": "Powerful_SA"}), "spec.serviceAccountName"),
    ("pc-invalid", merge(minimal(), {"priorityClassName": "High Priority"}), "spec.priorityClassName"),
    (
        "pvc-invalid",
        merge(minimal(), {"mounts": [{"name": "m", "mountPath": "/m", "persistentVolumeClaim": "A/B"}]}),
        "spec.mounts[0].persistentVolumeClaim",
    ),
    (
        "host-path-relative",
        merge(minimal(), {"mounts": [{"name": "m", "mountPath": "/m", "hostPath": "data"}]}),
        "spec.mounts[0].hostPath",
    ),
]

# Errors only Python reports (the API server has list-map keys or nothing for these).
BAD_PYTHON_ONLY: list[tuple[str, dict[str, Any], str]] = [
    (
        "duplicate-env",
        merge(minimal(), {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
        "spec.env[1].name",
    ),
    (
        "reserved-mount-name",
        merge(minimal(), {"mounts": [{"name": "dshm", "mountPath": "/x", "hostPath": "/h"}]}),
        "spec.mounts[0].name",
    ),
    (
        "mount-over-config",
        merge(minimal(), {"mounts": [{"name": "m", "mountPath": "/etc/rlkube", "hostPath": "/h"}]}),
        "spec.mounts[0].mountPath",
    ),
]


UID = "0b7c6a1e-0000-4000-8000-000000000001"


def admit_and_render(
    raw: dict[str, Any], *, namespace: str = "ns", uid: str = UID, defaults: Any = None
) -> Any:
    """What the operator does with a live RLJob: validate and resolve once, then render the resolved job.

    Raises InvalidRLJob for a spec the operator refuses (it then renders nothing).
    """
    from rlkube.api import check, parse_rljob, resolve
    from rlkube.operator.render import render_children

    job = parse_rljob(raw)
    job = job.model_copy(update={"metadata": {**job.metadata, "namespace": namespace, "uid": uid}})
    return render_children(resolve(check(job)), defaults)
