"""Rollout decode speed on one GPU: the hf engine vs ``transformers.generate``, against the bound.

Random-init Qwen2 with Qwen2.5-0.5B / 1.5B shapes, bf16, P prompts x S samples (default 8 x 8 = 64
completions) of N new tokens (256) after a 64-token prompt, no stop tokens (every completion runs
to length, so both sides generate exactly the same number of tokens). One process, no Ray, no vLLM.

Bound: a decode step must read every weight once plus the batch's KV cache, so
``tokens/s <= batch / ((weight_bytes + batch * kv_bytes_per_token * mean_context) / bandwidth)``.
Bandwidth is a measured device-to-device copy. Two figures are reported: ``rw`` counts a copy's
bytes twice (read + write; the stricter bound, primary) and ``copy`` counts them once (the
definition behind the 0.6%-of-bound figure quoted for ``generate`` in shared/reference/rl.md).

    python bench/gpu/rollout_gpu.py                 # GPU: 0.5b and 1.5b
    python bench/gpu/rollout_gpu.py --smoke         # CPU: tiny shapes, seconds (tested in CI)

Writes JSON to stdout and to ``$OUT/rollout-gpu.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any


def _import_rlkube() -> None:
    """Use the installed package, else map ``rlkube.runtime`` onto this checkout (GPU box: no install)."""
    try:
        import rlkube.runtime.rollout.hf  # noqa: F401

        return
    except ImportError:
        pass
    root = Path(__file__).resolve().parents[2]
    pkg = types.ModuleType("rlkube")
    pkg.__path__ = []
    sys.modules["rlkube"] = pkg
    spec = importlib.util.spec_from_file_location(
        "rlkube.runtime", root / "runtime" / "__init__.py", submodule_search_locations=[str(root / "runtime")]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rlkube.runtime"] = mod
    spec.loader.exec_module(mod)


_import_rlkube()

import torch  # noqa: E402

from rlkube.runtime.models.tiny import make_qwen2_like, tiny_qwen2_config  # noqa: E402
from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams  # noqa: E402
from rlkube.runtime.rollout.hf import HFEngine, teacher_forced_logprobs  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def copy_bandwidth(dev: torch.device, nbytes: int, iters: int = 20) -> dict[str, float]:
    """Measured D2D copy: bytes copied per second (``copy``) and read+write bytes per second (``rw``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(dev)
    t = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(dev)
    dt = (time.perf_counter() - t) / iters
    del src, dst
    return {"copy_GBps": nbytes / dt / 1e9, "rw_GBps": 2 * nbytes / dt / 1e9, "bytes": float(nbytes)}


def model_bytes(model: Any) -> dict[str, float]:
    cfg = model.config
    itemsize = next(model.parameters()).element_size()
    params = {n: p for n, p in model.named_parameters()}
    total = sum(p.numel() for p in params.values())
    read = sum(p.numel() for n, p in params.items() if "embed_tokens" not in n or cfg.tie_word_embeddings)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize
    return {
        "parameters": float(total),
        "weight_bytes_read_per_step": float(read * itemsize),
        "kv_bytes_per_token": float(kv_per_token),
    }


def bound(mb: dict[str, float], batch: int, prompt_len: int, new_tokens: int, bw_GBps: float) -> float:
    mean_ctx = prompt_len + new_tokens / 2
    step_bytes = mb["weight_bytes_read_per_step"] + batch * mb["kv_bytes_per_token"] * mean_ctx
    return batch / (step_bytes / (bw_GBps * 1e9))


def reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


def run_engine(
    model: Any,
    prompts: list[list[int]],
    args: argparse.Namespace,
    dev: torch.device,
    cuda_graphs: bool | None,
    compile_step: bool | str = "auto",
) -> dict[str, Any]:
    n_seq = len(prompts) * args.samples
    engine = HFEngine(
        model=model,
        num_slots=n_seq,
        max_seq_len=args.prompt_len + args.new_tokens + 1,
        sync_every=args.sync_every,
        cuda_graphs=cuda_graphs,
        compile_step=compile_step,
    )
    try:
        params = SamplingParams(
            n=args.samples, temperature=1.0, top_p=1.0, max_tokens=args.new_tokens, seed=1
        )
        reqs = [RolloutRequest(f"p{i}", p, params) for i, p in enumerate(prompts)]
        t = time.perf_counter()
        engine.generate(reqs)  # warm-up: captures the CUDA graph of every KV bucket
        warm_s = time.perf_counter() - t
        reset_peak(dev)
        sync(dev)
        t = time.perf_counter()
        out = engine.generate([RolloutRequest(f"q{i}", p, params) for i, p in enumerate(prompts)])
        sync(dev)
        dt = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for c in out)
        # Trust check: the engine's logprobs vs a teacher-forced forward of the same model.
        errs = []
        for c in out[:: max(1, len(out) // 2)][:2]:
            tf = teacher_forced_logprobs(model, c.prompt_ids, c.token_ids)
            errs.append(float((tf - torch.tensor(c.logprobs)).abs().max()))
        return {
            "tokens": tokens,
            "seconds": dt,
            "tokens_per_s": tokens / dt,
            "warmup_seconds": warm_s,
            "peak_memory_gib": peak_gib(dev),
            "cuda_graphs": engine.decoder.use_graphs,
            "compile_step": compile_step,
            "compiled": engine.decoder.compiled,
            "compile_error": (engine.decoder.compile_error or "")[-3000:] or None,
            "graphs_captured": len(engine.decoder._graphs),
            "sync_every": engine.sync_every,
            "logprob_max_abs_err_vs_teacher_forced": max(errs),
        }
    finally:
        engine.shutdown()


def run_generate(
    model: Any, prompts: list[list[int]], args: argparse.Namespace, dev: torch.device
) -> dict[str, Any]:
    ids = torch.tensor([p for p in prompts for _ in range(args.samples)], device=dev)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        reset_peak(dev)
        sync(dev)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **kw)
        sync(dev)
        dt = time.perf_counter() - t
    tokens = int(out[:, ids.shape[1] :].numel())
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt, "peak_memory_gib": peak_gib(dev)}


