"""A request's life once its body is checked: wait for the model, open the Llama's stream, respond.

:func:`start` admits the request (or 503), waits for the model and opens the stream in a :class:`~.service.Job`,
so that bad input and a prompt that does not fit the budget are answered before any response is sent.
:func:`respond` sends the chunks as server-sent events (``data: {chunk}`` lines, then ``data: [DONE]``) or
assembles one JSON response from them. Either way the model is freed when the response ends, however it ends.
This module imports fastapi, sse-starlette and llama-cpp-python's server at the top:
:func:`~epikv_local.api.server.routes.create_app` imports it, nothing at import time.
"""

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from llama_cpp.server.app import _logit_bias_tokens_to_input_ids
from sse_starlette.sse import EventSourceResponse

from ...errors import EpikvError, first_line
from .errors import APIError, epikv_status, error_body, status_type
from .service import END_OF_STREAM, STREAM_OPENED, Job, Service, ShuttingDown


async def start(service: Service, request: Request, method, kwargs: dict, bias_tokens: dict | None) -> Job:
    """Admit (or 503), wait for the model, and open ``method(**kwargs)`` (a Llama ``*_steps`` method) in a job:
    bad input and a prompt that does not fit the budget raise here, before any response is sent.
    ``bias_tokens``: a ``logit_bias`` keyed by token text, converted to token ids once the model is held."""
    service.admit(APIError)
    await service.acquire()
    try:
        service.check_stopping(APIError)
        if await request.is_disconnected():
            raise APIError(400, "the client closed the request before it started", code="client_closed")
        job = Job(service)
    except BaseException:
        service.release()
        raise

    def open_stream():
        if bias_tokens is not None:
            kwargs["logit_bias"] = _logit_bias_tokens_to_input_ids(service.llama, bias_tokens)
        return iter(method(**kwargs))

    job.start(open_stream)
    try:
        if await job.get() is not STREAM_OPENED:
            raise RuntimeError("the generation thread did not open its stream")
    except ShuttingDown:
        await job.finish()
        service.check_stopping(APIError)
        raise
    except BaseException:
        await job.finish()
        raise
    return job


async def respond(service: Service, request: Request, job: Job, stream: bool, assemble):
    """The response to a started ``job``: its chunks as events when ``stream``, else
    ``assemble(chunks, stats)`` as JSON (gathered until the end; a client that leaves stops the generation)."""
    if stream:
        return JobEventSource(events(service, request, job), job=job, sep="\n")
    try:
        chunks = []
        while (chunk := await job.get()) is not END_OF_STREAM:
            chunks.append(chunk)
            service.check_stopping(APIError)
            if await request.is_disconnected():
                raise APIError(400, "the client closed the request", code="client_closed")
    finally:
        stats = await job.finish()
    return JSONResponse(assemble(chunks, stats))


async def events(service: Service, request: Request, job: Job):
    """The job's chunks as server-sent events (``{"data": json}``), then ``[DONE]``; an error once the response
    has started (a Llama error, a shutdown) is the last event, in OpenAI's error shape."""
    try:
        while True:
            try:
                chunk = await job.get()
            except EpikvError as e:  # the response has started: the error goes into the stream
                status = epikv_status(e)
                yield {"data": json.dumps(error_body(first_line(e), status_type(status), code=type(e).__name__))}
                return
            if chunk is END_OF_STREAM:
                break
            yield {"data": json.dumps(chunk)}
            if service.stopping:
                yield {"data": json.dumps(error_body("the server is shutting down", "unavailable_error",
                                                     code="shutting_down"))}
                return
            if await request.is_disconnected():
                return
        yield {"data": "[DONE]"}
    finally:
        await job.finish()


class JobEventSource(EventSourceResponse):
    """An SSE response that frees the model when it ends, however it ends (also if never iterated)."""

    def __init__(self, content, *, job: Job, **kwargs):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.job.finish()
