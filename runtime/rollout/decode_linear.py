"""The decode step's four linear layers for small batches, as one Triton kernel with fused edges.

Why: at <= 64 rows a decode step's GEMMs are too small for cuBLAS to reach the memory bound.
In stop 28's H100 kernel table (0.5B, 64 rows) the q/k/v GEMM took 4.8 us for 2 MB of weights and
the o GEMM 4.0 us for 1.6 MB (a tenth of the read bandwidth), the down GEMM a split-K kernel plus a
reduce kernel, and the two RMS norms and the SiLU were three more kernels per layer. Here one
kernel per linear layer reads its weight tile once and does what sat around the GEMM:

- ``NORM``: the RMS norm before q/k/v and gate/up. ``rms_norm(x) @ W.T = rstd * ((x * g) @ W.T)``
  with ``rstd`` one number per row, so each program scales its ``x`` blocks by the norm weight
  ``g``, sums ``x**2`` as it goes, and multiplies the accumulator by ``rstd`` at the end.
- ``GATED``: the gate/up projection followed by ``silu(gate) * up``; a program holds the gate and
  the up columns of the same outputs, so the [rows, 2 I] intermediate is never written.
- ``RESIDUAL``: o and down accumulate into the residual stream in place (``out += x @ W.T``).
- **Split-K**: a layer with few output tiles (o and down: 896 or 1,536 outputs) would leave most
  SMs idle, so the K range is cut into ``split`` parts, one program each. Each writes its float32
  partial (and its partial sum of squares) to a workspace and counts itself in per output tile;
  the last one to arrive adds the partials in split order and applies the epilogue. The sum is
  in a fixed order, so results do not depend on which program finished last; the counter is reset
  by that program, so a captured CUDA graph replays with no memset.

``small_linear_ref`` is the same maths in PyTorch (the CPU path and the self-check's reference).
The decoder uses the kernel only when asked (``linear_max_rows``). Off by default: on an H100 each
layer ran 1.3-2.2x slower than the cuBLAS path at 64 rows (gate/up worst: each program scales its
``x`` rows in registers before the MMA, a load Triton does not pipeline; with 1-2 K blocks per
program the split-K tail costs more than cuBLAS's whole o GEMM). ``bash bench/gpu/run.sh
linear-layers linear-rollout`` repeats the measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlkube.runtime.rollout.kernels import HAVE_TRITON, silu_mul_ref

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _small_linear_finish(acc, acc_up, sq, rm, rn, m_ok, n_ok, BIAS, OUT, s_om, K, eps,
                             NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                             HAS_BIAS: tl.constexpr):  # fmt: skip
        """The epilogue: row scale of the norm, bias, SiLU gate or residual add, one rounding."""
        if NORM:
            rstd = 1.0 / tl.sqrt(sq / K + eps)
            acc = acc * rstd[:, None]
            if GATED:
                acc_up = acc_up * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        ptrs = OUT + rm[:, None] * s_om + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        if RESIDUAL:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _small_linear_kernel(
        X, W, NORM_W, BIAS, OUT, WS, WS_SQ, COUNT,
        M, N, K, s_xm, s_wn, s_om, up_rows, n_pad, eps,
        NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
        IEEE: tl.constexpr, SPLIT: tl.constexpr, K_PER_SPLIT: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """Output columns [pid_n * BN, +BN) of rows [pid_m * BM, +BM), over K range pid_k (see
        the module doc). Row blocks vary fastest: the programs that read one weight tile run
        side by side and share it through L2, so the weights leave HBM once however many row
        blocks there are (n fastest read a 55 MB gate/up weight once per row block)."""
        pid_t = tl.program_id(0)
        pid_k = tl.program_id(1)
        m_tiles = tl.cdiv(M, BM)
        pid_m = pid_t % m_tiles
        pid_n = pid_t // m_tiles
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        sq = tl.zeros((BM,), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for k0 in range(0, K_PER_SPLIT, BK):
            k = k_start + k0 + rk
            k_ok = k < K
            x = tl.load(X + rm[:, None] * s_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                xf = x.to(tl.float32)
                sq += tl.sum(xf * xf, 1)
                g = tl.load(NORM_W + k, mask=k_ok, other=0.0).to(tl.float32)
                x = (xf * g[None, :]).to(W.dtype.element_ty)
            w_mask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(W + rn[:, None] * s_wn + k[None, :], mask=w_mask, other=0.0)
            if IEEE:  # noqa: SIM108 - a constexpr branch inside a Triton kernel
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            if GATED:
                wu = tl.load(W + (rn[:, None] + up_rows) * s_wn + k[None, :], mask=w_mask, other=0.0)
                if IEEE:
                    acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(x, tl.trans(wu), acc_up)
        if SPLIT == 1:
            _small_linear_finish(acc, acc_up, sq, rm, rn, m_ok, n_ok, BIAS, OUT, s_om, K, eps,
                                 NORM, GATED, RESIDUAL, HAS_BIAS)  # fmt: skip
        else:
            # partials laid out [split, plane (gate, up), m_pad, n_pad]; sums of squares
            # [n tile, split, m_pad]; one counter per output tile
            m_pad = m_tiles * BM
            tile = rm[:, None] * n_pad + rn[None, :]
            plane = m_pad * n_pad
            tl.store(WS + (pid_k * 2) * plane + tile, acc)
            if GATED:
                tl.store(WS + (pid_k * 2 + 1) * plane + tile, acc_up)
            if NORM:
                tl.store(WS_SQ + (pid_n * SPLIT + pid_k) * m_pad + rm, sq)
            tl.debug_barrier()  # every thread's partial is written before the count goes up
            counter = COUNT + pid_t
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLIT - 1:  # the last of this tile's programs: sum in split order
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                acc_up = tl.zeros((BM, BN), dtype=tl.float32)
                sq = tl.zeros((BM,), dtype=tl.float32)
                for s in range(SPLIT):
                    acc += tl.load(WS + (s * 2) * plane + tile, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(WS + (s * 2 + 1) * plane + tile, cache_modifier=".cg")
                    if NORM:
                        sq += tl.load(WS_SQ + (pid_n * SPLIT + s) * m_pad + rm, cache_modifier=".cg")
                tl.store(counter, 0)  # ready for the next launch (and graph replay)
                _small_linear_finish(acc, acc_up, sq, rm, rn, m_ok, n_ok, BIAS, OUT, s_om, K, eps,
                                     NORM, GATED, RESIDUAL, HAS_BIAS)  # fmt: skip


def small_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the kernel computes, in PyTorch: ``rms_norm`` (if ``norm``), ``x @ weight.T + bias``,
    then ``silu(gate) * up`` (if ``gated``) or ``out += ...`` in place (if ``out`` is given)."""
    if norm is not None:
        x = F.rms_norm(x, (x.shape[-1],), norm, eps)
    y = F.linear(x, weight, bias)
    if gated:
        y = silu_mul_ref(y)
    if out is None:
        return y
    return out.add_(y)


