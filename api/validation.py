"""Cross-field validation of an RLJob spec: one table, two enforcers.

Each `Rule` carries a CEL expression (evaluated by the API server at `kubectl apply`, generated
into the CRD) and a Python check with the same meaning and the same message, so the local
`rlkube-train` path and the operator's `Valid` condition refuse exactly what the API server
refuses. Rules CEL cannot say (or cannot afford) have `cel=None` and run only in Python.
Messages name the field and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .algorithms import DEFAULT_ESTIMATOR, GROUP_ESTIMATORS, POLICY_LOSS_AGGREGATION
from .contract import (
    CHECKPOINT_MOUNT,
    CHECKPOINT_VOLUME,
    CONFIG_DIR,
    CONFIG_VOLUME,
    FORBIDDEN_ENV,
    RESERVED_ENV_PREFIX,
    SHM_PATH,
    SHM_VOLUME,
)
from .models import RLJob, RLJobSpec, colocated, effective_async

# Volume names and paths the renderer uses itself; user mounts must not collide with them.
RESERVED_VOLUME_NAMES = frozenset({SHM_VOLUME, CONFIG_VOLUME, CHECKPOINT_VOLUME})
RESERVED_MOUNT_PATHS = frozenset({SHM_PATH, CONFIG_DIR})
MAX_RLJOB_NAME = 63  # the name becomes a label value (contract.JOB_LABEL) on every child


@dataclass(frozen=True)
class FieldError:
    """One refusal: the offending field (e.g. `spec.training.trainBatchSize`) and what to do."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class InvalidRLJob(ValueError):
    """Raised where a caller needs an exception instead of a list (local runs, the renderer)."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("invalid RLJob:\n" + "\n".join(f"  {e}" for e in errors))


@dataclass(frozen=True)
class Rule:
    """A cross-field rule on the spec: `check(spec)` is True when the spec is acceptable."""

    field: str  # spec-relative camelCase path, e.g. "training.trainBatchSize"
    message: str
    check: Callable[[RLJobSpec], bool]
    cel: str | None  # with `self` = spec; None when only Python enforces it


def _separate(s: RLJobSpec) -> bool:
    return s.training.mode == "separate_async"


def _cel_one_of(field: str, values: list[str] | tuple[str, ...]) -> str:
    return " || ".join(f"{field} == '{v}'" for v in values)


# CEL: "the effective advantage estimator compares responses within a group", from the API's tables.
_GROUP_ALGORITHMS = [n for n, e in DEFAULT_ESTIMATOR.items() if e in GROUP_ESTIMATORS]
_GROUP_ESTIMATOR_CEL = (
    "(has(self.algorithm.advantageEstimator) ? "
    f"{_cel_one_of('self.algorithm.advantageEstimator', GROUP_ESTIMATORS)} : "
    f"{_cel_one_of('self.algorithm.name', _GROUP_ALGORITHMS)})"
)


def _loss_aggregation_rule(loss: str, agg: str) -> Rule:
    """A policy loss that is defined with one aggregation refuses any other written explicitly."""

    def check(s: RLJobSpec) -> bool:
        a = s.algorithm
        return a.policy_loss != loss or a.loss_aggregation is None or a.loss_aggregation == agg

    return Rule(
        "algorithm.lossAggregation",
        f"policyLoss {loss} is defined with lossAggregation {agg} (its paper's objective, and verl's): "
        f"remove lossAggregation or set it to {agg}",
        check,
        f"!has(self.algorithm.policyLoss) || self.algorithm.policyLoss != '{loss}' || "
        f"!has(self.algorithm.lossAggregation) || self.algorithm.lossAggregation == '{agg}'",
    )


RULES: list[Rule] = [
    Rule(
        "trainer.strategy",
        "megatron is not supported yet; use strategy: fsdp2",
        lambda s: s.trainer.strategy != "megatron",
        "self.trainer.strategy != 'megatron'",
    ),
    Rule(
        "async",
        "async settings apply only to training.mode colocate_async or separate_async: remove spec.async "
        "or change training.mode",
        lambda s: s.training.mode != "sync" or s.async_ is None,
        "self.training.mode != 'sync' || !has(self.async)",
    ),
    Rule(
        "training.miniBatchSize",
        "training.miniBatchSize must not exceed training.trainBatchSize: lower miniBatchSize",
        lambda s: s.training.mini_batch_size <= s.training.train_batch_size,
        "self.training.miniBatchSize <= self.training.trainBatchSize",
    ),
    Rule(
        "training.trainBatchSize",
        "training.trainBatchSize must be a multiple of training.miniBatchSize: adjust either",
        lambda s: s.training.train_batch_size % s.training.mini_batch_size == 0,
        "self.training.trainBatchSize % self.training.miniBatchSize == 0",
    ),
    Rule(
        "training.trainBatchSize",
        "in separate_async training.trainBatchSize must equal async.parameterSyncStep x "
        "training.miniBatchSize (weights are pushed after parameterSyncStep mini-batches): set "
        "trainBatchSize to that product or change parameterSyncStep/miniBatchSize",
        lambda s: (
            not _separate(s)
            or s.training.train_batch_size
            == effective_async(s).parameter_sync_step * s.training.mini_batch_size
        ),
        "self.training.mode != 'separate_async' || self.training.trainBatchSize == "
        "(has(self.async) ? self.async.parameterSyncStep : 1) * self.training.miniBatchSize",
    ),
    Rule(
        "rollout.gpusPerReplica",
        "separate_async runs the rollout on its own GPUs: set rollout.gpusPerReplica (at least 1)",
        lambda s: not _separate(s) or s.gpu.vendor == "cpu" or (s.rollout.gpus_per_replica or 0) >= 1,
        "self.training.mode != 'separate_async' || self.gpu.vendor == 'cpu' || "
        "(has(self.rollout.gpusPerReplica) && self.rollout.gpusPerReplica >= 1)",
    ),
    Rule(
        "rollout.gpusPerReplica",
        "rollout.gpusPerReplica must be a multiple of rollout.tensorParallelSize (each engine takes "
        "tensorParallelSize GPUs): change either",
        lambda s: (s.rollout.gpus_per_replica or 0) % s.rollout.tensor_parallel_size == 0,
        "!has(self.rollout.gpusPerReplica) || "
        "self.rollout.gpusPerReplica % self.rollout.tensorParallelSize == 0",
    ),
    Rule(
        "rollout.tensorParallelSize",
        "in separate_async each rollout pod runs rollout.gpusPerReplica / tensorParallelSize engines: "
        "rollout.gpusPerReplica (1 when unset on gpu.vendor cpu) must be a multiple of "
        "rollout.tensorParallelSize; lower tensorParallelSize or raise gpusPerReplica",
        lambda s: (
            not _separate(s) or max(s.rollout.gpus_per_replica or 0, 1) % s.rollout.tensor_parallel_size == 0
        ),
        "self.training.mode != 'separate_async' || (has(self.rollout.gpusPerReplica) && "
        "self.rollout.gpusPerReplica > 0 && self.rollout.gpusPerReplica % self.rollout.tensorParallelSize "
        "== 0) || ((!has(self.rollout.gpusPerReplica) || self.rollout.gpusPerReplica == 0) && "
        "self.rollout.tensorParallelSize == 1)",
    ),
    Rule(
        "rollout.tensorParallelSize",
        "in sync/colocate_async the rollout shares the trainer GPUs: trainer.gpusPerReplica (1 when 0 on "
        "gpu.vendor cpu) must be a multiple of rollout.tensorParallelSize; lower tensorParallelSize or use "
        "separate_async",
        lambda s: (
            not colocated(s) or max(s.trainer.gpus_per_replica, 1) % s.rollout.tensor_parallel_size == 0
        ),
        "self.training.mode == 'separate_async' || (self.trainer.gpusPerReplica > 0 && "
        "self.trainer.gpusPerReplica % self.rollout.tensorParallelSize == 0) || "
        "(self.trainer.gpusPerReplica == 0 && self.rollout.tensorParallelSize == 1)",
    ),
    Rule(
        "training.miniBatchSize",
        "every trainer rank takes an equal share of each mini-batch's prompt groups: "
        "training.miniBatchSize must be a multiple of the trainer ranks (trainer.replicas x "
        "trainer.gpusPerReplica, 0 counting as 1); raise miniBatchSize (and trainBatchSize) or use "
        "fewer trainer GPUs",
        lambda s: s.training.mini_batch_size % (s.trainer.replicas * max(s.trainer.gpus_per_replica, 1)) == 0,
        "(self.trainer.gpusPerReplica > 0 && self.training.miniBatchSize % (self.trainer.replicas * "
        "self.trainer.gpusPerReplica) == 0) || (self.trainer.gpusPerReplica == 0 && "
        "self.training.miniBatchSize % self.trainer.replicas == 0)",
    ),
    Rule(
        "rollout.gpusPerReplica",
        "in sync/colocate_async the rollout must fit on the trainer GPUs: rollout.replicas x "
        "rollout.gpusPerReplica must not exceed trainer.replicas x trainer.gpusPerReplica (leave "
        "rollout.gpusPerReplica unset to use them all)",
        lambda s: (
            not colocated(s)
            or s.rollout.gpus_per_replica is None
            or s.rollout.replicas * s.rollout.gpus_per_replica
            <= s.trainer.replicas * s.trainer.gpus_per_replica
        ),
        "self.training.mode == 'separate_async' || !has(self.rollout.gpusPerReplica) || "
        "self.rollout.replicas * self.rollout.gpusPerReplica <= "
        "self.trainer.replicas * self.trainer.gpusPerReplica",
    ),
    Rule(
        "gpu.resourceName",
        "gpu.vendor amd needs an amd.com/ resource (e.g. amd.com/gpu or amd.com/cpx_nps4): fix "
        "gpu.resourceName or gpu.vendor",
        lambda s: (
            s.gpu.resource_name is None or s.gpu.vendor != "amd" or s.gpu.resource_name.startswith("amd.com/")
        ),
        "!has(self.gpu.resourceName) || self.gpu.vendor != 'amd' || "
        "self.gpu.resourceName.startsWith('amd.com/')",
    ),
    Rule(
        "gpu.resourceName",
        "gpu.vendor nvidia needs an nvidia.com/ resource (e.g. nvidia.com/gpu): fix gpu.resourceName "
        "or gpu.vendor",
        lambda s: (
            s.gpu.resource_name is None
            or s.gpu.vendor != "nvidia"
            or s.gpu.resource_name.startswith("nvidia.com/")
        ),
        "!has(self.gpu.resourceName) || self.gpu.vendor != 'nvidia' || "
        "self.gpu.resourceName.startsWith('nvidia.com/')",
    ),
    Rule(
        "gpu.resourceName",
        "gpu.vendor cpu uses no GPU resource: remove gpu.resourceName",
        lambda s: s.gpu.vendor != "cpu" or s.gpu.resource_name is None,
        "self.gpu.vendor != 'cpu' || !has(self.gpu.resourceName)",
    ),
    Rule(
        "gpu.productName",
        "gpu.productName selects nodes by amd.com/gpu.product-name: it needs gpu.vendor amd; use "
        "gpu.nodeSelector otherwise",
        lambda s: s.gpu.product_name is None or s.gpu.vendor == "amd",
        "!has(self.gpu.productName) || self.gpu.vendor == 'amd'",
    ),
    Rule(
        "trainer.gpusPerReplica",
        "trainer.gpusPerReplica must be at least 1 on GPUs (0 only with gpu.vendor cpu)",
        lambda s: s.gpu.vendor == "cpu" or s.trainer.gpus_per_replica >= 1,
        "self.gpu.vendor == 'cpu' || self.trainer.gpusPerReplica >= 1",
    ),
    Rule(
        "rollout.gpusPerReplica",
        "rollout.gpusPerReplica must be at least 1 on GPUs: raise it or leave it unset (colocated modes then "
        "use all trainer GPUs)",
        lambda s: (
            s.gpu.vendor == "cpu" or s.rollout.gpus_per_replica is None or s.rollout.gpus_per_replica >= 1
        ),
        "self.gpu.vendor == 'cpu' || !has(self.rollout.gpusPerReplica) || self.rollout.gpusPerReplica >= 1",
    ),
    Rule(
        "rollout.engine",
        "rollout.engine sglang needs GPUs: use engine hf or vllm with gpu.vendor cpu",
        lambda s: s.gpu.vendor != "cpu" or s.rollout.engine != "sglang",
        "self.gpu.vendor != 'cpu' || self.rollout.engine != 'sglang'",
    ),
    Rule(
        "data.maxResponseLength",
        "data.maxPromptLength + data.maxResponseLength exceed model.maxPositionEmbeddings: shorten them or "
        "raise model.maxPositionEmbeddings",
        lambda s: (
            s.model.max_position_embeddings is None
            or s.data.max_prompt_length + s.data.max_response_length <= s.model.max_position_embeddings
        ),
        "!has(self.model.maxPositionEmbeddings) || "
        "self.data.maxPromptLength + self.data.maxResponseLength <= self.model.maxPositionEmbeddings",
    ),
    Rule(
        "algorithm.groupSize",
        "algorithm.groupSize must be at least 2 for the grpo and rloo advantage estimators (grpo and dapo "
        "use grpo): a group baseline needs two responses per prompt; raise groupSize or use "
        "advantageEstimator gae or reinforce_pp",
        lambda s: (
            s.algorithm.effective_advantage_estimator not in GROUP_ESTIMATORS or s.algorithm.group_size >= 2
        ),
        f"!{_GROUP_ESTIMATOR_CEL} || self.algorithm.groupSize >= 2",
    ),
    *(_loss_aggregation_rule(loss, agg) for loss, agg in POLICY_LOSS_AGGREGATION.items()),
    Rule(
        "algorithm.overlongBuffer.length",
        "algorithm.overlongBuffer.length must be smaller than data.maxResponseLength: shorten the buffer",
        lambda s: (
            s.algorithm.overlong_buffer is None
            or not s.algorithm.overlong_buffer.enabled
            or s.algorithm.overlong_buffer.length < s.data.max_response_length
        ),
        "!has(self.algorithm.overlongBuffer) || !self.algorithm.overlongBuffer.enabled || "
        "self.algorithm.overlongBuffer.length < self.data.maxResponseLength",
    ),
    Rule(
        "training.evalIntervalSteps",
        "training.evalIntervalSteps > 0 needs data.validation: set data.validation or evalIntervalSteps: 0",
        lambda s: s.training.eval_interval_steps == 0 or s.data.validation is not None,
        "self.training.evalIntervalSteps == 0 || has(self.data.validation)",
    ),
    Rule(
        "checkpoint.path",
        "checkpoint.path is where the PVC is mounted and must be absolute (e.g. /checkpoints)",
        lambda s: s.checkpoint.persistent_volume_claim is None or (s.checkpoint.path or "/").startswith("/"),
        "!has(self.checkpoint.persistentVolumeClaim) || !has(self.checkpoint.path) || "
        "self.checkpoint.path.startsWith('/')",
    ),
    Rule(
        "env",
        f"env must not set {FORBIDDEN_ENV}: together with HIP/CUDA_VISIBLE_DEVICES Ray refuses to start, "
        "and rlkube manages GPU visibility; remove it",
        lambda s: all(e.name != FORBIDDEN_ENV for e in s.env),
        f"!has(self.env) || self.env.all(e, e.name != '{FORBIDDEN_ENV}')",
    ),
    Rule(
        "env",
        f"env must not set {RESERVED_ENV_PREFIX}* variables: rlkube sets them so the runtime can report "
        "status; remove them",
        lambda s: all(not e.name.startswith(RESERVED_ENV_PREFIX) for e in s.env),
        f"!has(self.env) || self.env.all(e, !e.name.startsWith('{RESERVED_ENV_PREFIX}'))",
    ),
    Rule(
        "mounts",
        "each mounts entry needs exactly one of persistentVolumeClaim or hostPath",
        lambda s: all((m.persistent_volume_claim is None) != (m.host_path is None) for m in s.mounts),
        "!has(self.mounts) || self.mounts.all(m, has(m.persistentVolumeClaim) != has(m.hostPath))",
    ),
]

# Fields that cannot change after creation (CEL transition rule `self == oldSelf` in the CRD):
# changing them would mean a different RayCluster layout or a different run, so recreate instead.
IMMUTABLE_FIELDS: dict[str, str] = {
    "training.mode": "training.mode is immutable: delete and recreate the RLJob to change it",
    "algorithm.name": "algorithm.name is immutable: delete and recreate the RLJob to change it",
    "algorithm.advantageEstimator": "algorithm.advantageEstimator is immutable (gae trains a critic): delete "
    "and recreate the RLJob to change it",
    "gpu.vendor": "gpu.vendor is immutable: delete and recreate the RLJob to change it",
}


# What a spec change does after creation (docs/api.md has the table):
# - LIVE_FIELDS reach the RayJob at once and KubeRay reads them as the job goes;
# - IMMUTABLE_FIELDS never change (above);
# - every other field changes only while the RLJob is suspended (spec.suspend true before and after the
#   edit): the Ray cluster is gone then, and resuming builds the new one and its config from the new
#   spec. A CEL transition rule on spec refuses the edit otherwise, so no change is silently ignored.
LIVE_FIELDS: tuple[str, ...] = ("suspend", "activeDeadlineSeconds", "backoffLimit", "ttlSecondsAfterFinished")
SUSPEND_TO_EDIT_MESSAGE = (
    "a running RLJob's spec may change only in suspend, activeDeadlineSeconds, backoffLimit and "
    "ttlSecondsAfterFinished: set spec.suspend: true, edit, then set it back to false (the new Ray cluster "
    "and config roll out on resume)"
)


def suspend_to_edit_rule(fields: list[str]) -> str:
    """CEL transition rule on spec: unchanged outside LIVE_FIELDS, unless suspended before and after."""
    same = [
        f"(has(self.{f}) == has(oldSelf.{f}) && (!has(self.{f}) || self.{f} == oldSelf.{f}))"
        for f in fields
        if f not in LIVE_FIELDS
    ]
    suspended = "(has(oldSelf.suspend) && oldSelf.suspend && has(self.suspend) && self.suspend)"
    return suspended + " || (" + " && ".join(same) + ")"


def _python_only(spec: RLJobSpec) -> list[FieldError]:
    """Checks the API server enforces structurally (list-map keys) or that CEL cannot afford."""
    errors: list[FieldError] = []
    seen: set[str] = set()
    for i, e in enumerate(spec.env):
        if e.name in seen:
            errors.append(FieldError(f"spec.env[{i}].name", f"duplicate env name {e.name!r}: keep one entry"))
        seen.add(e.name)
    names: set[str] = set()
    paths: set[str] = set()
    for i, m in enumerate(spec.mounts):
        if m.name in RESERVED_VOLUME_NAMES:
            errors.append(
                FieldError(
                    f"spec.mounts[{i}].name",
                    f"volume name {m.name!r} is used by rlkube "
                    f"({', '.join(sorted(RESERVED_VOLUME_NAMES))}): rename it",
                )
            )
        elif m.name in names:
            errors.append(FieldError(f"spec.mounts[{i}].name", f"duplicate mount name {m.name!r}: rename it"))
        names.add(m.name)
        path = m.mount_path.rstrip("/") or "/"
        if path in RESERVED_MOUNT_PATHS or (
            spec.checkpoint.persistent_volume_claim and path == _ckpt_path(spec)
        ):
            errors.append(
                FieldError(
                    f"spec.mounts[{i}].mountPath", f"{path} is mounted by rlkube itself: choose another path"
                )
            )
        elif path in paths:
            errors.append(
                FieldError(f"spec.mounts[{i}].mountPath", f"two mounts at {path}: choose another path")
            )
        paths.add(path)
    for key in spec.gpu.node_selector:
        if key == "amd.com/gpu.product-name" and spec.gpu.product_name:
            errors.append(
                FieldError(
                    "spec.gpu.nodeSelector", "set the product either in gpu.productName or here, not both"
                )
            )
    return errors


def _ckpt_path(spec: RLJobSpec) -> str:
    return (spec.checkpoint.path or CHECKPOINT_MOUNT).rstrip("/") or "/"


def validate(spec: RLJobSpec) -> list[FieldError]:
    """Every cross-field error of `spec` (empty when valid), in the same words as the API server."""
    errors = [FieldError(f"spec.{r.field}", r.message) for r in RULES if not r.check(spec)]
    return errors + _python_only(spec)


def validate_rljob(job: RLJob) -> list[FieldError]:
    """`validate(job.spec)` plus the metadata checks (name length) the CRD root rule makes."""
    errors: list[FieldError] = []
    name = job.name
    if len(name) > MAX_RLJOB_NAME:
        errors.append(
            FieldError(
                "metadata.name",
                f"must be at most {MAX_RLJOB_NAME} characters (it is a label value on every child): "
                "rename the RLJob",
            )
        )
    return errors + validate(job.spec)


def check(job: RLJob) -> RLJob:
    """Return `job` unchanged, or raise InvalidRLJob listing every error."""
    errors = validate_rljob(job)
    if errors:
        raise InvalidRLJob(errors)
    return job
