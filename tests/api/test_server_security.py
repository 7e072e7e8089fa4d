"""``epikv-local serve`` against hostile clients (issue "Hostile inputs") and browsers (CORS, Host), end to end:
real servers on 127.0.0.1 with the real default model, raw HTTP (urllib, sockets), the ``openai`` client and
headless Chromium. No wall-clock assertions; waits have deadlines so that a broken server fails instead of
hanging.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_server import CHAT, ROOT, assert_openai_error, chat, epikv, free_port, http, serving

KEYS = ("key-alpha", "key-beta", "key-gamma")
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(model_path):
    """Three keys (comma-separated and repeated), the loopback CORS default."""
    with serving(model_path, "--api-key", f"{KEYS[0]},{KEYS[1]}", "--api-key", KEYS[2]) as s:
        yield s


# -- row 6 / 14: authenticate before parsing; a depth-limited parse ----------------------------------------------
@pytest.mark.parametrize("body", [b"[" * 100_000, b"{not json", b"\xff\xfe", b"", b'{"messages": 5}'])
def test_row6_deep_nesting_before_auth_is_401(keyed, body):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/nothing"):
        err = assert_openai_error(*http("POST", keyed.base + path, body), 401)
        assert err["code"] == "invalid_api_key"
    keyed.health()


@pytest.mark.parametrize("body,code", [
    (b"[" * 100_000, "too_deep"), (b'{"a": ' * 5000 + b"1" + b"}" * 5000, "too_deep"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "invalid_json"),
    (b'{"prompt": "a\xff"}', "invalid_json"), (b'{"prompt": "x"', "invalid_json"), (b"[1]", "invalid_json")])
def test_row6_a_hostile_body_is_a_400_not_a_500(keyed, body, code):
    err = assert_openai_error(*http("POST", keyed.base + "/v1/chat/completions", body, headers=auth(KEYS[0])), 400)
    assert err["code"] == code, err
    keyed.health()


# -- row 7, 8, 16: messages, text and types ---------------------------------------------------------------------
@pytest.mark.parametrize("messages,index", [
    ([{"role": "user", "content": None}], 0),
    ([{"role": "system", "content": "Be brief."}, {"role": "user"}], 1),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}], 1)])
def test_row7_null_or_missing_content_is_a_400_naming_the_message(keyed, messages, index):
    err = assert_openai_error(*http("POST", keyed.base + "/v1/chat/completions", {"messages": messages},
                                    headers=auth(KEYS[0])), 400)
    assert err["param"] == f"messages[{index}].content" and f"messages[{index}]" in err["message"]


def test_row7_a_tool_call_turn_with_null_content_is_served(keyed):
    """What the openai client sends back after a tool call (assistant content null beside tool_calls)."""
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    status, body = http("POST", keyed.base + "/v1/chat/completions", {"messages": messages, "max_tokens": 2},
                        headers=auth(KEYS[0]))
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant", body


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"), ("/v1/completions", b'{"prompt": ["\\udbff"]}',
                                                              "prompt[0]"),
    ("/tokenize", b'{"content": "a\\ud800b"}', "content")])
def test_row8_a_lone_surrogate_is_a_400_naming_the_field(keyed, path, raw, param):
    err = assert_openai_error(*http("POST", keyed.base + path, raw, headers=auth(KEYS[0])), 400)
    assert err["param"] == param and err["code"] == "invalid_unicode" and param in err["message"]
    ok = http("POST", keyed.base + "/v1/completions", b'{"prompt": "\\ud83d\\ude00 hi", "max_tokens": 2}',
              headers=auth(KEYS[0]))  # a surrogate pair is a character
    assert ok[0] == 200, ok


@pytest.mark.parametrize("field,value", [("max_tokens", "10"), ("max_tokens", True), ("max_tokens", 2.0),
                                         ("temperature", "0.5"), ("stream", "true"), ("seed", "1"),
                                         ("logprobs", "yes"), ("stop", 5), ("top_logprobs", True)])
def test_row16_strict_types_no_coercion(keyed, field, value):
    err = assert_openai_error(*http("POST", keyed.base + "/v1/chat/completions",
                                    {"messages": CHAT, field: value}, headers=auth(KEYS[0])), 400)
    assert err["param"] == field, err


def test_row16_top_logprobs_goes_where_logprobs_goes(keyed):
    """The Llama serves chat logprobs now: top_logprobs is honoured with them (and refused where they are)."""
    client = keyed.client(KEYS[0])
    r = chat(client, "m", max_tokens=3, logprobs=True, top_logprobs=2)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    err = assert_openai_error(*http("POST", keyed.base + "/v1/chat/completions",
                                    {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, headers=auth(KEYS[0])),
                              400)
    assert "top_logprobs" in err["message"]


# -- row 13: prompt-prefix reuse within one identity ----------------------------------------------------------
def reused(server, key: str) -> int:
    r = chat(server.client(key), "m", [{"role": "user", "content": "Tell me about the sea and its waves."}],
             max_tokens=2)
    return epikv(r)["prompt_tokens_reused"]


def test_row13_prompt_cache_is_reused_within_one_key_only(keyed):
    reused(keyed, KEYS[0])
    assert reused(keyed, KEYS[0]) > 0  # the same client: its prefix is reused
    assert reused(keyed, KEYS[1]) == 0  # another key: the cache was reset first
    assert reused(keyed, KEYS[2]) == 0
    assert reused(keyed, KEYS[0]) == 0  # and back: KEYS[2]'s conversation was not kept for KEYS[0] either


def test_row13_share_prompt_cache_opts_in(model_path):
    with serving(model_path, "--api-key", f"{KEYS[0]},{KEYS[1]}", "--share-prompt-cache") as s:
        reused(s, KEYS[0])
        assert reused(s, KEYS[1]) > 0


# -- row 14, 15: docs behind the key, keys at startup ----------------------------------------------------------
def test_row14_docs_and_openapi_need_the_key(keyed):
    for path in ("/docs", "/redoc", "/openapi.json", "/props", "/v1/models"):
        assert_openai_error(*http("GET", keyed.base + path), 401)
        req = urllib.request.Request(keyed.base + path, headers=auth(KEYS[1]))
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
    assert http("GET", keyed.base + "/health")[0] == 200


@pytest.mark.parametrize("key", ["clé-secrète", "two words", "tab\tkey", ",", "ok,  "])
def test_row15_a_bad_api_key_is_refused_at_startup_in_one_line(model_path, key):
    r = subprocess.run([sys.executable, "-m", "epikv_local.cli", "serve", "-m", str(model_path), "--port", "0",
                        "--api-key", key], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("epikv-local: error: --api-key"), r.stderr
    assert key.strip(",") not in lines[0] or not key.strip(", ")  # the key itself is not echoed


# -- Host and CORS ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host,status", [("evil.example", 403), ("evil.example:8080", 403), ("127.0.0.1.nip.io", 403),
                                         ("localhost", 200), ("127.0.0.1:1234", 200), ("[::1]:99", 200)])
def test_itemA_host_header_is_loopback_only_on_a_loopback_server(keyed, host, status):
    got, body = http("GET", keyed.base + "/health", headers={"Host": host})
    if status == 200:
        assert got == 200, body
    else:
        assert assert_openai_error(got, body, status)["code"] == "host_not_allowed"


def test_itemA_cors_preflight_and_foreign_origins(keyed):
    allowed, foreign = "http://localhost:5173", "http://evil.example"
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    req = urllib.request.Request(keyed.base + "/v1/chat/completions", method="OPTIONS",
                                 headers={"Origin": allowed, **pre})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == allowed
        assert "authorization" in r.headers["Access-Control-Allow-Headers"]
    for headers in ({"Origin": foreign, **pre}, {"Origin": "null", **pre}):
        req = urllib.request.Request(keyed.base + "/v1/chat/completions", method="OPTIONS", headers=headers)
        assert_openai_error(*_status_body(req), 403)
    served = keyed.health()["served"]
    err = assert_openai_error(*http("POST", keyed.base + "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}',
                                    headers={"Origin": foreign, "Content-Type": "text/plain", **auth(KEYS[0])}), 403)
    assert err["code"] == "origin_not_allowed" and keyed.health()["served"] == served  # nothing was generated
    req = urllib.request.Request(keyed.base + "/v1/models", headers={"Origin": allowed, **auth(KEYS[0])})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Access-Control-Allow-Origin"] == allowed


def _status_body(req):
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


PAGE = """<!doctype html><html><body><pre id="out">pending</pre><script>
(async () => {
  const out = document.getElementById("out");
  try {
    const r = await fetch("%(url)s/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer %(key)s"},
      body: JSON.stringify({messages: [{role: "user", content: "Say hello."}], max_tokens: 6, stream: true})});
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let text = "", events = 0, done = false;
    while (true) {
      const {value, done: end} = await reader.read();
      if (end) break;
      for (const line of decoder.decode(value, {stream: true}).split("\\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") { done = true; continue; }
        events++;
        const delta = JSON.parse(line.slice(6)).choices[0].delta || {};
        text += delta.content || "";
      }
    }
    out.textContent = "ok:" + r.status + ":" + events + ":" + done + ":" + text;
  } catch (e) { out.textContent = "error:" + e; }
  fetch("%(pages)s/report", {mode: "no-cors"});  // lets /wait, and so the page's load, finish
})();
</script><img src="%(pages)s/wait"></body></html>"""


@contextlib.contextmanager
def page_server(pages: dict):
    """A tiny http.server on another 127.0.0.1 port; yields its origin. ``/page.html`` is ``pages["html"]`` as
    it is when asked; ``/wait`` (an image of the page) answers once the page has fetched ``/report`` (or after
    60 s), so that the page's load event, which ``--dump-dom`` waits for, comes after its script's result."""
    reported = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/report":
                reported.set()
            elif self.path == "/wait":
                reported.wait(60)
                reported.clear()
            data = pages.get("html", "").encode() if self.path == "/page.html" else b""
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        reported.set()
        srv.shutdown()
        srv.server_close()
        t.join(timeout=10)


def browser_result(url: str, tmp_path) -> str:
    """What the page at ``url`` wrote into its ``#out`` (headless Chromium, its DOM once the script ran)."""
    browser = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if browser is None:
        pytest.fail("no headless browser found (tried chromium, chromium-browser, google-chrome): install one")
    r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'p'}",
                        "--dump-dom", url],
                       capture_output=True, text=True, timeout=150)
    start = r.stdout.find('<pre id="out">')
    assert start >= 0, (r.returncode, r.stdout[-500:], r.stderr[-500:])
    return r.stdout[start + len('<pre id="out">'):r.stdout.find("</pre>", start)]


