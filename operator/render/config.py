"""The ConfigMap child: the resolved spec the entrypoint reads (mounted at contract.CONFIG_DIR)."""

from __future__ import annotations

from typing import Any

from rlkube.api import RLJob, dump_resolved
from rlkube.api.contract import CONFIG_FILE

from .names import child_name
from .objects import Owner, object_meta


def config_map_name(owner: Owner) -> str:
    return child_name(owner.name, "config")


def render_config_map(job: RLJob, owner: Owner) -> dict[str, Any]:
    """`<name>-config` holding `rljob.yaml`: the resolved job, so the pods never re-derive a default."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(config_map_name(owner), owner),
        "data": {CONFIG_FILE: dump_resolved(job)},
    }
