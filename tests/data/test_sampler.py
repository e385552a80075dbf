"""PromptSampler: deterministic epochs and exact resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rlkube.runtime.data import PromptSampler, Record

RECS = [Record(f"p{i}", str(i)) for i in range(10)]


def _prompts(batches: list[list[Record]]) -> list[str]:
    return [r.prompt for b in batches for r in b]


def test_each_epoch_visits_every_record_once_across_batch_boundaries() -> None:
    s = PromptSampler(RECS, batch_size=3, seed=0)
    seen = _prompts([s.next_batch() for _ in range(10)])  # 30 = 3 epochs; batches straddle epochs
    for epoch in range(3):
        assert Counter(seen[epoch * 10 : (epoch + 1) * 10]) == Counter(r.prompt for r in RECS)
    assert s.epoch == 2 and s.position == 10
    assert seen[:10] != seen[10:20]  # reshuffled per epoch


def test_same_seed_same_stream_and_no_shuffle_is_in_order() -> None:
    a = PromptSampler(RECS, 4, seed=5)
    b = PromptSampler(RECS, 4, seed=5)
    assert [a.next_batch() for _ in range(6)] == [b.next_batch() for _ in range(6)]
    c = PromptSampler(RECS, 4, seed=6)
    assert (
        _prompts([c.next_batch() for _ in range(3)])[:10]
        != _prompts([PromptSampler(RECS, 4, seed=5).next_batch() for _ in range(3)])[:10]
    )
    plain = PromptSampler(RECS, 4, shuffle=False)
    assert _prompts([plain.next_batch() for _ in range(3)]) == [f"p{i}" for i in [*range(10), 0, 1]]


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 7])
def test_resume_continues_exactly_where_it_stopped(stop_after: int) -> None:
    reference = PromptSampler(RECS, 3, seed=11)
    expected = _prompts([reference.next_batch() for _ in range(12)])

    first = PromptSampler(RECS, 3, seed=11)
    got = _prompts([first.next_batch() for _ in range(stop_after)])
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = PromptSampler(RECS, 3, seed=0)  # a fresh process; seed comes from the state
    resumed.load_state_dict(state)
    got += _prompts([resumed.next_batch() for _ in range(12 - stop_after)])
    assert got == expected


def test_resume_over_a_different_dataset_is_refused() -> None:
    s = PromptSampler(RECS, 3)
    s.next_batch()
    with pytest.raises(ValueError, match="10 records"):
        PromptSampler(RECS[:9], 3).load_state_dict(s.state_dict())


def test_batch_larger_than_the_dataset_spans_epochs() -> None:
    s = PromptSampler(RECS[:3], 7, seed=0)
    batch = s.next_batch()
    assert len(batch) == 7 and Counter(r.prompt for r in batch[:6]) == Counter(["p0", "p1", "p2"] * 2)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one"):
        PromptSampler([], 1)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(RECS, 0)
