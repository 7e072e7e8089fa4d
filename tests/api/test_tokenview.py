"""The token view (epikv_local/api/tokenview/): per-token records on the real model, the HTML page, the CLI's
``--html`` / ``--html-compare``, and the page rendered by a headless Chromium."""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser

import numpy as np
import pytest

from epikv_local.policies import DEFAULT_POLICY

CLI = [sys.executable, "-m", "epikv_local.cli"]
PROMPT = 'Explain what <b>&" means in HTML, step by step. First,'
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def cli(*args, timeout=300):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout)


def one_line_error(r, needle):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("epikv-local: error:") and needle in lines[0], lines[0]


class Spans(HTMLParser):
    """Token spans (those with data-p) per run section: [(policy, [(position, classes, title, text)])]."""

    def __init__(self):
        super().__init__()
        self.runs: list[tuple[str, list]] = []
        self.current = None  # [position, classes, title, text] while inside a token span

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" and "run" in (a.get("class") or "").split():
            self.runs.append((a.get("data-policy"), []))
        elif tag == "span" and "data-p" in a:
            assert self.current is None, "token spans do not nest"
            self.current = [int(a["data-p"]), (a.get("class") or "").split(), a.get("title"), ""]

    def handle_endtag(self, tag):
        if tag == "span" and self.current is not None:
            self.runs[-1][1].append(tuple(self.current))
            self.current = None

    def handle_data(self, data):
        if self.current is not None:
            self.current[3] += data


@pytest.fixture(scope="module")
def page(model_path, tmp_path_factory):
    """epikv vs streaming on the same prompt through the public front door (greedy, budget 48)."""
    from epikv_local import token_view

    out = tmp_path_factory.mktemp("view") / "view.html"
    runs = token_view(model_path, PROMPT, policies=("epikv", "streaming"), kv_budget=48, n_recent=12,
                      max_tokens=60, chat=False, out=out, ignore_eog=True)
    return runs, out, out.read_text(encoding="utf-8")


def test_every_position_has_one_record(page, model):
    from epikv_local.api.chat import tokenize_prompt

    runs, _, _ = page
    prompt_tokens = tokenize_prompt(model, PROMPT)
    for run in runs:
        recs = run.records
        assert [r.position for r in recs] == list(range(len(recs)))
        assert len(recs) == run.n_prompt + run.stats.n_generated_tokens
        assert run.n_prompt == len(prompt_tokens) == run.stats.n_prompt_tokens
        assert [r.token for r in recs[: run.n_prompt]] == prompt_tokens
        assert {r.kind for r in recs[: run.n_prompt]} == {"prompt"} and {r.kind for r in recs[run.n_prompt:]} == {
            "generated"}
        assert all(r.decoded for r in recs[:-1])  # only the last sampled token may be undecoded
        assert run.text.strip() and run.text[:10] in "".join(r.text for r in recs[run.n_prompt:])
        assert run.n_live <= run.budget.kv_budget and run.stats.max_live_cells <= run.budget.kv_budget


def test_evicted_records_match_the_recorded_events(page):
    runs, _, _ = page
    for run in runs:
        union = np.concatenate([e.evicted for e in run.events]).tolist() if run.events else []
        assert len(union) == len(set(union)) == run.stats.n_evicted > 20, run.label
        assert {r.position for r in run.records if r.evicted} == set(union)
        for r in run.records:
            if not r.evicted:
                assert r.evicted_step is None and r.evicted_seq_len is None
                continue
            ev = run.events[r.evicted_round]
            assert r.position in ev.evicted.tolist()
            i = ev.positions.tolist().index(r.position)
            want = float(ev.scores[i])
            assert (r.score is None and math.isnan(want)) or r.score == want
            assert r.evicted_seq_len == int(ev.positions.max()) + 1 > r.position
            assert r.evicted_step == (r.evicted_seq_len - run.n_prompt if r.evicted_seq_len >= run.n_prompt else None)
            assert r.evicted_reason == ev.reason and not r.protected
    # streaming scores a token by its position: evicted ones keep exactly that
    streaming = runs[1]
    assert all(r.score == r.position for r in streaming.records if r.evicted)


