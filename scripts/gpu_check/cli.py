"""The command line: every option of ``scripts/gpu_check.sh`` / ``python scripts/gpu_check`` (``--help`` lists
them), checked, then ``--prepare`` (bundle) or the run (``--mode cpu|gpu``)."""

from __future__ import annotations

import argparse
import os

from . import __doc__ as PACKAGE_DOC
from .bundle import prepare
from .common import BUNDLE, ROOT, WORK
from .run import run_check


def main(argv=None) -> int:
    """Parse argv (default: sys.argv[1:]) and run; returns the exit status."""
    ap = argparse.ArgumentParser(prog="gpu_check", description=PACKAGE_DOC.splitlines()[0])
    ap.add_argument("--prepare", action="store_true", help="build the travel bundle (here, before a device run)")
    ap.add_argument("--mode", choices=("cpu", "gpu"), help="run the check: cpu (here, CI) or gpu (on the device)")
    ap.add_argument("--out", default=None, help="folder of gpu_check.json (default: $OUT, else build/gpu_check_out)")
    ap.add_argument("--bundle", default=str(BUNDLE), help="travel bundle folder (default: build/gpu_bundle)")
    ap.add_argument("--work", default=str(WORK), help="gpu mode: unpack/build/model folder (default: build/gpu_run)")
    ap.add_argument("--max-bundle-mib", type=float, default=60.0, help="--prepare fails above this size (60)")
    ap.add_argument("--contexts", default=None, help="comma-separated (gpu 4096,16384,32768; cpu 256,512,1024)")
    ap.add_argument("--budget", type=int, default=None, help="KV budget of epikv/streaming/h2o (gpu 2048, cpu 128)")
    ap.add_argument("--batch", type=int, default=None, help="n_batch = ubatch of the prefill (gpu 512, cpu 32)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="greedy tokens per checkpoint (gpu 32, cpu 16)")
    ap.add_argument("--max-context", type=int, default=None, help="end of the longest-context search (262144, 4096)")
    ap.add_argument("--variant-cap-s", type=float, default=None, help="time cap per variant (gpu 40, cpu 4)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="the whole run, from gpu_check.sh's start (gpu 480, cpu 240); the variant caps shrink to fit")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp CPU threads (gpu: the package's default; "
                    "cpu: 1)")
    ap.add_argument("--ftype", choices=("q4_0", "q4_k_m", "q8_0", "f16"), default=None,
                    help="benchmark model type (q4_k_m)")
    ap.add_argument("--model", default=None, help="use this GGUF as the benchmark model instead of making one")
    ap.add_argument("--vocab-from", default=None, help="cpu mode: tokenizer GGUF of the random model (SmolLM2's)")
    ap.add_argument("--lib-dir", default=None, help="cpu mode: patched libraries to use (default: the installed ones)")
    ap.add_argument("--keep-model", action="store_true", help="cpu mode: keep the random model under --out")
    ap.add_argument("--jobs", type=int, default=None, help="gpu mode: build jobs (default: all cores)")
    ap.add_argument("--cmake-arg", action="append", metavar="-DNAME=VALUE",
                    help="gpu mode: one more CMake configure argument (repeatable), e.g. -DCUDAToolkit_ROOT=...")
    ap.add_argument("--no-cuda", dest="cuda", action="store_false",
                    help="gpu mode without CUDA, with --build-only: test the bootstrap and build on a CPU machine")
    ap.add_argument("--build-only", action="store_true", help="gpu mode: stop after the build")
    ap.add_argument("--no-native-pytest", action="store_true", help="gpu mode: skip tests/engine/test_native.py")
    args = ap.parse_args(argv)
    if args.prepare == bool(args.mode):
        ap.error("give exactly one of --prepare and --mode cpu|gpu")
    if args.prepare:
        return prepare(args)
    if args.mode == "gpu" and not args.cuda and not args.build_only:
        ap.error("--no-cuda only tests the bootstrap: add --build-only (nothing is measured without a GPU)")
    if args.mode == "cpu" and (args.build_only or not args.cuda):
        ap.error("--build-only and --no-cuda belong to --mode gpu")
    if args.out is None:
        args.out = os.environ.get("OUT") or str(ROOT / "build" / "gpu_check_out")
    return run_check(args)
