"""One admitted request while it holds the model: :class:`Job`, the generation thread and its buffer.

A producer thread opens the Llama's stream and pulls its chunks into a small buffer that the event loop reads
(so decoding the next token overlaps sending the last one). A job is stopped (:meth:`Job.stop`) when its client
leaves, the server shuts down, or it runs past ``--max-request-seconds``: between two tokens it sees the stop
itself, and inside a long prefill (or a decode) ``llama.cancel()`` reaches it, so a 3,000-word prompt stops
within one ``n_batch`` chunk. The cancel is aimed at this job only: it is sent while this job's thread is the
one inside the Llama (under the service's ``cancel_lock``), and repeated until the thread is out, since a
cancel that lands just before the Llama begins its generation is cleared by it. A stopped job's last item is
the reason it was stopped (an ``api_error``), which the request turns into its answer (or a stream's last
event). The slot is released exactly once, by the thread's end, whatever happens to the request's task.

Importing this module loads nothing but the standard library (asyncio when a job is made).
"""

import threading
import time

from ...errors import CancelledError

#: the buffer's first item, once the Llama's stream is open (its input was accepted)
STREAM_OPENED = object()
#: the buffer's last item after a stream that ran to its end
END_OF_STREAM = object()


class ShuttingDown(Exception):
    """The server began shutting down before a job's thread opened the stream."""


class Job:
    """One request holding the model (see the module docstring). ``identity``: whose request it is (the index of
    its API key; None without keys): the service resets the Llama's cache before a request of another identity.

    The buffer holds ``(item, took_room)`` pairs: ``STREAM_OPENED``, then the stream's chunks (dicts), then
    ``END_OF_STREAM``, the exception the generation raised or the stop's reason; ``took_room`` says whether the
    item holds one of the ``BUFFER`` places (the last item does not, so that it is never refused)."""

    BUFFER = 16  # chunks decoded ahead of the sender
    POLL_S = 0.05  # seconds between two looks at a stop request while the buffer is full, and between cancels

    def __init__(self, service, identity=None):
        import asyncio

        self.service = service
        self.identity = identity
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.room = threading.Semaphore(self.BUFFER)
        self._stop = threading.Event()
        self._out = threading.Event()  # the thread has left the Llama
        self._canceller: threading.Thread | None = None
        self.reason = None  # the api_error the job was stopped with (the first one given)
        self.finished = self.loop.create_future()  # the generation's stats, once the thread is done
        self.stats = None
        self._deadline = None
        self.thread_id: int | None = None  # the generation thread (a cancel with several sequences aims at it)
        self.abandoned = False  # the reader gave up on the thread (a shutdown's grace period ran out)

    def start(self, open_stream, max_seconds: float | None = None, timeout_error=None) -> None:
        """Run ``open_stream()`` (-> an iterator of ``ChunkStep``s: a chunk and the generation's statistics as
        of it) and the stream in the job's thread; the statistics of the last step read are the job's.
        After ``max_seconds`` the job is stopped with ``timeout_error``."""
        if max_seconds is not None:
            self._deadline = self.loop.call_later(max_seconds, self.stop, timeout_error)
        threading.Thread(target=self._produce, args=(open_stream,), name="epikv-generation").start()

    def stop(self, reason=None) -> None:
        """Stop the generation (from the event loop or any thread): between tokens, or by cancelling the Llama's
        call in progress. ``reason``: the api_error the request ends with (the first one given wins)."""
        if self.reason is None and reason is not None:
            self.reason = reason
        self._stop.set()
        if self._canceller is None and not self._out.is_set():
            self._canceller = threading.Thread(target=self._cancel_until_out, name="epikv-cancel", daemon=True)
            self._canceller.start()

    def abandon_at(self, deadline: float) -> None:
        """From the event loop, at a shutdown: if the thread is still inside the Llama at ``deadline``
        (monotonic seconds), stop waiting for it: the reader gets the stop error at once, :meth:`finish`
        returns None. Only one native call (tokenizing megabytes) outlasts a cancel; the server exits anyway."""
        def give_up():
            if not self._out.is_set():
                self.abandoned = True
                self.queue.put_nowait((self._stop_error(), False))
                if not self.finished.done():
                    self.finished.set_result(None)

        self.loop.call_later(max(0.0, deadline - time.monotonic()), give_up)

    def _cancel_until_out(self) -> None:
        while True:
            self.service.cancel_if_inside(self)
            if self._out.wait(self.POLL_S):
                return

    def _stopped(self) -> bool:
        return self._stop.is_set() or self.service.stopping

    def _stop_error(self):
        """What a stopped job ends with: its reason, else a shutdown's 503 or the client's leaving."""
        if self.reason is not None:
            return self.reason
        return self.service.shutdown_error() if self.service.stopping else self.service.client_gone_error()

    def _put(self, item, wait: bool = True) -> bool:
        """Hand ``item`` to the event loop; ``wait``: for a place in the buffer first (False when asked to stop
        meanwhile). False also when the event loop is gone."""
        while wait and not self.room.acquire(timeout=self.POLL_S):
            if self._stopped():
                return False
        if wait and self._stopped():
            return False
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (item, wait))
        except RuntimeError:  # the event loop is gone (shutdown)
            self._stop.set()
            return False
        return True

    def _produce(self, open_stream) -> None:
        it, stats, completed = None, None, False
        self.thread_id = threading.get_ident()
        try:
            with self.service.inside(self):
                try:
                    if self.service.stopping:
                        raise ShuttingDown()
                    self.service.claim_cache(self.identity)
                    it = open_stream()
                    if self._put(STREAM_OPENED):
                        for step in it:  # a ChunkStep: the chunk goes to the client, its statistics stay here
                            stats = step.stats if step.stats is not None else stats
                            if not self._put(step.chunk):
                                break
                        else:
                            completed = True
                            self._put(END_OF_STREAM, wait=False)
                    if not completed:
                        self._put(self._stop_error(), wait=False)
                except BaseException as e:  # reported to the request (bad input -> 4xx); the thread ends
                    stopped = isinstance(e, CancelledError) or (self._stopped() and not isinstance(e, ShuttingDown))
                    self._put(self._stop_error() if stopped else e, wait=False)
                finally:
                    if it is not None:
                        it.close()
        finally:
            self._out.set()
            try:
                self.loop.call_soon_threadsafe(self._done, stats, completed, it is not None)
            except RuntimeError:
                pass

    def _done(self, stats, completed: bool, opened: bool) -> None:
        self.stats = stats
        if self._deadline is not None:
            self._deadline.cancel()
        if opened:
            self.service.record(stats, completed)
        self.service.release()
        if not self.finished.done():
            self.finished.set_result(stats)

    async def get(self):
        """The next chunk, ``END_OF_STREAM`` after the last; raises what the generation raised (or the reason
        it was stopped)."""
        item, took_room = await self.queue.get()
        if took_room:
            self.room.release()
        if isinstance(item, BaseException):
            raise item
        return item

    async def finish(self):
        """Stop the generation (if still running) and wait until the model is free; returns its statistics (None
        once :meth:`abandon_at` gave up on the thread)."""
        import asyncio

        self.stop()
        return await asyncio.shield(self.finished)
