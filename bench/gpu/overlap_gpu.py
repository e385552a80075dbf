"""The decode step's layers over two row halves on two CUDA streams, against all rows on one.

Why: at 512 rows the step's GEMMs are compute-bound and its attention is memory-bound, and they run
one after the other, so the step costs about the sum of the two while its bound is the larger. With
the rows split in two halves on two streams, one half's attention can run beside the other's GEMMs
(and fill the GEMMs' last partial wave). The halves read the weights twice and their GEMMs are half
as tall, so whether this wins is a measurement, not a derivation: this is the go/no-go before the
decoder gets such a mode.

Random weights with Qwen2.5-0.5B / 1.5B layer shapes, bf16, the engine's Triton attention kernel
(RoPE, K/V write, attention; groups of 8 rows share a 64-token prompt) and SiLU kernel, cuBLAS
GEMMs, torch's RMS norm; no LM head or sampler (the same in every variant). Each variant is
captured as one CUDA graph and replayed; the figure is the median of ``--repeats`` timings of
``--calls`` replays. Variants:

- ``one-stream``: all rows, layer after layer (what the decoder does today);
- ``halves-serial``: each half through every layer, one stream (the cost of halving alone);
- ``two-stream``: the halves on two streams, started together;
- ``two-stream-lag``: the second half starts once the first has finished layer 0, so the
  halves start one layer apart (where they drift from there is up to the GPU);
- ``fold-mlp-norm``: all rows on one stream, one kernel fewer per layer: the MLP's RMS norm
  weight folded into the gate/up weight (the engine's ``fold_mlp_norm``: ``kernels.fold_norm_weight``),
  the GEMM on the raw residual, and each row's ``1 / rms`` applied in the SiLU kernel
  (``kernels.scaled_silu_mul``, which reads the row of the residual for it).

    python3 bench/gpu/overlap_gpu.py                      # GPU: 1.5b and 0.5b at 512 rows
    TRITON_INTERPRET=1 python3 bench/gpu/overlap_gpu.py --smoke   # CPU: tiny layers, no streams (CI)

Writes JSON to stdout and ``$OUT/overlap-gpu.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location("rlkube_bench_common", Path(__file__).with_name("_common.py"))
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
common.import_rlkube()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# hidden, heads, KV heads, head dim, intermediate, layers (Qwen2.5)
SHAPES = {
    "0.5b": (896, 14, 2, 64, 4864, 24),
    "1.5b": (1536, 12, 2, 128, 8960, 28),
    "tiny": (64, 4, 2, 16, 128, 2),
}
GROUP, PROMPT, CONTEXT, CACHE = 8, 64, 192, 384
VARIANTS = ("one-stream", "halves-serial", "two-stream", "two-stream-lag", "fold-mlp-norm")
EPS = 1e-6


class Layers:
    """Weights, caches and per-half attention kernels for one model shape."""

    def __init__(self, size: str, rows: int, dev: torch.device, layers: int | None = None):
        from rlkube.runtime.rollout import kernels

        h, nh, nkv, d, inter, n_layers = SHAPES[size]
        self.h, self.nh, self.nkv, self.d = h, nh, nkv, d
        self.n_layers = layers or n_layers
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        g = torch.Generator().manual_seed(0)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dev, dtype)

        qkv_out = (nh + 2 * nkv) * d
        self.weights = [
            (w(h), w(qkv_out, h), w(qkv_out), w(h, nh * d), w(h), w(2 * inter, h), w(h, inter))
            for _ in range(self.n_layers)
        ]
        # the MLP norm's weight folded into the gate/up weight's input columns (fold-mlp-norm)
        self.w_gu_folded = [kernels.fold_norm_weight(wt[5], wt[4]) for wt in self.weights]
        self.kc = [torch.randn(rows, nkv, CACHE, d, generator=g).to(dev, dtype) for _ in range(self.n_layers)]
        self.vc = [torch.randn(rows, nkv, CACHE, d, generator=g).to(dev, dtype) for _ in range(self.n_layers)]
        ang = torch.arange(CACHE)[:, None] * torch.rand(d // 2, generator=g)[None]
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(dev, dtype)
        self.sin = torch.cat([-ang.sin(), ang.sin()], -1).to(dev, dtype)
        self.pos = torch.full((rows,), CONTEXT, device=dev)
        r = torch.arange(rows)
        lead = r - r % GROUP
        self.share_row = lead.to(dev)
        self.share_len = torch.where(lead == r, 0, PROMPT).to(dev)
        self.x0 = torch.randn(rows, h, generator=g).to(dev, dtype)
        self.rows, self.dev = rows, dev
        # the engine's Triton kernels on a GPU, or in Triton's interpreter (the CPU test)
        self.triton = dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        # one kernel object (its own partial buffers) per row range a variant runs
        self.att = {
            lo: kernels.TritonDecodeAttention(rows - lo, nkv, nh // nkv, d, CACHE, dev)
            if self.triton
            else None
            for lo in (0, rows // 2)
        }
        self.kernels = kernels

    def layer(self, i: int, x: torch.Tensor, lo: int, hi: int, att: Any, fold: bool = False) -> torch.Tensor:
        """Layer ``i`` over rows ``[lo, hi)`` (``x`` holds those rows); returns the new residual;
        ``fold``: the MLP norm folded into the gate/up weight and the SiLU kernel."""
        n1, w_qkv, b_qkv, w_o, n2, w_gu, w_down = self.weights[i]
        k = self.kernels
        h = F.rms_norm(x, (self.h,), n1, EPS)
        qkv = F.linear(h, w_qkv, b_qkv)
        kc, vc, pos = self.kc[i][lo:hi], self.vc[i][lo:hi], self.pos[lo:hi]
        if att is not None:
            # the halves are group-aligned, so every row's lead row is in its own half
            a = att.rope_attend(
                qkv, self.cos, self.sin, pos, kc, vc, self.nh,
                share_row=self.share_row[lo:hi] - lo, share_len=self.share_len[lo:hi],
            )  # fmt: skip
        else:
            a = k.rope_attention_ref(qkv, self.cos, self.sin, pos, kc, vc, self.nh, CONTEXT + 1)
        x = torch.addmm(x, a.reshape(hi - lo, -1), w_o.t())
        if fold:
            scaled = k.scaled_silu_mul if self.triton else k.scaled_silu_mul_ref
            m = scaled(F.linear(x, self.w_gu_folded[i]), x, EPS)
        else:
            gu = F.linear(F.rms_norm(x, (self.h,), n2, EPS), w_gu)
            m = k.silu_mul(gu) if self.triton else k.silu_mul_ref(gu)
        return torch.addmm(x, m, w_down.t())

    def run(
        self, lo: int, hi: int, start: int = 0, x: torch.Tensor | None = None, fold: bool = False
    ) -> torch.Tensor:
        """Rows ``[lo, hi)`` through layers ``start..``, from the step's input or ``x``."""
        x = self.x0[lo:hi] if x is None else x
        for i in range(start, self.n_layers):
            x = self.layer(i, x, lo, hi, self.att[lo], fold)
        return x

    def variant(self, name: str) -> Callable[[], torch.Tensor]:
        rows, half = self.rows, self.rows // 2
        if name == "one-stream":
            return lambda: self.run(0, rows)
        if name == "fold-mlp-norm":
            return lambda: self.run(0, rows, fold=True)
        if name == "halves-serial":
            return lambda: torch.cat([self.run(0, half), self.run(half, rows)])
        if self.dev.type != "cuda":  # no streams on the CPU: the smoke run checks the halves' maths
            return lambda: torch.cat([self.run(0, half), self.run(half, rows)])
        side = torch.cuda.Stream(self.dev)
        lag = 1 if name == "two-stream-lag" else 0

        def two_streams() -> torch.Tensor:
            # the fork is an event inside the graph: the second half starts after the first half's
            # first ``lag`` layers
            main = torch.cuda.current_stream(self.dev)
            a = self.x0[:half]
            for i in range(lag):
                a = self.layer(i, a, 0, half, self.att[0])
            fork = torch.cuda.Event()
            fork.record(main)
            side.wait_event(fork)
            a = self.run(0, half, start=lag, x=a)
            with torch.cuda.stream(side):
                b = self.run(half, rows)
            main.wait_stream(side)
            return torch.cat([a, b])

        return two_streams

    def bound(self, read_bps: float, flops: float) -> dict[str, float]:
        """The layers' own bound: weights read once, each row's K/V (a group's prompt once), the
        GEMM flops at the measured rate."""
        h, nh, nkv, d = self.h, self.nh, self.nkv, self.d
        inter = self.weights[0][-1].shape[1]  # the down projection's input width
        params = h * (nh + 2 * nkv) * d + h * nh * d + 3 * h * inter
        el = 2
        own = self.rows * (CONTEXT + 1) - (self.rows - self.rows // GROUP) * PROMPT
        kv = 2 * nkv * d * el * own
        mem = self.n_layers * (params * el + kv) / read_bps
        comp = self.n_layers * 2 * self.rows * params / flops
        return {"memory_s": mem, "compute_s": comp, "bound_s": max(mem, comp)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.5b,0.5b")
    ap.add_argument("--rows", default="512")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, one tiny shape, eager")
    args = ap.parse_args(argv)
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    sizes = ["tiny"] if args.smoke else args.sizes.split(",")
    rows_list = [16] if args.smoke else [int(r) for r in args.rows.split(",")]
    ceil = common.ceilings(dev, args.smoke)
    report: dict[str, Any] = {**common.run_info(dev, ceil, args), "results": []}
    read_bps, flops = ceil["read_bandwidth_gbs"] * 1e9, ceil["gemm_tflops"] * 1e12
    for size in sizes:
        for rows in rows_list:
            layers = Layers(size, rows, dev)
            bound = layers.bound(read_bps, flops)
            ref = None
            first = None
            for name in args.variants.split(","):
                fn = layers.variant(name)
                with torch.no_grad():
                    out = fn().float()
                    times = common.timed_calls(
                        fn, dev, 1 if args.smoke else args.calls, 1 if args.smoke else args.repeats
                    )
                ref = out if ref is None else ref
                t = statistics.median(times)
                first = t if first is None else first
                row = {
                    "size": size, "rows": rows, "variant": name, "us": 1e6 * t,
                    "us_range": [1e6 * min(times), 1e6 * max(times)], "vs_first": first / t,
                    "fraction_of_bound": bound["bound_s"] / t, **bound,
                    "max_abs_diff_vs_first": float((out - ref).abs().max()),
                }  # fmt: skip
                report["results"].append(row)
                print(json.dumps(row), flush=True)
            del layers
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "overlap-gpu.json").write_text(json.dumps(report, indent=2))
    for r in report["results"]:
        print(
            f"{r['size']:>5} {r['rows']:4d} rows {r['variant']:<15} {r['us']:8.1f} us "
            f"(x{r['vs_first']:.3f} vs first, {100 * r['fraction_of_bound']:.1f}% of the layers' bound, "
            f"max diff {r['max_abs_diff_vs_first']:.3g})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
