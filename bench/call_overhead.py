"""vtc's fixed cost per call: a compiled workload whose generated kernels do nothing.

    PYTHONPATH=$PWD python -m bench.call_overhead micro_index_select_sum_1mb,llama3_decode_b1 [--rounds 15]

Each workload is compiled (``plan="all"`` for the micro ones, the default plan
for the others), then every generated kernel's function is swapped for an
empty C function of the same signature (index range checks still run), so a
call's time is everything around the kernels: Python, ctypes, allocating the
outputs, and the torch ops that are not generated (a library GEMM).  Timed
side by side in one process, 1 thread, CPU time of the calling thread
(``bench.gemm_side_by_side.time_side_by_side``):

- ``call``: ``compiled(*inputs)``, the user's call;
- ``plan``: the executor's call plan (``vtc.runtime.callplan``), no input checks;
- ``solo``: the call plan with every kernel called on its own (``VTC_CALL_SEGMENTS=0``: no segments,
  ``vtc.runtime.segment``);
- ``steps``: the same steps one by one through ``Executor.run_step`` (the slower
  reference path);
- ``real``: the user's call with the real kernels, for scale.

A profile, not the benchmark: it says how many microseconds of a call are not kernels.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time
import warnings

import torch

from bench import workloads as W
from bench.gemm_side_by_side import time_side_by_side

_NOP = 'extern "C" void vtc_nop_kernel(void* const* bufs, int nthreads) { (void)bufs; (void)nthreads; }\n'


def nop_kernel():
    """An empty C function with the signature of a generated kernel."""
    from vtc.runtime import cbuild

    fn = cbuild.build(_NOP, name="vtc_nop").vtc_nop_kernel
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int], None
    return fn


def compiled_pair(name: str, copies: int = 1):
    """(compiled with real kernels, compiled whose kernels are empty (`copies` of them), inputs) for workload
    `name`."""
    import vtc

    model, inputs = W.get(name).build(False) if name.startswith("micro") else W.get(name).build()
    options = {"plan": "all"} if name.startswith("micro") else {}
    real = vtc.compile(model, inputs, **options)
    nop = nop_kernel()
    empties = []
    for _ in range(copies):
        empty = vtc.compile(model, inputs, **options)
        for s in empty._first.executor.steps:
            if s.kind == "kernel":
                s.kernel.fn = nop  # before the first call: the call plan takes the function when it is built
        empties.append(empty)
    return (real, *empties, inputs)


def measure(name: str, rounds: int) -> dict[str, float]:
    """{way of calling: (median, min) microseconds per call} (see the module docstring)."""
    from vtc.runtime import segment

    real, empty, solo, inputs = compiled_pair(name, 2)
    ex, solo_ex = empty._first.executor, solo._first.executor
    was, segment.SEGMENTS = segment.SEGMENTS, False
    try:
        solo_ex.call_plan()  # built now, without segments
    finally:
        segment.SEGMENTS = was
    flush = torch.set_flush_denormal(True)  # the empty kernels leave garbage that torch ops read: keep
    with torch.no_grad():                   # denormals from slowing those down
        fns = {"call": lambda: empty(*inputs), "plan": lambda: ex(list(inputs)), "solo": lambda: solo_ex(list(inputs)),
               "steps": lambda: ex.run_steps(list(inputs)), "real": lambda: real(*inputs)}
        times = time_side_by_side(fns, rounds, time.thread_time)
    torch.set_flush_denormal(False) if flush else None
    return {k: (t["median_ms"] * 1e3, t["min_ms"] * 1e3) for k, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workloads", help="comma-separated workload names")
    p.add_argument("--rounds", type=int, default=31)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    for name in args.workloads.split(","):
        us = measure(name, args.rounds)
        print(f"{name}: " + "  ".join(f"{k} {med:.1f}/{low:.1f}" for k, (med, low) in us.items())
              + f" us (median/min; 1 thread, CPU time; load {os.getloadavg()[0]:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
