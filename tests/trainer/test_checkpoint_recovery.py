"""Checkpoints that recover: a damaged newest checkpoint is reported by file and the previous one is
used; a save that fails (ENOSPC) leaves nothing behind, names the file and checkpoint.path, and the
next save succeeds."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rlkube.api import load_rljob, resolve
from rlkube.runtime.metrics import read_jsonl
from rlkube.runtime.trainer import checkpoint as ckpt
from rlkube.runtime.trainer.checkpoint_guard import MANIFEST, CheckpointLoadError, CheckpointSaveError
from rlkube.runtime.trainer.local import run_local

from .conftest import write_job


def _save(root: Path, *steps: int) -> None:
    for s in steps:
        ckpt.save_checkpoint(root, s, {"step": s, "w": torch.arange(1000.0) * s}, [{"x": s}], keep=5)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tmp_path, 2, 4)
    bad = tmp_path / "step-000004" / "state.pt"
    _truncate(bad)
    with caplog.at_level(logging.WARNING):
        loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None and loaded[0]["step"] == 2 and loaded[1] == [{"x": 2}]
    assert str(bad) in caplog.text and "truncated" in caplog.text and "step-000002" in caplog.text
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-000002"]
    assert (tmp_path / "corrupt-step-000004" / "state.pt").exists()  # kept for inspection


def test_a_checkpoint_without_manifest_that_fails_to_load_is_named(tmp_path: Path) -> None:
    """Older checkpoints (no manifest) are loaded unverified; torch's zip error is tied to the file."""
    _save(tmp_path, 2, 4)
    (tmp_path / "step-000004" / MANIFEST).unlink()
    bad = tmp_path / "step-000004" / "state.pt"
    bad.write_bytes(bad.read_bytes()[:100])
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None and loaded[0]["step"] == 2


def test_no_loadable_checkpoint_is_an_error_listing_every_file(tmp_path: Path) -> None:
    _save(tmp_path, 2, 4)
    for s in (2, 4):
        _truncate(tmp_path / f"step-00000{s}" / "state.pt")
    with pytest.raises(CheckpointLoadError) as err:
        ckpt.load_latest(tmp_path)
    msg = str(err.value)
    assert "checkpoint.path" in msg and str(tmp_path) in msg
    assert "step-000002/state.pt" in msg and "step-000004/state.pt" in msg
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-000002", "step-000004"]  # untouched


def test_a_save_that_hits_enospc_cleans_up_and_names_the_file(tmp_path: Path, monkeypatch: Any) -> None:
    _save(tmp_path, 2)
    real_save = torch.save

    def save_onto_a_full_disk(obj: Any, f: Any) -> None:
        f.write(b"x" * 4096)  # part of the file made it
        with open("/dev/full", "wb") as full:  # the kernel's own ENOSPC
            full.write(b"x")
            full.flush()

    monkeypatch.setattr(ckpt.torch, "save", save_onto_a_full_disk)
    with pytest.raises(CheckpointSaveError) as err:
        ckpt.save_checkpoint(tmp_path, 4, {"step": 4}, [])
    msg = str(err.value)
    assert err.value.__cause__ is not None and err.value.__cause__.errno == errno.ENOSPC  # type: ignore[attr-defined]
    assert "No space left on device" in msg and "state.pt" in msg and "checkpoint.path" in msg
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")], "staging dir left behind"
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-000002"]
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    ckpt.save_checkpoint(tmp_path, 4, {"step": 4}, [])  # the retry starts clean and succeeds
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None and loaded[0]["step"] == 4


def test_a_run_resumes_from_the_previous_checkpoint_when_the_newest_is_damaged(
    tmp_path: Path, tiny_task: Any
) -> None:
    path = write_job(tmp_path / "job.yaml", tiny_task, training={"totalSteps": 4})
    out = tmp_path / "out"
    run_local(resolve(load_rljob(path)), out)
    _truncate(out / "checkpoints" / "step-000004" / "state.pt")
    path = write_job(tmp_path / "job.yaml", tiny_task, training={"totalSteps": 6})
    res = run_local(resolve(load_rljob(path)), out)
    assert res.resumed_from == 2 and res.final_step == 6
    assert [r["step"] for r in read_jsonl(res.metrics_path) if r["step"] > 0] == [1, 2, 3, 4, 5, 6]
    assert (out / "checkpoints" / "corrupt-step-000004").is_dir()
    assert os.path.isdir(out / "checkpoints" / "step-000006")


