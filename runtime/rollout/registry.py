"""Rollout engines by name: where each implementation lives and how a spec becomes its options.

`rlkube.api.contract.ENGINES` lists the names a spec may use (the API cannot import the runtime);
this table registers one implementation per name, and a test asserts the two agree. Adding an
engine is its module (the engine class and, if it takes options from the spec, an
`options_from_spec(spec)` function) plus one line here (and its name in the contract's list).
Implementations are imported on first use: vLLM pulls heavy packages and must never build at import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlkube.api import RLJobSpec
from rlkube.api.contract import Engine

if TYPE_CHECKING:
    from rlkube.runtime.rollout.base import RolloutEngine

ModelPath = Literal["required", "optional", "none"]


@dataclass(frozen=True)
class EngineEntry:
    """One engine: its module and class, and whether the constructor takes the model path first.

    The module's `options_from_spec(spec) -> dict`, when it has one, gives the constructor options.
    """

    module: str
    cls: str
    model_path: ModelPath = "required"


ENGINE_REGISTRY: dict[Engine, EngineEntry] = {
    "hf": EngineEntry("rlkube.runtime.rollout.hf", "HFEngine", "optional"),
    "vllm": EngineEntry("rlkube.runtime.rollout.vllm_engine", "VLLMEngine"),
    "sglang": EngineEntry("rlkube.runtime.rollout.sglang", "SGLangEngine", "none"),  # an HTTP client
}
OPTIONS_FUNCTION = "options_from_spec"


def engine_entry(kind: str) -> EngineEntry:
    """The registered engine `kind`, or a ValueError naming the ones that exist."""
    entry = ENGINE_REGISTRY.get(kind)
    if entry is None:
        raise ValueError(f"unknown rollout engine {kind!r}; expected one of {list(ENGINE_REGISTRY)}")
    return entry


def engine_options(spec: RLJobSpec, kind: str | None = None) -> dict[str, Any]:
    """Constructor options of engine `kind` (default spec.rollout.engine) derived from the spec."""
    module = importlib.import_module(engine_entry(kind or spec.rollout.engine).module)
    from_spec = getattr(module, OPTIONS_FUNCTION, None)
    return dict(from_spec(spec)) if from_spec is not None else {}


def make_engine(kind: str, model_path: str | Path | None = None, **options: Any) -> RolloutEngine:
    """Build engine `kind`; `options` go to its constructor (see each engine's docstring)."""
    entry = engine_entry(kind)
    cls = getattr(importlib.import_module(entry.module), entry.cls)
    if entry.model_path == "none":
        engine: RolloutEngine = cls(**options)
        return engine
    if entry.model_path == "required" and model_path is None:
        raise ValueError(f"the {kind} engine needs model_path")
    engine = cls(model_path, **options)
    return engine


def spec_dtype(spec: RLJobSpec) -> str:
    """The dtype an engine runs in: the spec's on a GPU, float32 on a CPU (no fast bf16 kernels there)."""
    import torch

    return spec.model.dtype if torch.cuda.is_available() else "float32"


def model_config_overrides(spec: RLJobSpec) -> dict[str, Any]:
    """config.json fields the spec overrides (model.maxPositionEmbeddings), for every engine."""
    mpe = spec.model.max_position_embeddings
    return {"max_position_embeddings": mpe} if mpe else {}
