"""Rollout engines for a spec: the constructor options each engine kind takes from it."""

from __future__ import annotations

from typing import Any

from rlkube.api import RLJobSpec


def build_engine(spec: RLJobSpec, model_path: str | None = None, **overrides: Any) -> Any:
    """An in-process engine of ``spec.rollout.engine`` serving ``model_path`` (default spec.model.path)."""
    from rlkube.runtime.rollout.registry import engine_options, make_engine

    kind = spec.rollout.engine
    opts = {**engine_options(spec, kind), **overrides}
    return make_engine(kind, model_path or spec.model.path, **opts)