def test_itemA_cors_a_page_from_a_loopback_origin_streams_a_chat_in_chromium(keyed, tmp_path):
    pages: dict = {}
    with page_server(pages) as origin:
        pages["html"] = PAGE % {"url": keyed.base, "key": KEYS[0], "pages": origin}
        out = browser_result(origin + "/page.html", tmp_path)
    status, n_events, done, text = out.removeprefix("ok:").split(":", 3)
    assert out.startswith("ok:") and status == "200" and int(n_events) >= 2 and done == "true" and text, out


def test_itemA_cors_pages_from_other_origins_are_refused_in_chromium(model_path, tmp_path):
    """--cors-origins lists one page server's origin: its page streams, the same page from another port (another
    origin) and from a data: URL (origin null) are refused before anything is generated."""
    pages: dict = {}
    with page_server(pages) as listed, page_server(pages) as other:
        with serving(model_path, "--api-key", "k", "--cors-origins", listed) as s:
            pages["html"] = PAGE % {"url": s.base, "key": "k", "pages": listed}
            ok = browser_result(listed + "/page.html", tmp_path / "a")
            served = s.health()["served"]
            pages["html"] = PAGE % {"url": s.base, "key": "k", "pages": other}
            refused = browser_result(other + "/page.html", tmp_path / "b")
            data_url = "data:text/html;charset=utf-8," + urllib.parse.quote(pages["html"])
            for attempt in range(3):  # a data: page (origin null) may load before its refused fetch settles: the
                # DOM is then dumped still "pending" (seen once in a full run), which says nothing; ask again
                refused_data = browser_result(data_url, tmp_path / f"c{attempt}")
                if refused_data != "pending":
                    break
            assert s.health()["served"] == served == 1
    assert ok.startswith("ok:200:"), ok
    assert refused.startswith("error:") and refused_data.startswith("error:"), (refused, refused_data)
