"""GRPO training steps on one GPU (sync mode, hf engine), against the bound and against TRL.

Random-init Qwen2 with Qwen2.5-0.5B / 1.5B shapes, bf16 compute (fp32 master weights + AdamW), one
process (no Ray, no vLLM, no rlkube install, no pydantic: runs with plain ``python3``). Per step:
generate (hf engine) -> reward -> GRPO advantages -> one PPO update (one epoch x one mini-batch is
on-policy: no separate old log-prob pass, as in the trainer) -> full bf16 weight sync into the
engine. Two jobs:

- ``today``: 8 prompts x 8 samples, 64-token prompts, 256 new tokens (no stops), one pass of 64
  sequences (halved after an out-of-memory error: 1.5B's one pass needs ~98 GiB), and TRL's
  GRPOTrainer on the identical model/batch/group/lengths (its step also runs the 64 in one
  pass) when ``trl`` imports (carried as a wheel);
- ``rl``: 64 prompts x 8 samples, prompts of 64-320 tokens, responses of 32-1,024 tokens drawn
  per sample (``_common.draw_rl_lengths``).

Figures: rollout, train and end-to-end tokens/s; ``mfu_update`` = the update's FLOPs
(``roofline.update_flops``: 6 x matmul parameters x real tokens + causal attention; padding is not
counted) over update time x the dense bf16 GEMM rate measured in the same run; the rollout's
fraction of ``roofline.rollout_bound`` (read bandwidth measured in the same run);
``speedup_vs_trl_median``: TRL's median step time over ours, TRL's range beside it; the first step's
time (compile, graph capture) and peak memory. After the warm-up step the update alternates
between the rank-group path (``LearnerGroup`` -> ``Learner.update``, what ``Trainer.train`` runs)
and a direct ``PolicyWorker.update`` call (``--update-path``): ``update_paths`` compares the two.

    python bench/gpu/trainer_gpu.py            # GPU: 0.5b and 1.5b
    python bench/gpu/trainer_gpu.py --smoke    # CPU: tiny shapes, seconds (tested in CI)

JSON to stdout and to ``$OUT/trainer-gpu.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch

_spec = importlib.util.spec_from_file_location("rlkube_bench_common", Path(__file__).with_name("_common.py"))
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

COMPILE_CHOICES: dict[str, Any] = {"auto": "auto", "on": True, "off": False}


def update_profiler(on: bool) -> Any:
    """A CPU + CUDA ``torch.profiler`` context when ``on``, else one that yields ``None``."""
    if not on:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def write_profile(
    prof: Any, title: str, sort_keys: tuple[str, ...] = ("cuda_time_total",), rows: int = 45
) -> None:
    """Append the profile's kernel table(s) to ``$OUT/trainer-profile.txt``."""
    with open(Path(os.environ.get("OUT", "."), "trainer-profile.txt"), "a") as f:
        for key in sort_keys:
            table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)
            suffix = f", by {key}" if len(sort_keys) > 1 else ""
            f.write(f"===== {title}{suffix}\n{table}\n")