def test_protection_at_the_end(page):
    runs, _, _ = page
    for run in runs:
        live = [r for r in run.records if r.live]
        assert live and all(r.score is None or isinstance(r.score, float) for r in live)
        assert all("sink" in r.protected for r in live if r.position < run.budget.n_sink)
        assert "newest" in live[-1].protected and "recent" in live[-1].protected
        # the prompt is protected by default: never evicted, marked at the end
        assert all(r.live and "prompt" in r.protected for r in run.records[: run.n_prompt])


def test_page_is_self_contained_and_escaped(page):
    runs, _, text = page
    assert text.startswith("<!DOCTYPE html>")
    for bad in ("http://", "https://", "src=", "<link", "@import", "url("):
        assert bad not in text, bad
    assert "<b>" not in text  # the prompt's markup is escaped, never rendered
    parsed = Spans()
    parsed.feed(text)
    assert [p for p, _ in parsed.runs] == ["epikv", "streaming"]
    assert 'class="runs n2"' in text
    from epikv_local.api.tokenview import display_text

    for (policy, spans), run in zip(parsed.runs, runs):
        assert len(spans) == len(run.records)
        for (pos, classes, title, shown), r in zip(spans, run.records):
            assert pos == r.position and shown == display_text(r.text)
            assert ("ev" in classes) == r.evicted and ("pr" in classes) == bool(r.protected)
            assert title.startswith(f"position {r.position} ")
            if r.evicted:
                assert f"round {r.evicted_round}" in title and f"sequence length {r.evicted_seq_len}" in title
        prompt_text = "".join(s[3] for s in spans[: run.n_prompt])
        assert '<b>&"' in prompt_text  # round-trips through the escaping
        for key in ("kv_budget", "evicted", "max live cells", "flash attn", "KV"):
            assert f"<li>{key} <strong>" in text


def test_scores_nan_inf_and_one_run():
    from epikv_local.api import tokenview as tv
    from epikv_local.api.generation import GenerationStats
    from epikv_local.engine.budget import BudgetConfig

    assert tv.percentiles([None, 1.0, math.inf, -math.inf, 1.0]) == [None, 0.5, 1.0, 0.0, 0.5]
    assert tv.percentiles([2.0, 2.0]) == [0.5, 0.5] and tv.percentiles([None]) == [None]
    assert [tv.fmt_score(x) for x in (None, math.inf, -math.inf, 3.0, 0.12345)] == [
        "unscored", "+inf", "-inf", "3", "0.123"]
    recs = [tv.TokenRecord(0, 1, "<s>", "prompt", None, protected=("sink",)),
            tv.TokenRecord(1, 2, "a\n", "prompt", math.inf),
            tv.TokenRecord(2, 3, "&", "generated", -math.inf, evicted_round=0, evicted_step=0, evicted_seq_len=3,
                           evicted_reason="budget"),
            tv.TokenRecord(3, 4, "x", "generated", None, decoded=False)]
    run = tv.TokenRun("mine", recs, GenerationStats(policy="p", kv_budget=8), "&x", BudgetConfig(8, n_sink=1,
                      n_recent=2), recent=2, n_prompt=2)
    html = tv.render_html([run])
    assert 'class="runs n1"' in html and "&lt;s&gt;" in html and "-inf" in html and "never decoded" in html
    assert json.dumps(run.as_dict())  # inf is written as text
    assert tv.render_html([run, run, run]).count('<section class="run"') == 3
    with pytest.raises(tv.ConfigError):
        tv.render_html([run] * 4)


def _one_token_run(label: str):
    from epikv_local.api import tokenview as tv
    from epikv_local.api.generation import GenerationStats
    from epikv_local.engine.budget import BudgetConfig

    return tv.TokenRun(label, [tv.TokenRecord(0, 1, "a", "prompt", 1.0)], GenerationStats(policy=label, kv_budget=8),
                       "", BudgetConfig(8, n_sink=1, n_recent=2), recent=2, n_prompt=1)


