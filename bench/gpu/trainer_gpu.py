"""GRPO training steps on one GPU (sync mode, hf engine), and TRL's GRPOTrainer on the same job.

Random-init Qwen2 with Qwen2.5-0.5B / 1.5B shapes, bf16 compute (fp32 master weights + AdamW),
8 prompts x 8 samples = 64 completions of 256 tokens after a 64-token prompt, no stop tokens (every
completion runs to length, on both sides). One process: no Ray, no vLLM. Per step: generate (hf
engine) -> reward -> GRPO advantages -> one PPO update (one epoch x one mini-batch is on-policy: no
separate old log-prob pass, as in the trainer) -> full bf16 weight sync into the engine. Reports
rollout tokens/s, train tokens/s, end-to-end completion tokens/s, MFU, step time, peak memory, the
decode bound, and -- when ``trl`` imports -- TRL's end-to-end completion tokens/s on the identical
model/batch/group/lengths as a ratio.

    python bench/gpu/trainer_gpu.py            # GPU: 0.5b and 1.5b
    python bench/gpu/trainer_gpu.py --smoke    # CPU: tiny shapes, seconds (tested in CI)

JSON to stdout and to ``$OUT/trainer-gpu.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch


def _import_rlkube() -> None:
    """Installed package, else map ``rlkube.runtime`` / ``rlkube.api`` onto this checkout."""
    try:
        import rlkube.runtime.trainer.actor  # noqa: F401

        return
    except ImportError:
        pass
    import types

    top = Path(__file__).resolve().parents[2]
    pkg = types.ModuleType("rlkube")
    pkg.__path__ = []  # type: ignore[attr-defined]
    sys.modules["rlkube"] = pkg
    import importlib.util

    for name, folder in (("rlkube.runtime", top / "runtime"), ("rlkube.api", top / "api")):
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)


COMPILE_CHOICES: dict[str, Any] = {"auto": "auto", "on": True, "off": False}


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bytes/s, counted once (read+write is twice this)."""
    if device.type != "cuda":
        return 0.0
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 20 * x.numel() / (time.perf_counter() - t0)


def decode_bound(model: Any, batch: int, prompt: int, new: int, bw: float) -> float:
    """tokens/s if each decode step read the bf16 weights once plus the batch's KV cache once."""
    cfg = model.config
    w = sum(p.numel() for p in model.parameters()) * 2
    head = cfg.hidden_size // cfg.num_attention_heads
    kv_per_tok = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head * 2
    mean_ctx = prompt + new / 2
    return batch / ((w + batch * kv_per_tok * mean_ctx) / bw) if bw else 0.0


