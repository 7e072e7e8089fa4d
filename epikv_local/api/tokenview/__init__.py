"""Token view: see which tokens of a generation an eviction policy kept, evicted, and when.

:func:`run_tokens` generates under a policy with eviction recording on and returns a :class:`TokenRun`: one
:class:`TokenRecord` per position of the sequence (prompt and generated) with its text, its policy score (the
score it had in the round that evicted it, or its final score if it survived), whether and when it was
evicted (eviction round, generation step, sequence length at that moment) and whether it was protected (sink,
prompt, recent window, newest) at the end. :func:`collect_run` builds the same from a recorded session the
caller ran itself (what ``epikv-local generate --html`` does).

:func:`render_html` turns one to three runs of one prompt into ONE self-contained HTML page (inline CSS and JS, no
external resource, every text escaped): each token is a ``<span class="tok">`` coloured by its score (a diverging
scale over the score's percentile within its run), evicted tokens struck through and faded, protected ones
underlined, a tooltip per token, a legend and the run's statistics per column. :func:`write_html` writes it
atomically; :func:`token_view` is the one-call front door (exported as ``epikv_local.token_view``).
:func:`render_cases` puts several prompts on one page (:class:`Case`), each run with an optional verdict
(:class:`Mark`, e.g. a graded answer: ``scripts/accuracy_pages.py`` makes one page per benchmark setting).

Derivation of "when": every recorded :class:`~epikv_local.engine.budget.EvictionEvent` lists the live positions
at that moment, and the newest position is always live (the engine never evicts it), so the sequence length
when the round ran is ``max(event.positions) + 1``; the generation step is that length minus the prompt
length (``None``: the round ran during prefill). Rounds are numbered by their index in ``session.events``.

Modules: :mod:`.records` (the records, and collecting them from a session's public API), :mod:`.display`
(colour scale, percentiles, short texts), :mod:`.render` (the HTML page and its atomic write; its CSS and JS
are the package data files ``assets/token_view.css`` and ``assets/token_view.js``), :mod:`.page` (the front
doors: :func:`token_view`, the CLI's :class:`PageBuilder`). Everything public is imported from here.
"""

from __future__ import annotations

from ...errors import ConfigError  # noqa: F401  (callers catch tokenview.ConfigError)
from .display import SCALE, colour, display_text, fmt_bytes, fmt_score, percentiles
from .page import PageBuilder, page_meta, token_view
from .records import TokenRecord, TokenRun, collect_run, run_tokens
from .render import (MAX_RUNS, Case, Mark, asset, check_output_path, render_cases, render_html, write_atomic,
                     write_html)

__all__ = ["MAX_RUNS", "SCALE", "Case", "Mark", "PageBuilder", "TokenRecord", "TokenRun", "asset", "check_output_path",
           "collect_run", "colour", "display_text", "fmt_bytes", "fmt_score", "page_meta",
           "percentiles", "render_cases", "render_html", "run_tokens", "token_view", "write_atomic", "write_html"]
