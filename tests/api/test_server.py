"""``epikv-local serve`` end to end: the server runs as a subprocess on the real default model and is spoken to
with the real ``openai`` client and with raw HTTP (urllib). No mocks, no wall-clock assertions: waits have
deadlines only so that a broken server fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from epikv_local.policies import DEFAULT_POLICY

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 128
KEY = "sekrit-test-key"
#: SmolLM2's end-of-generation tokens (<|endoftext|>, <|im_end|>): banned where a generation must run long
NO_EOG = {"0": -100, "2": -100}
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m epikv_local.cli serve ...`` on a free port, with its stderr in a temporary file."""

    def __init__(self, model_path: Path, *extra: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epikv_local.cli", "serve", "-m", str(model_path), "--kv-budget", str(BUDGET),
             "--port", str(self.port), "-t", "1", *extra],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        try:
            wait_healthy(self.proc, self.base, self.stderr)
        except RuntimeError:
            self.stop()
            raise

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        """SIGTERM, then wait (60 s, then kill); ``stop_seconds``: how long the server took to exit."""
        if self.proc.poll() is None:
            t0 = time.monotonic()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.stop_seconds = time.monotonic() - t0
        return self.proc.returncode

    def client(self, key: str = "x", **kw):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def health(self) -> dict:
        status, body = http("GET", self.base + "/health")
        assert status == 200 and body["status"] == "ok", (status, body)
        return body


