"""Rendered RayJobs against KubeRay v1.5's own CRD schema (offline): unknown or mistyped fields fail here.

The cluster tests apply them to the real API server; this catches the same mistakes in a second.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from specs import EXAMPLES, admit_and_render


@functools.cache
def _kuberay_validator() -> jsonschema.Draft7Validator | None:
    from rlkube.devcluster.binaries import cache_dir, module_version

    path = cache_dir() / f"kuberay-{module_version('kuberay')}" / "crds" / "ray.io_rayjobs.json"
    if not path.is_file():
        return None
    docs = json.loads(path.read_text())
    crd = docs[0] if isinstance(docs, list) else docs
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_closed(version["schema"]["openAPIV3Schema"]))


def _errors(rayjob: dict[str, Any]) -> list[str]:
    validator = _kuberay_validator()
    if validator is None:
        pytest.fail("KubeRay CRDs missing from the tool cache: run `make cluster-build`")
    body = {k: v for k, v in rayjob.items() if k != "metadata"}
    errors = sorted(validator.iter_errors(body), key=lambda e: list(e.path))
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]


def _closed(node: Any) -> Any:
    """Refuse unknown fields like the API server's strict field validation (kubectl's default)."""
    if isinstance(node, dict):
        out = {k: _closed(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
        if node.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_closed(v) for v in node]
    return node


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_rendered_rayjob_matches_the_kuberay_crd(path: Path) -> None:
    rayjob = admit_and_render(yaml.safe_load(path.read_text())).ray_job
    errors = _errors(rayjob)
    assert not errors, "\n".join(errors[:10])


def test_the_schema_check_catches_a_mistyped_field() -> None:
    rayjob = admit_and_render(yaml.safe_load(EXAMPLES[0].read_text())).ray_job
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 1
    rayjob["spec"]["backoffLimit"] = "2"
    assert len(_errors(rayjob)) == 2
