"""A request's life once its body is checked: wait for the model, open the Llama's stream, respond.

:func:`start` admits the request (or 503), waits for the model and opens the stream in a
:class:`~.job.Job`, so that bad input and a prompt that does not fit the budget are answered before any response
is sent. A client that leaves while it waits in the queue gives its place back at once; one that leaves during
the prefill stops it (``llama.cancel()``). :func:`respond` sends the chunks as server-sent events (``data:
{chunk}`` lines, then ``data: [DONE]``; an error once the stream has started, a shutdown's included, is its last
event before ``[DONE]``) or assembles one JSON response from them. Either way the model is freed when the
response ends, however it ends: a stream whose client reads nothing for ``--stall-seconds`` is dropped.
This module imports fastapi, sse-starlette and llama-cpp-python's server at the top:
:func:`~epikv_local.api.server.routes.create_app` imports it, nothing at import time.
"""

import asyncio
import json
import sys

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from llama_cpp.server.app import _logit_bias_tokens_to_input_ids
from sse_starlette.sse import EventSourceResponse, SendTimeoutError

from ...errors import EpikvError
from .errors import APIError, epikv_error, error_body, status_type
from .gate import IDENTITY
from .limits import Limits
from .service import END_OF_STREAM, STREAM_OPENED, Job, Service, ShuttingDown

#: seconds a stream may take to send its last events once a shutdown began (within uvicorn's grace period)
SHUTDOWN_EVENTS_S = 3.0


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body was read by then: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, coro, on_gone):
    """Await ``coro`` in this task; if the client leaves meanwhile, call ``on_gone()`` (on the event loop, while
    this task still waits in ``coro``), which makes ``coro`` end (its result or error is the caller's)."""
    waiting = [True]

    def fire(f: asyncio.Future) -> None:
        if waiting[0] and not f.cancelled() and f.exception() is None:
            on_gone()

    gone = asyncio.ensure_future(_disconnected(request))
    gone.add_done_callback(fire)
    try:
        return await coro
    finally:
        waiting[0] = False
        gone.cancel()


async def _wait_for_model(service: Service, request: Request) -> None:
    """Wait for the model (FIFO); a client that leaves meanwhile gives its place back at once (400)."""
    task, left = asyncio.current_task(), []

    def leave() -> None:
        left.append(True)
        task.cancel()  # thrown into service.acquire(), which counts the request out

    try:
        await _unless_gone(request, service.acquire(), leave)
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()
        raise service.client_gone_error() from None


def timeout_error(limits: Limits) -> APIError:
    return APIError(503, f"the request ran past the server's limit of {limits.max_request_seconds:g} seconds "
                         "(--max-request-seconds); its generation was stopped", code="request_timeout")


async def start(service: Service, request: Request, method, kwargs: dict, bias_tokens: dict | None,
                limits: Limits) -> Job:
    """Admit (or 503), wait for the model, and open ``method(**kwargs)`` (a Llama ``*_steps`` method) in a job:
    bad input and a prompt that does not fit the budget raise here, before any response is sent.
    ``bias_tokens``: a ``logit_bias`` keyed by token text, converted to token ids once the model is held."""
    service.admit()
    await _wait_for_model(service, request)
    try:
        service.check_stopping()
        if await request.is_disconnected():
            raise service.client_gone_error()
        job = Job(service, request.scope.get(IDENTITY))
    except BaseException:
        service.release()
        raise

    def open_stream():
        if bias_tokens is not None:
            kwargs["logit_bias"] = _logit_bias_tokens_to_input_ids(service.llama, bias_tokens)
        return iter(method(**kwargs))

    job.start(open_stream, limits.max_request_seconds, timeout_error(limits))
    try:  # the prefill: a client that leaves stops it
        if await _unless_gone(request, job.get(), lambda: job.stop(service.client_gone_error())) \
                is not STREAM_OPENED:
            raise RuntimeError("the generation thread did not open its stream")
    except ShuttingDown:
        await job.finish()
        service.check_stopping()
        raise
    except BaseException:
        await job.finish()
        raise
    return job


