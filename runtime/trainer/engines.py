"""Rollout engines for a spec: the constructor options each engine kind takes from it."""

from __future__ import annotations

from typing import Any

from rlkube.api import RLJobSpec


def engine_options(spec: RLJobSpec, kind: str) -> dict[str, Any]:
    """Constructor options for ``make_engine`` from the spec (what each engine understands)."""
    max_len = spec.data.max_prompt_length + spec.data.max_response_length
    if kind == "hf":
        slots = min(
            spec.rollout.max_num_seqs, max(spec.training.train_batch_size * spec.algorithm.group_size, 1)
        )
        # async modes over-subscribe: room for the extra groups in flight
        slots = min(spec.rollout.max_num_seqs, slots * 2) if spec.training.mode != "sync" else slots
        return {
            "dtype": spec.model.dtype if _on_gpu() else "float32",
            "num_slots": slots,
            "max_seq_len": max_len,
            "seed": spec.training.seed,
        }
    if kind == "vllm":
        return {
            "max_model_len": max_len,
            "seed": spec.training.seed,
            "dtype": spec.model.dtype if _on_gpu() else "float32",
            "gpu_memory_utilization": spec.rollout.gpu_memory_utilization,
            "tensor_parallel_size": spec.rollout.tensor_parallel_size,
            "max_num_seqs": spec.rollout.max_num_seqs,
        }
    return {}


def _on_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def build_engine(spec: RLJobSpec, model_path: str | None = None, **overrides: Any) -> Any:
    """An in-process engine of ``spec.rollout.engine`` serving ``model_path`` (default spec.model.path)."""
    from rlkube.runtime.rollout import make_engine

    kind = spec.rollout.engine
    opts = {**engine_options(spec, kind), **overrides}
    return make_engine(kind, model_path or spec.model.path, **opts)
