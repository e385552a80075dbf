"""Rollout engines behind one interface (``rlkube.runtime.rollout.base``).

Engines are imported lazily: vLLM and the SGLang client pull heavy or absent packages, and
vLLM's engine must never be built at import time (it spawns workers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkube.runtime.rollout.base import (
    Completion,
    EngineCapabilities,
    RolloutEngine,
    RolloutRequest,
    SamplingParams,
    UnsupportedCapability,
)

__all__ = [
    "Completion",
    "EngineCapabilities",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingParams",
    "UnsupportedCapability",
    "make_engine",
]


def make_engine(kind: str, model_path: str | Path | None = None, **options: Any) -> RolloutEngine:
    """Build a rollout engine: ``"hf"``, ``"vllm"`` (in-process) or ``"sglang"`` (HTTP client).

    ``options`` go to the engine's constructor (see each engine's docstring).
    """
    if kind == "hf":
        from rlkube.runtime.rollout.hf import HFEngine

        return HFEngine(model_path, **options)
    if kind == "vllm":
        from rlkube.runtime.rollout.vllm_engine import VLLMEngine

        if model_path is None:
            raise ValueError("the vllm engine needs model_path")
        return VLLMEngine(model_path, **options)
    if kind == "sglang":
        from rlkube.runtime.rollout.sglang import SGLangEngine

        return SGLangEngine(**options)
    raise ValueError(f"unknown rollout engine {kind!r}; expected hf, vllm or sglang")
