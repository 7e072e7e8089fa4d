"""The token view's page: runs of :class:`~.records.TokenRun` side by side, as ONE self-contained HTML file.

A page holds one or more :class:`Case` (one prompt and its 1 to :data:`MAX_RUNS` runs, e.g. a full cache and two
policies), each run optionally with a :class:`Mark` (a verdict on its title, e.g. "right: 18"); :func:`render_html`
is the one-case page of the CLI and :func:`~.page.token_view`, :func:`render_cases` the page of several prompts
(a benchmark setting's problems).

Self-contained means: the CSS and JavaScript (package data files ``assets/token_view.css`` and
``assets/token_view.js``, read with :mod:`importlib.resources`) are inlined in ``<style>``/``<script>``, there
is no external resource, and every text from a run, the prompt or the caller is HTML-escaped. Each token is a
``<span class="tok">`` coloured by its score's percentile within its run (:mod:`.display`), evicted tokens
struck through and faded (``ev``), protected ones underlined (``pr``), with a tooltip per token, a legend, a
cache strip and the run's statistics per column. :func:`write_html` writes the page atomically.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from ... import fileio
from ...errors import ConfigError, EpikvError
from .display import SCALE, colour, display_text, fmt_bytes, fmt_score, percentiles
from .records import TokenRecord, TokenRun

#: most runs one case shows side by side
MAX_RUNS = 3


@dataclass(frozen=True)
class Mark:
    """A verdict shown on a run's title: ``ok`` True (green), False (red) or None (grey); ``text`` says what,
    e.g. ``"right: 18"`` or ``"wrong: 17 (gold 18)"``. The token view does not grade: the caller does."""

    ok: bool | None
    text: str

    def __post_init__(self):
        if not isinstance(self.ok, (bool, type(None))):
            raise ConfigError(f"a mark's ok is True, False or None, got {self.ok!r}")


@dataclass(frozen=True)
class Case:
    """One prompt's runs side by side (1 to :data:`MAX_RUNS`, same prompt tokens), with an optional heading, the
    prompt text shown above them and one optional :class:`Mark` per run (``marks`` empty: none)."""

    runs: Sequence[TokenRun]
    title: str | None = None
    prompt: str | None = None
    marks: Sequence[Mark | None] = ()


@lru_cache(maxsize=None)
def asset(name: str) -> str:
    """The text of the package data file ``assets/<name>`` (UTF-8), read once per process.

    It is inlined raw (CSS and JS cannot be HTML-escaped), so it must not close its own element: an asset
    containing ``</style`` or ``</script`` is refused rather than written into a broken page."""
    try:
        text = (resources.files(__package__) / "assets" / name).read_text(encoding="utf-8")
    except OSError as e:
        raise EpikvError(f"the token view's {name} is missing from the installed package ({e}): reinstall "
                         "epikv-local") from None
    if "</style" in text.lower() or "</script" in text.lower():
        raise EpikvError(f"the token view's {name} closes an inline element (</style> or </script>)")
    return text


def _e(text) -> str:
    """``text`` (any value, as str) escaped for element content and double-quoted attributes."""
    return html.escape(str(text), quote=True)


def _tooltip(r: TokenRecord) -> str:
    """A token's hover text, plain lines (escaped by the caller): position, text, score, eviction or protection."""
    lines = [f"position {r.position} \u00b7 {r.kind} \u00b7 token id {r.token}", f"text {r.text!r}"]
    if not r.decoded:
        lines.append("sampled last, never decoded into the cache (no score)")
    else:
        lines.append(f"score {fmt_score(r.score)}" + (" (when evicted)" if r.evicted else " (final)"))
    if r.evicted:
        when = (f"during prefill (sequence length {r.evicted_seq_len})" if r.evicted_step is None
                else f"at generation step {r.evicted_step} (sequence length {r.evicted_seq_len})")
        lines.append(f"EVICTED in round {r.evicted_round} {when}, "
                     f"after {r.evicted_seq_len - r.position - 1} newer tokens [{r.evicted_reason}]")
    elif r.decoded:
        lines.append("kept (live at the end)" + (f"; protected: {', '.join(r.protected)}" if r.protected else ""))
    return "\n".join(lines)


def _span(r: TokenRecord, q: float | None) -> str:
    """A token's ``<span class="tok ...">`` coloured by its percentile ``q`` in [0, 1] (None: unscored)."""
    cls = ["tok"]
    if r.evicted:
        cls.append("ev")
    if r.protected:
        cls.append("pr")
    if not r.decoded:
        cls.append("nd")
    if r.score is None:
        cls.append("un")
    return (f'<span class="{" ".join(cls)}" data-p="{r.position}" style="background-color:{colour(q)}" '
            f'title="{_e(_tooltip(r))}">{_e(display_text(r.text))}</span>')


