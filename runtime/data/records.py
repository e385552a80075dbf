"""Prompt/answer records loaded from JSONL or Parquet (plain or verl layout)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_VERL_ANSWER_KEY = "reward_model.ground_truth"


@dataclass(frozen=True)
class Record:
    """One prompt with its reference answer.

    ``messages`` is set for chat-formatted datasets (verl layout: a list of ``{role, content}``) so the
    trainer can apply the tokenizer's chat template; ``prompt`` is then the messages' contents joined
    by blank lines. ``extra`` keeps the row's other top-level fields (data_source, ids, ...).
    """

    prompt: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None


def _lookup(row: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """``row["a"]["b"]`` for ``"a.b"``; (found, value)."""
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False, None
        cur = cur[part]
    return True, cur


def _read_rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return [dict(r) for r in pq.read_table(path).to_pylist()]
    if suffix == ".json" and path.read_text(encoding="utf-8").lstrip().startswith("["):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not all(isinstance(r, dict) for r in data):
            raise ValueError(f"{path}: expected a JSON array of objects")
        return [dict(r) for r in data]
    if suffix in (".jsonl", ".json", ".ndjson"):
        rows: list[dict[str, Any]] = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON object per line ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
                rows.append(obj)
        return rows
    raise ValueError(f"{path}: unsupported data file type {suffix!r}; use .jsonl or .parquet")


def _prompt_of(value: Any, where: str) -> tuple[str, list[dict[str, str]] | None]:
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        messages = [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in value]
        return "\n\n".join(m["content"] for m in messages), messages
    raise ValueError(f"{where}: prompt must be a string or a list of {{role, content}} messages")


def load_records(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Record]:
    """Records from a ``.jsonl`` (one object a line), ``.json`` (that, or one array) or ``.parquet`` file.

    Keys may be dotted paths into nested objects (``reward_model.ground_truth``). The verl layout
    (chat-message prompt, answer under ``reward_model.ground_truth``) is read as is: when the default
    ``answer`` key is absent that path is tried. Non-string answers (numbers) are converted with ``str``.
    A missing key is an error that names the file, the row and the key.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}")
    records = []
    for i, row in enumerate(_read_rows(p)):
        where = f"{p} row {i}"
        found, prompt_value = _lookup(row, prompt_key)
        if not found:
            raise KeyError(f"{where}: no prompt key {prompt_key!r} (keys: {sorted(row)})")
        found, answer = _lookup(row, answer_key)
        used_answer_key = answer_key
        if not found and answer_key == "answer":
            found, answer = _lookup(row, _VERL_ANSWER_KEY)
            used_answer_key = _VERL_ANSWER_KEY
        if not found or answer is None:
            raise KeyError(f"{where}: no answer key {answer_key!r} (keys: {sorted(row)})")
        prompt, messages = _prompt_of(prompt_value, where)
        top = {prompt_key.split(".")[0], used_answer_key.split(".")[0]}
        extra = {k: v for k, v in row.items() if k not in top}
        records.append(Record(prompt=prompt, answer=str(answer), extra=extra, messages=messages))
    return records


def write_jsonl(records: Sequence[Record], path: str | Path) -> None:
    """Write records as JSONL that :func:`load_records` reads back to equal records."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for r in records:
            row: dict[str, Any] = dict(r.extra)
            row["prompt"] = r.messages if r.messages is not None else r.prompt
            row["answer"] = r.answer
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def split_records(
    records: Sequence[Record], held_out: int | float, *, seed: int = 0
) -> tuple[list[Record], list[Record]]:
    """Split into ``(train, held_out)`` so that no prompt text appears in both.

    ``held_out`` is a count of distinct prompts or, if a float in (0, 1), a fraction of them. Records
    sharing a prompt go to the same side, so duplicates cannot leak the held-out set into training.
    Deterministic in ``seed``; each side keeps the input order.
    """
    prompts = list(dict.fromkeys(r.prompt for r in records))
    if isinstance(held_out, float) and not isinstance(held_out, bool) and 0.0 < held_out < 1.0:
        n_held = round(held_out * len(prompts))
    else:
        n_held = int(held_out)
    if not 0 <= n_held <= len(prompts):
        raise ValueError(f"held_out={held_out} is not within the {len(prompts)} distinct prompts")
    random.Random(seed).shuffle(prompts)
    held = set(prompts[:n_held])
    return [r for r in records if r.prompt not in held], [r for r in records if r.prompt in held]
