"""Shared helpers of the operator and chart tests: manifests users would write, and status lookups."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from rlkube.devcluster.testing import Kubectl, token_kubeconfig

__all__ = ["REPO", "condition", "events_for", "example", "rljob", "small_rljob", "token_kubeconfig"]

REPO = Path(__file__).resolve().parents[2]


def example(name: str) -> dict[str, Any]:
    """An example manifest from examples/ (the files users apply)."""
    return dict(yaml.safe_load((REPO / "examples" / name).read_text()))


def small_rljob(name: str, *, mode: str = "colocate_async", gpus: int = 2, **spec: Any) -> dict[str, Any]:
    """A minimal valid RLJob that fits the 4 x 8 GPU fake nodes."""
    body: dict[str, Any] = {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name},
        "spec": {
            "image": "rlkube/runtime-rocm:0.1.0",
            "model": {"path": "/models/Qwen2.5-0.5B"},
            "data": {"train": "/data/gsm8k.parquet", "reward": "gsm8k"},
            "training": {"mode": mode, "totalSteps": 10},
            "trainer": {"replicas": 1, "gpusPerReplica": gpus},
        },
    }
    if mode == "separate_async":
        body["spec"]["rollout"] = {"replicas": 1, "gpusPerReplica": gpus}
    for k, v in spec.items():
        body["spec"][k] = v
    return body


def rljob(kubectl: Kubectl, ns: str, name: str) -> dict[str, Any]:
    return dict(kubectl.json("-n", ns, "get", "rljob", name))


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or ():
        if c.get("type") == type_:
            return dict(c)
    return {}


def events_for(kubectl: Kubectl, ns: str, name: str) -> list[dict[str, Any]]:
    out = kubectl.json("-n", ns, "get", "events", "--field-selector", f"involvedObject.name={name}")
    return list(out.get("items") or [])


def apply(kubectl: Kubectl, ns: str, body: dict[str, Any]) -> None:
    kubectl("-n", ns, "apply", "-f", "-", input=yaml.safe_dump(body))


def cond_is(kubectl: Kubectl, ns: str, name: str, type_: str, status: str, reason: str | None = None) -> Any:
    """A wait_for check: the condition, once it has this status (and reason)."""

    def check() -> dict[str, Any] | None:
        c = condition(rljob(kubectl, ns, name), type_)
        return c if c.get("status") == status and (reason is None or c.get("reason") == reason) else None

    return check


def describe(kubectl: Kubectl, ns: str, name: str) -> Callable[[], Any]:
    return lambda: rljob(kubectl, ns, name)
