"""Token view: see which tokens of a generation an eviction policy kept, evicted, and when.

:func:`run_tokens` generates under a policy with eviction recording on and returns a :class:`TokenRun`: one
:class:`TokenRecord` per position of the sequence (prompt and generated) with its text, its policy score (the
score it had in the round that evicted it, or its final score if it survived), whether and when it was
evicted (eviction round, generation step, sequence length at that moment) and whether it was protected (sink,
prompt, recent window) at the end. :func:`collect_run` builds the same from a recorded session the caller
ran itself (what ``epikv-local generate --html`` does).

:func:`render_html` turns one or two runs into ONE self-contained HTML page (inline CSS and JS, no external
resource, every text escaped): each token is a ``<span class="tok">`` coloured by its score (a diverging
scale over the score's percentile within its run), evicted tokens struck through and faded, protected ones
underlined, a tooltip per token, a legend and the run's statistics per column. :func:`write_html` writes it
atomically; :func:`token_view` is the one-call front door (exported as ``epikv_local.token_view``).

Derivation of "when": every recorded :class:`~epikv_local.engine.budget.EvictionEvent` lists the live positions
at that moment, and the newest position is always live (the engine never evicts it), so the sequence length
when the round ran is ``max(event.positions) + 1``; the generation step is that length minus the prompt
length (``None``: the round ran during prefill). Rounds are numbered by their index in ``session.events``.
"""

from __future__ import annotations

import codecs
import html
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence

import numpy as np

from ..engine.budget import BudgetConfig
from ..engine.handles import Model
from ..engine.session import Session, SessionConfig
from .. import fileio
from ..errors import ConfigError
from ..policies.base import Policy
from .generation import GenerationResult, GenerationStats, generate
from .sampling import SamplingConfig

#: most runs one page shows side by side
MAX_RUNS = 2


# -- records ------------------------------------------------------------------------------------------------
@dataclass
class TokenRecord:
    """One position of the sequence.

    text: the characters this token completes (its UTF-8 bytes decoded incrementally: a token that only starts
        a multi-byte character has ``""`` and the next one carries it); special tokens are rendered.
    kind: "prompt" or "generated".
    score: the policy's score (higher = keep) when the token was evicted, else its score at the end; None when
        it was never scored (NaN) or not decoded. +/-inf are kept as floats.
    decoded: False only for a generated token that was sampled last and never decoded into the cache.
    evicted_round: index into the run's events of the round that evicted it (None: kept).
    evicted_step: generated tokens in the sequence when that round ran (None: during prefill, or kept).
    evicted_seq_len: sequence length (positions decoded) when that round ran.
    evicted_reason: the round's reason ("budget", "budget_window", "kv_full_hook").
    protected: protections in force at the end for a live token: any of "sink", "prompt", "recent", "newest".
    """

    position: int
    token: int
    text: str
    kind: str
    score: float | None
    decoded: bool = True
    evicted_round: int | None = None
    evicted_step: int | None = None
    evicted_seq_len: int | None = None
    evicted_reason: str | None = None
    protected: tuple[str, ...] = ()

    @property
    def evicted(self) -> bool:
        return self.evicted_round is not None

    @property
    def live(self) -> bool:
        """Held in the KV cache at the end."""
        return self.decoded and not self.evicted

    def as_dict(self) -> dict:
        d = asdict(self)
        d["protected"] = list(self.protected)
        d["evicted"] = self.evicted
        if d["score"] is not None and not math.isfinite(d["score"]):
            d["score"] = str(d["score"])  # JSON has no inf
        return d


