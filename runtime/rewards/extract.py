"""Answer extraction and normalisation shared by the math-style rewards.

``last_boxed`` finds the last ``\\boxed{...}`` (or ``\\fbox{...}``) with brace matching, as in the
MATH benchmark (Hendrycks et al. 2021). ``normalize_answer`` is a string canonicaliser in the spirit
of Hendrycks' ``is_equiv`` and Minerva's ``normalize_final_answer`` (Lewkowycz et al. 2022): it makes
``\\dfrac12``, ``\\frac{1}{2}`` and `` \\frac {1}{2}.`` compare equal, but it is not a CAS.
"""

from __future__ import annotations

import re

_BOX_OPENERS = ("\\boxed", "\\fbox")

# Words/markup that do not change the value of a final answer.
_REMOVE = (
    "\\left",
    "\\right",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\ ",
    "^{\\circ}",
    "^\\circ",
    "\\%",
    "%",
    "\\$",
    "$",
    "\\displaystyle",
    "mbox",
)
_UNITS = (
    "degrees",
    "degree",
    "units",
    "unit",
    "cm",
    "meters",
    "inches",
    "feet",
    "dollars",
    "cents",
    "hours",
    "minutes",
    "seconds",
    "points",
    "ways",
    "square",
)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (braces matched) or ``\\boxed x``; else None."""
    start = max(text.rfind(o) for o in _BOX_OPENERS)
    if start < 0:
        return None
    opener = next(o for o in _BOX_OPENERS if text.startswith(o, start))
    i = start + len(opener)
    if i < len(text) and text[i] == " ":  # "\boxed 5": up to the next space or "$"
        m = re.match(r" ([^\s$]+)", text[i:])
        return m.group(1) if m else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: the response was cut off inside the box


def _strip_text_wrappers(s: str) -> str:
    # \text{5 cm} -> 5 cm ; \textbf{x} -> x ; \mathrm{...} -> ...
    return re.sub(r"\\(?:text|textbf|textit|mathrm|mathbf|operatorname)\{([^{}]*)\}", r"\1", s)


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}, \frac{1}2 -> \frac{1}{2}
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    return re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)


def normalize_answer(answer: str) -> str:
    """Canonical string for comparing two final answers (see the module docstring)."""
    s = answer.strip()
    s = s.replace("\n", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\\\", "\\")
    s = _strip_text_wrappers(s)
    for token in _REMOVE:
        s = s.replace(token, "")
    # "x = 5" / "k=5" -> "5": keep what follows a short left-hand side.
    if "=" in s:
        lhs, rhs = s.rsplit("=", 1)
        if len(lhs.strip()) <= 2:
            s = rhs
    s = s.strip()
    for unit in _UNITS:
        s = re.sub(rf"(\d)\s*{unit}\b$", r"\1", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # 1,000 -> 1000
        s = s.replace(",", "")
    if s.startswith("."):
        s = "0" + s
    if re.fullmatch(r"-?\d+\.0+", s):  # 5.0 -> 5
        s = s.split(".")[0]
    if re.fullmatch(r"\d+/\d+", s):  # 1/2 -> \frac{1}{2}
        num, den = s.split("/")
        s = f"\\frac{{{num}}}{{{den}}}"
    return s


def answers_match(pred: str, truth: str) -> bool:
    """String equality after :func:`normalize_answer` (the cheap check before any CAS)."""
    return normalize_answer(pred) == normalize_answer(truth)


def strip_boxed(truth: str) -> str:
    """A ground truth given as ``\\boxed{x}`` -> ``x``; anything else unchanged."""
    inner = last_boxed(truth)
    return inner if inner is not None and truth.strip().startswith(_BOX_OPENERS) else truth
