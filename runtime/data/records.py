"""Prompt/answer records loaded from JSONL or Parquet."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Record:
    """One prompt with its reference answer.

    ``messages`` is set for chat-formatted datasets (verl layout: a list of ``{role, content}``) so the
    trainer can apply the tokenizer's chat template; ``prompt`` is then the messages' text joined.
    ``extra`` keeps the row's other fields (data_source, ids, ...).
    """

    prompt: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None


def load_records(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Record]:
    """Records from a ``.jsonl``/``.json`` (one object a line) or ``.parquet`` file."""
    raise NotImplementedError


def write_jsonl(records: Sequence[Record], path: str | Path) -> None:
    """Write records as JSONL that :func:`load_records` reads back unchanged."""
    raise NotImplementedError


def split_records(
    records: Sequence[Record], held_out: int | float, *, seed: int = 0
) -> tuple[list[Record], list[Record]]:
    """Split into (train, held_out) so that no prompt text appears in both."""
    raise NotImplementedError
