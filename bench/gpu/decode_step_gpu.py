"""One decode step of the hf engine's ``StaticDecoder`` per attention configuration (A/B on one GPU).

Where ``rollout_gpu.py`` times whole ``generate`` calls, this times the captured decode step alone
(graph replays from a fixed context), so a choice the step makes rests on a measurement: here the
attention kernel's split (positions per program; ``direct`` is one program per row and KV head and
no combine kernel). Random-init Qwen2 with Qwen2.5-0.5B / 1.5B shapes, bf16.

    python bench/gpu/decode_step_gpu.py                       # GPU: 0.5b and 1.5b, 64 and 512 rows
    python bench/gpu/decode_step_gpu.py --sizes 0.5b --rows 64 --context 192
    python bench/gpu/decode_step_gpu.py --compile auto,max-autotune --configs default   # GEMM autotune A/B
    TRITON_INTERPRET=1 python bench/gpu/decode_step_gpu.py --smoke   # CPU, tiny shapes (tested in CI)

Writes JSON to stdout and to ``$OUT/decode-step-gpu.json`` when ``$OUT`` is set (rewritten after
every part, so a run cut short keeps what it measured). First the quick parts: the sampling kernel
alone, each of its settings on the same random-normal and Zipf-shaped logits (what its block
skipping and its screen save on a trained model's logits; ``--sizes ""`` stops after these), and a
graph capture that CUDA aborts (the engine must decode on and leave the device's random numbers
usable). Then each entry has the step time (median of ``--repeats``
timings of ``--steps`` replays), its fraction of the step's bound (``roofline.decode_step_bytes`` /
``decode_step_flops`` against the read bandwidth and GEMM rate measured in the same run, as
``rollout_gpu.py``), the ratio to the first configuration of the same shape and, with several
``--compile`` settings, to the first setting.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location("rlkube_bench_common", Path(__file__).with_name("_common.py"))
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
common.import_rlkube()

import torch  # noqa: E402

from rlkube.runtime.models.roofline import decode_step_bytes, decode_step_flops, model_cost  # noqa: E402
from rlkube.runtime.models.tiny import make_qwen2_like, tiny_qwen2_config  # noqa: E402
from rlkube.runtime.rollout.decode_linear import gated_launch  # noqa: E402
from rlkube.runtime.rollout.hf_decode import (  # noqa: E402
    DOWN_SPLIT_K,
    LINEAR_MAX_ROWS_DEFAULT,
    StaticDecoder,
    auto_down_split_min_rows,
)

# name -> settings of the attention kernel: ``split`` (positions per program; None for the default
# policy, "direct" for one program per row and KV head and no combine kernel), ``shared`` (each
# group of 8 rows reads its first that many positions from the group's first row, as the samples of
# one prompt do), ``block_n`` (positions per inner-loop block) and ``launch`` (Triton's num_warps /
# num_stages: how many programs fit on an SM, how deep the loads are pipelined); ``silu``:
# "inductor" computes the MLP's silu(gate) * up inside inductor's compiled layer_mlp_in, as before
# the decoder took kernels.silu_mul; ``blas``: the GEMM library torch prefers while the step is
# captured ("cublaslt": cuBLASLt's heuristics, not cuBLAS's); ``tail``: "eager" runs the step's
# tail (the seeds' hash, the final norm) uncompiled, as before stop 27
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "direct": {"split": "direct"},
    "split128": {"split": 128},
    "split256": {"split": 256},
    "shared64": {"shared": 64},
    "warps8": {"launch": {"num_warps": 8}},
    "stages2": {"launch": {"num_stages": 2}},
    "stages4": {"launch": {"num_stages": 4}},
    "block32": {"block_n": 32},
    "block128": {"block_n": 128, "launch": {"num_stages": 2}},
    "silu-inductor": {"silu": "inductor"},
    "cublaslt": {"blas": "cublaslt"},
    "eager-tail": {"tail": "eager"},
    # the fused linear kernel (``decode_linear``; the engine's default row limit is
    # hf_decode.LINEAR_MAX_ROWS_DEFAULT, which ``default`` follows): off (cuBLAS and the compiled
    # norms / Triton SiLU around it), on for all the step's rows with the kernel's policy, or on
    # with launch settings (TritonSmallLinear.launch: output columns per program ``bn``, K block
    # ``bk``, programs aimed at per SM, warps)
    "cublas": {"linear": "off"},
    "linear": {"linear": {}},
    "lin-bn32": {"linear": {"bn": 32}},
    "lin-bn64": {"linear": {"bn": 64}},
    "lin-bk64": {"linear": {"bk": 64}},
    "lin-2x": {"linear": {"programs_per_sm": 2}},
    "lin-w8": {"linear": {"num_warps": 8}},
    # the down GEMM split-K (hf_decode.split_k_partials) at every row count, in N slices of K
    # (the engine's default: hf_decode.auto_down_split_min_rows / DOWN_SPLIT_K), or never;
    # the partials summed inside the next norm's kernel, or ("-sep") by a kernel of their own
    "down-k2": {"down_split_k": 2},
    "down-k4": {"down_split_k": 4},
    "down-k8": {"down_split_k": 8},
    "down-k2-sep": {"down_split_k": 2, "down_split_fold": False},
    "down-k4-sep": {"down_split_k": 4, "down_split_fold": False},
    "down-off": {"down_split_k": 0},
    # gate/up + SiLU as one Triton GEMM with the SiLU in its epilogue, after the compiled norm
    # (hf_decode's gated_min_rows; decode_linear.gated_launch, or a LINEAR_VARIANTS launch)
    "gated": {"gated": {}},
    "gated-t64x128": {"gated": {"bm": 64, "bn": 128, "bk": 64, "num_warps": 4, "num_stages": 4}},
    "gated-t128x64": {"gated": {"bm": 128, "bn": 64, "bk": 64, "num_warps": 4, "num_stages": 4}},
}
DEFAULT_BLAS = torch.backends.cuda.preferred_blas_library()
GROUP = 8

CAPTURE_FAILURE_CHECKS = ("same_tokens", "graphs_off", "graph_error_recorded", "random_ops_work_after")


def time_step(dec: StaticDecoder, rows: int, context: int, steps: int, repeats: int) -> tuple[float, float]:
    """Median seconds per replayed step, every row at ``context`` positions when each timing starts,
    and the seconds of the first step (compile, when not done yet, and capture)."""
    s = dec.state
    s.pos[:rows] = context
    s.running[:rows] = True
    s.n_gen[:rows] = 0
    s.max_new[:rows] = dec.T
    s.temperature[:rows] = 1.0
    snap = dec._snapshot()
    common.sync(dec.device)
    t = time.perf_counter()
    dec.decode(rows)  # capture (and compile) outside the timings
    common.sync(dec.device)
    first = time.perf_counter() - t
    out = []
    for _ in range(repeats):
        dec._restore(snap)
        common.sync(dec.device)
        t = time.perf_counter()
        for _ in range(steps):
            dec.decode(rows)
        common.sync(dec.device)
        out.append((time.perf_counter() - t) / steps)
    return statistics.median(out), first


def configure(
    dec: StaticDecoder,
    name: str,
    default_split: Any,
    default_mlp_in: Any,
    default_tail: tuple[Any, Any],
    rows: int,
    context: int,
) -> None:
    cfg = CONFIGS[name]
    torch.backends.cuda.preferred_blas_library(cfg.get("blas", DEFAULT_BLAS))
    dec._mlp_in_fn = default_mlp_in
    dec._seeds_fn, dec._final_norm_fn = default_tail
    if cfg.get("tail") == "eager":
        from rlkube.runtime.rollout import kernels
        from rlkube.runtime.rollout.hf_decode import final_norm

        dec._seeds_fn, dec._final_norm_fn = kernels.row_seeds, final_norm
    if cfg.get("silu") == "inductor":
        from rlkube.runtime.rollout.hf_decode import layer_mlp_in

        dec._mlp_in_fn = torch.compile(layer_mlp_in) if dec.compiled else layer_mlp_in
    split, shared = cfg.get("split"), min(cfg.get("shared", 0), context)  # never past a row's position
    if dec._linear is not None:
        lin = cfg.get("linear")
        # on: for the step's rows whatever their count (at 512 rows, the kernel's 128-row tiles)
        dec.linear_max_rows = (
            dec.B if isinstance(lin, dict) else 0 if lin == "off" else LINEAR_MAX_ROWS_DEFAULT
        )
        dec._linear.launch = linear_launch(lin if isinstance(lin, dict) else {}, dec._linear.n_sm)
        dec.reserve_linear()
    if dec._gated is not None:
        gated = cfg.get("gated")
        dec.gated_min_rows = 1 if isinstance(gated, dict) else 0
        dec._gated.launch = {**gated_launch(dec._gated.hip), **(gated or {})}
        dec.reserve_linear()
    if "down_split_k" in cfg:
        k = cfg["down_split_k"]
        dec.down_split_min_rows, dec.down_split_k = (1, k) if k else (0, DOWN_SPLIT_K)
    else:
        inter = int(dec.model.config.intermediate_size)
        dec.down_split_min_rows = auto_down_split_min_rows(inter, dec.device.type)
        dec.down_split_k = DOWN_SPLIT_K
    dec.down_split_fold = cfg.get("down_split_fold", True)
    dec.drop_graphs()
    leaders = [r - r % GROUP for r in range(rows)]
    dec.set_shared_prompts(leaders, [shared if lead != r else 0 for r, lead in enumerate(leaders)])
    att = dec._attention
    att.block_n, att.launch = cfg.get("block_n", 64), cfg.get("launch")
    if split is None:
        att.split_for = default_split
    else:
        fixed = att.max_seq if split == "direct" else int(split)
        att.split_for = lambda rows, fixed=fixed: max(fixed, default_split(rows))


def linear_launch(cfg: dict[str, Any], n_sm: int) -> dict[str, int]:
    """TritonSmallLinear.launch from a config (``programs_per_sm`` becomes a program count)."""
    out = {k: int(v) for k, v in cfg.items() if k != "programs_per_sm"}
    if "programs_per_sm" in cfg:
        out["programs"] = int(cfg["programs_per_sm"] * n_sm)
    return out


def bench(
    size: str,
    rows: int,
    context: int,
    compile_step: str,
    args: argparse.Namespace,
    read_bps: float,
    flops: float,
) -> list[dict[str, Any]]:
    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:  # fp32 tiny model; the Triton kernels run in the interpreter
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        config = tiny_qwen2_config(64, hidden_size=128, num_heads=2)
        model = AutoModelForCausalLM.from_config(config).eval()
    else:
        model = make_qwen2_like(size, dtype=torch.bfloat16, device="cpu").to(dev)  # CPU init: no CUDA RNG
    dtype_bytes = torch.finfo(next(model.parameters()).dtype).bits // 8
    cost = model_cost(model.config, dtype_bytes=dtype_bytes)
    context_sum = rows * (context + args.steps // 2)  # the timed steps' mean context
    bound_s = max(
        decode_step_bytes(cost, rows, context_sum) / read_bps,
        decode_step_flops(cost, rows, context_sum) / flops,
    )
    dec = StaticDecoder(
        model, num_slots=rows, max_seq_len=context + args.steps + 8, max_new_tokens=args.steps + 4,
        compile_step=compile_step, kernels_setting=True, use_cuda_graphs=None, linear_max_rows=rows,
        gated_min_rows=1 if any("gated" in CONFIGS[c] for c in args.configs.split(",")) else 0,
    )  # fmt: skip
    default_split, default_mlp_in = dec._attention.split_for, dec._mlp_in_fn
    default_tail = (dec._seeds_fn, dec._final_norm_fn)
    res = []
    base = None
    for name in args.configs.split(","):
        configure(dec, name, default_split, default_mlp_in, default_tail, rows, context)
        try:
            t, first_s = time_step(dec, rows, context, args.steps, args.repeats)
        except Exception:
            res.append({
                "size": size, "rows": rows, "compile": compile_step, "config": name,
                "error": traceback.format_exc()[-3000:],
            })  # fmt: skip
            continue
        base = base or t
        res.append({
            "size": "tiny" if args.smoke else size, "rows": rows, "context": context,
            "linear": dec.kernels_used["linear"] if rows <= dec.linear_max_rows else "torch",
            "gated": dec.kernels_used["gated"] if 0 < dec.gated_min_rows <= rows else "torch",
            "compile": compile_step, "compiled": dec.compiled, "config": name,
            "step_ms": 1e3 * t, "first_step_s": first_s, "bound_ms": 1e3 * bound_s,
            "cuda_graphs": dec.use_graphs, "graph_error": (dec.graph_error or "")[-1500:] or None,
            "fraction_of_bound": bound_s / t, "speedup_vs_first": base / t,
            "split": dec._attention.split_for(rows),
        })  # fmt: skip
        print(json.dumps(res[-1]), flush=True)
    del dec, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


# the sampling kernel's settings timed side by side (same logits, same run); "default" is the
# policy (TritonSampler.chunk_for), the others fix the vocabulary entries per program
SAMPLER_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "no-screen": {"screen": False},
    # temperature-1 rows screen with the log-sum-exp's exponentials: each row checked (a branch per
    # block), or all rows taken to be at temperature 1 (the bench's are)
    "reuse-exp": {"reuse_exp": 1},
    "reuse-exp-all": {"reuse_exp": 2},
    "int-to-float": {"bitcast_uniform": False},  # the uniform from a conversion (until stop 36)
    "chunk4k": {"chunk": 4096},
    "chunk8k": {"chunk": 8192},
    "chunk16k": {"chunk": 16384},
    "chunk32k": {"chunk": 32768},
    "block1k": {"block": 1024},  # the default until stop 33 (on 4 warps)
    "block2k": {"block": 2048},
    # 16 entries per thread (stop 33: slower at 512 rows, 1,024-entry blocks 258.7 us, 2,048 292.6)
    "block1k-warps2": {"block": 1024, "warps": 2},
    # inverse-CDF sampling (other tokens for the same seeds: compared with its own first variant;
    # the chunk does not change a token, 4 warps would: another reduction tree in every block sum,
    # and were slower at stop 37, 110 against 82 us at 512 rows)
    "cdf": {"method": "cdf"},
    "cdf-chunk16k": {"method": "cdf", "chunk": 16384},
    "cdf-chunk32k": {"method": "cdf", "chunk": 32768},
}


def bench_sampler(
    rows: int, vocab: int, dev: torch.device, read_bps: float, repeats: int, calls: int = 20
) -> list[dict[str, Any]]:
    """The sampling kernel alone, each setting of SAMPLER_VARIANTS on the same logits, against the
    read of the bf16 logits it needs. Logits: random normal (a random-init model's), Zipf with
    exponent 1 (a heavy tail) and 2 (a trained model's peak)."""
    from rlkube.runtime.rollout import kernels

    g = torch.Generator().manual_seed(0)
    rank = torch.randperm(vocab, generator=g).float() + 1
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    shapes = {
        "normal": torch.randn(rows, vocab, generator=g) * 3,
        "zipf1": (-1.0 * rank.log()).expand(rows, -1).clone(),
        "zipf2": (-2.0 * rank.log()).expand(rows, -1).clone(),
    }
    samplers = {name: kernels.TritonSampler(rows, vocab, dev, **kw) for name, kw in SAMPLER_VARIANTS.items()}
    temp = torch.ones(rows, device=dev)
    seeds = kernels.row_seeds(torch.arange(rows), torch.zeros(rows, dtype=torch.long)).to(dev)
    out = []
    for shape, logits in shapes.items():
        x = logits.to(dev, dtype)
        want: dict[str, torch.Tensor] = {}  # per method, its first variant's tokens
        for name, sampler in samplers.items():
            tok, _ = sampler(x, temp, seeds)  # compiles
            first = want.setdefault(sampler.method, tok)
            same = bool((tok == first).all())
            times = common.timed_calls(
                lambda sampler=sampler, x=x: sampler(x, temp, seeds), dev, calls, repeats
            )
            t = statistics.median(times)
            bound = x.numel() * x.element_size() / read_bps
            out.append({
                "sampler": shape, "variant": name, "method": sampler.method, "chunk": sampler.chunk_for(rows),
                "rows": rows,
                "vocab": vocab, "us": 1e6 * t, "us_range": [1e6 * min(times), 1e6 * max(times)],
                "fraction_of_read_bound": bound / t, "same_tokens_as_first_variant": same,
            })  # fmt: skip
            print(json.dumps(out[-1]), flush=True)
    return out


# the attention kernel's launch settings timed alone (same inputs, same run): positions per inner
# block, Triton's num_warps / num_stages, a register cap per thread (``maxnreg``: more programs
# resident per SM, at the price of spills) and the split ("direct": one program per row and KV head)
ATTENTION_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},  # the kernel's policy (TritonDecodeAttention.launch_for)
    "w4s3": {"launch": {}},  # Triton's defaults everywhere (the policy until stop 28)
    "w4s2": {"launch": {"num_warps": 4, "num_stages": 2}},
    "w4s1": {"launch": {"num_warps": 4, "num_stages": 1}},
    "w2s2": {"launch": {"num_warps": 2, "num_stages": 2}},
    "w2s3": {"launch": {"num_warps": 2, "num_stages": 3}},
    "w8s2": {"launch": {"num_warps": 8, "num_stages": 2}},
    "w4s2r96": {"launch": {"num_warps": 4, "num_stages": 2, "maxnreg": 96}},
    "w4s2r80": {"launch": {"num_warps": 4, "num_stages": 2, "maxnreg": 80}},
    "w4s3r96": {"launch": {"num_warps": 4, "num_stages": 3, "maxnreg": 96}},
    "b32w4s2": {"block_n": 32, "launch": {"num_warps": 4, "num_stages": 2}},
    "b32w4s3": {"block_n": 32, "launch": {"num_warps": 4, "num_stages": 3}},
    "b32w2s3": {"block_n": 32, "launch": {"num_warps": 2, "num_stages": 3}},
    "b32w4s2r80": {"block_n": 32, "launch": {"num_warps": 4, "num_stages": 2, "maxnreg": 80}},
    "b32w4s2r64": {"block_n": 32, "launch": {"num_warps": 4, "num_stages": 2, "maxnreg": 64}},
    "b128w8s2": {"block_n": 128, "launch": {"num_warps": 8, "num_stages": 2}},
    "split64": {"split": 64},
    "split128": {"split": 128},
    "split256": {"split": 256},
    "split512": {"split": 512},
    "direct": {"split": "direct"},  # one program per row and KV head over its whole context
    "split64w4s2": {"split": 64, "launch": {"num_warps": 4, "num_stages": 2}},
    # the grouped kernel: one program per group of rows reading one prompt copy (hf_decode's
    # grouped_attention_min_rows), with Triton's defaults or 8 warps / 2 stages
    "grouped": {"grouped": {}},
    "grouped-w8": {"grouped": {"num_warps": 8}},
    "grouped-w8s2": {"grouped": {"num_warps": 8, "num_stages": 2}},
    "grouped-s2": {"grouped": {"num_stages": 2}},
}
# (rows, context of every row, cache length) per shape: today's job (64 rows), the batch-512 target,
# and long RL responses (contexts spread over [context / 2, 3 context / 2])
ATTENTION_SHAPES = {
    "b64": (64, 192, 384),
    "b512": (512, 192, 384),
    "b512-long": (512, 700, 1408),
    "b256-long": (256, 700, 1408),
    "b128-long": (128, 700, 1408),
    "b64-long": (64, 700, 1408),
}
# the caches are copied until the copies together hold this many bytes and every timed call reads
# the next copy: as in a decode step, where each layer reads its own cache, nothing is still in L2
# (50 MB on an H100) from the call before (until stop 42 every call read one copy: at 512 rows of
# 0.5B heads, 36 MB, the timing was mostly cache hits)
COLD_BYTES = 1 << 30


