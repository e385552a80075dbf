"""The hf rollout engine: plain PyTorch/transformers, runs anywhere, the reference engine.

A background thread drives ``StaticDecoder`` over a fixed set of slots: it admits waiting samples
into free slots (one batched prefill per round, one forward per distinct prompt), keeps the live
samples in the lowest rows (moving a sample down when that lets steps run over a smaller batch
bucket), runs up to ``sync_every`` decode steps without looking at the host, then collects finished
slots (their flags copied ``flag_lag`` steps before the chunk's end, so the host plans the next
chunk while the GPU runs the last steps). Each chunk's new tokens are copied to the host behind the
chunk (asynchronously on CUDA) and turned into Python lists while the next chunk runs, so collecting
a finished batch costs one chunk's worth of list building, not the whole response's, while the GPU
waits. ``submit``/``poll`` are therefore truly asynchronous; ``generate`` is submit-and-wait.
``abort_all`` pauses the loop at its next sync point and hands back every unfinished sample with the
tokens it has; ``resume`` re-prefills prompt + those tokens (under whatever weights are loaded now)
and continues with the remaining budget.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlkube.runtime.heap import freeze_warm_heap, thaw_heap
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
from rlkube.runtime.rollout.hf_decode import (
    DOWN_SPLIT_K,
    FOLD_MLP_NORM_DEFAULT,
    GATED_MIN_ROWS_DEFAULT,
    GROUPED_ATTENTION_MIN_ROWS_DEFAULT,
    LINEAR_MAX_ROWS_DEFAULT,
    SAMPLING_DEFAULT,
    CompileSetting,
    KernelSetting,
    StaticDecoder,
    to_device,
)
from rlkube.runtime.rollout.registry import model_config_overrides, spec_dtype

if TYPE_CHECKING:
    from rlkube.api import RLJobSpec
    from rlkube.runtime.weights.direct import DirectCopyStats


@dataclass
class _Work:
    """One sample (or resumed segment) waiting for or occupying a slot."""

    completion: Completion  # accumulates tokens across segments; returned to the caller
    prefix: list[int]  # what is prefilled: prompt + tokens of earlier segments
    params: SamplingParams  # this segment's params (n == 1, remaining budget)
    key: int
    version: int = 0  # weights version of this segment
    slot: int = -1
    max_pos: int = 0  # host-side upper bound of the slot's position
    remaining: int = 0  # host-side upper bound of the decode steps this segment still needs
    prefill: int = -1  # which prefill wrote its prefix's K/V (samples of one share it)
    harvested: int = 0  # this segment's tokens already in ``completion`` (the rest is on the device)


@dataclass
class _Harvest:
    """One chunk's tokens on their way to the host: for each row, ``width`` columns from the first
    one its sample had not read yet, copied after the chunk's steps; read while the next runs."""

    works: list[tuple[_Work, int, int]]  # each sample of the chunk, its row then, its first column
    n_gen: torch.Tensor  # [rows] host copies
    tok: torch.Tensor  # [rows, width]
    lp: torch.Tensor  # [rows, width]
    stopped: torch.Tensor  # [rows] bool: finished on a stop token
    event: Any  # a CUDA event after the copies (None on the CPU: they were synchronous)


def _key_for(params: SamplingParams, sample_index: int, offset: int, rng: torch.Generator) -> int:
    seed = sample_seed(params, sample_index, offset)
    if seed is None:
        return int(torch.randint(0, 2**62, (1,), generator=rng).item())
    return seed & ((1 << 62) - 1)


class _ParamView(MutableMapping[str, torch.Tensor]):
    """HF-named parameters where assignment copies *into* the existing storage.

    Keeps tensor addresses stable, which the captured CUDA graphs depend on.
    """

    def __init__(self, model: nn.Module) -> None:
        self._t: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._t[name].data

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        dst = self._t[name]
        if tuple(value.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(dst.shape)}")
        with torch.no_grad():
            dst.data.copy_(value)

    def __delitem__(self, name: str) -> None:
        raise TypeError("parameters cannot be deleted")

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)


