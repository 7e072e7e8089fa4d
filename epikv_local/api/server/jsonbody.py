"""A request body parsed under limits: UTF-8, bounded nesting, standard JSON only, valid Unicode strings.

:func:`parse_object` is what the gate (:mod:`.gate`) runs on every POST body before the app sees it, so that
no body can make the server recurse (``[[[[…`` 100,000 deep), hand the model a string it cannot encode (a lone
surrogate from ``"\\ud800"``), or a number that is not one (``NaN``, ``1e999``). Its errors are
:class:`BodyError`: a message, the offending field's path (``messages[0].content``) when there is one, and a
code. Imports nothing but the standard library.
"""

import json
import math
import re
from itertools import accumulate

#: a JSON string literal (the unrolled form: linear, no backtracking)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_SURROGATE = re.compile("[\ud800-\udfff]")
#: the escape a lone surrogate must come from (UTF-8 decoding refuses encoded ones)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class BodyError(ValueError):
    """A body refused before validation: ``message``, ``param`` (the field's path, or None), ``code``."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_json"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (brackets inside strings do not count),
    without recursion; an unbalanced text is measured as far as it goes."""
    if text.count("[") + text.count("{") <= 1:
        return text.count("[") + text.count("{")
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def _no_constant(name: str):
    raise BodyError(f"the request body is not valid JSON: {name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(f"the request body is not valid JSON: the number {text[:40]} is out of range")
    return value


def _path(parent: str, key) -> str:
    return f"{parent}[{key}]" if isinstance(key, int) else f"{parent}.{key}" if parent else str(key)


def lone_surrogate_path(value) -> str | None:
    """The path of the first string (key or value) in ``value`` that holds a lone UTF-16 surrogate, or None.
    Iterative: the depth was bounded before, but a walk needs no stack either way."""
    todo = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                return path or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                if not k.isascii() and _SURROGATE.search(k):
                    return _path(path, k.encode("utf-8", "backslashreplace").decode())
                todo.append((_path(path, k), item))
        elif isinstance(v, list):
            todo.extend((_path(path, i), item) for i, item in enumerate(v))
    return None


def parse_object(raw: bytes, max_depth: int) -> dict:
    """``raw`` as a JSON object, or BodyError: not UTF-8, nested deeper than ``max_depth``, not JSON (NaN and
    infinities included), not an object, or holding a lone surrogate."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"the request body is not UTF-8 (byte {e.start})") from None
    depth = nesting_depth(text)
    if depth > max_depth:
        raise BodyError(f"the request body nests {depth} levels deep, over the limit of {max_depth}",
                        code="too_deep")
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite) if text.strip() else None
    except BodyError:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer of more than 4,300 digits
        raise BodyError(f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(data), "a number")
        raise BodyError(f"the request body must be a JSON object, got {kind}")
    path = lone_surrogate_path(data) if _SURROGATE_ESCAPE.search(text) else None
    if path is not None:
        raise BodyError(f"{path}: the text holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid "
                        "Unicode", param=path, code="invalid_unicode")
    return data
