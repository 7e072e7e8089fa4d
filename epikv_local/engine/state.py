"""Save a session's sequence to a file and restore it: KV cells (with the holes evictions left), the engine's
bookkeeping, the tokens, the policy's and the capture's running state.

File layout: ``EPIKVST1`` (8 bytes), the header length (8 bytes, little endian), a JSON header (format version,
model identity, budget, engine bookkeeping, the sha256 and length of each blob), then the blobs: the policy
and capture state (pickled: a state file is trusted like the model file; a foreign or corrupted one is refused by
its checksum before anything is unpickled) and llama.cpp's sequence state (``llama_state_seq_get_data``).
Written atomically (temporary file + rename). Restoring needs the same model file, cache types and a budget
no smaller than the saved live cells. Saving also re-lays the saved session's cells the way a restore does, so
that the original and every restored copy continue with bit-identical logits.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

from ..errors import DataError
from ..fileio import sha256_bytes, write_atomic

MAGIC = b"EPIKVST1"
VERSION = 2  # 2: the engine's bookkeeping as one EvictionEngine.snapshot()


def _model_identity(session) -> dict:
    info = session.model.info
    return {"desc": info.desc, "arch": info.arch, "n_layer": info.n_layer, "n_embd": info.n_embd,
            "n_vocab": info.n_vocab, "file_size": session.model.path.stat().st_size,
            "type_k": session.cfg.type_k, "type_v": session.cfg.type_v}


def save(session, path: str | os.PathLike) -> Path:
    """Write the session's sequence to ``path`` (atomically)."""
    eng = session.engine
    running = pickle.dumps({"policy": session.policy, "capture": session.capture.state()},
                           protocol=pickle.HIGHEST_PROTOCOL)
    kv = session.ctx.seq_state()
    # lay the live cells out as a restore does (position order): flash attention accumulates over the cells
    # in their physical order (in f16 on the CPU), so only the same layout continues with identical logits
    session.ctx.set_seq_state(kv)
    header = {
        "version": VERSION, "model": _model_identity(session), "policy": session.policy.name,
        "kv_budget": eng.cfg.kv_budget, "n_past": session.n_past, "tokens": session.tokens,
        "engine": eng.snapshot(),
        "blobs": [{"name": "running", "bytes": len(running), "sha256": sha256_bytes(running)},
                  {"name": "kv", "bytes": len(kv), "sha256": sha256_bytes(kv)}],
    }
    head = json.dumps(header).encode()
    return write_atomic(path, MAGIC + struct.pack("<Q", len(head)) + head + running + kv, error=DataError,
                        what="session state", make_parents=False)


def read(path: str | os.PathLike) -> tuple[dict, dict[str, bytes]]:
    """The header and blobs of a state file; DataError when it is not one, truncated or corrupted."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read session state {path}: {e.strerror or e}") from None
    if data[:8] != MAGIC:
        raise DataError(f"{path} is not an epikv-local session state file")
    if len(data) < 16:
        raise DataError(f"{path} is truncated")
    (n,) = struct.unpack("<Q", data[8:16])
    try:
        header = json.loads(data[16:16 + n])
    except ValueError:
        raise DataError(f"{path} is truncated or corrupted (unreadable header)") from None
    if header.get("version") != VERSION:
        raise DataError(f"{path} has state format {header.get('version')}, this version reads {VERSION}")
    blobs, at = {}, 16 + n
    for b in header["blobs"]:
        blob = data[at:at + b["bytes"]]
        if len(blob) != b["bytes"]:
            raise DataError(f"{path} is truncated ({b['name']}: {len(blob)} of {b['bytes']} bytes)")
        if sha256_bytes(blob) != b["sha256"]:
            raise DataError(f"{path} is corrupted ({b['name']} checksum mismatch)")
        blobs[b["name"]] = blob
        at += b["bytes"]
    return header, blobs


def load(session, path: str | os.PathLike) -> None:
    """Replace the session's sequence with the one saved in ``path``."""
    header, blobs = read(path)
    want = _model_identity(session)
    if header["model"] != want:
        diff = sorted(k for k in want if header["model"].get(k) != want[k])
        raise DataError(f"{path} was saved with another model or cache ({', '.join(diff)} differ)")
    if header["policy"] != session.policy.name:
        raise DataError(f"{path} was saved with policy {header['policy']!r}, this session runs "
                        f"{session.policy.name!r}")
    if len(header["engine"]["live"]) > session.budget.kv_budget:
        raise DataError(f"{path} holds {len(header['engine']['live'])} live cells, more than this session's budget "
                        f"{session.budget.kv_budget}")
    running = pickle.loads(blobs["running"])
    session.reset()
    session.ctx.set_seq_state(blobs["kv"])
    session.engine.restore(header["engine"])
    session.tokens = list(header["tokens"])
    session.n_past = header["n_past"]
    session.policy.__dict__.update(running["policy"].__dict__)
    session.capture.set_state(running["capture"])
