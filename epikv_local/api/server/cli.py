"""``epikv-local serve``'s command line: its arguments (:func:`add_args`) and :func:`run`, which listens, loads
the Llama, builds the app (:func:`~epikv_local.api.server.routes.create_app`) and serves it with uvicorn.

uvicorn, the Llama (llama_cpp) and the app are loaded by :func:`run` only: the CLI imports this module to build
its parser.
"""

import ipaddress
import os
import sys
import time

from ...errors import ConfigError
from . import limits as L
from .routes import api_keys, create_app
from .service import DEFAULT_MAX_QUEUE

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
#: seconds a shutdown waits for requests in flight before cancelling them (a generation stops at its next token)
SHUTDOWN_GRACE_S = 5
#: seconds of the grace period kept for closing the Llama after uvicorn has finished its requests
CLOSE_GRACE_S = 1
#: seconds before the end of the grace period at which the watchdog ends a server still running
EXIT_MARGIN_S = 0.5
#: the kernel send buffer of each connection (bytes; Linux doubles it). Fixed rather than autotuned (up to MBs),
#: so that a client that reads nothing fills it, and is dropped after --stall-seconds, within a few hundred
#: tokens; it is still far more than a stream needs in flight
SEND_BUFFER_BYTES = 64 * 1024


#: the limit flags: (flag, type, default, help); their errors name them (docs/security.md has the table)
LIMIT_ARGS = (
    ("--max-queue", int, DEFAULT_MAX_QUEUE, "requests that may wait while one runs; more are answered 503"),
    ("--max-body-bytes", int, L.DEFAULT_MAX_BODY_BYTES, "bytes of one request body; more is 413"),
    ("--max-messages", int, L.DEFAULT_MAX_MESSAGES, "chat messages in one request; more is 400"),
    ("--max-prompt-tokens", int, None, "prompt tokens of one request; more is 400 (default: 4 x --kv-budget)"),
    ("--max-tokens", int, L.DEFAULT_MAX_TOKENS,
     "tokens one request may generate: the default max_tokens, and asking for more is 400"),
    ("--max-request-seconds", float, L.DEFAULT_MAX_REQUEST_SECONDS,
     "seconds one request may hold the model (prefill + generation); then it is stopped, 503"),
    ("--stall-seconds", float, L.DEFAULT_STALL_SECONDS,
     "seconds a stream may wait for a client that reads nothing; then it is dropped"))


def add_args(p) -> None:
    """Add ``serve``'s arguments to its argparse subparser (generate's names where they mean the same)."""
    from ..options import add_budget_args, add_model_args
    from ..reasoning import FORMATS

    add_model_args(p)
    p.add_argument("--model-alias", default=None,
                   help="model id in /v1/models and responses; unset: the model file's name")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (0: any free port)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY[,KEY...]",
                   help="require 'Authorization: Bearer KEY' on every path but /health (repeatable or "
                        "comma-separated: each key is one client identity); unset: no key")
    p.add_argument("--cors-origins", default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="browser origins allowed to call the server ('*': any); unset: loopback origins only")
    p.add_argument("--parallel", "-np", type=int, default=1, metavar="N",
                   help="sequences decoded together, each request in its own, each within --kv-budget "
                        "(llama-server's -np; the KV cache holds N budgets)")
    p.add_argument("--metrics", action="store_true", help="serve GET /metrics (Prometheus text)")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="folder for POST /slots/{id}?action=save|restore (llama-server's); off when unset")
    p.add_argument("--share-prompt-cache", action="store_true",
                   help="let a request reuse the cached prompt prefix of another key's (off: reset between keys)")
    for flag, kind, default, text in LIMIT_ARGS:
        p.add_argument(flag, type=kind, default=default, help=text)
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
    if not 1 <= args.parallel <= 256:
        raise ConfigError(f"--parallel must be in 1..256, got {args.parallel}")
    if args.slot_save_path is not None and not os.path.isdir(args.slot_save_path):
        raise ConfigError(f"--slot-save-path {args.slot_save_path} is not a folder")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ConfigError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    api_keys(args.api_key)
    cors_origins(args.cors_origins)
    server_limits(args)
    if args.model_alias is not None and not args.model_alias.strip():
        raise ConfigError("--model-alias must not be empty")


def server_limits(args) -> L.Limits:
    return L.Limits(max_body_bytes=args.max_body_bytes, max_messages=args.max_messages, max_tokens=args.max_tokens,
                    max_request_seconds=args.max_request_seconds, stall_seconds=args.stall_seconds)


