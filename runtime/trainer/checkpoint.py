"""The trainer's checkpoint format: ``<dir>/step-000012/`` with ``state.pt`` and ``replay.json``.

``state.pt``: model, optimizer, scheduler, step, weights version, sampler position, counters, RNG.
``replay.json``: buffered samples with their policy versions (async modes). Atomicity, the manifest,
verification, fallback to an older checkpoint and clean-up after a failed save are
:mod:`checkpoint_guard`'s job, so this module only says how the two files are written and read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from rlkube.runtime.trainer.checkpoint_guard import (
    CorruptCheckpoint,
    list_checkpoints,
    load_newest,
    prune,
    staged,
)

__all__ = ["list_checkpoints", "load_latest", "save_checkpoint"]

WHERE = "checkpoint.path"  # the spec field that chooses the root (else <output>/checkpoints)


def _write(path: Path, write: Any) -> None:
    """Write one file durably; an OSError carries the file name (the guard reports it)."""
    try:
        with path.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def save_checkpoint(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    replay: list[dict[str, Any]] | None = None,
    keep: int = 3,
) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep``."""
    root = Path(root)
    with staged(root, step, where=WHERE) as tmp:
        _write(tmp / "state.pt", lambda f: torch.save(state, f))
        payload = json.dumps({"step": step, "samples": replay or []}).encode()
        _write(tmp / "replay.json", lambda f: f.write(payload))
    prune(root, keep)
    return root / f"step-{step:06d}"


def _load(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    except Exception as e:
        raise CorruptCheckpoint(path / "state.pt", f"unreadable ({e})") from e
    try:
        replay = json.loads((path / "replay.json").read_text()).get("samples", [])
    except (OSError, ValueError, AttributeError) as e:
        raise CorruptCheckpoint(path / "replay.json", f"unreadable ({e})") from e
    return state, replay


def load_latest(root: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """(state, replay samples) of the newest checkpoint that verifies and loads, or None.

    Older checkpoints are tried when the newest is bad (it is renamed ``corrupt-step-N`` and
    reported); :class:`CheckpointLoadError` when none loads.
    """
    found = load_newest(root, _load, where=WHERE)
    return None if found is None else found[1]
