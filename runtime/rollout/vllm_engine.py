"""The vLLM rollout engine, driven in-process through ``LLMEngine``'s step loop.

Every sample is its own vLLM request (seed derived per sample, prefix caching shares the prompt),
streamed back with ``RequestOutputKind.DELTA`` so an abort keeps exactly the tokens (and logprobs)
already received. A background thread steps the engine while requests are unfinished; all engine
calls are serialised by one lock. Weights go to the worker extension
(``rlkube.runtime.rollout.vllm_worker.WeightLoaderExtension``) through ``collective_rpc`` by method
name. Logprobs are ``logprobs_mode="raw_logprobs"``: the temperature-1 model distribution, as the
hf engine reports (see ``rollout.base``). Construct it inside ``main``/a test/an actor, never at
import time: vLLM spawns worker processes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlkube.api import RLJobSpec
from rlkube.runtime.rollout.base import (
    Completion,
    EngineCapabilities,
    RolloutRequest,
    SamplingParams,
    ThreadedEngine,
    UnsupportedCapability,
    check_base_version,
    check_resumable,
    continuation_params,
    expand_samples,
    sample_seed,
)
from rlkube.runtime.rollout.registry import model_config_overrides, spec_dtype
from rlkube.runtime.rollout.vllm_worker import bucket_to_wire, tensor_from_wire, tensor_to_wire

WORKER_EXTENSION = "rlkube.runtime.rollout.vllm_worker.WeightLoaderExtension"


@dataclass
class _Live:
    completion: Completion
    version: int
    n_new: int = 0


class VLLMEngine(ThreadedEngine):
    """``vllm.LLM`` with token-id prompts, async submit/poll/abort and RL weight loading."""

    _name = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str | None = None,
        max_model_len: int = 1024,
        max_num_seqs: int = 64,
        seed: int = 0,
        enforce_eager: bool | None = None,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool | None = None,
        version: int = 0,
        **engine_args: Any,
    ) -> None:
        from vllm import LLM

        self._on_gpu = torch.cuda.is_available()
        if enable_sleep_mode is None:
            enable_sleep_mode = self._on_gpu
        if enable_sleep_mode and not self._on_gpu:
            raise UnsupportedCapability("vLLM sleep mode needs a GPU")
        kwargs: dict[str, Any] = dict(
            model=str(model_path),
            skip_tokenizer_init=True,
            dtype=dtype or ("bfloat16" if self._on_gpu else "float32"),
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            enforce_eager=(not self._on_gpu) if enforce_eager is None else enforce_eager,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="raw_logprobs",
            enable_prefix_caching=True,
        )
        # On vLLM's CPU backend gpu_memory_utilization is the share of the node's RAM it reserves
        # (its default 0.92 rarely fits a shared machine): pass the spec's on every platform.
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if self._on_gpu:
            kwargs["enable_sleep_mode"] = enable_sleep_mode
        kwargs.update(engine_args)
        self._sleep_mode = bool(enable_sleep_mode)
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        self.max_model_len = max_model_len
        self._version = version
        self._lock = threading.RLock()  # every call into the engine
        self._init_queue()
        self._live: dict[str, _Live] = {}
        self._counter = 0
        self._closed = False
        self._sleeping = False
        self._thread = threading.Thread(target=self._loop, name="vllm-rollout", daemon=True)
        self._thread.start()

    # ---- interface -------------------------------------------------------------------------
    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            engine="vllm",
            sleep=self._sleep_mode,
            sleep_levels=(1, 2) if self._sleep_mode else (),
            abort_resume=True,
            async_submit=True,
            full_weights=True,
            delta_weights=True,
            distributed_weights=False,
            notes="in-process LLMEngine; weights via worker extension + in-place layer reload"
            + ("" if self._on_gpu else "; CPU: no sleep mode"),
        )

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        items = []
        for req, k in expand_samples(requests):
            p = req.params
            comp = Completion(
                request_id=req.request_id,
                sample_index=k,
                prompt_ids=[int(t) for t in req.prompt_ids],
                token_ids=[],
                logprobs=[],
                finish_reason="length",
                policy_version=self._version,
                token_versions=[],
                params=p,
            )
            items.append((comp, list(comp.prompt_ids), SamplingParams(**{**_asdict(p), "n": 1}), 0))
        self._add(items)

    def resume(self, partials: Sequence[Completion]) -> None:
        items = []
        for c in check_resumable(partials):
            items.append((c, [*c.prompt_ids, *c.token_ids], continuation_params(c), len(c.token_ids)))
        self._add(items)

    def num_in_flight(self) -> int:
        with self._cv:
            return len(self._live)

    def abort_all(self) -> list[Completion]:
        with self._lock, self._cv:
            ids = list(self._live)
            if ids:
                self.engine.abort_request(ids)
            out = []
            for rid in ids:
                lv = self._live.pop(rid)
                lv.completion.finish_reason = "abort"
                out.append(lv.completion)
            return out

    def sleep(self, level: int = 1) -> None:
        if not self._sleep_mode:
            raise UnsupportedCapability("vLLM sleep mode is GPU-only (capabilities.sleep is False here)")
        self._require_idle()
        with self._lock:
            self.llm.sleep(level=level)
            self._sleeping = True

    def wake(self) -> None:
        if not self._sleep_mode:
            raise UnsupportedCapability("vLLM sleep mode is GPU-only (capabilities.sleep is False here)")
        with self._lock:
            self.llm.wake_up()
            self._sleeping = False

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """HF-named full (or partial) weights; each touched vLLM layer is reloaded whole."""
        items = [(n, tensor_to_wire(t)) for n, t in named_tensors]
        self._require_idle()
        with self._lock:
            names, wire = [n for n, _ in items], [w for _, w in items]
            self.llm.collective_rpc("rlkube_load_hf_weights", args=(names, wire))
            self.llm.reset_prefix_cache()
            self._version = version

    def update_weights(self, buckets: Iterable[Any], version: int) -> set[str]:
        """Apply ``rlkube.runtime.weights`` buckets (checksums verified in the worker first)."""
        items = list(buckets)
        check_base_version(items, self._version)
        wire = [bucket_to_wire(b) for b in items]
        self._require_idle()
        with self._lock:
            results = self.llm.collective_rpc("rlkube_apply_buckets", args=(wire,))
            self.llm.reset_prefix_cache()
            self._version = version
        return set(results[0])

    def read_weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """HF-named weights the worker last loaded (its snapshot), for bit-exactness checks."""
        with self._lock:
            res = self.llm.collective_rpc("rlkube_read_weights", args=(names,))[0]
        return {k: tensor_from_wire(v) for k, v in res.items()}

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        with self._lock, contextlib.suppress(Exception):  # best effort: may already be gone
            self.engine.engine_core.shutdown()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals -------------------------------------------------------------------------
    def _require_idle(self) -> None:
        if self.num_in_flight():
            raise RuntimeError("samples in flight: abort_all() (and resume later) before updating weights")

    def _in_flight_locked(self, ids: set[str]) -> bool:
        return any(lv.completion.request_id in ids for lv in self._live.values())

    def _vllm_params(self, p: SamplingParams, sample_index: int, offset: int) -> Any:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            max_tokens=p.max_tokens,
            stop_token_ids=list(p.stop_token_ids),
            seed=sample_seed(p, sample_index, offset),
            logprobs=0 if p.logprobs else None,
            ignore_eos=True,  # stop only on the caller's stop ids, as the hf engine does
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _add(self, items: list[tuple[Completion, list[int], SamplingParams, int]]) -> None:
        from vllm.inputs import TokensPrompt

        for c, prefix, seg, _ in items:
            if len(prefix) + seg.max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt {len(prefix)} + max_tokens {seg.max_tokens} > max_model_len {self.max_model_len}"
                )
            if not prefix:
                raise ValueError(f"{c.key}: empty prompt")
        with self._lock, self._cv:
            self._raise_if_failed()
            for c, prefix, seg, offset in items:
                if seg.max_tokens == 0:
                    c.finish_reason = "length"
                    self._finished.append(c)
                    continue
                self._counter += 1
                rid = f"{c.request_id}#{c.sample_index}#{self._counter}"
                params = self._vllm_params(seg, c.sample_index, offset)
                # vLLM returns an internal id (ours + a random suffix); outputs and abort_request
                # use the id we passed, so that is the key.
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prefix), params)
                self._live[rid] = _Live(c, self._version)
            self._cv.notify_all()

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._closed and not self._live:
                        self._cv.wait()
                    if self._closed:
                        return
                with self._lock:
                    if not self.engine.has_unfinished_requests():
                        with self._cv:
                            self._cv.wait(timeout=0.01)
                        continue
                    outputs = self.engine.step()
                    with self._cv:
                        for out in outputs:
                            lv = self._live.get(out.request_id)
                            if lv is None:  # aborted meanwhile
                                continue
                            o: Any = out.outputs[0]  # type: ignore[index]
                            toks = list(o.token_ids)
                            lps = (
                                [d[t].logprob for d, t in zip(o.logprobs, toks, strict=True)]
                                if o.logprobs
                                else [0.0] * len(toks)
                            )
                            lv.completion.extend(toks, lps, lv.version)
                            if out.finished:
                                fr = o.finish_reason
                                lv.completion.finish_reason = "stop" if fr == "stop" else "length"
                                self._finished.append(lv.completion)
                                del self._live[out.request_id]
                        self._cv.notify_all()
        except BaseException as exc:
            with self._cv:
                self._error = exc
                self._cv.notify_all()


def _asdict(p: SamplingParams) -> dict[str, Any]:
    return {
        "n": p.n,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "max_tokens": p.max_tokens,
        "stop_token_ids": p.stop_token_ids,
        "seed": p.seed,
        "logprobs": p.logprobs,
    }


def options_from_spec(spec: RLJobSpec) -> dict[str, Any]:
    """VLLMEngine options for a spec: context length, memory share, tensor parallelism, batch width."""
    from rlkube.runtime.rollout.sizing import vllm_memory_options

    opts: dict[str, Any] = {
        "max_model_len": spec.data.max_prompt_length + spec.data.max_response_length,
        "seed": spec.training.seed,
        "dtype": spec_dtype(spec),
        "tensor_parallel_size": spec.rollout.tensor_parallel_size,
        "max_num_seqs": spec.rollout.max_num_seqs,
        **vllm_memory_options(spec),  # gpuMemoryUtilization / kvCacheMemory, on every platform
    }
    if overrides := model_config_overrides(spec):
        opts["hf_overrides"] = overrides
    return opts
