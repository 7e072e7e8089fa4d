"""The package's layers and their import rules, checked on the source (every import, also inside functions).

engine/ (native, handles, capture, selection, budget, session), policies/ (scorers only), api/ (front doors)
and errors.py are the product: they never import eval/ (the research harness). A policy never imports the
engine or the front doors; the engine never imports the front doors; the scoring math is numpy only.
``epikv_local/cli.py`` is the composition root that wires both sides' subcommands.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "epikv_local"
STDLIB = set(sys.stdlib_module_names)


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of every module imported anywhere in the file."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)  # "from . import x" imports a module
    return out


MODULES = {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "root"


def test_the_tree_has_the_documented_layers():
    layers = {layer(m) for m in MODULES}
    assert {"engine", "policies", "api", "eval", "errors", "cli"} <= layers
    for sub in ("engine", "policies", "api", "eval"):
        doc = ast.get_docstring(ast.parse((PKG / sub / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{sub}/__init__.py must say what it owns and may import"


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if layer(m) in ("engine", "policies", "api", "errors")))
def test_product_never_imports_eval(mod):
    bad = sorted(i for i in MODULES[mod] if i.startswith("epikv_local.eval"))
    assert not bad, f"{mod} imports the evaluation code: {bad}"


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if layer(m) == "policies"))
def test_policies_never_import_engine_or_front_doors(mod):
    bad = sorted(i for i in MODULES[mod] if i.split(".")[:2] in (["epikv_local", "engine"], ["epikv_local", "api"])
                 or i.split(".")[0] in ("llama_cpp", "cffi", "ctypes"))
    assert not bad, f"{mod} imports {bad}"


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if layer(m) == "engine"))
def test_engine_never_imports_front_doors(mod):
    bad = sorted(i for i in MODULES[mod] if i.startswith("epikv_local.api"))
    assert not bad, f"{mod} imports {bad}"


def test_errors_is_a_leaf_and_scoring_is_numpy_only():
    assert not any(i.startswith("epikv_local") for i in MODULES["epikv_local.errors"])
    third_party = {i.split(".")[0] for i in MODULES["epikv_local.policies.scoring"]} - STDLIB - {"epikv_local"}
    assert third_party == {"numpy"}
    assert {i for i in MODULES["epikv_local.policies.scoring"] if i.startswith("epikv_local")} <= {
        "epikv_local.errors", "epikv_local.errors.ConfigError"}


def test_importing_loads_nothing_native_and_no_eval():
    code = ("import sys, epikv_local, epikv_local.engine.session, epikv_local.api.generation, epikv_local.policies;"
            "bad = [m for m in sys.modules if m.startswith(('llama_cpp', 'epikv_local.eval', 'matplotlib'))];"
            "print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_lazy_exports_return_the_object_they_name():
    code = ("import epikv_local as ek; ek.generate; import epikv_local.api.generation;"
            "print(callable(ek.generate), ek.generate.__module__, ek.Session.__name__, ek.EpikvError.__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "epikv_local.api.generation", "Session", "EpikvError"]


def test_every_package_error_derives_from_epikv_error():
    import epikv_local.errors as errors

    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert len(classes) >= 8
    assert all(issubclass(c, errors.EpikvError) for c in classes)


def _attribute_uses(path: Path) -> list[ast.Attribute]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)]


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if layer(m) != "engine"))
def test_only_the_engine_calls_llama_samplers_and_imports_cffi(mod):
    path = PKG.parent / (mod.replace(".", "/") + ("/__init__.py" if (PKG.parent / mod.replace(".", "/")).is_dir()
                                                   else ".py"))
    samplers = sorted({a.attr for a in _attribute_uses(path) if a.attr.startswith("llama_sampler_")})
    assert not samplers, f"{mod} calls {samplers}: the sampler chain lives in engine/sampling.py"
    cffi = sorted(i for i in MODULES[mod] if i.split(".")[0] == "cffi")
    assert not cffi, f"{mod} imports cffi: native bindings live in engine/native.py"


#: the engine's objects, reached from outside the engine through these attribute names
ENGINE_OBJECTS = ("engine", "ctx", "capture", "_session", "session")


@pytest.mark.parametrize("mod", sorted(m for m in MODULES if layer(m) != "engine"))
def test_nothing_outside_the_engine_touches_its_private_attributes(mod):
    """``x.engine._alive``, ``session._lock``, ``llm._session.ctx._handle``...: a private name read through an
    engine object is refused outside engine/ (a module's own ``self._x`` is its business), and so is a
    Session's eviction engine or capture (``session.engine``, ``session.capture``): callers use its methods."""
    path = PKG.parent / (mod.replace(".", "/") + ("/__init__.py" if (PKG.parent / mod.replace(".", "/")).is_dir()
                                                   else ".py"))
    bad = []
    for a in _attribute_uses(path):
        inner = a.value
        through = inner.attr if isinstance(inner, ast.Attribute) else inner.id if isinstance(inner, ast.Name) else ""
        private = a.attr.startswith("_") and not a.attr.startswith("__") and through in ENGINE_OBJECTS
        internal = a.attr in ("engine", "capture") and through in ("session", "_session")  # a Session's parts
        if private or internal:
            bad.append(f"{through}.{a.attr} (line {a.lineno})")
    assert not bad, f"{mod} reaches into the engine's private state: {bad}"
