"""``vtc bench``: the benchmark suite (issue 6), run from the repository's ``bench/`` directory.

The harness and the workloads live outside the package, in ``bench/`` at the
repository root (``Path(vtc.__file__).resolve().parents[1] / "bench"``), so
this command works from a source checkout (an editable install) and says so
clearly when vtc is installed without the repository.  Everything else is in
``bench/harness.py`` (measuring) and ``bench/report.py`` (BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path


def bench_dir() -> Path:
    """The repository's bench/ directory (next to the vtc package)."""
    import vtc

    return Path(vtc.__file__).resolve().parents[1] / "bench"


def load_harness():
    """Imports bench.harness from the repository; RuntimeError when there is no checkout."""
    d = bench_dir()
    if not (d / "harness.py").is_file():
        raise RuntimeError(f"vtc bench needs the vtc source repository: no bench/harness.py at {d}. "
                           "Install vtc from a checkout (pip install -e '.[bench]') and run it there.")
    root = str(d.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    mod = sys.modules.get("bench")
    if mod is not None and Path(getattr(mod, "__file__", "") or "").resolve().parent != d.resolve():
        raise RuntimeError(f"another module named 'bench' is already imported ({getattr(mod, '__file__', mod)}); "
                           f"vtc bench needs {d}")
    harness = importlib.import_module("bench.harness")
    if Path(harness.__file__).resolve().parent != d.resolve():
        raise RuntimeError(f"'bench' resolved to {harness.__file__}, not {d}: another package named 'bench' "
                           "shadows the repository's")
    return harness


def register(sub) -> None:
    """Adds the `bench` subcommand."""
    b = sub.add_parser("bench", help="benchmark vtc against eager, Inductor, ONNX Runtime and OpenVINO",
                       description="Runs the benchmark suite in bench/ and writes bench/results/<host>-<date>.json "
                                   "and BENCHMARKS.md.")
    # the options are defined by the harness; added lazily so `vtc --help` needs no bench/ import
    _add_arguments(b)
    b.set_defaults(func=bench)


def _add_arguments(b: argparse.ArgumentParser) -> None:
    try:
        load_harness().add_run_arguments(b)
    except RuntimeError as e:  # no checkout: keep the command so that it can say why
        b.set_defaults(_bench_error=str(e))
        b.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def bench(args: argparse.Namespace) -> int:
    """Runs the suite with the parsed options; returns 0 when it ran."""
    if getattr(args, "_bench_error", None):
        raise RuntimeError(args._bench_error)
    harness = load_harness()
    command = "vtc bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    harness.run_from_args(args, command=command or _command_from(args))
    return 0


def _command_from(args: argparse.Namespace) -> str:
    parts = ["vtc bench"]
    if args.quick:
        parts.append("--quick")
    for opt in ("workloads", "systems", "out", "markdown", "runs", "threads"):
        v = getattr(args, opt, None)
        if v is not None:
            parts.append(f"--{opt} {v}")
    if args.memory is not None:
        parts.append("--memory" if args.memory else "--no-memory")
    return " ".join(parts)
