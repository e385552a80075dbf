"""Checkpoint directories that recover, whatever is inside them (torch.save files, DCP shards, JSON).

The format layer writes its files into a staging directory; this module makes the result a
checkpoint one can trust or clearly reject:

- **Atomic, verified writes** (:func:`staged`): files go into ``.tmp-step-NNNNNN-<pid>/``; on
  success a manifest (``rlkube-manifest.json``: size and CRC-32 of every file) is written, the
  directory is fsynced and renamed to ``step-NNNNNN/``. On any error (ENOSPC included) the staging
  directory is removed, so a retry starts clean, and :class:`CheckpointSaveError` names the file and
  the checkpoint root.
- **Verification on load** (:func:`verify`): every manifest entry must exist with its size and CRC.
- **Fallback** (:func:`load_newest`): the newest checkpoint that verifies *and* loads wins; a bad
  one is reported with the file at fault and renamed ``corrupt-step-NNNNNN/`` (kept for
  inspection, never listed again), and the previous one is tried. If none loads, nothing is
  renamed and :class:`CheckpointLoadError` lists every failure.

Directories without a manifest (written before manifests existed) are loaded unverified.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from rlkube.runtime.errors import UserError

log = logging.getLogger(__name__)

PREFIX = "step-"
MANIFEST = "rlkube-manifest.json"
CORRUPT_PREFIX = "corrupt-"
_STEP_DIR = re.compile(r"^step-(\d+)$")
T = TypeVar("T")


class CheckpointSaveError(UserError):
    """A checkpoint could not be written (disk full, permissions); nothing half-written remains."""


class CorruptCheckpoint(Exception):
    """One checkpoint failed verification or loading; ``file`` is the file at fault."""

    def __init__(self, file: Path, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file = file
        self.reason = reason


class CheckpointLoadError(UserError):
    """No checkpoint under the root could be loaded."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:06d}"


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _crc32(path: Path, chunk: int = 1 << 22) -> int:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def write_manifest(directory: Path, checksum: bool = True) -> dict[str, Any]:
    """Record every file under ``directory`` (size, CRC-32 unless ``checksum`` is off)."""
    files: dict[str, dict[str, int]] = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            entry = {"size": p.stat().st_size}
            if checksum:
                entry["crc32"] = _crc32(p)
            files[p.relative_to(directory).as_posix()] = entry
    manifest = {"version": 1, "files": files}
    target = directory / MANIFEST
    with target.open("w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def verify(directory: Path) -> bool:
    """Raise :class:`CorruptCheckpoint` naming the bad file; True if verified, False if no manifest."""
    mpath = directory / MANIFEST
    if not mpath.exists():
        return False
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(mpath, f"unreadable manifest ({e})") from e
    for name, entry in files.items():
        p = directory / name
        if not p.is_file():
            raise CorruptCheckpoint(p, "missing")
        size = p.stat().st_size
        if size != entry["size"]:
            raise CorruptCheckpoint(p, f"truncated or changed: {size} bytes, manifest says {entry['size']}")
        if "crc32" in entry and _crc32(p) != entry["crc32"]:
            raise CorruptCheckpoint(p, "checksum mismatch (the file changed after it was written)")
    return True


@contextlib.contextmanager
def staged(root: str | Path, step: int, *, where: str = "", checksum: bool = True) -> Iterator[Path]:
    """Yield a staging directory for checkpoint ``step``; commit it on success, remove it on error.

    ``where`` names the setting that chose ``root`` (e.g. ``checkpoint.path``) for error messages.
    """
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp-{PREFIX}{step:06d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        yield tmp
        write_manifest(tmp, checksum=checksum)
        for p in tmp.rglob("*"):
            if p.is_dir():
                _fsync(p)
        _fsync(tmp)
        if final.exists():  # a re-save of the same step (resume then immediate save): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        file = e.filename or tmp
        setting = f" ({where} is {root})" if where else ""
        raise CheckpointSaveError(
            f"checkpoint of step {step} not saved: {e.strerror or e} writing {file}; the partial "
            f"checkpoint was removed and earlier ones are intact. Free space under {root}{setting} "
            "(or lower checkpoint.keep), then rerun to resume from the last checkpoint"
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def list_checkpoints(root: str | Path) -> list[Path]:
    """Committed checkpoints (``step-N`` directories holding files), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and any(p.iterdir()):
            out.append((int(m.group(1)), p))
    return [p for _, p in sorted(out)]


def prune(root: str | Path, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints and any staging directory left by a crash."""
    root = Path(root)
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    remove_staging(root, keep_own=True)


def remove_staging(root: str | Path, keep_own: bool = False) -> None:
    """Delete ``.tmp-step-*`` directories (crashed saves); ``keep_own`` spares this process's."""
    root = Path(root)
    if not root.is_dir():
        return
    own = f"-{os.getpid()}"
    for p in root.glob(f".tmp-{PREFIX}*"):
        if keep_own and p.name.endswith(own):
            continue
        shutil.rmtree(p, ignore_errors=True)


def load_newest(
    root: str | Path, load: Callable[[Path], T], *, where: str = ""
) -> tuple[Path, T, list[CorruptCheckpoint]] | None:
    """(directory, load(directory), the bad ones skipped) for the newest checkpoint that loads.

    ``load`` should raise :class:`CorruptCheckpoint` naming the file it could not read; any other
    exception is attributed to the directory. None when there is no checkpoint at all.
    """
    root = Path(root)
    remove_staging(root)
    ckpts = list_checkpoints(root)
    if not ckpts:
        return None
    bad: list[CorruptCheckpoint] = []
    for path in reversed(ckpts):
        try:
            verify(path)
            value = load(path)
        except CorruptCheckpoint as e:
            bad.append(e)
        except Exception as e:  # a format error the loader did not attribute
            bad.append(CorruptCheckpoint(path, f"{type(e).__name__}: {e}"))
        else:
            for b in bad:
                d = _checkpoint_of(b.file, root)
                quarantine = d.with_name(CORRUPT_PREFIX + d.name)
                if quarantine.exists():
                    shutil.rmtree(quarantine, ignore_errors=True)
                os.rename(d, quarantine)
                log.warning(
                    "checkpoint %s is unusable (%s: %s); resumed from %s instead. The bad one is kept "
                    "as %s for inspection: delete it when done",
                    d.name,
                    b.file,
                    b.reason,
                    path.name,
                    quarantine,
                )
            return path, value, bad
    setting = f" ({where} is {root})" if where else ""
    details = "; ".join(str(b) for b in bad)
    raise CheckpointLoadError(
        f"no checkpoint under {root}{setting} can be loaded: {details}. Restore them, or move them "
        "away to start from scratch"
    )


def _checkpoint_of(file: Path, root: Path) -> Path:
    """The ``step-N`` directory directly under ``root`` that holds ``file``."""
    file = Path(file)
    for parent in [file, *file.parents]:
        if parent.parent == root:
            return parent
    return file
