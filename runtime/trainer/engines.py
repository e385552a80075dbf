"""Rollout engines for a spec, and the Ray-actor proxy that makes a remote engine look local."""

from __future__ import annotations

import logging
import os
from typing import Any

from rlkube.api import RLJobSpec
from rlkube.runtime.errors import UserError

log = logging.getLogger(__name__)


def build_engine(spec: RLJobSpec, model_path: str | None = None, **overrides: Any) -> Any:
    """An in-process engine of ``spec.rollout.engine`` serving ``model_path`` (default spec.model.path)."""
    from rlkube.runtime.rollout.registry import engine_options, make_engine

    kind = spec.rollout.engine
    if kind in ("hf", "vllm"):
        from rlkube.runtime.trainer.core import check_model_dir

        check_model_dir("model.path", model_path or spec.model.path)
    if kind == "vllm" and not _on_gpu():
        from rlkube.runtime.rollout.sizing import cpu_plan_problem

        problem = cpu_plan_problem(spec)
        if problem:
            raise UserError(problem)
        if spec.rollout.kv_cache_memory and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            log.warning(
                "VLLM_CPU_KVCACHE_SPACE=%s GiB is set: vLLM uses it instead of rollout.kvCacheMemory (%s)",
                os.environ["VLLM_CPU_KVCACHE_SPACE"],
                spec.rollout.kv_cache_memory,
            )
    opts = {**engine_options(spec, kind), **overrides}
    return make_engine(kind, model_path or spec.model.path, **opts)


def _on_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class RayEngineProxy:
    """The rollout interface over a Ray actor handle (``RolloutActor``): every call is a remote call."""

    def __init__(self, handle: Any, timeout_s: float = 600.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    def _call(self, name: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.handle, name).remote(*args), timeout=self.timeout_s)

    def generate(self, requests: Any) -> Any:
        return self._call("generate", list(requests))

    def submit(self, requests: Any) -> None:
        self._call("submit", list(requests))

    def poll(self) -> Any:
        return self._call("poll")

    def abort_all(self) -> Any:
        return self._call("abort_all")

    def resume(self, partials: Any) -> None:
        self._call("resume", list(partials))

    def update_weights(self, buckets: Any, version: int) -> Any:
        return self._call("update_weights", list(buckets), version)

    def num_in_flight(self) -> int:
        return int(self._call("num_in_flight"))
