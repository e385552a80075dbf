"""The generated CRD: in sync with the models, structural, and CEL rules that agree with Python.

The real API server compiles the CEL (cluster tests apply the CRD); here the rules are checked
for the properties the server insists on and, through a translator for the small CEL subset
the rules use, evaluated on the same specs as the Python checks: both must give the same verdict.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from specs import BAD, EXAMPLES, cpu, minimal, separate

from rlkube.api import parse_rljob, to_dict
from rlkube.api.crd import PRINTER_COLUMNS, build_crd, main, openapi_schema, outputs
from rlkube.api.validation import IMMUTABLE_FIELDS, LIVE_FIELDS, RULES


def test_committed_crds_and_docs_match_the_models() -> None:
    stale = [str(p) for p, content in outputs().items() if not p.exists() or p.read_text() != content]
    assert stale == [], "generated files drifted from rlkube.api.models: run `make crds`"
    assert main(["--check"]) == 0


def test_names_scope_status_and_columns() -> None:
    crd = build_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "rljobs.rlkube.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] | {} == {
        "kind": "RLJob",
        "listKind": "RLJobList",
        "plural": "rljobs",
        "singular": "rljob",
        "shortNames": ["rlj"],
        "categories": ["all"],
    }
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    cols = {c["name"].upper(): c for c in version["additionalPrinterColumns"]}
    assert list(cols) == ["PHASE", "ALGORITHM", "MODE", "GPUS", "STEP", "REWARD", "AGE", "REASON", "RAYJOB"]
    assert {n for n, c in cols.items() if c.get("priority") == 1} == {"REASON", "RAYJOB"}
    schema = version["schema"]["openAPIV3Schema"]
    for col in PRINTER_COLUMNS:
        if col["jsonPath"].startswith(".metadata"):
            continue
        _node(schema, col["jsonPath"].lstrip("."))  # every column reads a field the schema keeps


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")


def test_schema_is_structural() -> None:
    text = yaml.safe_dump(openapi_schema())
    for banned in ("anyOf", "oneOf", "allOf", "$ref", "null", "title", "x-rlkube"):
        assert banned not in text
    for path, node in _walk(openapi_schema()):
        assert "type" in node, f"{path} has no type"
        assert node["type"] in {"object", "array", "string", "integer", "number", "boolean"}, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True, path
        assert not ("properties" in node and "additionalProperties" in node), path
        for key in node.get("required", []):
            assert key in node["properties"], f"{path}: required {key} is not a property"


def test_list_maps_and_defaults() -> None:
    schema = openapi_schema()
    spec = schema["properties"]["spec"]
    conditions = schema["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert "type" in conditions["items"]["required"]
    assert spec["properties"]["env"]["x-kubernetes-list-map-keys"] == ["name"]
    # Blocks with all-default fields default to {} so the server fills them; optional blocks stay absent.
    assert spec["properties"]["training"]["default"] == {}
    assert spec["properties"]["training"]["properties"]["mode"]["default"] == "sync"
    assert "default" not in spec["properties"]["async"]
    assert "default" not in spec["properties"]["algorithm"]["properties"]["overlongBuffer"]
    assert spec["required"] == ["model", "data"]
    assert "default" not in yaml.safe_dump(schema["properties"]["status"])


def _node(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    node = schema
    for part in dotted.split("."):
        assert part in node.get("properties", {}), f"{dotted}: no field {part}"
        node = node["properties"][part]
    return node


def test_cel_rules_reference_existing_bounded_fields() -> None:
    schema = openapi_schema()
    spec = schema["properties"]["spec"]
    rules = [r for r in spec["x-kubernetes-validations"] if "oldSelf" not in r["rule"]]
    assert len(rules) == sum(1 for r in RULES if r.cel)
    for rule in rules:
        assert rule["rule"].count("(") == rule["rule"].count(")"), rule
        assert rule["message"] and rule["fieldPath"].startswith(".")
        _node(spec, rule["fieldPath"].lstrip("."))
        for ref in re.findall(r"self((?:\.\w+)+)(?!\w*\()", rule["rule"]):
            node = _node(spec, ref.lstrip("."))
            # The server estimates CEL cost from these bounds; unbounded strings/lists can exceed it.
            if node["type"] == "string":
                assert "maxLength" in node or "enum" in node, f"{ref} needs maxLength"
            if node["type"] == "array":
                assert "maxItems" in node, f"{ref} needs maxItems"
                for field in re.findall(r"\b[em]\.(\w+)", rule["rule"]):
                    item = node["items"]["properties"][field]
                    assert item["type"] != "string" or "maxLength" in item
    for dotted in IMMUTABLE_FIELDS:
        assert {"rule": "self == oldSelf", "message": IMMUTABLE_FIELDS[dotted]} in _node(spec, dotted)[
            "x-kubernetes-validations"
        ]
    assert "size(self.metadata.name) <= 63" in schema["x-kubernetes-validations"][0]["rule"]


# ---- a translator for the CEL subset the rules use, to evaluate them like the API server would ----


class _Obj:
    """Attribute access over the defaulted wire form, as CEL sees an object (missing key = error)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getattr__(self, name: str) -> Any:
        key = "async" if name == "async_" else name
        if key not in self._data:
            raise KeyError(f"no such key: {key}")
        return _wrap(self._data[key])


