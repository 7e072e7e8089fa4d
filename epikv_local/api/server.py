"""``epikv-local serve``: an OpenAI-compatible HTTP server for one :class:`~epikv_local.api.llama.Llama`.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON, or server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health``. Responses are the Llama's own: reasoning is split
into ``reasoning_content`` and every response (and the last stream chunk) carries the ``"epikv"`` eviction
statistics. Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: a bad request
(body not JSON, fields of the wrong type, an unknown model name, any ``EpikvError`` of the Llama such as a
``BudgetError``) is a 4xx and leaves the server healthy; a full queue is 503; a missing or wrong
``--api-key`` bearer token is 401.

Scheduling: the model has one KV cache, so requests run one at a time. Up to ``--max-queue`` more wait in
FIFO order, beyond that a request is answered 503 at once. Generation is blocking native work: each request's
generation runs in a thread of its own that pulls the Llama's stream into a small buffer read by the event
loop, so decoding the next token overlaps sending the last one and the loop keeps answering ``/health``. The
thread stops between two tokens when the client goes away or the server shuts down (SIGINT / SIGTERM), closes
the Llama's iterator itself and only then frees the model for the next request. Every request, streaming or
not, is run as the Llama's stream; a non-streaming response is assembled from the chunks (the Llama's
reasoning splitter makes streamed deltas and the final message agree), so a client that disconnects also
stops a long non-streaming generation. ``/health`` reports the queue and counts the generations served, cut
off, and their tokens.

How llama-cpp-python's server (``llama-cpp-python[server]``, pinned with the bindings) is reused, and why not
its ``create_app``: its app is built around a module-global ``LlamaProxy`` that constructs ``llama_cpp.Llama``
from its ``ModelSettings`` (which know nothing of a KV budget or a policy), and its routes call the stock
class's methods unbound (``llama_cpp.Llama.create_chat_completion(llama, ...)``), so handing it our object
would run llama-cpp-python's implementation on it. Its double lock also queues without bound (no 503) and its
error route turns validation errors into 500s (and fails on a body that is not JSON). So this module builds a
small FastAPI app of its own and reuses the pieces that fit: the request models (``CreateChatCompletionRequest``,
``CreateCompletionRequest``: field names, types and ranges as llama-cpp-python's server accepts them; only the
chat messages are left to the Llama's own check, whose errors name the message),
``RouteErrorHandler`` (subclassed: ``EpikvError`` and validation errors become 4xx instead of 500, a body is
checked to be a JSON object before its recovery path re-reads it), its logit-bias token conversion, sse-starlette's
``EventSourceResponse`` and uvicorn. Sampling fields a request does not set take the Llama's defaults (the
reasoning-model temperature 0.6 / top-p 0.95, no ``max_tokens`` limit), not the request model's.

fastapi, uvicorn, sse-starlette and llama_cpp are imported by :func:`create_app` / :func:`run` only: the CLI
imports this module to build its parser. (No ``from __future__ import annotations`` here: FastAPI reads the
endpoints' annotations, whose classes are local to :func:`create_app`.)
"""

import json
import sys
import threading
import time
from pathlib import Path

from ..errors import ConfigError, EpikvError, NativeError, first_line
from . import responses as R
from .chat import flatten_text_parts

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_MAX_QUEUE = 8
#: seconds a shutdown waits for requests in flight before cancelling them (a generation stops at its next token)
SHUTDOWN_GRACE_S = 5
#: request fields that are not Llama arguments (checked or converted here)
NOT_LLAMA_ARGS = frozenset({"n", "best_of", "user", "logit_bias_type", "min_tokens", "stream"})
_END = object()