async def respond(service: Service, request: Request, job: Job, stream: bool, assemble, limits: Limits,
                  usage_chunk=None):
    """The response to a started ``job``: its chunks as events when ``stream`` (then ``usage_chunk(last chunk,
    stats)``, when given, before ``[DONE]``), else ``assemble(chunks, stats)`` as JSON (gathered until the end;
    a client that leaves stops the generation)."""
    if stream:
        return JobEventSource(events(service, request, job, usage_chunk), job=job, sep="\n",
                              send_timeout=limits.stall_seconds, shutdown_event=anyio.Event(),
                              shutdown_grace_period=SHUTDOWN_EVENTS_S)
    try:
        chunks = []
        while (chunk := await job.get()) is not END_OF_STREAM:
            chunks.append(chunk)
            service.check_stopping()
            if await request.is_disconnected():
                raise service.client_gone_error()
    finally:
        stats = await job.finish()
    return JSONResponse(assemble(chunks, stats))


def _error_event(e: BaseException) -> dict:
    if isinstance(e, APIError):
        body = error_body(e.detail, e.type, e.param, e.code)
    else:
        status, message, code, param = epikv_error(e)
        body = error_body(message, status_type(status), param, code)
    return {"data": json.dumps(body)}


async def events(service: Service, request: Request, job: Job, usage_chunk=None):
    """The job's chunks as server-sent events (``{"data": json}``), then ``[DONE]``; an error once the response
    has started (a Llama error, a shutdown, a limit) is the last event before ``[DONE]``, in OpenAI's shape."""
    try:
        last, calls_seen = None, set()
        while True:
            try:
                chunk = await job.get()
            except (EpikvError, APIError) as e:  # the response has started: the error goes into the stream
                yield _error_event(e)
                break
            if chunk is END_OF_STREAM:
                if usage_chunk is not None and last is not None:
                    yield {"data": json.dumps(usage_chunk(last, await job.finish()))}
                break
            last = chunk
            yield {"data": json.dumps(openai_tool_deltas(chunk, calls_seen))}
            if service.stopping:
                yield _error_event(service.shutdown_error())
                break
            if await request.is_disconnected():
                return
        yield {"data": "[DONE]"}
    finally:
        await job.finish()


def openai_tool_deltas(chunk: dict, seen: set) -> dict:
    """``chunk`` with each tool call's ``id``, ``type`` and function ``name`` in its first delta only, as OpenAI
    streams them (clients join the deltas' strings); llama-cpp-python's chat handlers repeat them in every delta,
    and the legacy ``function_call`` beside them too. ``seen``: the tool-call indexes already sent in this
    stream, and "function_call" once that was (updated)."""
    choices = chunk.get("choices") or ()
    if not any(isinstance(c, dict) and ((c.get("delta") or {}).get("tool_calls") or
                                        (c.get("delta") or {}).get("function_call")) for c in choices):
        return chunk
    out = {**chunk, "choices": []}
    for c in choices:
        delta = dict(c.get("delta") or {})
        calls = delta.get("tool_calls")
        if calls:
            fixed = []
            for d in calls:
                i = d.get("index", 0)
                if i in seen:
                    d = {k: v for k, v in d.items() if k not in ("id", "type")}
                    if isinstance(d.get("function"), dict):
                        d["function"] = {k: v for k, v in d["function"].items() if k != "name"}
                seen.add(i)
                fixed.append(d)
            delta["tool_calls"] = fixed
        fc = delta.get("function_call")
        if isinstance(fc, dict):
            if "function_call" in seen:
                delta["function_call"] = {k: v for k, v in fc.items() if k != "name"}
            seen.add("function_call")
        out["choices"].append({**c, "delta": delta})
    return out


class JobEventSource(EventSourceResponse):
    """An SSE response that frees the model when it ends, however it ends (also if never iterated). A send that
    waits past its ``send_timeout`` (a client that reads nothing) drops the stream: the model is freed and the
    connection closed."""

    def __init__(self, content, *, job: Job, **kwargs):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            print(f"epikv-local: dropped a stream whose client read nothing for {self.send_timeout:g} s "
                  "(--stall-seconds)", file=sys.stderr, flush=True)
        finally:
            await self.job.finish()
