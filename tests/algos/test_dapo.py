"""DAPO overlong penalty and dynamic sampling."""

from __future__ import annotations

import pytest
import torch

from rlkube.runtime.algos import (
    DynamicSamplingBuffer,
    DynamicSamplingExhaustedError,
    dynamic_sampling_keep,
    overlong_penalty,
)

torch.set_num_threads(1)


def test_overlong_penalty_by_hand() -> None:
    # max 20, buffer 4: free up to 16 tokens, then -1/4 per token down to -1 at 20.
    out = overlong_penalty(torch.tensor([10, 16, 17, 18, 20]), 20, 4, 1.0)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])
    assert overlong_penalty(torch.tensor([18]), 20, 4, 0.5).item() == pytest.approx(-0.25)


def test_overlong_penalty_rejects_a_bad_buffer() -> None:
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([1]), 20, 0, 1.0)


def test_keep_drops_zero_variance_and_singleton_groups() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert dynamic_sampling_keep(rewards, groups).tolist() == [False, False, True, True, False, False, False]


def test_buffer_accumulates_kept_groups_across_generation_batches() -> None:
    buf: DynamicSamplingBuffer[str] = DynamicSamplingBuffer(target_groups=2, max_num_gen_batches=3)
    # batch 1: group 0 all right (dropped), group 1 mixed (kept)
    assert not buf.add(
        ["a0", "a1", "b0", "b1"], torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    )
    assert buf.num_groups == 1 and buf.num_dropped_groups == 1
    # batch 2 reuses group ids 0/1: they are new groups; both mixed -> full (one surplus)
    assert buf.add(["c0", "c1", "d0", "d1"], torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]))
    assert buf.num_gen_batches == 2
    assert buf.take() == [["b0", "b1"], ["c0", "c1"]]
    assert buf.num_groups == 0 and buf.num_gen_batches == 0


def test_buffer_raises_when_max_gen_batches_is_reached() -> None:
    buf: DynamicSamplingBuffer[int] = DynamicSamplingBuffer(target_groups=1, max_num_gen_batches=2)
    same = torch.tensor([1.0, 1.0])
    ids = torch.tensor([0, 0])
    assert not buf.add([1, 2], same, ids)
    with pytest.raises(DynamicSamplingExhaustedError, match="max_num_gen_batches=2"):
        buf.add([3, 4], same, ids)


def test_buffer_without_limit_keeps_going_and_take_needs_full() -> None:
    buf: DynamicSamplingBuffer[int] = DynamicSamplingBuffer(target_groups=1, max_num_gen_batches=0)
    for _ in range(10):
        assert not buf.add([1, 2], torch.tensor([0.0, 0.0]), torch.tensor([5, 5]))
    with pytest.raises(RuntimeError, match="0 of 1"):
        buf.take()
    with pytest.raises(ValueError, match="one entry per sample"):
        buf.add([1], torch.tensor([0.0, 1.0]), torch.tensor([0, 0]))