# -- the command line ----------------------------------------------------------------------------------------------
def add_args(p) -> None:
    """Add ``serve``'s arguments to its argparse subparser (generate's names where they mean the same)."""
    from .options import add_budget_args, add_model_args
    from .reasoning import FORMATS

    add_model_args(p)
    p.add_argument("--model-alias", default=None,
                   help="model id in /v1/models and responses; unset: the model file's name")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (0: any free port)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*; unset: no key (/health is always open)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait while one runs; more are answered 503")
    add_budget_args(p)
    p.add_argument("--reasoning-format", choices=list(FORMATS), default="deepseek",
                   help="deepseek: <think>...</think> goes to reasoning_content; none: it stays in content")
    p.add_argument("--chat-format", default=None,
                   help="a llama-cpp-python chat format name; unset: the GGUF's chat template")


def _check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key must not be empty")
    if args.model_alias is not None and not args.model_alias.strip():
        raise ConfigError("--model-alias must not be empty")


def _listen(host: str, port: int):
    """A listening TCP socket on host:port (ConfigError naming the address when that fails)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def _url(sock) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(args) -> int:
    """Serve until SIGINT (exit 130 through ``run_main``) or SIGTERM (exit 0)."""
    import signal

    from ..engine.handles import check_gguf

    _check_args(args)
    model_path = check_gguf(args.model)
    alias = args.model_alias or model_path.name

    def on_term(signum, frame):  # before uvicorn takes over (model loading), and re-raised by it at the end
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, on_term)
    sock = _listen(args.host, args.port)  # fail fast, before the model is loaded
    try:
        try:
            import uvicorn
        except ImportError:
            raise ConfigError('the server needs uvicorn: pip install "llama-cpp-python[server]==0.3.36"') from None
        from .llama import Llama
        from .options import llama_kwargs

        llama = Llama(**{**llama_kwargs(args), "model_path": model_path}, chat_format=args.chat_format,
                      reasoning_format=args.reasoning_format)
        app = None
        try:
            if llama.calibration is not None:
                print(f"epikv-local: using calibration {llama.calibration.path}", file=sys.stderr)
            app = create_app(llama, model_alias=alias, api_key=args.api_key, max_queue=args.max_queue)
            banner = f"epikv-local: serving {alias} on {_url(sock)}"

            service = app.state.epikv

            class Server(uvicorn.Server):
                def handle_exit(self, sig, frame):  # SIGINT / SIGTERM: generations stop at their next token
                    service.stopping = True
                    super().handle_exit(sig, frame)

                async def startup(self, sockets=None):
                    await super().startup(sockets=sockets)
                    if not self.should_exit:
                        print(banner, file=sys.stderr, flush=True)

            config = uvicorn.Config(app, log_level="info" if args.verbose else "warning", access_log=args.verbose,
                                    lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
            Server(config).run(sockets=[sock])
        finally:
            if app is not None:
                app.state.epikv.close()  # after a generation thread still inside the Llama stops
            else:
                llama.close()
    finally:
        sock.close()
        signal.signal(signal.SIGTERM, previous)
    return 0


# -- the service: one Llama, one request at a time ---------------------------------------------------------------
class _Service:
    """The model, its FIFO slot (one running request, ``max_queue`` waiting) and the server's counters."""

    def __init__(self, llama, alias: str, max_queue: int, api_key: str | None):
        import anyio

        self.llama = llama
        self.alias = alias
        self.max_queue = max_queue
        self.api_key = api_key
        self.created = int(time.time())
        self._slot = anyio.Semaphore(1)  # FIFO; released when a request's generation has stopped
        self._admitted = 0  # running + waiting
        self.busy_lock = threading.Lock()  # held by the thread inside the Llama (a generation, or close())
        self.stopping = False  # set on SIGINT / SIGTERM: running generations stop, new requests get 503
        self.n_served = 0  # generations run (completed or cut off)
        self.n_cancelled = 0  # generations cut off by a client that went away, or by a shutdown
        self.tokens_generated = 0

    def check_stopping(self, api_error) -> None:
        if self.stopping:
            raise api_error(503, "the server is shutting down", "unavailable_error", code="shutting_down")

    def admit(self, api_error) -> None:
        self.check_stopping(api_error)
        if self._admitted > self.max_queue:
            raise api_error(503, f"the server is busy: one request is running and {self._admitted - 1} are "
                                 f"waiting (--max-queue {self.max_queue}); retry later",
                            "unavailable_error", code="queue_full")
        self._admitted += 1

    async def acquire(self) -> None:
        try:
            await self._slot.acquire()
        except BaseException:
            self._admitted -= 1
            raise

    def release(self) -> None:
        self._slot.release()
        self._admitted -= 1

    def record(self, stats, completed: bool) -> None:
        self.n_served += 1
        self.n_cancelled += not completed
        self.tokens_generated += stats.n_generated_tokens if stats is not None else 0

    @property
    def queued(self) -> int:
        return max(0, self._admitted - 1)

    @property
    def busy(self) -> bool:
        return self._admitted > 0

    def close(self) -> None:
        """Close the Llama once no generation is inside it (a running one stops at its next token when
        ``stopping`` is set)."""
        self.stopping = True
        with self.busy_lock:
            self.llama.close()


