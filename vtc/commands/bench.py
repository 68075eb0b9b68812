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
    add_run_arguments(b)
    b.set_defaults(func=bench)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `vtc bench` (also those of `python -m bench.harness`)."""
    p.add_argument("--quick", action="store_true", help="few small workloads, 5 runs, no memory probes (< 3 min)")
    p.add_argument("--workloads", metavar="A,B",
                   help="workload names, globs, groups (unit, model, attention, micro) or 'all' (see --list)")
    p.add_argument("--systems", metavar="X,Y", help="systems (see --list; 'vtc' = every vtc variant)")
    p.add_argument("--out", metavar="DIR", help="where the JSON (and, for non-default runs, the report) goes")
    p.add_argument("--markdown", metavar="FILE", help="where to write the markdown report")
    p.add_argument("--runs", type=int, help="timed runs per system (default 20, quick 5)")
    p.add_argument("--threads", type=int, help="threads for every system (default: all cores)")
    p.add_argument("--no-memory", dest="memory", action="store_const", const=False, default=None,
                   help="skip the per-process memory probes")
    p.add_argument("--memory", dest="memory", action="store_const", const=True,
                   help="memory probes for every group (also in --quick; default: units and models, not in --quick)")
    p.add_argument("--memory-groups", metavar="G,H", help="memory probes for these groups only (unit, model, attention, micro)")
    p.add_argument("--memory-systems", metavar="X,Y", help="memory probes for these systems only (default: all)")
    p.add_argument("--list", action="store_true", help="list the workloads and systems and exit")


def bench(args: argparse.Namespace) -> int:
    """Runs the suite with the parsed options; returns 0 when it ran."""
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
    if getattr(args, "memory_groups", None):
        parts.append(f"--memory-groups {args.memory_groups}")
    if getattr(args, "memory_systems", None):
        parts.append(f"--memory-systems {args.memory_systems}")
    elif args.memory is not None:
        parts.append("--memory" if args.memory else "--no-memory")
    return " ".join(parts)