def wait_healthy(proc, base: str, log, seconds: float = 180) -> None:
    """Wait until ``base``'s ``/health`` answers 200; RuntimeError (with ``log()``) when ``proc`` exits first
    or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {log()[-2000:]}")
        try:
            if http("GET", base + "/health")[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come up: {log()[-2000:]}")
        time.sleep(0.2)


@contextlib.contextmanager
def serving(model_path: Path, *extra: str):
    """A :class:`Server` with ``extra`` arguments, stopped (and its log closed) on every path."""
    s = Server(model_path, *extra)
    try:
        yield s
    finally:
        s.stop()
        s.log.close()


def http(method: str, url: str, body=None, headers: dict | None = None, timeout: float = 120):
    """(status, parsed JSON body) of one request; ``body``: a dict (sent as JSON) or raw bytes."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def sse_data(url: str, body: dict, headers: dict | None = None, timeout: float = 120) -> list[str]:
    """The ``data:`` payloads of one streamed POST, in order (``[DONE]`` included)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        return [line[len(b"data: "):].decode().strip() for line in r if line.startswith(b"data: ")]


def assert_openai_error(status: int, body, expected_status: int | None = None) -> dict:
    assert 400 <= status < 600, status
    if expected_status is not None:
        assert status == expected_status, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    return err


def epikv(obj) -> dict:
    ext = (obj.model_extra or {}).get("epikv")
    assert isinstance(ext, dict), obj
    assert ext["kv_budget"] == BUDGET and 0 < ext["max_live_cells"] <= BUDGET
    assert ext["live_cells"] <= BUDGET and ext["flash_attn"] is True and ext["policy"] == DEFAULT_POLICY
    return ext


def reasoning_of(obj):
    return (obj.model_extra or {}).get("reasoning_content")


@pytest.fixture(scope="module")
def server(model_path):
    with serving(model_path) as s:
        yield s


@pytest.fixture(scope="module")
def guarded(model_path):
    """A second server: --max-queue 1 and an API key."""
    with serving(model_path, "--max-queue", "1", "--api-key", KEY, "--model-alias", "smol") as s:
        yield s


def chat(client, model: str, messages=CHAT, max_tokens: int = 24, **kw):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens, **kw)


def test_health_models_and_banner(server, model_path):
    h = server.health()
    assert h["model"] == model_path.name and h["busy"] is False and h["queued"] == 0
    models = server.client().models.list()
    assert [m.id for m in models.data] == [model_path.name]
    assert f"epikv-local: serving {model_path.name} on http://127.0.0.1:{server.port}" in server.stderr()


def test_chat_non_streaming_and_streaming_agree(server, model_path):
    client = server.client()
    r = chat(client, model_path.name)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == model_path.name
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ext = epikv(r)
    assert ext["prompt_tokens_reused"] + ext["prompt_tokens_decoded"] == r.usage.prompt_tokens

    chunks = list(chat(client, model_path.name, stream=True))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != r.id
    assert all(c.object == "chat.completion.chunk" and c.model == model_path.name for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    epikv(chunks[-1])
    assert all("epikv" not in (c.model_extra or {}) for c in chunks[:-1])
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    reasoning = "".join(reasoning_of(c.choices[0].delta) or "" for c in chunks)
    # greedy: the same answer, and reasoning_content absent (or present) in both the same way
    assert content == choice.message.content
    assert (reasoning or None) == reasoning_of(choice.message)


def test_completions_non_streaming_and_streaming(server, model_path):
    client = server.client()
    kw = dict(model=model_path.name, prompt="The capital of France is", max_tokens=12, temperature=0)
    r = client.completions.create(**kw)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == model_path.name
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length") and 0 < r.usage.completion_tokens <= 12
    epikv(r)
    chunks = list(client.completions.create(stream=True, **kw))
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    epikv(chunks[-1])


def test_two_concurrent_clients_get_their_own_complete_answers(server, model_path):
    questions = [[{"role": "user", "content": "Name three colours of the rainbow."}],
                 [{"role": "user", "content": "What is two plus three? Explain briefly."}]]
    alone = [chat(server.client(), model_path.name, q).choices[0].message.content for q in questions]
    assert alone[0] != alone[1]
    results: dict = {}

    def ask(i: int, stream: bool):
        try:
            client = server.client()  # one client (connection pool) per thread
            if stream:
                chunks = list(chat(client, model_path.name, questions[i], stream=True))
                results[i] = (chunks[0].id, "".join(c.choices[0].delta.content or "" for c in chunks),
                              chunks[-1].choices[0].finish_reason)
            else:
                r = chat(client, model_path.name, questions[i])
                results[i] = (r.id, r.choices[0].message.content, r.choices[0].finish_reason)
        except Exception as e:  # reported by the main thread
            results[i] = e

    threads = [threading.Thread(target=ask, args=(0, True)), threading.Thread(target=ask, args=(1, False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    for i in (0, 1):
        assert not isinstance(results[i], Exception), results[i]
        assert results[i][1] == alone[i] and results[i][2] in ("stop", "length")
    assert results[0][0] != results[1][0]
    assert server.health()["busy"] is False


def leave_mid_stream(client, model: str) -> None:
    """Start a generation that cannot end by itself before 2000 tokens (end-of-generation tokens banned), read
    two chunks and leave."""
    stream = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=2000, temperature=0,
                                       logit_bias=NO_EOG, stream=True)
    it = iter(stream)
    next(it), next(it)
    stream.close()


def test_client_disconnecting_mid_stream_frees_the_model(server, model_path):
    client = server.client()
    before = server.health()
    leave_mid_stream(client, model_path.name)
    r = chat(client, model_path.name, max_tokens=8)  # served next, after the cut-off generation stopped
    assert r.choices[0].message.content and r.usage.completion_tokens <= 8
    after = server.health()
    assert after["busy"] is False and after["served"] == before["served"] + 2
    assert after["cancelled"] == before["cancelled"] + 1
    cut_off = after["tokens_generated"] - before["tokens_generated"] - r.usage.completion_tokens
    assert 1 <= cut_off < 1000, cut_off  # stopped soon after the client left, far from its 2000 tokens


@pytest.mark.parametrize("path,body,status", [
    ("/v1/chat/completions", {"model": None}, 400),  # no messages
    ("/v1/chat/completions", {"messages": "hello"}, 400),  # not a list
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -1}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "many"}, 400),
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/chat/completions", b"", 400),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": -1}, 400),  # EpikvError: the Llama's check
    ("/v1/completions", {"prompt": "hi", "logprobs": 1, "echo": True}, 400),  # EpikvError: not supported
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/nothing-here", {"prompt": "hi"}, 404),
])
def test_bad_requests_get_openai_errors_and_the_server_stays_healthy(server, path, body, status):
    got, payload = http("POST", server.base + path, body)
    assert_openai_error(got, payload, status)
    server.health()


def test_budget_error_is_a_400_with_its_message(server, model_path):
    long_prompt = " ".join(f"word{i}" for i in range(60))  # more prompt than a 128-cell budget can protect
    got, payload = http("POST", server.base + "/v1/completions", {"prompt": long_prompt, "max_tokens": 4})
    err = assert_openai_error(got, payload, 400)
    assert err["code"] == "BudgetError" and "budget" in err["message"].lower()
    r = server.client().completions.create(model=model_path.name, prompt="Hello", max_tokens=4, temperature=0)
    assert r.choices[0].text is not None and server.health()["busy"] is False


def test_openai_client_sees_errors_as_exceptions(server, model_path):
    client = server.client()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_path.name, messages=[], max_tokens=4)
    server.health()


def test_api_key(guarded):
    assert http("GET", guarded.base + "/health")[0] == 200  # open, like llama-server's
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        status, body = http("GET", guarded.base + "/v1/models", headers=headers)
        assert_openai_error(status, body, 401)
        status, body = http("POST", guarded.base + "/v1/chat/completions", {"messages": CHAT}, headers=headers)
        assert_openai_error(status, body, 401)
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").models.list()
    status, body = http("GET", guarded.base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and [m["id"] for m in body["data"]] == ["smol"]
    r = chat(guarded.client(KEY), "smol", max_tokens=4)
    assert r.model == "smol" and r.choices[0].message.content


def test_full_queue_answers_503(guarded):
    """--max-queue 1: one request runs, one waits, the next is refused at once with 503."""
    client = guarded.client(KEY)
    running = client.completions.create(model="smol", prompt="1, 2, 3,", max_tokens=2000, temperature=0,
                                        logit_bias=NO_EOG, stream=True)
    it = iter(running)
    next(it)  # the stream has started: it holds the model
    waiting: dict = {}

    def wait_in_queue():
        try:
            waiting["r"] = guarded.client(KEY).completions.create(model="smol", prompt="Hello", max_tokens=4,
                                                                  temperature=0)
        except Exception as e:
            waiting["r"] = e

    t = threading.Thread(target=wait_in_queue)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while guarded.health()["queued"] < 1:  # /health answers while the model generates
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.05)
        refused = []
        for _ in range(3):
            status, body = http("POST", guarded.base + "/v1/completions", {"prompt": "Hi", "max_tokens": 4},
                                headers={"Authorization": f"Bearer {KEY}"})
            refused.append(status)
            err = assert_openai_error(status, body, 503)
            assert err["code"] == "queue_full"
        with pytest.raises(openai.InternalServerError):  # the client sees the 503 too
            chat(client, "smol", max_tokens=4)
    finally:
        running.close()  # the running stream's client leaves: the waiting request runs
        t.join(timeout=120)
    assert not isinstance(waiting["r"], Exception), waiting["r"]
    assert waiting["r"].choices[0].text is not None
    h = guarded.health()
    assert h["busy"] is False and h["queued"] == 0


def test_sigterm_shuts_down_cleanly(guarded):
    assert guarded.stop() == 0, guarded.stderr()
    assert "Traceback" not in guarded.stderr()


# -- conformance (issue "drop-in", item 4) ----------------------------------------------------------------------
def test_itemA_any_model_name_is_served_under_the_alias(server, model_path):
    client = server.client()
    r = chat(client, "gpt-4o", max_tokens=4)
    assert r.model == model_path.name and r.choices[0].message.content
    c = client.completions.create(model="no-such-model", prompt="Hello", max_tokens=3, temperature=0)
    assert c.model == model_path.name
    chunks = list(chat(client, "whatever", max_tokens=3, stream=True))
    assert {ch.model for ch in chunks} == {model_path.name}


def test_itemA_max_completion_tokens_is_honoured_and_wins_over_max_tokens(server, model_path):
    client = server.client()
    kw = dict(model="m", messages=CHAT, temperature=0, logit_bias=NO_EOG)
    r = client.chat.completions.create(max_completion_tokens=3, max_tokens=20, **kw)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(max_tokens=5, **kw)
    assert r.usage.completion_tokens == 5
    r = client.chat.completions.create(max_completion_tokens=4, **kw)
    assert r.usage.completion_tokens == 4


def test_itemA_include_usage_sends_the_usage_chunk_before_done(server, model_path):
    client = server.client()
    chunks = list(client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, temperature=0,
                                                 logit_bias=NO_EOG, stream=True,
                                                 stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4 and last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + 4 and last.id == chunks[0].id
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks[:-1])
    data = sse_data(server.base + "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True,
                                                      "logit_bias": NO_EOG, "stream_options": {"include_usage": True}})
    assert data[-1] == "[DONE]"
    usage = json.loads(data[-2])
    assert usage["choices"] == [] and usage["object"] == "text_completion" and usage["usage"]["completion_tokens"] == 3
    plain = sse_data(server.base + "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True})
    assert all("usage" not in json.loads(d) for d in plain[:-1])


def test_itemA_n_out_of_range_is_a_clear_400(server):
    for path, body in (("/v1/chat/completions", {"messages": CHAT, "n": 9}),
                       ("/v1/completions", {"prompt": "Hi", "n": 0})):
        err = assert_openai_error(*http("POST", server.base + path, body), 400)
        assert err["param"] == "n" and "n must be in 1..8" in err["message"]


def test_n_choices_with_one_sequence_one_after_another(server, model_path):
    client = server.client()
    r = client.chat.completions.create(model=model_path.name, messages=CHAT, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: the same answer twice
    assert 2 <= r.usage.completion_tokens <= 12
    chunks = list(client.completions.create(model=model_path.name, prompt="Hello", max_tokens=3, n=2, stream=True))
    assert {c.choices[0].index for c in chunks} == {0, 1} and len({c.id for c in chunks}) == 1


def test_itemA_tokenize_detokenize_props_in_llama_servers_shapes(server, model_path):
    status, body = http("POST", server.base + "/tokenize", {"content": "Hello world"})
    assert status == 200 and set(body) == {"tokens"} and body["tokens"] and all(type(t) is int for t in body["tokens"])
    ids = body["tokens"]
    status, back = http("POST", server.base + "/detokenize", {"tokens": ids})
    assert status == 200 and back == {"content": "Hello world"}
    status, pieces = http("POST", server.base + "/tokenize", {"content": "Hello world", "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == ids and "".join(p["piece"] for p in pieces["tokens"]) == "Hello world"
    special = http("POST", server.base + "/tokenize", {"content": "<|im_start|>"})[1]["tokens"]
    literal = http("POST", server.base + "/tokenize", {"content": "<|im_start|>", "parse_special": False})[1]["tokens"]
    assert len(special) == 1 and len(literal) > 1
    assert http("POST", server.base + "/detokenize", {"tokens": special})[1] == {"content": "<|im_start|>"}
    assert_openai_error(*http("POST", server.base + "/detokenize", {"tokens": [10 ** 9]}), 400)
    assert_openai_error(*http("POST", server.base + "/tokenize", {"content": 5}), 400)
    status, props = http("GET", server.base + "/props")
    assert status == 200 and props["total_slots"] == 1
    assert props["model_path"] == model_path.name and props["model_alias"] == model_path.name
    assert props["epikv"] == {"kv_budget": BUDGET, "policy": DEFAULT_POLICY} and props["max_prompt_tokens"] == 4 * BUDGET
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == BUDGET and settings["params"]["temperature"] == 0.6
    assert settings["params"]["n_predict"] == 8192 and "<|im_start|>" in props["chat_template"]
    assert props["build_info"].startswith("epikv-local ")


def test_row14_models_and_props_do_not_show_the_models_directory(server, model_path):
    for path in ("/v1/models", "/props", "/health"):
        req = urllib.request.urlopen(server.base + path, timeout=60)
        text = req.read().decode()
        assert str(model_path.parent) not in text and model_path.parent.name not in text, (path, text[:300])


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}}


def test_itemA_json_mode_and_tools_through_the_openai_client(server):
    """What agents and chat UIs send: JSON mode, a JSON schema and a named tool choice, through the real client."""
    client = server.client()
    r = chat(client, "gpt-4o", messages=[{"role": "user", "content": "Give me a JSON object with a name."}],
             max_tokens=48, response_format={"type": "json_object"})
    text = r.choices[0].message.content  # the grammar holds it to JSON; 48 tokens may end it early
    assert text.lstrip()[:1] in "{[" and (r.choices[0].finish_reason == "length" or json.loads(text) is not None), text
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "maximum": 1000}}, "required": ["answer"],
              "additionalProperties": False}
    r = chat(client, "m", messages=[{"role": "user", "content": "What is 2+2? Answer in JSON."}], max_tokens=32,
             response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["answer"], int)
    r = chat(client, "m", messages=[{"role": "user", "content": "What is the weather in Oslo?"}], max_tokens=48,
             tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    # the conversation goes on with the tool's answer, as an agent sends it (assistant content null)
    follow = chat(client, "m", max_tokens=8, messages=[
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 20 C"}])
    assert follow.choices[0].message.role == "assistant"


def test_itemA_reasoning_budget_flag_bounds_the_thinking(model_path):
    """--reasoning-budget N: after N reasoning tokens the closing tag is forced (a prompt that opens thinking)."""
    with serving(model_path, "--reasoning-budget", "4") as s:
        status, body = http("POST", s.base + "/v1/completions", {
            "prompt": "<|im_start|>user\nWhat is 6 times 7?<|im_end|>\n<|im_start|>assistant\n<think>\n",
            "max_tokens": 24, "temperature": 0})
    assert status == 200, body
    text = body["choices"][0]["text"]
    assert "</think>" in text, text


def test_itemA_streamed_tool_calls_follow_openai(server):
    """A streamed tool call sends its id, type and name once (clients join the deltas' strings), and the openai
    client's joined call equals the non-streamed one."""
    client = server.client()
    kw = dict(messages=[{"role": "user", "content": "What is the weather in Oslo?"}], max_tokens=48,
              tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = chat(client, "m", **kw).choices[0].message.tool_calls[0]
    names, args = [], ""
    for ch in chat(client, "m", stream=True, **kw):
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            if d.function and d.function.name:
                names.append(d.function.name)
            args += (d.function.arguments or "") if d.function else ""
    assert names == ["get_weather"] and args == whole.function.arguments


def test_itemA_tool_call_deltas_name_each_call_once_function_call_too():
    from epikv_local.api.server.streaming import openai_tool_deltas

    def chunk(args):
        return {"choices": [{"index": 0, "delta": {
            "tool_calls": [{"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": args}}],
            "function_call": {"name": "f", "arguments": args}}}]}

    seen: set = set()
    out = [openai_tool_deltas(chunk(a), seen)["choices"][0]["delta"] for a in ('{"a"', ": 1}")]
    assert out[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert out[1]["tool_calls"][0] == {"index": 0, "function": {"arguments": ": 1}"}}
    assert out[0]["function_call"]["name"] == "f" and out[1]["function_call"] == {"arguments": ": 1}"}
    plain = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    assert openai_tool_deltas(plain, seen) is plain
