"""OpenAI-shaped errors, ``{"error": {"message", "type", "param", "code"}}``, and the statuses they get.

A bad request (fields of the wrong type, any ``EpikvError`` of the Llama such as a ``BudgetError``) is a 4xx (400
naming the field for a validation error) and leaves the server healthy; a ``NativeError`` is a 500; a full queue,
a shutdown or a request past ``--max-request-seconds`` is 503. The gate (:mod:`.gate`) answers its own refusals
(401 key, 403 host or origin, 413 body size, 400 body not a JSON object within limits) in the same shape.

:class:`OpenAIRoute` is llama-cpp-python's ``RouteErrorHandler`` with that mapping. This module imports fastapi
and llama-cpp-python's server (so llama_cpp) at the top: :func:`~epikv_local.api.server.routes.create_app` imports it, nothing at import time.
"""

import re

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from llama_cpp.server.errors import ErrorResponse, RouteErrorHandler
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import ConfigError, EpikvError, NativeError, first_line


#: a union member's tag in a pydantic error location (``str``, ``list[str]``, ``function-after[...]``, a class)
UNION_MEMBER = re.compile(r"[A-Z].*|str|int|float|bool|none|[\w-]+\[.*\]")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def status_type(status: int) -> str:
    """OpenAI's error ``type`` of an HTTP status."""
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
            422: "invalid_request_error", 503: "unavailable_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")


def epikv_status(error: EpikvError) -> int:
    """Bad input (ConfigError, BudgetError, ModelError, ...: ValueErrors) is the client's 400; a native failure
    (NativeError) is the server's 500."""
    return 500 if isinstance(error, NativeError) else 400


def validation_message(errors) -> tuple[str, str | None]:
    """(message, param) of pydantic / FastAPI validation errors: the first one, naming its field. The members
    of a union (a message's role) are left out of the field path, and their literal choices are merged."""
    if not errors:
        return "invalid request", None

    def path(e) -> str:
        return ".".join(str(x) for x in e.get("loc", ())
                        if x != "body" and not (isinstance(x, str) and UNION_MEMBER.fullmatch(x)))

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


class APIError(HTTPException):
    """An OpenAI-shaped error; an HTTPException, so RouteErrorHandler passes it on to our handler."""

    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(status_code=status, detail=message)
        self.type, self.param, self.code = type_ or status_type(status), param, code


def error_response(status: int, message: str, type_: str | None = None, param=None, code=None,
                   headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_ or status_type(status), param, code), status_code=status,
                        headers=headers)


def epikv_error(error: EpikvError) -> tuple[int, str, str, str | None]:
    """(status, message, code, param) of a Llama error: its first line and class name, except a prompt over the
    server's ``--max-prompt-tokens`` (the Llama's ``max_prompt_tokens``), which is OpenAI's
    ``context_length_exceeded`` naming the flag."""
    message = first_line(error)
    if isinstance(error, ConfigError) and "(max_prompt_tokens)" in message:
        return 400, message.replace("the limit", "the server's limit").replace(
            "(max_prompt_tokens)", "(--max-prompt-tokens)"), "context_length_exceeded", None
    return epikv_status(error), message, type(error).__name__, None


class OpenAIRoute(RouteErrorHandler):
    """llama-cpp-python's error route with our mapping: EpikvError -> 400 (NativeError 500), validation
    error -> 400 naming the field; other exceptions stay its 500 with a traceback on stderr. The body reaches
    it checked by the gate (:mod:`.gate`: a JSON object within the limits), so its recovery path, which
    re-reads the body, can parse it."""

    def error_message_wrapper(self, error, body=None):
        if isinstance(error, EpikvError):
            status, message, code, param = epikv_error(error)
            return status, ErrorResponse(message=message, type=status_type(status), param=param, code=code)
        if isinstance(error, RequestValidationError):
            message, param = validation_message(error.errors())
            return 400, ErrorResponse(message=message, type="invalid_request_error", param=param,
                                      code="invalid_value")
        return super().error_message_wrapper(error, body)


async def http_error(request, exc: StarletteHTTPException):
    """Ours, FastAPI's and the router's (404, 405) HTTP errors, in OpenAI's shape."""
    if isinstance(exc, APIError):
        return error_response(exc.status_code, exc.detail, exc.type, exc.param, exc.code)
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def llama_error(request, exc: EpikvError):
    """A Llama error outside an :class:`OpenAIRoute` (the GET endpoints)."""
    status, message, code, param = epikv_error(exc)
    return error_response(status, message, param=param, code=code)


async def validation_error(request, exc: RequestValidationError):
    """A body that fails validation outside an :class:`OpenAIRoute`: 400 naming the field."""
    message, param = validation_message(exc.errors())
    return error_response(400, message, param=param, code="invalid_value")


#: the app's exception handlers, {exception class: handler(request, exc) -> response}
HANDLERS = {StarletteHTTPException: http_error, RequestValidationError: validation_error, EpikvError: llama_error}
