"""A fast batched decoder for HF Qwen2/Llama-style causal LMs: static KV cache, on-device sampling.

Why not ``model.generate``: it re-plans the cache, syncs with the host every token and launches
hundreds of small kernels per step, which on an H200 leaves decode at well under 1% of its
memory-bandwidth bound. Here a fixed set of *slots* (rows) shares one preallocated KV cache; a
decode step is a pure function of device tensors (no host sync, no allocation), so on CUDA it is
captured once per KV-length bucket as a CUDA graph and replayed; the host looks at finished flags
only every ``sync_every`` steps. The forward reuses the HF module's own parameters (``nn.Linear``
and norm weights). q/k/v and gate/up are fused once: the fused tensor becomes the storage and the
HF modules' weights become views into it, so a weight update written into the HF parameters lands
in the fused weights too (no re-copy, no second copy in memory) and captured graphs stay valid.

``compile_step="auto"`` compiles the per-layer decode function with torch.compile on CUDA
(inductor fuses the norm, RoPE and SiLU chains the graph would otherwise launch one kernel each;
one compile serves every layer) and falls back to eager, recording why, if compilation fails.

Sampling is batched and counter-based: each slot has a 32-bit key (from the request seed) and the
uniform for its ``i``-th token is a hash of (key, i), so a seeded sample is reproducible whatever
else shares the batch. ``temperature == 0`` is greedy; top-p sorts only when some slot asks for it.
Logprobs are raw ``log_softmax(logits)`` of the sampled token (see ``rollout.base``).
"""

from __future__ import annotations

import logging
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

_M32 = 0xFFFFFFFF
log = logging.getLogger(__name__)
CompileSetting = bool | str  # True, False or "auto" (compile on CUDA, eager elsewhere)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser on int64 tensors holding 32-bit values (wrapping multiply, masked)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def counter_uniform(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) float64 per row from (key, counter) int64 tensors; deterministic on any device."""
    a = _fmix32((keys & _M32) ^ ((counters * 0x9E3779B9) & _M32))
    b = _fmix32((a + 0x68E31DA4 + (keys >> 32)) & _M32)
    return ((a >> 5).double() * 67108864.0 + (b >> 6).double()) / 9007199254740992.0


@dataclass
class SlotState:
    """Device tensors describing every slot; the CUDA graph reads and writes these in place."""

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