def _wrap(value: Any) -> Any:
    if isinstance(value, dict):
        return _Obj(value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def _has(obj: _Obj, key: str) -> bool:
    return ("async" if key == "async_" else key) in obj._data


def cel_to_python(rule: str) -> str:
    """Translate the rules' CEL subset; fails loudly on anything else so new syntax gets a test."""
    py = re.sub(r"\.async\b", ".async_", rule)
    py = re.sub(r"\((has\([^)]*\)) \? ([^:]+) : ([^)]+)\)", r"((\2) if \1 else (\3))", py)
    py = re.sub(r"([\w.]+)\.all\((\w+), (.+)\)$", r"all((\3) for \2 in \1)", py)
    py = re.sub(r"has\(([\w.]+)\.(\w+)\)", r"_has(\1, '\2')", py)
    py = py.replace("||", " or ").replace("&&", " and ").replace(".startsWith(", ".startswith(")
    py = re.sub(r"!(?!=)", " not ", py)
    leftover = re.sub(r"'[^']*'|\b(self|not|or|and|in|for|if|else|all|_has|startswith|\w+_?|\d+)\b", "", py)
    assert set(leftover) <= set(" .()=<>!%*+,"), f"untranslated CEL in {rule!r}: {leftover!r}"
    return py


def _cel_ok(rule: str, wire_spec: dict[str, Any]) -> bool:
    return bool(eval(cel_to_python(rule), {"_has": _has, "all": all}, {"self": _Obj(wire_spec)}))


CASES = [("minimal", minimal()), ("separate", separate()), ("cpu", cpu())]
CASES += [(c, j) for c, j, _ in BAD]
CASES += [(p.name, yaml.safe_load(p.read_text())) for p in EXAMPLES]


@pytest.mark.parametrize(("case", "job"), CASES, ids=[c for c, _ in CASES])
def test_cel_and_python_agree(case: str, job: dict[str, Any]) -> None:
    parsed = parse_rljob(job)
    # The wire form with defaults filled and unset optionals absent: what CEL sees after defaulting.
    wire = to_dict(parsed)["spec"]
    for rule in RULES:
        if rule.cel is None:
            continue
        assert _cel_ok(rule.cel, wire) == rule.check(parsed.spec), (
            f"{case}: CEL and Python disagree on {rule.field}"
        )


def test_every_spec_field_but_the_live_ones_is_frozen_while_running() -> None:
    """A field added to the spec later is covered too: the rule is generated from the schema."""
    spec = openapi_schema()["properties"]["spec"]
    (rule,) = [r["rule"] for r in spec["x-kubernetes-validations"] if "oldSelf" in r["rule"]]
    assert rule.startswith("(has(oldSelf.suspend) && oldSelf.suspend && has(self.suspend) && self.suspend)")
    for field in spec["properties"]:
        assert (f"self.{field} == oldSelf.{field}" in rule) is (field not in LIVE_FIELDS), field
