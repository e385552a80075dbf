"""Rollout decode speed on one GPU: the hf engine against the honest bound (and ``generate``).

Random-init Qwen2 with Qwen2.5-0.5B / 1.5B shapes, bf16, no stop tokens (lengths are set by each
sample's ``max_tokens``), one process, no Ray, no vLLM. Three shapes:

- ``b64``: today's GRPO job, 8 prompts x 8 samples, 64-token prompts, 256 new tokens each;
- ``b512``: 64 prompts x 8 samples, same lengths (the batch-512 decode target);
- ``rl``: 64 prompts x 8 samples, prompts of 64-320 tokens and responses of 32-1,024 tokens drawn
  per sample (``_common.draw_rl_lengths``): samples finish at their own lengths, as with EOS.

The bound: the same run measures the device's read bandwidth (a read-only float32 sum over 4 GiB)
and dense bf16 GEMM rate (8192^3 on random data); ``rlkube.runtime.models.roofline.rollout_bound``
sums, over every decode step, ``max(bytes / read bandwidth, FLOPs / GEMM rate)`` with the bytes a
step must move (weights once, the KV of every live sample over its context, logits) and adds one
prefill per distinct prompt. ``fraction_of_bound`` = bound time / measured time of the whole
``generate`` call (prefill, admission and host work included). ``fraction_of_unique_read_bound``
uses the tighter bound that reads each prompt's K/V once per group of samples, as the engine's
prompt sharing (``--share-prompt on``, the default) lets the attention kernel do.

    python bench/gpu/rollout_gpu.py                  # GPU: 0.5b and 1.5b, all shapes
    python bench/gpu/rollout_gpu.py --smoke          # CPU: tiny shapes, seconds (tested in CI)

Writes JSON to stdout and to ``$OUT/rollout-gpu.json`` when ``$OUT`` is set (``--profile`` also
writes kernel tables of the b64 and b512 decode to ``$OUT/rollout-profile.txt``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import os
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
from torch._dynamo.utils import counters  # noqa: E402

from rlkube.runtime.models.roofline import model_cost, rollout_bound  # noqa: E402
from rlkube.runtime.models.tiny import make_qwen2_like, tiny_qwen2_config  # noqa: E402
from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams  # noqa: E402
from rlkube.runtime.rollout.hf import HFEngine, teacher_forced_logprobs  # noqa: E402
from rlkube.runtime.rollout.hf_decode import (  # noqa: E402
    DOWN_SPLIT_K,
    FOLD_MLP_NORM_DEFAULT,
    GATED_MIN_ROWS_DEFAULT,
    GROUPED_ATTENTION_MIN_ROWS_DEFAULT,
    LINEAR_MAX_ROWS_DEFAULT,
    SAMPLING_DEFAULT,
)

# launch options of the grouped attention kernel (``--grouped-launch``): Triton's defaults (4
# warps, 3 stages), 8 warps, 8 warps and 2 stages
GROUPED_LAUNCHES: dict[str, dict[str, int]] = {
    "default": {},
    "w8": {"num_warps": 8},
    "w8s2": {"num_warps": 8, "num_stages": 2},
}


def reset_peak(dev: torch.device) -> None:
    """Peak-memory counters from here. The allocator keeps the blocks the warm-up call left, as
    it does from one step of a training loop to the next; until stop 27 its cache was emptied
    here, so the timed call allocated its prefill's activations afresh (``cudaMalloc``)."""
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


