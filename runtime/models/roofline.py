"""The honest bound of a decoder LM's rollout and update on one device: bytes and FLOPs it must move.

Benchmarks divide what they measure by these, with the device's ceilings measured in the same run
(``measure_read_bandwidth``: a read-only reduction; ``measure_gemm_flops``: a large dense matrix
product on random data), so a fraction of the bound means the same thing on every machine.

Decode step (one new token for each of ``live`` sequences):

- bytes: every weight once (an untied input embedding is only gathered, ``live`` rows, so it is
  left out; a tied one is read whole by the LM head), the KV cache of every live sequence over its
  whole context, the new K/V written, and the logits written once and read once by the sampler;
- FLOPs: ``2 x matmul parameters`` per token plus attention ``4 x layers x heads x head_dim x context``.

The step cannot be faster than ``max(bytes / read bandwidth, FLOPs / GEMM rate)``; a rollout's bound
is the sum of that over its steps (sequences finish at their own lengths, so the live batch
shrinks), plus each distinct prompt's prefill at the GEMM rate.

Update: ``6 x matmul parameters x tokens`` plus causal attention ``6 x layers x heads x head_dim x
L^2`` per sequence of length ``L`` (forward 2 x, backward 4 x); MFU is that over time x GEMM rate.
Recomputation (activation checkpointing, a chunked LM head's second pass) is not counted: it is
work a faster implementation would not do.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a decoder-only LM (from its HF config)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # all parameters (tied embedding counted once)
    matmul_params: int  # parameters multiplied per token: everything but an untied input embedding
    weight_bytes_per_step: int  # weights a decode step reads
    kv_bytes_per_token: int  # K and V of one position, all layers
    dtype_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_cost(config: Any, dtype_bytes: int = 2) -> ModelCost:
    """Cost model of a Qwen2/Llama-style config (attention q/k/v/o, gated MLP, RMSNorm, LM head)."""
    h = int(config.hidden_size)
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    d = int(getattr(config, "head_dim", None) or h // heads)
    inter = int(config.intermediate_size)
    vocab = int(config.vocab_size)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    bias = bool(getattr(config, "attention_bias", False)) or getattr(config, "model_type", "") == "qwen2"
    attn = h * heads * d + 2 * h * kv * d + heads * d * h + ((heads + 2 * kv) * d if bias else 0)
    mlp = 3 * h * inter
    per_layer = attn + mlp + 2 * h  # + the two norms
    body = layers * per_layer + h  # + the final norm
    embed = vocab * h
    params = body + embed + (0 if tied else vocab * h)
    matmul = body + vocab * h  # the LM head (the tied embedding is this same matrix)
    return ModelCost(
        layers=layers,
        hidden=h,
        heads=heads,
        kv_heads=kv,
        head_dim=d,
        vocab=vocab,
        params=params,
        matmul_params=matmul,
        weight_bytes_per_step=matmul * dtype_bytes,
        kv_bytes_per_token=2 * layers * kv * d * dtype_bytes,
        dtype_bytes=dtype_bytes,
    )


def decode_step_bytes(cost: ModelCost, live: int, context_sum: int) -> float:
    """Bytes one decode step moves: weights, the KV of ``context_sum`` positions, new KV, logits."""
    kv_read = cost.kv_bytes_per_token * context_sum
    kv_write = cost.kv_bytes_per_token * live
    logits = 2 * live * cost.vocab * cost.dtype_bytes  # written by the LM head, read by the sampler
    return float(cost.weight_bytes_per_step + kv_read + kv_write + logits)


def decode_step_flops(cost: ModelCost, live: int, context_sum: int) -> float:
    return float(2 * cost.matmul_params * live + 4 * cost.layers * cost.heads * cost.head_dim * context_sum)


def prefill_flops(cost: ModelCost, prompt_len: int) -> float:
    """One prompt's forward (causal attention counted as half the square). The LM head runs on
    the last position only: the first token needs no other logits (until stop 38 the bound
    counted it at every position, 15% of the 1.5B's FLOPs and 27% of the 0.5B's)."""
    head = cost.vocab * cost.hidden
    attn = 2 * cost.layers * cost.heads * cost.head_dim * prompt_len * prompt_len
    return float(2 * (cost.matmul_params - head) * prompt_len + 2 * head + attn)


def rollout_bound(
    cost: ModelCost,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    read_bytes_per_s: float,
    flops_per_s: float,
    distinct_prompts: int | None = None,
    prompt_groups: Sequence[int] | None = None,
) -> dict[str, float]:
    """Fastest possible time for a batch of samples decoded together, and which bound binds.

    Sample ``i`` has prompt ``prompt_lens[i]`` and generates ``response_lens[i]`` tokens: the first
    from the prefill, token ``j >= 1`` from a decode step over ``prompt + j`` positions. All start
    together (one batch); a step's live set is every sample still generating. Prefill: one per
    prompt group, of its own length; without groups ``distinct_prompts`` of the mean prompt
    length (default one per sample).
    With ``prompt_groups`` (a group id per sample, one prompt per group) a step reads each
    group's prompt K/V once while any of its samples is live, as a kernel that shares it can:
    a tighter memory bound (the attention FLOPs stay per sample).
    """
    if len(prompt_lens) != len(response_lens) or not response_lens:
        raise ValueError("prompt_lens and response_lens must be non-empty and of equal length")
    steps = max(response_lens)
    # live[j] and context sums by difference arrays: O(samples + steps)
    live_delta = [0] * (steps + 1)
    ctx_delta = [0] * (steps + 1)  # sum of prompt lengths of the samples live at step j
    read_delta = [0] * (steps + 1)  # ... of the prompts read at step j
    group_end: dict[int, tuple[int, int]] = {}  # group -> (prompt, last step + 1)
    for i, (p, n) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        if n > 1:
            live_delta[1] += 1
            live_delta[n] -= 1
            ctx_delta[1] += p
            ctx_delta[n] -= p
            if prompt_groups is None:
                read_delta[1] += p
                read_delta[n] -= p
            else:
                g = prompt_groups[i]
                group_p, group_n = group_end.get(g, (p, 0))
                if group_p != p:
                    raise ValueError(f"prompt group {g} has prompts of different lengths")
                group_end[g] = (p, max(n, group_n))
    for p, end in group_end.values():
        read_delta[1] += p
        read_delta[end] -= p
    t_mem = t_flop = t_bound = 0.0
    live = psum = rsum = 0
    mem_bound_steps = 0
    for j in range(1, steps):
        live += live_delta[j]
        psum += ctx_delta[j]
        rsum += read_delta[j]
        ctx = psum + live * j  # positions attended: prompt + j (+ the new token, written)
        tm = decode_step_bytes(cost, live, rsum + live * j) / read_bytes_per_s
        tf = decode_step_flops(cost, live, ctx) / flops_per_s
        t_mem += tm
        t_flop += tf
        t_bound += max(tm, tf)
        mem_bound_steps += tm >= tf
    if group_end:  # each group's own prompt
        t_prefill = sum(prefill_flops(cost, p) for p, _ in group_end.values()) / flops_per_s
    else:
        n_prompts = distinct_prompts if distinct_prompts is not None else len(prompt_lens)
        mean_p = sum(prompt_lens) / len(prompt_lens)
        t_prefill = n_prompts * prefill_flops(cost, round(mean_p)) / flops_per_s
    tokens = float(sum(response_lens))
    total = t_bound + t_prefill
    return {
        "tokens": tokens,
        "decode_steps": float(steps - 1),
        "bound_seconds": total,
        "bound_tokens_per_s": tokens / total,
        "memory_seconds": t_mem,
        "compute_seconds": t_flop,
        "prefill_seconds": t_prefill,
        "memory_bound_step_fraction": mem_bound_steps / max(steps - 1, 1),
    }


def update_flops(cost: ModelCost, seq_lens: Sequence[int]) -> float:
    """FLOPs of one forward + backward over sequences of these lengths (no padding counted)."""
    tokens = sum(seq_lens)
    attn = 6 * cost.layers * cost.heads * cost.head_dim * sum(n * n for n in seq_lens)
    return float(6 * cost.matmul_params * tokens + attn)


# ---- the device's ceilings, measured in the run that uses them ----------------------------------
def _timed(device: torch.device, fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` (device events on CUDA, wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_read_bandwidth(device: torch.device, nbytes: int = 4 << 30, iters: int = 10) -> dict[str, float]:
    """Read-only bandwidth: a float32 sum over ``nbytes`` (>= 4 GiB on a GPU: far past any cache)."""
    x = torch.rand(nbytes // 4, device=device)
    seconds = _timed(device, lambda: x.sum(), iters)
    return {"read_bytes": float(nbytes), "seconds": seconds, "read_GBps": nbytes / seconds / 1e9}


def measure_copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, iters: int = 10) -> dict[str, float]:
    """A device-to-device copy, bytes read + written per second (for reference; not the bound)."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(device, lambda: dst.copy_(src), iters)
    return {"copy_bytes": float(nbytes), "seconds": seconds, "read_write_GBps": 2 * nbytes / seconds / 1e9}


def measure_gemm_flops(
    device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16, iters: int = 10
) -> dict[str, Any]:
    """Dense ``n x n x n`` matrix product on random data (never zeros: they run faster)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device, dtype)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    seconds = _timed(device, lambda: a @ b, iters)
    flops = 2.0 * n**3
    return {"n": float(n), "dtype": str(dtype), "seconds": seconds, "TFLOPs": flops / seconds / 1e12}


def measure_ceilings(device: torch.device, small: bool = False) -> dict[str, Any]:
    """Read bandwidth, copy bandwidth and GEMM rate; ``small`` for CPU smoke runs (seconds)."""
    if small or device.type != "cuda":
        return {
            "read": measure_read_bandwidth(device, 64 << 20, iters=5),
            "copy": measure_copy_bandwidth(device, 32 << 20, iters=5),
            "gemm": measure_gemm_flops(device, 256, torch.float32, iters=5),
        }
    return {
        "read": measure_read_bandwidth(device),
        "copy": measure_copy_bandwidth(device),
        "gemm": measure_gemm_flops(device),
    }
