"""The answer extractor and grader (eval/accuracy.py) on hand-written outputs and, where the shared data is
present, on the reference solutions of GSM8K and MATH-500 (each solution must grade as right against its own
answer); the paired statistics against known values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from epikv_local.eval.accuracy import (extract_answer, grade, is_looping, mcnemar, normalize, paired_bootstrap,
                                      recovered_share)

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.mark.parametrize("text,gold", [
    ("So she makes 9 * 2 = $18 every day.\n#### 18", "18"),
    ("The answer is 1,234 apples.", "1234"),
    ("<think>maybe 7? no, 8</think>The final answer is: $\\boxed{8}$.", "8"),
    ("Total: 3 + 4 = 7. So the answer is 7.", "7"),
    ("He pays 12.50 dollars, then 2.5 more: 15", "15"),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{0.5}", "\\frac12"),
    ("We get $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}"),
    ("\\boxed{10\\%}", "10"),
    ("So the answer is 18, since she sells them all.", "18"),
    ("#### Step 1\nadd them\n#### Step 2: Answer\nShe has 18 apples.", "18"),
    ("\\boxed{18\\text{ eggs}}", "18"),
    ("\\boxed{1{,}000}", "1000"),
    ("\\boxed{\\frac{9}{19}}", "\\frac9{19}"),
    ("\\boxed{\\frac{270}{7}}", "\\frac{270}7\\text{ degrees}"),
    ("\\boxed{11\\sqrt{2}}", "11\\sqrt2"),
    ("\\boxed{864}", "864 \\mbox{ inches}^2"),
    ("\\boxed{5.4}", "5.4 \\text{ cents}"),
    ("Final Answer: The final answer is $18$. I hope it is correct.", "18"),
    ("The answer is \\(\\frac12\\).", "\\frac{1}{2}"),
])
def test_right_answers_grade_right(text, gold):
    g = grade(text, gold, numeric=gold.lstrip("-").replace(".", "").isdigit())
    assert g.correct, (g, normalize(gold))


@pytest.mark.parametrize("text,gold", [
    ("#### 17", "18"), ("The answer is 1,235.", "1234"), ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}"),
    ("no number here", "5"), ("", "5"), ("\\boxed{2", "2"), ("\\boxed{(3, 2)}", "(2, 3)"),
    ("<think>the answer is 8</think>I am not sure.", "8"),
])
def test_wrong_or_missing_answers_grade_wrong(text, gold):
    assert not grade(text, gold, numeric=False).correct


def test_a_cut_off_output_needs_an_explicit_answer():
    assert grade("... so far 3 + 15 = 18", "18", numeric=True).correct
    assert not grade("... so far 3 + 15 = 18", "18", numeric=True, truncated=True).correct
    assert grade("\\boxed{18} and then I kept going", "18", numeric=True, truncated=True).correct


def test_reasoning_joined_to_the_answer_the_way_the_bench_does():
    """bench_accuracy puts "</think>" between reasoning_content and content: a box inside the reasoning and
    the digits at the seam do not count."""
    text = "maybe \\boxed{5}? no, it is 18" + "\n</think>\n" + "42 is wrong; the answer is 6."
    assert extract_answer(text, numeric=True) == "6"


def test_the_last_box_and_the_text_after_thinking_count():
    assert extract_answer("\\boxed{1} then \\boxed{{2}}", numeric=False) == "{2}"
    assert extract_answer("<think>\\boxed{4}</think> so 5", numeric=True) == "5"
    assert extract_answer("1 2 3", numeric=True) == "3" and extract_answer("1 2 3", numeric=False) is None


def test_empty_and_looping_outputs_are_told():
    assert grade("   ", "1", True).empty
    loop = "Let me check again. " * 80
    assert is_looping(loop) and grade(loop, "1", True).looping
    sentence = " ".join(f"w{i}" for i in range(25)) + " "  # a 25-word period, repeated
    assert is_looping("An answer starts here. " + sentence * 20)
    prose = " ".join(f"step {i} adds {i * 7 % 11} to the total of {i * i}" for i in range(120))
    assert not is_looping(prose)


def test_mcnemar_and_paired_bootstrap():
    assert mcnemar([True] * 10, [True] * 10) == {"a_only": 0, "b_only": 0, "p": 1.0}
    # 10 discordant pairs all one way: p = 2 / 2^10
    r = mcnemar([True] * 10 + [False] * 5, [False] * 10 + [False] * 5)
    assert (r["a_only"], r["b_only"]) == (10, 0) and r["p"] == pytest.approx(2 / 1024)
    r = mcnemar([True, False] * 5, [False, True] * 5)
    assert r["p"] == pytest.approx(1.0)
    d, lo, hi = paired_bootstrap([True] * 30 + [False] * 10, [True] * 10 + [False] * 30)
    assert d == pytest.approx(0.5) and 0.2 < lo < d < hi < 0.8
    with pytest.raises(ValueError):
        mcnemar([True], [True, False])


def test_recovered_share_of_streamings_loss():
    # full right on 40 of 60, StreamingLLM on 10 of those, the policy on 25: it wins back 15 of the 30 lost
    full = [True] * 40 + [False] * 20
    streaming = [True] * 10 + [False] * 50
    policy = [True] * 25 + [False] * 35
    r = recovered_share(policy, streaming, full)
    assert r["n"] == 60 and r["share"] == pytest.approx(0.5)
    assert 0.2 < r["ci95"][0] < 0.5 < r["ci95"][1] < 0.8
    assert recovered_share(full, streaming, full)["share"] == pytest.approx(1.0)
    assert recovered_share(streaming, streaming, full)["share"] == 0.0
    worse = recovered_share([False] * 60, streaming, full)  # below StreamingLLM: negative
    assert worse["share"] == pytest.approx(-1 / 3) and worse["ci95"][1] < 0
    nothing = recovered_share(policy, full, full)  # StreamingLLM loses nothing: no share to report
    assert math.isnan(nothing["share"]) and all(math.isnan(c) for c in nothing["ci95"])
    with pytest.raises(ValueError):
        recovered_share([True], [True], [True, False])


@pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists(), reason="../shared/data is not on this machine")
def test_gsm8k_reference_solutions_grade_right():
    rows = [json.loads(line) for line in (DATA / "gsm8k_test.jsonl").open()]
    wrong = [r["id"] for r in rows if not grade(r["solution"], r["answer"], numeric=True).correct]
    assert not wrong, wrong[:10]


@pytest.mark.skipif(not (DATA / "math500.jsonl").exists(), reason="../shared/data is not on this machine")
def test_math500_reference_solutions_grade_right():
    rows = [json.loads(line) for line in (DATA / "math500.jsonl").open()]
    wrong = [r["unique_id"] for r in rows if not grade(r["solution"], r["answer"], numeric=False).correct]
    print(f"\n{len(rows) - len(wrong)} of {len(rows)} MATH-500 solutions grade right against their answer")
    assert len(wrong) <= len(rows) // 100, wrong[:10]  # a string grader: a few equivalent spellings may differ
