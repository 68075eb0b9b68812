"""Streaming stores off, always and by the cache rule (``vtc.codegen.stream``), eager and Inductor alongside, in one process.

    PYTHONPATH=$PWD python -m bench.stream_side_by_side micro_roll_add_8mb micro_cat_relu_1mb [--rounds 15] [--no-inductor]
    PYTHONPATH=$PWD python -m bench.stream_side_by_side micro_cat_relu_8mb --threads 1 --clock cpu   # CPU time

Each workload is compiled by vtc three times (``plan="all"``): ``vtc-off`` with streaming stores off
(``STREAM_STORES``), ``vtc-on`` with every output of ``STREAM_MIN_BYTES`` or more streamed whatever the
cache (``CACHE_BYTES = 0``: the rule before 2026-11-30), ``vtc`` with the default rule (streamed when the
kernel's working set is larger than the last-level cache), each checked against eager; then eager,
Inductor and the three run round after round (``bench.gemm_side_by_side.time_side_by_side``), with
``--threads`` threads (2 by default) and wall time, or the calling thread's CPU time (``--clock cpu``,
with ``--threads 1`` only).  The line per workload: median/min per system in ms, and eager/vtc,
inductor/vtc for each vtc variant (> 1: vtc faster).
"""
from __future__ import annotations

import argparse
import os
import warnings

import torch

from bench import workloads as W
from bench.gemm_side_by_side import CLOCKS, time_side_by_side


def measure(name: str, rounds: int, inductor: bool, clock=CLOCKS["wall"]) -> dict[str, dict]:
    """{system: {"median_ms", "min_ms", ...}} for eager, (inductor,) vtc-off and vtc-on on workload `name`."""
    import vtc
    from vtc.codegen import stream
    from vtc.codegen.stream import STREAM_STORES

    torch._dynamo.reset()
    model, inputs = W.get(name).build(False)
    with torch.no_grad():
        ref = model(*inputs)
        fns = {"eager": lambda: model(*inputs)}
        if inductor:
            ci = torch.compile(model)
            ci(*inputs)
            fns["inductor"] = lambda: ci(*inputs)
        for label, on, cache in (("vtc-off", False, None), ("vtc-on", True, 0), ("vtc", True, None)):
            token, saved = STREAM_STORES.set(on), stream.CACHE_BYTES
            stream.CACHE_BYTES = cache
            try:
                compiled = vtc.compile(model, inputs, plan="all")
            finally:
                STREAM_STORES.reset(token)
                stream.CACHE_BYTES = saved
            torch.testing.assert_close(compiled(*inputs), ref, rtol=1e-4, atol=1e-4)
            fns[label] = (lambda c: lambda: c(*inputs))(compiled)
        return time_side_by_side(fns, rounds, clock)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workloads", nargs="+")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time, or the calling thread's CPU time (with --threads 1 only)")
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error(f"--clock cpu measures the calling thread only: it needs --threads 1, not {args.threads}")
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    for name in args.workloads:
        t = measure(name, args.rounds, not args.no_inductor, CLOCKS[args.clock])
        med = {k: v["median_ms"] for k, v in t.items()}
        ratios = " | ".join(f"{v}: " + ", ".join(f"{med[k] / med[v]:.2f}x" for k in ("eager", "inductor") if k in med)
                            for v in ("vtc-off", "vtc-on", "vtc"))
        print(f"{name}: " + " ".join(f"{k} {v['median_ms']:.3f}/{v['min_ms']:.3f}" for k, v in t.items())
              + f" ms | {ratios} | load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
