"""A fast batched decoder for HF Qwen2/Llama-style causal LMs: static KV cache, on-device sampling.

Why not ``model.generate``: it re-plans the cache, syncs with the host every token and launches
hundreds of small kernels per step, which on an H200 leaves decode at a few percent of its
memory-bandwidth bound. Here a fixed set of *slots* (rows) shares one preallocated KV cache; a
decode step is a pure function of device tensors (no host sync, no allocation), so on CUDA it is
captured once per *batch bucket* as a CUDA graph and replayed; the host looks at finished flags
only every few steps.

- **Batch buckets**: the engine keeps live samples in the lowest rows (it moves a sample's KV
  down when rows free up), and a step runs over the smallest bucket of rows that holds them, so
  a batch whose samples finish at different lengths stops paying for the finished ones.
- **Attention over each row's own length**: on GPUs one Triton flash-decoding kernel per layer
  takes the q/k/v projection's output, applies RoPE, writes the new K/V into the cache and attends
  over only the KV the row has (``kernels.TritonDecodeAttention.rope_attend``), so mixed lengths
  do not pay for the longest and the KV length is not part of the graph's key. Elsewhere (the CPU,
  or a kernel that failed its start-up self-check) SDPA runs over a 128-aligned KV prefix bucket
  with a mask, after RoPE and the cache write in PyTorch.
- **Sampling on the device**: inverse CDF from per-block sums of the logits (``sampling="cdf"``,
  the default) or Gumbel-max (``"gumbel"``), token and raw log-probability per row (Triton
  kernels on GPUs; the same maths in PyTorch elsewhere). Top-p, when a slot asks for it, adds a
  sort.
- **Batched prefill**: one forward for every distinct prompt admitted together (right-padded, so
  plain causal attention is exact for every real position); each prompt's KV goes to all of its
  samples' slots: one prefill per prompt group, not per sample. The attention kernel reads a
  group's prompt from one of those rows (``set_shared_prompts``), so its samples do not each read
  the prompt's K/V from memory.

The forward reuses the HF module's own parameters. q/k/v and gate/up are fused once: the fused
tensor becomes the storage and the HF modules' weights become views into it, so a weight update
written into the HF parameters lands in the fused weights too (no re-copy, no second copy in
memory) and captured graphs stay valid.

A layer of a decode step is: norm + q/k/v GEMM, the attention kernel, the o GEMM accumulating into
the residual in place (cuBLAS's C operand, no copy of the residual first), norm + gate/up GEMM +
SiLU, the down GEMM into the residual in place. With ``linear_max_rows`` (opt-in: slower on an
H100, see ``LINEAR_MAX_ROWS_DEFAULT``), buckets of up to that many rows run each linear layer as
one Triton kernel with the norm, SiLU, residual add and split-K reduction folded in
(``decode_linear``). ``compile_step="auto"`` compiles the pure pieces around the GEMMs (the norms,
SiLU, the slots' bookkeeping after sampling) with torch.compile on CUDA (one compile serves every
layer and, after one recompile with a dynamic batch, every bucket) and falls back to eager,
recording why, if it fails; a step whose CUDA graph capture fails decodes without graphs from then
on, also recording why (``graph_error``).
Logprobs are raw ``log_softmax(logits)`` of the sampled token (see ``rollout.base``).
"""

from __future__ import annotations

import functools
import logging
import math
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlkube.runtime.rollout import decode_linear, kernels