def job_lengths(job: str, args: argparse.Namespace, step: int) -> tuple[list[int], list[int], int]:
    """(prompt length per prompt, response length per sample, group size) of one step."""
    if job == "today":
        return [args.prompt_len] * args.prompts, [args.new_tokens] * (args.prompts * args.group), args.group
    p_lens, r_lens = common.draw_rl_lengths(
        args.rl_prompts, args.group, args.rl_max_response, seed=1000 + step
    )
    if args.smoke:
        p_lens = [max(2, p // 16) for p in p_lens]
    return p_lens, r_lens, args.group


def grpo_fitting_memory(
    size: str, job: str, a: argparse.Namespace, device: torch.device, ceil: dict[str, Any]
) -> dict[str, Any]:
    """``rlkube_grpo``, with passes of half as many sequences after each out-of-memory error (down
    to one), so the bench runs on a card smaller than the one its defaults were set for (1.5B's
    one pass of 64 needs ~98 GiB); the result says what was asked and what ran."""
    asked = a.micro_batch
    while True:
        try:
            res = rlkube_grpo(size, job, a, device, ceil)
            if a.micro_batch != asked:
                res["micro_batch_fallback"] = {
                    "asked": asked, "ran": a.micro_batch,
                    "why": "out of memory in passes of the asked size on this card",
                }  # fmt: skip
            return res
        except torch.cuda.OutOfMemoryError:
            if a.micro_batch <= 1:
                raise
        # outside the handler, so the traceback's frames (and the tensors they hold) are gone
        gc.collect()
        torch.cuda.empty_cache()
        print(f"{size} {job}: out of memory in passes of {a.micro_batch}, trying half", flush=True)
        a.micro_batch //= 2


def rlkube_grpo(
    size: str, job: str, args: argparse.Namespace, device: torch.device, ceil: dict[str, Any]
) -> dict[str, Any]:
    from rlkube.runtime.algos import compute_advantages
    from rlkube.runtime.distributed.ranks import LearnerGroup, split_rows
    from rlkube.runtime.models.roofline import model_cost, rollout_bound, update_flops
    from rlkube.runtime.models.tiny import make_qwen2_like
    from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams
    from rlkube.runtime.rollout.hf import HFEngine
    from rlkube.runtime.trainer.batch import Sample, collate
    from rlkube.runtime.trainer.learner import Learner
    from rlkube.runtime.trainer.packing import padded_tokens, row_lengths, token_micro_batches
    from rlkube.runtime.trainer.policy import PolicyWorker, needs_old_logprob_pass
    from rlkube.runtime.trainer.token_logprob import fused_kernel_problem
    from rlkube.runtime.trainer.worker import LossConfig, OptimConfig
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
    cost = model_cost(base.config, dtype_bytes=2 if bf16 else 4)
    vocab = base.config.vocab_size
    if args.smoke:
        import copy

        eng_model = copy.deepcopy(base)
    else:
        eng_model = make_qwen2_like(size, dtype=dtype, device=device)
    eng_model.load_state_dict({k: v.to(dtype) for k, v in base.state_dict().items()})
    all_lengths = [job_lengths(job, args, s) for s in range(args.steps)]
    batch = len(all_lengths[0][1])
    max_seq = max(max(p) + max(r) for p, r, _ in all_lengths) + 1
    t_build = time.perf_counter()
    engine = HFEngine(
        model=eng_model.to(device),
        num_slots=batch,
        max_seq_len=max_seq,
        seed=0,
        compile_step=COMPILE_CHOICES[args.compile],
    )
    engine_build_s = time.perf_counter() - t_build
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
        micro_batch_tokens=args.micro_batch_tokens if args.pack else 0,  # training.microBatchTokens
        optim=OptimConfig(lr=1e-6),
        loss=LossConfig(),
        compile_layers=args.train_compile,
    )
    sender = WeightSender(bucket_megabytes=512, dtype=dtype)
    # The trainer's one-rank path: the Learner behind the rank group, rows split by whole groups.
    group_of_ranks = LearnerGroup(Learner.from_workers(actor, sender))
    g = torch.Generator().manual_seed(0)
    read_bps, gemm = ceil["read_bandwidth_gbs"] * 1e9, ceil["gemm_tflops"] * 1e12
    steps = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        p_lens, r_lens, group = all_lengths[step]
        t_step = time.perf_counter()
        reqs = []
        for i, plen in enumerate(p_lens):
            prompt = torch.randint(4, vocab, (plen,), generator=g).tolist()
            for k in range(group):  # one request per sample: its own length, one shared prefill
                params = SamplingParams(
                    n=1, temperature=1.0, max_tokens=r_lens[i * group + k], seed=step * 100003 + i * 97 + k
                )
                reqs.append(RolloutRequest(f"s{step}p{i}k{k}", prompt, params))
        t0 = time.perf_counter()
        comps = engine.generate(reqs)
        t_gen = time.perf_counter() - t0
        samples = [
            Sample(
                list(c.prompt_ids),
                list(c.token_ids),
                c.request_id.split("k")[0],
                0,
                score=float(sum(c.token_ids) % 2),
            )
            for c in comps
        ]
        batch_t = collate(samples, 0)
        common.sync(device)
        t0 = time.perf_counter()
        t_old = 0.0
        if old_pass:
            old, _ = actor.compute_logprobs(batch_t)
            batch_t.extras["old_logp"] = old
            common.sync(device)
            t_old = time.perf_counter() - t0
        adv, _ = compute_advantages(
            "grpo", mask=batch_t.response_mask, scores=batch_t.scores, group_index=batch_t.group_index
        )
        batch_t.extras["advantages"] = adv
        # After the warm-up step, alternate the rank-group path (what Trainer.train runs) with a
        # direct worker call (the path before trainer ranks existed): same run, same model.
        path = (
            "group"
            if args.update_path == "group" or (args.update_path == "both" and step % 2 == 1)
            else "direct"
        )
        # --profile-step: this step's update, inside the loop
        with update_profiler(args.profile_step == step and device.type == "cuda") as prof:
            t_up = time.perf_counter()
            if path == "group":
                rows: dict[int, list[int]] = {}
                for i, gi in enumerate(batch_t.group_index.tolist()):
                    rows.setdefault(gi, []).append(i)
                (plan,) = split_rows(list(rows.values()), num_mini, 1)
                group_of_ranks.call("update", [((batch_t.select(plan), num_mini, epochs, True), {})])
            else:
                actor.update(batch_t, num_mini_batches=num_mini, epochs=epochs)
                actor.lr_step()
            common.sync(device)
            t_update = time.perf_counter() - t_up
        if prof is not None:
            write_profile(
                prof, f"{size} {job}: step {step} update ({path})", ("cuda_time_total", "cpu_time_total"), 30
            )
        t_train = time.perf_counter() - t0
        t0 = time.perf_counter()
        if args.weight_sync == "direct":  # what the trainer does in one process (full sync)
            engine.load_weights(list(actor.full_named_parameters()), step + 1)
        else:
            engine.update_weights(list(sender.full(actor.full_named_parameters(), step + 1)), step + 1)
        t_sync = time.perf_counter() - t0
        dt = time.perf_counter() - t_step
        resp = sum(len(c.token_ids) for c in comps)
        seq_lens = [len(c.prompt_ids) + len(c.token_ids) for c in comps]
        padded = batch_t.input_ids.numel()
        plens, rlens_real = row_lengths(batch_t)
        packed = padded_tokens(
            plens, rlens_real, token_micro_batches(plens, rlens_real, args.micro_batch_tokens)
        )
        flops = update_flops(cost, seq_lens) * (4 / 3 if old_pass else 1.0)
        per_sample_p = [p for p in p_lens for _ in range(group)]
        bound = rollout_bound(cost, per_sample_p, r_lens, read_bps, gemm, distinct_prompts=len(p_lens))
        steps.append(
            {
                "step_s": dt,
                "gen_s": t_gen,
                "train_s": t_train,
                "old_logprob_s": t_old,
                "sync_s": t_sync,
                "update_path": path,
                "update_s": t_update,
                "rollout_tokens_per_s": resp / t_gen,
                "rollout_fraction_of_bound": bound["bound_seconds"] / t_gen,
                "train_tokens_per_s": sum(seq_lens) / t_train,
                "e2e_completion_tokens_per_s": resp / dt,
                "mfu_update": flops / (t_train * gemm),
                "mfu_update_vs_datasheet_989": flops / (t_train * 989e12) if bf16 else None,
                "completion_tokens": resp,
                "update_tokens": sum(seq_lens),
                "padded_tokens": padded,
                "padding_fraction": 1 - sum(seq_lens) / padded,
                # what micro-batches of <= micro_batch_tokens padded tokens (trainer.packing) would leave
                "padding_fraction_token_microbatches": 1 - sum(seq_lens) / packed,
            }
        )
    if args.profile and device.type == "cuda":  # the last batch once more by each path, profiled

        def by_group() -> None:
            group_of_ranks.call("update", [((batch_t, num_mini, epochs, False), {})])

        def direct() -> None:
            actor.update(batch_t, num_mini_batches=num_mini, epochs=epochs)

        for name, fn in (("direct", direct), ("rank group", by_group)):
            with update_profiler(True) as prof:
                fn()
                common.sync(device)
            write_profile(prof, f"{size} {job}: one update ({name}), micro-batch {args.micro_batch}")
    engine_compiled = getattr(engine.decoder, "compiled", None)
    compile_error = getattr(engine.decoder, "compile_error", None)
    kernels_used = engine.decoder.kernels_used
    engine.shutdown()
    timed = steps[1:] if len(steps) > 1 else steps  # the first step compiles and captures
    avg = {
        k: sum(s[k] for s in timed) / len(timed)
        for k in timed[0]
        if isinstance(timed[0][k], (int, float)) and not isinstance(timed[0][k], bool)
    }
    by_path = {p: [s["update_s"] for s in timed if s["update_path"] == p] for p in ("group", "direct")}
    update_paths = {f"update_{p}_s": sum(v) / len(v) for p, v in by_path.items() if v}
    if len(update_paths) == 2:
        update_paths["group_over_direct"] = update_paths["update_group_s"] / update_paths["update_direct_s"]
    return {
        "size": size,
        "job": job,
        "params": cost.params,
        "batch": batch,
        "engine_compiled": engine_compiled,
        "compile_error": compile_error[-3000:] if compile_error else None,
        "kernels": kernels_used,
        "token_logprob": fused_kernel_problem(device) or "fused",
        "train_compiled_layers": actor.compiled_layers,
        "weight_sync": args.weight_sync,
        "old_logprob_pass": old_pass,
        "update_paths": update_paths,
        "micro_batch": args.micro_batch,
        "micro_batch_tokens": args.micro_batch_tokens if args.pack else 0,
        "first_step_s": steps[0]["step_s"] + engine_build_s,
        "steps": steps,
        "mean_after_warmup": avg,
        "step_s_median": statistics.median(s["step_s"] for s in timed),
        "mfu_update": avg["mfu_update"],
        "rollout_fraction_of_bound": avg["rollout_fraction_of_bound"],
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def head_bench(size: str, device: torch.device, tokens: int, repeats: int = 5) -> dict[str, Any]:
    """Log-prob + entropy of ``tokens`` response tokens through the LM head, forward + backward:
    the full float32 logits path (the actor before the fused kernel), the fused Triton kernels over
    the bf16 logits (``trainer.token_logprob``, what the actor runs on GPUs) and
    ``trainer.logprob.chunked_logprobs`` (the head itself in chunks)."""
    from rlkube.runtime.algos import entropy_from_logits, logprobs_from_logits
    from rlkube.runtime.models.tiny import qwen2_like_config
    from rlkube.runtime.trainer.logprob import chunked_logprobs
    from rlkube.runtime.trainer.token_logprob import _FusedTokenLogprob

    cfg = qwen2_like_config(size)
    g = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02).to(device).requires_grad_()
    hidden = torch.randn(tokens, cfg.hidden_size, generator=g).to(device, torch.bfloat16).requires_grad_()
    targets = torch.randint(0, cfg.vocab_size, (tokens,), generator=g).to(device)

    def full() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = torch.nn.functional.linear(hidden, weight)
        lp = logprobs_from_logits(logits[None], targets[None])
        with torch.no_grad():
            entropy_from_logits(logits.detach()[None])
        lp.sum().backward()

    def fused() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = torch.nn.functional.linear(hidden, weight)
        lp, _ = _FusedTokenLogprob.apply(logits, targets, 1.0)
        lp.sum().backward()

    def chunked() -> None:
        lp, ent = chunked_logprobs(hidden, weight, targets, with_entropy=True)
        (lp.sum() + 0.0 * ent.sum()).backward()

    out: dict[str, Any] = {"tokens": tokens, "vocab": cfg.vocab_size, "hidden": cfg.hidden_size}
    for name, fn in (("full_logits", full), ("fused", fused), ("chunked", chunked)):
        for _ in range(2):
            fn()
        common.sync(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(repeats):
            weight.grad, hidden.grad = None, None
            common.sync(device)
            t = time.perf_counter()
            fn()
            common.sync(device)
            times.append(time.perf_counter() - t)
        out[name] = {
            "seconds_median": statistics.median(times),
            "peak_extra_gib": (torch.cuda.max_memory_allocated(device) - base) / 2**30,
        }
    out["speedup"] = out["full_logits"]["seconds_median"] / out["chunked"]["seconds_median"]
    out["fused_speedup"] = out["full_logits"]["seconds_median"] / out["fused"]["seconds_median"]
    return out


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
        ds = Dataset.from_dict({"prompt": prompts * (args.trl_steps + 1)})

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
            max_steps=args.trl_steps,
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
                common.sync(device)
                self.t = time.perf_counter()

            def on_step_end(self, *a: Any, **k: Any) -> None:
                common.sync(device)
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
        step_s = statistics.median(timed)
        tokens = args.prompts * args.group * args.new_tokens
        return {
            "available": True,
            "version": trl.__version__,
            "step_s_median": step_s,
            "step_s_range": [min(timed), max(timed)],
            "timed_steps": len(timed),
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
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 3 steps (2 for rl)")
    p.add_argument("--sizes", default="0.5b,1.5b")
    p.add_argument("--jobs", default="today,rl")
    p.add_argument("--steps", type=int, default=4, help="rlkube steps per job (the first is warm-up)")
    p.add_argument("--rl-steps", type=int, default=3)
    p.add_argument(
        "--trl-steps", type=int, default=4, help="TRL steps (the first is warm-up; median of the rest)"
    )
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--rl-prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rl-max-response", type=int, default=1024)
    p.add_argument(
        "--micro-batch",
        type=int,
        default=64,
        help="today's job: sequences per pass (64: the whole batch in one pass, as TRL's step runs it)",
    )
    p.add_argument("--rl-micro-batch", type=int, default=8)
    p.add_argument("--no-trl", action="store_true")
    p.add_argument("--no-head-bench", action="store_true")
    p.add_argument("--head-tokens", type=int, default=5120, help="tokens of the LM-head logprob bench")
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=16384,
        help="token budget per pass: the padding estimate, and the actor's micro-batches with --pack",
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="micro-batches chosen by tokens (training.microBatchTokens = --micro-batch-tokens)",
    )
    p.add_argument(
        "--logprob-kernel",
        choices=["auto", "reference"],
        default="auto",
        help="token log-probs by the fused Triton kernels where they pass their check (auto) or "
        "by the float32 PyTorch path (reference: RLKUBE_FUSED_LOGPROB=0)",
    )
    p.add_argument("--profile", action="store_true", help="kernel table of one update (GPU)")
    p.add_argument(
        "--profile-step", type=int, default=-1, help="kernel table of this step's update, inside the loop"
    )
    p.add_argument("--compile", choices=sorted(COMPILE_CHOICES), default="auto", help="the rollout engine's")
    p.add_argument(
        "--train-compile", action="store_true", help="torch.compile the actor's decoder layers (training)"
    )
    p.add_argument(
        "--weight-sync",
        choices=["direct", "buckets"],
        default="direct",
        help="full sync by direct copy (the trainer's in-process path) or checksummed buckets",
    )
    p.add_argument(
        "--update-path",
        choices=["both", "group", "direct"],
        default="both",
        help="update through the rank group (Learner), by a direct worker call, or both alternating",
    )
    args = p.parse_args()
    if args.logprob_kernel == "reference":
        os.environ["RLKUBE_FUSED_LOGPROB"] = "0"
    if args.smoke:
        args.sizes, args.steps, args.rl_steps, args.prompts, args.rl_prompts, args.group = (
            "tiny",
            3,
            2,
            2,
            3,
            2,
        )
        args.prompt_len, args.new_tokens, args.micro_batch, args.no_trl, args.rl_max_response = (
            8,
            8,
            4,
            True,
            40,
        )
        torch.set_num_threads(1)
    common.import_rlkube()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    ceil = common.ceilings(device, args.smoke)
    out: dict[str, Any] = {
        "bench": "trainer-gpu",
        **common.run_info(device, ceil, args),
        "results": [],
    }
    out_dir = os.environ.get("OUT")
    ok = True
    for size in args.sizes.split(","):
        entry: dict[str, Any] = {"size": size}
        for job in args.jobs.split(","):
            a = argparse.Namespace(**vars(args))
            if job == "rl":  # 8 rows of up to ~1,350 tokens: the float32 logits of 16 would not fit at 1.5B
                a.steps, a.micro_batch = args.rl_steps, args.rl_micro_batch
            try:
                entry[job] = grpo_fitting_memory(size, job, a, device, ceil)
            except Exception as e:
                ok = False
                entry[job] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if device.type == "cuda" and not args.no_head_bench:
            try:
                entry["lm_head_logprob"] = head_bench(size, device, tokens=args.head_tokens)
            except Exception as e:
                entry["lm_head_logprob"] = {"error": f"{type(e).__name__}: {e}"}
            torch.cuda.empty_cache()
        today = entry.get("today", {})
        entry["mfu_update"] = today.get("mfu_update")
        if not args.no_trl and "today" in entry:
            entry["trl"] = t = trl_grpo(size, args, device)
            if "step_s_median" in today and "step_s_median" in t:
                entry["speedup_vs_trl_median"] = t["step_s_median"] / today["step_s_median"]
                entry["trl_step_s_range"] = t["step_s_range"]
                entry["speedup_vs_trl_range"] = [
                    t["step_s_range"][0] / today["step_s_median"],
                    t["step_s_range"][1] / today["step_s_median"],
                ]
        out["results"].append(entry)
        if out_dir:  # after every size, so a run cut short still leaves its results
            Path(out_dir, "trainer-gpu.json").write_text(json.dumps(out, indent=2))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(out, indent=2))
    for res in out["results"]:
        for job in args.jobs.split(","):
            r = res.get(job, {})
            if "error" in r:
                print(f"{res['size']} {job}: {r['error']}")
                continue
            m = r["mean_after_warmup"]
            frac = 100 * r["rollout_fraction_of_bound"]
            print(
                f"{res['size']:>5} {job:>5}: step {r['step_s_median']:.2f} s, "
                f"first {r['first_step_s']:.1f} s, "
                f"rollout {m['rollout_tokens_per_s']:.0f} tok/s = {frac:.1f}% of bound, "
                f"update MFU {100 * r['mfu_update']:.1f}%, padding {100 * m['padding_fraction']:.0f}%, "
                f"peak {r['peak_memory_gib'] or 0:.1f} GiB"
            )
            up = r["update_paths"]
            if "group_over_direct" in up:
                print(
                    f"{res['size']:>5} {job:>5}: update via rank group {up['update_group_s']:.3f} s, "
                    f"direct {up['update_direct_s']:.3f} s ({up['group_over_direct']:.3f}x)"
                )
        hb = res.get("lm_head_logprob", {})
        if "speedup" in hb:
            f, c = hb["full_logits"], hb["chunked"]
            ff = f"{1e3 * f['seconds_median']:.1f} ms +{f['peak_extra_gib']:.1f} GiB"
            cc = f"{1e3 * c['seconds_median']:.1f} ms +{c['peak_extra_gib']:.1f} GiB"
            u = hb["fused"]
            uu = f"{1e3 * u['seconds_median']:.1f} ms +{u['peak_extra_gib']:.1f} GiB"
            print(
                f"{res['size']:>5}  LM-head logprob fwd+bwd, {hb['tokens']} tokens: full {ff}, "
                f"fused {uu}, chunked {cc}"
            )
        if "speedup_vs_trl_median" in res:
            rng = res["trl_step_s_range"]
            print(
                f"{res['size']:>5}  vs TRL: {res['speedup_vs_trl_median']:.2f}x (TRL steps {rng} s; "
                f"host CPU {out['host_cpu']}: TRL's generate is bound by its kernel launches)"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