def bench_attention(
    n_heads: int,
    n_kv: int,
    d: int,
    dev: torch.device,
    read_bps: float,
    repeats: int,
    names: list[str],
    shapes: list[str],
    calls: int = 20,
) -> list[dict[str, Any]]:
    """The rope-attention kernel alone, each of ATTENTION_VARIANTS on the same inputs (groups of 8
    rows sharing a 64-position prompt, as a rollout's samples do), against the read of the bytes it
    needs: each group's prompt K/V once, every row's own K/V, the q/k/v rows, the output. The calls
    cycle through copies of the caches (``COLD_BYTES``), so each reads from memory, not L2."""
    from rlkube.runtime.rollout import kernels

    group = n_heads // n_kv
    out: list[dict[str, Any]] = []
    for shape in shapes:
        rows, context, seq = ATTENTION_SHAPES[shape]
        if dev.type == "cpu":
            rows, context, seq = 8, 40, 128
        inp = common.DecodeAttentionInputs(
            rows, n_heads, n_kv, d, context, seq, dev, mixed="long" in shape, group=GROUP
        )
        caches = inp.cache_copies(COLD_BYTES)
        needed = inp.needed_bytes
        want = None
        for name in names:
            cfg = ATTENTION_VARIANTS[name]
            att = kernels.TritonDecodeAttention(rows, n_kv, group, d, seq, dev)
            att.block_n, att.launch = cfg.get("block_n", 64), cfg.get("launch")
            split = cfg.get("split")
            groups = None
            if "grouped" in cfg:
                att.grouped_min_rows, att.grouped_launch = 1, cfg["grouped"]
                table = kernels.attention_group_tensors(
                    inp.lead.tolist(), inp.shared.tolist(), rows, att.members, att.block_n
                )
                groups = tuple(t.to(dev) for t in table)

            split = att.max_seq if split == "direct" else split
            each = [
                functools.partial(
                    att.rope_attend, inp.qkv, inp.cos, inp.ssin, inp.pos, k, v, n_heads, split=split,
                    share_row=inp.lead, share_len=inp.shared, groups=groups,
                )
                for k, v in caches
            ]  # fmt: skip
            call = common.cycling(each)  # the next copy of the caches each time

            try:
                got = each[0]().float()
                times = common.timed_calls(call, dev, calls * len(each), repeats)
            except Exception as exc:
                err = f"{type(exc).__name__}: {exc}"[:1500]
                out.append({"attention": shape, "variant": name, "error": err})
                print(json.dumps(out[-1]), flush=True)
                continue
            want = got if want is None else want
            t = statistics.median(times)
            out.append({
                "attention": shape, "variant": name, "heads": n_heads, "kv_heads": n_kv, "head_dim": d,
                "rows": rows, "mean_context": float(inp.host_pos.float().mean()), "cache_copies": len(caches),
                "split": split or att.split_for(rows),
                "us": 1e6 * t, "us_range": [1e6 * min(times), 1e6 * max(times)], "bytes_needed": needed,
                "fraction_of_read_bound": needed / read_bps / t,
                "max_abs_diff_vs_first": float((got - want).abs().max()),
            })  # fmt: skip
            print(json.dumps(out[-1]), flush=True)
    return out


