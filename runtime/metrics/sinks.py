"""Metric sinks. The JSONL file is the record of truth (the resume test reads its step sequence);
TensorBoard and the terminal line are views of the same dicts."""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from rlkube.api.contract import now_rfc3339

log = logging.getLogger(__name__)


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in metrics.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out[k] = f
    return out


class JsonlSink:
    """One JSON object per step, flushed and fsynced, so a SIGKILL loses at most the line in flight."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        import os

        self._f.write(json.dumps({"step": step, **metrics}, sort_keys=True) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics file, skipping a torn last line."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class TensorBoardSink:
    """Scalars per step. With ``history`` (a resume) the old event files are replaced by a fresh one
    holding exactly those rows, so re-run steps appear once in any TensorBoard reader."""

    def __init__(self, logdir: str | Path, history: Sequence[dict[str, Any]] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if history is not None:
            for old in Path(logdir).glob("events.out.tfevents.*"):
                old.unlink()
        self._w = SummaryWriter(log_dir=str(logdir))
        for row in history or []:
            step = row.get("step")
            if isinstance(step, int):
                self.write(step, _clean({k: v for k, v in row.items() if k != "step"}))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class TerminalSink:
    """A rich progress bar on a TTY, one compact timestamped line per step otherwise (CI, kubectl logs)."""

    # metric -> label on the line (labels are unique: a reader greps for them)
    KEYS = {
        "reward/mean": "reward",
        "eval/reward_mean": "eval",
        "staleness/mean": "staleness",
        "perf/tokens_per_s": "tok/s",
        "timing_s/step": "step_s",
    }

    def __init__(self, total: int, start: int = 0, stream: Any = None) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self._progress: Any = None
        self._task: Any = None
        if getattr(self.stream, "isatty", lambda: False)():
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeRemainingColumn,
                )

                self._progress = Progress(
                    TextColumn("[bold]rlkube[/bold]"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeRemainingColumn(),
                    TextColumn("{task.description}"),
                )
                self._progress.start()
                self._task = self._progress.add_task("", total=total, completed=start)
            except Exception:  # a progress bar is never worth failing a run
                self._progress = None

    def _line(self, metrics: dict[str, float]) -> str:
        return " ".join(f"{label}={metrics[k]:.3g}" for k, label in self.KEYS.items() if k in metrics)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=self._line(metrics))
        else:
            now = now_rfc3339()
            print(f"{now} step {step}/{self.total} {self._line(metrics)}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


class MetricsLogger:
    """Fans one metrics dict out to every sink; a failing view sink is logged and dropped."""

    def __init__(self, sinks: Sequence[Any]) -> None:
        self.sinks = list(sinks)

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """Finite numbers go to every sink; short text labels (``weight_sync/transport``) to the
        JSONL record only. Returns the numbers."""
        clean = _clean(metrics)
        labels = {k: v for k, v in metrics.items() if isinstance(v, str)}
        for s in list(self.sinks):
            try:
                s.write(step, {**clean, **labels} if isinstance(s, JsonlSink) else clean)
            except Exception as e:
                if isinstance(s, JsonlSink):
                    raise
                log.warning("metrics sink %s failed (%s); disabling it", type(s).__name__, e)
                self.sinks.remove(s)
        return clean

    def close(self) -> None:
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:
                log.warning("closing %s: %s", type(s).__name__, e)
