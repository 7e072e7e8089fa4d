"""The gate in front of the app (a plain ASGI middleware): what every HTTP request passes before routing.

In this order, each refusal an OpenAI-shaped error sent by the gate itself:

1. ``Host`` (when the server is bound to a loopback address): only loopback names (``127.x.x.x``,
   ``localhost``, ``[::1]``, any port) are accepted, else 403 ``host_not_allowed``: a web page that rebinds its
   own DNS name to 127.0.0.1 sends its own name and is refused.
2. ``Origin`` (CORS): a request that carries an origin not allowed is refused, 403 ``origin_not_allowed``
   (also a "simple" POST a browser would send without asking first, so a page cannot drive the model blind);
   a preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin is answered 204.
   Allowed: the ``--cors-origins`` list, ``*`` only when given explicitly; by default the loopback origins
   (``http(s)://127.0.0.1``, ``localhost``, ``[::1]``, any port). Responses to allowed origins carry
   ``Access-Control-Allow-Origin``. A request without ``Origin`` (not from a browser) is not affected.
3. The API key (when there are keys): every path but ``/health`` and preflights needs ``Authorization: Bearer
   KEY``, checked before the body is read, so an unauthenticated client gets 401 whatever it sends. The index
   of the key that matched is the request's identity (``scope["epikv.identity"]``; None without keys).
4. The body of a POST: over ``max_body_bytes`` is 413 (from ``Content-Length`` before reading, else while
   reading); then it must be a JSON object within the limits of :func:`~.jsonbody.parse_object` (400). A valid
   body is handed on as ``application/json`` whatever its declared type (``curl -d`` sends form-urlencoded).

Imports nothing but the standard library (anyio, for a large body's parse off the event loop, when one comes).
"""

import json
import re
import secrets

from .jsonbody import BodyError, parse_object

IDENTITY = "epikv.identity"
#: paths open without a key (liveness probes)
PUBLIC_PATHS = frozenset({"/health"})
LOOPBACK_ORIGIN = re.compile(r"https?://(127\.\d{1,3}\.\d{1,3}\.\d{1,3}|localhost|\[::1\])(:\d{1,5})?")
LOOPBACK_HOST = re.compile(r"(127\.\d{1,3}\.\d{1,3}\.\d{1,3}|localhost|\[::1\])(:\d{1,5})?")
#: a preflight's answer is cached this long by the browser (seconds)
PREFLIGHT_MAX_AGE_S = 600
#: bodies larger than this are parsed in a worker thread (bytes), so the event loop keeps answering
THREADED_PARSE_BYTES = 256 * 1024
#: a refused body (too large, or not authenticated) is read and dropped up to this many bytes before the answer,
#: so that the client, still sending, reads it instead of a reset connection; beyond it the connection is closed
DRAIN_BYTES = 64 * 1024 * 1024
#: and for at most this many seconds
DRAIN_SECONDS = 5.0
_HEADER_NAMES = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")