def capture_failure_check(dev: torch.device) -> dict[str, Any]:
    """A decode step that CUDA refuses to capture (a host sync inside it): the engine must record
    why, decode the same tokens without graphs, and leave the device's random numbers usable (in
    torch 2.11 an aborted capture otherwise breaks every later eager random op in the process,
    a colocated trainer's included)."""
    if dev.type != "cuda":
        return {"ran": False, "why": "needs a CUDA or ROCm device"}
    from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams
    from rlkube.runtime.rollout.hf import HFEngine

    def make_model() -> Any:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_qwen2_config(64, hidden_size=128, num_heads=2)).to(dev)

    reqs = [RolloutRequest("r", [1, 2, 3], SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=3))]
    with HFEngine(model=make_model(), num_slots=4, max_seq_len=64, cuda_graphs=False) as eng:
        want = [c.token_ids for c in eng.generate(reqs)]
    out: dict[str, Any] = {"ran": True, "torch": torch.__version__}
    with HFEngine(model=make_model(), num_slots=4, max_seq_len=64) as eng:
        dec = eng.decoder
        step = dec._decode_step

        def step_with_host_sync(nb: int, kv_len: int) -> None:
            if torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize()  # not allowed while capturing: CUDA aborts the capture
            step(nb, kv_len)

        dec._decode_step = step_with_host_sync
        got = [c.token_ids for c in eng.generate(reqs)]
        out["same_tokens"] = got == want
        out["graphs_off"] = not dec.use_graphs
        out["graph_error_recorded"] = bool(dec.graph_error)
        out["graph_error_tail"] = (dec.graph_error or "")[-400:]
    try:
        torch.randn(1024, device=dev).sum().item()
        out["random_ops_work_after"] = True
    except RuntimeError as exc:
        out["random_ops_work_after"] = False
        out["random_error"] = str(exc)[-400:]
    print(json.dumps({"capture_failure": out}), flush=True)
    return out


