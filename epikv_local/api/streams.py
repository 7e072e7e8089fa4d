"""The Llama's streams: started at the call (:func:`primed`) and superseded by a newer call (:class:`Stream`).

One ``Llama`` holds one sequence, so a new call cannot share the cache with a stream still being read: it
supersedes that stream, which frees the stream's generation at once and raises :data:`SUPERSEDED` (a
ConfigError) at its next item, rather than ending as if the generation had finished.
"""

from __future__ import annotations

import threading
from typing import Iterator

from ..errors import ConfigError

#: what an older stream raises at its next item once a newer call on the same Llama superseded it
SUPERSEDED = "this stream was superseded by a newer call on the same Llama (one Llama holds one sequence: " \
             "read a stream to its end before the next call, or use one Llama per conversation)"


def primed(it: Iterator) -> Iterator:
    """Run an iterator to its first item now, so that bad input and a prompt that does not fit the budget
    raise at the call, not at the first ``next()``; the item is replayed. Closing the result closes ``it``."""
    sentinel = object()
    first = next(it, sentinel)

    def replay():
        try:
            if first is not sentinel:
                yield first
            yield from it
        finally:
            it.close()
    return replay()


class Stream:
    """An iterator of ``ChunkStep``s that a newer call can supersede (:meth:`supersede`).

    A stream whose last chunk (the one with a ``finish_reason``) was read is finished: superseding it
    changes nothing, and it ends as usual.
    """

    def __init__(self, steps: Iterator):
        self._steps = steps
        self._superseded = False
        self._finished = False
        self._reading = threading.Lock()  # held while a thread is inside next(): supersede() never waits for it

    def __iter__(self) -> "Stream":
        return self

    def __next__(self):
        with self._reading:
            if self._superseded and not self._finished:
                raise ConfigError(SUPERSEDED)
            step = next(self._steps)
            if step.chunk["choices"][0].get("finish_reason") is not None:
                self._finished = True
            return step

    def close(self) -> None:
        self._steps.close()

    def supersede(self) -> bool:
        """End the generation (its session state is released) and make the next read raise. False, and
        nothing done, when the stream is being read in another thread right now: the newer call is then
        refused by the session instead (it is still generating)."""
        if not self._reading.acquire(blocking=False):  # another thread is inside next() right now
            return False
        try:
            self._steps.close()
            self._superseded = True
            return True
        finally:
            self._reading.release()