def _stats_items(run: TokenRun) -> list[tuple[str, str]]:
    """(name, value) of the run's statistics line, in page order (values unescaped)."""
    st = run.stats
    items = [("policy", st.policy), ("kv_budget", str(st.kv_budget)), ("n_sink", str(run.budget.n_sink)),
             ("recent", str(run.recent)), ("prompt", f"{st.n_prompt_tokens} tok"),
             ("generated", f"{st.n_generated_tokens} tok"), ("evicted", str(st.n_evicted)),
             ("rounds", str(sum(1 for e in run.events if len(e.evicted)))), ("live at end", str(run.n_live)),
             ("max live cells", str(st.max_live_cells)), ("KV", fmt_bytes(st.kv_bytes)),
             ("flash attn", "on" if st.flash_attn else "off")]
    if st.layers:
        items.append(("layers", ",".join(map(str, st.layers))))
    if "window" in run.settings:
        items.append(("window", str(run.settings["window"])))
    items.append(("stop", st.stop_reason or "-"))
    return items


def _legend(run: TokenRun, qs: list[float | None]) -> str:
    """The colour scale with the run's lowest, median and highest raw score, and one sample span per class."""
    scored = [r.score for r in run.records if r.score is not None]
    grad = ",".join(f"{colour(f)} {f * 100:.0f}%" for f, _ in SCALE)
    if scored:
        lo, mid, hi = fmt_score(min(scored)), fmt_score(sorted(scored)[len(scored) // 2]), fmt_score(max(scored))
        ends = (f'<span>low {_e(lo)}</span><span class="bar" style="background:linear-gradient(90deg,{grad})" '
                f'title="score percentile within this run; median {_e(mid)}"></span><span>high {_e(hi)}</span>')
    else:
        ends = "<span>no scores</span>"
    return ('<div class="legend">'
            f'<span class="scale"><span>score (percentile in run):</span>{ends}</span>'
            f'<span class="key"><span class="tok" style="background-color:{colour(0.8)}">kept</span></span>'
            f'<span class="key"><span class="tok ev" style="background-color:{colour(0.2)}">evicted</span></span>'
            f'<span class="key"><span class="tok pr" style="background-color:{colour(0.5)}">protected</span>'
            '<span>(sink / prompt / recent, at end)</span></span>'
            f'<span class="key"><span class="tok un" style="background-color:{colour(None)}">unscored</span></span>'
            '</div>')


def _cache_map(run: TokenRun) -> str:
    """A strip of every position, left to right: dark = live in the cache at the end, light = evicted, the
    prompt/generated boundary marked."""
    n = len(run.records)
    if not n:
        return ""
    rects = []
    for r in run.records:
        fill = "#1f2937" if r.live else "#cfd2dc" if r.evicted else "#ffffff"
        rects.append(f'<rect x="{r.position}" y="0" width="1" height="10" fill="{fill}"/>')
    mark = (f'<rect x="{run.n_prompt - 0.15:.2f}" y="0" width="0.3" height="10" fill="#d00"/>'
            if run.n_prompt < n else "")  # no generated part: no boundary to mark
    return ('<div class="map"><span>cache at the end (positions 0\u2013' f"{n - 1}" '):</span>'
            f'<svg viewBox="0 0 {n} 10" preserveAspectRatio="none" shape-rendering="crispEdges" role="img" '
            f'aria-label="live and evicted positions">{"".join(rects)}{mark}</svg>'
            '<span class="mk"><i style="background:#1f2937"></i>live <i style="background:#cfd2dc"></i>evicted '
            '<i style="background:#d00;width:2px"></i>prompt end</span></div>')


def _mark(mark: Mark | None) -> str:
    if mark is None:
        return ""
    cls = {True: "ok", False: "bad", None: "na"}[mark.ok]
    return f'<span class="mark {cls}">{_e(mark.text)}</span>'


def _run_section(run: TokenRun, mark: Mark | None = None) -> str:
    """One run's column: title (and mark), statistics, legend, cache strip, then the prompt's and the generated
    spans."""
    qs = percentiles([r.score for r in run.records])
    stats = "".join(f"<li>{_e(k)} <strong>{_e(v)}</strong></li>" for k, v in _stats_items(run))
    sub = f"{run.n_evicted} of {len(run.records)} tokens evicted \u00b7 {run.n_live} live at the end"
    if run.calibration:
        sub += " \u00b7 the model's calibration"
    prompt = "".join(_span(r, q) for r, q in zip(run.records, qs) if r.kind == "prompt")
    gen = "".join(_span(r, q) for r, q in zip(run.records, qs) if r.kind == "generated")
    n_gen = sum(r.kind == "generated" for r in run.records)
    return (f'<section class="run" data-policy="{_e(run.stats.policy)}">'
            f'<h3>{_e(run.label)}{_mark(mark)}<span class="sub">{_e(sub)}</span></h3>'
            f'<ul class="stats">{stats}</ul>{_legend(run, qs)}{_cache_map(run)}'
            f'<div class="part-label">prompt \u00b7 {run.n_prompt} tokens</div>'
            f'<div class="text prompt-part">{prompt}</div>'
            f'<div class="part-label">generated \u00b7 {n_gen} tokens</div>'
            f'<div class="text gen-part">{gen}</div></section>')


def _case_section(case: Case) -> str:
    runs, marks = list(case.runs), list(case.marks)
    if not 1 <= len(runs) <= MAX_RUNS:
        raise ConfigError(f"a token view shows 1 to {MAX_RUNS} runs side by side, got {len(runs)}")
    if marks and len(marks) != len(runs):
        raise ConfigError(f"{len(marks)} marks for {len(runs)} runs: give one per run (None: no mark)")
    head = f'<h2 class="case-title">{_e(case.title)}</h2>' if case.title else ""
    if case.prompt is not None:
        head += f'<div class="prompt-line"><strong>Prompt:</strong> {_e(case.prompt)}</div>'
    body = "".join(_run_section(r, marks[i] if marks else None) for i, r in enumerate(runs))
    return f'<section class="case">{head}<div class="runs n{len(runs)}">{body}</div></section>'


def render_cases(cases: Sequence[Case], title: str = "epikv-local token view", meta: dict | None = None,
                 note: str | None = None) -> str:
    """One self-contained HTML page (inline CSS/JS, every text escaped) of one or more cases, one below the
    other, each with its runs side by side. meta: header facts ({name: value}, e.g. model, budget); note: a
    paragraph under the header (what the page shows, how it was made)."""
    cases = list(cases)
    if not cases:
        raise ConfigError("a token view page needs at least one case")
    facts = " \u00b7 ".join(f"{_e(k)}: {_e(v)}" for k, v in (meta or {}).items())
    head = (f'<header><h1>{_e(title)}</h1><span class="meta">{facts}</span>'
            '<label><input type="checkbox" id="hide-ev"> hide evicted tokens</label></header>')
    if note:
        head += f'<p class="note">{_e(note)}</p>'
    body = "".join(_case_section(c) for c in cases)
    foot = ("<footer>Each token is coloured by its policy score (higher = keep) as a percentile within its run: the "
            "score in the round that evicted it, or its final score if it survived. Struck through and faded: "
            "evicted; underlined: protected at the end. Hover a token for its position, score and eviction step "
            "(the same position is outlined in the other runs of its case). Generated by epikv-local.</footer>")
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{_e(title)}</title><style>\n{asset("token_view.css")}</style></head><body>{head}'
            f'<main>{body}</main>{foot}<div id="tip"></div>'
            f'<script>\n{asset("token_view.js")}</script></body></html>\n')


def render_html(runs: Sequence[TokenRun], title: str = "epikv-local token view", prompt: str | None = None,
                meta: dict | None = None, marks: Sequence[Mark | None] = ()) -> str:
    """The page of one prompt: its 1 to :data:`MAX_RUNS` runs side by side (:func:`render_cases` of one
    :class:`Case`). prompt: the user's prompt, shown above the runs; meta: header facts ({name: value}, e.g.
    model, seed); marks: one verdict per run, or none."""
    return render_cases([Case(list(runs), prompt=prompt, marks=marks)], title=title, meta=meta)


# -- writing ----------------------------------------------------------------------------------------------
def check_output_path(path: str | os.PathLike) -> Path:
    """ConfigError unless ``path`` can be written as a file: its folder exists, it is not a folder."""
    p = Path(path).expanduser()
    if str(path) == "" or p.name in ("", ".", ".."):
        raise ConfigError(f"not a file path for the HTML page: {str(path)!r}")
    if p.is_dir():
        raise ConfigError(f"cannot write the HTML page {p}: it is a directory")
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"cannot write the HTML page {p}: {parent} is not a folder")
    if not parent.is_dir():
        raise ConfigError(f"cannot write the HTML page {p}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write the HTML page {p}: folder {parent} is not writable")
    return p


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (``fileio.write_atomic``); ConfigError naming the path when
    that fails (the folder must exist)."""
    return fileio.write_atomic(check_output_path(path), text, error=ConfigError, what="HTML page",
                               make_parents=False)


def write_html(path: str | os.PathLike, runs: Sequence[TokenRun], **kwargs) -> Path:
    """Render ``runs`` (:func:`render_html`, same keyword arguments) and write the page atomically."""
    return write_atomic(path, render_html(runs, **kwargs))
