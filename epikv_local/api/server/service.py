"""The service behind the routes: one Llama, one request at a time.

:class:`Service` holds the model, its FIFO slot (one request running, up to ``max_queue`` waiting, beyond that
503) and the counters ``/health`` reports. :class:`Job` is one admitted request while it holds the model: a
thread of its own runs the Llama's stream (blocking native work) and hands the chunks to the event loop through
a small buffer.

Importing this module loads nothing but the standard library (anyio and asyncio are imported when a service or
a job is made, inside the running server). Errors are raised through the ``api_error`` class the caller passes
in (:class:`~epikv_local.api.server.errors.APIError`), so that this module needs no FastAPI.
"""

import threading
import time

#: requests that may wait while one runs (``--max-queue``)
DEFAULT_MAX_QUEUE = 8
#: the buffer's first item, once the Llama's stream is open (its input was accepted)
STREAM_OPENED = object()
#: the buffer's last item after a stream that ran to its end
END_OF_STREAM = object()


class ShuttingDown(Exception):
    """The server began shutting down before a job's thread opened the stream."""


class Service:
    """The model, its FIFO slot (one running request, ``max_queue`` waiting) and the server's counters:
    ``n_served`` generations run (completed or cut off), ``n_cancelled`` of them cut off (the client went
    away, or a shutdown), ``tokens_generated`` over all of them."""

    def __init__(self, llama, alias: str, max_queue: int, api_key: str | None):
        import anyio

        self.llama = llama
        self.alias = alias
        self.max_queue = max_queue
        self.api_key = api_key
        self.created = int(time.time())  # unix seconds, the ``created`` of /v1/models
        self._slot = anyio.Semaphore(1)  # FIFO; released when a request's generation has stopped
        self._admitted = 0  # running + waiting
        self.busy_lock = threading.Lock()  # held by the thread inside the Llama (a generation, or close())
        self.stopping = False  # set on SIGINT / SIGTERM: running generations stop, new requests get 503
        self.n_served = 0
        self.n_cancelled = 0
        self.tokens_generated = 0

    def check_stopping(self, api_error) -> None:
        """Raise ``api_error`` 503 once the server is shutting down."""
        if self.stopping:
            raise api_error(503, "the server is shutting down", "unavailable_error", code="shutting_down")

    def admit(self, api_error) -> None:
        """Count a request in (running or waiting), or raise ``api_error`` 503 when the queue is full."""
        self.check_stopping(api_error)
        if self._admitted > self.max_queue:
            raise api_error(503, f"the server is busy: one request is running and {self._admitted - 1} are "
                                 f"waiting (--max-queue {self.max_queue}); retry later",
                            "unavailable_error", code="queue_full")
        self._admitted += 1

    async def acquire(self) -> None:
        """Wait for the model (FIFO); a request cancelled while waiting is counted out."""
        try:
            await self._slot.acquire()
        except BaseException:
            self._admitted -= 1
            raise

    def release(self) -> None:
        """Free the model for the next request and count this one out."""
        self._slot.release()
        self._admitted -= 1

    def record(self, stats, completed: bool) -> None:
        """Count a generation that was opened: ``stats`` its statistics (None: none were kept)."""
        self.n_served += 1
        self.n_cancelled += not completed
        self.tokens_generated += stats.n_generated_tokens if stats is not None else 0

    @property
    def queued(self) -> int:
        """Requests waiting for the model."""
        return max(0, self._admitted - 1)

    @property
    def busy(self) -> bool:
        """Whether a request holds or waits for the model."""
        return self._admitted > 0

    def close(self) -> None:
        """Close the Llama once no generation is inside it (a running one stops at its next token when
        ``stopping`` is set)."""
        self.stopping = True
        with self.busy_lock:
            self.llama.close()


class Job:
    """One request holding the model. A producer thread opens the Llama's stream and pulls its chunks into a
    small buffer that the event loop reads (so decoding the next token overlaps sending the last one); it stops
    between tokens when asked (:meth:`stop`: the client left, the server shuts down), closes the iterator itself
    and frees the model from the event loop. The statistics travel with the stream: those of the last step
    the thread read (a cut-off generation's included) are the job's. The slot is released
    exactly once, by that thread's end, whatever happens to the request's task.

    The buffer holds ``(item, took_room)`` pairs: ``STREAM_OPENED``, then the stream's chunks (dicts), then
    ``END_OF_STREAM`` or the exception the generation raised; ``took_room`` says whether the item holds one of
    the ``BUFFER`` places (the last item does not, so that it is never refused)."""

    BUFFER = 16  # chunks decoded ahead of the sender
    POLL_S = 0.05  # seconds between two looks at a stop request while the buffer is full

    def __init__(self, service: Service):
        import asyncio

        self.service = service
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.room = threading.Semaphore(self.BUFFER)
        self._stop = threading.Event()
        self.finished = self.loop.create_future()  # the generation's stats, once the thread is done
        self.stats = None

    def start(self, open_stream) -> None:
        """Run ``open_stream()`` (-> an iterator of ``ChunkStep``s: a chunk and the generation's statistics as
        of it) and the stream in the job's thread; the statistics of the last step read are the job's."""
        threading.Thread(target=self._produce, args=(open_stream,), name="epikv-generation").start()

    def stop(self) -> None:
        self._stop.set()

    def _stopped(self) -> bool:
        return self._stop.is_set() or self.service.stopping

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
        try:
            with self.service.busy_lock:
                try:
                    if self.service.stopping:
                        raise ShuttingDown()
                    it = open_stream()
                    if self._put(STREAM_OPENED):
                        for step in it:  # a ChunkStep: the chunk goes to the client, its statistics stay here
                            stats = step.stats if step.stats is not None else stats
                            if not self._put(step.chunk):
                                break
                        else:
                            completed = True
                            self._put(END_OF_STREAM, wait=False)
                except BaseException as e:  # reported to the request (bad input -> 4xx); the thread ends
                    self._put(e, wait=False)
                finally:
                    if it is not None:
                        it.close()
        finally:
            try:
                self.loop.call_soon_threadsafe(self._done, stats, completed, it is not None)
            except RuntimeError:
                pass

    def _done(self, stats, completed: bool, opened: bool) -> None:
        self.stats = stats
        if opened:
            self.service.record(stats, completed)
        self.service.release()
        if not self.finished.done():
            self.finished.set_result(stats)

    async def get(self):
        """The next chunk, ``END_OF_STREAM`` after the last; raises what the generation raised."""
        item, took_room = await self.queue.get()
        if took_room:
            self.room.release()
        if isinstance(item, BaseException):
            raise item
        return item

    async def finish(self):
        """Stop the generation (if still running) and wait until the model is free; returns its statistics."""
        import asyncio

        self.stop()
        return await asyncio.shield(self.finished)