def rlkube_grpo(size: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from rlkube.runtime.algos import compute_advantages
    from rlkube.runtime.models.tiny import make_qwen2_like
    from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams
    from rlkube.runtime.rollout.hf import HFEngine
    from rlkube.runtime.trainer.actor import LossConfig, OptimConfig, PolicyWorker, needs_old_logprob_pass
    from rlkube.runtime.trainer.batch import Sample, collate
    from rlkube.runtime.weights import WeightSender

    bf16 = device.type == "cuda"
    dtype = torch.bfloat16 if bf16 else torch.float32
    if args.smoke:
        from transformers import AutoModelForCausalLM

        from rlkube.runtime.models.tiny import tiny_qwen2_config

        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(tiny_qwen2_config(64), dtype=torch.float32)
    else:
        base = make_qwen2_like(size, dtype=torch.float32, device=device)
    n_params = sum(p.numel() for p in base.parameters())
    vocab = base.config.vocab_size
    eng_model = make_qwen2_like(size, dtype=dtype, device=device) if not args.smoke else None
    if eng_model is None:
        import copy

        eng_model = copy.deepcopy(base)
    eng_model.load_state_dict({k: v.to(dtype) for k, v in base.state_dict().items()})
    engine = HFEngine(
        model=eng_model.to(device),
        num_slots=args.prompts * args.group,
        max_seq_len=args.prompt_len + args.new_tokens,
        seed=0,
        compile_step=COMPILE_CHOICES[args.compile],
    )
    # One PPO epoch over one mini-batch (the whole batch), like the trainer at miniBatchSize ==
    # trainBatchSize, ppoEpochs 1: on-policy, so the update uses its own detached log-probs.
    num_mini, epochs = 1, 1
    old_pass = needs_old_logprob_pass(num_mini, epochs)
    actor = PolicyWorker(
        "",
        model=base,
        device=device,
        bf16=bf16,
        micro_batch_size=args.micro_batch,
        optim=OptimConfig(lr=1e-6),
        loss=LossConfig(),
    )
    sender = WeightSender(bucket_megabytes=512, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    steps = []
    peak_flops = 989e12 if device.type == "cuda" else None
    try:
        from rlkube.runtime.platform import current_platform

        peak_flops = current_platform().peak_flops() or peak_flops
    except Exception:
        pass
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        t_step = time.perf_counter()
        reqs = [
            RolloutRequest(
                f"s{step}p{i}",
                torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist(),
                SamplingParams(
                    n=args.group, temperature=1.0, max_tokens=args.new_tokens, seed=step * 100 + i
                ),
            )
            for i in range(args.prompts)
        ]
        t0 = time.perf_counter()
        comps = engine.generate(reqs)
        t_gen = time.perf_counter() - t0
        samples = [
            Sample(list(c.prompt_ids), list(c.token_ids), c.request_id, 0, score=float(sum(c.token_ids) % 2))
            for c in comps
        ]
        batch = collate(samples, 0)
        t0 = time.perf_counter()
        t_old = 0.0
        if old_pass:
            old, _ = actor.compute_logprobs(batch)
            batch.extras["old_logp"] = old
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_old = time.perf_counter() - t0
        adv, _ = compute_advantages(
            "grpo", mask=batch.response_mask, scores=batch.scores, group_index=batch.group_index
        )
        batch.extras["advantages"] = adv
        actor.update(batch, num_mini_batches=num_mini, epochs=epochs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_train = time.perf_counter() - t0
        t0 = time.perf_counter()
        if args.weight_sync == "direct":  # what the trainer does in one process (full sync)
            engine.load_weights(list(actor.full_named_parameters()), step + 1)
        else:
            engine.update_weights(list(sender.full(actor.full_named_parameters(), step + 1)), step + 1)
        t_sync = time.perf_counter() - t0
        dt = time.perf_counter() - t_step
        resp = sum(len(c.token_ids) for c in comps)
        total = resp + args.prompts * args.group * args.prompt_len
        # fwd + bwd (3x), plus the old-logprob fwd when it runs
        train_flops = 2 * n_params * total * (4 if old_pass else 3)
        gen_flops = 2 * n_params * resp
        steps.append(
            {
                "step_s": dt,
                "gen_s": t_gen,
                "train_s": t_train,
                "old_logprob_s": t_old,
                "sync_s": t_sync,
                "rollout_tokens_per_s": resp / t_gen,
                "train_tokens_per_s": total / t_train,
                "e2e_completion_tokens_per_s": resp / dt,
                "mfu": (train_flops + gen_flops) / (dt * peak_flops) if peak_flops else None,
                "train_mfu": train_flops / (t_train * peak_flops) if peak_flops else None,
                "completion_tokens": resp,
            }
        )
    engine_compiled = getattr(engine.decoder, "compiled", None)  # False if compile fell back
    compile_error = getattr(engine.decoder, "compile_error", None)
    engine.shutdown()
    bw = copy_bandwidth(device)
    timed = steps[1:] if len(steps) > 1 else steps  # first step warms up kernels / graphs
    avg = {k: sum(s[k] for s in timed) / len(timed) for k in timed[0] if timed[0][k] is not None}
    bound = decode_bound(eng_model, args.prompts * args.group, args.prompt_len, args.new_tokens, bw)
    return {
        "size": size,
        "params": n_params,
        "engine_compiled": engine_compiled,
        "compile_error": compile_error[-3000:] if compile_error else None,
        "weight_sync": args.weight_sync,
        "old_logprob_pass": old_pass,
        "steps": steps,
        "mean_after_warmup": avg,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "copy_bandwidth_gbs": bw / 1e9,
        "decode_bound_tokens_per_s": bound,
        "decode_fraction_of_bound": avg["rollout_tokens_per_s"] / bound if bound else None,
    }


def trl_grpo(size: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """TRL GRPOTrainer, same model shape / batch / group / lengths, beta 0, one update per step."""
    try:
        import trl
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except Exception as e:
        return {"available": False, "error": f"{type(e).__name__}: {e}"}
    try:
        from rlkube.runtime.models.tiny import make_char_tokenizer, make_qwen2_like

        model = make_qwen2_like(size, dtype=torch.bfloat16, device=device).train()
        tok = make_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789")
        tok.padding_side = "left"
        prompts = [
            "".join(chr(97 + (i * 7 + j) % 26) for j in range(args.prompt_len - 1))
            for i in range(args.prompts)
        ]
        ds = Dataset.from_dict({"prompt": prompts * (args.steps + 1)})

        def reward(completions: list[str], **_: Any) -> list[float]:
            return [float(len(c) % 2) for c in completions]

        cfg = GRPOConfig(
            output_dir="/tmp/trl-bench",
            per_device_train_batch_size=args.prompts * args.group,
            num_generations=args.group,
            max_completion_length=args.new_tokens,
            beta=0.0,
            learning_rate=1e-6,
            bf16=device.type == "cuda",
            max_steps=args.steps,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            temperature=1.0,
            gradient_accumulation_steps=1,
            generation_kwargs={"min_new_tokens": args.new_tokens},
        )
        times: list[float] = []

        from transformers import TrainerCallback

        class Timer(TrainerCallback):
            def on_step_begin(self, *a: Any, **k: Any) -> None:
                self.t = time.perf_counter()

            def on_step_end(self, *a: Any, **k: Any) -> None:
                times.append(time.perf_counter() - self.t)

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=cfg,
            train_dataset=ds,
            processing_class=tok,
            callbacks=[Timer()],
        )
        trainer.train()
        timed = times[1:] if len(times) > 1 else times
        step_s = sum(timed) / len(timed)
        tokens = args.prompts * args.group * args.new_tokens
        return {
            "available": True,
            "version": trl.__version__,
            "step_s": step_s,
            "steps": times,
            "e2e_completion_tokens_per_s": tokens / step_s,
        }
    except Exception as e:
        return {
            "available": True,
            "error": f"{type(e).__name__}: {e}",
            "trace": traceback.format_exc()[-3000:],
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 2 steps")
    p.add_argument("--sizes", default="0.5b,1.5b")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--no-trl", action="store_true")
    p.add_argument(
        "--compile",
        choices=sorted(COMPILE_CHOICES),
        default="auto",
        help="HFEngine compile_step: auto (the engine decides), on, off",
    )
    p.add_argument(
        "--weight-sync",
        choices=["direct", "buckets"],
        default="direct",
        help="full sync by direct copy (the trainer's in-process path) or checksummed buckets",
    )
    args = p.parse_args()
    if args.smoke:
        args.sizes, args.steps, args.prompts, args.group = "tiny", 2, 2, 2
        args.prompt_len, args.new_tokens, args.micro_batch, args.no_trl = 8, 8, 4, True
        torch.set_num_threads(1)
    _import_rlkube()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    out: dict[str, Any] = {
        "bench": "trainer-gpu",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "job": {
            "prompts": args.prompts,
            "group": args.group,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "steps": args.steps,
        },
        "results": [],
    }
    for size in args.sizes.split(","):
        entry: dict[str, Any] = {"size": size}
        try:
            entry["rlkube"] = rlkube_grpo(size, args, device)
        except Exception as e:
            entry["rlkube"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        if not args.no_trl:
            entry["trl"] = trl_grpo(size, args, device)
            r, t = entry["rlkube"].get("mean_after_warmup", {}), entry["trl"]
            if "e2e_completion_tokens_per_s" in r and "e2e_completion_tokens_per_s" in t:
                entry["speedup_vs_trl"] = r["e2e_completion_tokens_per_s"] / t["e2e_completion_tokens_per_s"]
        out["results"].append(entry)
        if os.environ.get("OUT"):  # after every size, so a run cut short still leaves its results
            Path(os.environ["OUT"], "trainer-gpu.json").write_text(json.dumps(out, indent=2))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    text = json.dumps(out, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "trainer-gpu.json").write_text(text)
    return 0 if all("error" not in e["rlkube"] for e in out["results"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
