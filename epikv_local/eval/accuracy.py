"""Answer accuracy: extract a model's final answer from its text, grade it against the gold answer, tell
empty or looping outputs, and compare two settings on the same problems (paired statistics).

GSM8K answers are numbers; MATH answers are LaTeX expressions. Extraction looks, in this order, for the last
``\\boxed{...}`` (balanced braces), a GSM8K ``#### N`` line, an "answer is ..." phrase, and (numeric tasks
only) the last number in the text. Grading normalizes both sides the same way (numbers: commas, ``$``, ``%``,
trailing zeros; LaTeX: ``\\left``/``\\right``, ``\\dfrac``→``\\frac``, ``\\text{}``, spaces, a trailing period,
``^\\circ``) and compares numbers by value (1e-6 relative) and everything else as normalized strings, with
``\\frac{a}{b}`` and ``a/b`` read as the same number when both are numeric. This is a string grader, not a
symbolic one: equivalent expressions written differently (``\\sqrt{2}/2`` vs ``\\frac{\\sqrt2}{2}``) count as
wrong for every setting alike, which the paired comparisons tolerate.

Paired comparisons (:func:`mcnemar`, :func:`paired_bootstrap`) use the per-problem outcomes of two settings on
the same problems; :func:`recovered_share` those of three (a policy, StreamingLLM and the full cache): the share of
StreamingLLM's loss that the policy wins back, issue 21's goal figure.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

__all__ = ["INSTRUCTION", "Grade", "extract_answer", "grade", "is_looping", "mcnemar", "normalize",
           "paired_bootstrap", "recovered_share"]

#: what follows each problem in the accuracy benchmark's chat turn (and in ``calibrate --objective accuracy``)
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"(?:final answer|the answer|answer)\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE)
#: GSM8K's answer line ("#### 18"), not a markdown heading ("#### Step 2")
_HASHES = re.compile(r"^####\s*(\$?\s*-?\.?\d[^\n]*)", re.MULTILINE)
_MATH = re.compile(r"\$([^$]+)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: the output was cut off inside the box


def extract_answer(text: str, numeric: bool, truncated: bool = False) -> str | None:
    """The final answer written in ``text`` (the part after the last ``</think>`` when there is one), or None.
    ``numeric``: the task's answers are numbers (GSM8K): the last number is the fallback. ``truncated``: the
    output was cut off (``finish_reason == "length"``): only an explicit answer (``\\boxed{}``, ``####``)
    counts, not a number the text happened to end on."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes:
        last = hashes[-1].strip()
        nums = _NUMBER.findall(last) if numeric else None
        return nums[0] if nums else last
    if truncated:
        return None
    phrases = _ANSWER_IS.findall(text)
    if phrases:
        phrase = phrases[-1].strip()
        nested = _ANSWER_IS.findall(phrase)  # "Final Answer: The final answer is $18$."
        phrase = nested[-1].strip() if nested else phrase
        math = _MATH.search(phrase)
        if math:
            phrase = next(g for g in math.groups() if g is not None)
        if numeric:
            nums = _NUMBER.findall(phrase)
            if nums:
                return nums[0]
        return phrase.split("\n")[0].strip().rstrip(". ")
    if numeric:
        nums = _NUMBER.findall(text)
        if nums:
            return nums[-1]
    return None


def _strip_braces(s: str) -> str:
    while s.startswith("{") and s.endswith("}") and _balanced(s[1:-1]):
        s = s[1:-1]
    return s


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            return False
    return depth == 0


def normalize(answer: str) -> str:
    """A canonical string for comparing answers (see the module docstring)."""
    s = answer.strip()
    s = s.replace("{,}", "")  # 1{,}000
    # units after a number: 18\text{ eggs}, 864 \mbox{ inches}^2, \frac{270}7\text{ degrees}
    s = re.sub(r"(?<=[\d}])\s*\\(?:text|mbox)\{\s*[A-Za-z][^{}]*\}(\^\d)?\s*$", "", s)
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\mbox\{\s*([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:mathrm|textbf|mathbf)\{([^{}]*)\}", r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""), ("^\\circ", ""), ("^{\\circ}", ""),
                     ("\\%", ""), ("%", ""), ("\\$", ""), ("$", ""), ("dollars", ""), ("degrees", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = _strip_braces(s)
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", s) and "," in s and re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")  # 1,000 is a thousand; (1,2) stays a pair
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)  # \frac9{19}
    s = re.sub(r"\\frac(\{[^{}]*\})(\d)", r"\\frac\1{\2}", s)  # \frac{270}7
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)  # 11\sqrt2
    s = re.sub(r"^([a-zA-Z]\w*)=", "", s)  # "x=5" -> "5"
    return s


def _number(s: str) -> float | None:
    """The value of a normalized answer that is a number (or a numeric fraction), else None."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s) or \
        re.fullmatch(r"(-?)(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)", s)
    if m:
        den = float(m.group(3))
        return None if den == 0 else (-1 if m.group(1) else 1) * float(m.group(2)) / den
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


@dataclass(frozen=True)
class Grade:
    """One graded output: the extracted answer (None when none was found), whether it matches the gold,
    whether the output is empty (no answer text) or looping (:func:`is_looping`)."""

    answer: str | None
    correct: bool
    empty: bool
    looping: bool


def grade(text: str, gold: str, numeric: bool, truncated: bool = False) -> Grade:
    """Grade one output ``text`` against ``gold`` (GSM8K: ``numeric=True``; ``truncated``: see
    :func:`extract_answer`)."""
    pred = extract_answer(text, numeric, truncated)
    correct = False
    if pred is not None:
        a, b = normalize(pred), normalize(str(gold))
        x, y = _number(a), _number(b)
        if x is not None and y is not None:
            correct = abs(x - y) <= 1e-6 * max(1.0, abs(y))
        else:
            correct = a == b
    return Grade(pred, correct, empty=not text.strip(), looping=is_looping(text))


def is_looping(text: str, n: int = 8, tail_chars: int = 1500, share: float = 0.5) -> bool:
    """True when the last ``tail_chars`` characters are mostly repetition: at least ``share`` of the word
    ``n``-grams there occur three times or more (the degenerate loops of an over-pruned cache, whatever their
    period)."""
    words = text[-tail_chars:].split()
    if len(words) < 4 * n:
        return False
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    counts: dict[tuple, int] = {}
    for g in grams:
        counts[g] = counts.get(g, 0) + 1
    repeated = sum(1 for g in grams if counts[g] >= 3)
    return repeated >= share * len(grams)


def mcnemar(a: list[bool], b: list[bool]) -> dict:
    """Exact McNemar test of two settings' per-problem outcomes (same problems, same order): the discordant
    counts (``a_only``: right in a, wrong in b; ``b_only``) and the two-sided binomial p-value."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes of different lengths: {len(a)} vs {len(b)}")
    a_only = sum(1 for x, y in zip(a, b) if x and not y)
    b_only = sum(1 for x, y in zip(a, b) if y and not x)
    n = a_only + b_only
    if n == 0:
        return {"a_only": 0, "b_only": 0, "p": 1.0}
    k = min(a_only, b_only)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return {"a_only": a_only, "b_only": b_only, "p": min(1.0, 2 * tail)}


