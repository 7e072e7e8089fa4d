"""Result provenance (epikv_local/eval/provenance.py): committed results name no path of the machine they ran on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from epikv_local.eval import provenance as pv


def test_portable_spells_machine_paths_portably(monkeypatch, tmp_path):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("EPIKV_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    repo, shared = pv.REPO, pv.REPO.parent / "shared"
    doc = {"command": f"{repo}/.venv/bin/python scripts/x.py --model {home}/.cache/epikv-local/models/m.gguf "
                      f"--data {shared}/data/gsm8k_test.jsonl --out {repo}/results",
           "parts": [f"{home}/notes.txt", ("tuple", 3)], "n": 3, "ok": None}
    out = pv.portable(doc)
    assert out == {"command": ".venv/bin/python scripts/x.py --model ~/.cache/epikv-local/models/m.gguf "
                              "--data ../shared/data/gsm8k_test.jsonl --out results",
                   "parts": ["~/notes.txt", ["tuple", 3]], "n": 3, "ok": None}
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path / "models-here"))
    assert pv.portable(f"{tmp_path}/models-here/a.gguf") == "$EPIKV_CACHE_DIR/a.gguf"
    monkeypatch.setenv("EPIKV_CACHE_DIR", "cache")  # relative: never matched inside a text
    assert pv.portable("my cache/x and cache/y") == "my cache/x and cache/y"
    monkeypatch.delenv("EPIKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pv.portable(f"{tmp_path}/xdg/epikv-local/models/m.gguf") == "$XDG_CACHE_HOME/epikv-local/models/m.gguf"
    monkeypatch.setattr(sys, "executable", "")
    assert pv.portable("a.b.c") == "a.b.c"
    assert pv.portable("python scripts/y.py --budgets 1,2") == "python scripts/y.py --budgets 1,2"


def test_command_line_and_fingerprint_are_portable(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(pv.REPO / "scripts" / "x.py"), "--out", str(pv.REPO / "results")])
    line = pv.command_line()
    assert line.endswith("scripts/x.py --out results") and str(pv.REPO) + "/" not in line, line
    inside = pv.REPO / "pyproject.toml"
    fp = pv.model_fingerprint(inside)
    assert fp["path"] == "pyproject.toml" and fp["size_bytes"] == inside.stat().st_size and json.dumps(fp)


def test_committed_results_name_no_machine_path():
    """No committed result file names this checkout, its shared data, the home folder, or the folders of this
    workplace's machines (/work/, /root/): a path of the machine a result ran on."""
    results = Path(pv.REPO) / "results"
    bad = []
    for p in sorted(results.glob("*.json*")):
        text = p.read_text(encoding="utf-8")
        for machine_path in (str(pv.REPO) + "/", str(pv.REPO.parent / "shared") + "/", str(Path.home()) + "/",
                             "/work/", "/root/"):
            if machine_path in text:
                bad.append(f"{p.name}: {machine_path}")
    assert not bad, bad