def error_json(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


class Refusal(Exception):
    """A request the gate answers itself: status, OpenAI-shaped body, extra headers."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None, headers=()):
        type_ = {401: "authentication_error", 403: "permission_error"}.get(status, "invalid_request_error")
        super().__init__(message)
        self.status, self.body, self.headers = status, error_json(message, type_, code, param), list(headers)
        self.body_read = False  # True once the body was read (or drained) to its end


class Cors:
    """Allowed origins: ``origins`` (exact ``scheme://host[:port]`` strings, ``"*"``: any), or None: loopback."""

    def __init__(self, origins=None):
        self.any = origins is not None and "*" in origins
        self.origins = frozenset(o.rstrip("/") for o in origins or ())
        self.loopback = origins is None

    def allows(self, origin: str) -> bool:
        if self.any or origin in self.origins:
            return True
        return self.loopback and LOOPBACK_ORIGIN.fullmatch(origin) is not None

    def headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        """Headers of a response to an allowed ``origin``."""
        return [(b"access-control-allow-origin", b"*" if self.any else origin.encode("latin-1")),
                (b"vary", b"Origin")]


def bearer_identity(authorization: str, keys: tuple[str, ...]) -> int | None:
    """The index of the key ``authorization`` ("Bearer KEY") carries, or None; every key is compared, in constant
    time each."""
    scheme, _, token = authorization.strip().partition(" ")
    given = token.strip().encode("latin-1", "replace") if scheme.lower() == "bearer" else b""
    match = None
    for i, key in enumerate(keys):
        if secrets.compare_digest(given, key.encode()) and match is None:
            match = i
    return match


class Gate:
    """The ASGI middleware of the module docstring. ``keys``: accepted bearer tokens (empty: no key);
    ``cors``: a :class:`Cors`; ``check_host``: refuse non-loopback ``Host`` headers; ``max_body_bytes``,
    ``max_depth``: the body's limits (bytes, nesting levels)."""

    def __init__(self, app, *, keys=(), cors: Cors | None = None, check_host: bool = False,
                 max_body_bytes: int, max_depth: int):
        self.app, self.keys, self.cors = app, tuple(keys), cors or Cors()
        self.check_host, self.max_body_bytes, self.max_depth = check_host, max_body_bytes, max_depth

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        origin = headers.get("origin")
        extra = self.cors.headers(origin) if origin is not None and self.cors.allows(origin) else []

        async def send_with_cors(message):
            if extra and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            if scope["method"] == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
                return await self._preflight(headers, extra, send_with_cors)
            scope = self._admit(scope, headers, origin)
            if scope["method"] == "POST":
                body = await self._read_body(headers, receive)
                scope = await self._check_body(scope, body)
                receive = _replay(body, receive)
        except Refusal as r:
            if scope["method"] == "POST" and not r.body_read:  # let the client finish sending, then read the answer
                await _drain(receive, DRAIN_BYTES if _declared(headers) <= DRAIN_BYTES else 0)
            return await _answer(send_with_cors, r.status, r.body, [(b"content-type", b"application/json"),
                                                                      *r.headers])
        await self.app(scope, receive, send_with_cors)

    def _admit(self, scope, headers: dict, origin: str | None):
        """The Host, Origin and key checks (Refusal); the scope with the request's identity."""
        if self.check_host and "host" in headers and not LOOPBACK_HOST.fullmatch(headers["host"]):
            raise Refusal(403, "this server answers to loopback host names only (127.0.0.1, localhost, [::1]); "
                               "bind it to another address with --host to serve other names", "host_not_allowed")
        if origin is not None and not self.cors.allows(origin):
            raise Refusal(403, f"the origin {origin[:100]} is not allowed (--cors-origins)", "origin_not_allowed")
        identity = None
        if self.keys and scope["path"] not in PUBLIC_PATHS:
            identity = bearer_identity(headers.get("authorization", ""), self.keys)
            if identity is None:
                raise Refusal(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                              "invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])
        return {**scope, IDENTITY: identity}

    async def _preflight(self, headers: dict, extra: list, send) -> None:
        if not extra:
            raise Refusal(403, f"the origin {headers['origin'][:100]} is not allowed (--cors-origins)",
                          "origin_not_allowed")
        asked = headers.get("access-control-request-headers", "").strip()
        allow = asked if _HEADER_NAMES.fullmatch(asked) else "authorization, content-type"
        out = [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
               (b"access-control-allow-headers", allow.encode("latin-1")),
               (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode())]
        if headers.get("access-control-request-private-network") == "true":
            out.append((b"access-control-allow-private-network", b"true"))
        await _answer(send, 204, b"", out)

    async def _read_body(self, headers: dict, receive) -> bytes:
        """The whole body (Refusal 413 beyond ``max_body_bytes``; the caller drains what fits in ``DRAIN_BYTES``)."""
        limit = self.max_body_bytes
        too_large = Refusal(413, f"the request body is over the server's limit of {limit} bytes "
                                 "(--max-body-bytes)", "body_too_large")
        if _declared(headers) > limit:
            raise too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone = Refusal(400, "the client closed the request", "client_closed")
                gone.body_read = True
                raise gone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _check_body(self, scope, body: bytes):
        try:
            if len(body) > THREADED_PARSE_BYTES:
                import anyio

                await anyio.to_thread.run_sync(parse_object, body, self.max_depth)
            else:
                parse_object(body, self.max_depth)
        except BodyError as e:
            refusal = Refusal(400, e.message, e.code, e.param)
            refusal.body_read = True
            raise refusal from None
        rest = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-type", b"content-length")]
        return {**scope, "headers": [*rest, (b"content-type", b"application/json"),
                                     (b"content-length", str(len(body)).encode())]}


def _replay(body: bytes, receive):
    """A ``receive`` that hands on the body read by the gate, then the connection's own messages (the
    disconnect the app and sse-starlette wait for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()
    return replay


def _declared(headers: dict) -> int:
    """The body's ``Content-Length`` (0 when absent; chunked bodies are counted as they come)."""
    value = headers.get("content-length", "")
    return int(value) if value.isdigit() else 0


async def _drain(receive, budget: int, seconds: float = None) -> None:
    """Read and drop the rest of a body, at most ``budget`` bytes and ``seconds`` (``DRAIN_SECONDS``): a
    client that trickles its body does not hold the answer (and the connection) open."""
    import asyncio

    deadline = asyncio.get_running_loop().time() + (DRAIN_SECONDS if seconds is None else seconds)
    while budget > 0:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


async def _answer(send, status: int, body: bytes, headers) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