log = logging.getLogger(__name__)
# True, False, "auto" (compile on CUDA, eager elsewhere) or "max-autotune" (compile, and let inductor
# time its Triton GEMM templates against cuBLAS for the step's four GEMMs, fusing SiLU and the
# residual add into a winner; an A/B for the GPU benches, off by default until measured)
CompileSetting = bool | str
COMPILE_SETTINGS = (True, False, "auto", "max-autotune")
KernelSetting = bool | str  # True (required), False (PyTorch only) or "auto" (on GPUs, if they self-check)
# Buckets of up to this many rows run the fused linear kernel (``decode_linear``) by default: none.
# On an H100 it was slower than the cuBLAS path on every layer at 64 rows (1.3-2.2x; the step 1.505
# vs 1.155 ms at 0.5B, 3.358 vs 2.129 ms at 1.5B; docs/benchmarks.md, stop 29), so it stays an A/B
# (``decode_step_gpu.py --linear`` and the ``cublas`` / ``linear`` step configs).
LINEAR_MAX_ROWS_DEFAULT = 0
# Buckets of at least this many rows run gate/up + SiLU as one Triton GEMM with the SiLU in its
# epilogue (``decode_linear``, launch ``gated_launch``; the norm before it its own compiled
# kernel), so the [rows, 2 I] product is never written and read back. 0: never (cuBLAS, then the
# SiLU kernel), the default: on an H100 the kernel ran the layer at 48-58% of the GEMM rate where
# cuBLAS's GEMM alone ran at 82%, so even without the SiLU pass it lost (1.5B, 512 rows: 61.6-82.5
# us against 52.4 us for cuBLAS + SiLU); the 512-row step 0.89x (1.5B) and 0.90x (0.5B), the b512
# rollout 48.0 -> 44.8% and 38.2 -> 34.1% of its bound (docs/benchmarks.md, stop 35).
GATED_MIN_ROWS_DEFAULT = 0
# Buckets of at least this many rows run the down projection split-K (``split_k_partials``:
# ``DOWN_SPLIT_K`` slices of its long K, one batched GEMM into float32 partials, added into the
# residual by the next layer's norm kernel, or the final norm's). 0: never. By default ("auto",
# ``down_split_min_rows=None``) only on GPUs and only for MLPs at least DOWN_SPLIT_MIN_INTERMEDIATE
# wide: on an H100 (stop 32) two slices made the 512-row step of Qwen2.5-1.5B (MLP 8960 wide)
# 1.03x faster and its b512 rollout 46.4 -> 47.8% of the bound, but the 0.5B step (4864 wide)
# 0.95x slower, and four slices lost at both sizes (docs/benchmarks.md, stop 32).
DOWN_SPLIT_MIN_ROWS_DEFAULT = 256
DOWN_SPLIT_MIN_INTERMEDIATE = 8192
DOWN_SPLIT_K = 2
# How a token is drawn (``kernels.SAMPLE_REFS``): "cdf" (inverse CDF from per-block sums, one
# uniform per row) or "gumbel" (Gumbel-max, a hash per vocabulary entry). Both draw exactly from
# softmax(logits / T); a seed gives other tokens under each. On an H100 (stop 37) the cdf kernel
# sampled 512 rows in 71.5 us against Gumbel's 177.0 (64 rows: 16.1 against 33.9), and the b512
# rollout went from 37.7 to 39.6% of its bound at 0.5B and 47.9 to 48.9% at 1.5B.
SAMPLING_DEFAULT = "cdf"
# Batch buckets of at least this many rows run the grouped attention kernel (one program per group
# of up to 8 rows that read one prompt copy: the prompt's K/V read once per group, not once per
# row from L2) where the whole cache fits one split (``TritonDecodeAttention.split_for``).
# 0: never (one program per row and KV head): measured slower at every shape (H100, stop 41: the
# b512 rollout 48.4 -> 41.0% of its bound at 1.5B, 39.2 -> 34.1% at 0.5B; docs/rollout.md).
GROUPED_ATTENTION_MIN_ROWS_DEFAULT = 0
# True: the decode step folds the MLP's RMS norm weight into a copy of the gate/up weight, runs the
# GEMM on the raw residual and applies each row's 1 / rms in the SiLU kernel, so the norm needs
# no kernel of its own (the prefill keeps the norm). The copy costs the gate/up weights' memory
# again and is rebuilt after every weight load or sync (``refresh_folded``).
FOLD_MLP_NORM_DEFAULT = False


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without the host waiting for the stream: a copy from pageable
    memory synchronises with everything queued before it (on a decode boundary, the chunk still
    running), one from pinned memory does not (torch keeps the pinned block until the copy ran)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as 8-byte elements along its last dimension, where its layout allows (the
    last dimension contiguous and a whole number of words; every other stride and the offset too),
    else ``t`` itself. Copying K/V rows by index moves one element per thread step: a bf16 cache
    copied as int64 takes a quarter of the steps for the same bytes."""
    size = t.element_size()
    ratio = 8 // size if size < 8 and 8 % size == 0 else 0
    if (
        ratio < 2
        or t.dim() == 0
        or t.stride(-1) != 1
        or t.shape[-1] % ratio
        or t.storage_offset() % ratio
        or any(st % ratio for st in t.stride()[:-1])
    ):
        return t
    return t.view(torch.int64)


def auto_down_split_min_rows(intermediate_size: int, device_type: str, k: int = DOWN_SPLIT_K) -> int:
    """The ``down_split_min_rows`` the decoder uses when it is not given: where it was measured to win."""
    wide = intermediate_size >= DOWN_SPLIT_MIN_INTERMEDIATE and intermediate_size % k == 0
    return DOWN_SPLIT_MIN_ROWS_DEFAULT if device_type == "cuda" and wide else 0


@dataclass
class SlotState:
    """Device tensors describing every slot; the CUDA graphs read and write these in place."""

    cur_tok: torch.Tensor  # [B] int64 token to feed next
    pos: torch.Tensor  # [B] int64 position of cur_tok (= tokens in the KV cache before it)
    n_gen: torch.Tensor  # [B] int64 tokens generated so far in this segment
    max_new: torch.Tensor  # [B] int64 budget of this segment
    running: torch.Tensor  # [B] bool: active and not finished
    stopped: torch.Tensor  # [B] bool: finished on a stop token
    temperature: torch.Tensor  # [B] float32 (0 = greedy)
    top_p: torch.Tensor  # [B] float32
    key: torch.Tensor  # [B] int64 sampling key
    stop_ids: torch.Tensor  # [B, S] int64, -1 padded
    out_tok: torch.Tensor  # [B, T] int64
    out_lp: torch.Tensor  # [B, T] float32
    share_row: torch.Tensor  # [B] int64 row holding the same K/V as this one below share_len
    share_len: torch.Tensor  # [B] int64 (0: the row reads only its own K/V)


def batch_buckets(num_slots: int) -> list[int]:
    """Row counts a step can run over: 8, 16, 24, 32, 48, 64, 96, ... (x2 and x1.5), and ``num_slots``."""
    out = {num_slots}
    p = 8
    while p < num_slots:
        out.add(p)
        if p >= 16 and p * 3 // 2 < num_slots:
            out.add(p * 3 // 2)
        p *= 2
    return sorted(out)


class StaticDecoder:
    """Owns the KV cache and runs prefill / decode steps over ``num_slots`` rows."""

    # the step's pure functions: plain PyTorch, or torch.compile'd on CUDA
    _qkv_fn: Callable[..., Any]
    _mlp_in_fn: Callable[..., Any]
    _residual_fn: Callable[..., Any]
    _advance_fn: Callable[..., Any]
    _seeds_fn: Callable[..., Any]
    _final_norm_fn: Callable[..., Any]
    _add_partials_fn: Callable[..., Any]
    _qkv_after_split_fn: Callable[..., Any]
    _final_norm_after_split_fn: Callable[..., Any]

    def __init__(
        self,
        model: Any,
        *,
        num_slots: int,
        max_seq_len: int,
        max_new_tokens: int,
        max_stop_ids: int = 8,
        use_cuda_graphs: bool | None = None,
        compile_step: CompileSetting = False,
        kernels_setting: KernelSetting = "auto",
        kv_bucket: int = 128,
        max_prefill_tokens: int = 16384,
        linear_max_rows: int = LINEAR_MAX_ROWS_DEFAULT,
        down_split_min_rows: int | None = None,
        down_split_k: int = DOWN_SPLIT_K,
        gated_min_rows: int = GATED_MIN_ROWS_DEFAULT,
        sampling: str = SAMPLING_DEFAULT,
        grouped_attention_min_rows: int = GROUPED_ATTENTION_MIN_ROWS_DEFAULT,
        fold_mlp_norm: bool = FOLD_MLP_NORM_DEFAULT,
    ) -> None:
        cfg: Any = model.config
        if not isinstance(fold_mlp_norm, bool):
            raise ValueError(f"fold_mlp_norm must be True or False, not {fold_mlp_norm!r}")
        self.fold_mlp_norm = fold_mlp_norm
        # per layer, the gate/up weight with the MLP norm's weight folded in (fold_mlp_norm)
        self._gu_folded: list[torch.Tensor] = []
        if sampling not in kernels.SAMPLE_REFS:
            raise ValueError(f"sampling must be one of {sorted(kernels.SAMPLE_REFS)}, not {sampling!r}")
        self.sampling = sampling
        p = next(model.parameters())
        if down_split_min_rows is None:  # "auto": where it was measured to win
            inter = int(cfg.intermediate_size)
            down_split_min_rows = auto_down_split_min_rows(inter, p.device.type, down_split_k)
        if not (isinstance(linear_max_rows, int) and linear_max_rows >= 0):
            raise ValueError(
                f"linear_max_rows must be an integer >= 0 (0: cuBLAS only), not {linear_max_rows!r}"
            )
        if not (isinstance(down_split_min_rows, int) and down_split_min_rows >= 0):
            raise ValueError(
                f"down_split_min_rows must be an integer >= 0 (0: never split), not {down_split_min_rows!r}"
            )
        if not (isinstance(gated_min_rows, int) and gated_min_rows >= 0):
            raise ValueError(
                f"gated_min_rows must be an integer >= 0 (0: cuBLAS, then the SiLU kernel), "
                f"not {gated_min_rows!r}"
            )
        if not (isinstance(grouped_attention_min_rows, int) and grouped_attention_min_rows >= 0):
            raise ValueError(
                "grouped_attention_min_rows must be an integer >= 0 (0: one attention program per "
                f"row), not {grouped_attention_min_rows!r}"
            )
        self.grouped_attention_min_rows = grouped_attention_min_rows
        if not (isinstance(down_split_k, int) and down_split_k >= 2):
            raise ValueError(f"down_split_k must be an integer >= 2, not {down_split_k!r}")
        if down_split_min_rows and cfg.intermediate_size % down_split_k:
            raise ValueError(
                f"down_split_k={down_split_k} does not divide intermediate_size={cfg.intermediate_size}; "
                "pick a divisor or set down_split_min_rows=0"
            )
        # buckets of at least this many rows run the down GEMM as ``down_split_k`` slices of K
        self.down_split_min_rows, self.down_split_k = down_split_min_rows, down_split_k
        # True: the partials are summed into the residual inside the next norm's kernel; False: by
        # a kernel of their own right after the GEMM (the benchmark's A/B)
        self.down_split_fold = True
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the hf rollout engine")
        self.model: Any = model
        self.inner: Any = self.model.model
        self.layers: list[Any] = list(self.inner.layers)
        self.device, self.dtype = p.device, p.dtype
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.group = self.n_heads // self.n_kv
        self.vocab = int(cfg.vocab_size)
        self.hidden = int(cfg.hidden_size)
        self.inter = int(cfg.intermediate_size)
        self.eps = float(self.layers[0].input_layernorm.variance_epsilon)
        self.B = num_slots
        self.buckets = batch_buckets(num_slots)
        self.kv_bucket = kv_bucket
        self.max_prefill_tokens = max_prefill_tokens
        self.S = int(math.ceil(max_seq_len / kv_bucket) * kv_bucket)
        self.T = max_new_tokens
        dev = self.device
        shape = (self.B, self.n_kv, self.S, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        # RoPE tables from the model's own rotary module (rope scaling and attention scaling included).
        with torch.no_grad():
            positions = torch.arange(self.S, device=dev)[None]
            dummy = torch.zeros(1, dtype=self.dtype, device=dev)
            cos, sin = self.inner.rotary_emb(dummy, positions)
        self.cos = cos[0].to(self.dtype).contiguous()
        half = self.head_dim // 2
        sin = sin[0].to(self.dtype)
        self.sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).contiguous()  # signed: kernels.rope
        self._fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self.refresh_fused()
        self.state = SlotState(
            cur_tok=torch.zeros(self.B, dtype=torch.long, device=dev),
            pos=torch.zeros(self.B, dtype=torch.long, device=dev),
            n_gen=torch.zeros(self.B, dtype=torch.long, device=dev),
            max_new=torch.zeros(self.B, dtype=torch.long, device=dev),
            running=torch.zeros(self.B, dtype=torch.bool, device=dev),
            stopped=torch.zeros(self.B, dtype=torch.bool, device=dev),
            temperature=torch.ones(self.B, dtype=torch.float32, device=dev),
            top_p=torch.ones(self.B, dtype=torch.float32, device=dev),
            key=torch.zeros(self.B, dtype=torch.long, device=dev),
            stop_ids=torch.full((self.B, max_stop_ids), -1, dtype=torch.long, device=dev),
            out_tok=torch.zeros(self.B, self.T + 1, dtype=torch.long, device=dev),
            out_lp=torch.zeros(self.B, self.T + 1, dtype=torch.float32, device=dev),
            share_row=torch.arange(self.B, device=dev),
            share_len=torch.zeros(self.B, dtype=torch.long, device=dev),
        )
        self._rows = torch.arange(self.B, device=dev)
        self.any_top_p = False
        if use_cuda_graphs and dev.type != "cuda":
            raise ValueError(
                f"cuda_graphs=True needs the model on a CUDA or ROCm GPU, not {dev.type}; "
                "leave it unset to use graphs wherever they run"
            )
        self.use_graphs = (dev.type == "cuda") if use_cuda_graphs is None else use_cuda_graphs
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self._init_kernels(kernels_setting, linear_max_rows, gated_min_rows)
        # the grouped attention kernel's table (``kernels.attention_groups``), rewritten in place
        # by ``set_shared_prompts``; None while no step runs that kernel
        self._groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if self._attention is not None and self.grouped_attention_min_rows:
            att = self._attention
            alone = kernels.attention_group_tensors(
                list(range(self.B)), [0] * self.B, self.B, att.members, att.block_n
            )
            self._groups = (alone[0].to(dev), alone[1].to(dev), alone[2].to(dev))
        if compile_step not in COMPILE_SETTINGS:
            allowed = "True, False, 'auto' or 'max-autotune'"
            raise ValueError(f"compile_step must be {allowed}, not {compile_step!r}")
        self.compiled = dev.type == "cuda" if compile_step == "auto" else bool(compile_step)
        # our own CUDA graphs capture the step, so inductor must not add its own
        mode = "max-autotune-no-cudagraphs" if compile_step == "max-autotune" else None
        # True: the prefill runs the step's compiled functions too (the benchmark's A/B: on one
        # H100 that made admission slower, 24 vs 14 ms for 8 prompts of 64 tokens at 0.5B, so eager)
        self.compiled_prefill = False
        # True: each compiled function's first compile treats the batch (row) dimension as dynamic,
        # so one compile serves every bucket; False: the first bucket compiles with its size fixed
        # and the second one recompiles it dynamic (torch's default: twice the cold compiles)
        self.dynamic_rows = True
        self.compile_error: str | None = None  # traceback of a failed compile (then eager)
        self.graph_error: str | None = None  # traceback of a failed graph capture (then no graphs)
        self._compiled_ok: set[tuple[int, int]] = set()  # (rows, kv_len) steps that ran compiled
        self._use_eager_functions()
        if self.compiled:
            self._qkv_fn = torch.compile(layer_qkv, mode=mode)
            if self._silu is not None:  # inductor's fused SiLU was up to 3x off bandwidth (1.5B)
                self._mlp_in_fn = self._mlp_in_with(torch.compile(layer_gate_up, mode=mode))
            else:
                self._mlp_in_fn = torch.compile(layer_mlp_in, mode=mode)
            if mode is not None:  # autotuned, the o and down GEMMs may fuse the residual add too
                self._residual_fn = torch.compile(residual_linear_, mode=mode)
            self._advance_fn = torch.compile(advance_slots)
            # eager, the seeds' 32-bit hash was ~25 one-microsecond integer kernels per step
            self._seeds_fn = torch.compile(kernels.row_seeds)
            self._final_norm_fn = torch.compile(final_norm)
            self._add_partials_fn = torch.compile(add_partials_)
            self._qkv_after_split_fn = torch.compile(layer_qkv_after_split, mode=mode)
            self._final_norm_after_split_fn = torch.compile(final_norm_after_split)
        # host-side counters (benchmarks and tests read them): steps per batch bucket, rows moved
        self.steps_by_bucket: dict[int, int] = {}
        self.capture_seconds: dict[int, float] = {}  # host seconds per bucket: compile, warm-up, capture
        self.rows_moved = 0
        self.prefill_forwards = 0
        self.prefill_padded_tokens = 0  # prompt positions the prefill ran, padding included

    def _use_eager_functions(self) -> None:
        """The step's pure functions as plain PyTorch (``torch.compile`` wraps them on CUDA)."""
        f = self._eager_layer_functions()
        self._qkv_fn, self._mlp_in_fn, self._residual_fn = f["qkv"], f["mlp_in"], f["residual"]
        self._final_norm_fn = f["final_norm"]
        self._add_partials_fn = add_partials_
        self._qkv_after_split_fn = layer_qkv_after_split
        self._final_norm_after_split_fn = final_norm_after_split
        self._advance_fn = advance_slots
        self._seeds_fn = kernels.row_seeds

    def _eager_layer_functions(self) -> dict[str, Callable[..., Any]]:
        """A layer's functions and the final norm, uncompiled (SiLU on its Triton kernel, if any)."""
        mlp_in = layer_mlp_in if self._silu is None else self._mlp_in_with(layer_gate_up)
        return {"qkv": layer_qkv, "mlp_in": mlp_in, "residual": residual_linear_, "final_norm": final_norm}

    def _functions(self, compiled: bool) -> dict[str, Callable[..., Any]]:
        """The layer functions a prefill runs: the step's (compiled, when they are), or eager."""
        if not compiled:
            return self._eager_layer_functions()
        fns = (self._qkv_fn, self._mlp_in_fn, self._residual_fn, self._final_norm_fn)
        return dict(zip(("qkv", "mlp_in", "residual", "final_norm"), fns, strict=True))

    def _mlp_in_with(self, gate_up: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``layer_mlp_in`` as ``gate_up`` (norm + GEMM) followed by the Triton SiLU kernel."""
        silu = self._silu
        assert silu is not None

        def mlp_in(x: torch.Tensor, norm: torch.Tensor, w_gate_up: torch.Tensor, eps: float) -> torch.Tensor:
            return silu(gate_up(x, norm, w_gate_up, eps))

        return mlp_in

    # ---- kernels ---------------------------------------------------------------------------
    def _init_kernels(
        self, setting: KernelSetting, linear_max_rows: int = 0, gated_min_rows: int = 0
    ) -> None:
        """Triton attention, sampling and SiLU where they run and agree with their references; the
        fused linear kernel too when ``linear_max_rows`` asks for it, and the gated GEMM when
        ``gated_min_rows`` does."""
        if setting not in (True, False, "auto"):
            raise ValueError(f"kernels must be True, False or 'auto', not {setting!r}")
        self.kernel_errors: dict[str, str] = {}
        self.kernel_check_seconds: dict[str, float] = {}
        self._attention: Any = None
        self._sampler: Any = None
        self._silu: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._scaled_silu: Callable[..., torch.Tensor] | None = None
        self._linear: decode_linear.TritonSmallLinear | None = None
        # buckets of at most this many rows run the fused small-batch linear kernel (0: cuBLAS)
        self.linear_max_rows = 0
        self._gated: decode_linear.TritonSmallLinear | None = None
        # buckets of at least this many rows run gate/up + SiLU as one GEMM (0: never)
        self.gated_min_rows = 0

        want = setting is True or (setting == "auto" and self.device.type == "cuda")
        if not want:
            return
        if not kernels.HAVE_TRITON:
            self.kernel_errors["triton"] = "triton is not importable"
        else:
            rows = min(self.B, 8)
            self._attention = self._checked_kernel(
                "attention",
                self._make_attention,
                rows=rows, n_kv=self.n_kv, group=self.group, d=self.head_dim, seq=min(self.S, 700),
                # the step always passes the shared-prompt rows (a row that shares nothing reads its
                # own), so the variant without them, never launched here, is not compiled to check it
                share_modes=(True,),
            )  # fmt: skip
            self._sampler = self._checked_kernel(
                "sample",
                lambda: kernels.TritonSampler(self.B, self.vocab, self.device, method=self.sampling),
                rows=rows,
                vocab=self.vocab,
            )
            self._silu = self._checked_kernel("silu", lambda: kernels.silu_mul, rows=rows, inter=self.inter)
            if self.fold_mlp_norm:
                self._scaled_silu = self._checked_kernel(
                    "scaled_silu",
                    lambda: kernels.scaled_silu_mul,
                    rows=rows,
                    inter=self.inter,
                    hidden=self.hidden,
                )
            widths = self._linear_widths
            if linear_max_rows:
                self._linear = self._checked_kernel(
                    "linear",
                    lambda: decode_linear.TritonSmallLinear(self.device),
                    check=decode_linear.self_check,
                    rows=min(self.B, linear_max_rows),
                    **widths,
                )
            if self._linear is not None:
                self.linear_max_rows = linear_max_rows
                self.reserve_linear()
            if gated_min_rows:
                self._gated = self._checked_kernel(
                    "gated",
                    self._make_gated,
                    check=functools.partial(decode_linear.self_check, layers=("gated",)),
                    rows=min(self.B, max(8, gated_min_rows)),
                    **widths,
                )
            if self._gated is not None:
                self.gated_min_rows = gated_min_rows
                self.reserve_linear()
        if setting is True and self.kernel_errors:
            raise RuntimeError(f"decode kernels unavailable: {self.kernel_errors}")
        for k, v in self.kernel_errors.items():
            log.warning("decode kernel %s unavailable, using PyTorch: %s", k, v)

    def _make_attention(self) -> kernels.TritonDecodeAttention:
        att = kernels.TritonDecodeAttention(self.B, self.n_kv, self.group, self.head_dim, self.S, self.device)
        att.grouped_min_rows = self.grouped_attention_min_rows  # its self-check covers the grouped kernel too
        return att

    def _checked_kernel(
        self, kind: str, make: Callable[[], Any], check: Callable[..., str | None] | None = None, **shape: Any
    ) -> Any:
        """``make()`` if it builds and passes its self-check (``kernels.self_check`` unless
        ``check`` is given), else None with the reason kept."""
        t0 = time.perf_counter()
        try:
            fn = make()
            if check is None:
                err = kernels.self_check(kind, fn, self.device, dtype=self.dtype, **shape)
            else:
                err = check(fn, self.device, dtype=self.dtype, **shape)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        # a cold Triton cache compiles the kernel here: part of the engine's start-up time
        self.kernel_check_seconds[kind] = time.perf_counter() - t0
        if err is None:
            return fn
        self.kernel_errors[kind] = err
        return None

    @property
    def kernels_used(self) -> dict[str, str]:
        return {
            "attention": "triton" if self._attention is not None else "sdpa",
            "sampling": "triton" if self._sampler is not None else "torch",
            "silu": "triton" if self._silu is not None else "torch",
            "linear": "triton" if self._linear is not None and self.linear_max_rows else "torch",
            "gated": "triton" if self._gated is not None and self.gated_min_rows else "torch",
        }

    @property
    def _linear_widths(self) -> dict[str, int]:
        """The linear layers' widths, as ``decode_linear.self_check`` and ``decode_layer_shapes``
        take them."""
        return {
            "hidden": self.hidden,
            "inter": self.inter,
            "n_att": self.n_heads * self.head_dim,
            "n_qkv": (self.n_heads + 2 * self.n_kv) * self.head_dim,
        }

    def _make_gated(self) -> decode_linear.TritonSmallLinear:
        lin = decode_linear.TritonSmallLinear(self.device)
        lin.launch = decode_linear.gated_launch(lin.hip)
        return lin

    def _mlp_in_folded(
        self, x: torch.Tensor, norm: torch.Tensor, w_gate_up_folded: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``layer_mlp_in`` with the norm folded: the GEMM on the raw residual against the folded
        weight, then ``silu(s g) * (s u)`` with each row's ``s = 1 / rms(x)`` (``norm`` is in the
        weight already)."""
        scaled = self._scaled_silu or kernels.scaled_silu_mul_ref
        return scaled(F.linear(x, w_gate_up_folded), x, eps)

    def _mlp_in_gated(
        self, x: torch.Tensor, norm: torch.Tensor, w_gate_up: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``layer_mlp_in`` as the norm (the step's compiled RMS norm) and one Triton GEMM with
        ``silu(gate) * up`` in its epilogue."""
        assert self._gated is not None
        return self._gated(self._final_norm_fn(x, norm, eps), w_gate_up, gated=True)

    def reserve_linear(self) -> None:
        """Size the linear kernels' workspaces (small-batch layers, large-batch gated GEMM) for
        every bucket they serve. Call again after changing ``linear_max_rows``,
        ``gated_min_rows`` or a kernel's launch settings: a graph keeps the workspace's address, so
        if a buffer has to move, the captured graphs are dropped."""
        moved = []
        lin = self._linear
        if lin is not None:
            shapes = decode_linear.decode_layer_shapes(**self._linear_widths).values()
            small = [nb for nb in self.buckets if nb <= self.linear_max_rows]
            moved += [lin.reserve(nb, *shape) for nb in small for shape in shapes]
        if self._gated is not None and self.gated_min_rows:
            moved += [
                self._gated.reserve(nb, self.inter, self.hidden, True)
                for nb in self.buckets
                if nb >= self.gated_min_rows
            ]
        if any(moved):
            self.drop_graphs()

    # ---- weights ---------------------------------------------------------------------------
    def refresh_fused(self) -> None:
        """Keep the fused qkv / gate-up weights equal to the HF modules' weights.

        The first call builds each fused tensor and re-points the HF weights at views of it, so
        later calls (after a weight update) only check that the views are intact: a module whose
        weight was replaced by a new tensor is copied back into the fused storage and re-viewed.
        """
        with torch.no_grad():
            if not self._fused:
                for layer in self.layers:
                    a, m = layer.self_attn, layer.mlp
                    qkv = [a.q_proj, a.k_proj, a.v_proj]
                    w = torch.cat([p.weight for p in qkv], 0)
                    b = torch.cat([p.bias for p in qkv], 0) if a.q_proj.bias is not None else None
                    gu = torch.cat([m.gate_proj.weight, m.up_proj.weight], 0)
                    self._fused.append((w, b, gu))
            for layer, (w, b, gu) in zip(self.layers, self._fused, strict=True):
                a, m = layer.self_attn, layer.mlp
                _bind_views(w, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                if b is not None:
                    _bind_views(b, [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
                _bind_views(gu, [m.gate_proj.weight, m.up_proj.weight])
            self.refresh_folded()

    @torch.no_grad()
    def refresh_folded(self) -> None:
        """Rebuild the folded gate/up weights from the current ones (``fold_mlp_norm``), in place:
        the captured graphs keep their addresses. Every path that writes weights calls this."""
        if not self.fold_mlp_norm:
            return
        for i, (layer, (_, _, gu)) in enumerate(zip(self.layers, self._fused, strict=True)):
            norm = layer.post_attention_layernorm.weight
            if i < len(self._gu_folded):
                kernels.fold_norm_weight(gu, norm, out=self._gu_folded[i])
            else:
                self._gu_folded.append(kernels.fold_norm_weight(gu, norm))

    def _layer_weights(self, i: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        w, b, gu = self._fused[i]
        layer = self.layers[i]
        a, m = layer.self_attn, layer.mlp
        pre = (layer.input_layernorm.weight, w, b)
        post = (
            a.o_proj.weight,
            a.o_proj.bias,
            layer.post_attention_layernorm.weight,
            gu,
            m.down_proj.weight,
            m.down_proj.bias,
        )
        return pre, post

    def _head(self, h: torch.Tensor, norm: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """Logits in the model dtype (the sampler reads them once, in float32 inside); ``norm`` is
        ``final_norm`` or its compiled copy (the decode step's)."""
        norm = norm or final_norm
        return self.model.lm_head(norm(h, self.inner.norm.weight, self.inner.norm.variance_epsilon))

    # ---- prefill ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]], slot_groups: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run each prompt once and write its KV into every slot of its group.

        Prompts go through together (right-padded to the longest of a chunk of at most
        ``max_prefill_tokens`` padded tokens): causal attention never lets a real position see
        the padding after it, so every real position's KV and the last position's logits are
        exact. Chunks take the prompts in order of length, so a chunk pads less (the rl bench's
        prompts of 65-320 tokens: 1.59x their positions in arrival order, 1.50x sorted; a chunk
        still pads to its longest prompt). Returns last-position logits ``[len(prompts), V]`` in
        the model dtype, in the order of ``prompts``.
        """
        if len(prompts) != len(slot_groups):
            raise ValueError("one slot group per prompt")
        for p in prompts:
            if not 0 < len(p) < self.S:
                raise ValueError(f"prompt length {len(p)} must be in [1, {self.S - 1}]")
        out: list[torch.Tensor] = []
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        start = 0
        while start < len(order):
            end, longest = start, 0
            while end < len(order):
                longest2 = max(longest, len(prompts[order[end]]))
                if end > start and longest2 * (end - start + 1) > self.max_prefill_tokens:
                    break
                longest, end = longest2, end + 1
            chunk = order[start:end]
            args = ([prompts[i] for i in chunk], [slot_groups[i] for i in chunk])
            start = end
            if not (self.compiled and self.compiled_prefill):
                out.append(self._prefill_chunk(*args))
                continue
            try:  # the step's compiled functions; a rerun rewrites the same K/V
                out.append(self._prefill_chunk(*args))
            except Exception:  # inductor/triton failures surface as many exception types
                self._go_eager("prefill")
                out.append(self._prefill_chunk(*args))
        logits = torch.cat(out)
        if order == sorted(order):
            return logits
        back = [0] * len(order)  # row of each prompt in the sorted logits
        for row, i in enumerate(order):
            back[i] = row
        return logits[to_device(torch.tensor(back), self.device)]

    def _prefill_chunk(self, prompts: list[Sequence[int]], groups: list[Sequence[int]]) -> torch.Tensor:
        g, P, D, dev = len(prompts), max(len(p) for p in prompts), self.head_dim, self.device
        self.prefill_forwards += 1
        self.prefill_padded_tokens += g * P
        # one host-to-device copy for the padded ids, lengths, slots and their prompts: a copy from
        # pageable memory waits for the stream, so one before any kernel, none between them
        host: list[int] = [t for p in prompts for t in (*p, *[0] * (P - len(p)))]
        host += [len(p) for p in prompts]
        host += [s for grp in groups for s in grp]
        host += [i for i, grp in enumerate(groups) for _ in grp]
        n = sum(len(grp) for grp in groups)
        packed = to_device(torch.tensor(host, dtype=torch.long), dev)
        ids, lens, slot_idx, src = packed.split([g * P, g, n, n])
        f = self._functions(compiled=self.compiled and self.compiled_prefill)
        # rows [g * P, H], as the decode step's (whose compiled functions can serve here too)
        x = self.inner.embed_tokens(ids.view(g, P)).view(g * P, -1)
        cos, sin = self.cos[:P], self.sin[:P]
        nq, nk, nqk = self.n_heads * D, self.n_kv * D, self.n_heads + self.n_kv
        for i in range(len(self.layers)):
            pre, post = self._layer_weights(i)
            qkv = f["qkv"](x, pre, self.eps).view(g, P, -1)
            # q and k rotated together: [g, H + Hkv, P, D]
            qk = kernels.rope(qkv[..., : nq + nk].view(g, P, nqk, D).transpose(1, 2), cos, sin)
            q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
            v = qkv[..., nq + nk :].view(g, P, self.n_kv, D).transpose(1, 2)
            _put_rows(self.k_cache[i], slot_idx, P, k, src)
            _put_rows(self.v_cache[i], slot_idx, P, v, src)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            att = att.transpose(1, 2).reshape(g * P, self.n_heads * D)
            x = layer_post_attention(x, att, post, self.eps, f["mlp_in"], f["residual"])
        last = x.view(g, P, -1)[torch.arange(g, device=dev), lens - 1]
        return self._head(last, f["final_norm"])

    # ---- sampling --------------------------------------------------------------------------
    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        keys: torch.Tensor,
        counters: torch.Tensor,
        use_top_p: bool,
        seeds_fn: Callable[..., torch.Tensor] = kernels.row_seeds,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row of ``logits`` [N, V]; returns (token, raw logprob float32).
        ``seeds_fn`` is ``kernels.row_seeds`` or its compiled copy (the decode step's)."""
        seeds = seeds_fn(keys, counters)
        ref = kernels.SAMPLE_REFS[self.sampling]
        if use_top_p:
            return ref(logits, temperature, seeds, kernels.top_p_keep(logits, temperature, top_p))
        if self._sampler is not None:
            return self._sampler(logits, temperature, seeds)
        return ref(logits, temperature, seeds)

    # ---- decode ----------------------------------------------------------------------------
    def bucket_for(self, rows: int) -> int:
        """Smallest batch bucket holding ``rows`` rows."""
        for b in self.buckets:
            if b >= rows:
                return b
        return self.B

    def kv_len_for(self, max_pos: int) -> int:
        """KV-length bucket covering positions up to ``max_pos`` (inclusive); 0 when the kernel
        reads each row's own length (no KV-length shape at all)."""
        if self._attention is not None:
            return 0
        return min(self.S, (max_pos // self.kv_bucket + 1) * self.kv_bucket)

    def _decode_step(self, nb: int, kv_len: int) -> None:
        """One token for every running slot among rows ``[0, nb)``."""
        s, D = self.state, self.head_dim
        pos = s.pos[:nb].clamp(max=self.S - 1)
        x = self.inner.embed_tokens(s.cur_tok[:nb])  # [nb, H]
        mark = self.compiled and self.dynamic_rows
        if mark:  # x is the residual stream every layer updates in place: one mark covers them all
            _rows_dynamic(x)
        att_kernel = self._attention
        lin = self._linear if nb <= self.linear_max_rows else None
        split = lin is None and bool(self.down_split_min_rows) and nb >= self.down_split_min_rows
        gated = lin is None and self._gated is not None and 0 < self.gated_min_rows <= nb
        fold = lin is None and not gated and self.fold_mlp_norm
        mlp_in = self._mlp_in_gated if gated else self._mlp_in_folded if fold else self._mlp_in_fn
        pending: tuple[torch.Tensor, torch.Tensor | None] | None = None  # partials not yet in x
        for i in range(len(self.layers)):
            pre, post = self._layer_weights(i)
            if fold:  # the gate/up weight with the MLP norm's weight in it
                post = (*post[:3], self._gu_folded[i], *post[4:])
            kc, vc = self.k_cache[i], self.v_cache[i]
            if lin is not None:
                norm, w_qkv, b_qkv = pre
                qkv = lin(x, w_qkv, norm=norm, eps=self.eps, bias=b_qkv)
            elif pending is not None:
                qkv = self._qkv_after_split_fn(x, *pending, pre, self.eps)
            else:
                qkv = self._qkv_fn(x, pre, self.eps)
            if att_kernel is not None:  # RoPE, the K/V write and attention in one kernel
                att = att_kernel.rope_attend(
                    qkv, self.cos, self.sin, pos, kc, vc, self.n_heads,
                    share_row=s.share_row[:nb], share_len=s.share_len[:nb], groups=self._groups,
                )  # fmt: skip
            else:
                att = kernels.rope_attention_ref(qkv, self.cos, self.sin, pos, kc, vc, self.n_heads, kv_len)
            att = att.reshape(nb, self.n_heads * D)
            if lin is not None:
                x = small_layer_post_attention(lin, x, att, post, self.eps)
            elif split:
                pending = self._post_attention_split(x, att, post, mlp_in)
                if mark:
                    _rows_dynamic(pending[0], dim=1)
                if not self.down_split_fold:  # summed now, by a kernel of their own
                    x, pending = self._add_partials_fn(x, *pending), None
            else:
                x = layer_post_attention(x, att, post, self.eps, mlp_in, self._residual_fn)
        if pending is not None:
            parts, bias = pending
            logits = self._head(x, lambda h, w, eps: self._final_norm_after_split_fn(h, parts, bias, w, eps))
        else:
            logits = self._head(x, self._final_norm_fn)
        keys, counters = s.key[:nb], s.n_gen[:nb]
        if mark:
            _rows_dynamic(keys, counters)
        tok, lp = self.sample(
            logits, s.temperature[:nb], s.top_p[:nb], keys, counters, self.any_top_p, self._seeds_fn
        )
        slots = (
            tok, lp, self._rows[:nb], s.cur_tok[:nb], s.pos[:nb], s.n_gen[:nb], s.max_new[:nb],
            s.running[:nb], s.stopped[:nb], s.stop_ids[:nb], s.out_tok[:nb], s.out_lp[:nb],
        )  # fmt: skip
        if mark:
            _rows_dynamic(*slots)
        self._advance_fn(*slots, self.T)

    def _post_attention_split(
        self, x: torch.Tensor, att: torch.Tensor, post: tuple[Any, ...], mlp_in: Callable[..., torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``layer_post_attention`` with the down projection left as float32 split-K partials (and
        its bias), for the next layer's norm kernel (or ``add_partials_``) to add into ``x``."""
        w_o, b_o, norm, w_gu, w_down, b_down = post
        x = self._residual_fn(x, att, w_o, b_o)
        h = mlp_in(x, norm, w_gu, self.eps)
        return split_k_partials(h, w_down, self.down_split_k), b_down

    @torch.no_grad()
    def set_shared_prompts(self, share_row: Sequence[int], share_len: Sequence[int]) -> None:
        """Tell the attention kernel which rows hold the same prompt K/V: for rows ``r < n``,
        positions below ``share_len[r]`` (at most its position) are the same as in row
        ``share_row[r]``, whose own position is at least ``share_len[r]`` (so no step writes
        there); rows ``>= n`` read only their own. A group's samples then read their
        prompt from one copy. Call between steps after rows are admitted, moved or freed; the
        PyTorch path (no kernel) reads each row's own copy, which holds the same values."""
        n, s = len(share_row), self.state
        if len(share_len) != n or n > self.B:
            raise ValueError(f"share_row and share_len must have the same length <= {self.B} rows")
        rows, lens = [*share_row, *range(n, self.B)], [*share_len, *[0] * (self.B - n)]
        s.share_row.copy_(to_device(torch.tensor(rows, dtype=torch.long), self.device))
        s.share_len.copy_(to_device(torch.tensor(lens, dtype=torch.long), self.device))
        if self._groups is not None:  # the same rows, as groups for the grouped kernel
            att = self._attention
            table = kernels.attention_group_tensors(rows, lens, self.B, att.members, att.block_n)
            for dst, src in zip(self._groups, table, strict=True):
                dst.copy_(to_device(src, self.device))

    @torch.no_grad()
    def decode(self, nb: int, kv_len: int = 0) -> None:
        """Run one decode step over rows ``[0, nb)`` (graph replay on CUDA)."""
        if nb not in self.buckets:
            raise ValueError(f"{nb} rows is not a batch bucket {self.buckets}")
        if self._attention is None and kv_len <= 0:
            raise ValueError("kv_len is required without the decode-attention kernel")
        self.steps_by_bucket[nb] = self.steps_by_bucket.get(nb, 0) + 1
        if self.use_graphs:
            key = (nb, kv_len, self.any_top_p)
            graph = self._graphs.get(key)
            if graph is None:
                t0 = time.perf_counter()
                graph = self._capture(nb, kv_len)
                self.capture_seconds[nb] = self.capture_seconds.get(nb, 0.0) + time.perf_counter() - t0
            if graph is not None:
                self._graphs[key] = graph
                graph.replay()
                return
        self._step(nb, kv_len)

    def _step(self, nb: int, kv_len: int) -> None:
        """One step, compiled where it compiles: if the compiled step fails, go eager and retry."""
        if not self.compiled or (nb, kv_len) in self._compiled_ok:
            self._decode_step(nb, kv_len)
            return
        snap = self._snapshot()
        try:
            self._decode_step(nb, kv_len)
            self._compiled_ok.add((nb, kv_len))
        except Exception:  # inductor/triton failures surface as many exception types
            self._go_eager("decode step")
            self._restore(snap)
            self._decode_step(nb, kv_len)

    def _go_eager(self, where: str) -> None:
        """After a compiled function failed (in a step or a prefill): eager from now on, why kept."""
        self.compile_error = traceback.format_exc()
        log.warning("torch.compile failed in the %s; eager from now on:\n%s", where, self.compile_error)
        self.compiled = False
        self._use_eager_functions()
        self.drop_graphs()

    def _capture(self, nb: int, kv_len: int) -> torch.cuda.CUDAGraph | None:
        """A CUDA graph of the step, or None once capture has failed: then the reason is kept in
        ``graph_error`` and graphs are off for good. The step still decodes (without graphs), and
        the process's CUDA random-number state stays usable for whatever else runs in it (a
        colocated trainer)."""
        # Warm-up and capture run real steps, so snapshot the (small) slot state and restore it:
        # capture must not advance real requests. The KV cache needs no snapshot: a step writes
        # only at each slot's current position (the value the next real step writes again) and,
        # for advanced slots, beyond it, where nothing is read before being rewritten.
        snap = self._snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles (or falls back to eager) outside the capture
                self._step(nb, kv_len)
                self._restore(snap)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._decode_step(nb, kv_len)
        except Exception:
            release_rng_after_failed_capture(self.device)
            self.graph_error = traceback.format_exc()
            log.warning("decode step graph capture failed; decoding without graphs:\n%s", self.graph_error)
            self.use_graphs = False
            self.drop_graphs()
            return None
        finally:
            self._restore(snap)
        return graph

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in vars(self.state).items()}

    def _restore(self, snap: dict[str, torch.Tensor]) -> None:
        for k, v in snap.items():
            getattr(self.state, k).copy_(v)

    @torch.no_grad()
    def move_rows(self, src: Sequence[int], dst: Sequence[int], upto: int) -> None:
        """Move slots ``src`` to free rows ``dst``: their state and their first ``upto`` KV positions."""
        if not src:
            return
        self.rows_moved += len(src)
        s_idx = to_device(torch.tensor(list(src), dtype=torch.long), self.device)
        d_idx = to_device(torch.tensor(list(dst), dtype=torch.long), self.device)
        upto = min(max(upto, 1), self.S)
        for cache in (*self.k_cache, *self.v_cache):
            _put_rows(cache, d_idx, upto, cache, s_idx)
        for t in vars(self.state).values():
            t[d_idx] = t[s_idx]
        self.state.running[s_idx] = False

    def drop_graphs(self) -> None:
        """Forget captured graphs (e.g. after the cache or weights were reallocated), and their
        memory pool: once its last graph is gone torch frees the pool, and a capture into the old
        handle fails ("use_count > 0 INTERNAL ASSERT FAILED", torch 2.11 on the H200), which
        would leave the engine decoding without graphs, several times slower."""
        self._graphs.clear()
        self._pool = None


def _put_rows(
    cache: torch.Tensor, rows: torch.Tensor, upto: int, source: torch.Tensor, take: torch.Tensor
) -> None:
    """``cache[rows, :, :upto] = source[take, :, :upto]``, copied as 8-byte words where both
    layouts allow (``as_words``; ``source`` may be the cache itself: the rows read are taken first)."""
    dst, src = as_words(cache), as_words(source)
    if dst.dtype != src.dtype:
        dst, src = cache, source
    dst[rows, :, :upto] = src[take, :, :upto]


def _rows_dynamic(*tensors: torch.Tensor, dim: int = 0) -> None:
    """Ask ``torch.compile`` to treat ``dim`` (the batch rows) of each tensor as dynamic when it
    first compiles a function taking them; a hint, so a function that needs the size fixed still
    compiles (fixed) instead of failing."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, dim)


def release_rng_after_failed_capture(device: torch.device) -> None:
    """Make the device's default CUDA generator usable again after a capture CUDA aborted.

    Such a capture never reaches torch's capture epilogue, so (torch 2.11; 2.13 keeps this state
    per capture) the generator stays marked as capturing and every later eager random op on
    the device raises "Offset increment outside graph capture encountered unexpectedly". A clone of
    its state (same seed and offset) is not marked: install it, only when the probe op fails.
    """
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch.empty(1, device=device).uniform_()
    except RuntimeError:
        gen = torch.cuda.default_generators[index]
        gen.graphsafe_set_state(gen.clone_state())
        log.warning("reset the CUDA random-number state of %s after a failed graph capture", device)


def advance_slots(
    tok: torch.Tensor,
    lp: torch.Tensor,
    rows: torch.Tensor,
    cur_tok: torch.Tensor,
    pos: torch.Tensor,
    n_gen: torch.Tensor,
    max_new: torch.Tensor,
    running: torch.Tensor,
    stopped: torch.Tensor,
    stop_ids: torch.Tensor,
    out_tok: torch.Tensor,
    out_lp: torch.Tensor,
    max_tokens: int,
) -> None:
    """Record each running row's sampled token and move it on; stop rows on a stop id or their budget.

    Updates the slot tensors in place (rows ``[0, len(tok))``); pure otherwise, so one compile
    fuses the dozen small ops into a kernel or two.
    """
    run = running.clone()  # the rows that sampled this step
    col = n_gen.clamp(max=max_tokens)
    out_tok[rows, col] = torch.where(run, tok, out_tok[rows, col])
    out_lp[rows, col] = torch.where(run, lp, out_lp[rows, col])
    new_n = n_gen + run.long()
    hit = (stop_ids == tok[:, None]).any(-1) & run
    still = run & ~hit & (new_n < max_new)  # the rows that go on: only they feed their token next
    stopped.copy_(stopped | hit)
    running.copy_(still)
    n_gen.copy_(new_n)
    cur_tok.copy_(torch.where(still, tok, cur_tok))
    pos.copy_(pos + still.long())


def final_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's last RMS norm, before the LM head."""
    return F.rms_norm(h, (h.shape[-1],), weight, eps)


def layer_qkv(x: torch.Tensor, weights: tuple[Any, ...], eps: float) -> torch.Tensor:
    """Norm and the fused q/k/v projection: ``x`` [B, H] -> ``qkv`` [B, (H + 2 Hkv) D]."""
    norm, w_qkv, b_qkv = weights
    return F.linear(F.rms_norm(x, (x.shape[-1],), norm, eps), w_qkv, b_qkv)


def layer_gate_up(x: torch.Tensor, norm: torch.Tensor, w_gate_up: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm and the fused gate/up projection: ``x`` [B, H] -> [B, 2 I], gate first."""
    return F.linear(F.rms_norm(x, (x.shape[-1],), norm, eps), w_gate_up)


def layer_mlp_in(x: torch.Tensor, norm: torch.Tensor, w_gate_up: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm, the fused gate/up projection and ``silu(gate) * up``: the down projection's input."""
    return kernels.silu_mul_ref(layer_gate_up(x, norm, w_gate_up, eps))


def layer_post_attention(
    x: torch.Tensor,
    att: torch.Tensor,
    weights: tuple[Any, ...],
    eps: float,
    mlp_in: Callable[..., torch.Tensor] = layer_mlp_in,
    residual: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """o_proj into the residual, then the gated MLP into the residual, both in place on ``x``
    [..., H] (the caller's residual stream); ``mlp_in`` and ``residual`` are ``layer_mlp_in`` and
    ``residual_linear_`` or their compiled copies."""
    residual = residual or residual_linear_
    w_o, b_o, norm, w_gu, w_down, b_down = weights
    x = residual(x, att, w_o, b_o)
    return residual(x, mlp_in(x, norm, w_gu, eps), w_down, b_down)


def small_layer_post_attention(
    lin: decode_linear.TritonSmallLinear,
    x: torch.Tensor,
    att: torch.Tensor,
    weights: tuple[Any, ...],
    eps: float,
) -> torch.Tensor:
    """``layer_post_attention`` on the fused small-batch kernel: o into the residual, then norm +
    gate/up + SiLU, then down into the residual: three kernels."""
    w_o, b_o, norm, w_gu, w_down, b_down = weights
    lin(att, w_o, bias=b_o, out=x)
    h = lin(x, w_gu, norm=norm, eps=eps, gated=True)
    return lin(h, w_down, bias=b_down, out=x)


def residual_linear_(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x += h @ weight.T (+ bias)`` in place; bias-free, one GEMM with ``x`` as cuBLAS's C operand
    (no copy of the residual first)."""
    if bias is not None:
        return x.add_(F.linear(h, weight, bias))
    x.view(-1, x.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), weight.t())
    return x


def split_k_partials(h: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """``h @ weight.T`` as ``splits`` slices of K: one strided-batched GEMM into float32 partials
    ``[splits, rows, out]`` (each slice is a view of ``h`` and of ``weight``, nothing is copied).

    Why: a few hundred rows against a long K (the down projection: 512 x 8,960 -> 1,536 at 1.5B)
    give cuBLAS about one output tile per SM, each walking all of K; split, the tiles are
    ``splits`` times as many and as short."""
    rows, k = h.shape
    ks = k // splits
    hs = h.view(rows, splits, ks).transpose(0, 1)  # [splits, rows, ks]
    ws = weight.view(weight.shape[0], splits, ks).transpose(0, 1).transpose(1, 2)  # [splits, ks, out]
    # no mixed-precision batched GEMM on the CPU: there, the same sums in float32
    return torch.bmm(hs, ws, out_dtype=torch.float32) if h.is_cuda else torch.bmm(hs.float(), ws.float())


def residual_split_k_(
    x: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    splits: int,
    add_partials: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x += h @ weight.T (+ bias)`` in place: ``split_k_partials`` and ``add_partials`` summing
    them into ``x`` (a kernel of its own)."""
    return (add_partials or add_partials_)(x, split_k_partials(h, weight, splits), bias)


def add_partials_(x: torch.Tensor, parts: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x += parts.sum(0) (+ bias)`` in float32, rounded once into ``x``'s dtype (one kernel
    compiled)."""
    acc = x.float() + parts.sum(0)
    if bias is not None:
        acc = acc + bias.float()
    return x.copy_(acc.to(x.dtype))


def layer_qkv_after_split(
    x: torch.Tensor, parts: torch.Tensor, bias: torch.Tensor | None, weights: tuple[Any, ...], eps: float
) -> torch.Tensor:
    """The previous layer's split-K partials added into the residual ``x`` in place, then
    ``layer_qkv``: compiled, the sum, the rounding and the norm are one kernel."""
    return layer_qkv(add_partials_(x, parts, bias), weights, eps)


def final_norm_after_split(
    x: torch.Tensor, parts: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``final_norm`` after the last layer's split-K partials are added into ``x`` in place."""
    return final_norm(add_partials_(x, parts, bias), weight, eps)


def _bind_views(fused: torch.Tensor, params: list[Any]) -> None:
    """Make each parameter's data the matching row block of ``fused`` (copying it in if it moved)."""
    row = 0
    for p in params:
        n = p.shape[0]
        view = fused[row : row + n]
        if p.data_ptr() != view.data_ptr() or p.shape != view.shape:
            view.copy_(p.data)
            p.data = view
        row += n
