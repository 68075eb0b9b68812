"""Streaming stores on and off (``vtc.codegen.stream.STREAM_STORES``), eager and Inductor alongside, in one process.

    PYTHONPATH=$PWD python -m bench.stream_side_by_side micro_roll_add_8mb micro_cat_relu_1mb [--rounds 15] [--no-inductor]

Each workload is compiled by vtc twice (``plan="all"``), once with streaming stores off and once on (the
default), both checked against eager; then eager, Inductor, vtc-off and vtc-on run round after round
(``bench.gemm_side_by_side.time_side_by_side``), 1 thread, CPU time of the calling thread.  The line per
workload: median/min per system in ms, and eager/vtc, inductor/vtc for each vtc variant (> 1: vtc faster).
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

from bench import workloads as W
from bench.gemm_side_by_side import time_side_by_side


def measure(name: str, rounds: int, inductor: bool) -> dict[str, dict]:
    """{system: {"median_ms", "min_ms", ...}} for eager, (inductor,) vtc-off and vtc-on on workload `name`."""
    import vtc
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
        for label, on in (("vtc-off", False), ("vtc-on", True)):
            token = STREAM_STORES.set(on)
            try:
                compiled = vtc.compile(model, inputs, plan="all")
            finally:
                STREAM_STORES.reset(token)
            torch.testing.assert_close(compiled(*inputs), ref, rtol=1e-4, atol=1e-4)
            fns[label] = (lambda c: lambda: c(*inputs))(compiled)
        return time_side_by_side(fns, rounds, time.thread_time)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workloads", nargs="+")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--no-inductor", action="store_true")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    for name in args.workloads:
        t = measure(name, args.rounds, not args.no_inductor)
        med = {k: v["median_ms"] for k, v in t.items()}
        ratios = " | ".join(f"{v}: " + ", ".join(f"{med[k] / med[v]:.2f}x" for k in ("eager", "inductor") if k in med)
                            for v in ("vtc-off", "vtc-on"))
        print(f"{name}: " + " ".join(f"{k} {v['median_ms']:.3f}/{v['min_ms']:.3f}" for k, v in t.items())
              + f" ms | {ratios} | load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