def test_cases_on_one_page_with_marks():
    """Several prompts on one page, each with its runs and a verdict per run (escaped); marks must match runs."""
    from epikv_local.api import tokenview as tv

    runs = [_one_token_run(x) for x in ("full", "streaming", "epikv")]
    cases = [tv.Case(runs, title="p<1>", prompt="What is 1 & 2?",
                     marks=[tv.Mark(True, "right: 3"), tv.Mark(False, "wrong: <4> (gold 3)"), None]),
             tv.Case(runs[:2], title="p2", marks=[tv.Mark(None, "not graded"), tv.Mark(True, "right: 5")])]
    html = tv.render_cases(cases, title="gsm8k dev", meta={"budget": "192 cells"}, note="a & b")
    assert html.count('<section class="case">') == 2 and html.count('<section class="run"') == 5
    assert 'class="runs n3"' in html and 'class="runs n2"' in html
    assert '<span class="mark ok">right: 3</span>' in html
    assert '<span class="mark bad">wrong: &lt;4&gt; (gold 3)</span>' in html
    assert '<span class="mark na">not graded</span>' in html
    assert "p&lt;1&gt;" in html and "What is 1 &amp; 2?" in html and '<p class="note">a &amp; b</p>' in html
    for bad in ([tv.Case(runs, marks=[None])], [tv.Case([])], []):
        with pytest.raises(tv.ConfigError):
            tv.render_cases(bad)
    with pytest.raises(tv.ConfigError, match="True, False or None"):
        tv.Mark(1, "one is not a verdict")


def test_page_inlines_the_packaged_assets():
    from importlib import resources

    from epikv_local.api import tokenview as tv
    from epikv_local.api.generation import GenerationStats
    from epikv_local.engine.budget import BudgetConfig

    run = tv.TokenRun("one", [tv.TokenRecord(0, 1, "a", "prompt", 1.0)], GenerationStats(policy="p", kv_budget=8),
                      "", BudgetConfig(8, n_sink=1, n_recent=2), recent=2, n_prompt=1)
    html = tv.render_html([run])
    for name, tag in (("token_view.css", "style"), ("token_view.js", "script")):
        text = (resources.files("epikv_local.api.tokenview") / "assets" / name).read_text(encoding="utf-8")
        assert text.strip() and tv.asset(name) == text
        assert f"<{tag}>\n{text}</{tag}>" in html  # inlined whole: the page needs no file beside it


