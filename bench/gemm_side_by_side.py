"""GEMM workloads timed side by side in one process, interleaved, reporting min and median per system.

The harness (``vtc bench --workloads gemm``) times one system after the other and reports medians; on a
shared, loaded machine those swing by 10x (a 2-thread call that loses its core waits a scheduler quantum).
This script runs every system once per round, round after round, so each sees the same load, and records
the minimum (the undisturbed time) next to the median::

    python -m bench.gemm_side_by_side [--workloads gemm] [--threads 2] [--rounds 15] [--out DIR]
    python -m bench.gemm_side_by_side --threads 1 --clock cpu   # CPU time of the calling thread

With ``--clock cpu`` (one thread only: every system then runs in the calling thread) the time is the
thread's CPU time, which does not count the time the thread waited for a core: on a machine shared with
other jobs it is the figure that stays put while wall times swing.

Systems: eager (torch.matmul: MKL/oneDNN), onnxruntime (MLAS), vtc-all (gemm="auto"), vtc-gemm-vtc (every
GEMM generated), vtc-gemm-torch (every GEMM through torch, non-strided operands copied first); ``--systems``
picks some (and may add openvino).

``--workloads sweep`` (or ``sweep_sq*``, ``sweep_rect*``, ``sweep_skinny*``, ``swin_*``: globs over the grid) takes
the issue-4 grid defined here instead of the registry's: contiguous float32 ``M x K @ K x N`` with both operands
runtime inputs (``sweep_*_rt_m<M>_k<K>_n<N>``) and ``x @ W^T`` of an ``nn.Linear(K, N)`` (B a constant weight,
``sweep_*_lin_m<M>_k<K>_n<N>``): every square 64 .. 2048, rectangular cells of M, N, K in {64 .. 2048}, the
skinny rows of decoding (M = 1 .. 16 against 1024 / 4096-wide weights) and swin_t's Linear layers (``swin_*``,
M = 3136 / 784 / 196 / 49 rows).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

from bench import workloads as W
from bench.harness import SETTLE_S
from bench.systems import PREPARE, Context, SystemFailure

SYSTEMS = ("eager", "onnxruntime", "vtc-all", "vtc-gemm-vtc", "vtc-gemm-torch")
SWEEP_SIZES = (64, 128, 256, 512, 1024, 2048)
# rectangular (M, K, N): each of the three long / short in turn, the 256-row and 2048-row prefill-like cells
SWEEP_RECT = [(64, 2048, 2048), (2048, 64, 2048), (2048, 2048, 64), (128, 1024, 512), (512, 128, 1024),
              (1024, 512, 128), (256, 2048, 1024), (1024, 256, 2048), (2048, 1024, 256), (64, 512, 2048),
              (2048, 128, 512), (512, 2048, 128), (1024, 2048, 512), (256, 64, 1024)]
SWEEP_SKINNY = [(m, k, n) for m in (1, 2, 4, 8, 16) for k, n in ((1024, 1024), (4096, 4096), (1024, 4096), (4096, 1024))]
# swin_t's nn.Linear layers at batch 1 (rows = tokens of the stage: 56^2, 28^2, 14^2, 7^2): qkv (C -> 3C), proj
# (C -> C), MLP (C -> 4C -> C), patch merging (4C -> 2C)
SWIN = [(rows, k, n) for rows, c in ((3136, 96), (784, 192), (196, 384), (49, 768))
        for k, n in ((c, 3 * c), (c, c), (c, 4 * c), (4 * c, c))] + [(784, 384, 192), (196, 768, 384), (49, 1536, 768)]


def sweep_workloads() -> list:
    """The sweep grid as Workloads (runtime operands and a constant weight for every (M, K, N))."""
    from torch import nn

    from bench.workloads import Workload, randn
    from bench.workloads.micro import Fn

    def rt(m, k, n):
        return lambda quick: (Fn(lambda _, a, b: a @ b, f"mm_{m}_{k}_{n}"), (randn(m, k, seed=1), randn(k, n, seed=2)))

    def lin(m, k, n):
        return lambda quick: (nn.Linear(k, n, bias=False), (randn(m, k, seed=3),))

    cells = ([("sq", s, s, s) for s in SWEEP_SIZES] + [("rect", *c) for c in SWEEP_RECT]
             + [("skinny", *c) for c in SWEEP_SKINNY] + [("swin", *c) for c in SWIN])
    out = []
    for kind, m, k, n in cells:
        for form, build, what in (("rt", rt, "a @ b, both runtime inputs"), ("lin", lin, "x @ W^T, W a constant")):
            name = f"{kind}_{form}_m{m}_k{k}_n{n}" if kind == "swin" else f"sweep_{kind}_{form}_m{m}_k{k}_n{n}"
            out.append(Workload(name, "gemm", f"{what}: {m} x {k} @ {k} x {n}", build(m, k, n), default=False,
                                params=dict(m=m, n=n, k=k)))
    return out


def select(spec: str) -> list:
    """Workloads for a comma list: registry names / globs / groups, or globs over the sweep grid."""
    import fnmatch

    grid = sweep_workloads()
    out, rest = [], []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        hits = [w for w in grid if item == "sweep" and w.name.startswith("sweep_") or fnmatch.fnmatchcase(w.name, item)]
        if hits:
            out += [w for w in hits if w not in out]
        else:
            rest.append(item)
    return out + (W.select(",".join(rest)) if rest else [])
MIN_ROUND_S = 0.02  # each system's calls per round last at least this long (small GEMMs repeat)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def time_side_by_side(fns: dict, rounds: int, clock=time.perf_counter) -> dict:
    """{system: {"min_ms", "median_ms", "calls_per_round"}} from interleaved rounds (each opened by a pause and an
    untimed call)."""
    reps = {}
    for name, fn in fns.items():
        fn(); fn()
        t0 = time.perf_counter()
        fn()
        reps[name] = max(1, int(MIN_ROUND_S / max(time.perf_counter() - t0, 1e-7)))
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(SETTLE_S)  # the previous system's spinning threads go idle (bench/harness.py, step 3)
            fn()
            t0 = clock()
            for _ in range(reps[name]):
                fn()
            samples[name].append((clock() - t0) / reps[name] * 1e3)
    return {n: {"min_ms": min(s), "median_ms": statistics.median(s), "calls_per_round": reps[n]}
            for n, s in samples.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="gemm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list (of " + ", ".join(SYSTEMS)
                   + ", openvino)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time, or the calling thread's CPU time (with --threads 1 only)")
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error(f"--clock cpu measures the calling thread only: it needs --threads 1, not {args.threads}")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in select(args.workloads):
            model, inputs = w.build()
            ctx = Context(w.name, model, inputs, args.threads, Path(tmp))
            fns, failed = {}, {}
            for s in args.systems.split(","):
                try:
                    fns[s] = PREPARE[s](ctx).fn
                except SystemFailure as e:
                    failed[s] = e.reason
                except Exception as e:  # e.g. ONNX Runtime has no CPU MatMul for bf16
                    failed[s] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            with torch.no_grad():
                times = time_side_by_side(fns, args.rounds, CLOCKS[args.clock])
            best_lib = min(times[s]["min_ms"] for s in ("eager", "onnxruntime") if s in times)
            row = {"workload": w.name, "desc": w.desc, "params": w.params, "times": times, "failed": failed,
                   "vtc_all_vs_best_library": best_lib / times["vtc-all"]["min_ms"] if "vtc-all" in times else None,
                   "vtc_gemm_vs_best_library": best_lib / times["vtc-gemm-vtc"]["min_ms"]
                   if "vtc-gemm-vtc" in times else None,
                   "vtc_gemm_vs_copy_plus_torch": times["vtc-gemm-torch"]["min_ms"] / times["vtc-gemm-vtc"]["min_ms"]
                   if "vtc-gemm-torch" in times and "vtc-gemm-vtc" in times else None}  # bf16 virtual operands: no bf16 copy kernel
            results.append(row)
            ratios = ", ".join(f"{k} x{row[v]:.2f}" for k, v in (("vtc-all", "vtc_all_vs_best_library"),
                                                                 ("vtc-gemm", "vtc_gemm_vs_best_library")) if row[v])
            print(f"{w.name:<20} " + "  ".join(f"{s} {t['min_ms']:.3f}/{t['median_ms']:.3f}" for s, t in times.items())
                  + f"  | {ratios} of the best library (min ms/median ms)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gemm-side-by-side-{socket.gethostname()}-{datetime.now():%Y-%m-%d-%H%M%S}.json"
    data = {"command": "python -m bench.gemm_side_by_side " + " ".join(sys.argv[1:] if argv is None else argv), "threads": args.threads,
            "clock": args.clock,
            "rounds": args.rounds, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "cpu_count": os.cpu_count(), "results": results}
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}; load average before {load_before}, after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
