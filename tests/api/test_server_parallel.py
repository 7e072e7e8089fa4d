"""``epikv-local serve --parallel 4 --metrics``: eight concurrent real ``openai`` clients (streaming and not)
on four sequences, ``/slots`` and ``/metrics`` against what was served, a client that leaves frees its
sequence. The server is a real subprocess on the default model."""

from __future__ import annotations

import threading

import pytest
from test_server import BUDGET, NO_EOG, http, serving

openai = pytest.importorskip("openai")

QUESTIONS = [f"Write the number {i} in words, then count to three." for i in range(8)]


@pytest.fixture(scope="module")
def server(model_path):
    with serving(model_path, "--parallel", "4", "--metrics", "--max-queue", "8") as s:
        yield s


def answer(server, model, i: int, stream: bool):
    client = server.client()
    msgs = [{"role": "user", "content": QUESTIONS[i]}]
    if stream:
        chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0,
                                                     stream=True))
        return chunks[0].id, "".join(c.choices[0].delta.content or "" for c in chunks)
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    return r.id, r.choices[0].message.content


def test_eight_clients_on_four_sequences_all_answered_unmixed(server, model_path):
    out: dict = {}

    def run(i):
        try:
            out[i] = answer(server, model_path.name, i, stream=i % 2 == 0)
        except Exception as e:  # reported by the main thread
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads)
    for i in range(8):
        assert not isinstance(out[i], Exception), out[i]
    assert len({out[i][0] for i in range(8)}) == 8
    # each answer is the one its question gets alone (greedy; alone = one request in the pool)
    for i in (1, 6):
        assert answer(server, model_path.name, i, stream=False)[1].split()[:2] == out[i][1].split()[:2]
    health = server.health()
    assert health["busy"] is False and health["n_parallel"] == 4


def test_slots_and_metrics_agree_with_what_was_served(server, model_path):
    status, slots = http("GET", server.base + "/slots")
    assert status == 200 and len(slots) == 4
    for s in slots:
        assert s["kv_budget"] == BUDGET and 0 <= s["n_live"] <= BUDGET and s["is_processing"] is False
    import urllib.request

    with urllib.request.urlopen(server.base + "/metrics", timeout=60) as r:
        assert r.headers["content-type"].startswith("text/plain")
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    health = server.health()
    assert values["epikv_requests_total"] == health["served"]
    assert values["epikv_tokens_predicted_total"] == health["tokens_generated"]
    assert values["epikv_requests_deferred"] == 0
    assert values[f'epikv_kv_budget_cells{{slot="0"}}'] == BUDGET
    live = [values[f'epikv_kv_live_cells{{slot="{i}"}}'] for i in range(4)]
    assert live == [s["n_live"] for s in slots]


def test_a_client_that_leaves_frees_its_sequence(server, model_path):
    client = server.client()
    before = server.health()
    stream = client.completions.create(model=model_path.name, prompt="1, 2, 3, 4,", max_tokens=2000,
                                       temperature=0, logit_bias=NO_EOG, stream=True)
    it = iter(stream)
    next(it), next(it)
    stream.close()
    r = client.chat.completions.create(model=model_path.name, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4)
    assert r.choices[0].message.content is not None
    after = server.health()
    assert after["busy"] is False and after["cancelled"] == before["cancelled"] + 1
    assert after["tokens_generated"] - before["tokens_generated"] < 1000