def shape_lengths(shape: str, args: argparse.Namespace, seed: int) -> tuple[list[int], list[int], int]:
    """(prompt length per prompt, response length per sample, samples per prompt)."""
    if shape == "b64":
        p, s = args.prompts, args.samples
        return [args.prompt_len] * p, [args.new_tokens] * (p * s), s
    if shape == "b512":
        p, s = args.rl_prompts, args.samples
        return [args.prompt_len] * p, [args.new_tokens] * (p * s), s
    if shape == "rl":
        p_lens, r_lens = common.draw_rl_lengths(
            args.rl_prompts, args.samples, args.rl_max_response, seed=seed
        )
        if args.smoke:
            p_lens = [max(2, x // 16) for x in p_lens]
        return p_lens, r_lens, args.samples
    raise ValueError(shape)


def make_requests(
    tag: str, vocab: int, p_lens: list[int], r_lens: list[int], samples: int, seed: int
) -> list[Any]:
    """One request per sample (its own ``max_tokens``); a prompt's samples share one prefill."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i, plen in enumerate(p_lens):
        prompt = torch.randint(4, vocab, (plen,), generator=g).tolist()
        for k in range(samples):
            n = r_lens[i * samples + k]
            params = SamplingParams(
                n=1, temperature=1.0, top_p=1.0, max_tokens=n, seed=seed * 100003 + i * 97 + k
            )
            reqs.append(RolloutRequest(f"{tag}{i}_{k}", prompt, params))
    return reqs


class GcPauses:
    """A ``gc.callbacks`` entry adding up the collector's pauses (they stall the engine's loop)."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t = 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.count, self.seconds = self.count + 1, self.seconds + time.perf_counter() - self._t


def run_engine(model: Any, shape: str, args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    p_lens, r_lens, samples = shape_lengths(shape, args, seed=1)
    warm_p, warm_r, _ = shape_lengths(shape, args, seed=2)  # same distribution, other draws
    vocab = model.config.vocab_size
    batch = len(r_lens)
    max_seq = max(max(p_lens) + max(r_lens), max(warm_p) + max(warm_r)) + 1
    t0 = time.perf_counter()
    engine = HFEngine(
        model=model,
        num_slots=batch,
        max_seq_len=max_seq,
        sync_every=args.sync_every,
        flag_lag=args.flag_lag,
        sampling=args.sampling or SAMPLING_DEFAULT,
        compile_step={"auto": "auto", "on": True, "off": False, "max-autotune": "max-autotune"}[args.compile],
        kernels={"auto": "auto", "on": True, "off": False}[args.kernels],
        share_prompt_reads=args.share_prompt == "on",
        harvest_tokens=args.harvest == "on",
        linear_max_rows=LINEAR_MAX_ROWS_DEFAULT if args.linear_max_rows is None else args.linear_max_rows,
        down_split_min_rows=args.down_split_min_rows,  # None: the decoder's own rule
        down_split_k=DOWN_SPLIT_K if args.down_split_k is None else args.down_split_k,
        gated_min_rows=GATED_MIN_ROWS_DEFAULT if args.gated_min_rows is None else args.gated_min_rows,
        grouped_attention_min_rows=(
            GROUPED_ATTENTION_MIN_ROWS_DEFAULT
            if args.grouped_attention_min_rows is None
            else args.grouped_attention_min_rows
        ),
        fold_mlp_norm=FOLD_MLP_NORM_DEFAULT if args.fold_mlp_norm is None else args.fold_mlp_norm == "on",
        freeze_heap=args.freeze_heap == "on",
    )
    engine.decoder.compiled_prefill = args.prefill == "compiled"
    if engine.decoder._attention is not None:
        engine.decoder._attention.grouped_launch = GROUPED_LAUNCHES[args.grouped_launch]
    engine.decoder.dynamic_rows = args.dynamic_rows == "on"
    init_s = time.perf_counter() - t0
    graphs_compiled0 = counters["stats"]["unique_graphs"]
    try:
        engine.generate(make_requests("w", vocab, warm_p, warm_r, samples, seed=2))  # compiles, captures
        common.sync(dev)
        first_call_s = time.perf_counter() - t0
        capture_s = dict(sorted(engine.decoder.capture_seconds.items()))
        graphs_compiled = counters["stats"]["unique_graphs"] - graphs_compiled0
        d = engine.decoder
        d.steps_by_bucket.clear()
        moved0, prefill0, padded0 = d.rows_moved, d.prefill_forwards, d.prefill_padded_tokens
        routes0, reads0 = dict(engine.tokens_by_route), dict(engine.flag_reads)
        reqs = make_requests("q", vocab, p_lens, r_lens, samples, seed=1)
        reset_peak(dev)
        engine.phase_events = []  # filled on CUDA only (the engine records no events elsewhere)
        graphs0, pauses = len(d._graphs), GcPauses()
        common.sync(dev)
        gc.callbacks.append(pauses)
        t = time.perf_counter()
        try:
            out = engine.generate(reqs)
            common.sync(dev)
            dt = time.perf_counter() - t
        finally:
            gc.callbacks.remove(pauses)
        phases = phase_seconds(engine.phase_events or [])
        gaps = idle_gaps(engine.phase_events or [])
        engine.phase_events = None
        tokens = sum(len(c.token_ids) for c in out)
        assert tokens == sum(r_lens), (tokens, sum(r_lens))
        errs = []  # trust check: the engine's logprobs vs a teacher-forced forward of the same model
        for c in (out[0], out[len(out) // 2], out[-1]):
            tf = teacher_forced_logprobs(model, c.prompt_ids, c.token_ids)
            errs.append(float((tf - torch.tensor(c.logprobs)).abs().max()))
        return {
            "batch": batch,
            "prompts": len(p_lens),
            "samples_per_prompt": samples,
            "prompt_len": common.spread(p_lens),
            "response_len": common.spread(r_lens),
            "tokens": tokens,
            "seconds": dt,
            "tokens_per_s": tokens / dt,
            "first_call_seconds": first_call_s,
            # its parts: building the engine (KV cache, kernel self-checks), then per batch bucket
            # the compiles, warm-up steps and graph capture (host seconds), and the number of
            # graphs torch.compile built (all cold with empty TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR)
            "engine_init_seconds": init_s,
            "kernel_check_seconds": engine.decoder.kernel_check_seconds,
            "capture_seconds": sum(capture_s.values()),
            "capture_seconds_by_bucket": capture_s,
            "graphs_compiled": graphs_compiled,
            "dynamic_rows": engine.decoder.dynamic_rows,
            "compile_caches": {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")},
            "peak_memory_gib": peak_gib(dev),
            "cuda_graphs": d.use_graphs,
            "compiled": d.compiled,
            "share_prompt_reads": engine.share_prompt_reads,
            "compiled_prefill": d.compiled and d.compiled_prefill,
            "compile_error": (d.compile_error or "")[-3000:] or None,
            "graph_error": (d.graph_error or "")[-3000:] or None,
            "kernels": d.kernels_used,
            "linear_max_rows": d.linear_max_rows,
            "down_split_min_rows": d.down_split_min_rows,
            "down_split_k": d.down_split_k,
            "gated_min_rows": d.gated_min_rows,
            "grouped_attention_min_rows": d.grouped_attention_min_rows,
            "fold_mlp_norm": d.fold_mlp_norm,
            "grouped_launch": args.grouped_launch,
            "harvest_tokens": engine.harvest_tokens,
            "kernel_errors": d.kernel_errors,
            "graphs_captured": len(d._graphs),
            "graphs_captured_in_timed_call": len(d._graphs) - graphs0,
            # the host's garbage-collector pauses inside the timed call (count, seconds)
            "gc_pauses": pauses.count,
            "gc_pause_seconds": pauses.seconds,
            "freeze_heap": args.freeze_heap == "on",
            "steps_by_bucket": dict(sorted(d.steps_by_bucket.items())),
            "rows_moved": d.rows_moved - moved0,
            "prefill_forwards": d.prefill_forwards - prefill0,
            "prefill_padded_tokens": d.prefill_padded_tokens - padded0,
            "sync_every": engine.sync_every,
            "flag_lag": engine.flag_lag,
            "sampling": engine.decoder.sampling,
            "flag_reads": {k: v - reads0[k] for k, v in engine.flag_reads.items()},
            # the call's wall time on the device's timeline: prefill and admission, decode chunks,
            # and the rest (the GPU idle while the host collects, plans and launches)
            "phase_seconds": phases,
            "gpu_idle_seconds": dt - sum(phases.values()) if phases else None,
            # its part between phases, by the phase the GPU was waiting for; the rest of it is
            # before the first phase and after the last
            "gpu_idle_between_phases": gaps,
            # tokens copied behind their chunk vs read at collection (while the GPU waits)
            "tokens_by_route": {k: v - routes0[k] for k, v in engine.tokens_by_route.items()},
            "logprob_max_abs_err_vs_teacher_forced": max(errs),
            "_lengths": (p_lens, r_lens, samples),
        }
    finally:
        engine.shutdown()


def idle_gaps(events: list[tuple[str, Any, Any]]) -> dict[str, Any] | None:
    """The device's idle seconds from the end of each phase to the start of the next (CUDA events,
    after a sync), summed by the phase that followed, with the five longest gaps in ms: where the
    host's work between chunks (collecting, planning, launching) left the GPU waiting."""
    if len(events) < 2:
        return None
    by: dict[str, float] = {}
    gaps = []
    for (_, _, end), (phase, start, _) in itertools.pairwise(events):
        gap = max(0.0, end.elapsed_time(start) / 1e3)
        by["before_" + phase] = by.get("before_" + phase, 0.0) + gap
        gaps.append(gap)
    return {**by, "gaps": len(gaps), "longest_ms": [round(1e3 * g, 3) for g in sorted(gaps)[-5:]]}


def phase_seconds(events: list[tuple[str, Any, Any]]) -> dict[str, float]:
    """Seconds per phase from the engine's (phase, start, end) CUDA events (after a sync)."""
    out: dict[str, float] = {}
    for phase, start, end in events:
        out[phase] = out.get(phase, 0.0) + start.elapsed_time(end) / 1e3
    return out


def run_generate(model: Any, args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """``transformers.generate`` on the b64 shape (same prompts length, same new tokens)."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    ids = torch.tensor([p for p in prompts for _ in range(args.samples)], device=dev)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        reset_peak(dev)
        common.sync(dev)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **kw)
        common.sync(dev)
        dt = time.perf_counter() - t
    tokens = int(out[:, ids.shape[1] :].numel())
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt, "peak_memory_gib": peak_gib(dev)}


def profile_decode(
    model: Any, args: argparse.Namespace, dev: torch.device, out_dir: Path, size: str, prompts: int
) -> None:
    """Kernel table of ``prompts`` x ``samples`` rows decoding 128 tokens (graph replays included)
    -> rollout-profile.txt."""
    from torch.profiler import ProfilerActivity, profile

    rows = prompts * args.samples
    engine = HFEngine(model=model, num_slots=rows, max_seq_len=args.prompt_len + 129)
    try:
        p_lens, r_lens = [args.prompt_len] * prompts, [128] * rows
        vocab = model.config.vocab_size
        engine.generate(make_requests("p", vocab, p_lens, r_lens, args.samples, seed=3))
        common.sync(dev)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(make_requests("r", vocab, p_lens, r_lens, args.samples, seed=4))
            common.sync(dev)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70)
        with open(out_dir / "rollout-profile.txt", "a") as f:
            f.write(
                f"===== {size}: b{rows} decode, 128 new tokens, "
                f"kernels {engine.decoder.kernels_used}\n{table}\n"
            )
    finally:
        engine.shutdown()


def bench_size(
    size: str, args: argparse.Namespace, dev: torch.device, ceil: dict[str, Any]
) -> dict[str, Any]:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_qwen2_config(64), dtype=dtype).to(dev).eval()
    else:
        model = make_qwen2_like(size, dtype=dtype, device=dev)
    cost = model_cost(model.config, dtype_bytes=torch.finfo(dtype).bits // 8)
    res: dict[str, Any] = {
        "size": "tiny" if args.smoke else size,
        "dtype": str(dtype),
        "cost": cost.as_dict(),
    }
    read_bps, flops = ceil["read_bandwidth_gbs"] * 1e9, ceil["gemm_tflops"] * 1e12
    for shape in args.shapes.split(","):
        try:
            r = run_engine(model, shape, args, dev)
        except Exception as exc:  # keep the run useful: report, go on
            res[shape] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            continue
        p_lens, r_lens, samples = r.pop("_lengths")
        per_sample_p = [p for p in p_lens for _ in range(samples)]
        b = rollout_bound(cost, per_sample_p, r_lens, read_bps, flops, distinct_prompts=len(p_lens))
        r["bound"] = b
        r["fraction_of_bound"] = b["bound_seconds"] / r["seconds"]
        # the tighter bound that reads each prompt's K/V once per group (as prompt sharing can)
        groups = [i for i in range(len(p_lens)) for _ in range(samples)]
        unique = rollout_bound(cost, per_sample_p, r_lens, read_bps, flops, len(p_lens), prompt_groups=groups)
        r["unique_read_bound"] = unique
        r["fraction_of_unique_read_bound"] = unique["bound_seconds"] / r["seconds"]
        # the same bound with the KV and logits left out: what reading the weights alone allows
        r["weights_only_tokens_per_s"] = len(r_lens) / (cost.weight_bytes_per_step / read_bps)
        res[shape] = r
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_generate and "b64" in args.shapes.split(",") and "error" not in res.get("b64", {}):
        gen = run_generate(model, args, dev)
        b = res["b64"]["bound"]
        gen["fraction_of_bound"] = gen["tokens_per_s"] / b["bound_tokens_per_s"]
        res["generate_b64"] = gen
        res["speedup_vs_generate_b64"] = res["b64"]["tokens_per_s"] / gen["tokens_per_s"]
    if args.profile and dev.type == "cuda":
        try:
            for prompts in (args.prompts, args.rl_prompts):  # the b64 and b512 rows
                profile_decode(model, args, dev, Path(os.environ.get("OUT", ".")), size, prompts)
        except Exception as exc:
            res["profile_error"] = f"{type(exc).__name__}: {exc}"
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sizes", default="0.5b,1.5b")
    ap.add_argument("--shapes", default="b64,b512,rl")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rl-prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rl-max-response", type=int, default=1024)
    ap.add_argument("--sync-every", type=int, default=None)
    ap.add_argument(
        "--flag-lag", type=int, default=None,
        help="steps before a chunk's end at which the host reads the finished flags (0: at the end; "
        "default: the engine's, 1 on a GPU)",
    )  # fmt: skip
    ap.add_argument(
        "--sampling", choices=["gumbel", "cdf"], default=None,
        help="how tokens are drawn (hf_decode.SAMPLING_DEFAULT unless given)",
    )  # fmt: skip
    ap.add_argument("--compile", choices=["auto", "on", "off", "max-autotune"], default="auto")
    ap.add_argument("--kernels", choices=["auto", "on", "off"], default="auto")
    ap.add_argument(
        "--share-prompt", choices=["on", "off"], default="on",
        help="a prompt's samples read its K/V from one row (the attention kernel)",
    )  # fmt: skip
    ap.add_argument(
        "--prefill", choices=["compiled", "eager"], default="eager",
        help="the prefill eager (the engine's default), or through the decode step's compiled functions",
    )  # fmt: skip
    ap.add_argument(
        "--harvest", choices=["on", "off"], default="on",
        help="copy each chunk's tokens to the host behind it (default), or read them all at collection",
    )  # fmt: skip
    ap.add_argument(
        "--linear-max-rows", type=int, default=None,
        help="buckets up to this many rows run the fused linear kernel (0: cuBLAS; default: the engine's, "
        "hf_decode.LINEAR_MAX_ROWS_DEFAULT)",
    )  # fmt: skip
    ap.add_argument(
        "--down-split-min-rows", type=int, default=None,
        help="buckets of at least this many rows run the down GEMM split-K (0: never; default: the "
        "engine's rule, hf_decode.auto_down_split_min_rows)",
    )  # fmt: skip
    ap.add_argument(
        "--gated-min-rows", type=int, default=None,
        help="buckets of at least this many rows run gate/up + SiLU as one Triton GEMM (0: never; "
        "default: the engine's, hf_decode.GATED_MIN_ROWS_DEFAULT)",
    )  # fmt: skip
    ap.add_argument(
        "--grouped-attention-min-rows", type=int, default=None,
        help="buckets of at least this many rows run the grouped attention kernel (0: never; default: "
        "the engine's, hf_decode.GROUPED_ATTENTION_MIN_ROWS_DEFAULT)",
    )  # fmt: skip
    ap.add_argument(
        "--fold-mlp-norm", choices=["on", "off"], default=None,
        help="the decode step's MLP norm folded into a copy of the gate/up weight, 1 / rms in the SiLU "
        "kernel (default: the engine's, hf_decode.FOLD_MLP_NORM_DEFAULT)",
    )  # fmt: skip
    ap.add_argument(
        "--grouped-launch",
        choices=sorted(GROUPED_LAUNCHES),
        default="default",
        help="Triton launch options of the grouped attention kernel (the A/B's)",
    )
    ap.add_argument(
        "--down-split-k", type=int, default=None,
        help="slices of K in the split down GEMM (default: the engine's, hf_decode.DOWN_SPLIT_K)",
    )  # fmt: skip
    ap.add_argument(
        "--freeze-heap", choices=("on", "off"), default="on",
        help="off: the engine leaves the warm heap to the garbage collector (the A/B of its pauses)",
    )  # fmt: skip
    ap.add_argument(
        "--dynamic-rows",
        choices=["on", "off"],
        default="on",
        help="compile the step's functions with the batch rows dynamic from the first compile (off: "
        "torch's default, which recompiles at the second bucket)",
    )
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--profile", action="store_true", help="kernel tables of the b64 and b512 decode (GPU)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.rl_prompts, args.samples, args.prompt_len, args.new_tokens = 2, 3, 2, 8, 16
        args.rl_max_response = 40
        torch.set_num_threads(1)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    ceil = common.ceilings(dev, args.smoke)
    report: dict[str, Any] = {"benchmark": "rollout-gpu", **common.run_info(dev, ceil, args), "results": []}
    out_dir = os.environ.get("OUT")
    for size in ["tiny"] if args.smoke else args.sizes.split(","):
        report["results"].append(bench_size(size, args, dev, ceil))
        if out_dir:  # after every size, so a run cut short still leaves its results
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "rollout-gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    for r in report["results"]:  # the short table last (the device tool returns the output's end)
        for shape in args.shapes.split(","):
            x = r.get(shape, {})
            if "fraction_of_bound" in x:
                print(
                    f"{r['size']:>5} {shape:>5} batch {x['batch']:>4}: {x['tokens_per_s']:>9.0f} tok/s, "
                    f"bound {x['bound']['bound_tokens_per_s']:>9.0f} -> {100 * x['fraction_of_bound']:.1f}% "
                    f"({100 * x['fraction_of_unique_read_bound']:.1f}% of the unique-read bound), "
                    f"first call {x['first_call_seconds']:.1f} s (init {x['engine_init_seconds']:.1f} s, "
                    f"capture {x['capture_seconds']:.1f} s, {x['graphs_compiled']} graphs compiled), "
                    f"kernels {x['kernels']}, "
                    f"phases {x['phase_seconds']} of {x['seconds']:.4f} s, gc {x['gc_pauses']} pauses "
                    f"{x['gc_pause_seconds']:.3f} s, graphs captured in the call "
                    f"{x['graphs_captured_in_timed_call']}"
                )
            elif x:
                print(f"{r['size']} {shape}: {x.get('error')}")
    return (
        0
        if all("error" not in r.get(s, {}) for r in report["results"] for s in args.shapes.split(","))
        else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