@dataclass
class TokenRun:
    """One generation seen token by token: the records, the statistics and the settings that produced them."""

    label: str
    records: list[TokenRecord]
    stats: GenerationStats
    text: str
    budget: BudgetConfig
    recent: int                      # recent window in effect (after a protected prompt shrank it)
    n_prompt: int
    events: list = field(default_factory=list, repr=False)  # the session's EvictionEvents
    calibration: str | None = None   # path of the model calibration used, if any
    settings: dict = field(default_factory=dict)  # policy settings (for the page)

    @property
    def n_evicted(self) -> int:
        return sum(r.evicted for r in self.records)

    @property
    def n_live(self) -> int:
        return sum(r.live for r in self.records)

    def as_dict(self) -> dict:
        return {"label": self.label, "stats": self.stats.as_dict(), "text": self.text,
                "budget": asdict(self.budget), "recent": self.recent, "n_prompt": self.n_prompt,
                "n_rounds": len(self.events), "calibration": self.calibration, "settings": dict(self.settings),
                "records": [r.as_dict() for r in self.records]}


def _token_texts(model: Model, tokens: Sequence[int]) -> list[str]:
    """The characters each token completes (incremental UTF-8 decoding; special tokens rendered)."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    out = [dec.decode(model.token_bytes(int(t), special=True)) for t in tokens]
    tail = dec.decode(b"", final=True)
    if tail and out:
        out[-1] += tail
    return out


def _clean_score(v: float) -> float | None:
    v = float(v)
    return None if math.isnan(v) else v


def collect_run(session: Session, prompt_tokens: Sequence[int], result: GenerationResult, label: str | None = None,
                calibration: str | None = None) -> TokenRun:
    """The token records of a generation that ``session`` (created with ``record=True``, fresh before it)
    just ran on ``prompt_tokens``; call it before the session is closed or reused."""
    if not session.engine.record:
        raise ConfigError("the token view needs a session created with record=True")
    n_prompt = len(prompt_tokens)
    n_past = session.n_past
    decoded = list(session.tokens)
    if decoded[:n_prompt] != [int(t) for t in prompt_tokens] or n_past < n_prompt:
        raise ConfigError("the session does not hold this prompt from position 0: run the generation on a fresh "
                          "session (no reused prefix) before collecting its token view")
    gen = [int(t) for t in result.tokens]
    if decoded[n_prompt:] != gen[: n_past - n_prompt]:
        raise ConfigError("the session's generated tokens differ from the result's: collect right after generate()")
    tokens = decoded + gen[n_past - n_prompt:]  # the last sampled token(s) were never decoded
    texts = _token_texts(session.model, tokens)

    events = list(session.events)
    recs = [TokenRecord(position=p, token=t, text=texts[p], kind="prompt" if p < n_prompt else "generated",
                        score=None, decoded=p < n_past) for p, t in enumerate(tokens)]
    for k, ev in enumerate(events):
        if not len(ev.evicted):
            continue
        seq_len = int(np.max(ev.positions)) + 1
        index = {int(p): i for i, p in enumerate(ev.positions)}
        for p in ev.evicted:
            r = recs[int(p)]
            if r.evicted:
                raise ConfigError(f"position {int(p)} evicted twice: the session was rewound; collect from a fresh run")
            r.score = _clean_score(ev.scores[index[int(p)]])
            r.evicted_round, r.evicted_seq_len, r.evicted_reason = k, seq_len, ev.reason
            r.evicted_step = seq_len - n_prompt if seq_len >= n_prompt else None

    live = session.live_positions()
    if len(live):
        final = session.policy.score(live)
        mask = session.engine.protected(live)
        eng, cfg = session.engine, session.budget
        for p, s, m in zip(live.tolist(), np.asarray(final, dtype=np.float64), mask):
            r = recs[p]
            r.score = _clean_score(s)
            if m:
                kinds = []
                if p < cfg.n_sink:
                    kinds.append("sink")
                if cfg.protect_prompt and eng.prompt_end is not None and p < eng.prompt_end:
                    kinds.append("prompt")
                if p > eng.newest - max(1, eng.recent):
                    kinds.append("recent")
                if p == eng.newest:
                    kinds.append("newest")
                r.protected = tuple(kinds)
    settings = {}
    for name in ("layers", "window"):
        if hasattr(session.policy, name) and getattr(session.policy, name) is not None:
            v = getattr(session.policy, name)
            settings[name] = list(v) if isinstance(v, tuple) else v
    if session.layers:
        settings["layers"] = list(session.layers)
    return TokenRun(label=label or session.policy.name, records=recs, stats=result.stats, text=result.text,
                    budget=session.budget, recent=int(session.engine.recent), n_prompt=n_prompt, events=events,
                    calibration=calibration, settings=settings)


def check_policy(policy: Policy, cfg: SessionConfig) -> None:
    """ConfigError now (before a long first run) if ``policy`` cannot run with these session settings."""
    if policy.needs_attention and cfg.flash_attn:
        raise ConfigError(f"policy {policy.name!r} reads the attention matrix, which flash attention never "
                          "materialises: run it with flash attention off (--no-flash-attn)")


def run_tokens(model: Model, prompt_tokens: Sequence[int], policy: Policy, budget: BudgetConfig,
               cfg: SessionConfig | None = None, sampling: SamplingConfig = SamplingConfig(),
               max_tokens: int | None = 256, stop: tuple[str, ...] = (), ignore_eog: bool = False,
               on_text: Callable[[str], object] | None = None, label: str | None = None,
               calibration: str | None = None) -> TokenRun:
    """Generate from ``prompt_tokens`` under ``policy`` and ``budget`` on a new recording session and return
    the token view of the run (one record per position, prompt and generated)."""
    tokens = [int(t) for t in prompt_tokens]
    with Session(model, policy, budget, cfg, record=True) as session:
        session.check_prompt(len(tokens))
        result = generate(session, tokens, max_tokens, sampling, tuple(stop), on_text=on_text,
                          ignore_eog=ignore_eog)
        return collect_run(session, tokens, result, label=label, calibration=calibration)


# -- colours ------------------------------------------------------------------------------------------------
#: diverging scale, low score (evicted first) -> high score (kept): (fraction, (r, g, b))
SCALE = ((0.0, (69, 117, 180)), (0.25, (145, 191, 219)), (0.5, (247, 247, 247)), (0.75, (253, 174, 97)),
         (1.0, (215, 48, 39)))


def _mix(q: float) -> tuple[int, int, int]:
    q = min(1.0, max(0.0, q))
    for (f0, c0), (f1, c1) in zip(SCALE, SCALE[1:]):
        if q <= f1:
            t = (q - f0) / (f1 - f0) if f1 > f0 else 0.0
            return tuple(round(a + (b - a) * t) for a, b in zip(c0, c1))
    return SCALE[-1][1]


def colour(q: float | None, light: float = 0.35) -> str:
    """Background colour of a percentile q in [0, 1] (None: unscored), lightened towards white for reading."""
    if q is None:
        return "#e6e6e6"
    r, g, b = (round(c + (255 - c) * light) for c in _mix(q))
    return f"#{r:02x}{g:02x}{b:02x}"


def percentiles(scores: Sequence[float | None]) -> list[float | None]:
    """Each score's mid-rank percentile in [0, 1] among the run's scores (ties share one; inf sorts at the ends;
    None stays None). All equal: 0.5."""
    vals = np.array([s for s in scores if s is not None], dtype=np.float64)
    if len(vals) == 0:
        return [None] * len(scores)
    srt = np.sort(vals)
    n = len(srt)
    out: list[float | None] = []
    for s in scores:
        if s is None:
            out.append(None)
            continue
        lo = int(np.searchsorted(srt, s, "left"))
        hi = int(np.searchsorted(srt, s, "right"))
        out.append(0.5 if n == 1 or (lo == 0 and hi == n) else ((lo + hi - 1) / 2) / (n - 1))
    return out


def fmt_score(s: float | None) -> str:
    if s is None or math.isnan(s):
        return "unscored"
    if math.isinf(s):
        return "+inf" if s > 0 else "-inf"
    if s == int(s) and abs(s) < 1e9:
        return str(int(s))
    return f"{s:.3g}"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def display_text(text: str) -> str:
    """What a token's span shows (before escaping): a run of line breaks gets one visible mark (so that a
    newline token has something to colour) and keeps its breaks; everything else is shown as is."""
    return re.sub(r"(\r\n|\r|\n)+", lambda m: "\u21b5" + "\n" * m.group(0).replace("\r\n", "\n").count("\n")
                  if "\n" in m.group(0) else "\u21b5", text)


# -- HTML ---------------------------------------------------------------------------------------------------
_CSS = """
*{box-sizing:border-box}
body{margin:0;background:#fafafa;color:#1d1d1f;font:13px/1.45 "DejaVu Sans","Segoe UI",Helvetica,Arial,sans-serif}
header{padding:10px 18px 8px;border-bottom:1px solid #ddd;background:#fff;display:flex;gap:18px;align-items:baseline;
 flex-wrap:wrap}
header h1{font-size:17px;margin:0;font-weight:700}
header .meta{color:#555;font-size:12px}
header label{margin-left:auto;font-size:12px;color:#333;cursor:pointer;user-select:none}
.prompt-line{padding:6px 18px;background:#fff;border-bottom:1px solid #ddd;font-size:12px;color:#333;
 white-space:pre-wrap;max-height:4.4em;overflow:auto}
.prompt-line strong{color:#000}
main{display:grid;gap:14px;padding:12px 14px}
main.n1{grid-template-columns:minmax(0,1fr)}
main.n2{grid-template-columns:minmax(0,1fr) minmax(0,1fr)}
section.run{background:#fff;border:1px solid #d6d6d6;border-radius:6px;padding:10px 12px;min-width:0}
.run h2{font-size:15px;margin:0 0 6px;display:flex;align-items:baseline;gap:10px}
.run h2 .sub{font-size:11.5px;font-weight:400;color:#666}
.stats{display:flex;flex-wrap:wrap;gap:3px 5px;margin:0 0 7px;padding:0;list-style:none}
.stats li{background:#f2f3f5;border-radius:3px;padding:1px 6px;font-size:11.5px;color:#444;white-space:nowrap}
.stats li strong{color:#111;font-weight:600}
.legend{display:flex;flex-wrap:wrap;align-items:center;gap:6px 14px;font-size:11.5px;color:#444;
 padding:6px 0 8px;border-bottom:1px solid #eee;margin-bottom:8px}
.scale{display:flex;align-items:center;gap:6px}
.bar{width:150px;height:11px;border-radius:2px;border:1px solid #ccc}
.key{display:inline-flex;align-items:center;gap:4px}
.key .tok{font-size:11.5px;padding:0 3px}
.map{display:flex;align-items:center;gap:8px;font-size:11.5px;color:#444;margin:0 0 6px}
.map svg{flex:1;height:12px;border:1px solid #bbb;background:#fff;min-width:60px}
.map .mk{display:inline-flex;align-items:center;gap:4px;white-space:nowrap}
.map i{display:inline-block;width:10px;height:10px;border:1px solid #999}
.part-label{font-size:10.5px;text-transform:uppercase;letter-spacing:.06em;color:#777;margin:6px 0 2px}
.text{white-space:pre-wrap;word-wrap:break-word;overflow-wrap:anywhere;font:13px/1.75 "DejaVu Sans Mono",Menlo,
 Consolas,monospace;color:#111}
.prompt-part{background:#fbfbfb;border-left:3px solid #bbb;padding:2px 6px;margin-bottom:6px}
.tok{border-radius:2px;box-shadow:inset -1px 0 0 rgba(255,255,255,.85);cursor:default}
.tok.ev{opacity:.5;text-decoration:line-through;text-decoration-color:rgba(122,0,0,.8);text-decoration-thickness:1px}
.tok.pr{box-shadow:inset 0 -1.5px 0 #333,inset -1px 0 0 rgba(255,255,255,.85)}
.tok.un{background-image:repeating-linear-gradient(45deg,rgba(0,0,0,.10) 0 2px,transparent 2px 5px)}
.tok.nd{outline:1px dashed #666}
.tok.hl{outline:2px solid #000;opacity:1}
body.hide-ev .tok.ev{display:none}
#tip{position:fixed;display:none;z-index:10;max-width:360px;background:#222;color:#f4f4f4;font-size:12px;
 line-height:1.45;padding:6px 8px;border-radius:4px;pointer-events:none;white-space:pre-line;
 box-shadow:0 2px 8px rgba(0,0,0,.3)}
footer{padding:4px 18px 14px;font-size:11px;color:#777}
"""

_JS = """
(function(){
  var tip=document.getElementById('tip');
  document.querySelectorAll('.tok[title]').forEach(function(s){s.dataset.tip=s.title;s.removeAttribute('title');});
  function show(e){
    var s=e.target.closest('.tok'); if(!s||!s.dataset.tip){return;}
    tip.textContent=s.dataset.tip; tip.style.display='block';
    var x=Math.min(e.clientX+14,window.innerWidth-370), y=e.clientY+16;
    if(y+110>window.innerHeight){y=e.clientY-110;}
    tip.style.left=x+'px'; tip.style.top=y+'px';
    var p=s.dataset.p; document.querySelectorAll('.tok[data-p="'+p+'"]').forEach(function(o){o.classList.add('hl');});
  }
  function hide(e){
    var s=e.target.closest('.tok'); tip.style.display='none';
    if(s){document.querySelectorAll('.tok.hl').forEach(function(o){o.classList.remove('hl');});}
  }
  document.addEventListener('mouseover',show); document.addEventListener('mouseout',hide);
  var box=document.getElementById('hide-ev');
  if(box){box.addEventListener('change',function(){document.body.classList.toggle('hide-ev',box.checked);});}
})();
"""


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _tooltip(r: TokenRecord) -> str:
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
    st = run.stats
    items = [("policy", st.policy), ("kv_budget", str(st.kv_budget)), ("n_sink", str(run.budget.n_sink)),
             ("recent", str(run.recent)), ("prompt", f"{st.n_prompt_tokens} tok"),
             ("generated", f"{st.n_generated_tokens} tok"), ("evicted", str(st.n_evicted)),
             ("rounds", str(sum(1 for e in run.events if len(e.evicted)))), ("live at end", str(run.n_live)),
             ("max live cells", str(st.max_live_cells)), ("KV", _fmt_bytes(st.kv_bytes)),
             ("flash attn", "on" if st.flash_attn else "off")]
    if st.layers:
        items.append(("layers", ",".join(map(str, st.layers))))
    if "window" in run.settings:
        items.append(("window", str(run.settings["window"])))
    items.append(("stop", st.stop_reason or "-"))
    return items


def _legend(run: TokenRun, qs: list[float | None]) -> str:
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
    mark = f'<rect x="{run.n_prompt - 0.15:.2f}" y="0" width="0.3" height="10" fill="#d00"/>' if run.n_prompt < n else ""
    return ('<div class="map"><span>cache at the end (positions 0\u2013' f"{n - 1}" '):</span>'
            f'<svg viewBox="0 0 {n} 10" preserveAspectRatio="none" shape-rendering="crispEdges" role="img" '
            f'aria-label="live and evicted positions">{"".join(rects)}{mark}</svg>'
            '<span class="mk"><i style="background:#1f2937"></i>live <i style="background:#cfd2dc"></i>evicted '
            '<i style="background:#d00;width:2px"></i>prompt end</span></div>')


def _run_section(run: TokenRun) -> str:
    qs = percentiles([r.score for r in run.records])
    stats = "".join(f"<li>{_e(k)} <strong>{_e(v)}</strong></li>" for k, v in _stats_items(run))
    sub = f"{run.n_evicted} of {len(run.records)} tokens evicted \u00b7 {run.n_live} live at the end"
    if run.calibration:
        sub += " \u00b7 the model's calibration"
    prompt = "".join(_span(r, q) for r, q in zip(run.records, qs) if r.kind == "prompt")
    gen = "".join(_span(r, q) for r, q in zip(run.records, qs) if r.kind == "generated")
    n_gen = sum(r.kind == "generated" for r in run.records)
    return (f'<section class="run" data-policy="{_e(run.stats.policy)}">'
            f'<h2>{_e(run.label)}<span class="sub">{_e(sub)}</span></h2>'
            f'<ul class="stats">{stats}</ul>{_legend(run, qs)}{_cache_map(run)}'
            f'<div class="part-label">prompt \u00b7 {run.n_prompt} tokens</div>'
            f'<div class="text prompt-part">{prompt}</div>'
            f'<div class="part-label">generated \u00b7 {n_gen} tokens</div>'
            f'<div class="text gen-part">{gen}</div></section>')


def render_html(runs: Sequence[TokenRun], title: str = "epikv-local token view", prompt: str | None = None,
                meta: dict | None = None) -> str:
    """One self-contained HTML page of one or two runs side by side (inline CSS/JS, every text escaped).

    prompt: the user's prompt shown in the header; meta: extra header facts ({name: value}, e.g. model, seed).
    """
    runs = list(runs)
    if not 1 <= len(runs) <= MAX_RUNS:
        raise ConfigError(f"a token view shows 1 to {MAX_RUNS} runs, got {len(runs)}")
    facts = " \u00b7 ".join(f"{_e(k)}: {_e(v)}" for k, v in (meta or {}).items())
    head = (f'<header><h1>{_e(title)}</h1><span class="meta">{facts}</span>'
            '<label><input type="checkbox" id="hide-ev"> hide evicted tokens</label></header>')
    if prompt is not None:
        head += f'<div class="prompt-line"><strong>Prompt:</strong> {_e(prompt)}</div>'
    body = "".join(_run_section(r) for r in runs)
    foot = ("<footer>Each token is coloured by its policy score (higher = keep) as a percentile within its run: the "
            "score in the round that evicted it, or its final score if it survived. Struck through and faded: "
            "evicted; underlined: protected at the end. Hover a token for its position, score and eviction step "
            "(the same position is outlined in the other run). Generated by epikv-local.</footer>")
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{_e(title)}</title><style>{_CSS}</style></head><body>{head}'
            f'<main class="n{len(runs)}">{body}</main>{foot}<div id="tip"></div>'
            f'<script>{_JS}</script></body></html>\n')


# -- writing --------------------------------------------------------------------------------------------------
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


# -- the command line's page (``epikv-local generate --html``) ----------------------------------------------
class PageBuilder:
    """Collects the runs of one ``--html`` page: the command's own run, then an optional comparison run of the
    same prompt and settings under another policy. Everything that can be refused (the output path, the
    comparison policy) is checked in the constructor, before anything is generated."""

    def __init__(self, out: str | os.PathLike, compare: str | None = None,
                 model_path: str | os.PathLike | None = None, cfg: SessionConfig | None = None,
                 kv_budget: int | None = None):
        from .calibration import resolve_policy

        self.out = check_output_path(out)
        self.compare = resolve_policy(compare, model_path, kv_budget=kv_budget) if compare else None
        if self.compare is not None:
            check_policy(self.compare.policy, cfg or SessionConfig())
        self.compare_name = compare
        self.runs: list[TokenRun] = []

    def add(self, session: Session, prompt_tokens: Sequence[int], result: GenerationResult,
            calibration: str | None = None) -> TokenRun:
        """The command's own run (its session was created with ``record=True``)."""
        run = collect_run(session, prompt_tokens, result, calibration=calibration)
        self.runs.append(run)
        return run

    def run_compare(self, model: Model, prompt_tokens: Sequence[int], budget: BudgetConfig, cfg: SessionConfig,
                    sampling: SamplingConfig, max_tokens: int | None, stop: tuple[str, ...] = (),
                    ignore_eog: bool = False) -> TokenRun | None:
        """Run the comparison policy with the same prompt, budget (its own recent share, as ``--policy`` would
        give it), sampling and seed; None without one."""
        if self.compare is None:
            return None
        from dataclasses import replace

        cal = self.compare.calibration
        run = run_tokens(model, prompt_tokens, self.compare.policy,
                         replace(budget, recent_fraction=self.compare.recent_fraction), cfg, sampling, max_tokens,
                         stop, ignore_eog, label=self.compare_name, calibration=cal.path if cal else None)
        self.runs.append(run)
        return run

    def write(self, prompt: str | None = None, meta: dict | None = None) -> Path:
        return write_html(self.out, self.runs, prompt=prompt, meta=meta)


# -- front door -----------------------------------------------------------------------------------------------
def token_view(model_path: str | os.PathLike | None, prompt: str, policies: Sequence[str] = ("epikv",),
               kv_budget: int = 128, max_tokens: int | None = 300, chat: bool = True, system: str | None = None,
               out: str | os.PathLike | None = "token_view.html", sampling: SamplingConfig = SamplingConfig(),
               n_sink: int = 4, n_recent: int | None = None, protect_prompt: bool = True, evict_chunk: int = 16,
               session_cfg: SessionConfig | None = None, n_gpu_layers: int = -1, stop: tuple[str, ...] = (),
               ignore_eog: bool = False) -> list[TokenRun]:
    """Run ``prompt`` under each of one or two ``policies`` (same budget, sampling and seed; greedy by default)
    and write the side-by-side token view to ``out`` (None: write nothing). Returns the runs.

    model_path None: the default model. Each policy takes the model's calibration the way the CLI does
    (:func:`~epikv_local.api.calibration.resolve_policy`), recent share included.
    """
    from ..engine.handles import check_gguf
    from .calibration import resolve_policy
    from .chat import apply_chat_template, tokenize_prompt
    from .models import default_model_path

    if isinstance(policies, str):
        policies = (policies,)
    policies = tuple(policies)
    if not 1 <= len(policies) <= MAX_RUNS:
        raise ConfigError(f"token_view compares 1 to {MAX_RUNS} policies, got {len(policies)}")
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError("the prompt must be a non-empty string")
    if out is not None:
        check_output_path(out)
    path = default_model_path() if model_path is None else check_gguf(model_path)
    cfg = session_cfg or SessionConfig()
    resolved = [resolve_policy(name, path, kv_budget=kv_budget) for name in policies]
    for r in resolved:
        check_policy(r.policy, cfg)
    runs = []
    with Model(path, n_gpu_layers=n_gpu_layers) as model:
        text = apply_chat_template(model, prompt, system=system) if chat else prompt
        tokens = tokenize_prompt(model, text)
        for name, r in zip(policies, resolved):
            budget = BudgetConfig(kv_budget=kv_budget, n_sink=n_sink, n_recent=n_recent,
                                  recent_fraction=r.recent_fraction, protect_prompt=protect_prompt,
                                  evict_chunk=evict_chunk)
            runs.append(run_tokens(model, tokens, r.policy, budget, cfg, sampling, max_tokens, stop, ignore_eog,
                                   label=name, calibration=r.calibration.path if r.calibration else None))
    if out is not None:
        write_html(out, runs, prompt=prompt, meta=page_meta(path, sampling, chat))
    return runs


def page_meta(model_path: str | os.PathLike, sampling: SamplingConfig, chat: bool) -> dict:
    """The header facts of a page: model file, sampling, chat template."""
    samp = "greedy" if sampling.temperature <= 0 else f"temp {sampling.temperature} top_p {sampling.top_p}"
    return {"model": Path(model_path).name, "sampling": f"{samp}, seed {sampling.seed}",
            "chat template": "yes" if chat else "no"}