def _two_ranks_save_damage_load(port: int, job_path: str, root: str, conn: Any, out: Any) -> None:
    """Rank 0 of a 2-rank gloo world: checkpoints at steps 1 and 2 (each rank its DCP shard), rank
    1's shard of step 2 damaged, then a load over both ranks."""
    from rlkube.runtime.distributed.groups import leave_trainer_world
    from rlkube.runtime.trainer.core import Trainer

    from .rank_peers import PipePeer, fixed_samples, full_weights, join_world

    join_world(0, 2, port)
    peer = PipePeer(conn)
    trainer = Trainer(resolve(load_rljob(job_path)), peers=[peer])
    saved = {}
    for step in (1, 2):
        trainer.train(fixed_samples(trainer), {})
        trainer.step = step
        ckpt.save_checkpoint(root, step, trainer.state_dict(), [], write_shards=trainer.save_models)
        saved[step] = full_weights(trainer)
    shard = Path(root) / "step-000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes: only the CRC can tell
    shard.write_bytes(bytes(data))
    loaded = ckpt.load_latest(root, load_shards=trainer.load_models)
    assert loaded is not None
    now = full_weights(trainer)
    diff = {s: max(float(abs(now[k] - w[k]).max()) for k in w) for s, w in saved.items()}
    peer.close()
    leave_trainer_world()
    out.put((loaded[0]["step"], diff))


def test_a_damaged_rank_shard_falls_back_on_every_rank(tmp_path: Path, tiny_task: Any) -> None:
    """Two trainer ranks, each writing its own DCP shard: the manifest covers every rank's shard, so
    a corrupt shard of rank 1 in the newest checkpoint is caught before any rank loads, and both
    ranks resume from the previous checkpoint's weights."""
    import multiprocessing as mp

    from rlkube.runtime.distributed.groups import free_port

    from .rank_peers import run_ranks, serve_learner

    job = write_job(
        tmp_path / "job.yaml",
        tiny_task,
        trainer={"gpusPerReplica": 2},
        training={"trainBatchSize": 4, "miniBatchSize": 2, "learningRate": 1e-3},
    )
    root = tmp_path / "ckpt"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    a, b = ctx.Pipe()
    procs = [
        ctx.Process(target=_two_ranks_save_damage_load, args=(port, str(job), str(root), a, out)),
        ctx.Process(target=serve_learner, args=(1, 2, port, str(job), b)),
    ]
    step, diff = run_ranks(procs, out)
    assert step == 1
    assert diff[1] == 0.0 and diff[2] > 0  # step 1's weights on both ranks, not step 2's
    assert sorted(p.name for p in root.iterdir()) == ["corrupt-step-000002", "step-000001"]
    manifest = json.loads((root / "step-000001" / MANIFEST).read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.pt", "replay.json"} <= set(manifest)


def test_shards_that_hit_enospc_clean_up_and_name_checkpoint_path(tmp_path: Path, monkeypatch: Any) -> None:
    """DCP wraps a rank's write error in its own CheckpointException (a BaseException): the guard
    still sees the ENOSPC, removes the staging directory and says what to free."""
    import contextlib
    from collections.abc import Iterator

    from torch.distributed.checkpoint import filesystem

    from rlkube.runtime.distributed.checkpoint import save_model_shards

    model = torch.nn.Linear(32, 32)
    optim = torch.optim.AdamW(model.parameters())
    real = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def shard_onto_a_full_disk(self: Any, path: Any, mode: str) -> Iterator[Any]:
        if str(path).endswith(".distcp"):
            with open("/dev/full", mode) as f:  # the kernel's own ENOSPC
                yield f
        else:
            with real(self, path, mode) as f:
                yield f

    def shards(d: Path) -> None:
        save_model_shards(d, {"actor": (model, optim, None)})

    _save(tmp_path, 2)
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", shard_onto_a_full_disk)
    with pytest.raises(CheckpointSaveError) as err:
        ckpt.save_checkpoint(tmp_path, 4, {"step": 4}, [], write_shards=shards)
    assert err.value.__cause__ is not None and err.value.__cause__.errno == errno.ENOSPC  # type: ignore[attr-defined]
    assert "No space left on device" in str(err.value) and "checkpoint.path" in str(err.value)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")], "staging dir left behind"
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-000002"]