def _torch_variant(kind: str) -> Any:
    """Another cuBLAS formulation of one decode layer: ``wt`` multiplies by the weight stored
    transposed ([in, out], so cuBLAS runs NN instead of TN and picks from other kernels);
    ``mm-add`` writes the product and adds it to the residual in a second kernel; ``split2``
    runs the residual GEMM as two halves of K; ``bmmN`` (o and down) runs it as one batched GEMM
    over N slices of K into float32 partials, summed into the residual by one compiled kernel
    (split-K: N times the output tiles, so a few hundred rows fill the GPU); ``autotune`` is
    inductor's max-autotune (its Triton templates against cuBLAS) on the layer's function."""

    def build(layer: str, h: Any, w: Any, w_t: Any, res: Any, norm: Any, b_qkv: Any, silu: Any) -> Any:
        import torch.nn.functional as F

        from rlkube.runtime.rollout import hf_decode

        wt = w_t if kind == "wt" else w.t()
        if kind == "gemm-only":  # the gate/up GEMM without its SiLU: what fusing the SiLU can reach
            if layer != "gated":
                raise ValueError("gemm-only is the floor of the gated layer")
            return lambda: F.linear(h, w)
        if layer == "gated":
            if kind == "wt":
                return lambda: silu(torch.mm(h, wt))
            if kind == "autotune":
                gemm = torch.compile(F.linear, mode="max-autotune-no-cudagraphs")
                return lambda: silu(gemm(h, w))
            raise ValueError(f"{kind} is not a formulation of the gated layer")
        if kind == "autotune":
            mode = "max-autotune-no-cudagraphs"
            if layer == "q/k/v":
                qkv = torch.compile(hf_decode.layer_qkv, mode=mode)
                return lambda: qkv(h, (norm, w, b_qkv), 1e-6)
            if layer == "gate/up":
                gu = torch.compile(hf_decode.layer_gate_up, mode=mode)
                return lambda: silu(gu(h, norm, w, 1e-6))
            resid = torch.compile(hf_decode.residual_linear_, mode=mode)
            return lambda: resid(res, h, w, None)
        if kind.startswith("bmm"):
            if layer in ("q/k/v", "gate/up"):
                raise ValueError(f"{kind} is for the residual GEMMs (o, down)")
            splits = int(kind[3:])
            if h.shape[1] % splits:
                raise ValueError(f"K={h.shape[1]} does not split into {splits}")
            add = torch.compile(hf_decode.add_partials_) if h.is_cuda else hf_decode.add_partials_
            return lambda: hf_decode.residual_split_k_(res, h, w, None, splits, add)
        if layer == "q/k/v":
            return lambda: torch.addmm(b_qkv, F.rms_norm(h, (h.shape[-1],), norm, 1e-6), wt)
        if layer == "gate/up":
            return lambda: silu(torch.mm(F.rms_norm(h, (h.shape[-1],), norm, 1e-6), wt))
        if kind == "mm-add":
            return lambda: res.add_(torch.mm(h, wt))
        if kind == "split2":
            k = h.shape[1] // 2
            return lambda: res.addmm_(h[:, :k], wt[:k]).addmm_(h[:, k:], wt[k:])
        return lambda: res.addmm_(h, wt)

    return build


