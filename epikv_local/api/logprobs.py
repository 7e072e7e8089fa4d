"""Completion ``logprobs`` in llama-cpp-python's shape (``llama_types.CompletionLogprobs``)::

    {"tokens": [str, ...], "text_offset": [int, ...], "token_logprobs": [float, ...],
     "top_logprobs": [{token string: logprob, ...}, ...]}

one entry per generated token, as ``llama_cpp.Llama._create_completion`` builds them: the token's string
(``detokenize([token])`` decoded with errors ignored), its text offset (``len(prompt)`` plus the characters of
the generated text before it), its log-probability and a dict of the ``logprobs`` most likely tokens plus the
sampled one. The log-probabilities are the log-softmax of the model's raw logits row the token was drawn from
(before logit bias, logits processors, penalties, grammar and temperature), as llama-cpp-python's ``_scores``.
Chat logprobs are converted from these by llama-cpp-python's own chat handlers.
"""

from __future__ import annotations

import codecs

import numpy as np

#: the keys of a completion's logprobs, in llama-cpp-python's order
KEYS = ("tokens", "text_offset", "token_logprobs", "top_logprobs")


def logits_to_logprobs(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    """log-softmax of ``logits`` along ``axis`` (float32), llama-cpp-python's ``Llama.logits_to_logprobs``."""
    maxs = np.amax(logits, axis=axis, keepdims=True)
    if maxs.ndim > 0:
        maxs[~np.isfinite(maxs)] = 0
    elif not np.isfinite(maxs):
        maxs = 0
    shifted = np.subtract(logits, maxs, dtype=np.single)
    with np.errstate(divide="ignore"):  # log of zero for an all -inf row
        out = np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))
    return shifted - out


def empty() -> dict:
    return {k: [] for k in KEYS}


def merge(parts) -> dict:
    """One logprobs dict from the logprobs of several chunks (None entries skipped), in order."""
    out = empty()
    for p in parts:
        if p:
            for k in KEYS:
                out[k].extend(p[k])
    return out


class CompletionLogprobs:
    """The logprobs of one completion, built token by token and handed out with the text they belong to.

    model: the engine Model (token strings). n_top: how many alternatives per token (``logprobs``; 0: only
    the sampled token's). base_offset: ``len(prompt)`` (llama-cpp-python's: characters of a text prompt, the
    number of ids of a token prompt).
    """

    def __init__(self, model, n_top: int, base_offset: int):
        self.model = model
        self.n_top = n_top
        self.base = base_offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0  # characters of generated text before the next token
        self._pending: list[tuple[int, str, float, dict]] = []  # (offset in the generated text, ...)

    def _piece(self, token: int) -> str:
        return self.model.token_bytes(int(token)).decode("utf-8", errors="ignore")

    def add(self, token: int, logits: np.ndarray) -> None:
        """A generated token and the (n_vocab,) raw logits row it was drawn from."""
        lp = logits_to_logprobs(logits)
        token_str = self._piece(token)
        top: dict[str, float] = {}
        k = min(self.n_top, lp.shape[-1])
        if k > 0:
            idx = np.argpartition(lp, -k)[-k:]
            # llama-cpp-python sorts (logprob, id) pairs descending: ties go to the larger id
            for i in sorted(idx.tolist(), key=lambda i: (lp[i], i), reverse=True):
                top[self._piece(i)] = float(lp[i])
        top[token_str] = float(lp[token])  # the sampled token is always there (dict.update, as upstream)
        self._pending.append((self._chars, token_str, float(lp[token]), top))
        self._chars += len(self._decoder.decode(self.model.token_bytes(int(token))))

    def take(self, n_chars: int, inclusive: bool = False) -> dict | None:
        """The entries of the tokens whose text starts within the first ``n_chars`` characters of the
        generated text handed out so far (the stream holds back text that may start a stop string; tokens
        cut off with it are never handed out), or None when there are none. inclusive: also those starting
        at ``n_chars`` (tokens without text at the end of a generation no stop string cut)."""
        n = 0
        while n < len(self._pending) and (self._pending[n][0] < n_chars
                                          or inclusive and self._pending[n][0] == n_chars):
            n += 1
        if not n:
            return None
        entries, self._pending = self._pending[:n], self._pending[n:]
        return {"tokens": [e[1] for e in entries], "text_offset": [self.base + e[0] for e in entries],
                "token_logprobs": [e[2] for e in entries], "top_logprobs": [e[3] for e in entries]}
