"""What every child shares: who owns it (the RLJob), its metadata and the labels passed through."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlkube.api import RLJob
from rlkube.api.contract import (
    API_VERSION,
    JOB_LABEL,
    KIND,
    KUEUE_QUEUE_LABEL,
    MANAGED_BY,
    PASSTHROUGH_LABEL_PREFIXES,
)


@dataclass(frozen=True)
class Owner:
    """The RLJob the children belong to: their namespace, ownerReference and labels come from it."""

    name: str
    namespace: str
    uid: str
    labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, job: RLJob) -> Owner:
        """The owner named by a (resolved) RLJob's metadata; the uid is required for garbage collection."""
        uid = str(job.metadata.get("uid") or "")
        if not job.name or not uid:
            raise ValueError("render an RLJob with metadata.name and metadata.uid (the live object's)")
        labels = {str(k): str(v) for k, v in (job.metadata.get("labels") or {}).items()}
        return cls(job.name, job.namespace, uid, labels)

    @property
    def kueue_managed(self) -> bool:
        """True when Kueue, not rlkube, decides RayJob.spec.suspend (the RLJob names a queue)."""
        return KUEUE_QUEUE_LABEL in self.labels


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


def passthrough_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """The RLJob labels that go onto the RayJob for queueing/gang scheduling (Kueue, Volcano)."""
    return {k: v for k, v in labels.items() if k.startswith(PASSTHROUGH_LABEL_PREFIXES)}


def job_labels(owner: Owner) -> dict[str, str]:
    """The labels of every child and pod: managed by rlkube, belonging to this RLJob (the watch selector)."""
    return {**MANAGED_BY, JOB_LABEL: owner.name}


def object_meta(name: str, owner: Owner, extra_labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """metadata of a child: in the RLJob's namespace, labelled and owner-referenced."""
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**job_labels(owner), **(extra_labels or {})},
        "ownerReferences": [owner_reference(owner.name, owner.uid)],
    }