class HFEngine(ThreadedEngine):
    """Batched static-cache decoding of an HF causal LM (Qwen2/Llama family)."""

    _name = "hf"

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        model: nn.Module | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        num_slots: int = 64,
        max_seq_len: int = 1024,
        sync_every: int | None = None,
        flag_lag: int | None = None,
        cuda_graphs: bool | None = None,
        compile_step: CompileSetting = "auto",
        kernels: KernelSetting = "auto",
        max_stop_ids: int = 8,
        share_prompt_reads: bool = True,
        harvest_tokens: bool = True,
        linear_max_rows: int = LINEAR_MAX_ROWS_DEFAULT,
        down_split_min_rows: int | None = None,
        down_split_k: int = DOWN_SPLIT_K,
        gated_min_rows: int = GATED_MIN_ROWS_DEFAULT,
        sampling: str = SAMPLING_DEFAULT,
        grouped_attention_min_rows: int = GROUPED_ATTENTION_MIN_ROWS_DEFAULT,
        fold_mlp_norm: bool = FOLD_MLP_NORM_DEFAULT,
        freeze_heap: bool = True,
        seed: int = 0,
        version: int = 0,
        config_overrides: dict[str, Any] | None = None,
    ) -> None:
        if model is None:
            if model_path is None:
                raise ValueError("pass model_path or model")
            from transformers import AutoModelForCausalLM

            dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            tdtype = _dtype(dtype) or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                str(model_path), dtype=tdtype, **(config_overrides or {})
            )
            model = loaded.to(dev)
        self.model = model.eval()
        self.device = next(self.model.parameters()).device
        self.decoder = StaticDecoder(
            self.model,
            num_slots=num_slots,
            max_seq_len=max_seq_len,
            max_new_tokens=max_seq_len,
            max_stop_ids=max_stop_ids,
            use_cuda_graphs=cuda_graphs,
            compile_step=compile_step,
            kernels_setting=kernels,
            linear_max_rows=linear_max_rows,
            down_split_min_rows=down_split_min_rows,
            down_split_k=down_split_k,
            gated_min_rows=gated_min_rows,
            sampling=sampling,
            grouped_attention_min_rows=grouped_attention_min_rows,
            fold_mlp_norm=fold_mlp_norm,
        )
        self.sync_every = sync_every or (16 if self.device.type == "cuda" else 4)
        # The finished flags are copied this many steps before a chunk's end, so the host plans the
        # next chunk while the GPU runs the last steps (instead of the GPU waiting for the host).
        # A sample that stops in those steps is collected one chunk later; its row stays in the
        # batch meanwhile (masked). 0: read at the chunk's end (the CPU default, where nothing runs
        # behind the host's back anyway).
        if flag_lag is not None and flag_lag < 0:
            raise ValueError(f"flag_lag must be >= 0 (steps), got {flag_lag}")
        self.flag_lag = (1 if self.device.type == "cuda" else 0) if flag_lag is None else flag_lag
        self._flag_buf = torch.zeros(num_slots, dtype=torch.bool, pin_memory=self.device.type == "cuda")
        self._flags: tuple[int, Any] | None = None  # (rows, CUDA event) of this chunk's early copy
        self.flag_reads = {"early": 0, "end": 0}  # where each chunk's finished flags were read
        self._version = version
        self.last_load_stats: DirectCopyStats | None = None
        from rlkube.runtime.weights.direct import DirectCopier

        self._copier = DirectCopier()  # keeps the validated plan while the tensors stay put
        self._target_cache: tuple[list[tuple[torch.Tensor, int]], dict[str, torch.Tensor]] | None = None
        self._rng = torch.Generator().manual_seed(seed)
        self._init_queue()
        self._waiting: deque[_Work] = deque()
        self._slots: list[_Work | None] = [None] * num_slots
        # the samples of one prefill read their prompt's K/V from one row (the attention kernel)
        self.share_prompt_reads = share_prompt_reads
        # copy each chunk's tokens to the host behind it (False: all at collection, the A/B)
        self.harvest_tokens = harvest_tokens
        self._harvest: _Harvest | None = None  # the newest chunk's, not yet fully read
        self._harvest_prev: _Harvest | None = None  # the chunk before it's, read while this one runs
        self._chunk_harvest: _Harvest | None = None  # the harvest of the chunk just launched, if any
        # samples seen finished in a chunk's early flags: their rows are free already; they are
        # completed from that chunk's harvest once it has landed (sample, harvest, its row there)
        self._finishing: list[tuple[_Work, _Harvest, int]] = []
        self.finished_from_harvest = 0  # samples completed that way, without a read of the device
        # two sets of host buffers (each row's first column, n_gen, tokens, logprobs), alternating
        # between chunks, and each row's columns to gather on the device
        self._harvest_bufs: list[tuple[torch.Tensor, ...] | None] = [None, None]
        self._harvest_cols = torch.arange(self.decoder.T + 1, device=self.device)
        self._harvest_count = 0
        # tokens moved into completions by each route: behind the chunks, or read at collection
        self.tokens_by_route = {"harvest": 0, "collect": 0}
        self._prefills = 0
        self._shares_stale = False
        self._pause = 0  # callers waiting for the loop to stop at a sync point
        self._busy = False  # the loop is inside a chunk (touching the decoder)
        self._closed = False
        # freeze the process's heap when the first work is done (compiled, captured: warm)
        self._freeze_heap_pending, self._froze_heap = freeze_heap, False
        # a benchmark sets a list here to time the loop's device work by phase (CUDA events:
        # ("admit" | "decode", start, end)); the GPU's idle time is the wall time outside them
        self.phase_events: list[tuple[str, Any, Any]] | None = None
        self._thread = threading.Thread(target=self._loop, name="hf-rollout", daemon=True)
        self._thread.start()

    # ---- interface -------------------------------------------------------------------------
    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            engine="hf",
            sleep=False,
            abort_resume=True,
            async_submit=True,
            full_weights=True,
            delta_weights=True,
            distributed_weights=True,
            direct_weights=True,
            notes=(
                "static KV cache, batch buckets; on GPUs CUDA graphs, torch.compile and Triton "
                "decode kernels (self-checked); weights updated in place"
            ),
        )

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        """Queue requests; their samples show up in ``poll`` when finished."""
        items = []
        per_request: dict[str, tuple[list[int], SamplingParams]] = {}  # checked once, shared by its samples
        for req, k in expand_samples(requests):
            p = req.params
            if req.request_id not in per_request:
                self._check(req.prompt_ids, p)
                seg = SamplingParams(
                    n=1,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    max_tokens=p.max_tokens,
                    stop_token_ids=p.stop_token_ids,
                    seed=p.seed,
                    logprobs=p.logprobs,
                )
                per_request[req.request_id] = ([int(t) for t in req.prompt_ids], seg)
            prompt, seg = per_request[req.request_id]
            comp = Completion(
                request_id=req.request_id,
                sample_index=k,
                prompt_ids=list(prompt),
                token_ids=[],
                logprobs=[],
                finish_reason="length",
                policy_version=self._version,
                token_versions=[],
                params=p,
            )
            items.append(_Work(comp, list(prompt), seg, _key_for(p, k, 0, self._rng)))
        self._enqueue(items)

    def resume(self, partials: Sequence[Completion]) -> None:
        """Continue aborted samples under the current weights (their tokens become prompt)."""
        items = []
        for c in check_resumable(partials):
            seg = continuation_params(c)
            key = _key_for(c.params, c.sample_index, len(c.token_ids), self._rng)
            items.append(_Work(c, [*c.prompt_ids, *c.token_ids], seg, key))
        self._enqueue(items)

    def num_in_flight(self) -> int:
        with self._cv:
            return len(self._waiting) + sum(w is not None for w in self._slots) + len(self._finishing)

    def abort_all(self) -> list[Completion]:
        """Stop everything in flight; return the partial samples (finish_reason "abort")."""
        with self._paused():
            slots = [i for i, w in enumerate(self._slots) if w is not None]
            partial = self._collect(slots, aborted=True) if slots else []
            while self._waiting:
                w = self._waiting.popleft()
                w.completion.finish_reason = "abort"
                partial.append(w.completion)
            return partial

    def sleep(self, level: int = 1) -> None:
        raise UnsupportedCapability("the hf engine cannot free its memory (capabilities.sleep is False)")

    def wake(self) -> None:
        raise UnsupportedCapability("the hf engine cannot sleep (capabilities.sleep is False)")

    def named_parameters(self) -> MutableMapping[str, torch.Tensor]:
        """HF-named weights; assignment copies in place (what ``apply_buckets`` writes into)."""
        return _ParamView(self.model)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy full (or partial) HF-named tensors into the model; nothing may be in flight.

        Everything is validated before anything is written (an unknown name or a wrong shape
        leaves the engine untouched), then copied in a few grouped kernels by the engine's
        ``DirectCopier``, which re-validates only when names, shapes or addresses changed;
        ``last_load_stats`` says how long it took and how many bytes were written.
        """
        with self._paused():
            self._require_idle()
            targets = self._targets()
            items = list(named_tensors)
            unknown = [n for n, _ in items if n not in targets]
            if unknown:
                raise KeyError(f"unknown parameter names: {unknown[:5]}")
            self.last_load_stats = self._copier(targets, items, version)
            # Written in place into the fused storage's own views: nothing to re-fuse, but the
            # folded copies (fold_mlp_norm) are copies, rebuilt from the new weights.
            self.decoder.refresh_folded()
            self._version = version

    def update_weights(self, buckets: Iterable[Any], version: int) -> set[str]:
        """Apply checksum-verified weight buckets in place (``rlkube.runtime.weights``)."""
        from rlkube.runtime.weights import apply_buckets  # the weight-sync package owns the format

        items = list(buckets)
        check_base_version(items, self._version)
        with self._paused():
            self._require_idle()
            changed: set[str] = apply_buckets(_ParamView(self.model), items)
            self._after_update(version)
            return changed

    weight_workers = 1  # this process joins the weight groups

    def join_weight_groups(self, specs: list[Any], rank: int) -> None:
        """Join the job's weight groups (``rlkube.runtime.weights.collective``) as ``rank``."""
        from rlkube.runtime.weights.collective import WeightGroupMember

        member = WeightGroupMember()
        member.join(specs, rank, self.device)
        self._weight_member = member

    def receive_weights(self, version: int, kind: str) -> set[str]:
        """One sync over the weight groups: a delta applied atomically, a full sync bucket by bucket."""
        from rlkube.runtime.weights import apply_buckets

        member = getattr(self, "_weight_member", None)
        if member is None:
            raise RuntimeError("the hf engine has not joined the job's weight groups")
        view = _ParamView(self.model)

        def apply(buckets: list[Any], complete: bool) -> set[str]:
            if complete:
                check_base_version(buckets, self._version)
            changed: set[str] = apply_buckets(view, buckets, complete)
            return changed

        with self._paused():
            self._require_idle()
            changed = member.receive(kind, apply, self.device)
            self._after_update(version)
            return changed

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        if self._froze_heap:
            self._froze_heap = False
            thaw_heap()

    def __enter__(self) -> HFEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals -------------------------------------------------------------------------
    def _check(self, prompt: Sequence[int], p: SamplingParams) -> None:
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) + p.max_tokens > self.decoder.S:
            raise ValueError(
                f"prompt {len(prompt)} + max_tokens {p.max_tokens} exceeds max_seq_len {self.decoder.S}"
            )
        if len(p.stop_token_ids) > self.decoder.state.stop_ids.shape[1]:
            raise ValueError(f"at most {self.decoder.state.stop_ids.shape[1]} stop ids (max_stop_ids)")

    def _enqueue(self, items: list[_Work]) -> None:
        with self._cv:
            self._raise_if_failed()
            for w in items:
                if w.params.max_tokens == 0:  # nothing to do: finished at once
                    w.completion.finish_reason = "length"
                    self._finished.append(w.completion)
                else:
                    self._waiting.append(w)
            self._cv.notify_all()

    def _has_work_locked(self) -> bool:
        return bool(self._waiting) or bool(self._finishing) or any(w is not None for w in self._slots)

    def _in_flight_locked(self, ids: set[str]) -> bool:
        return self._has_work_locked()

    def _targets(self) -> dict[str, torch.Tensor]:
        """HF-named weight tensors to copy into; re-read only when a parameter was re-pointed.

        Walking the module tree (``state_dict``) costs more host time than a small model's copy,
        so the parameters are read once and then only their addresses are checked.
        """
        cache = self._target_cache
        if cache is not None and all(p.data_ptr() == ptr for p, ptr in cache[0]):
            return cache[1]
        self.decoder.refresh_fused()  # a re-pointed q/k/v or gate/up weight goes back into the fused storage
        params = dict(self.model.state_dict(keep_vars=True))
        self._target_cache = (
            [(p, p.data_ptr()) for p in params.values()],
            {n: p.detach() for n, p in params.items()},
        )
        return self._target_cache[1]

    def _require_idle(self) -> None:
        if any(w is not None for w in self._slots):
            raise RuntimeError("samples in flight: abort_all() (and resume later) before updating weights")

    def _after_update(self, version: int) -> None:
        self.decoder.refresh_fused()
        self._version = version

    class _Pause:
        def __init__(self, eng: HFEngine) -> None:
            self.eng = eng

        def __enter__(self) -> None:
            e = self.eng
            e._cv.acquire()
            e._pause += 1
            while e._busy:
                e._cv.wait()
            e._complete_finishing()  # whoever paused sees every finished sample delivered

        def __exit__(self, *exc: object) -> None:
            e = self.eng
            e._pause -= 1
            e._cv.notify_all()
            e._cv.release()

    def _paused(self) -> HFEngine._Pause:
        """Hold the engine at a sync point (the loop is not touching the decoder)."""
        return HFEngine._Pause(self)

    def _loop(self) -> None:
        try:
            with torch.no_grad():
                while True:
                    with self._cv:
                        while not self._closed and (self._pause or not self._has_work_locked()):
                            self._cv.wait()
                        if self._closed:
                            return
                        self._busy = True
                        admit = self._take_admissions()
                        moves = self._plan_compaction()
                    try:
                        self._timed("admit", self._move_and_admit, moves, admit)
                        self._timed("decode", self._run_chunk)
                    finally:
                        with self._cv:
                            self._busy = False
                            self._collect_finished()
                            if self._freeze_heap_pending and not self._has_work_locked():
                                # before the caller wakes, so no later call pays for it
                                self._freeze_heap_pending = False
                                self._froze_heap = freeze_warm_heap()
                            self._cv.notify_all()
        except BaseException as exc:  # surfaced to callers by _raise_if_failed
            with self._cv:
                self._error = exc
                self._busy = False
                self._cv.notify_all()

    def _timed(self, phase: str, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)``, bracketed by CUDA events while a benchmark collects ``phase_events``
        (events, not host clocks: the device's timeline is what the bound is about)."""
        events = self.phase_events
        if events is None or self.device.type != "cuda":
            fn(*args)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        events.append((phase, start, end))

    def _take_admissions(self) -> list[_Work]:
        free = [i for i, w in enumerate(self._slots) if w is None]
        out = []
        while free and self._waiting:
            w = self._waiting.popleft()
            w.slot = free.pop(0)
            w.version = self._version
            self._slots[w.slot] = w
            out.append(w)
        return out

    def _plan_compaction(self) -> list[tuple[int, int]]:
        """Move live samples above the smallest bucket that holds them all into free rows below it.

        Called with the lock held, after admissions (which take the lowest free rows). Returns
        ``(from, to)`` row pairs for ``_move_and_admit``; ``_slots`` already shows the new rows.
        """
        live = [i for i, w in enumerate(self._slots) if w is not None]
        if not live:
            return []
        nb = self.decoder.bucket_for(len(live))
        if live[-1] < nb:
            return []
        free = [i for i in range(nb) if self._slots[i] is None]
        moves = list(zip([i for i in live if i >= nb], free, strict=False))
        for src, dst in moves:
            w = self._slots[src]
            assert w is not None
            self._slots[dst], self._slots[src] = w, None
            w.slot = dst
        return moves

    def _move_and_admit(self, moves: list[tuple[int, int]], admit: list[_Work]) -> None:
        """Compact the live rows (``_plan_compaction``'s moves), then admit ``admit``."""
        if moves:
            self._shares_stale = True
            upto = max(w.max_pos for w in self._slots if w is not None) + 1
            self.decoder.move_rows([a for a, _ in moves], [b for _, b in moves], upto)
        self._admit(admit)

    def _admit(self, items: list[_Work]) -> None:
        """Prefill new samples (one forward per distinct prefix, all of them batched) and sample
        their first token."""
        if not items:
            return
        d, s, dev = self.decoder, self.decoder.state, self.device
        groups: dict[tuple[int, ...], list[_Work]] = {}
        for w in items:
            groups.setdefault(tuple(w.prefix), []).append(w)
        prefixes = list(groups)
        works = [w for p in prefixes for w in groups[p]]
        n, width = len(works), s.stop_ids.shape[1]
        # every row's settings in two host-to-device copies, before the prefill's kernels (a copy
        # from pageable memory waits for the stream; a tensor op per row was ~20 us each)
        rows = []
        for g, p in enumerate(prefixes):
            for w in groups[p]:
                stop = list(w.params.stop_token_ids)
                rows.append(
                    [g, w.slot, w.key, w.params.max_tokens, len(w.prefix), *stop, *[-1] * (width - len(stop))]
                )
        ints = to_device(torch.tensor(rows, dtype=torch.long), dev)
        top_p_host = [w.params.top_p for w in works]
        temperature = [w.params.temperature for w in works]
        floats = to_device(torch.tensor([temperature, top_p_host], dtype=torch.float32), dev)
        src, idx, keys, max_new, plen = ints[:, :5].unbind(1)
        stops, temp, top_p = ints[:, 5:], floats[0], floats[1]
        logits = d.prefill([list(p) for p in prefixes], [[w.slot for w in groups[p]] for p in prefixes])
        for p in prefixes:
            for w in groups[p]:
                w.prefill = self._prefills
            self._prefills += 1
        self._shares_stale = True
        zeros = torch.zeros(n, dtype=torch.long, device=dev)
        use_top_p = any(t < 1 for t in top_p_host)
        tok, lp = d.sample(logits[src], temp, top_p, keys, zeros, use_top_p)
        hit = (stops == tok[:, None]).any(-1)
        s.stop_ids[idx] = stops
        s.temperature[idx] = temp
        s.top_p[idx] = top_p
        s.key[idx] = keys
        s.max_new[idx] = max_new
        s.out_tok[idx, 0] = tok
        s.out_lp[idx, 0] = lp
        s.n_gen[idx] = 1
        s.cur_tok[idx] = tok
        s.pos[idx] = plen
        s.stopped[idx] = hit
        s.running[idx] = ~hit & (max_new > 1)
        for w in works:
            w.max_pos = len(w.prefix)
            w.remaining = w.params.max_tokens - 1
        d.any_top_p = any(w is not None and w.params.top_p < 1 for w in self._slots)

    def _run_chunk(self) -> None:
        """Up to ``sync_every`` decode steps over the smallest batch bucket holding the live rows;
        never more steps than the longest remaining budget (no idle steps at the end)."""
        active = [w for w in self._slots if w is not None]
        if not active:
            return
        d = self.decoder
        if self._shares_stale:
            self._share_prompts()
        nb = d.bucket_for(max(w.slot for w in active) + 1)
        steps = min(self.sync_every, max(w.remaining for w in active))
        max_pos = max(w.max_pos for w in active)
        # the step before which the finished flags are copied (none when the chunk is too short)
        early = steps - self.flag_lag if steps > self.flag_lag > 0 else -1
        self._flags = None
        self._chunk_harvest = None
        done = 0
        for j in range(steps):
            if self._pause:
                break
            if j == early:
                self._copy_flags(nb)
            d.decode(nb, d.kv_len_for(min(max_pos + j, d.S - 1)))
            done += 1
        for w in active:
            w.max_pos = min(w.max_pos + done, len(w.prefix) + w.params.max_tokens - 1, d.S - 1)
            w.remaining = max(0, w.remaining - done)
        if self.harvest_tokens and done:
            self._start_harvest(active, nb)

    def _copy_flags(self, rows: int) -> None:
        """Queue the copy of rows ``[0, rows)``'s running flags to the host (``_collect_finished``
        reads it as soon as it lands, while the chunk's last steps still run)."""
        self._flag_buf[:rows].copy_(self.decoder.state.running[:rows], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._flags = (rows, event)

    def _start_harvest(self, active: list[_Work], rows: int) -> None:
        """Queue the copy of the chunk's new tokens to the host (``_read_harvest`` takes them).

        Each row's window starts at its first unread column and is as wide as the most tokens any
        row can have gained since (its budget minus what is left of it, minus what was read): at
        most two chunks and the admission's token, whatever the rows' ages."""
        s = self.decoder.state
        width = max(w.params.max_tokens - w.remaining - w.harvested for w in active)
        if width <= 0:
            return
        # the previous chunk's buffers are read while this one fills the other set (pinned on CUDA,
        # so neither the copy of the starts nor of the tokens makes the host wait for the chunk)
        k = self._harvest_count % 2
        self._harvest_count += 1
        size = rows * width
        pin = self.device.type == "cuda"
        bufs = self._harvest_bufs[k]
        if bufs is None or bufs[0].numel() < rows or bufs[2].numel() < size:
            have_rows, have = (0, 0) if bufs is None else (bufs[0].numel(), bufs[2].numel())
            bufs = (
                torch.empty(max(rows, have_rows), dtype=torch.long, pin_memory=pin),
                torch.empty(max(rows, have_rows), dtype=torch.long, pin_memory=pin),
                torch.empty(max(size, have), dtype=torch.long, pin_memory=pin),
                torch.empty(max(size, have), dtype=torch.float32, pin_memory=pin),
                torch.empty(max(rows, have_rows), dtype=torch.bool, pin_memory=pin),
            )
            self._harvest_bufs[k] = bufs
        s_buf, n_buf, t_buf, l_buf, st_buf = bufs
        starts = [0] * rows
        for w in active:
            starts[w.slot] = w.harvested
        s_host = s_buf[:rows]
        s_host.copy_(torch.tensor(starts, dtype=torch.long))
        cols = (s_host.to(self.device, non_blocking=pin)[:, None] + self._harvest_cols[:width]).clamp_(
            max=self.decoder.T
        )
        n_gen, tok, lp = n_buf[:rows], t_buf[:size].view(rows, width), l_buf[:size].view(rows, width)
        n_gen.copy_(s.n_gen[:rows], non_blocking=pin)
        tok.copy_(s.out_tok[:rows].gather(1, cols), non_blocking=pin)
        lp.copy_(s.out_lp[:rows].gather(1, cols), non_blocking=pin)
        stopped = st_buf[:rows]
        stopped.copy_(s.stopped[:rows], non_blocking=pin)
        event = None
        if pin:
            event = torch.cuda.Event()
            event.record()
        self._harvest_prev = self._harvest
        self._harvest = _Harvest([(w, w.slot, w.harvested) for w in active], n_gen, tok, lp, stopped, event)
        self._chunk_harvest = self._harvest

    def _read_harvest(self, h: _Harvest, rows: set[int] | None = None) -> None:
        """Move a harvest's tokens into the samples' completions (only ``rows``, if given: then only
        those rows become Python lists, since collecting a few finished samples happens while the
        GPU waits and the whole copy is read again behind the next chunk anyway)."""
        if h.event is not None:
            h.event.synchronize()
        works = h.works if rows is None else [x for x in h.works if x[1] in rows]
        if not works:
            return
        if rows is None:  # every row: each sample's line is its row
            n_gen, toks, lps = h.n_gen.tolist(), h.tok.tolist(), h.lp.tolist()
            lines: Iterable[int] = (row for _, row, _ in works)
        else:  # the picked rows only, in ``works``' order
            picked = [row for _, row, _ in works]
            n_gen, toks, lps = (t[picked].tolist() for t in (h.n_gen, h.tok, h.lp))
            lines = range(len(works))
        for (w, _, start), j in zip(works, lines, strict=True):
            n = n_gen[j]
            if n <= w.harvested:
                continue
            a, b = w.harvested - start, n - start
            w.completion.extend(toks[j][a:b], lps[j][a:b], w.version)
            w.harvested = n
            self.tokens_by_route["harvest"] += b - a

    def _share_prompts(self) -> None:
        """Point every live sample at the lowest live row filled by the same prefill: rows hold
        identical copies of that prefix's K/V (prefill wrote them, moves copy them), a live row's
        prefix is never overwritten, and a freed row is not read before the next call. With
        ``share_prompt_reads`` off, every row reads its own."""
        live = [w for w in self._slots if w is not None] if self.share_prompt_reads else []
        n = max((w.slot for w in live), default=-1) + 1
        share_row, share_len = list(range(n)), [0] * n
        first: dict[int, _Work] = {}
        for w in sorted(live, key=lambda w: w.slot):
            lead = first.setdefault(w.prefill, w)
            if lead is not w:
                share_row[w.slot], share_len[w.slot] = lead.slot, len(w.prefix)
        self.decoder.set_shared_prompts(share_row, share_len)
        self._shares_stale = False

    def _collect_finished(self) -> None:
        """After a chunk was launched: read the previous chunk's tokens (the GPU is busy with this
        one), then wait for this chunk's finished flags (copied ``flag_lag`` steps before its end)
        and collect the finished samples."""
        if self._harvest_prev is not None:
            self._read_harvest(self._harvest_prev)
            self._harvest_prev = None
        self._complete_finishing()  # their harvests are older than this chunk's: landed
        slots = [i for i, w in enumerate(self._slots) if w is not None]
        if not slots:
            return
        flags, self._flags = self._flags, None
        early = flags is not None and not self._pause and flags[0] > slots[-1]
        if early:
            assert flags is not None
            # the early copy: samples still running then are looked at again after the next chunk
            if flags[1] is not None:
                flags[1].synchronize()
            running = self._flag_buf[: slots[-1] + 1].tolist()
            self.flag_reads["early"] += 1
        else:  # at the chunk's end (a pause leaves the GPU idle: whoever paused may touch it)
            running = self.decoder.state.running[: slots[-1] + 1].tolist()  # one copy, no index upload
            self.flag_reads["end"] += 1
        done = [i for i in slots if not running[i]]
        harvest = self._chunk_harvest
        if done and early and harvest is not None:
            # Their tokens are all in this chunk's harvest (queued behind its last step): free the
            # rows now and complete the samples from it after the next chunk is launched, so the
            # host plans that chunk while the GPU finishes this one instead of waiting for it.
            for i in done:
                w = self._slots[i]
                assert w is not None
                self._finishing.append((w, harvest, i))
                self._slots[i] = None
            self._shares_stale = True
            if len(done) == len(slots) and not self._waiting:  # nothing left to launch: finish now
                self._complete_finishing()
        elif done:
            self._finished.extend(self._collect(done, aborted=False))

    def _complete_finishing(self) -> None:
        """Complete the samples whose rows were freed at an early flag read, from their harvest
        (waiting for it only when nothing else runs: the end of the work, or a pause)."""
        if not self._finishing:
            return
        by_harvest: dict[int, tuple[_Harvest, set[int]]] = {}
        for _, h, row in self._finishing:
            by_harvest.setdefault(id(h), (h, set()))[1].add(row)
        stopped: dict[int, list[bool]] = {}
        for key, (h, rows) in by_harvest.items():
            self._read_harvest(h, rows)  # nothing left to read once the whole copy was
            stopped[key] = h.stopped.tolist()  # one list per harvest, not a tensor index per sample
        for w, h, row in self._finishing:
            w.completion.finish_reason = "stop" if stopped[id(h)][row] else "length"
            self._finished.append(w.completion)
        self.finished_from_harvest += len(self._finishing)
        self._finishing = []

    def _collect(self, slots: list[int], aborted: bool) -> list[Completion]:
        """Move the slots' tokens into their completions and free the slots: what the harvests
        have not brought over yet is read from the device here."""
        s = self.decoder.state
        if self._harvest is not None:  # the newest harvest's copy of these rows, already made
            self._read_harvest(self._harvest, set(slots))
        works = [w for w in (self._slots[i] for i in slots) if w is not None]
        assert len(works) == len(slots), "collecting an empty slot"
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        n_gen = s.n_gen[idx].tolist()
        stopped = s.stopped[idx].tolist()
        first = min((w.harvested for w in works), default=0)
        width = max(n_gen, default=0)  # read only the columns not harvested yet
        toks = s.out_tok[idx, first:width].tolist() if width > first else [[] for _ in slots]
        lps = s.out_lp[idx, first:width].tolist() if width > first else [[] for _ in slots]
        s.running[idx] = False
        out = []
        for j, (slot, w) in enumerate(zip(slots, works, strict=True)):
            n = n_gen[j]
            a, b = w.harvested - first, n - first
            w.completion.extend(toks[j][a:b], lps[j][a:b], w.version)
            w.harvested = n
            self.tokens_by_route["collect"] += max(0, b - a)
            if aborted:
                w.completion.finish_reason = "abort"
            else:
                w.completion.finish_reason = "stop" if stopped[j] else "length"
            self._slots[slot] = None
            self._shares_stale = True
            out.append(w.completion)
        return out


def _dtype(d: str | torch.dtype | None) -> torch.dtype | None:
    if d is None or isinstance(d, torch.dtype):
        return d
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[str(d)]


def teacher_forced_logprobs(
    model: nn.Module, prompt_ids: Sequence[int], token_ids: Sequence[int]
) -> torch.Tensor:
    """Raw logprobs of ``token_ids`` given ``prompt_ids`` from one plain HF forward (the trainer's view)."""
    dev = next(model.parameters()).device
    ids = torch.tensor([[*prompt_ids, *token_ids]], dtype=torch.long, device=dev)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1)
    return lp.gather(1, ids[0, len(prompt_ids) :, None])[:, 0].cpu()


def options_from_spec(spec: RLJobSpec) -> dict[str, Any]:
    """HFEngine options for a spec: one decode slot per sample in flight (twice that in async modes,
    which over-subscribe to keep the extra groups in flight), capped by rollout.maxNumSeqs."""
    slots = min(spec.rollout.max_num_seqs, max(spec.training.train_batch_size * spec.algorithm.group_size, 1))
    slots = min(spec.rollout.max_num_seqs, slots * 2) if spec.training.mode != "sync" else slots
    return {
        "dtype": spec_dtype(spec),
        "num_slots": slots,
        "max_seq_len": spec.data.max_prompt_length + spec.data.max_response_length,
        "seed": spec.training.seed,
        "config_overrides": model_config_overrides(spec),
    }
