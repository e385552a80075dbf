"""Prompt datasets from JSONL / Parquet files, a resumable prompt sampler, and the tiny arithmetic task."""

from rlkube.runtime.data.arith import make_arith_records
from rlkube.runtime.data.records import Record, load_records, split_records, write_jsonl
from rlkube.runtime.data.sampler import PromptSampler

__all__ = ["PromptSampler", "Record", "load_records", "make_arith_records", "split_records", "write_jsonl"]
