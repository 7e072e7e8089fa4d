"""``epikv-local serve``'s command line: its arguments (:func:`add_args`) and :func:`run`, which listens, loads
the Llama, builds the app (:func:`~epikv_local.api.server.routes.create_app`) and serves it with uvicorn.

uvicorn, the Llama (llama_cpp) and the app are loaded by :func:`run` only: the CLI imports this module to build
its parser.
"""

import sys

from ...errors import ConfigError
from .routes import create_app
from .service import DEFAULT_MAX_QUEUE

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
#: seconds a shutdown waits for requests in flight before cancelling them (a generation stops at its next token)
SHUTDOWN_GRACE_S = 5


def add_args(p) -> None:
    """Add ``serve``'s arguments to its argparse subparser (generate's names where they mean the same)."""
    from ..options import add_budget_args, add_model_args
    from ..reasoning import FORMATS

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
    service = app.state.epikv

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGINT / SIGTERM: generations stop at their next token
            service.stopping = True
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if not self.should_exit:
                print(banner, file=sys.stderr, flush=True)

    config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                            lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    Server(config).run(sockets=[sock])


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

        llama = Llama(**{**llama_kwargs(args), "model_path": model_path}, chat_format=args.chat_format,
                      reasoning_format=args.reasoning_format)
        app = None
        try:
            if llama.calibration is not None:
                print(f"epikv-local: using calibration {llama.calibration.path}", file=sys.stderr)
            app = create_app(llama, model_alias=alias, api_key=args.api_key, max_queue=args.max_queue)
            _serve(uvicorn, app, sock, f"epikv-local: serving {alias} on {_url(sock)}", args.verbose)
        finally:
            if app is not None:
                app.state.epikv.close()  # after a generation thread still inside the Llama stops
            else:
                llama.close()
    finally:
        sock.close()
        signal.signal(signal.SIGTERM, previous)
    return 0
