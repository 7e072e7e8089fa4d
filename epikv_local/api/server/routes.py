"""The FastAPI app: :func:`create_app` and its endpoints.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON, or server-sent events with ``"stream":
true``), ``GET /v1/models``, llama-server's ``POST /tokenize``, ``POST /detokenize`` and ``GET /props``
(:mod:`.extras`), and FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json`` are behind the API key when there is
one; ``GET /health`` is always open. The key, the ``Host`` and ``Origin`` checks and the body's limits are the
gate's (:mod:`.gate`), before any route is reached.

fastapi and the modules that import it at the top (:mod:`.errors`, :mod:`.params`, :mod:`.streaming`,
:mod:`.extras`) are imported by :func:`create_app` only. (No ``from __future__ import annotations`` here:
FastAPI reads the endpoints' annotations, whose classes are local to :func:`create_app`.)
"""

import functools
from pathlib import Path

from ...errors import ConfigError
from .. import responses
from .assembly import assemble_chat, assemble_completion, usage_chunk
from .gate import Cors, Gate
from .limits import Limits
from .service import DEFAULT_MAX_QUEUE, Service


def api_keys(api_key) -> tuple[str, ...]:
    """The accepted keys of ``api_key``: None (no key), one key, or several (a list, or one string of
    comma-separated keys)."""
    if api_key is None:
        return ()
    keys = [k.strip() for part in ([api_key] if isinstance(api_key, str) else api_key) for k in part.split(",")]
    if not keys or any(not k or not k.isascii() or not k.isprintable() or " " in k for k in keys):
        raise ConfigError("--api-key must be one or more printable ASCII keys without spaces, comma-separated "
                          "(a key travels in an HTTP header)")
    return tuple(dict.fromkeys(keys))


def slot_file_name_ok(name: str) -> bool:
    """A slot file's name: a plain name inside --slot-save-path (no folder, no traversal, no hidden file)."""
    return 0 < len(name) <= 128 and not name.startswith(".") and all(c.isascii() and (c.isalnum() or c in "._-")
                                                                    for c in name)


