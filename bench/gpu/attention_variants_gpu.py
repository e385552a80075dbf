"""What the decode attention kernel's structure costs, and the layers around it (A/B on one GPU).

``decode_step_gpu.py --attention`` times the engine's kernel under launch settings and splits;
this times variants of its *code* against it, on the same inputs (groups of 8 rows sharing a
64-position prompt; the caches copied until the copies are past L2, each call reading the next):

- ``prod``: ``kernels.TritonDecodeAttention`` as the engine runs it (``split`` variants force one);
- ``old``: the same class from another checkout's ``kernels.py`` (``--old-kernels PATH``);
- ``early`` ...: a copy of the kernel, one program per row and KV head over the whole context,
  with the new token first and a base-2 softmax (what stop 42 took into the engine), optionally
  with unmasked block loads (``nomask``), the shared and own positions in two loops
  (``twoloops``) or the grid's KV head first (``headmajor``);
- ``stream``: no maths, each program summing its row's K and V: the bound of this access pattern
  (the read bound assumes every byte streams; a program per row and head does not get there at
  short contexts).

``--parts silu`` times the SiLU kernel per block and warp count (plain, and scaled as
``fold_mlp_norm`` runs it); ``--parts gemm`` the step's small GEMMs at 512 rows as the step runs
them and split-K into float32 partials (``hf_decode.split_k_partials``).

    python bench/gpu/attention_variants_gpu.py                      # GPU: contexts 192 and 700
    python bench/gpu/attention_variants_gpu.py --old-kernels ../old/runtime/rollout/kernels.py
    TRITON_INTERPRET=1 python bench/gpu/attention_variants_gpu.py --smoke   # CPU (tested in CI)

Writes JSON to stdout and to ``$OUT/attention-variants-gpu.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location("rlkube_bench_common", Path(__file__).with_name("_common.py"))
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
common.import_rlkube()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from rlkube.runtime.rollout import kernels  # noqa: E402
from rlkube.runtime.rollout.kernels import _rope_row  # noqa: E402


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc):
    """One block of the online softmax in base 2: scores ``s`` [G, N] (masked), values ``v`` [N, D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _attn_variant(
    QKV, COS, SIN, POS, SHARE_ROW, SHARE_LEN, K, V, OUT,
    s_qkv, s_cs, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_g, G, qk_scale,
    N_HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    NOMASK: tl.constexpr, TWO_LOOPS: tl.constexpr, HEAD_MAJOR: tl.constexpr,
):  # fmt: skip
    """One program per (row, KV head), whole context: the new token's k/v first (its loads overlap
    the prologue), exp2 softmax, optional unmasked block loads and split shared/own loops."""
    if HEAD_MAJOR:
        h = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        h = tl.program_id(1)
    n_kv = N_HEADS // G
    pos = tl.load(POS + b).to(tl.int32)
    src = tl.load(SHARE_ROW + b)
    shared_end = tl.load(SHARE_LEN + b).to(tl.int32) // BLOCK_N * BLOCK_N
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    row = QKV + b * s_qkv
    c = tl.load(COS + pos * s_cs + offs_d).to(tl.float32)
    sn = tl.load(SIN + pos * s_cs + offs_d).to(tl.float32)
    half = D // 2
    qcol = (h * G + offs_g[:, None]) * D
    q = tl.load(row + qcol + offs_d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    rot = tl.where(offs_d < half, offs_d + half, offs_d - half)
    q_p = tl.load(row + qcol + rot[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    q = (q * c[None, :] + q_p * sn[None, :]) * qk_scale  # scale and log2(e) folded into q
    q = q.to(K.dtype.element_ty)
    k_new = _rope_row(row, (N_HEADS + h) * D, c, sn, D).to(K.dtype.element_ty)
    v_new = tl.load(row + (N_HEADS + n_kv + h) * D + offs_d)
    k_own = K + b * sk_b + h * sk_h
    v_own = V + b * sv_b + h * sv_h
    tl.store(k_own + pos * sk_s + offs_d, k_new)
    tl.store(v_own + pos * sv_s + offs_d, v_new)
    k_src = K + src * sk_b + h * sk_h
    v_src = V + src * sv_b + h * sv_h
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    if TWO_LOOPS:
        for n0 in range(0, shared_end, BLOCK_N):
            n = n0 + offs_n
            k = tl.load(k_src + n[:, None] * sk_s + offs_d[None, :])
            v = tl.load(v_src + n[:, None] * sv_s + offs_d[None, :])
            m_i, l_i, acc = _softmax_step(tl.dot(q, tl.trans(k)), v, m_i, l_i, acc)
        lo = shared_end
    else:
        lo = 0
    for n0 in range(lo, pos, BLOCK_N):
        n = n0 + offs_n
        nmask = n < pos
        if TWO_LOOPS:
            kb, vb = k_own, v_own
        else:
            from_src = n0 < shared_end
            kb = tl.where(from_src, k_src, k_own)
            vb = tl.where(from_src, v_src, v_own)
        if NOMASK:  # the cache holds whole blocks: positions past pos are stale, masked in s only
            k = tl.load(kb + n[:, None] * sk_s + offs_d[None, :])
            v = tl.load(vb + n[:, None] * sv_s + offs_d[None, :])
        else:
            k = tl.load(kb + n[:, None] * sk_s + offs_d[None, :], mask=nmask[:, None], other=0.0)
            v = tl.load(vb + n[:, None] * sv_s + offs_d[None, :], mask=nmask[:, None], other=0.0)
        s = tl.where(nmask[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)
    s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1)
    m_new = tl.maximum(m_i, s_new)
    p = tl.exp2(s_new - m_new)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
    ptr = OUT + b * so_b + h * so_h + offs_g[:, None] * so_g + offs_d[None, :]
    tl.store(ptr, (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _stream_only(
    POS, SHARE_ROW, SHARE_LEN, K, V, OUT, sk_b, sk_h, sk_s, BLOCK_N: tl.constexpr, D: tl.constexpr
):
    """The same grid and bytes with no maths: each program sums its row's K and V (the bound of this
    access pattern)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(POS + b).to(tl.int32)
    src = tl.load(SHARE_ROW + b)
    shared_end = tl.load(SHARE_LEN + b).to(tl.int32) // BLOCK_N * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for n0 in range(0, pos, BLOCK_N):
        n = n0 + offs_n
        base = tl.where(n0 < shared_end, src, b)
        off = base * sk_b + h * sk_h + n[:, None] * sk_s + offs_d[None, :]
        acc += tl.load(K + off, mask=(n < pos)[:, None], other=0.0).to(tl.float32)
        acc += tl.load(V + off, mask=(n < pos)[:, None], other=0.0).to(tl.float32)
    tl.store(OUT + b * 2 + h, tl.sum(tl.sum(acc, 1), 0))


# ``--old-kernels``: another checkout's kernels.py, for the ``old`` variant
OLD_KERNELS: list[str] = []


def variant_call(name: str, cfg: dict[str, Any], inputs: Any, n_heads: int, att: Any) -> Any:
    qkv, cos, ssin, pos, kc, vc, lead, shared = inputs
    b = qkv.shape[0]
    n_kv, d = kc.shape[1], kc.shape[3]
    g = n_heads // n_kv
    if cfg["kind"] == "old":
        spec = importlib.util.spec_from_file_location("old_kernels", OLD_KERNELS[0])
        assert spec is not None and spec.loader is not None
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        oatt = old.TritonDecodeAttention(b, n_kv, g, d, att.max_seq, qkv.device)
        oatt.launch = cfg.get("launch")
        return lambda: oatt.rope_attend(
            qkv, cos, ssin, pos, kc, vc, n_heads, share_row=lead, share_len=shared
        )
    if cfg["kind"] == "prod":
        att.block_n, att.launch = cfg.get("block_n", 64), cfg.get("launch")
        split = cfg.get("split")
        split = att.max_seq if split == "direct" else split
        return lambda: att.rope_attend(
            qkv, cos, ssin, pos, kc, vc, n_heads, split=split, share_row=lead, share_len=shared
        )
    if cfg["kind"] == "stream":
        out = torch.empty(b * 2, device=qkv.device, dtype=torch.float32)
        bn = cfg.get("block_n", 64)

        def stream() -> Any:
            _stream_only[(b, n_kv)](
                pos, lead, shared, kc, vc, out, kc.stride(0), kc.stride(1), kc.stride(2),
                BLOCK_N=bn, D=d, **cfg.get("launch", {}),
            )  # fmt: skip
            return out

        return stream
    out = torch.empty((b, n_kv, g, d), dtype=qkv.dtype, device=qkv.device)
    head_major = cfg.get("head_major", False)
    grid = (n_kv, b) if head_major else (b, n_kv)

    def call() -> Any:
        _attn_variant[grid](
            qkv, cos, ssin, pos, lead, shared, kc, vc, out,
            qkv.stride(0), cos.stride(0),
            kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
            out.stride(0), out.stride(1), out.stride(2), g, math.log2(math.e) / math.sqrt(d),
            N_HEADS=n_heads, BLOCK_N=cfg.get("block_n", 64), BLOCK_G=max(16, triton.next_power_of_2(g)), D=d,
            NOMASK=cfg.get("nomask", False), TWO_LOOPS=cfg.get("two_loops", False), HEAD_MAJOR=head_major,
            **cfg.get("launch", {}),
        )  # fmt: skip
        return out

    return call


VARIANTS: dict[str, dict[str, Any]] = {
    "prod": {"kind": "prod"},
    "old": {"kind": "old"},
    "direct": {"kind": "prod", "split": "direct"},
    "s128": {"kind": "prod", "split": 128},
    "s256": {"kind": "prod", "split": 256},
    "s512": {"kind": "prod", "split": 512},
    "prod-w4s2": {"kind": "prod", "launch": {"num_warps": 4, "num_stages": 2}},
    "prod-w2s2": {"kind": "prod", "launch": {"num_warps": 2, "num_stages": 2}},
    "early": {"kind": "v"},
    "early-w4s2": {"kind": "v", "launch": {"num_warps": 4, "num_stages": 2}},
    "early-w2s2": {"kind": "v", "launch": {"num_warps": 2, "num_stages": 2}},
    "nomask": {"kind": "v", "nomask": True},
    "nomask-w2s2": {"kind": "v", "nomask": True, "launch": {"num_warps": 2, "num_stages": 2}},
    "twoloops": {"kind": "v", "two_loops": True},
    "twoloops-nomask": {"kind": "v", "two_loops": True, "nomask": True},
    "twoloops-nomask-w2s2": {
        "kind": "v",
        "two_loops": True,
        "nomask": True,
        "launch": {"num_warps": 2, "num_stages": 2},
    },
    "twoloops-nomask-b32": {"kind": "v", "two_loops": True, "nomask": True, "block_n": 32},
    "headmajor": {"kind": "v", "head_major": True},
    "stream": {"kind": "stream"},
    "stream-w2": {"kind": "stream", "launch": {"num_warps": 2}},
    "stream-w8": {"kind": "stream", "launch": {"num_warps": 8}},
}


def bench_attention(args: argparse.Namespace, dev: Any, read_bps: float) -> list[dict[str, Any]]:
    res = []
    shapes = [("0.5b", 14, 2, 64), ("1.5b", 12, 2, 128)]
    for size, n_heads, n_kv, d, rows_ in ((*sh, r) for sh in shapes for r in args.rows_list):
        if size not in args.sizes:
            continue
        for context in args.contexts:
            rows, seq = (8, 128) if args.smoke else (rows_, 320 if context < 320 else 2048)
            ctx = min(context, seq - 2) if not args.smoke else 40
            inp = common.DecodeAttentionInputs(rows, n_heads, n_kv, d, ctx, seq, dev, mixed=ctx >= 700)
            kv_bytes = inp.kv_bytes
            sets = [
                (inp.qkv, inp.cos, inp.ssin, inp.pos, k, v, inp.lead, inp.shared)
                for k, v in inp.cache_copies(args.cold_bytes)
            ]
            att = kernels.TritonDecodeAttention(rows, n_kv, n_heads // n_kv, d, seq, dev)
            want = None
            for name in args.variants:
                cfg = VARIANTS[name]
                try:
                    calls = [variant_call(name, cfg, s, n_heads, att) for s in sets]
                    # each call writes the new token's k/v at pos: same value every time, so repeatable
                    got = calls[0]().float()
                    times = common.timed_calls(
                        common.cycling(calls),
                        dev,
                        len(calls) * (1 if args.smoke else 5),
                        1 if args.smoke else 5,
                    )
                except Exception as exc:
                    res.append(
                        {
                            "size": size,
                            "context": ctx,
                            "variant": name,
                            "error": f"{type(exc).__name__}: {exc}"[:800],
                        }
                    )
                    print(json.dumps(res[-1]), flush=True)
                    continue
                diff = None
                if cfg["kind"] != "stream":
                    want = got if want is None else want
                    diff = float((got - want).abs().max())
                t = statistics.median(times)
                res.append({
                    "size": size, "context": ctx, "rows": rows, "variant": name, "us": 1e6 * t,
                    "us_range": [1e6 * min(times), 1e6 * max(times)],
                    "fraction_of_read_bound": kv_bytes / read_bps / t, "max_abs_diff_vs_prod": diff,
                })  # fmt: skip
                print(json.dumps(res[-1]), flush=True)
    return res


def silu_call(gu: torch.Tensor, x: torch.Tensor | None, block: int, warps: int) -> Any:
    """The engine's SiLU kernel on ``gu`` (scaled by ``x``'s rows when given) at one launch."""
    b, n = gu.shape[0], gu.shape[1] // 2
    res = gu if x is None else x

    def call() -> torch.Tensor:
        out = torch.empty((b, n), dtype=gu.dtype, device=gu.device)
        kernels._silu_mul_kernel[(b, triton.cdiv(n, block))](
            gu, res, out, n, res.shape[1], 1e-6, gu.stride(0), res.stride(0), out.stride(0),
            BLOCK=block, BLOCK_H=triton.next_power_of_2(res.shape[1]) if x is not None else 1,
            SCALED=x is not None, num_warps=warps,
        )  # fmt: skip
        return out

    return call


def bench_silu(args: argparse.Namespace, dev: Any, read_bps: float) -> list[dict[str, Any]]:
    """The SiLU kernel per block and warp count at the step's rows, plain and scaled."""
    res = []
    for size, hidden, inter in (("0.5b", 896, 4864), ("1.5b", 1536, 8960)):
        rows = 8 if args.smoke else args.rows
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
        gu = torch.randn(rows, 2 * inter, device=dev, dtype=dtype)
        x = torch.randn(rows, hidden, device=dev, dtype=dtype)
        base = kernels.silu_mul(gu)
        for scaled, block, warps in itertools.product((False, True), (1024, 2048, 4096, 8192), (4, 8)):
            call = silu_call(gu, x if scaled else None, block, warps)
            got = call()
            times = common.timed_calls(call, dev, 1 if args.smoke else 20, 1 if args.smoke else 5)
            t = statistics.median(times)
            nbytes = gu.numel() * gu.element_size() * 1.5  # read [rows, 2 I], write [rows, I]
            res.append({
                "size": size, "silu": "scaled" if scaled else "plain", "block": block, "warps": warps,
                "us": 1e6 * t, "fraction_of_read_bound": nbytes / read_bps / t,
                "same_as_default": None if scaled else bool(torch.equal(got, base)),
            })  # fmt: skip
            print(json.dumps(res[-1]), flush=True)
    return res


def gemm_cases(size: str, rows: int, dev: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The step's GEMMs at ``rows`` rows as the step runs them, and split-K into float32 partials."""
    from rlkube.runtime.rollout.hf_decode import split_k_partials

    hidden, qkv_out, inter = {"0.5b": (896, 1152, 4864), "1.5b": (1536, 2048, 8960)}[size]

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype) * scale

    x, att, h = rand(rows, hidden), rand(rows, hidden), rand(rows, inter)
    w_qkv, b_qkv, w_o = rand(qkv_out, hidden, scale=0.02), rand(qkv_out), rand(hidden, hidden, scale=0.02)
    w_gu, w_down = rand(2 * inter, hidden, scale=0.02), rand(hidden, inter, scale=0.02)
    linear = torch.nn.functional.linear
    return {
        "qkv-bias": functools.partial(linear, x, w_qkv, b_qkv),
        "qkv-nobias": functools.partial(linear, x, w_qkv),
        "qkv-split2": functools.partial(split_k_partials, x, w_qkv, 2),
        "o-addmm": functools.partial(x.addmm_, att, w_o.t()),  # the residual as C, as the step
        "o-split2": functools.partial(split_k_partials, att, w_o, 2),
        "o-split4": functools.partial(split_k_partials, att, w_o, 4),
        "gate-up": functools.partial(linear, x, w_gu),
        "down-split2": functools.partial(split_k_partials, h, w_down, 2),
    }


def bench_gemm(args: argparse.Namespace, dev: Any, read_bps: float) -> list[dict[str, Any]]:
    """Each of ``gemm_cases`` alone, replayed from a graph."""
    res = []
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    rows = 8 if args.smoke else args.rows
    for size in ("0.5b", "1.5b"):
        for name, fn in gemm_cases(size, rows, dev, dtype).items():
            times = common.timed_calls(fn, dev, 1 if args.smoke else 20, 1 if args.smoke else 5)
            res.append({"size": size, "gemm": name, "rows": rows, "us": 1e6 * statistics.median(times)})
            print(json.dumps(res[-1]), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--rows-list", default="512")
    ap.add_argument("--sizes", default="0.5b,1.5b")
    ap.add_argument("--contexts", default="192,700")
    ap.add_argument(
        "--cold-bytes", type=int, default=1 << 30, help="bytes of cache copies the timed calls cycle through"
    )
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--parts", default="attention,silu")
    ap.add_argument("--old-kernels", default="", help="another checkout's runtime/rollout/kernels.py")
    args = ap.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.variants = args.variants.split(",")
    args.rows_list = [int(r) for r in args.rows_list.split(",")]
    if args.old_kernels:
        OLD_KERNELS.append(args.old_kernels)
    elif "old" in args.variants:
        args.variants.remove("old")
    dev = torch.device("cpu" if args.smoke else "cuda")
    ceil = common.ceilings(dev, args.smoke)
    report: dict[str, Any] = {"benchmark": "attention-variants-gpu", **common.run_info(dev, ceil, args)}
    read_bps = ceil["read_bandwidth_gbs"] * 1e9
    out = os.environ.get("OUT")
    for part in args.parts.split(","):
        fn = {"attention": bench_attention, "silu": bench_silu, "gemm": bench_gemm}[part]
        report[part] = fn(args, dev, read_bps)
        if out:
            Path(out, "attention-variants-gpu.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
