"""The random-weight models (``scripts/make_random_model.py``): their command lines, the environment of the
child processes, and ``Models``, which makes them -- in the background on the GPU machine, in one go here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from .common import ROOT, SCRIPTS, CheckError, log, run_cmd, tail
from .presets import Shape

if TYPE_CHECKING:
    from .build import Bootstrap
    from .run import Run


def model_cmd(shape: Shape, out: Path, vocab: Path | None, ftype: str, context_length: int) -> list[str]:
    cmd = [sys.executable, str(SCRIPTS / "make_random_model.py"), "--out", str(out), "--layers", str(shape.layers),
           "--embd", str(shape.embd), "--n-head", str(shape.n_head), "--n-head-kv", str(shape.n_head_kv),
           "--n-ff", str(shape.n_ff), "--ftype", ftype, "--no-check", "--context-length", str(context_length)]
    return cmd + (["--vocab-from", str(vocab)] if vocab is not None else [])


def child_env(boot: Bootstrap | None, lib_dir: Path | None) -> dict:
    """Environment of the child processes (model writers, quantizer, pytest): this tree and the bundle's
    packages on PYTHONPATH (nothing is installed on the GPU machine), the built libraries in EPIKV_LIB_DIR."""
    env = dict(os.environ)
    paths = [str(ROOT), str(SCRIPTS)] + ([str(d) for d in boot.site_dirs] if boot else [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if lib_dir is not None:
        env["EPIKV_LIB_DIR"] = str(lib_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# a child process, so that quantizing the benchmark model runs beside the native checks (no shared GIL)
QUANTIZE_PY = ("import sys; from pathlib import Path; import make_random_model as m; "
               "m.quantize(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))")


class Models:
    """The random models, made with make_random_model.py. On the GPU machine each F16 file is written by a
    background process while the library builds (pure numpy), then quantized by the patched build's quantizer
    (``make_random_model.quantize``, in a subprocess) in the background while the native checks run."""

    def __init__(self, run: Run, folder: Path, vocab: Path | None, env: dict, log_dir: Path):
        self.run, self.folder, self.vocab, self.env, self.log_dir = run, folder, vocab, env, log_dir
        self.f16: dict[str, tuple] = {}  # what -> (shape, final path, f16 path, writer process)
        self.jobs: dict[str, tuple] = {}  # what -> (thread, result dict)
        self.procs: list[subprocess.Popen] = []

    def path(self, what: str, shape: Shape) -> Path:
        return self.folder / f"{what}-{shape.layers}L-{shape.embd}-{shape.ftype}.gguf"

    def start_f16(self, what: str, shape: Shape, out: Path, context_length: int) -> None:
        if out.is_file():
            return
        f16 = out.with_name(out.stem + "-f16.gguf")
        f16.unlink(missing_ok=True)
        cmd = model_cmd(shape, f16, self.vocab, "f16", context_length)
        self.run.report["commands"][f"{what}_f16"] = " ".join(cmd)
        with open(self.log_dir / f"{what}_f16.log", "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append(proc)
        self.f16[what] = (shape, out, f16, proc)
        log(f"{what}: writing its F16 file in the background ({shape.layers} layers, n_embd {shape.embd})")

    def start_quantize(self, what: str) -> None:
        """Once the library is built: wait for the F16 writer, then quantize, in the background."""
        if what not in self.f16 or what in self.jobs:
            return
        import threading

        shape, out, f16, writer = self.f16.pop(what)
        threads = os.cpu_count() or 4
        cmd = [sys.executable, "-c", QUANTIZE_PY, str(f16), str(out), shape.ftype, str(threads)]
        self.run.report["commands"][f"{what}_quantize"] = (f"make_random_model.quantize({f16.name}, {out.name}, "
                                                           f"{shape.ftype!r}, {threads})")
        result: dict = {}

        def work():
            t0 = time.time()
            if writer.wait() != 0 or not f16.is_file():
                result["error"] = f"writing the {what} failed:\n{tail(self.log_dir / f'{what}_f16.log', 10)}"
                return
            result["f16_done_after_s"] = round(time.time() - self.run.t_origin, 1)
            t1 = time.time()
            with open(self.log_dir / f"{what}_quantize.log", "w") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env)
                self.procs.append(proc)
                rc = proc.wait()
            f16.unlink(missing_ok=True)
            if rc != 0 or not out.is_file():
                result["error"] = f"quantizing the {what} failed:\n{tail(self.log_dir / f'{what}_quantize.log', 10)}"
            result.update(quantize_seconds=round(time.time() - t1, 1), waited_for_f16_s=round(t1 - t0, 1))

        th = threading.Thread(target=work, name=f"quantize-{what}", daemon=True)
        th.start()
        self.jobs[what] = (th, result)
        log(f"{what}: quantizing to {shape.ftype} in the background once its F16 file is written")

    def finish(self, what: str, shape: Shape, out: Path, context_length: int) -> dict:
        """The model at ``out``: wait for its background job, or make it now in one go."""
        t0 = time.perf_counter()
        info: dict = {}
        self.start_quantize(what)
        if what in self.jobs:
            th, result = self.jobs.pop(what)
            th.join()
            if "error" in result:
                raise CheckError(result["error"])
            info.update(result)
            log(f"{what}: ready ({shape.ftype}, quantized in {result['quantize_seconds']} s)")
        elif not out.is_file():
            cmd = model_cmd(shape, out, self.vocab, shape.ftype, context_length)
            self.run.report["commands"][what] = " ".join(cmd)
            if run_cmd(cmd, self.log_dir / "model.log", self.env).returncode != 0 or not out.is_file():
                raise CheckError(f"make_random_model.py failed:\n{tail(self.log_dir / 'model.log', 10)}")
        else:
            log(f"{what}: {out.name} is already there")
        return {"path": str(out), "shape": asdict(shape), "bytes": out.stat().st_size,
                "vocab_from": str(self.vocab) if self.vocab else "the default model's tokenizer (SmolLM2-135M, 49152)",
                "waited_s": round(time.perf_counter() - t0, 1), **info}

    def stop(self) -> None:
        """End the background processes (a run that failed or was cut short) and drop half-written files."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        for th, _ in self.jobs.values():
            th.join(timeout=10)
        for _, _, f16, _ in self.f16.values():
            f16.unlink(missing_ok=True)
        for f16 in self.folder.glob("*-f16.gguf"):
            f16.unlink(missing_ok=True)
