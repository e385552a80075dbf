"""The names the operator, the pods and users agree on, each spelled once.

Everything a second party reads back (the CRD's group and plural, the labels the operator selects
children by, where the pods find the resolved spec and the checkpoints, the env the runtime reads
its identity from, phases, condition types, the time format) lives here. Pure data: importing this
imports nothing else of rlkube, so the operator, the runtime, the devcluster tool and the tests all
take their spelling from the same line.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal, get_args

# ------------------------------------------------------------------------------------------ the CRD

GROUP = "rlkube.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]
CRD_NAME = f"{PLURAL}.{GROUP}"

# ------------------------------------------------------------------------------ labels, annotations

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = {MANAGED_BY_LABEL: "rlkube"}
# On every child: the RLJob's name (the operator's watch selector; so RLJob names are <= 63 chars).
JOB_LABEL = f"{GROUP}/rljob"
# On every Ray pod: head, actor, trainer or rollout.
GROUP_LABEL = f"{GROUP}/group"
# The operator's finalizer and the prefix of Kopf's bookkeeping annotations on the RLJob.
FINALIZER = f"{GROUP}/finalizer"
ANNOTATION_PREFIX = GROUP
# On a resolved RLJob (the ConfigMap's file): every default is written out, do not resolve again.
RESOLVED_ANNOTATION = f"{GROUP}/resolved"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# RLJob labels copied onto the RayJob for queueing and gang scheduling (Kueue, Volcano).
PASSTHROUGH_LABEL_PREFIXES = ("kueue.x-k8s.io/", "volcano.sh/", "ray.io/scheduler-name")

# ------------------------------------------------------------------------------- paths in the pods

# The ConfigMap with the resolved spec is mounted here on every Ray container.
CONFIG_DIR = "/etc/rlkube"
CONFIG_FILE = "rljob.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
# Where checkpoint.persistentVolumeClaim is mounted unless checkpoint.path says otherwise.
CHECKPOINT_MOUNT = "/checkpoints"
SHM_PATH = "/dev/shm"
# Volume names the renderer uses itself (a user's spec.mounts must not take them).
SHM_VOLUME = "dshm"
CONFIG_VOLUME = "rljob-config"
CHECKPOINT_VOLUME = "checkpoints"
ENTRYPOINT = f"rlkube-train --rljob {CONFIG_PATH}"

# -------------------------------------------------------------------------------------------- env

# Set by the operator on every Ray container; the runtime reads them to find and patch its RLJob.
ENV_RLJOB_NAME = "RLKUBE_RLJOB_NAME"
ENV_RLJOB_NAMESPACE = "RLKUBE_RLJOB_NAMESPACE"
ENV_RLJOB_FILE = "RLKUBE_RLJOB_FILE"
ENV_RAY_GROUP = "RLKUBE_RAY_GROUP"
# A user's spec.env must not set these: the status pusher's identity.
RESERVED_ENV_PREFIX = "RLKUBE_RLJOB_"
# Never rendered and refused in spec.env: next to HIP/CUDA masks Ray refuses to start.
FORBIDDEN_ENV = "ROCR_VISIBLE_DEVICES"

# ---------------------------------------------------------------------------- vendors and engines

Vendor = Literal["amd", "nvidia", "cpu"]
VENDORS: tuple[str, ...] = get_args(Vendor)
# The rollout engines a spec may name. The runtime registers one implementation per name
# (rlkube.runtime.rollout.registry); a test asserts the two lists agree.
Engine = Literal["vllm", "sglang", "hf"]
ENGINES: tuple[str, ...] = get_args(Engine)

# ----------------------------------------------------------------------------- status vocabulary

Phase = Literal["Pending", "Provisioning", "Running", "Succeeded", "Failed", "Suspended"]
PHASES: tuple[str, ...] = get_args(Phase)
TERMINAL_PHASES: tuple[str, ...] = ("Succeeded", "Failed")
ConditionStatus = Literal["True", "False", "Unknown"]
CONDITION_TYPES: tuple[str, ...] = ("Valid", "ClusterReady", "Running", "Succeeded", "Failed", "Suspended")

# ------------------------------------------------------------------------------------------- time

# RFC 3339 in UTC at second precision: what the API server writes in metadata and what we write.
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def rfc3339(when: datetime) -> str:
    """`when` as the API server's timestamp text (an aware time is converted to UTC first)."""
    return (when.astimezone(UTC) if when.tzinfo else when).strftime(TIME_FORMAT)


def now_rfc3339() -> str:
    """The current time as the API server's timestamp text."""
    return rfc3339(datetime.now(UTC))


def parse_rfc3339(text: str) -> datetime:
    """An API server timestamp (e.g. metadata.creationTimestamp) as an aware datetime."""
    return datetime.strptime(text, TIME_FORMAT).replace(tzinfo=UTC)
