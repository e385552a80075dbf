"""The tiny verifiable task: ``"12+7="`` -> ``"19"``."""

from __future__ import annotations

from rlkube.runtime.data.records import Record


def make_arith_records(n: int, *, seed: int, max_operand: int = 20, ops: str = "+-") -> list[Record]:
    """``n`` distinct arithmetic prompts ``"a<op>b="`` with their integer answers."""
    raise NotImplementedError