def cors_origins(text: str | None) -> list[str] | None:
    """``--cors-origins``: a list of ``scheme://host[:port]`` origins or ``*``; None: the loopback default."""
    if text is None:
        return None
    origins = [o.strip().rstrip("/") for o in text.split(",") if o.strip()]
    bad = [o for o in origins if o != "*" and not (o.startswith(("http://", "https://")) and "/" not in o[8:])]
    if not origins or bad:
        raise ConfigError(f"--cors-origins takes scheme://host[:port] origins or '*', comma-separated; got {text!r}")
    return origins


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a --host value) is a loopback address or name: then only loopback Host headers are
    accepted (a web page using DNS rebinding sends its own name)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int):
    """A listening, non-blocking TCP socket on host:port (ConfigError naming the address when that fails)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)  # inherited by accepted sockets
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def _url(sock) -> str:
    """``http://host:port`` of a listening socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _serve(uvicorn, app, sock, banner: str, verbose: bool) -> None:
    """Serve ``app`` on ``sock`` until SIGINT / SIGTERM; ``banner`` goes to stderr once uvicorn is up."""
    import asyncio
    import signal
    import threading

    service = app.state.epikv
    loop, stopped_at = [], []  # the event loop; when the first SIGINT / SIGTERM came (monotonic seconds)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGINT / SIGTERM: generations stop, a prefill at its next chunk
            if not stopped_at:  # the first signal: the grace period starts now, and the watchdog with it:
                # whatever still runs when it ends (one native call, a second signal during the close) ends then
                stopped_at.append(time.monotonic())
                watchdog = threading.Timer(SHUTDOWN_GRACE_S - EXIT_MARGIN_S, _exit_now,
                                           (130 if sig == signal.SIGINT else 0,))
                watchdog.daemon = True  # a shutdown that finishes in time is not held up by it
                watchdog.start()
            service.stopping = True
            if loop:  # a signal handler: the job is stopped from the event loop, not from here; a request still
                # waiting for its thread when uvicorn's part of the grace ends is answered without it
                abandon_at = stopped_at[0] + SHUTDOWN_GRACE_S - CLOSE_GRACE_S - EXIT_MARGIN_S
                loop[0].call_soon_threadsafe(service.shutdown, abandon_at)
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            loop.append(asyncio.get_running_loop())
            await super().startup(sockets=sockets)
            if not self.should_exit:
                print(banner, file=sys.stderr, flush=True)

    # uvicorn's part of the grace period; the rest is for the Llama to close (run's finally), until the watchdog
    config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                            lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S - CLOSE_GRACE_S)
    Server(config).run(sockets=[sock])


def _exit_now(status: int) -> None:
    """End the process at once (the shutdown watchdog, when the grace period ends with the server still
    running): one native call (tokenizing megabytes) can outlast every cancel. Nothing is left half-written (the server writes no files); the
    operating system frees the model's memory."""
    print(f"epikv-local: a request was still inside the model after the {SHUTDOWN_GRACE_S} s grace period; "
          "exiting without waiting for it", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def run(args) -> int:
    """Serve until SIGINT (exit 130 through ``run_main``) or SIGTERM (exit 0)."""
    import signal

    from ...engine.handles import check_gguf

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
        from ..llama import Llama
        from ..options import llama_kwargs

        max_prompt = args.max_prompt_tokens or L.default_max_prompt_tokens(args.kv_budget)
        llama = Llama(**{**llama_kwargs(args), "model_path": model_path}, chat_format=args.chat_format,
                      reasoning_format=args.reasoning_format, max_prompt_tokens=max_prompt, n_parallel=args.parallel)
        app = None
        try:
            if llama.calibration is not None:
                print(f"epikv-local: using calibration {llama.calibration.path}", file=sys.stderr)
            app = create_app(llama, model_alias=alias, api_key=args.api_key, max_queue=args.max_queue,
                             limits=server_limits(args), cors_origins=cors_origins(args.cors_origins),
                             check_host=is_loopback(args.host), share_prompt_cache=args.share_prompt_cache,
                             metrics=args.metrics, slot_save_path=args.slot_save_path)
            _serve(uvicorn, app, sock, f"epikv-local: serving {alias} on {_url(sock)}", args.verbose)
        finally:
            if app is None:
                llama.close()
            else:
                app.state.epikv.close()  # after a generation thread still inside the Llama stops
    finally:
        sock.close()
        signal.signal(signal.SIGTERM, previous)
    return 0