def paired_bootstrap(a: list[bool], b: list[bool], n_resamples: int = 10000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """(difference, low, high): accuracy(a) - accuracy(b) and its percentile CI, resampling problems."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes of different lengths: {len(a)} vs {len(b)}")
    x = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    boot = x[rng.integers(0, x.size, size=(n_resamples, x.size))].mean(axis=1)
    lo, hi = np.quantile(boot, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(x.mean()), float(lo), float(hi)


def recovered_share(policy: list[bool], streaming: list[bool], full: list[bool], n_resamples: int = 10000,
                    seed: int = 0, level: float = 0.95) -> dict:
    """The share of StreamingLLM's accuracy loss against the full cache that a policy wins back, on the same
    problems in the same order: (acc(policy) - acc(streaming)) / (acc(full) - acc(streaming)); 1 = all of the
    loss recovered, 0 = none, negative = worse than StreamingLLM.

    Returns {"n", "share", "ci95": [low, high], "goal_met"}: a percentile CI resampling problems (one draw of
    indices for all three settings; resamples where StreamingLLM loses nothing are undefined and left out), and
    issue 21's goal: at least half recovered, with the CI of acc(policy) - acc(streaming) on the same resamples
    (:func:`paired_bootstrap`'s, for the same seed) above zero. ``share`` and the CI are NaN, and the goal unmet,
    when StreamingLLM loses nothing on the problems given (nothing to recover).
    """
    if not len(policy) == len(streaming) == len(full):
        raise ValueError(f"paired outcomes of different lengths: {len(policy)}, {len(streaming)}, {len(full)}")
    x = np.asarray([policy, streaming, full], dtype=np.float64)
    nan = float("nan")
    if x.shape[1] == 0 or x[2].mean() <= x[1].mean():
        return {"n": int(x.shape[1]), "share": nan, "ci95": [nan, nan], "goal_met": False}
    rng = np.random.default_rng(seed)
    means = x[:, rng.integers(0, x.shape[1], size=(n_resamples, x.shape[1]))].mean(axis=2)  # (3, resamples)
    loss = means[2] - means[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        boot = np.where(loss > 0, (means[0] - means[1]) / loss, np.nan)
    lo, hi = np.nanquantile(boot, [(1 - level) / 2, 1 - (1 - level) / 2])
    share = (x[0].mean() - x[1].mean()) / (x[2].mean() - x[1].mean())
    gain_low = np.quantile(means[0] - means[1], (1 - level) / 2)
    return {"n": int(x.shape[1]), "share": float(share), "ci95": [float(lo), float(hi)],
            "goal_met": bool(share >= 0.5 and gain_low > 0)}
