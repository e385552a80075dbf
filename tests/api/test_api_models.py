"""The RLJob models: what a user writes loads with defaults; mistakes are refused with their path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from specs import merge, minimal, separate

from rlkube.api import (
    InvalidRLJob,
    RLJob,
    dump_resolved,
    load_rljob,
    parse_rljob,
    ray_resource_name,
    resolve,
    step_display,
    total_gpus,
    worker_groups,
)


def _locs(exc: ValidationError) -> list[str]:
    return [".".join(str(p) for p in e["loc"]) for e in exc.errors()]


def test_minimal_spec_gets_documented_defaults() -> None:
    job = parse_rljob(minimal())
    s = job.spec
    assert (s.training.mode, s.algorithm.name, s.gpu.vendor, s.trainer.strategy) == (
        "sync",
        "grpo",
        "amd",
        "fsdp2",
    )
    assert s.model.dtype == "bfloat16"
    assert (s.data.prompt_key, s.data.answer_key) == ("prompt", "answer")
    assert s.algorithm.clip_ratio_c == 3.0
    assert s.async_ is None and s.algorithm.overlong_buffer is None
    assert s.suspend is False and s.backoff_limit == 0


def test_unknown_field_is_refused_with_its_path() -> None:
    job = minimal()
    job["spec"]["training"] = {"trainBatchSiz": 64}
    with pytest.raises(ValidationError) as exc:
        parse_rljob(job)
    assert "spec.training.trainBatchSiz" in _locs(exc.value)


@pytest.mark.parametrize(
    ("block", "value", "loc"),
    [
        ("training", {"mode": "async"}, "spec.training.mode"),
        ("training", {"trainBatchSize": 0}, "spec.training.trainBatchSize"),
        ("algorithm", {"name": "reinforce"}, "spec.algorithm.name"),
        ("gpu", {"vendor": "intel"}, "spec.gpu.vendor"),
        ("data", {"train": "/t", "reward": "not a reward"}, "spec.data.reward"),
        ("trainer", {"memory": "lots"}, "spec.trainer.memory"),
    ],
)
def test_structural_errors_name_the_field(block: str, value: dict, loc: str) -> None:
    job = minimal()
    job["spec"][block] = {**job["spec"].get(block, {}), **value}
    with pytest.raises(ValidationError) as exc:
        parse_rljob(job)
    assert loc in _locs(exc.value)


def test_custom_reward_function_is_accepted() -> None:
    job = minimal()
    job["spec"]["data"]["reward"] = "my_pkg.rewards:score"
    assert parse_rljob(job).spec.data.reward == "my_pkg.rewards:score"


def test_gpus_and_groups_per_mode() -> None:
    colocated = parse_rljob(merge(minimal(), {"trainer": {"replicas": 2, "gpusPerReplica": 8}}))
    assert total_gpus(colocated.spec) == 16
    assert worker_groups(colocated.spec) == ("actor",)
    split = parse_rljob(separate())
    assert total_gpus(split.spec) == 8
    assert worker_groups(split.spec) == ("trainer", "rollout")
    assert ray_resource_name("trainer") == "rlkube_trainer"
    assert step_display(12, 400) == "12/400"


def test_bare_spec_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(minimal()["spec"]))
    assert load_rljob(path).spec.model.path == "/models/m"


def test_load_refuses_cross_field_errors_naming_the_field(tmp_path: Path) -> None:
    job = minimal()
    job["spec"]["trainer"] = {"strategy": "megatron"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(job))
    with pytest.raises(InvalidRLJob) as exc:
        load_rljob(path)
    assert [e.field for e in exc.value.errors] == ["spec.trainer.strategy"]
    assert "megatron is not supported yet; use strategy: fsdp2" in str(exc.value)
    assert load_rljob(path, validate=False).spec.trainer.strategy == "megatron"


def test_load_picks_the_rljob_from_a_multi_document_file(tmp_path: Path) -> None:
    path = tmp_path / "multi.yaml"
    path.write_text(
        yaml.safe_dump_all([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}}, minimal()])
    )
    assert load_rljob(path).name == "job"


def test_wrong_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        parse_rljob({**minimal(), "kind": "RayJob"})


def test_resolved_spec_round_trips_with_every_default_written(tmp_path: Path) -> None:
    job = parse_rljob(separate(checkpoint={"persistentVolumeClaim": "ckpt"}))
    text = dump_resolved(job)
    path = tmp_path / "rljob.yaml"
    path.write_text(text)
    back = load_rljob(path)
    assert back == resolve(job)
    s = back.spec
    assert s.async_ is not None and s.async_.parameter_sync_step == 4
    assert s.gpu.resource_name == "amd.com/gpu"
    assert [t.key for t in s.gpu.tolerations or []] == ["amd.com/gpu"]
    assert s.checkpoint.path == "/checkpoints"
    assert back.metadata == {"name": "job", "namespace": "ns", "annotations": {"rlkube.io/resolved": "true"}}
    assert "status" not in yaml.safe_load(text)


def test_resolve_gives_colocated_rollout_all_trainer_gpus_and_keeps_sync_free_of_async() -> None:
    job = parse_rljob(merge(minimal(), {"trainer": {"replicas": 2, "gpusPerReplica": 8}}))
    s = resolve(job).spec
    assert (s.rollout.replicas, s.rollout.gpus_per_replica) == (2, 8)
    assert s.async_ is None


def test_resolve_fills_async_defaults_in_colocate_async() -> None:
    job = minimal()
    job["spec"]["training"] = {"mode": "colocate_async"}
    s = resolve(parse_rljob(job)).spec
    assert s.async_ is not None and s.async_.partial_rollout is True


def test_rljob_ignores_server_metadata_fields() -> None:
    body = minimal()
    body["metadata"].update({"uid": "abc", "generation": 3, "managedFields": []})
    body["status"] = {"phase": "Running", "progress": {"step": 3, "totalSteps": 10}}
    job = RLJob.model_validate(body)
    assert job.status is not None and job.status.progress is not None and job.status.progress.step == 3
