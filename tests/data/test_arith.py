"""The tiny arithmetic task's records."""

from __future__ import annotations

import pytest

from rlkube.runtime.data import make_arith_records


def test_records_are_correct_distinct_and_deterministic() -> None:
    recs = make_arith_records(200, seed=3, max_operand=20, ops="+-")
    assert len({r.prompt for r in recs}) == 200
    for r in recs:
        assert r.prompt.endswith("=")
        body = r.prompt[:-1]
        op = "+" if "+" in body else "-"
        a, b = (int(x) for x in body.split(op))
        assert 0 <= a <= 20 and 0 <= b <= 20
        assert int(r.answer) == (a + b if op == "+" else a - b)
        assert int(r.answer) >= 0
    assert make_arith_records(200, seed=3) == recs
    assert make_arith_records(200, seed=4) != recs


def test_space_limits_and_negative_option() -> None:
    assert len(make_arith_records(4, seed=0, max_operand=1, ops="+")) == 4
    with pytest.raises(ValueError, match="only 4 distinct"):
        make_arith_records(5, seed=0, max_operand=1, ops="+")
    # a >= b for '-': (0-0, 1-0, 1-1) = 3; with negatives all 4
    assert len(make_arith_records(3, seed=0, max_operand=1, ops="-")) == 3
    with pytest.raises(ValueError, match="only 3"):
        make_arith_records(4, seed=0, max_operand=1, ops="-")
    neg = make_arith_records(4, seed=0, max_operand=1, ops="-", allow_negative=True)
    assert {(r.prompt, r.answer) for r in neg} == {
        ("0-0=", "0"),
        ("0-1=", "-1"),
        ("1-0=", "1"),
        ("1-1=", "0"),
    }
    with pytest.raises(ValueError, match="ops"):
        make_arith_records(1, seed=0, ops="/")
