"""Split a reasoning model's ``<think>…</think>`` out of its answer, as llama-server's
``--reasoning-format deepseek`` does: the thinking goes to ``reasoning_content``, the rest to ``content``.

Works on a stream of text pieces (a tag may arrive split over several pieces), so streamed deltas and the
final message agree. DeepSeek-R1-style templates end the generation prompt with ``<think>\\n``: the model's
output then starts inside the thinking, without an opening tag (``starts_open``). Text after a thinking block
that never closes stays reasoning, as in llama-server.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("deepseek", "none")


def prompt_opens_thinking(prompt_text: str) -> bool:
    """True when a rendered chat prompt ends inside an opened thinking block."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


class ReasoningSplitter:
    """Feed text pieces with :meth:`feed`; each call returns (reasoning delta, content delta)."""

    def __init__(self, starts_open: bool = False):
        self.in_think = starts_open
        self.seen_open = starts_open
        self._buf = ""  # text that may be the beginning of a tag
        self._started = {"r": False, "c": False}  # leading whitespace of each part is dropped

    def _trim(self, which: str, text: str) -> str:
        if not self._started[which]:
            text = text.lstrip()
            self._started[which] = bool(text)
        return text

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            tag = CLOSE if self.in_think else OPEN
            k = self._buf.find(tag)
            if k >= 0:
                (reasoning if self.in_think else content).append(self._buf[:k])
                self._buf = self._buf[k + len(tag):]
                if self.in_think:
                    self.in_think = False
                elif not self.seen_open:  # only the first opening tag starts reasoning
                    self.in_think = self.seen_open = True
                else:
                    content.append(tag)
                continue
            # keep a suffix that could be the start of the tag for the next piece
            keep = next((n for n in range(min(len(tag) - 1, len(self._buf)), 0, -1)
                         if tag.startswith(self._buf[-n:])), 0)
            out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            (reasoning if self.in_think else content).append(out)
            break
        return self._trim("r", "".join(reasoning)), self._trim("c", "".join(content))

    def flush(self) -> tuple[str, str]:
        """What is still held back at the end of the text."""
        rest, self._buf = self._buf, ""
        return (self._trim("r", rest), "") if self.in_think else ("", self._trim("c", rest))


def split_reasoning(text: str, starts_open: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole text."""
    sp = ReasoningSplitter(starts_open)
    r1, c1 = sp.feed(text)
    r2, c2 = sp.flush()
    return r1 + r2, c1 + c2
