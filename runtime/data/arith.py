"""The tiny verifiable task: ``"12+7="`` -> ``"19"``, scored by the ``arith`` reward."""

from __future__ import annotations

import random

from rlkube.runtime.data.records import Record

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_arith_records(
    n: int, *, seed: int, max_operand: int = 20, ops: str = "+-", allow_negative: bool = False
) -> list[Record]:
    """``n`` distinct prompts ``"a<op>b="`` (operands in ``0..max_operand``) with the integer answer.

    Without ``allow_negative``, subtractions are only drawn with ``a >= b``. Deterministic in ``seed``;
    raises if fewer than ``n`` distinct prompts exist.
    """
    bad = set(ops) - set(_OPS)
    if bad or not ops:
        raise ValueError(f"ops must be drawn from {''.join(_OPS)!r}, got {ops!r}")
    space = [
        (a, op, b)
        for op in dict.fromkeys(ops)
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if allow_negative or op != "-" or a >= b
    ]
    if n > len(space):
        raise ValueError(
            f"only {len(space)} distinct prompts exist for max_operand={max_operand}, ops={ops!r}"
        )
    chosen = random.Random(seed).sample(space, n)
    return [
        Record(prompt=f"{a}{op}{b}=", answer=str(_OPS[op](a, b)), extra={"task": "arith"})
        for a, op, b in chosen
    ]
