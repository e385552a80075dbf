"""Cross-field validation: every bad spec is refused with an error that names the field and the fix."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError
from specs import BAD, BAD_PYTHON_ONLY, BAD_SCHEMA, EXAMPLES, cpu, minimal, separate

from rlkube.api import parse_rljob, validate, validate_rljob
from rlkube.api.validation import RULES, FieldError


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path) -> None:
    assert validate_rljob(parse_rljob(yaml.safe_load(path.read_text()))) == []


@pytest.mark.parametrize("job", [minimal(), separate(), cpu()], ids=["minimal", "separate", "cpu"])
def test_good_specs_pass(job: dict) -> None:
    assert validate(parse_rljob(job).spec) == []


@pytest.mark.parametrize(
    ("case", "job", "field"), BAD + BAD_PYTHON_ONLY, ids=[c[0] for c in BAD + BAD_PYTHON_ONLY]
)
def test_bad_spec_names_the_field(case: str, job: dict, field: str) -> None:
    errors = validate(parse_rljob(job).spec)
    assert field in [e.field for e in errors], errors


@pytest.mark.parametrize(("case", "job", "field"), BAD_SCHEMA, ids=[c[0] for c in BAD_SCHEMA])
def test_schema_patterns_refuse_what_pods_cannot_take(case: str, job: dict, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_rljob(job)
    locs = [".".join(str(p) for p in e["loc"]) for e in err.value.errors()]
    assert field.replace("[0]", ".0") in locs, locs


def test_megatron_message_is_the_documented_one() -> None:
    job = minimal()
    job["spec"]["trainer"] = {"strategy": "megatron"}
    assert validate(parse_rljob(job).spec) == [
        FieldError("spec.trainer.strategy", "megatron is not supported yet; use strategy: fsdp2")
    ]


def test_separate_async_batch_message_says_the_fix() -> None:
    job = separate(training={"mode": "separate_async", "trainBatchSize": 96, "miniBatchSize": 32})
    (err,) = [e for e in validate(parse_rljob(job).spec) if e.field == "spec.training.trainBatchSize"]
    assert "parameterSyncStep x training.miniBatchSize" in err.message


def test_every_rule_message_names_a_field() -> None:
    for rule in RULES:
        leaf = rule.field.split(".")[-1]
        assert leaf in rule.message or rule.field in rule.message, rule


def test_long_rljob_name_is_refused() -> None:
    job = minimal()
    job["metadata"]["name"] = "x" * 64
    assert [e.field for e in validate_rljob(parse_rljob(job))] == ["metadata.name"]
