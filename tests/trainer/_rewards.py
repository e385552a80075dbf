"""Reward functions for trainer tests (``data.reward: trainer._rewards:<name>``, local runs only).

``alternating``: a prompt whose character codes sum to an even number scores 0 for every sample
(a zero-variance group); any other prompt's samples score 0, 1, 0, 1, ... in the order they are
scored, so a group of 4 holds exactly two 1s and its mean reward is exactly 0.5.
"""

from __future__ import annotations

import math
from collections import Counter

_seen: Counter[str] = Counter()


def degenerate(prompt: str) -> bool:
    return sum(map(ord, prompt)) % 2 == 0


def alternating(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    out = []
    for p in prompts:
        if degenerate(p):
            out.append(0.0)
        else:
            out.append(float(_seen[p] % 2))
            _seen[p] += 1
    return out


def constant(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    return [0.0] * len(prompts)


def nan_on_degenerate(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """NaN for the 'degenerate' prompts, the arith reward's 0/1 elsewhere."""
    return [
        math.nan if degenerate(p) else float(r.strip() == a.strip())
        for p, r, a in zip(prompts, responses, answers, strict=True)
    ]
