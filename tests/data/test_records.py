"""load_records / write_jsonl / split_records on real files."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlkube.runtime.data import Record, load_records, split_records, write_jsonl


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return path


def test_jsonl_plain_layout_with_extra_fields(tmp_path: Path) -> None:
    p = _jsonl(
        tmp_path / "d.jsonl", [{"prompt": "2+2=", "answer": 4, "id": 7}, {"prompt": "1+0=", "answer": "1"}]
    )
    recs = load_records(p)
    assert recs == [Record("2+2=", "4", {"id": 7}), Record("1+0=", "1", {})]


def test_json_array_file(tmp_path: Path) -> None:
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]))
    assert [(r.prompt, r.answer) for r in load_records(p)] == [("a", "1"), ("b", "2")]


def test_custom_and_dotted_keys(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "d.jsonl", [{"question": "q?", "meta": {"gold": "42"}}])
    (rec,) = load_records(p, prompt_key="question", answer_key="meta.gold")
    assert (rec.prompt, rec.answer, rec.extra) == ("q?", "42", {})


def test_missing_key_names_the_path_row_and_key(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "solution": "2"}])
    with pytest.raises(KeyError, match=r"d\.jsonl row 1: no answer key 'answer'"):
        load_records(p)
    with pytest.raises(KeyError, match="no prompt key 'question'"):
        load_records(p, prompt_key="question")


def test_bad_json_line_is_reported_with_its_line_number(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2"):
        load_records(p)


def test_missing_file_and_unknown_suffix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unsupported"):
        load_records(tmp_path / "d.csv")


def test_parquet_plain(tmp_path: Path) -> None:
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["3+4=", "5-1="], "answer": ["7", "4"]}), p)
    assert [(r.prompt, r.answer) for r in load_records(p)] == [("3+4=", "7"), ("5-1=", "4")]


def test_parquet_verl_layout(tmp_path: Path) -> None:
    # The layout verl's preprocessing scripts write: chat-message prompt, answer under reward_model.
    p = tmp_path / "gsm8k.parquet"
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"index": 0, "split": "train"},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), p)
    (rec,) = load_records(p)
    assert rec.answer == "2"
    assert rec.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    assert rec.prompt == "Be brief.\n\n1+1?"
    assert rec.extra == {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "extra_info": {"index": 0, "split": "train"},
    }


def test_write_jsonl_round_trips(tmp_path: Path) -> None:
    recs = [
        Record("1+1=", "2", {"task": "arith"}),
        Record("hi", "x", {}, messages=[{"role": "user", "content": "hi"}]),
    ]
    write_jsonl(recs, tmp_path / "sub" / "out.jsonl")
    assert load_records(tmp_path / "sub" / "out.jsonl") == recs


def test_split_never_overlaps_even_with_duplicate_prompts() -> None:
    recs = [Record(f"p{i % 10}", str(i)) for i in range(30)]  # every prompt three times
    train, held = split_records(recs, 3, seed=1)
    assert len({r.prompt for r in held}) == 3 and len(held) == 9
    assert not {r.prompt for r in train} & {r.prompt for r in held}
    assert len(train) + len(held) == 30
    assert split_records(recs, 3, seed=1) == (train, held)
    assert split_records(recs, 3, seed=2) != (train, held)


def test_split_by_fraction_and_bounds() -> None:
    recs = [Record(f"p{i}", "a") for i in range(10)]
    train, held = split_records(recs, 0.2, seed=0)
    assert (len(train), len(held)) == (8, 2)
    with pytest.raises(ValueError, match="distinct prompts"):
        split_records(recs, 11)
