"""SGLang rollout adapter over SGLang's native HTTP server API.

UNTESTED AGAINST THE REAL ENGINE: SGLang needs its CUDA/ROCm kernels and cannot run on the
machines this project is developed on. The adapter is written to SGLang's documented request and
response shapes (``/generate`` with ``input_ids`` + ``sampling_params`` + ``return_logprob``,
``/abort_request``, ``/update_weights_from_tensor``, ``/init_weights_update_group`` +
``/update_weights_from_distributed``, ``/release_memory_occupation``, ``/resume_memory_occupation``,
``/flush_cache``) and is tested only against a recorded-protocol fake server.

Every sample is one ``/generate`` call (its own ``rid``) made from a small thread pool, so
``abort_all`` can abort each ``rid`` and collect the partial output SGLang returns with
``finish_reason.type == "abort"``. Logprobs: SGLang's ``output_token_logprobs`` are the model's
temperature-1 logprobs by default, the same convention as the other engines (``rollout.base``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rlkube.api.platform_env import engine_args, engine_env
from rlkube.runtime.rollout.base import (
    Completion,
    EngineCapabilities,
    RolloutRequest,
    SamplingParams,
    UnsupportedCapability,
    check_resumable,
    continuation_params,
    expand_samples,
    in_request_order,
    sample_seed,
)

Serializer = Callable[[list[tuple[str, Any]]], str]


class SGLangError(RuntimeError):
    """The server answered with an error or ``success: false``."""


def launch_command(
    model_path: str, *, port: int = 30000, vendor: str = "amd", tp: int = 1, host: str = "127.0.0.1"
) -> tuple[list[str], dict[str, str]]:
    """argv and env to start an SGLang server with the platform's decisions (ROCm: triton attention,
    AITER off, custom all-reduce off)."""
    argv = [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp),
        "--skip-tokenizer-init",
    ]
    for k, v in engine_args(vendor, "sglang").items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v not in (False, None):
            argv += [flag, str(v)]
    return argv, engine_env(vendor, "sglang")


class SGLangEngine:
    """Client for one SGLang server (``base_url``), implementing the rollout interface."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:30000",
        *,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
        version: int = 0,
        tensor_serializer: Serializer | None = None,
        sleep_supported: bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._version = version
        self._serializer = tensor_serializer
        self._sleep_supported = sleep_supported
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sglang-rollout")
        self._lock = threading.Lock()
        self._live: dict[str, tuple[Completion, int, Future[Any]]] = {}
        self._finished: list[Completion] = []
        self._aborting: set[str] = set()
        self._aborted: list[Completion] = []
        self._counter = 0
        self._errors: list[BaseException] = []

    # ---- HTTP ------------------------------------------------------------------------------
    def _post(self, path: str, payload: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        data = json.dumps(payload or {}).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            raise SGLangError(f"POST {path}: HTTP {e.code}: {e.read()[:500]!r}") from e
        out = json.loads(body) if body else {}
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangError(f"POST {path}: {out.get('message', 'failed')}")
        return out

    # ---- interface -------------------------------------------------------------------------
    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            engine="sglang",
            sleep=self._sleep_supported,
            sleep_levels=(1, 2) if self._sleep_supported else (),
            abort_resume=True,
            async_submit=True,
            full_weights=True,
            delta_weights=False,
            distributed_weights=True,
            notes="HTTP adapter; untested against the real SGLang engine (contract-tested only)",
        )

    @property
    def policy_version(self) -> int:
        return self._version

    def sampling_payload(self, p: SamplingParams, sample_index: int, offset: int) -> dict[str, Any]:
        """SGLang ``sampling_params`` for one sample (one request per sample, n=1)."""
        sp: dict[str, Any] = {
            "temperature": p.temperature,
            "top_p": p.top_p,
            "max_new_tokens": p.max_tokens,
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": True,  # stop only on the caller's ids, like the other engines
            "skip_special_tokens": False,
            "no_stop_trim": True,  # keep the stop token in output_ids
        }
        seed = sample_seed(p, sample_index, offset)
        if seed is not None:
            sp["sampling_seed"] = seed % (2**31)
        return sp

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        for req, k in expand_samples(requests):
            p = req.params
            c = Completion(
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
            self._start(c, list(c.prompt_ids), SamplingParams(**{**vars(p), "n": 1}), 0)

    def resume(self, partials: Sequence[Completion]) -> None:
        for c in check_resumable(partials):
            self._start(c, [*c.prompt_ids, *c.token_ids], continuation_params(c), len(c.token_ids))

    def _start(self, c: Completion, prefix: list[int], seg: SamplingParams, offset: int) -> None:
        if seg.max_tokens == 0:
            with self._lock:
                c.finish_reason = "length"
                self._finished.append(c)
            return
        with self._lock:
            self._counter += 1
            rid = f"{c.request_id}-{c.sample_index}-{self._counter}"
            payload = {
                "rid": rid,
                "input_ids": prefix,
                "sampling_params": self.sampling_payload(seg, c.sample_index, offset),
                "return_logprob": True,
                "stream": False,
            }
            fut = self._pool.submit(self._post, "/generate", payload)
            self._live[rid] = (c, self._version, fut)
        fut.add_done_callback(lambda f, rid=rid: self._done(rid, f))  # type: ignore[misc]

    def _done(self, rid: str, fut: Future[Any]) -> None:
        with self._lock:
            entry = self._live.pop(rid, None)
            if entry is None:
                return
            c, version, _ = entry
            try:
                out = fut.result()
            except BaseException as exc:
                self._errors.append(exc)
                return
            toks, lps = parse_generate_output(out)
            c.extend(toks, lps, version)
            fr = (out.get("meta_info", {}).get("finish_reason") or {}).get("type", "length")
            c.finish_reason = (
                "abort" if fr == "abort" or rid in self._aborting else ("stop" if fr == "stop" else "length")
            )
            self._aborting.discard(rid)
            if c.finish_reason != "abort":
                self._finished.append(c)
            else:
                self._aborted.append(c)

    def poll(self) -> list[Completion]:
        with self._lock:
            if self._errors:
                raise SGLangError("a /generate call failed") from self._errors.pop(0)
            out, self._finished = self._finished, []
            return out

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        ids = {r.request_id for r in requests}
        self.submit(requests)
        with self._lock:
            futs = [f for c, _, f in self._live.values() if c.request_id in ids]
        for f in futs:
            with contextlib.suppress(BaseException):  # errors are reported below
                f.result()
        with self._lock:
            if self._errors:
                raise SGLangError("a /generate call failed") from self._errors.pop(0)
            mine = [c for c in self._finished if c.request_id in ids]
            self._finished = [c for c in self._finished if c.request_id not in ids]
        return in_request_order(mine, requests)

    def abort_all(self) -> list[Completion]:
        """POST /abort_request for every rid in flight; SGLang returns each with its partial output."""
        with self._lock:
            self._aborted = []
            live = dict(self._live)
            self._aborting |= set(live)
        for rid in live:
            self._post("/abort_request", {"rid": rid})
        for _, _, fut in live.values():
            with contextlib.suppress(BaseException):
                fut.result(timeout=self.timeout_s)
        with self._lock:
            out, self._aborted = self._aborted, []
            return out

    def flush_cache(self) -> None:
        self._post("/flush_cache")

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory: level 1 the KV cache, level 2 the weights too."""
        if not self._sleep_supported:
            raise UnsupportedCapability("sleep disabled for this server")
        tags = ["kv_cache"] if level == 1 else ["kv_cache", "weights"]
        self._post("/release_memory_occupation", {"tags": tags})

    def wake(self) -> None:
        if not self._sleep_supported:
            raise UnsupportedCapability("sleep disabled for this server")
        self._post("/resume_memory_occupation", {"tags": None})

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """``/update_weights_from_tensor`` (colocated: SGLang's serializer passes CUDA IPC handles)."""
        ser = self._serializer or _sglang_serializer()
        self._post(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [ser(list(named_tensors))],
                "load_format": None,
                "flush_cache": True,
                "weight_version": str(version),
            },
        )
        self._version = version

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Join the trainer's process group; the trainer is rank 0, the server's ranks start at
        ``rank_offset``."""
        self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        group_name: str = "weight_update_group",
    ) -> None:
        """Announce a broadcast; the caller broadcasts the tensors over the group meanwhile."""
        self._post(
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "flush_cache": True,
                "weight_version": str(version),
            },
        )
        self._version = version

    def update_weights(self, buckets: Iterable[Any], version: int) -> set[str]:
        raise UnsupportedCapability(
            "SGLang has no checksum-verified delta path: use load_weights or update_weights_from_distributed"
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def parse_generate_output(out: dict[str, Any]) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of one ``/generate`` response.

    ``meta_info.output_token_logprobs`` is a list of ``[logprob, token_id, text_or_null]``; it is
    the source of truth for ids too, ``output_ids`` the fallback.
    """
    meta = out.get("meta_info", {})
    entries = meta.get("output_token_logprobs")
    if entries:
        return [int(e[1]) for e in entries], [float(e[0]) for e in entries]
    toks = [int(t) for t in out.get("output_ids", [])]
    return toks, [0.0] * len(toks)


def _sglang_serializer() -> Serializer:
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as e:
        raise UnsupportedCapability(
            "update_weights_from_tensor needs sglang's MultiprocessingSerializer (sglang not installed)"
        ) from e
    return lambda named: MultiprocessingSerializer.serialize(named, output_str=True)
