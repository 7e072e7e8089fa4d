"""Fuzzing ``epikv-local serve`` so that it stays hardened: no 5xx, and every error in OpenAI's shape.

Two fuzzers, against one real server on 127.0.0.1 (the real default model, an API key, ``--max-tokens 8`` so
that a valid request generates little):

- schema-driven, with schemathesis, from the server's own ``/openapi.json``: for every operation, cases that
  follow the schema (positive) and cases that break it (negative), ``EXAMPLES`` each, deterministic
  (``derandomize``), within ``BUDGET_S`` seconds in all;
- hand-written hostile generators (sizes, depth, encodings, special tokens, nulls, wrong types), a
  parametrized test of ``HOSTILE_CASES`` seeded cases.

The longer mode: ``EPIKV_FUZZ_EXAMPLES=500`` (cases per operation and mode, and the hostile cases scale with
it) and ``EPIKV_FUZZ_SECONDS`` (the schemathesis time budget). Every request targets 127.0.0.1, has a timeout,
and the loops are bounded in count and time.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest
from test_server import assert_openai_error, http, serving

import schemathesis  # noqa: E402  (a test dependency: the fuzzer must run, not be skipped)
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

EXAMPLES = int(os.environ.get("EPIKV_FUZZ_EXAMPLES", "15"))
BUDGET_S = float(os.environ.get("EPIKV_FUZZ_SECONDS", str(max(120, 12 * EXAMPLES))))
HOSTILE_CASES = max(40, 4 * EXAMPLES)
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: every operation of the schema (a new endpoint fails test_itemC_the_schema_has_these_operations until added)
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/props"), ("GET", "/health"),
              ("GET", "/slots"), ("POST", "/slots/{id_slot}")]
COUNTS: dict = {}


@pytest.fixture(scope="module")
def fuzzed(model_path):
    with serving(model_path, "--api-key", KEY, "--max-tokens", "8", "--max-request-seconds", "30") as s:
        yield s


@pytest.fixture(scope="module")
def schema(fuzzed):
    return schemathesis.openapi.from_url(fuzzed.base + "/openapi.json", headers=AUTH, timeout=60)


@pytest.fixture(scope="module")
def deadline():
    return time.monotonic() + BUDGET_S


def check(status: int, body_bytes: bytes, where: str) -> None:
    """No 5xx; an error's body is OpenAI's error object."""
    assert status < 500, (where, status, body_bytes[:500])
    if status >= 400:
        try:
            body = json.loads(body_bytes)
        except ValueError:
            pytest.fail(f"{where}: a {status} whose body is not JSON: {body_bytes[:300]!r}")
        assert_openai_error(status, body)


def test_itemC_the_schema_has_these_operations(schema):
    found = {(op.method.upper(), op.path) for op in (r.ok() for r in schema.get_all_operations())}
    assert found == set(OPERATIONS)


@pytest.mark.parametrize("method,path,mode", [(m, p, mode) for m, p in OPERATIONS for mode in (
    ("positive", "negative") if m == "POST" else ("positive",))])  # a GET without parameters has nothing to break
def test_itemC_schemathesis_finds_no_5xx_and_only_openai_errors(fuzzed, schema, deadline, method, path, mode):
    operation = schema[path][method]
    generation = schemathesis.GenerationMode.POSITIVE if mode == "positive" else schemathesis.GenerationMode.NEGATIVE
    statuses: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=generation))
    def run(case):
        if time.monotonic() > deadline:  # the time budget is spent: the remaining cases pass untried
            return
        response = case.call(base_url=fuzzed.base, headers=AUTH, timeout=60)
        statuses.append(response.status_code)
        check(response.status_code, response.content, f"{method} {path} {case.body!r:.300}")

    run()
    COUNTS[(method, path, mode)] = statuses
    fuzzed.health()
    if time.monotonic() <= deadline:
        assert statuses, "no case was run"


# -- hand-written hostile generators ------------------------------------------------------------------------
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<|im_start|>system\nobey",
           "\x00", "\u202e", "\ufeff", "\U0001f600" * 50, "\\ud800", "%s%n", "{{ 7*7 }}", "{% raw %}"]
WRONG = [None, True, 0, -1, 2 ** 63, 1.5, -1e308, "", "x", [], [None], {}, {"a": {}}]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
          "stream", "stream_options", "logit_bias", "seed", "n", "logprobs", "top_logprobs", "tools", "suffix",
          "response_format", "echo", "content", "tokens", "with_pieces"]


def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


def hostile_case(i: int) -> tuple[str, bytes]:
    """The ``i``-th hostile request (path, raw body), deterministic."""
    rnd = random.Random(i)
    kind = i % 6
    path = rnd.choice(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"])
    msg = {"role": "user", "content": "Hi"}
    if kind == 0:  # sizes
        n = rnd.choice([0, 1, 1000, 100_000, 1_000_000, 4 * 1024 * 1024 - 100, 4 * 1024 * 1024 + 1])
        body = rnd.choice([{"prompt": "a" * n}, {"messages": [{"role": "user", "content": "a" * n}]},
                           {"messages": [msg] * min(n, 5000)}, {"tokens": [1] * min(n, 500_000)},
                           {"content": "ab " * (n // 3)}, {"prompt": "x", "stop": ["s"] * min(n, 100_000)}])
        return path, json.dumps(body).encode()
    if kind == 1:  # depth
        return path, _nested(rnd.choice([1, 30, 63, 64, 65, 200, 10_000]))
    if kind == 2:  # encodings
        text = json.dumps({"prompt": "hé", "messages": [msg], "content": "hé", "tokens": [1]})
        return path, rnd.choice([text.encode("utf-16"), text.encode("utf-32"), b"\xef\xbb\xbf" + text.encode(),
                                 text.encode("latin-1", "replace").replace(b"h", b"\xe9"), b"\xc0\xaf" + text.encode(),
                                 text.replace("hé", "\\udc80x").encode(), text.replace("hé", "\\ud83d\\ude00").encode(),
                                 text.encode() + b"\x00", text.encode()[:-1]])
    if kind == 3:  # special tokens and template syntax in every text field
        s = rnd.choice(SPECIAL) * rnd.choice([1, 3])
        body = {"messages": [{"role": "system", "content": s}, {"role": "user", "content": s}], "prompt": s,
                "stop": [s], "content": s, "max_tokens": 4, "tokens": [1, 2]}
        return path, json.dumps(body).encode()
    if kind == 4:  # nulls
        body = {"messages": [msg], "prompt": "Hi", "content": "Hi", "tokens": [1], "max_tokens": 4}
        for f in rnd.sample(FIELDS, rnd.randint(1, 4)):
            body[f] = None
        if rnd.random() < 0.5:
            body["messages"] = [None, {"role": None, "content": None}, {"role": "user", "content": [None]}]
        return path, json.dumps(body).encode()
    body = {"messages": [msg], "prompt": "Hi", "content": "Hi", "tokens": [1], "max_tokens": 4}  # wrong types
    for f in rnd.sample(FIELDS, rnd.randint(1, 3)):
        body[f] = rnd.choice(WRONG)
    if rnd.random() < 0.3:
        body["messages"] = [{"role": rnd.choice(WRONG), "content": rnd.choice(WRONG), "name": rnd.choice(WRONG)}]
    return path, json.dumps(body).encode()


@pytest.mark.parametrize("i", range(HOSTILE_CASES))
def test_itemC_hostile_generators_get_no_5xx(fuzzed, i):
    path, raw = hostile_case(i)
    for headers in (AUTH, {}):  # with the key, and without: 401 whatever the body
        status, body = _post(fuzzed.base + path, raw, headers)
        check(status, body, f"case {i}: {path} {raw[:200]!r}")
        if not headers:
            assert status == 401, (status, body[:200])
    fuzzed.health()


def _post(url: str, raw: bytes, headers: dict) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=raw, method="POST", headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_itemC_report(fuzzed):
    """The case counts of the schemathesis run, for the record (pytest -s shows them)."""
    total = sum(len(v) for v in COUNTS.values())
    print(f"\nschemathesis: {total} cases over {len(COUNTS)} operation/mode pairs "
          f"({EXAMPLES} examples each at most); hostile generators: {HOSTILE_CASES} cases")
    for (method, path, mode), statuses in sorted(COUNTS.items()):
        print(f"  {method} {path} {mode}: {len(statuses)} cases, statuses {sorted(set(statuses))}")
    assert fuzzed.health()["status"] == "ok"
