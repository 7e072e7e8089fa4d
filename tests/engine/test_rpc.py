"""Layers on other machines through llama.cpp's RPC backend: two real rpc-server processes on 127.0.0.1 (free
ports), the default model's layers offloaded to them; capture, scoring and eviction still work when the
captured layers live on a remote backend, and the logits match the local run within a stated tolerance."""

from __future__ import annotations

import socket
import subprocess
import time

import numpy as np
import pytest

from epikv_local.api.cli import rpc_server_path
from epikv_local.api.generation import generate
from epikv_local.engine.sampling import SamplingConfig
from epikv_local.engine.budget import BudgetConfig
from epikv_local.engine.handles import Context, Model
from epikv_local.engine.session import Session, SessionConfig
from epikv_local.errors import ConfigError, ModelError
from epikv_local.policies import make_policy

#: RPC moves the same tensors through another ggml CPU backend: the arithmetic is the same code, but the layer
#: split changes which threads reduce what; measured max |Δlogit| is 0 here, the bound leaves room for that
TOLERANCE = 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rpc_server() -> tuple[subprocess.Popen, str]:
    """A real rpc-server on a free 127.0.0.1 port, answering: (its process, its endpoint). The caller stops it."""
    port = free_port()
    proc = subprocess.Popen([str(rpc_server_path()), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.terminate()
    proc.wait(timeout=30)
    pytest.fail(f"rpc-server on 127.0.0.1:{port} did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def rpc_servers():
    procs, endpoints = [], []
    try:
        for _ in range(2):
            proc, endpoint = start_rpc_server()
            procs.append(proc)
            endpoints.append(endpoint)
        yield endpoints
    finally:
        for p in procs:
            stop(p)


def assert_loads_locally(model_path) -> None:
    """A model loaded without RPC servers puts its KV cache on the local CPU, none of it on an RPC device."""
    with Model(model_path, n_gpu_layers=-1) as m:
        m.nat.log.info.clear()
        with Context(m, n_ctx=256, n_batch=64, n_threads=1):
            pass
        assert not any("RPC" in line for line in m.nat.log.info)
        assert any("CPU KV buffer size" in line for line in m.nat.log.info)


def logits_of(model, tokens):
    with Context(model, n_ctx=256, n_batch=64, n_threads=1) as ctx:
        ctx.decode(tokens, np.arange(len(tokens)), logits_all=True)
        return np.stack([ctx.logits(i).copy() for i in range(len(tokens))])


def test_remote_layers_capture_score_and_evict(model_path, rpc_servers):
    local = Model(model_path, n_gpu_layers=0)
    tokens = local.tokenize("The quick brown fox jumps over the lazy dog because it wants to")
    ref = logits_of(local, tokens)
    remote = Model(model_path, n_gpu_layers=-1, rpc_servers=",".join(rpc_servers))
    try:
        remote.nat.log.info.clear()
        got = logits_of(remote, tokens)
        # the layers and their KV cache really live on the RPC servers (llama.cpp's own report)
        assert any("RPC" in line and "KV buffer size" in line for line in remote.nat.log.info), list(remote.nat.log.info)
        diff = float(np.abs(got - ref).max())
        print(f"max |logit difference| remote vs local: {diff}")
        assert diff <= TOLERANCE
        prompt = remote.tokenize("Write a story about a lighthouse keeper.")
        budget = BudgetConfig(kv_budget=48, n_recent=16)
        runs = {}
        for name, m in (("local", local), ("remote", remote)):
            with Session(m, make_policy("epikv", layers=(9, 20)), budget, SessionConfig(n_threads=1), record=True) as s:
                res = generate(s, prompt, 80, SamplingConfig(), ignore_eog=True)
                runs[name] = (res.tokens, s.stats(), [ev.evicted.tolist() for ev in s.events])
        tokens_l, st_l, ev_l = runs["local"]
        tokens_r, st_r, ev_r = runs["remote"]
        assert st_r.n_evicted > 0 and st_r.max_live <= 48 and st_r.flash_attn
        assert st_r.layers == [9, 20]  # captured from layers that live on the RPC servers
        assert tokens_r == tokens_l and ev_r == ev_l  # same scores -> same evictions -> same text
    finally:
        remote.close()
        local.close()


def test_bad_rpc_endpoints_are_clear_errors(model_path):
    with pytest.raises(ConfigError, match="host:port"):
        Model(model_path, rpc_servers="localhost")
    with pytest.raises(ModelError, match="cannot reach"):
        Model(model_path, rpc_servers=f"127.0.0.1:{free_port()}")


def test_a_model_without_rpc_servers_stays_local_after_one_used_them(model_path, rpc_servers):
    """RPC devices are in ggml's registry (the process's) while a model that asked for them is open: a model
    loaded meanwhile without them must not offload there."""
    with Model(model_path, n_gpu_layers=-1, rpc_servers=",".join(rpc_servers)) as first:
        assert_loads_locally(model_path)
        assert first.nat.rpc[1].ggml_backend_dev_count() > 1


def test_rpc_devices_leave_the_registry_with_the_last_model_so_default_loads_survive_a_gone_server(model_path,
                                                                                                   rpc_servers):
    """Once the last model that used an RPC server is freed, its devices leave ggml's registry: a model loaded
    afterwards with llama.cpp's *default* device list (llama-cpp-python's ``Llama`` in the same process, a
    vocabulary-only load) no longer asks the gone server for its memory, which aborted the whole process
    (ggml-rpc: "Failed to connect"; it took the test suite down when run in another order)."""
    with Model(model_path, n_gpu_layers=-1, rpc_servers=rpc_servers[0]) as other:  # another server, still in use
        g, ll = other.nat.rpc[1], other.nat.llama
        base = g.ggml_backend_dev_count()
        proc, endpoint = start_rpc_server()
        try:
            with Model(model_path, n_gpu_layers=-1, rpc_servers=endpoint):
                inside = g.ggml_backend_dev_count()
                assert inside == base + 1
                with Model(model_path, n_gpu_layers=-1, rpc_servers=endpoint):
                    pass  # a second user of the same server: closing it keeps the devices for the first
                assert g.ggml_backend_dev_count() == inside
        finally:
            stop(proc)
        assert g.ggml_backend_dev_count() == base  # the other server's device is still listed
        with Session(other, make_policy("epikv"), BudgetConfig(kv_budget=32),
                     SessionConfig(n_batch=16, n_threads=1)) as s:
            s.feed(other.tokenize("The other server still computes its layers."), is_prompt=True)
            assert np.isfinite(s.logits()).all()
    assert g.ggml_backend_dev_count() == base - 1
    handle = ll.llama_model_load_from_file(str(model_path).encode(), ll.llama_model_default_params())
    assert handle  # the process is still alive, and the model loaded on the local devices
    ll.llama_model_free(handle)
    assert_loads_locally(model_path)