def decode_layer_shapes(hidden: int, inter: int, n_att: int, n_qkv: int) -> dict[str, tuple[int, int, bool]]:
    """A decoder layer's four calls as (outputs, K, gated): what ``reserve`` needs for each."""
    return {
        "q/k/v": (n_qkv, hidden, False),
        "o": (hidden, n_att, False),
        "gate/up": (inter, hidden, True),
        "down": (hidden, inter, False),
    }


@dataclass(frozen=True)
class LinearPlan:
    """How one call is cut: ``m_tiles`` x ``n_tiles`` output tiles of ``bm`` x ``bn``, each over
    ``split`` K ranges of ``k_per_split``."""

    bm: int
    bn: int
    bk: int
    split: int
    k_per_split: int
    n_tiles: int
    m_tiles: int
    num_warps: int
    num_stages: int

    @property
    def programs(self) -> int:
        return self.n_tiles * self.m_tiles * self.split

    @property
    def workspace(self) -> tuple[int, int, int]:
        """Float32 partials, float32 partial sums of squares, int32 counters (0 without a split)."""
        if self.split == 1:
            return 0, 0, 0
        m_pad, n_pad = self.m_tiles * self.bm, self.n_tiles * self.bn
        return self.split * 2 * m_pad * n_pad, self.n_tiles * self.split * m_pad, self.m_tiles * self.n_tiles


