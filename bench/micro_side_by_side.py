"""Movement micro-benchmarks timed side by side in one process: eager, torch.compile and vtc (plan="all").

Like ``bench.gemm_side_by_side``: every system runs once per round, round after round, so each sees the
same load on a shared machine; the line per workload gives the median per system and the ratios to vtc,
with the load average.  Each vtc result is checked against eager first::

    python -m bench.micro_side_by_side micro_gelu_64mb micro_permute_softmax_64mb [--systems eager,vtc]
    python -m bench.micro_side_by_side micro_gelu_1mb --threads 1 --clock cpu   # CPU time, min and median

With ``--clock cpu`` (one thread: every system runs in the calling thread) the rounds are those of
``bench.gemm_side_by_side.time_side_by_side`` and the figure is the thread's CPU time, which stays put
on a loaded machine where a 2-thread call of a 1 MB kernel waits a scheduler quantum (16 ms instead of
0.1 ms at load 8); the line then gives the min and the median of each system.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

from bench import workloads as W


def side_by_side(name: str, systems: list[str], seconds: float = 3.0, clock: str = "wall") -> dict[str, float]:
    """Median seconds per call of each system on workload `name` (with clock "cpu": {system: (min, median)})."""
    import vtc

    model, inputs = W.get(name).build(False)
    fns = {}
    with torch.no_grad():
        ref = model(*inputs)
        if "eager" in systems:
            fns["eager"] = lambda: model(*inputs)
        if "inductor" in systems:
            ci = torch.compile(model)
            ci(*inputs)
            fns["inductor"] = lambda: ci(*inputs)
        if "vtc" in systems:
            cv = vtc.compile(model, inputs, plan="all")
            torch.testing.assert_close(cv(*inputs), ref, rtol=1e-4, atol=1e-4)
            fns["vtc"] = lambda: cv(*inputs)
        if clock == "cpu":
            from bench.gemm_side_by_side import time_side_by_side

            t = time_side_by_side(fns, 21, time.thread_time)
            return {k: (v["min_ms"] / 1e3, v["median_ms"] / 1e3) for k, v in t.items()}
        for f in fns.values():
            f()
            f()
        one = max(_timed(f, 1) for f in fns.values())
        rounds = max(5, min(30, int(seconds / max(one, 1e-5))))
        inner = 1 if one > 1e-3 else 20
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                times[k].append(_timed(f, inner))
    return {k: statistics.median(v) for k, v in times.items()}


def _timed(f, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        out = f()
        del out
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workloads", nargs="+")
    p.add_argument("--systems", default="eager,inductor,vtc")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error(f"--clock cpu measures the calling thread only: it needs --threads 1, not {args.threads}")
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    for name in args.workloads:
        med = side_by_side(name, args.systems.split(","), clock=args.clock)
        if args.clock == "cpu":
            line = " ".join(f"{k} {lo * 1e3:.3f}/{m * 1e3:.3f}" for k, (lo, m) in med.items())
            ratios = " ".join(f"{k}/vtc {med[k][1] / med['vtc'][1]:.2f}x" for k in med if k != "vtc") if "vtc" in med else ""
            print(f"{name}: cpu ms min/median {line} | median {ratios}  load {os.getloadavg()[0]:.2f}", flush=True)
            continue
        line = " ".join(f"{k} {v * 1e3:.3f}" for k, v in med.items())
        ratios = " ".join(f"{k}/vtc {med[k] / med['vtc']:.2f}x" for k in med if k != "vtc") if "vtc" in med else ""
        print(f"{name}: {line} ms | {ratios}  load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