TORCH_VARIANTS: dict[str, Any] = {
    k: _torch_variant(k)
    for k in ("wt", "mm-add", "split2", "bmm2", "bmm4", "bmm5", "bmm8", "autotune", "gemm-only")
}

# the layers --linear times: the step's four, and "gated" (gate/up + SiLU after a separate norm)
LINEAR_LAYERS = ("q/k/v", "o", "gate/up", "down", "gated")

# the small-batch linear kernel's launch settings timed alone, per layer (TritonSmallLinear.launch)
LINEAR_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},  # the policy (TritonSmallLinear.plan)
    "bn16": {"bn": 16},
    "bn32": {"bn": 32},
    "bn64": {"bn": 64},
    "bn128": {"bn": 128},
    "bk64": {"bk": 64},
    "bk256": {"bk": 256, "num_stages": 2},
    "half": {"programs_per_sm": 0.5},
    "2x": {"programs_per_sm": 2},
    "4x": {"programs_per_sm": 4},
    "w8": {"num_warps": 8},
    "s2": {"num_stages": 2},
    "s4": {"num_stages": 4},
    # for large batches: 128 x 128 output tiles, 64-wide K blocks, 8 warps
    "t128": {"bm": 128, "bn": 128, "bk": 64, "num_warps": 8, "num_stages": 3},
    "t128s4": {"bm": 128, "bn": 128, "bk": 64, "num_warps": 8, "num_stages": 4},
    "t64x128": {"bm": 64, "bn": 128, "bk": 64, "num_warps": 4, "num_stages": 4},
    "t128x64": {"bm": 128, "bn": 64, "bk": 64, "num_warps": 4, "num_stages": 4},
    "t128x64w8": {"bm": 128, "bn": 64, "bk": 64, "num_warps": 8, "num_stages": 3},
    "t128k32": {"bm": 128, "bn": 128, "bk": 32, "num_warps": 8, "num_stages": 5},
    "t64x256": {"bm": 64, "bn": 256, "bk": 64, "num_warps": 8, "num_stages": 3},
}


