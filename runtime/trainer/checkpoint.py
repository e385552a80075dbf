"""Atomic checkpoints: ``<dir>/step-000012/`` appears whole or not at all.

Each checkpoint is written into a temporary sibling directory, fsynced, then renamed into place
(rename is atomic on one filesystem, a PVC included); ``latest`` is the newest complete directory,
found by listing, so a kill between the rename and anything else cannot leave a dangling pointer.
Contents: ``state.pt`` (model, optimizer, scheduler, step, weights version, sampler position, RNG)
and ``replay.json`` (buffered samples with their policy versions, async modes).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PREFIX = "step-"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    replay: list[dict[str, Any]] | None = None,
    keep: int = 3,
    write_shards: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep``.

    ``write_shards(dir)`` writes the trainer ranks' model/optimiser shards (DCP) into the staged
    directory before it is renamed into place."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{PREFIX}{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if write_shards is not None:
        write_shards(tmp)
    with (tmp / "state.pt").open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    with (tmp / "replay.json").open("w") as f:
        json.dump({"step": step, "samples": replay or []}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # a re-save of the same step (resume then immediate save): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(f".tmp-{PREFIX}*"):
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [
        p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.pt").exists()
    ]
    return sorted(out, key=lambda p: int(p.name[len(PREFIX) :]))


def load_latest(
    root: str | Path, load_shards: Callable[[Path], None] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """(state, replay samples) of the newest checkpoint, or None; ``load_shards(dir)`` reads the
    ranks' model/optimiser shards from it."""
    ckpts = list_checkpoints(root)
    if not ckpts:
        return None
    path = ckpts[-1]
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    replay = json.loads((path / "replay.json").read_text()).get("samples", [])
    if load_shards is not None:
        load_shards(path)
    return state, replay
