"""The shared contract: `rlkube.api` stands on its own, spells each name once, and a spec is
validated and resolved once (the operator's file is taken as it is, a user's own file resolved once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import yaml
from specs import minimal, separate

from rlkube.api import (
    InvalidRLJob,
    RLJob,
    contract,
    dump_resolved,
    is_resolved,
    load_resolved,
    parse_rljob,
    resolve,
)
from rlkube.api.models import RolloutSpec


def test_the_api_and_the_renderer_import_neither_the_runtime_nor_torch() -> None:
    code = (
        "import sys, rlkube.api, rlkube.api.platform_env, rlkube.operator.render;"
        "bad = sorted(m for m in sys.modules"
        " if m.startswith('rlkube.runtime') or m.split('.')[0] == 'torch');"
        "print(' '.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"


def test_the_models_spell_the_contracts_names() -> None:
    job = RLJob.model_validate(minimal())
    assert (job.api_version, job.kind) == (contract.API_VERSION, contract.KIND)
    assert get_args(RolloutSpec.model_fields["engine"].annotation) == contract.ENGINES


def test_the_operators_file_is_taken_as_it_is(tmp_path: Path) -> None:
    job = parse_rljob(separate())
    path = tmp_path / "rljob.yaml"
    path.write_text(dump_resolved(job))
    loaded = load_resolved(path)
    assert is_resolved(loaded) and loaded == resolve(job)
    # A resolved file is not re-derived: a value resolve() would change stays as written.
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["gpu"]["tolerations"] = []
    path.write_text(yaml.safe_dump(doc))
    assert load_resolved(path).spec.gpu.tolerations == []


def test_a_users_file_is_validated_and_resolved_once(tmp_path: Path) -> None:
    path = tmp_path / "user.yaml"
    path.write_text(yaml.safe_dump(separate()))
    loaded = load_resolved(path)
    assert is_resolved(loaded) and loaded.spec.gpu.resource_name == "amd.com/gpu"
    assert loaded.spec.async_ is not None
    bad = separate()
    bad["spec"]["env"] = [{"name": "ROCR_VISIBLE_DEVICES", "value": "0"}]
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(InvalidRLJob, match=r"spec\.env"):
        load_resolved(path)


def test_time_format_round_trips() -> None:
    when = contract.parse_rfc3339("2026-01-02T03:04:05Z")
    assert contract.rfc3339(when) == "2026-01-02T03:04:05Z"