def gated_launch(hip: bool) -> dict[str, int]:
    """The launch of the large-batch gated layer (``StaticDecoder(gated_min_rows=...)``): 128-row
    blocks of 128 gate and 128 up columns, 64-wide K blocks in 3 stages on 8 warps (the
    decode-step bench's ``t128``; 144 KB of shared memory); on AMD, whose LDS holds 64 KB, half
    the columns and 32-wide K blocks in 2 stages (unmeasured: no AMD GPU here)."""
    if hip:
        return {"bm": 128, "bn": 64, "bk": 32, "num_warps": 8, "num_stages": 2}
    return {"bm": 128, "bn": 128, "bk": 64, "num_warps": 8, "num_stages": 3}


class TritonSmallLinear:
    """The fused linear layer; workspace and tile counters sized once, at ``reserve``.

    Built for the decode step's small batches (one row block of up to 64 rows); it takes any row
    count (blocks of ``bm`` rows, 128 by default past 64), which the benchmark times against
    cuBLAS, and the decoder uses it up to its ``linear_max_rows``. The workspace must not move once
    a CUDA graph has captured a call (the graph keeps its address), so the decoder reserves every
    shape it will run before its first step, and a call that would need more raises instead of
    growing it.
    """

    MAX_ROWS = 64  # the decoder's default: buckets up to this many rows

    def __init__(self, device: torch.device) -> None:
        if not HAVE_TRITON:
            raise RuntimeError("triton is not importable")
        self.device = device
        if device.type == "cuda":
            self.n_sm = torch.cuda.get_device_properties(device).multi_processor_count
            self.hip = torch.version.hip is not None
        else:  # the interpreter: any count exercises the same code
            self.n_sm, self.hip = 4, False
        # overrides of the policy's "bm", "bn", "bk", "num_warps", "num_stages" and "programs"
        # (the program count the split aims at); the benchmark's A/B
        self.launch: dict[str, int] = {}
        self.ws = torch.empty(0, dtype=torch.float32, device=device)
        self.ws_sq = torch.empty(0, dtype=torch.float32, device=device)
        self.count = torch.zeros(0, dtype=torch.int32, device=device)

    def plan(self, rows: int, n_out: int, k: int, gated: bool) -> LinearPlan:
        """Tiles and split for ``rows`` x ``n_out`` outputs over ``k``: about one program per SM
        (gate/up's programs each read two weight tiles into two accumulators)."""
        if rows < 1:
            raise ValueError("no rows")
        small = rows <= self.MAX_ROWS
        bm = self.launch.get("bm", max(16, 1 << (rows - 1).bit_length()) if small else 128)
        bn = self.launch.get("bn", 32 if gated else 64)
        # AMD's 64 KB of LDS per workgroup holds fewer, smaller stages
        bk = self.launch.get("bk", 64 if self.hip or not small else 128)
        n_tiles, m_tiles = math.ceil(n_out / bn), math.ceil(rows / bm)
        k_blocks = math.ceil(k / bk)
        target = self.launch.get("programs", self.n_sm)
        split = max(1, min(k_blocks, round(target / (n_tiles * m_tiles))))
        per = math.ceil(k_blocks / split)
        split = math.ceil(k_blocks / per)
        stages = self.launch.get("num_stages", 2 if self.hip else 3)
        warps = self.launch.get("num_warps", 4 if small else 8)
        return LinearPlan(bm, bn, bk, split, per * bk, n_tiles, m_tiles, warps, min(stages, per + 1))

    def reserve(self, rows: int, n_out: int, k: int, gated: bool) -> bool:
        """Grow the workspace and counters for a call of this shape (before any graph capture);
        True if a buffer moved (graphs captured before then hold its old address)."""
        ws, ws_sq, count = self.plan(rows, n_out, k, gated).workspace
        moved = False
        if ws > self.ws.numel():
            self.ws, moved = torch.empty(ws, dtype=torch.float32, device=self.device), True
        if ws_sq > self.ws_sq.numel():
            self.ws_sq, moved = torch.empty(ws_sq, dtype=torch.float32, device=self.device), True
        if count > self.count.numel():
            self.count, moved = torch.zeros(count, dtype=torch.int32, device=self.device), True
        return moved

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        *,
        norm: torch.Tensor | None = None,
        eps: float = 1e-6,
        bias: torch.Tensor | None = None,
        gated: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``small_linear_ref``'s contract: ``x`` [M, K], ``weight`` [N, K] ([2 I, K] gate rows
        first when ``gated``); ``out`` [M, N] is accumulated into in place."""
        m, k = x.shape
        n_w = weight.shape[0]
        n_out = n_w // 2 if gated else n_w
        assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == k
        assert not (gated and out is not None), "the gated projection writes a new tensor"
        p = self.plan(m, n_out, k, gated)
        residual = out is not None
        if out is None:
            out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
        assert out.shape == (m, n_out) and out.stride(-1) == 1
        ws, ws_sq, count = p.workspace
        if ws > self.ws.numel() or ws_sq > self.ws_sq.numel() or count > self.count.numel():
            raise RuntimeError(f"small linear workspace not reserved for {m}x{n_out}x{k} (gated={gated})")
        _small_linear_kernel[(p.n_tiles * p.m_tiles, p.split)](
            x, weight, norm if norm is not None else x, bias if bias is not None else x, out,
            self.ws, self.ws_sq, self.count,
            m, n_out, k, x.stride(0), weight.stride(0), out.stride(0), n_out, p.n_tiles * p.bn, eps,
            NORM=norm is not None, GATED=gated, RESIDUAL=residual, HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32, SPLIT=p.split, K_PER_SPLIT=p.k_per_split,
            BM=p.bm, BN=p.bn, BK=p.bk, num_warps=p.num_warps, num_stages=p.num_stages,
        )  # fmt: skip
        return out


def self_check(fn: TritonSmallLinear, device: torch.device, *, rows: int, hidden: int, inter: int,
               n_qkv: int, n_att: int, dtype: torch.dtype,
               layers: tuple[str, ...] = ("q/k/v", "o", "gate/up", "down")) -> str | None:  # fmt: skip
    """The layer kinds of a decode step at the model's shapes against ``small_linear_ref``
    (float32), at one row and at ``rows``; ``None`` if they agree, else why not (then the decoder
    keeps cuBLAS). ``layers``: the four of ``small_layer_post_attention`` by default; "gated" is
    gate/up + SiLU on an input already normed (the large-batch gated layer)."""
    g = torch.Generator(device="cpu").manual_seed(4321)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    x, norm, res = rand(rows, hidden), rand(hidden, scale=0.2) + 1, rand(rows, hidden)
    # name: (input, weight, norm weight, bias, gated, residual)
    cases: dict[
        str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool, bool]
    ] = {
        "q/k/v": (x, rand(n_qkv, hidden, scale=0.05), norm, rand(n_qkv), False, False),
        "o": (rand(rows, n_att), rand(hidden, n_att, scale=0.05), None, None, False, True),
        "gate/up": (x, rand(2 * inter, hidden, scale=0.05), norm, None, True, False),
        "down": (rand(rows, inter), rand(hidden, inter, scale=0.02), None, None, False, True),
        "gated": (x, rand(2 * inter, hidden, scale=0.05), None, None, True, False),
    }
    cases = {name: case for name, case in cases.items() if name in layers}
    tol = 2e-2 if dtype != torch.float32 else 1e-4

    def up(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.float()

    try:
        for name, (a, w, nw, bias, gated, residual) in cases.items():
            for m in sorted({1, rows}):
                fn.reserve(m, w.shape[0] // (2 if gated else 1), w.shape[1], gated)
                out = res[:m].to(torch.float32, copy=True) if residual else None
                want = small_linear_ref(
                    a[:m].float(), w.float(), norm=up(nw), eps=1e-6, bias=up(bias), gated=gated, out=out
                )
                out_k = res[:m].clone() if residual else None
                got = fn(a[:m], w, norm=nw, eps=1e-6, bias=bias, gated=gated, out=out_k).float()
                err = float((got - want).norm() / want.norm())
                if not err < tol:
                    return f"small linear kernel ({name}, {m} rows): relative error {err:.3g}"
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
