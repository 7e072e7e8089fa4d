"""A Llama's sequences when ``n_parallel`` > 1: each call leases one, and gives it back when its stream ends.

The sequences are sessions of one :class:`~epikv_local.engine.pool.SequencePool` (one context, decoded
together). A call takes, in this order of preference:

1. the idle sequence whose cached tokens share the longest prefix with its prompt (multi-turn reuse: the
   conversation continues where it was, as with one sequence);
2. a branch of a busy sequence that holds a longer prefix, or the whole prompt (``Session.fork``: the prompt's cells are shared,
   not decoded again: this is how ``n`` > 1 answers to one prompt, or many requests with one system prompt,
   share the prompt's cells);
3. a fresh sequence; and when every sequence is busy, it waits for one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from typing import Iterator

from ..engine.pool import SequencePool
from ..errors import ConfigError
from ..engine.session import Session

#: a busy sequence is branched only when it shares at least this many more prompt tokens than an idle one
MIN_SHARED = 16


def common_prefix(a: list[int], b: list[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class Slots:
    """Lease and release the sequences of ``pool`` (``first`` is the Llama's own session, sequence 0)."""

    def __init__(self, pool: SequencePool, first: Session):
        self.pool = pool
        self._cond = threading.Condition()
        self._idle: list[Session] = [first]
        self._busy: list[Session] = []
        self.n_primed = 0  # calls whose prompt is decoded (fan_out waits for the first before branching it)
        self._client = threading.local()  # the client a thread's calls run for (``set_client``)
        self._owner: dict[int, object] = {}  # id(session) -> the client whose conversation it holds
        self._thread: dict[int, Session] = {}  # thread id -> the session its call holds

    def set_client(self, client) -> None:
        """The calls of this thread run for ``client`` (None: anyone): they reuse or branch only sequences
        that hold that client's conversation; another client's idle sequence is emptied before it is used."""
        self._client.value = client

    def cancel_thread(self, thread_id: int) -> None:
        """Cancel the call that thread ``thread_id`` runs (its session's ``cancel()``), if any."""
        with self._cond:
            session = self._thread.get(thread_id)
        if session is not None:
            session.cancel()

    def lease(self, tokens: list[int]) -> Session:
        """A sequence for a call with prompt ``tokens`` (see the module doc); blocks while all are busy."""
        client = getattr(self._client, "value", None)

        def shared(s: Session) -> int:  # prompt tokens ``s`` holds for this client (0: another client's)
            owner = self._owner.get(id(s))
            return common_prefix(s.tokens, tokens) if client is None or owner is None or owner == client else 0

        with self._cond:
            while True:
                idle = [(shared(s), i, s) for i, s in enumerate(self._idle) if not s.closed]
                best = max(idle, key=lambda x: (x[0], -x[1]), default=None)
                donors = [(shared(s), s) for s in self._busy if not s.closed]
                donor = max(donors, key=lambda x: x[0], default=None)
                room = self.pool.n_free > 0
                held = best[0] if best else 0
                # a busy sequence holding the whole prompt is branched whenever no idle one does: the choices
                # of one ``n`` > 1 call then sample from the same prompt logits (Session.rewind_to_prefix)
                longer = donor is not None and (donor[0] > held + MIN_SHARED or donor[0] == len(tokens) > held)
                if longer and donor[0] >= MIN_SHARED and (room or idle):
                    if not room:  # give up the idle sequence that shares the least, to branch the donor
                        _, _, gone = min(idle, key=lambda x: x[0])
                        self._idle.remove(gone)
                        gone.close()
                    session = donor[1].fork()
                    break
                if best is not None:
                    session = best[2]
                    self._idle.remove(session)
                    owner = self._owner.get(id(session))
                    if client is not None and owner is not None and owner != client:
                        session.reset()  # another client's conversation: neither reused nor timed
                    break
                if room:
                    session = self.pool.open()
                    break
                self._cond.wait()
            self._busy.append(session)
            self._owner[id(session)] = client
            self._thread[threading.get_ident()] = session
            return session

    def release(self, session: Session) -> None:
        with self._cond:
            for tid, s in list(self._thread.items()):
                if s is session:
                    del self._thread[tid]
            if session in self._busy:
                self._busy.remove(session)
                if not session.closed:
                    self._idle.append(session)
            self._cond.notify_all()

    def primed(self) -> None:
        """A call's prompt is decoded (its first token sampled): later calls can branch its sequence."""
        with self._cond:
            self.n_primed += 1
            self._cond.notify_all()

    def wait_primed(self, before: int, done: threading.Event) -> None:
        """Wait until a call has primed since ``n_primed`` was ``before``, or ``done`` is set."""
        with self._cond:
            while self.n_primed == before and not done.is_set():
                self._cond.wait(0.05)

    def holding(self, session: Session, items: Iterator) -> Iterator:
        """``items``, then ``session`` released (also when the stream is closed or dropped unfinished)."""
        try:
            yield from items
        finally:
            self.release(session)

    @contextlib.contextmanager
    def reserved(self, seq_id: int):
        """The idle session of sequence ``seq_id`` (opened when none holds it), held as busy for the block:
        ConfigError when a call is using it, or there is no such sequence."""
        with self._cond:
            if not 0 <= seq_id < self.pool.n_seq:
                raise ConfigError(f"slot {seq_id} does not exist (0..{self.pool.n_seq - 1})")
            if any(s.seq_id == seq_id for s in self._busy):
                raise ConfigError(f"slot {seq_id} is processing a request")
            session = next((s for s in self._idle if s.seq_id == seq_id), None)
            if session is None:
                session = self.pool.open(seq_id=seq_id)
            else:
                self._idle.remove(session)
            self._busy.append(session)
        try:
            yield session
        finally:
            self.release(session)

    def snapshot(self) -> list[dict]:
        """Per sequence of the pool: the pool's slot record plus whether a call holds it."""
        with self._cond:
            busy = {s.seq_id for s in self._busy}
        return [dict(slot, leased=slot["id"] in busy) for slot in self.pool.slots()]


def fan_out(n: int, run_one, slots: Slots | None) -> dict:
    """``n`` answers to one call merged into one response: ``run_one(i)`` gives choice ``i``'s response (its own
    call, seed offset by ``i``). With ``slots`` (n_parallel > 1) the choices run in threads, in parallel
    sequences; the first runs alone until its prompt is decoded, so the others branch its sequence and share
    the prompt's cells. Without, they run one after another in the one sequence (each reusing the prompt's
    cells through the common prefix)."""
    results: list = [None] * n
    errors: list = []

    def work(i, done=None):
        try:
            results[i] = run_one(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
        finally:
            if done is not None:
                done.set()

    if slots is None:
        for i in range(n):
            work(i)
            if errors:
                raise errors[0]
    else:
        done = threading.Event()
        before = slots.n_primed
        first = threading.Thread(target=work, args=(0, done), daemon=True)
        first.start()
        slots.wait_primed(before, done)
        rest = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(1, n)]
        for t in rest:
            t.start()
        for t in [first, *rest]:
            t.join()
        if errors:
            raise errors[0]
    out = results[0]
    choices = []
    for i, r in enumerate(results):
        choice = dict(r["choices"][0], index=i)
        choices.append(choice)
    out["choices"] = choices
    n_prompt = out["usage"]["prompt_tokens"]
    n_completion = sum(r["usage"]["completion_tokens"] for r in results)
    out["usage"] = dict(out["usage"], completion_tokens=n_completion, total_tokens=n_prompt + n_completion)
    return out


def _tagged(step, index: int, cid: str, n_generated: int):
    """``step`` as choice ``index`` of a response with id ``cid``; its statistics count ``n_generated`` tokens
    (all choices' so far)."""
    chunk = dict(step.chunk, id=cid, choices=[dict(step.chunk["choices"][0], index=index)])
    stats = dataclasses.replace(step.stats, n_generated_tokens=n_generated) if step.stats is not None else None
    return type(step)(chunk, stats)


def fan_out_steps(n: int, start_one, slots: Slots | None) -> Iterator:
    """The ``ChunkStep`` streams of ``n`` calls merged into one (OpenAI's streamed ``n``: each chunk's choice
    has its ``index``, all chunks the first call's id); each step's statistics count the tokens of all choices
    so far. ``start_one(i)`` starts choice i's stream (primed: its prompt decoded). With ``slots`` the choices
    run in parallel sequences (the first alone until its prompt is decoded, the others branching it), else one
    after another. Closing the merged stream stops every choice at its next step."""
    counts = [0] * n
    first = start_one(0)
    cid = None

    def tag(step, i):
        nonlocal cid
        cid = cid or step.chunk["id"]
        if step.stats is not None:
            counts[i] = step.stats.n_generated_tokens
        return _tagged(step, i, cid, sum(counts))

    if slots is None:
        streams = [first]
        try:
            for i in range(n):
                steps = first if i == 0 else start_one(i)
                streams.append(steps)
                for step in steps:
                    yield tag(step, i)
        finally:
            for s in streams:
                s.close()
        return
    out: queue.Queue = queue.Queue(maxsize=64)
    stop = threading.Event()
    DONE = object()

    def pump(i, steps):
        try:
            steps = steps if steps is not None else start_one(i)
            try:
                for step in steps:
                    if stop.is_set():
                        break
                    out.put((i, step))
            finally:
                steps.close()
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            out.put((i, e))
        out.put((i, DONE))

    threads = [threading.Thread(target=pump, args=(0, first), daemon=True)]
    threads += [threading.Thread(target=pump, args=(i, None), daemon=True) for i in range(1, n)]
    for t in threads:
        t.start()
    running = n
    try:
        while running:
            i, item = out.get()
            if item is DONE:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield tag(item, i)
    finally:
        stop.set()
        while any(t.is_alive() for t in threads):  # let the pumps see ``stop`` (drain what they put)
            try:
                out.get(timeout=0.05)
            except queue.Empty:
                pass


def generate_batch(llama, prompts: list, **kwargs) -> list[dict]:
    """Complete every prompt of ``prompts`` (texts or token lists) with ``llama.create_completion(**kwargs)``,
    ``llama.n_parallel`` at a time, decoded together: the responses in prompt order, each with its own
    statistics (``"epikv"``: its sequence's live cells, evictions, tokens/s). For offline jobs (a data set
    through a bounded cache); ``stream`` is not accepted. The first error is raised once all have stopped."""
    if kwargs.get("stream"):
        raise ConfigError("generate_batch returns whole responses: stream is not accepted")
    prompts = list(prompts)
    out: list = [None] * len(prompts)
    errors: list = []
    todo = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker():
        while not errors:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                out[i] = llama.create_completion(prompts[i], **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(len(prompts), llama.n_parallel))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out