class _Job:
    """One request holding the model. A producer thread opens the Llama's stream and pulls its chunks into a
    small buffer that the event loop reads (so decoding the next token overlaps sending the last one); it stops
    between tokens when asked (:meth:`stop`: the client left, the server shuts down), closes the iterator itself
    (the Llama's statistics are then final) and frees the model from the event loop. The slot is released
    exactly once, by that thread's end, whatever happens to the request's task."""

    BUFFER = 16  # chunks decoded ahead of the sender

    def __init__(self, service: _Service):
        import asyncio

        self.service = service
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.room = threading.Semaphore(self.BUFFER)
        self._stop = threading.Event()
        self.finished = self.loop.create_future()  # the generation's stats, once the thread is done
        self.stats = None

    def start(self, open_stream) -> None:
        threading.Thread(target=self._produce, args=(open_stream,), name="epikv-generation").start()

    def stop(self) -> None:
        self._stop.set()

    def _stopped(self) -> bool:
        return self._stop.is_set() or self.service.stopping

    def _put(self, item, wait: bool = True) -> bool:
        while wait and not self.room.acquire(timeout=0.05):
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
                        raise _Stopped()
                    it = open_stream()
                    if self._put(_OPENED):
                        for chunk in it:
                            if not self._put(chunk):
                                break
                        else:
                            completed = True
                            self._put(_END, wait=False)
                except BaseException as e:  # reported to the request (bad input -> 4xx); the thread ends
                    self._put(e, wait=False)
                finally:
                    if it is not None:
                        try:
                            it.close()
                        finally:
                            stats = self.service.llama.last_stats
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
        """The next chunk, ``_END`` after the last; raises what the generation raised."""
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


class _Stopped(Exception):
    pass


_OPENED = object()


# -- response assembly (a non-streaming response from the stream's chunks) -----------------------------------------
def _usage(stats) -> dict:
    return R.usage(stats.n_prompt_tokens, stats.n_generated_tokens) if stats is not None else R.usage(0, 0)


