"""The batch split over trainer ranks (pure) and the engine balancer over two real hf engines."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkube.runtime.distributed.pool import EnginePool
from rlkube.runtime.distributed.ranks import PAD, SplitError, split_rows
from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    world=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 3),
    num_mini=st.integers(1, 4),
    group_size=st.integers(1, 4),
)
def test_each_rank_gets_an_equal_share_of_every_mini_batch(
    world: int, per_rank: int, num_mini: int, group_size: int
) -> None:
    n = world * per_rank * num_mini
    groups = [list(range(g * group_size, (g + 1) * group_size)) for g in range(n)]
    plan = split_rows(groups, num_mini, world)
    assert len(plan) == world
    assert sorted(i for rows in plan for i in rows) == list(range(n * group_size))  # every row once
    assert len({len(rows) for rows in plan}) == 1  # equal passes on every rank
    rows_per_mini = len(plan[0]) // num_mini
    for m in range(num_mini):  # the ranks' m-th slices together are exactly mini-batch m
        got = sorted(i for rows in plan for i in rows[m * rows_per_mini : (m + 1) * rows_per_mini])
        want = sorted(i for g in groups[m * n // num_mini : (m + 1) * n // num_mini] for i in g)
        assert got == want
    for rows in plan:  # whole groups only
        assert all(rows[k] // group_size == rows[k - k % group_size] // group_size for k in range(len(rows)))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    world=st.sampled_from([1, 2, 3, 4]),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=12),
    mini_size=st.integers(1, 4),
)
def test_an_uneven_batch_is_padded_so_every_rank_runs_equal_passes(
    world: int, sizes: list[int], mini_size: int
) -> None:
    """Groups shortened or lost to ``data.nonFiniteReward: skip``: whole groups, every mini-batch
    intact, padding only to even out the ranks."""
    groups, start = [], 0
    for n in sizes:
        groups.append(list(range(start, start + n)))
        start += n
    num_mini = max(1, round(len(groups) / mini_size))
    plan = split_rows(groups, num_mini, world)
    assert len({len(rows) for rows in plan}) == 1  # equal passes on every rank
    assert sorted(i for rows in plan for i in rows if i != PAD) == list(range(start))  # every row once
    width = len(plan[0]) // num_mini
    owner = {i: g for g, rows in enumerate(groups) for i in rows}
    for m in range(num_mini):
        got = sorted(i for rows in plan for i in rows[m * width : (m + 1) * width] if i != PAD)
        lo, hi = m * len(groups) // num_mini, (m + 1) * len(groups) // num_mini
        assert got == sorted(i for g in groups[lo:hi] for i in g)
        for rows in plan:  # whole groups: a group's rows sit on one rank
            mine = {owner[i] for i in rows[m * width : (m + 1) * width] if i != PAD}
            assert all(set(groups[g]) <= set(rows) for g in mine)


def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(SplitError, match="nothing to split"):
        split_rows([], 1, 2)


@pytest.fixture(scope="module")
def engines(tiny_task: Any) -> Any:
    from rlkube.runtime.rollout.hf import HFEngine

    made = [HFEngine(tiny_task.model_dir, dtype="float32", num_slots=16, max_seq_len=16) for _ in range(2)]
    yield made
    for e in made:
        e.shutdown()


def _requests(k: int, n: int = 4, max_tokens: int = 4) -> list[RolloutRequest]:
    return [
        RolloutRequest(f"r{i}", [1, 5, 6, 13], SamplingParams(n=n, max_tokens=max_tokens, seed=i))
        for i in range(k)
    ]


def test_balancer_spreads_whole_groups_and_resumes_partials_anywhere(engines: Any) -> None:
    pool = EnginePool(engines, ["a", "b"])
    out = pool.generate(_requests(6))
    assert [c.request_id for c in out] == [f"r{i}" for i in range(6) for _ in range(4)]  # request order
    load = pool.load_metrics()
    assert load["rollout/engines"] == 2
    assert load["rollout/engine_load/a"] == load["rollout/engine_load/b"] == 3  # least loaded first
    # Abort mid-generation: partials come back from both engines and resume on any of them.
    pool.submit(_requests(4, max_tokens=12))
    partial = [c for c in pool.abort_all() if c.finish_reason == "abort"]
    assert partial  # aborted right after submission: in flight on both engines
    pool.resume(partial)
    done: list[Any] = []
    deadline = time.monotonic() + 120
    while pool.num_in_flight() and time.monotonic() < deadline:
        done.extend(pool.poll())
        time.sleep(0.02)
    done.extend(pool.poll())
    assert {c.key for c in done} >= {c.key for c in partial}
    assert all(c.finish_reason != "abort" for c in done)
    assert pool.outstanding == [0, 0]
