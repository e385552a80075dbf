"""The cost model behind every GPU fraction-of-bound: parameter counts, bytes and FLOPs per step."""

from __future__ import annotations

import pytest
import torch

from rlkube.runtime.models.roofline import (
    decode_step_bytes,
    decode_step_flops,
    model_cost,
    prefill_flops,
    rollout_bound,
    update_flops,
)
from rlkube.runtime.models.tiny import qwen2_like_config, tiny_qwen2_config


@pytest.mark.parametrize("cfg", [qwen2_like_config("0.5b"), qwen2_like_config("7b"), tiny_qwen2_config(64)])
def test_parameter_count_matches_the_real_model(cfg: object) -> None:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    cost = model_cost(cfg)
    assert cost.params == sum(p.numel() for p in model.parameters())
    tied = cfg.tie_word_embeddings  # type: ignore[attr-defined]
    # an untied input embedding is only gathered: not read whole, not multiplied
    assert cost.matmul_params == cost.params - (0 if tied else cost.vocab * cost.hidden)


def test_rollout_bound_of_equal_lengths_is_the_closed_form() -> None:
    cost = model_cost(qwen2_like_config("0.5b"))
    bw, flops = 4e12, 800e12
    n, p, t = 64, 64, 256
    b = rollout_bound(cost, [p] * n, [t] * n, bw, flops, distinct_prompts=8)
    want = 0.0
    for j in range(1, t):
        ctx = n * (p + j)
        want += max(decode_step_bytes(cost, n, ctx) / bw, decode_step_flops(cost, n, ctx) / flops)
    assert b["tokens"] == n * t and b["decode_steps"] == t - 1
    assert b["bound_seconds"] == pytest.approx(want + b["prefill_seconds"])
    assert b["memory_bound_step_fraction"] == 1.0  # batch 64 decode of a 0.5B model reads, not computes
    # weights dominate: at most the weights-only rate
    assert b["bound_tokens_per_s"] < n / (cost.weight_bytes_per_step / bw)


def test_a_shared_prompt_is_read_once_per_group_while_any_sample_lives() -> None:
    cost = model_cost(qwen2_like_config("0.5b"))
    bw, flops = 4e12, 800e12
    n, p, t = 64, 64, 256
    groups = [i // 8 for i in range(n)]
    b = rollout_bound(cost, [p] * n, [t] * n, bw, flops, distinct_prompts=8, prompt_groups=groups)
    want = 0.0
    for j in range(1, t):
        read = decode_step_bytes(cost, n, n // 8 * p + n * j) / bw  # 8 prompts, 64 own parts
        want += max(read, decode_step_flops(cost, n, n * (p + j)) / flops)  # attention: per sample
    assert b["bound_seconds"] == pytest.approx(want + b["prefill_seconds"])
    assert b["bound_seconds"] < rollout_bound(cost, [p] * n, [t] * n, bw, flops, 8)["bound_seconds"]
    # a group's prompt is read until its last sample stops; the short sample adds only its own
    # part, its new K/V and its logits, for its 9 steps
    short = rollout_bound(cost, [p] * 2, [50, 10], bw, flops, prompt_groups=[0, 0])
    alone = rollout_bound(cost, [p], [50], bw, flops)
    assert short["memory_seconds"] == pytest.approx(
        alone["memory_seconds"]
        + 9 * (decode_step_bytes(cost, 1, 0) - decode_step_bytes(cost, 0, 0)) / bw
        + sum(cost.kv_bytes_per_token * j for j in range(1, 10)) / bw
    )
    with pytest.raises(ValueError, match="prompt group 0 has prompts of different lengths"):
        rollout_bound(cost, [p, p + 1], [t, t], bw, flops, prompt_groups=[0, 0])


def test_samples_that_finish_early_leave_the_live_batch() -> None:
    cost = model_cost(qwen2_like_config("0.5b"))
    long_only = rollout_bound(cost, [64] * 2, [100, 100], 4e12, 800e12)
    mixed = rollout_bound(cost, [64] * 2, [100, 10], 4e12, 800e12)
    # same number of steps (the longest sample), fewer bytes: the short one stops reading its KV
    assert mixed["decode_steps"] == long_only["decode_steps"]
    assert mixed["memory_seconds"] < long_only["memory_seconds"]
    with pytest.raises(ValueError):
        rollout_bound(cost, [1], [], 1.0, 1.0)


def test_update_flops_count_real_tokens_and_causal_attention() -> None:
    cost = model_cost(qwen2_like_config("1.5b"))
    f = update_flops(cost, [100, 300])
    attn = 6 * cost.layers * cost.heads * cost.head_dim * (100**2 + 300**2)
    assert f == 6 * cost.matmul_params * 400 + attn


def test_prefill_runs_the_lm_head_on_the_last_position_only() -> None:
    cost = model_cost(qwen2_like_config("1.5b"))
    head = cost.vocab * cost.hidden
    body_flops = 2 * (cost.matmul_params - head)
    attn = 2 * cost.layers * cost.heads * cost.head_dim  # per squared position
    assert prefill_flops(cost, 64) == body_flops * 64 + 2 * head + attn * 64 * 64
    # with prompt groups, each group's prefill is of its own prompt's length
    bw, flops = 4e12, 800e12
    b = rollout_bound(cost, [64, 64, 320, 320], [8, 8, 8, 8], bw, flops, prompt_groups=[0, 0, 1, 1])
    assert b["prefill_seconds"] == pytest.approx((prefill_flops(cost, 64) + prefill_flops(cost, 320)) / flops)