def assemble_chat(chunks: list[dict], stats) -> dict:
    """A ``chat.completion`` from its ``chat.completion.chunk``s (as the Llama's non-streaming call returns)."""
    role, content, reasoning, finish, ext = "assistant", [], [], None, None
    for c in chunks:
        choice = c["choices"][0]
        delta = choice.get("delta") or {}
        role = delta.get("role") or role
        content.append(delta.get("content") or "")
        reasoning.append(delta.get("reasoning_content") or "")
        finish = choice.get("finish_reason") or finish
        ext = c.get(R.EXTENSION, ext)
    message = {"role": role, "content": "".join(content)}
    if any(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    first = chunks[0]
    return {"id": first["id"], "object": "chat.completion", "created": first["created"], "model": first["model"],
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": _usage(stats), R.EXTENSION: ext}


def assemble_completion(chunks: list[dict], stats) -> dict:
    """A ``text_completion`` from its stream chunks."""
    text, finish, ext = [], None, None
    for c in chunks:
        choice = c["choices"][0]
        text.append(choice.get("text") or "")
        finish = choice.get("finish_reason") or finish
        ext = c.get(R.EXTENSION, ext)
    first = chunks[0]
    return {"id": first["id"], "object": "text_completion", "created": first["created"], "model": first["model"],
            "choices": [{"text": "".join(text), "index": 0, "logprobs": None, "finish_reason": finish}],
            "usage": _usage(stats), R.EXTENSION: ext}


def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _status_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
            422: "invalid_request_error", 503: "unavailable_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")


def _epikv_status(error: EpikvError) -> int:
    """Bad input (ConfigError, BudgetError, ModelError, ...: ValueErrors) is the client's 400; a native failure
    (NativeError) is the server's 500."""
    return 500 if isinstance(error, NativeError) else 400


def _validation_message(errors) -> tuple[str, str | None]:
    """(message, param) of pydantic / FastAPI validation errors: the first one, naming its field. The members
    of a union (a message's role) are left out of the field path, and their literal choices are merged."""
    if not errors:
        return "invalid request", None

    def path(e) -> str:
        return ".".join(str(x) for x in e.get("loc", ())
                        if x != "body" and not (isinstance(x, str) and x[:1].isupper()))

    first = errors[0]
    param = path(first) or None
    same = [e for e in errors if path(e) == param]
    msg = first.get("msg", "invalid value")
    if len(same) > 1 and all(e.get("type") == "literal_error" for e in same):
        choices = [str((e.get("ctx") or {}).get("expected", "")) for e in same]
        msg = "Input should be " + " or ".join(dict.fromkeys(c for c in choices if c))
    rest = len(errors) - len(same)
    more = f" (and {rest} more)" if rest > 0 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


# -- the app ---------------------------------------------------------------------------------------------------------
def create_app(llama, *, model_alias: str | None = None, api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE):
    """A FastAPI app serving ``llama`` (an :class:`epikv_local.Llama`) under the id ``model_alias`` (default: the
    model file's name). ``api_key``: the bearer token required on ``/v1/*`` (None: open). ``max_queue``:
    requests that may wait while one runs. The app does not close the Llama; its ``state.epikv.close()`` does
    so safely (after a worker thread still inside it returns)."""
    import secrets
    from typing import Any

    try:
        from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse
        from fastapi.security import HTTPBearer
        from llama_cpp.server.app import _logit_bias_tokens_to_input_ids
        from llama_cpp.server.errors import ErrorResponse, RouteErrorHandler
        from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
        from pydantic import Field
        from sse_starlette.sse import EventSourceResponse
        from starlette.exceptions import HTTPException as StarletteHTTPException
    except ImportError as e:
        raise ConfigError(f"the server needs llama-cpp-python's server extra ({e.name} is missing): "
                          'pip install "llama-cpp-python[server]==0.3.36"') from None

    if max_queue < 0:
        raise ConfigError(f"max_queue must be >= 0, got {max_queue}")

    class ChatRequest(CreateChatCompletionRequest):
        # the Llama checks each message (check_messages: role, content, naming the index); pydantic's union of
        # message TypedDicts would answer a wrong content type with a list of role mismatches
        messages: list[dict[str, Any]] = Field(default_factory=list, description="the conversation")

    alias = model_alias or Path(llama.model_path).name
    service = _Service(llama, alias, max_queue, api_key)

    class APIError(HTTPException):
        """An OpenAI-shaped error; an HTTPException, so RouteErrorHandler passes it on to our handler."""

        def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None,
                     code: str | None = None):
            super().__init__(status_code=status, detail=message)
            self.type, self.param, self.code = type_ or _status_type(status), param, code

    def error_response(status: int, message: str, type_: str | None = None, param=None, code=None,
                       headers=None) -> JSONResponse:
        return JSONResponse(_error_body(message, type_ or _status_type(status), param, code), status_code=status,
                            headers=headers)

    class OpenAIRoute(RouteErrorHandler):
        """llama-cpp-python's error route with our mapping: EpikvError -> 400 (NativeError 500), validation
        error -> 400 naming the field; other exceptions stay its 500 with a traceback on stderr."""

        def error_message_wrapper(self, error, body=None):
            if isinstance(error, EpikvError):
                status = _epikv_status(error)
                return status, ErrorResponse(message=first_line(error), type=_status_type(status), param=None,
                                             code=type(error).__name__)
            if isinstance(error, RequestValidationError):
                message, param = _validation_message(error.errors())
                return 400, ErrorResponse(message=message, type="invalid_request_error", param=param,
                                          code="invalid_value")
            return super().error_message_wrapper(error, body)

        def get_route_handler(self):
            handler = super().get_route_handler()

            async def route(request: Request):
                if request.method == "POST":  # its recovery path re-reads the body as a JSON object
                    try:
                        data = json.loads(await request.body() or b"null")
                    except ValueError:
                        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
                    if not isinstance(data, dict):
                        raise APIError(400, f"the request body must be a JSON object, got {_json_type(data)}",
                                       code="invalid_json")
                    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
                        # a JSON body whatever its declared type (curl -d sends form-urlencoded), as llama-server
                        request.scope["headers"] = [(k, v) for k, v in request.scope["headers"]
                                                    if k.lower() != b"content-type"]
                        request.scope["headers"].append((b"content-type", b"application/json"))
                        request.__dict__.pop("_headers", None)  # Request caches its parsed headers
                return await handler(request)
            return route

    bearer = HTTPBearer(auto_error=False)

    async def authenticate(credentials=Depends(bearer)):
        if api_key is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           "authentication_error", code="invalid_api_key")

    router = APIRouter(route_class=OpenAIRoute)
    open_router = APIRouter()

    def llama_kwargs(body, excluded: set[str]) -> dict:
        """The request's fields as Llama arguments (unset ones take the Llama's defaults), checked."""
        if body.model is not None and body.model != alias:
            raise APIError(404, f"the model `{body.model}` does not exist; this server serves `{alias}`",
                           "invalid_request_error", "model", "model_not_found")
        if body.n not in (None, 1):
            raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", param="n")
        if getattr(body, "best_of", None) not in (None, 1):
            raise APIError(400, f"best_of must be 1, got {body.best_of}", param="best_of")
        if body.min_tokens:
            raise APIError(400, "min_tokens is not supported by epikv-local", param="min_tokens")
        kw = {k: v for k, v in body.model_dump(exclude_unset=True, exclude=NOT_LLAMA_ARGS | excluded).items()
              if v is not None}
        if body.logit_bias is not None and body.logit_bias_type != "tokens":
            bad = [k for k in body.logit_bias if not k.lstrip("-").isdigit()]
            if bad:
                raise APIError(400, f"logit_bias keys must be token ids, got {bad[:3]} (or set "
                                    "logit_bias_type='tokens')", param="logit_bias")
        kw["model"] = alias
        return kw

    async def start(request: Request, method, kwargs: dict, bias_tokens: dict | None) -> _Job:
        """Admit (or 503), wait for the model, and open the Llama's stream: bad input and a prompt that does not
        fit the budget raise here, before any response is sent."""
        service.admit(APIError)
        await service.acquire()
        try:
            service.check_stopping(APIError)
            if await request.is_disconnected():
                raise APIError(400, "the client closed the request before it started", code="client_closed")
            job = _Job(service)
        except BaseException:
            service.release()
            raise

        def open_stream():
            if bias_tokens is not None:
                kwargs["logit_bias"] = _logit_bias_tokens_to_input_ids(llama, bias_tokens)
            return iter(method(**kwargs, stream=True))

        job.start(open_stream)
        try:
            if await job.get() is not _OPENED:
                raise RuntimeError("the generation thread did not open its stream")
        except _Stopped:
            await job.finish()
            service.check_stopping(APIError)
            raise
        except BaseException:
            await job.finish()
            raise
        return job

    async def respond(request: Request, job: _Job, stream: bool, assemble):
        if stream:
            return JobEventSource(events(request, job), job=job, sep="\n")
        try:
            chunks = []
            while (chunk := await job.get()) is not _END:
                chunks.append(chunk)
                service.check_stopping(APIError)
                if await request.is_disconnected():
                    raise APIError(400, "the client closed the request", code="client_closed")
        finally:
            stats = await job.finish()
        return JSONResponse(assemble(chunks, stats))

    async def events(request: Request, job: _Job):
        try:
            while True:
                try:
                    chunk = await job.get()
                except EpikvError as e:  # the response has started: the error goes into the stream
                    status = _epikv_status(e)
                    yield {"data": json.dumps(_error_body(first_line(e), _status_type(status),
                                                          code=type(e).__name__))}
                    return
                if chunk is _END:
                    break
                yield {"data": json.dumps(chunk)}
                if service.stopping:
                    yield {"data": json.dumps(_error_body("the server is shutting down", "unavailable_error",
                                                          code="shutting_down"))}
                    return
                if await request.is_disconnected():
                    return
            yield {"data": "[DONE]"}
        finally:
            await job.finish()

    class JobEventSource(EventSourceResponse):
        """An SSE response that frees the model when it ends, however it ends (also if never iterated)."""

        def __init__(self, content, *, job: _Job, **kwargs):
            super().__init__(content, **kwargs)
            self.job = job

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.job.finish()

    @router.post("/v1/chat/completions", dependencies=[Depends(authenticate)])
    async def chat_completions(request: Request, body: ChatRequest):
        kw = llama_kwargs(body, {"messages", "logit_bias"} if body.logit_bias_type == "tokens" else {"messages"})
        kw["messages"] = [flatten_text_parts(m) for m in body.messages]
        bias = body.logit_bias if body.logit_bias_type == "tokens" else None
        job = await start(request, llama.create_chat_completion, kw, bias)
        return await respond(request, job, body.stream, assemble_chat)

    @router.post("/v1/completions", dependencies=[Depends(authenticate)])
    async def completions(request: Request, body: CreateCompletionRequest):
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) > 1:
                raise APIError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
            prompt = prompt[0] if prompt else ""
        kw = llama_kwargs(body, {"prompt", "logit_bias"} if body.logit_bias_type == "tokens" else {"prompt"})
        kw["prompt"] = prompt
        bias = body.logit_bias if body.logit_bias_type == "tokens" else None
        job = await start(request, llama.create_completion, kw, bias)
        return await respond(request, job, body.stream, assemble_completion)

    @router.get("/v1/models", dependencies=[Depends(authenticate)])
    async def models():
        return {"object": "list", "data": [{
            "id": alias, "object": "model", "created": service.created, "owned_by": "epikv-local",
            "permissions": [], R.EXTENSION: {"kv_budget": llama.n_ctx(), "model_path": llama.model_path}}]}

    @open_router.get("/health")
    async def health():
        return {"status": "ok", "model": alias, "busy": service.busy, "queued": service.queued,
                "max_queue": max_queue, "served": service.n_served, "cancelled": service.n_cancelled,
                "tokens_generated": service.tokens_generated}

    app = FastAPI(title="epikv-local", description="OpenAI-compatible server with a KV budget")
    app.include_router(router)
    app.include_router(open_router)
    app.state.epikv = service

    @app.exception_handler(StarletteHTTPException)  # ours, FastAPI's and the router's (404, 405)
    async def http_error(request, exc: StarletteHTTPException):
        if isinstance(exc, APIError):
            return error_response(exc.status_code, exc.detail, exc.type, exc.param, exc.code)
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        return error_response(400, message, param=param, code="invalid_value")

    return app