def bench_size(
    size: str, args: argparse.Namespace, dev: torch.device, bw: dict[str, float]
) -> dict[str, Any]:
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_qwen2_config(64), dtype=dtype).to(dev).eval()
    else:
        model = make_qwen2_like(size, dtype=dtype, device=dev)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    mb = model_bytes(model)
    batch = args.prompts * args.samples
    res: dict[str, Any] = {"size": "tiny" if args.smoke else size, "dtype": str(dtype), **mb}
    res["bound_tokens_per_s_rw"] = bound(mb, batch, args.prompt_len, args.new_tokens, bw["rw_GBps"])
    res["bound_tokens_per_s_copy"] = bound(mb, batch, args.prompt_len, args.new_tokens, bw["copy_GBps"])
    # "hf_engine" is what a user gets (compile_step="auto": compiled on CUDA, eager fallback);
    # "hf_engine_eager" is the same engine without torch.compile, measured in the same run.
    modes = {"on": True, "off": False, "auto": "auto", "both": "auto"}
    try:
        res["hf_engine"] = run_engine(model, prompts, args, dev, None, modes[args.compile])
    except Exception as exc:  # keep the run useful: report, then try without graphs
        res["hf_engine_error"] = "".join(traceback.format_exception_only(exc)).strip()
        res["hf_engine"] = run_engine(model, prompts, args, dev, cuda_graphs=False, compile_step=False)
    if args.compile == "both" and res["hf_engine"]["compiled"]:
        res["hf_engine_eager"] = run_engine(model, prompts, args, dev, None, False)
        res["compiled_speedup_vs_eager"] = (
            res["hf_engine"]["tokens_per_s"] / res["hf_engine_eager"]["tokens_per_s"]
        )
    if not args.skip_generate:
        res["generate"] = run_generate(model, prompts, args, dev)
        res["speedup_vs_generate"] = res["hf_engine"]["tokens_per_s"] / res["generate"]["tokens_per_s"]
        res["generate_fraction_of_bound_rw"] = res["generate"]["tokens_per_s"] / res["bound_tokens_per_s_rw"]
        res["generate_fraction_of_bound_copy"] = (
            res["generate"]["tokens_per_s"] / res["bound_tokens_per_s_copy"]
        )
    tps = res["hf_engine"]["tokens_per_s"]
    res["fraction_of_bound_rw"] = tps / res["bound_tokens_per_s_rw"]
    res["fraction_of_bound_copy"] = tps / res["bound_tokens_per_s_copy"]
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5b,1.5b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--sync-every", type=int, default=None)
    ap.add_argument(
        "--compile",
        choices=["auto", "on", "off", "both"],
        default="both",
        help="decode-step torch.compile: auto/on/off, or both (auto, then eager for comparison)",
    )
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (or GPU), seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.samples, args.prompt_len, args.new_tokens = 2, 2, 8, 16
        torch.set_num_threads(1)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bw = copy_bandwidth(dev, (64 << 20) if args.smoke or dev.type == "cpu" else (1 << 30))
    import transformers

    report: dict[str, Any] = {
        "benchmark": "rollout-gpu",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch": args.prompts * args.samples,
        "prompts": args.prompts,
        "samples_per_prompt": args.samples,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "copy_bandwidth": bw,
        "results": [
            bench_size(s, args, dev, bw) for s in (["tiny"] if args.smoke else args.sizes.split(","))
        ],
    }
    text = json.dumps(report, indent=2)
    print(text)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "rollout-gpu.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
