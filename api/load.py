"""Reading and writing RLJobs: kubectl-style YAML in, the resolved spec (defaults applied) out.

The operator validates and resolves an RLJob once, at the edge, and writes `dump_resolved(job)`
into the job's ConfigMap; the pods mount it and `rlkube-train --rljob <file>` reads it back with
`load_resolved`, which takes a resolved file as it is and validates and resolves a user's own YAML
(a local run) once. `resolve` marks its output (contract.RESOLVED_ANNOTATION) so nobody redoes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .contract import API_VERSION, CHECKPOINT_MOUNT, KIND, RESOLVED_ANNOTATION
from .models import AsyncSpec, RLJob, Toleration, colocated, gpu_resource
from .validation import check

# Metadata kept in the resolved file: enough for the runtime to find and patch its RLJob.
_KEPT_METADATA = ("name", "namespace", "uid", "generation", "labels")


def parse_rljob(obj: dict[str, Any]) -> RLJob:
    """An RLJob from a parsed document: a full object (apiVersion/kind/spec) or a bare spec.

    Raises pydantic.ValidationError whose locations name the field (e.g. spec.training.mode).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"an RLJob document must be a mapping, got {type(obj).__name__}")
    if "spec" in obj or "kind" in obj or "apiVersion" in obj:
        if obj.get("kind", KIND) != KIND:
            raise ValueError(f"expected kind {KIND}, got {obj.get('kind')!r}")
        if obj.get("apiVersion", API_VERSION) != API_VERSION:
            raise ValueError(f"expected apiVersion {API_VERSION}, got {obj.get('apiVersion')!r}")
        return RLJob.model_validate(obj)
    return RLJob.model_validate({"spec": obj})


def load_rljob(path: str | Path, *, validate: bool = True) -> RLJob:
    """Load the first RLJob in a YAML file; with `validate`, raise InvalidRLJob on cross-field errors."""
    text = Path(path).read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    if not docs:
        raise ValueError(f"{path}: no YAML document")
    chosen = next((d for d in docs if isinstance(d, dict) and d.get("kind") == KIND), docs[0])
    job = parse_rljob(chosen)
    return check(job) if validate else job


def resolve(job: RLJob) -> RLJob:
    """A copy with every effective default written out, so the runtime never guesses.

    Fills: async knobs in async modes, the GPU resource name, the default GPU toleration,
    the colocated rollout's share of the trainer GPUs, the checkpoint mount path, and the advantage
    estimator, policy loss and loss aggregation `algorithm.name` implies.
    """
    spec = job.spec.model_copy(deep=True)
    if spec.training.mode != "sync" and spec.async_ is None:
        spec.async_ = AsyncSpec()
    resource = gpu_resource(spec)
    spec.gpu.resource_name = resource
    if spec.gpu.tolerations is None:
        spec.gpu.tolerations = (
            [Toleration(key=resource, operator="Exists", effect="NoSchedule")] if resource is not None else []
        )
    if colocated(spec) and spec.rollout.gpus_per_replica is None:
        spec.rollout.replicas = spec.trainer.replicas
        spec.rollout.gpus_per_replica = spec.trainer.gpus_per_replica
    if spec.training.mode == "separate_async" and spec.rollout.gpus_per_replica is None:
        spec.rollout.gpus_per_replica = 0  # only reachable with vendor cpu (validation refuses it on GPUs)
    if spec.checkpoint.persistent_volume_claim and spec.checkpoint.path is None:
        spec.checkpoint.path = CHECKPOINT_MOUNT
    if spec.model.tokenizer_path is None:
        spec.model.tokenizer_path = spec.model.path
    algo = spec.algorithm
    algo.advantage_estimator = algo.effective_advantage_estimator  # type: ignore[assignment]
    algo.policy_loss = algo.effective_policy_loss  # type: ignore[assignment]
    algo.loss_aggregation = algo.effective_loss_aggregation  # type: ignore[assignment]
    metadata = {k: job.metadata[k] for k in _KEPT_METADATA if k in job.metadata}
    metadata["annotations"] = {RESOLVED_ANNOTATION: "true"}
    return RLJob(metadata=metadata, spec=spec)


def is_resolved(job: RLJob) -> bool:
    """True for the output of `resolve` (also after a round trip through its YAML)."""
    return (job.metadata.get("annotations") or {}).get(RESOLVED_ANNOTATION) == "true"


def as_resolved(job: RLJob) -> RLJob:
    """`job` when it is already resolved (the operator's ConfigMap), else `resolve(job)` (a user's file)."""
    return job if is_resolved(job) else resolve(job)


def load_resolved(path: str | Path) -> RLJob:
    """What `rlkube-train --rljob` runs: the operator's ConfigMap file as it is (validated and
    resolved at the edge already), or a user's own file validated and resolved here, once."""
    job = load_rljob(path, validate=False)
    return job if is_resolved(job) else resolve(check(job))


def to_dict(job: RLJob) -> dict[str, Any]:
    """The wire form (camelCase, no nulls) of an RLJob."""
    return job.model_dump(by_alias=True, exclude_none=True, mode="json")


def dump_resolved(job: RLJob) -> str:
    """YAML of the resolved job without status: what the operator puts in the ConfigMap."""
    return yaml.safe_dump(to_dict(as_resolved(job).model_copy(update={"status": None})), sort_keys=False)