def test_reads_the_session_through_its_public_api_only():
    """No ``session.engine`` / ``.ctx`` / ``.capture`` and no other module's private attribute in the package."""
    import ast
    from pathlib import Path

    import epikv_local.api.tokenview as tv

    for path in sorted(Path(tv.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute):
                private = node.attr.startswith("_") and not node.attr.startswith("__")
                assert node.attr not in ("engine", "ctx", "capture") and not private, (
                    f"{path.name}:{node.lineno} reads .{node.attr}")


def test_collect_needs_a_recording_session(model):
    from epikv_local import BudgetConfig, ConfigError, Session, SessionConfig, generate, make_policy
    from epikv_local.api.tokenview import collect_run

    toks = model.tokenize("Hello there", add_special=True)
    with Session(model, make_policy("streaming"), BudgetConfig(32, n_recent=8), SessionConfig(n_batch=16)) as s:
        result = generate(s, toks, 4)
        with pytest.raises(ConfigError, match="record=True"):
            collect_run(s, toks, result)


def test_cli_html_and_compare(model_path, tmp_path):
    out = tmp_path / "one.html"
    r = cli("generate", "-m", str(model_path), "-p", PROMPT, "-n", "24", "--kv-budget", "40", "--n-recent", "8",
            "--temp", "0", "--ignore-eos", "--json", "--html", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["html"] == str(out) and "compare" not in res
    parsed = Spans()
    parsed.feed(out.read_text(encoding="utf-8"))
    assert [p for p, _ in parsed.runs] == [DEFAULT_POLICY]
    assert len(parsed.runs[0][1]) == res["n_prompt_tokens"] + res["n_generated_tokens"]
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary file was renamed into place

    two = tmp_path / "two.html"
    r = cli("generate", "-m", str(model_path), "-p", PROMPT, "-n", "24", "--kv-budget", "40", "--n-recent", "8",
            "--temp", "0", "--ignore-eos", "--html", str(two), "--html-compare", "streaming")
    assert r.returncode == 0, r.stderr
    assert f"policy={DEFAULT_POLICY}" in r.stderr and "policy=streaming" in r.stderr and f"written to {two}" in r.stderr
    parsed = Spans()
    parsed.feed(two.read_text(encoding="utf-8"))
    assert [p for p, _ in parsed.runs] == [DEFAULT_POLICY, "streaming"]
    assert all(len(spans) > 30 for _, spans in parsed.runs)


def test_cli_bad_html_arguments(model_path, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    base = ["generate", "-m", str(model_path), "-p", "hi", "-n", "5"]
    one_line_error(cli(*base, "--html", str(blocker / "out.html")), "is not a folder")
    one_line_error(cli(*base, "--html", str(tmp_path / "missing" / "out.html")), "does not exist")
    one_line_error(cli(*base, "--html", str(tmp_path)), "is a directory")
    one_line_error(cli(*base, "--html", str(tmp_path / "x.html"), "--html-compare", "h3o"), "unknown policy 'h3o'")
    one_line_error(cli(*base, "--html-compare", "streaming"), "--html-compare needs --html")
    one_line_error(cli(*base, "--html", str(tmp_path / "x.html"), "--html-compare", "h2o"), "flash attention")
    assert not (tmp_path / "x.html").exists()


def _png_pixels_vary(path) -> tuple[int, int, int]:
    """(width, height, distinct byte values of the decoded image data) of a PNG, with the stdlib only."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    return width, height, len(set(raw))


def test_page_renders_in_headless_chromium(page, tmp_path):
    browser = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if browser is None:
        pytest.fail("no headless browser found (tried chromium, chromium-browser, google-chrome): install one, "
                    "e.g. `apt-get install -y --no-install-recommends chromium fonts-dejavu-core`")
    _, out, _ = page
    png = tmp_path / "shot.png"
    r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", "--window-size=1400,1000",
                        out.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    assert png.is_file(), f"{browser} wrote no screenshot (rc {r.returncode}): {r.stderr[-500:]}"
    width, height, distinct = _png_pixels_vary(png)
    assert (width, height) == (1400, 1000)
    assert distinct > 32, f"the screenshot looks blank ({distinct} distinct byte values)"
    assert png.stat().st_size > 20_000


def test_a_chat_page_hands_said_words_the_templates_tokens(model_path, model):
    """``token_view(chat=True)`` marks the chat template's tokens as the chat path does, so ``said_words`` (the
    caller's words before the template's) evicts SmolLM2's default system prompt before the question, where
    ``said_prompt`` (the same policy without the marks' tier) keeps the oldest prompt tokens, the template's
    first."""
    from epikv_local import token_view
    from epikv_local.api.chat import apply_chat_template, prompt_template_marks, tokenize_prompt

    question = ("A baker bakes 48 loaves on Monday and three times as many on Tuesday; she sells all but 17 of "
                "them and gives the rest to a shelter. How many loaves does the shelter get?")
    runs = token_view(model_path, question, policies=("said_words", "said_prompt"), kv_budget=48, n_recent=12,
                      max_tokens=24, chat=True, out=None, protect_prompt=False, ignore_eog=True)
    tokens = tokenize_prompt(model, apply_chat_template(model, question))
    marks = prompt_template_marks(model, tokens, [{"role": "user", "content": question}])
    assert marks is not None and 0 < sum(marks) < len(marks)

    def evicted_template(run):
        return sum(1 for r in run.records[:len(tokens)] if marks[r.position] and r.evicted_round is not None)

    words, prompt = runs
    assert words.n_prompt == prompt.n_prompt == len(tokens)
    assert evicted_template(words) > evicted_template(prompt)
