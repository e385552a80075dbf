"""`rlkube-train` on a user's mistakes: one line naming the field or file (and line), exit code 2,
no traceback (``--debug`` shows it); and the per-step line a user reads in `kubectl logs`."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlkube.runtime.metrics import TerminalSink

from .conftest import write_job

TESTS = Path(__file__).resolve().parents[1]


def _train(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS)}
    return subprocess.run(
        [sys.executable, "-m", "rlkube.runtime.train", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("rlkube-train: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_missing_rljob_file(tmp_path: Path) -> None:
    line = _one_line_error(_train("--rljob", str(tmp_path / "nope.yaml"), "--no-ray"))
    assert line == f"rlkube-train: error: --rljob {tmp_path / 'nope.yaml'}: no such file"


def test_unparseable_yaml_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("apiVersion: rlkube.io/v1alpha1\nkind: RLJob\nspec:\n  model: {path: /m\n  data: x\n")
    line = _one_line_error(_train("--rljob", str(bad), "--no-ray"))
    assert f"{bad} line " in line and "not valid YAML" in line and "<unicode string>" not in line


def test_a_schema_error_names_the_field(tmp_path: Path, tiny_task: Any) -> None:
    job = write_job(tmp_path / "job.yaml", tiny_task, training={"mode": "fastest"})
    line = _one_line_error(_train("--rljob", str(job), "--no-ray"))
    assert "spec.training.mode" in line


def test_missing_model_path_names_the_field(tmp_path: Path, tiny_task: Any) -> None:
    job = write_job(tmp_path / "job.yaml", tiny_task, model={"path": str(tmp_path / "no-model")})
    line = _one_line_error(_train("--rljob", str(job), "--no-ray", "--output", str(tmp_path / "o")))
    assert f"model.path: {tmp_path / 'no-model'} is not a directory" in line
    assert "Repo id" not in line


def test_empty_data_file_names_the_field_and_file(tmp_path: Path, tiny_task: Any) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    job = write_job(tmp_path / "job.yaml", tiny_task, data={"train": str(empty)})
    line = _one_line_error(_train("--rljob", str(job), "--no-ray", "--output", str(tmp_path / "o")))
    assert f"data.train: {empty} holds no records" in line


def test_a_nan_reward_is_one_line_and_debug_shows_the_traceback(tmp_path: Path, tiny_task: Any) -> None:
    job = write_job(tmp_path / "job.yaml", tiny_task, data={"reward": "trainer._rewards:nan_on_degenerate"})
    line = _one_line_error(_train("--rljob", str(job), "--no-ray", "--output", str(tmp_path / "o")))
    assert "reward function 'trainer._rewards:nan_on_degenerate' returned nan for sample" in line
    debug = _train("--rljob", str(job), "--no-ray", "--output", str(tmp_path / "o2"), "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "NonFiniteRewardError" in debug.stderr


def test_the_step_line_has_a_timestamp_and_one_label_per_value() -> None:
    out = io.StringIO()
    TerminalSink(10, stream=out).write(
        3,
        {
            "reward/mean": 0.5,
            "eval/reward_mean": 0.625,
            "staleness/mean": 0.25,
            "perf/tokens_per_s": 1234.0,
            "timing_s/step": 1.5,
        },
    )
    line = out.getvalue().strip()
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ step 3/10 reward=0\.5 eval=0\.625 staleness=0\.25 "
        r"tok/s=1\.23e\+03 step_s=1\.5",
        line,
    ), line
    assert "mean=" not in line


@pytest.mark.parametrize("limit", [6])
def test_prompts_longer_than_max_prompt_length_are_skipped_and_counted(
    tmp_path: Path, tiny_task: Any, limit: int
) -> None:
    from rlkube.api import load_rljob, resolve
    from rlkube.runtime.errors import UserError
    from rlkube.runtime.trainer.core import Trainer

    job = resolve(load_rljob(write_job(tmp_path / "job.yaml", tiny_task, data={"maxPromptLength": limit})))
    tr = Trainer(job)
    prompts = tr.next_prompts(40)
    assert tr.prompts_too_long > 0 and tr.counters()["data/prompts_too_long_total"] == tr.prompts_too_long
    for p in prompts:  # whole prompts, never cut on the left
        assert len(p.prompt_ids) <= limit and p.prompt_ids == tr.encode(p.record, cut=False)
    assert [p.index for p in prompts] == list(range(40))
    job = resolve(load_rljob(write_job(tmp_path / "job2.yaml", tiny_task, data={"maxPromptLength": 2})))
    with pytest.raises(UserError, match=r"data\.maxPromptLength: every prompt of data\.train"):
        Trainer(job).next_prompts(1)


def test_max_position_embeddings_is_applied_where_the_model_loads(tmp_path: Path, tiny_task: Any) -> None:
    from transformers import AutoConfig

    from rlkube.api import load_rljob, resolve
    from rlkube.runtime.trainer.core import Trainer
    from rlkube.runtime.trainer.engines import build_engine

    own = AutoConfig.from_pretrained(tiny_task.model_dir).max_position_embeddings
    want = own + 100
    job = resolve(
        load_rljob(
            write_job(
                tmp_path / "job.yaml",
                tiny_task,
                model={"maxPositionEmbeddings": want},
                algorithm={"name": "grpo", "groupSize": 4, "kl": {"useKlLoss": True}},
            )
        )
    )
    tr = Trainer(job)
    assert tr.actor.model.config.max_position_embeddings == want
    assert tr.ref is not None and tr.ref.model.config.max_position_embeddings == want
    eng = build_engine(job.spec)
    try:
        assert eng.model.config.max_position_embeddings == want
    finally:
        eng.shutdown()