class StaticDecoder:
    """Owns the KV cache and runs prefill / decode steps over ``num_slots`` rows."""

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
        kv_bucket: int = 128,
    ) -> None:
        cfg: Any = model.config
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the hf rollout engine")
        self.model: Any = model
        self.inner: Any = self.model.model
        self.layers: list[Any] = list(self.inner.layers)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.group = self.n_heads // self.n_kv
        self.vocab = int(cfg.vocab_size)
        self.B = num_slots
        self.kv_bucket = kv_bucket
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
        self.sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).contiguous()  # signed for _rope
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
        )
        self._rows = torch.arange(self.B, device=dev)
        self.any_top_p = False
        self.use_graphs = (dev.type == "cuda") if use_cuda_graphs is None else use_cuda_graphs
        if compile_step not in (True, False, "auto"):
            raise ValueError(f"compile_step must be True, False or 'auto', not {compile_step!r}")
        self.compiled = dev.type == "cuda" if compile_step == "auto" else bool(compile_step)
        self.compile_error: str | None = None  # traceback of a failed compile (then eager)
        self._compiled_ok: set[int] = set()  # KV buckets whose compiled step has run once
        # Only the per-layer function is compiled (sampling stays eager: inductor on CUDA cannot
        # yet fuse the vocabulary-wide cumsum with its reductions, "NYI TritonSplitDimKernel").
        self._layer_fn: Callable[..., torch.Tensor] = decode_layer
        if self.compiled:
            self._layer_fn = torch.compile(decode_layer)  # the KV length goes dynamic at bucket 2
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None

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

    # ---- model pieces ----------------------------------------------------------------------
    @staticmethod
    def _rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
        # torch's rms_norm (one fused kernel on CUDA instead of ~7) with fp32 accumulation; it
        # differs from Qwen2RMSNorm only in rounding once before the weight multiply in bf16.
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_1, sin_2]: 3 kernels instead of 6
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)

    @staticmethod
    def _add_linear(x: torch.Tensor, h: torch.Tensor, linear: Any) -> torch.Tensor:
        return _residual_linear(x, h, linear.weight, linear.bias)

    def _qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w, b, _ = self._fused[i]
        qkv = F.linear(h, w, b)
        nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        return qkv[..., :nq], qkv[..., nq : nq + nk], qkv[..., nq + nk :]

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """The gated activation ``silu(gate) * up`` (the caller applies down_proj with the residual)."""
        _, _, gu = self._fused[i]
        g, u = F.linear(h, gu).chunk(2, dim=-1)
        return F.silu(g) * u

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._rms(h, self.inner.norm)).float()

    # ---- prefill ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompt: list[int], slots: list[int]) -> torch.Tensor:
        """Run ``prompt`` once, write its KV into every slot of ``slots``; return last-position logits."""
        P = len(prompt)
        if P == 0 or P >= self.S:
            raise ValueError(f"prompt length {P} must be in [1, {self.S - 1}]")
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        x = self.inner.embed_tokens(ids)  # [1, P, H]
        cos, sin = self.cos[:P], self.sin[:P]
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        D = self.head_dim
        for i, layer in enumerate(self.layers):
            h = self._rms(x, layer.input_layernorm)
            q, k, v = self._qkv(i, h)
            q = self._rope(q.view(1, P, self.n_heads, D).transpose(1, 2), cos, sin)
            k = self._rope(k.view(1, P, self.n_kv, D).transpose(1, 2), cos, sin)
            v = v.view(1, P, self.n_kv, D).transpose(1, 2)
            self.k_cache[i][idx, :, :P] = k
            self.v_cache[i][idx, :, :P] = v
            kk = k.repeat_interleave(self.group, dim=1)
            vv = v.repeat_interleave(self.group, dim=1)
            att = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
            att = att.transpose(1, 2).reshape(1, P, self.n_heads * D)
            x = self._add_linear(x, att, layer.self_attn.o_proj)
            x = self._add_linear(
                x, self._mlp(i, self._rms(x, layer.post_attention_layernorm)), layer.mlp.down_proj
            )
        return self._logits(x[:, -1])[0]

    # ---- sampling --------------------------------------------------------------------------
    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        u: torch.Tensor,
        use_top_p: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row of ``logits`` [N, V] fp32; return (token, raw logprob)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        greedy = temperature <= 0
        t = torch.where(greedy, torch.ones_like(temperature), temperature)
        probs = torch.softmax(logits / t[:, None], dim=-1)
        if use_top_p:
            sp, order = probs.sort(dim=-1, descending=True)
            csum = sp.cumsum(-1)
            sp = sp.masked_fill(csum - sp > top_p[:, None], 0.0)
            c = sp.cumsum(-1)
            j = torch.searchsorted(c, (u * c[:, -1].double()).to(c.dtype)[:, None], right=True)
            j = j.clamp_(max=logits.shape[-1] - 1)
            sampled = order.gather(1, j)[:, 0]
        else:
            c = probs.cumsum(-1)
            j = torch.searchsorted(c, (u * c[:, -1].double()).to(c.dtype)[:, None], right=True)
            sampled = j[:, 0].clamp_(max=logits.shape[-1] - 1)
        tok = torch.where(greedy, logits.argmax(-1), sampled)
        return tok, logprobs.gather(1, tok[:, None])[:, 0]

    # ---- decode ----------------------------------------------------------------------------
    def _decode_step(self, kv_len: int) -> None:
        """One token for every running slot; attends over the first ``kv_len`` cache positions."""
        s, D = self.state, self.head_dim
        pos = s.pos.clamp(max=kv_len - 1)
        x = self.inner.embed_tokens(s.cur_tok)[:, None]  # [B, 1, H]
        cos2, sin2 = self.cos[pos][:, None], self.sin[pos][:, None]  # [B,1,D]
        # Additive mask built once per step (a bool mask would be converted in every layer).
        visible = torch.arange(kv_len, device=self.device)[None] <= pos[:, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~visible, float("-inf"))[:, None, None]
        for i, layer in enumerate(self.layers):
            w, b, gu = self._fused[i]
            a, m = layer.self_attn, layer.mlp
            x = self._layer_fn(
                x,
                cos2,
                sin2,
                mask,
                self._rows,
                pos,
                self.k_cache[i],  # whole caches (graph inputs mutated in place), read up to kv_len
                self.v_cache[i],
                kv_len,
                (w, b, a.o_proj.weight, a.o_proj.bias, gu, m.down_proj.weight, m.down_proj.bias),
                (layer.input_layernorm.weight, layer.post_attention_layernorm.weight),
                float(layer.input_layernorm.variance_epsilon),
                (self.n_heads, self.n_kv, D),
            )
        logits = self._logits(x[:, 0])
        u = counter_uniform(s.key, s.n_gen)
        tok, lp = self.sample(logits, s.temperature, s.top_p, u, self.any_top_p)
        run = s.running
        col = s.n_gen.clamp(max=self.T)
        s.out_tok[self._rows, col] = torch.where(run, tok, s.out_tok[self._rows, col])
        s.out_lp[self._rows, col] = torch.where(run, lp, s.out_lp[self._rows, col])
        n_gen = s.n_gen + run.long()
        hit = (s.stop_ids == tok[:, None]).any(-1) & run
        s.stopped.copy_(s.stopped | hit)
        s.running.copy_(run & ~hit & (n_gen < s.max_new))
        s.n_gen.copy_(n_gen)
        s.cur_tok.copy_(torch.where(run, tok, s.cur_tok))
        s.pos.copy_(s.pos + run.long())

    def kv_len_for(self, max_pos: int) -> int:
        """KV-length bucket covering positions up to ``max_pos`` (inclusive)."""
        return min(self.S, (max_pos // self.kv_bucket + 1) * self.kv_bucket)

    @torch.no_grad()
    def decode(self, kv_len: int) -> None:
        """Run one decode step (graph replay on CUDA)."""
        if not self.use_graphs:
            self._guarded(False, kv_len)
            return
        key = (kv_len, self.any_top_p)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._guarded(True, kv_len)
            self._graphs[key] = graph
        graph.replay()

    def _guarded(self, capture: bool, kv_len: int) -> Any:
        """Step (or capture a graph); if the compiled step fails to compile, go eager and retry."""

        def run() -> Any:
            return self._capture(kv_len) if capture else self._decode_step(kv_len)

        if not self.compiled or kv_len in self._compiled_ok:
            return run()
        snap = {k: v.clone() for k, v in vars(self.state).items()}
        try:
            out = run()
            self._compiled_ok.add(kv_len)
            return out
        except Exception:  # inductor/triton failures surface as many exception types
            self.compile_error = traceback.format_exc()
            log.warning("torch.compile of the decode step failed; decoding eagerly:\n%s", self.compile_error)
            for k, v in snap.items():
                getattr(self.state, k).copy_(v)
            self.compiled = False
            self._layer_fn = decode_layer
            self._graphs.clear()
            return run()

    def _capture(self, kv_len: int) -> torch.cuda.CUDAGraph:
        # Warm-up and capture run real steps, so snapshot the (small) slot state and restore it:
        # capture must not advance real requests. The KV cache needs no snapshot: a step writes
        # only at each slot's current position (the value the next real step writes again) and,
        # for advanced slots, beyond it, where nothing is read before being rewritten.
        snap = {k: v.clone() for k, v in vars(self.state).items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._decode_step(kv_len)
                for k, v in snap.items():
                    getattr(self.state, k).copy_(v)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._decode_step(kv_len)
        for k, v in snap.items():
            getattr(self.state, k).copy_(v)
        return graph

    def drop_graphs(self) -> None:
        """Forget captured graphs (e.g. after the cache or weights were reallocated)."""
        self._graphs.clear()


def decode_layer(
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    mask: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: int,
    weights: tuple[Any, ...],
    norms: tuple[torch.Tensor, torch.Tensor],
    eps: float,
    dims: tuple[int, int, int],
) -> torch.Tensor:
    """One decoder layer for one new token per slot: ``x`` [B, 1, H] -> [B, 1, H]; writes the KV.

    A pure function of its tensors (weights passed in, no module access), so one torch.compile of
    it serves every layer: compiling the whole unrolled step instead took ~3 minutes on an H200
    host for a 24-layer model, this compiles one layer.
    """
    w_qkv, b_qkv, w_o, b_o, w_gu, w_down, b_down = weights
    n_heads, n_kv, d = dims
    bsz = x.shape[0]
    nqk = n_heads + n_kv
    h = F.rms_norm(x, (x.shape[-1],), norms[0], eps)
    qkv = F.linear(h[:, 0], w_qkv, b_qkv)  # [B, (H + 2 Hkv) D]
    # One RoPE over q and k together (adjacent in the fused output); rotate_half(x) * sin equals
    # roll(x, D/2) * [-sin_1, sin_2].
    qk = StaticDecoder._rope(qkv[:, : nqk * d].view(bsz, nqk, d), cos, signed_sin)
    q = qk[:, :n_heads].view(bsz, n_kv, n_heads // n_kv, d)  # GQA: the group as queries
    k = qk[:, n_heads:].view(bsz, n_kv, 1, d)
    v = qkv[:, nqk * d :].view(bsz, n_kv, 1, d)
    k_cache[rows, :, pos] = k[:, :, 0]
    v_cache[rows, :, pos] = v[:, :, 0]
    att = F.scaled_dot_product_attention(q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], attn_mask=mask)
    x = _residual_linear(x, att.reshape(bsz, 1, n_heads * d), w_o, b_o)
    g, u = F.linear(F.rms_norm(x, (x.shape[-1],), norms[1], eps), w_gu).chunk(2, dim=-1)
    return _residual_linear(x, F.silu(g) * u, w_down, b_down)


def _residual_linear(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x + h @ weight.T (+ bias)``; bias-free as one GEMM with the residual as its C operand."""
    if bias is not None:
        return x + F.linear(h, weight, bias)
    shape = x.shape
    return torch.addmm(x.reshape(-1, shape[-1]), h.reshape(-1, h.shape[-1]), weight.t()).view(shape)


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
