"""The service behind the routes: one Llama, ``n_parallel`` requests at a time (``--parallel``).

:class:`Service` holds the model, its FIFO slots (``n_parallel`` requests running, each in a sequence of its
own, up to ``max_queue`` waiting, beyond that 503), whose conversation its cache holds (prompt-prefix reuse stays within one client identity), the job inside
the Llama (the only one a cancel may reach) and the counters ``/health`` reports. The generation thread of a
request is :class:`~epikv_local.api.server.job.Job`.

Importing this module loads nothing but the standard library (anyio when a service is made, inside the running
server). Errors are raised through the ``api_error`` class the app passes in
(:class:`~epikv_local.api.server.errors.APIError`), so that this module needs no FastAPI.
"""

import contextlib
import threading
import time

from ...errors import EpikvError
from .job import END_OF_STREAM, STREAM_OPENED, Job, ShuttingDown

__all__ = ["DEFAULT_MAX_QUEUE", "END_OF_STREAM", "STREAM_OPENED", "Job", "Service", "ShuttingDown"]

#: requests that may wait while one runs (``--max-queue``)
DEFAULT_MAX_QUEUE = 8
#: the cache's owner before any request: every identity differs from it, and the cache is empty anyway
_NOBODY = object()


class Service:
    """The model, its FIFO slot (one running request, ``max_queue`` waiting) and the server's counters:
    ``n_served`` generations run (completed or cut off), ``n_cancelled`` of them cut off (the client went
    away, a shutdown, a limit), ``tokens_generated`` over all of them. ``share_prompt_cache``: let a request
    reuse the cached prompt prefix of another identity's (off: the cache is reset between identities)."""

    def __init__(self, llama, alias: str, max_queue: int, api_error, share_prompt_cache: bool = False):
        import anyio

        self.llama = llama
        self.n_parallel = getattr(llama, "n_parallel", 1)
        self.alias = alias
        self.max_queue = max_queue
        self.api_error = api_error
        self.share_prompt_cache = share_prompt_cache
        self.created = int(time.time())  # unix seconds, the ``created`` of /v1/models
        self._slot = anyio.Semaphore(self.n_parallel)  # FIFO; released when a request's generation has stopped
        self._admitted = 0  # running + waiting
        self.cancel_lock = threading.Condition()  # guards ``running``: a cancel reaches the job it was aimed at
        self.running: set = set()  # the jobs whose threads are inside the Llama
        self._cache_owner = _NOBODY
        self._borrowers = threading.Condition()  # short calls (tokenize) that use the model beside a generation
        self._n_borrowers = 0
        self._closing = False  # close() has begun: no thread enters the Llama any more
        self.stopping = False  # set on SIGINT / SIGTERM: running generations stop, new requests get 503
        self.n_served = 0
        self.n_cancelled = 0
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.n_evicted = 0
        self.decode_seconds = 0.0

    # -- errors ------------------------------------------------------------------------------------------------
    def shutdown_error(self):
        return self.api_error(503, "the server is shutting down", "unavailable_error", code="shutting_down")

    def client_gone_error(self):
        return self.api_error(400, "the client closed the request", code="client_closed")

    def check_stopping(self) -> None:
        """Raise a 503 once the server is shutting down."""
        if self.stopping:
            raise self.shutdown_error()

    # -- the slot ----------------------------------------------------------------------------------------------
    def admit(self) -> None:
        """Count a request in (running or waiting), or raise a 503 when the queue is full."""
        self.check_stopping()
        if self._admitted >= self.max_queue + self.n_parallel:
            raise self.api_error(503, f"the server is busy: {min(self._admitted, self.n_parallel)} request(s) are "
                                      f"running and {self.queued} are waiting (--max-queue {self.max_queue}); "
                                      "retry later",
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
        if stats is not None:
            self.prompt_tokens += stats.n_prompt_tokens
            self.n_evicted += stats.n_evicted_call
            self.decode_seconds += stats.decode_seconds

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decode time over the generations run (0 before any)."""
        return self.tokens_generated / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def queued(self) -> int:
        """Requests waiting for the model."""
        return max(0, self._admitted - self.n_parallel)

    @property
    def busy(self) -> bool:
        """Whether a request holds or waits for the model."""
        return self._admitted > 0

    # -- inside the Llama (the job's thread) ------------------------------------------------------------------
    @contextlib.contextmanager
    def inside(self, job: Job):
        """Count ``job``'s thread inside the Llama: cancels aimed at the job reach its call while it is inside."""
        with self.cancel_lock:  # after close() began, the job finds ``stopping`` set and leaves at once
            self.running.add(job)
        try:
            yield
        finally:
            with self.cancel_lock:
                self.running.discard(job)
                self.cancel_lock.notify_all()

    def cancel_if_inside(self, job: Job) -> None:
        """Cancel ``job``'s call if its thread is inside the Llama (from any thread): ``llama.cancel()`` with
        one sequence, that thread's call only with several."""
        with self.cancel_lock:
            if job in self.running:
                with contextlib.suppress(EpikvError):  # closed meanwhile: nothing runs
                    if self.n_parallel == 1:
                        self.llama.cancel()
                    else:
                        self.llama.cancel_thread(job.thread_id)

    def claim_cache(self, identity) -> None:
        """Before a request of ``identity`` (its thread inside the Llama): forget a conversation of another
        identity, so that neither the reused-prefix count nor timing tells one client another's prompt. With
        several sequences, each is tagged with its client and only that client's calls reuse or branch it."""
        if self.n_parallel > 1:
            self.llama.set_client(None if self.share_prompt_cache else identity)
            return
        if identity != self._cache_owner and not self.share_prompt_cache:
            if self._cache_owner is not _NOBODY:
                self.llama.reset()
            self._cache_owner = identity

    def shutdown(self, abandon_at: float | None = None) -> None:
        """Begin shutting down (from any thread): new requests get 503, the running generation is stopped,
        inside a prefill too. ``abandon_at`` (from the event loop only; monotonic seconds): when the request
        stops waiting for a generation thread still inside the Llama (see ``Job.abandon_at``)."""
        self.stopping = True
        with self.cancel_lock:
            jobs = list(self.running)
        for job in jobs:
            job.stop(self.shutdown_error())
            if abandon_at is not None:
                job.abandon_at(abandon_at)

    # -- short calls beside a generation, and the end ------------------------------------------------------
    @contextlib.contextmanager
    def borrow(self):
        """Use the model for a short call that needs no slot (tokenize, detokenize): 503 once it is closing;
        :meth:`close` waits for the calls in flight."""
        with self._borrowers:
            self.check_stopping()
            self._n_borrowers += 1
        try:
            yield self.llama
        finally:
            with self._borrowers:
                self._n_borrowers -= 1
                self._borrowers.notify_all()

    def close(self) -> None:
        """Close the Llama once no generation or short call is inside it (a running generation stops at its next
        step, a prefill at its next chunk). One native call (tokenizing megabytes) cannot be interrupted: at a
        shutdown the CLI's watchdog ends the process when the grace period ends, whatever still waits here."""
        self.shutdown()
        with self._borrowers:
            self._borrowers.wait_for(lambda: self._n_borrowers == 0)
        with self.cancel_lock:
            self._closing = True
            self.cancel_lock.wait_for(lambda: not self.running)
        self.llama.close()
