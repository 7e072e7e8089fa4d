"""``epikv-local rpc-server -H 127.0.0.1 -p PORT`` as the README writes it: every argument goes to llama.cpp's
rpc-server untouched (argparse used to answer ``unrecognized arguments: -H``), and it listens."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epikv_local.cli import build_parser, split_passthrough
from epikv_local.errors import NativeError

REPO = Path(__file__).resolve().parents[2]


def test_arguments_after_rpc_server_are_passed_untouched():
    argv = ["rpc-server", "-H", "127.0.0.1", "-p", "50052", "-t", "2", "--help", "-c"]
    head, rest = split_passthrough(argv)
    assert head == ["rpc-server"] and rest == argv[1:]
    assert split_passthrough(["generate", "-m", "x", "-p", "rpc-server"]) == (["generate", "-m", "x", "-p",
                                                                               "rpc-server"], None)
    assert build_parser()[0].parse_args(head).cmd == "rpc-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rpc_server_subcommand_listens_and_stops():
    from epikv_local.api.cli import rpc_server_path

    try:
        rpc_server_path()
    except NativeError as e:
        pytest.skip(f"this build has no rpc-server (GGML_RPC=OFF): {e}")
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "epikv_local.cli", "rpc-server", "-H", "127.0.0.1", "-p", str(port),
                          "-t", "1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert p.poll() is None, f"rpc-server exited with {p.returncode}: {p.stdout.read()}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2):
                    break  # it listens on the port it was given
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after 60 s")
                time.sleep(0.2)
    finally:
        p.terminate()
        try:
            out, _ = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
    assert "unrecognized arguments" not in out and "Traceback" not in out  # (its banner is block-buffered: lost)


def test_rpc_server_bad_option_is_the_binarys_answer():
    from epikv_local.api.cli import rpc_server_path

    try:
        rpc_server_path()
    except NativeError as e:
        pytest.skip(f"this build has no rpc-server (GGML_RPC=OFF): {e}")
    r = subprocess.run([sys.executable, "-m", "epikv_local.cli", "rpc-server", "--help"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert "-H, --host" in r.stdout + r.stderr and "Traceback" not in r.stderr
