"""Rollout engines behind one interface (``rlkube.runtime.rollout.base``), registered by name in
``rlkube.runtime.rollout.registry``.

Engines are imported lazily: vLLM and the SGLang client pull heavy or absent packages, and
vLLM's engine must never be built at import time (it spawns workers).
"""

from __future__ import annotations

from rlkube.runtime.rollout.base import (
    Completion,
    EngineCapabilities,
    RolloutEngine,
    RolloutRequest,
    SamplingParams,
    UnsupportedCapability,
)
from rlkube.runtime.rollout.registry import ENGINE_REGISTRY, engine_options, make_engine

__all__ = [
    "ENGINE_REGISTRY",
    "Completion",
    "EngineCapabilities",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingParams",
    "UnsupportedCapability",
    "engine_options",
    "make_engine",
]
