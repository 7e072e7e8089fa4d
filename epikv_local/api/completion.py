"""The pieces of ``Llama.completion_steps`` that do not need the Llama: argument checks, the
fill-in-the-middle prompt and the stream of completion chunks built from :func:`~.generation.stream_generate`.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from ..errors import ConfigError
from . import responses
from .logprobs import CompletionLogprobs
from .responses import ChunkStep


def check_budget(value, name: str = "reasoning_budget") -> int:
    """A reasoning budget (tokens; -1 unlimited, 0 close at once), checked."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ConfigError(f"{name} must be an integer >= -1 (-1: unlimited, 0: close the thinking at once), "
                          f"got {value!r}")
    return value


def chained(procs, what: str):
    """A logits processor / stopping criterion: one callable (a ``LogitsProcessorList`` /
    ``StoppingCriteriaList`` is one) or a plain list of them, combined as those lists combine them."""
    if procs is None or callable(procs):
        return procs
    if isinstance(procs, (list, tuple)) and all(callable(p) for p in procs):
        procs = list(procs)
        if what == "logits_processor":
            def chain(input_ids, scores):
                for p in procs:
                    scores = p(input_ids, scores)
                return scores
        else:
            def chain(input_ids, logits):
                return any([p(input_ids, logits) for p in procs])
        return chain
    raise ConfigError(f"{what} must be a callable or a list of callables (input_ids, scores), got "
                      f"{type(procs).__name__}")


def fim_prompt(prefix: list[int], suffix: list[int], fim: tuple[int, int, int], spm_infill: bool,
               bos: int | None, eos: int | None) -> list[int]:
    """llama-cpp-python's fill-in-the-middle prompt: [BOS] <fim_pre> prefix <fim_suf> suffix <fim_mid> [EOS]
    (the suffix part first with ``spm_infill``). fim: (pre, suf, mid) token ids; bos / eos: the tokens the
    vocabulary adds (None: none)."""
    pre, suf, mid = fim
    prefix_part, suffix_part = [pre] + prefix, [suf] + suffix
    body = suffix_part + prefix_part if spm_infill else prefix_part + suffix_part
    return ([bos] if bos is not None else []) + body + [mid] + ([eos] if eos is not None else [])


def completion_chunks(items, model_name: str, echo_text: str, lp: CompletionLogprobs | None,
                      on_done: Callable[[list[int]], None] | None = None) -> Iterator[ChunkStep]:
    """The stream of one completion from its ``GenerationResponse`` items: with ``echo``, a start chunk with
    the prompt once the first token is sampled; one chunk per text piece (with the logprobs of the tokens it
    completes), as llama-cpp-python streams them; a final chunk with the finish reason and the ``"epikv"``
    statistics. on_done(generated token ids) runs after the last item (llama-cpp-python's prompt cache stores
    its state there)."""
    cid, created = responses.new_id(), int(time.time())
    first, n_chars, generated = bool(echo_text), 0, []
    for r in items:
        if first:  # the prompt is in the cache and the first token sampled: the stream starts with the echo
            yield ChunkStep(responses.completion_chunk(cid, created, model_name, echo_text), r.stats)
            first = False
        if r.generated:
            generated.append(r.token)
            if lp is not None:
                lp.add(r.token, r.logits)
        n_chars += len(r.text)
        if r.finish_reason is None:
            if r.text:
                entries = lp.take(n_chars) if lp is not None else None
                yield ChunkStep(responses.completion_chunk(cid, created, model_name, r.text, logprobs=entries),
                                r.stats)
            continue
        # the end: the tokens a stop string cut off are not handed out (their text never is)
        entries = lp.take(n_chars, inclusive=r.finish_reason != "stop") if lp is not None else None
        if r.text or entries:
            yield ChunkStep(responses.completion_chunk(cid, created, model_name, r.text, logprobs=entries), r.stats)
        reason = responses.finish_reason(r.finish_reason)
        yield ChunkStep(responses.completion_chunk(cid, created, model_name, "", reason,
                                                   responses.extension(r.stats)), r.stats)
    if on_done is not None:
        on_done(generated)
