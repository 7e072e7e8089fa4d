"""The FastAPI app: :func:`create_app` and its endpoints.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON, or server-sent events with ``"stream":
true``) and ``GET /v1/models`` are behind the API key when there is one; ``GET /health`` is always open.

fastapi and the modules that import it at the top (:mod:`.errors`, :mod:`.params`, :mod:`.streaming`) are
imported by :func:`create_app` only. (No ``from __future__ import annotations`` here: FastAPI reads the
endpoints' annotations, whose classes are local to :func:`create_app`.)
"""

from pathlib import Path

from ...errors import ConfigError
from .. import responses
from .assembly import assemble_chat, assemble_completion
from .service import DEFAULT_MAX_QUEUE, Service


def create_app(llama, *, model_alias: str | None = None, api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE):
    """A FastAPI app serving ``llama`` (an :class:`epikv_local.Llama`) under the id ``model_alias`` (default: the
    model file's name). ``api_key``: the bearer token required on ``/v1/*`` (None: open). ``max_queue``:
    requests that may wait while one runs. The app does not close the Llama; its ``state.epikv.close()`` does
    so safely (after a worker thread still inside it returns)."""
    import secrets

    try:
        from fastapi import APIRouter, Depends, FastAPI, Request
        from fastapi.security import HTTPBearer

        from .errors import HANDLERS, APIError, OpenAIRoute
        from .params import ChatRequest, CompletionRequest, chat_kwargs, completion_kwargs, token_bias
        from .streaming import respond, start
    except ImportError as e:
        raise ConfigError(f"the server needs llama-cpp-python's server extra ({e.name} is missing): "
                          'pip install "llama-cpp-python[server]==0.3.36"') from None

    if max_queue < 0:
        raise ConfigError(f"max_queue must be >= 0, got {max_queue}")

    alias = model_alias or Path(llama.model_path).name
    service = Service(llama, alias, max_queue, api_key)
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

    @router.post("/v1/chat/completions", dependencies=[Depends(authenticate)])
    async def chat_completions(request: Request, body: ChatRequest):
        job = await start(service, request, llama.chat_completion_steps, chat_kwargs(body, alias), token_bias(body))
        return await respond(service, request, job, body.stream, assemble_chat)

    @router.post("/v1/completions", dependencies=[Depends(authenticate)])
    async def completions(request: Request, body: CompletionRequest):
        job = await start(service, request, llama.completion_steps, completion_kwargs(body, alias), token_bias(body))
        return await respond(service, request, job, body.stream, assemble_completion)

    @router.get("/v1/models", dependencies=[Depends(authenticate)])
    async def models():
        return {"object": "list", "data": [{
            "id": alias, "object": "model", "created": service.created, "owned_by": "epikv-local",
            "permissions": [], responses.EXTENSION: {"kv_budget": llama.n_ctx(), "model_path": llama.model_path}}]}

    @open_router.get("/health")
    async def health():
        return {"status": "ok", "model": alias, "busy": service.busy, "queued": service.queued,
                "max_queue": max_queue, "served": service.n_served, "cancelled": service.n_cancelled,
                "tokens_generated": service.tokens_generated}

    app = FastAPI(title="epikv-local", description="OpenAI-compatible server with a KV budget")
    app.include_router(router)
    app.include_router(open_router)
    app.state.epikv = service
    for exc_class, handler in HANDLERS.items():  # ours, FastAPI's and the router's errors (404, 405), OpenAI-shaped
        app.add_exception_handler(exc_class, handler)
    return app