def bench_linear(
    size: str,
    rows: int,
    dev: torch.device,
    read_bps: float,
    repeats: int,
    names: list[str],
    calls: int = 20,
    gemm_fps: float = 0.0,
    layer_names: tuple[str, ...] = LINEAR_LAYERS,
) -> list[dict[str, Any]]:
    """Each linear layer of a decode step alone at ``rows`` rows: the step's cuBLAS path (the
    compiled norm + GEMM, Triton's SiLU, the residual GEMM) against the fused kernel in each of
    LINEAR_VARIANTS and the other cuBLAS formulations in TORCH_VARIANTS, as microseconds per call
    and against reading the weights and activations and against the GEMM rate of this run."""
    import torch.nn.functional as F

    from rlkube.runtime.models.tiny import qwen2_like_config
    from rlkube.runtime.rollout import decode_linear, hf_decode, kernels

    tiny = tiny_qwen2_config(64, hidden_size=128, num_heads=2)
    cfg = qwen2_like_config(size) if dev.type == "cuda" else tiny
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    h, inter = cfg.hidden_size, cfg.intermediate_size
    n_att = cfg.num_attention_heads * (h // cfg.num_attention_heads)
    n_qkv = n_att + 2 * cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    x, att, hid = rand(rows, h), rand(rows, n_att), rand(rows, inter)
    res0, norm = rand(rows, h), rand(h, scale=0.1) + 1
    xn = F.rms_norm(x, (h,), norm, 1e-6)
    res = res0.clone()  # the residual stream o and down add into (in place)
    w_qkv, b_qkv, w_o = rand(n_qkv, h, scale=0.02), rand(n_qkv), rand(h, n_att, scale=0.02)
    w_gu, w_down = rand(2 * inter, h, scale=0.02), rand(h, inter, scale=0.02)
    compiled = dev.type == "cuda"
    qkv_fn = torch.compile(hf_decode.layer_qkv) if compiled else hf_decode.layer_qkv
    gate_up = torch.compile(hf_decode.layer_gate_up) if compiled else hf_decode.layer_gate_up
    silu = kernels.silu_mul if kernels.HAVE_TRITON else kernels.silu_mul_ref
    el = x.element_size()
    # (layer, the step's unfused call, the kernel's call, bytes it must move: weights, inputs, outputs)
    layers: list[tuple[str, Any, Any, int]] = [
        ("q/k/v", lambda: qkv_fn(x, (norm, w_qkv, b_qkv), 1e-6),
         lambda lin: lin(x, w_qkv, norm=norm, eps=1e-6, bias=b_qkv),
         (w_qkv.numel() + rows * (h + n_qkv)) * el),
        ("o", lambda: hf_decode.residual_linear_(res, att, w_o, None),
         lambda lin: lin(att, w_o, out=res), (w_o.numel() + rows * (n_att + 2 * h)) * el),
        ("gate/up", lambda: silu(gate_up(x, norm, w_gu, 1e-6)),
         lambda lin: lin(x, w_gu, norm=norm, eps=1e-6, gated=True), (w_gu.numel() + rows * (h + inter)) * el),
        ("down", lambda: hf_decode.residual_linear_(res, hid, w_down, None),
         lambda lin: lin(hid, w_down, out=res), (w_down.numel() + rows * (inter + 2 * h)) * el),
        # gate/up from an input already normed (the norm left to its own compiled kernel): cuBLAS
        # then Triton's SiLU against the kernel's GEMM with SiLU in its epilogue
        ("gated", lambda: silu(F.linear(xn, w_gu)),
         lambda lin: lin(xn, w_gu, gated=True), (w_gu.numel() + rows * (h + inter)) * el),
    ]  # fmt: skip
    layers = [entry for entry in layers if entry[0] in layer_names]
    shapes = decode_linear.decode_layer_shapes(h, inter, n_att, n_qkv)
    shapes["gated"] = shapes["gate/up"]
    weights = {"q/k/v": w_qkv, "o": w_o, "gate/up": w_gu, "down": w_down, "gated": w_gu}
    inputs = {"q/k/v": x, "o": att, "gate/up": x, "down": hid, "gated": xn}
    out: list[dict[str, Any]] = []
    for layer, unfused, fused, needed in layers:
        entries: list[tuple[str, Any]] = [("cublas", unfused)]
        w_t = weights[layer].t().contiguous()  # [in, out]: cuBLAS's other operand order
        for name in names:
            if name in TORCH_VARIANTS:
                try:
                    entries.append((name, TORCH_VARIANTS[name](layer, inputs[layer], weights[layer], w_t, res,
                                                               norm, b_qkv, silu)))  # fmt: skip
                except ValueError as exc:  # a variant that does not apply to this layer or shape
                    out.append({"linear": layer, "size": size, "rows": rows, "variant": name,
                                "skipped": str(exc)})  # fmt: skip
                continue
            lin = decode_linear.TritonSmallLinear(dev)
            lin.launch = linear_launch(LINEAR_VARIANTS[name], lin.n_sm)
            lin.reserve(rows, *shapes[layer])
            entries.append((name, functools.partial(fused, lin)))
        base, want = None, None
        for name, call in entries:
            try:
                res.copy_(res0)
                t_first = time.perf_counter()
                got = call()
                got = (res if got is None else got).float()  # the output of one call from the same residual
                first_s = time.perf_counter() - t_first
                want = got if want is None else want
                times = common.timed_calls(call, dev, calls, repeats)
            except Exception as exc:
                out.append({"linear": layer, "variant": name, "error": f"{type(exc).__name__}: {exc}"[:1500]})
                print(json.dumps(out[-1]), flush=True)
                continue
            t = statistics.median(times)
            base = base or t
            out.append({
                "linear": layer, "size": size, "rows": rows, "variant": name, "us": 1e6 * t,
                "us_range": [1e6 * min(times), 1e6 * max(times)], "bytes_needed": needed,
                "first_call_s": first_s,
                "fraction_of_read_bound": needed / read_bps / t, "speedup_vs_cublas": base / t,
                "fraction_of_gemm_rate": 2 * rows * weights[layer].numel() / gemm_fps / t if gemm_fps else 0,
                "max_rel_diff_vs_cublas": (  # none for a variant of another shape (gemm-only)
                    float((got - want).abs().max() / want.abs().max()) if got.shape == want.shape else None
                ),
            })  # fmt: skip
            print(json.dumps(out[-1]), flush=True)
    return out


def print_sampler(report: dict[str, Any]) -> None:
    for r in report["sampler"]:
        print(
            f"sampler {r['sampler']:<7} {r['variant']:<16} rows {r['rows']:>4}: {r['us']:8.1f} us, "
            f"{100 * r['fraction_of_read_bound']:5.1f}% of the logits' read bound"
            + ("" if r["same_tokens_as_first_variant"] else "  DIFFERENT TOKENS")
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sizes", default="0.5b,1.5b")
    ap.add_argument("--rows", default="64,512")
    ap.add_argument("--context", type=int, default=192, help="positions in the KV cache of every row")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument(
        "--compile", default="auto",
        help="compile_step settings to compare, e.g. auto,max-autotune (each builds its own decoder)",
    )  # fmt: skip
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--no-capture-check", dest="capture_check", action="store_false")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--attention", default="",
        help="attention variants to time alone (comma-separated names of ATTENTION_VARIANTS, or 'all')",
    )  # fmt: skip
    ap.add_argument("--attention-shapes", default=",".join(ATTENTION_SHAPES))
    ap.add_argument(
        "--linear", default="",
        help="small-batch linear variants to time alone per layer (names of LINEAR_VARIANTS, or 'all')",
    )  # fmt: skip
    ap.add_argument("--linear-rows", default="64,8", help="rows of the --linear timings")
    ap.add_argument("--linear-layers", default=",".join(LINEAR_LAYERS), help="layers of the --linear timings")
    ap.add_argument("--sampler-only", action="store_true", help="the sampling kernel's variants, then stop")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU (run with TRITON_INTERPRET=1)"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.sizes, args.rows, args.context, args.steps, args.repeats = "tiny", "8", 40, 4, 1
        torch.set_num_threads(1)
    dev = torch.device("cpu" if args.smoke else "cuda")
    ceil = common.ceilings(dev, args.smoke)
    report: dict[str, Any] = {
        "benchmark": "decode-step-gpu",
        **common.run_info(dev, ceil, args),
        "results": [],
    }
    out_dir = os.environ.get("OUT")

    def save() -> None:  # after every part, so a run cut short still leaves what it measured
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "decode-step-gpu.json").write_text(json.dumps(report, indent=2) + "\n")

    # the quick parts first
    vocab = 4096 if args.smoke else 151936  # Qwen2.5's
    report["sampler"] = [
        r
        for rows in (int(r) for r in args.rows.split(","))
        for r in bench_sampler(
            rows, vocab, dev, ceil["read_bandwidth_gbs"] * 1e9, args.repeats, calls=1 if args.smoke else 20
        )
    ]
    if args.sampler_only:
        save()
        print_sampler(report)
        return 0
    if args.attention:
        names = list(ATTENTION_VARIANTS) if args.attention == "all" else args.attention.split(",")
        report["attention"] = []
        # Qwen2.5-0.5B: 14 query heads on 2 KV heads of 64; 1.5B: 12 on 2 of 128
        for n_heads, n_kv, d in ((14, 2, 64), (12, 2, 128)) if not args.smoke else ((2, 1, 64),):
            report["attention"] += bench_attention(
                n_heads, n_kv, d, dev, ceil["read_bandwidth_gbs"] * 1e9, args.repeats, names,
                args.attention_shapes.split(","), calls=1 if args.smoke else 20,
            )  # fmt: skip
            save()
    if args.linear:
        names = [*LINEAR_VARIANTS, *TORCH_VARIANTS] if args.linear == "all" else args.linear.split(",")
        report["linear"] = []
        for size in ("0.5b", "1.5b") if not args.smoke else ("tiny",):
            for rows in (int(r) for r in args.linear_rows.split(",")):
                report["linear"] += bench_linear(
                    size, rows, dev, ceil["read_bandwidth_gbs"] * 1e9, args.repeats, names,
                    calls=1 if args.smoke else 20, gemm_fps=ceil["gemm_tflops"] * 1e12,
                    layer_names=tuple(args.linear_layers.split(",")),
                )  # fmt: skip
                save()
    report["capture_failure"] = (
        capture_failure_check(dev) if args.capture_check else {"ran": False, "why": "--no-capture-check"}
    )
    save()
    first_setting = args.compile.split(",")[0]
    for size in filter(None, args.sizes.split(",")):  # --sizes "": the quick parts only
        for rows in (int(r) for r in args.rows.split(",")):
            for setting in args.compile.split(","):
                report["results"] += bench(
                    size, rows, args.context, setting, args,
                    ceil["read_bandwidth_gbs"] * 1e9, ceil["gemm_tflops"] * 1e12,
                )  # fmt: skip
                ok = [r for r in report["results"] if "error" not in r]
                timed = {(r["size"], r["rows"], r["config"], r["compile"]): r for r in ok}
                for (sz, nr, config, _setting), r in timed.items():
                    ref = timed.get((sz, nr, config, first_setting))
                    if ref is not None:  # the same step under the first compile setting, in this run
                        r["speedup_vs_first_compile"] = ref["step_ms"] / r["step_ms"]
                save()
    for r in report["results"]:
        if "error" in r:
            print(f"{r['size']:>5} rows {r['rows']:>4} {r['compile']:<12} {r['config']:<10} {r['error']}")
        else:
            print(
                f"{r['size']:>5} rows {r['rows']:>4} {r['compile']:<12} {r['config']:<10} "
                f"{r['step_ms']:7.3f} ms {100 * r['fraction_of_bound']:5.1f}% of bound  "
                f"x{r['speedup_vs_first']:.2f}  split {r['split']}  first step {r['first_step_s']:.1f} s"
            )
    print_sampler(report)
    for r in report.get("attention", []):
        if "error" in r:
            print(f"attention {r['attention']:<10} {r['variant']:<12} {r['error'][:200]}")
        else:
            print(
                f"attention D={r['head_dim']:<3} {r['attention']:<10} {r['variant']:<12}: {r['us']:7.1f} us, "
                f"{100 * r['fraction_of_read_bound']:5.1f}% of its read bound, "
                f"max diff vs first {r['max_abs_diff_vs_first']:.3g}"
            )
    for r in report.get("linear", []):
        if "skipped" in r:
            continue
        if "error" in r:
            print(f"linear {r['linear']:<8} {r['variant']:<8} {r['error'][:200]}")
        else:
            print(
                f"linear {r['size']:>4} rows {r['rows']:>3} {r['linear']:<8} {r['variant']:<8}: "
                f"{r['us']:7.1f} us, {100 * r['fraction_of_read_bound']:5.1f}% of its read bound, "
                + f"{100 * r['fraction_of_gemm_rate']:5.1f}% of GEMM rate, "
                + f"x{r['speedup_vs_cublas']:.2f} vs cuBLAS (max diff {r['max_rel_diff_vs_cublas'] or 0:.2g})"
            )
    cf = report["capture_failure"]
    recovered = not cf["ran"] or all(cf[k] for k in CAPTURE_FAILURE_CHECKS)
    print(f"aborted graph capture: {'recovers' if recovered else 'DOES NOT RECOVER'} {cf}")
    differ = any(not r["same_tokens_as_first_variant"] for r in report["sampler"])
    return 1 if any("error" in r for r in report["results"]) or not recovered or differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
