"""Rule-based rewards that need no subprocess: gsm8k, dapo, geo3k, arith."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from rlkube.runtime.rewards.base import RewardResult, check_batch
from rlkube.runtime.rewards.extract import answers_match, last_boxed, strip_boxed

_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_TAIL_CHARS = 300  # the answer must sit near the end, as in verl's strict mode
_DAPO_TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")
_GEO3K_FORMAT = re.compile(r"\s*<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_LEADING_INT = re.compile(r"\s*(-?\d+)")


def _canon_number(s: str) -> str:
    s = s.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return s
    return format(d.normalize(), "f") if d == d.to_integral_value() else str(d.normalize())


def gsm8k_extract(response: str) -> str | None:
    """The last ``#### <number>`` in the response's tail (strict format), commas/$ removed."""
    found = _GSM8K_STRICT.findall(response[-_GSM8K_TAIL_CHARS:])
    return _canon_number(found[-1]) if found else None


def gsm8k_reward(prompts: list[str], responses: list[str], ground_truths: list[str]) -> list[RewardResult]:
    """GSM8K (Cobbe et al. 2021): 1.0 if the answer after ``####`` equals the reference number, else 0.0.

    The reference may be the bare number or the dataset's full solution ending ``#### n``.
    """
    check_batch(prompts, responses, ground_truths)
    out = []
    for response, truth in zip(responses, ground_truths, strict=True):
        truth_num = _canon_number(truth.split("####")[-1])
        pred = gsm8k_extract(response)
        ok = pred is not None and pred == truth_num
        out.append(RewardResult(score=1.0 if ok else 0.0, accuracy=ok, extra={"pred": pred}))
    return out


def dapo_extract(response: str) -> str | None:
    """The last ``Answer: ...`` line in the tail, else the last ``\\boxed{}``."""
    tail = response[-_DAPO_TAIL_CHARS:]
    lines = _ANSWER_LINE.findall(tail)
    if lines:
        ans = lines[-1].strip()
        boxed = last_boxed(ans)
        return boxed if boxed is not None else ans
    return last_boxed(response)


def dapo_reward(prompts: list[str], responses: list[str], ground_truths: list[str]) -> list[RewardResult]:
    """DAPO-Math (Yu et al. 2025, sec. 2.4): +1 if the final answer matches, -1 otherwise (incl. none)."""
    check_batch(prompts, responses, ground_truths)
    out = []
    for response, truth in zip(responses, ground_truths, strict=True):
        pred = dapo_extract(response)
        ok = pred is not None and answers_match(pred, strip_boxed(truth))
        out.append(RewardResult(score=1.0 if ok else -1.0, accuracy=ok, extra={"pred": pred}))
    return out


def geo3k_reward(prompts: list[str], responses: list[str], ground_truths: list[str]) -> list[RewardResult]:
    """Geometry3K as verl scores it: ``0.9 * accuracy + 0.1 * format``.

    format: ``<think>...</think>`` followed by a ``\\boxed{}``; accuracy: the boxed answer matches.
    """
    check_batch(prompts, responses, ground_truths)
    out = []
    for response, truth in zip(responses, ground_truths, strict=True):
        fmt = 1.0 if _GEO3K_FORMAT.fullmatch(response) else 0.0
        pred = last_boxed(response)
        acc = 1.0 if pred is not None and answers_match(pred, strip_boxed(truth)) else 0.0
        out.append(
            RewardResult(score=0.9 * acc + 0.1 * fmt, accuracy=acc, extra={"pred": pred, "format": fmt})
        )
    return out


def arith_extract(response: str) -> int | None:
    """The response's leading integer (after optional whitespace; it ends at the first non-digit)."""
    m = _LEADING_INT.match(response)
    return int(m.group(1)) if m else None


def arith_reward(prompts: list[str], responses: list[str], ground_truths: list[str]) -> list[RewardResult]:
    """The tiny task: 1.0 if the response starts with the exact integer answer, else 0.0.

    ``"19"``, ``" 19"``, ``"19<eos>"``, ``"19 because"`` score 1 for answer 19; ``"190"``, ``"1 9"``,
    ``"x19"`` score 0.
    """
    check_batch(prompts, responses, ground_truths)
    out = []
    for response, truth in zip(responses, ground_truths, strict=True):
        pred = arith_extract(response)
        ok = pred is not None and pred == int(truth.strip())
        out.append(RewardResult(score=1.0 if ok else 0.0, accuracy=ok, extra={"pred": pred}))
    return out
