"""MATH reward with real math-verify in spawned workers, and the pool's per-item timeout for real."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from rewards._slow_verify import slow_verify
from rlkube.runtime.rewards import get_reward_fn
from rlkube.runtime.rewards.math_reward import MathReward, MathVerifyPool


def _running_children(grace_s: float = 10.0) -> list[int]:
    """Pids of this process's multiprocessing children that still exist as OS processes (running
    or unreaped), after up to ``grace_s`` for a killed one to finish exiting on a loaded machine.

    Checked in /proc, not by multiprocessing's own bookkeeping: a child it lost track of (reaped by
    some other waiter in this process) stays listed as alive there though it is gone.
    """
    deadline = time.monotonic() + grace_s
    while True:
        pids = [p.pid for p in multiprocessing.active_children() if p.pid and Path(f"/proc/{p.pid}").exists()]
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.2)


def test_string_match_needs_no_subprocess() -> None:
    m = MathReward(use_math_verify=False)
    res = m([""] * 3, ["so \\boxed{\\dfrac{1}{2}}", "\\boxed{3}", "no box at all"], ["\\frac12", "4", "1"])
    assert [r.score for r in res] == [1.0, 0.0, 0.0]
    assert [r.extra["matched_by"] for r in res] == ["string", "string", "no_box"]
    assert m.pool._pool is None  # never started


def test_math_verify_equivalence_and_a_real_slow_expression_times_out() -> None:
    m = get_reward_fn("math", workers=1, timeout_s=3.0)
    assert isinstance(m, MathReward)
    try:
        responses = [
            "\\boxed{0.5}",  # = 1/2 only symbolically
            "\\boxed{x^2+2x}",
            "\\boxed{3}",
            "\\boxed{9^{9^{9}}}",  # sympy grinds on this (math-verify gives up after 5 s): killed at 3 s
            "\\boxed{2}",
        ]
        truths = ["\\frac{1}{2}", "2x+x^2", "4", "1", "2"]
        t0 = time.monotonic()
        res = m([""] * 5, responses, truths)
        elapsed = time.monotonic() - t0
        assert [r.score for r in res] == [1.0, 1.0, 0.0, 0.0, 1.0]
        assert res[0].extra["matched_by"] == "math_verify"
        assert res[3].extra["error"] == "timeout"
        assert m.pool.recycles == 1
        assert elapsed < 90
    finally:
        m.close()
    assert _running_children() == []


def test_hung_item_scores_zero_pool_is_recycled_and_the_rest_still_score() -> None:
    pool = MathVerifyPool(workers=2, timeout_s=3.0, verify_fn=slow_verify)
    try:
        t0 = time.monotonic()
        out = pool.map([("hang", "1"), ("two", "2"), ("nope", "2"), ("two", "2")])
        assert out == [(False, "timeout"), (True, None), (False, None), (True, None)]
        assert pool.recycles == 1
        assert time.monotonic() - t0 < 60  # far less than the 120 s the hung item would sleep
        assert pool.map([("two", "2")]) == [(True, None)]  # the rebuilt pool works
    finally:
        pool.close()
    assert _running_children() == []


def test_a_worker_that_dies_only_fails_its_own_item() -> None:
    pool = MathVerifyPool(workers=2, timeout_s=5.0, verify_fn=slow_verify)
    try:
        out = pool.map([("two", "2"), ("die", "2"), ("two", "2"), ("x", "2")])
        assert out == [(True, None), (False, "worker died"), (True, None), (False, None)]
    finally:
        pool.close()


def test_pool_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifyPool(timeout_s=0)