def create_app(llama, *, model_alias: str | None = None, api_key=None, max_queue: int = DEFAULT_MAX_QUEUE,
               limits: Limits | None = None, cors_origins=None, check_host: bool = False,
               share_prompt_cache: bool = False, metrics: bool = False, slot_save_path=None):
    """A FastAPI app serving ``llama`` (an :class:`epikv_local.Llama`) under the id ``model_alias`` (default: the
    model file's name). ``api_key``: the bearer token(s) required on every path but ``/health`` (None: open;
    several: a list or a comma-separated string, each key one client identity). ``max_queue``: requests that
    may wait while one runs. ``limits``: one request's :class:`~.limits.Limits`. ``cors_origins``: the allowed
    browser origins (None: loopback ones; ``["*"]``: any). ``check_host``: accept loopback ``Host`` names only
    (for a server bound to a loopback address). ``share_prompt_cache``: let a request reuse the cached prompt
    prefix of another identity. ``metrics``: serve ``GET /metrics`` (Prometheus text). ``slot_save_path``: the
    folder ``POST /slots/{id}?action=save|restore`` writes and reads (None: those actions are refused). The app
    does not close the Llama; its ``state.epikv.close()`` does so safely
    (after a worker thread still inside it returns)."""
    try:
        from fastapi import APIRouter, Depends, FastAPI, Request
        from fastapi.security import HTTPBearer

        from .errors import HANDLERS, APIError, OpenAIRoute
        from .extras import add_routes
        from .params import (ChatRequest, CompletionRequest, chat_kwargs, choices, completion_kwargs, include_usage,
                             token_bias)
        from .streaming import respond, start
    except ImportError as e:
        raise ConfigError(f"the server needs llama-cpp-python's server extra ({e.name} is missing): "
                          'pip install "llama-cpp-python[server]==0.3.36"') from None

    if max_queue < 0:
        raise ConfigError(f"max_queue must be >= 0, got {max_queue}")
    limits = limits or Limits()
    keys = api_keys(api_key)
    alias = model_alias or Path(llama.model_path).name
    service = Service(llama, alias, max_queue, APIError, share_prompt_cache)
    # the gate checks the key; this dependency only documents it in the OpenAPI schema
    bearer = HTTPBearer(auto_error=False, description="the server's --api-key") if keys else (lambda: None)

    async def authenticate(credentials=Depends(bearer)):
        return None

    router = APIRouter(route_class=OpenAIRoute)
    open_router = APIRouter()

    async def complete(request, body, method, kwargs, assemble):
        n = choices(body)
        if n > 1:  # n streams merged (each chunk's choice has its index), sharing the prompt's cells
            method = functools.partial(llama.choice_steps, n, method)
        job = await start(service, request, method, kwargs, token_bias(body), limits)
        return await respond(service, request, job, body.stream, assemble, limits,
                             usage_chunk if include_usage(body) else None)

    @router.post("/v1/chat/completions", dependencies=[Depends(authenticate)])
    async def chat_completions(request: Request, body: ChatRequest):
        return await complete(request, body, llama.chat_completion_steps, chat_kwargs(body, alias, limits),
                              assemble_chat)

    @router.post("/v1/completions", dependencies=[Depends(authenticate)])
    async def completions(request: Request, body: CompletionRequest):
        return await complete(request, body, llama.completion_steps, completion_kwargs(body, alias, limits),
                              assemble_completion)

    @router.get("/v1/models", dependencies=[Depends(authenticate)])
    async def models():
        return {"object": "list", "data": [{
            "id": alias, "object": "model", "created": service.created, "owned_by": "epikv-local",
            "permissions": [], responses.EXTENSION: {"kv_budget": llama.n_ctx(),
                                                      "model_file": Path(llama.model_path).name}}]}

    add_routes(router, service, authenticate, limits.max_tokens)

    @router.get("/slots", dependencies=[Depends(authenticate)])
    async def slots():
        """llama-server's /slots: one entry per sequence (live cells, budget, evictions, positions, state)."""
        return [dict(slot, is_processing=slot["leased"]) for slot in llama.slots()]

    @router.post("/slots/{id_slot}", dependencies=[Depends(authenticate)])
    async def slot_action(id_slot: int, request: Request, action: str = ""):
        """llama-server's slot actions: ``save`` / ``restore`` (body ``{"filename": NAME}``, a plain file name
        inside --slot-save-path) and ``erase``."""
        import anyio

        path = None
        if action in ("save", "restore"):
            if slot_save_path is None:
                raise APIError(400, "slot save and restore need the server to run with --slot-save-path",
                               param="action")
            try:
                body = await request.json()
            except ValueError:
                body = None
            name = body.get("filename") if isinstance(body, dict) else None
            if not isinstance(name, str) or not slot_file_name_ok(name):
                raise APIError(400, "filename must be a plain file name (letters, digits, '.', '-', '_'; not "
                                    "starting with '.'; at most 128 characters)", param="filename")
            path = Path(slot_save_path) / name
        elif action != "erase":
            raise APIError(400, f"action must be save, restore or erase, got {action!r}", param="action")
        with service.borrow():
            result = await anyio.to_thread.run_sync(lambda: llama.slot_action(id_slot, action, path))
        return dict(result, filename=path.name if path is not None else None)

    if metrics:
        from fastapi.responses import Response

        from .metrics import metrics_text

        @router.get("/metrics", dependencies=[Depends(authenticate)])
        async def prometheus():
            body, kind = metrics_text(service)
            return Response(body, media_type=kind)

    @open_router.get("/health")
    async def health():
        return {"status": "ok", "model": alias, "busy": service.busy, "queued": service.queued,
                "max_queue": max_queue, "served": service.n_served, "cancelled": service.n_cancelled,
                "tokens_generated": service.tokens_generated, "n_parallel": service.n_parallel}

    app = FastAPI(title="epikv-local", description="OpenAI-compatible server with a KV budget")
    app.include_router(router)
    app.include_router(open_router)
    app.state.epikv = service
    for exc_class, handler in HANDLERS.items():  # ours, FastAPI's and the router's errors (404, 405), OpenAI-shaped
        app.add_exception_handler(exc_class, handler)
    app.add_middleware(Gate, keys=keys, cors=Cors(cors_origins), check_host=check_host,
                       max_body_bytes=limits.max_body_bytes, max_depth=limits.max_json_depth)
    return app
