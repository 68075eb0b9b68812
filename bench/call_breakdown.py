"""Where the fixed cost of one call of a one-kernel model goes, piece by piece (docs/call_cost.md).

    PYTHONPATH=$PWD python -m bench.call_breakdown [micro_cat_relu_1mb | sweep_sq_rt_m64_k64_n64 | ...] [--calls 20000]

The workload is compiled twice, one copy with its kernel swapped for an empty C
function (``bench.call_overhead.nop_kernel``); then, 1 thread, the calling
thread's CPU time, the best of 7 repeats of `--calls` calls each, in one process:
the whole call with the real kernel and with the empty one, and each thing the
fast call (``vtc.runtime.callplan.fast_call``) does, alone: the input test, the
output's allocation (the pool's allocator; the old ways of making the tensor for
comparison), reading the addresses, packing them, the ctypes call; where the model has
parameters, the fast call made without the parameter watch (``vtc.runtime.weights``) and the
watch's test alone.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
import timeit
import warnings

import torch


def per_call_us(stmt, calls: int, env: dict) -> float:
    """The best of 7 repeats of `calls` calls of stmt (a string run in env), microseconds per call."""
    return min(timeit.repeat(stmt, number=calls, repeat=7, globals=env, timer=time.thread_time)) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", nargs="?", default="micro_cat_relu_1mb")
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from bench.call_overhead import compiled_pair, nop_kernel
    from vtc.runtime import buffers
    from vtc.runtime.callplan import _allocator, fast_call, pointer_array

    if args.workload.startswith("sweep_"):  # a GEMM of bench.gemm_side_by_side's grid, every GEMM generated
        import vtc
        from bench.gemm_side_by_side import select

        model, inputs = select(args.workload)[0].build(False)
        real, empty = (vtc.compile(model, inputs, gemm="vtc") for _ in range(2))
        for s in empty._first.executor.steps:
            if s.kind == "kernel":
                s.kernel.fn = nop_kernel()
    else:
        real, empty, inputs = compiled_pair(args.workload)
    with torch.no_grad():
        real(*inputs), empty(*inputs)
        plan = empty._first.executor.call_plan()
        out = empty(*inputs)
        shape, dtype, sizes = out.shape, out.dtype, tuple(out.shape)
        del out
        st = torch.empty(shape, dtype=dtype).untyped_storage()
        kept = torch.empty(0, dtype=dtype).set_(st, 0, shape)
        sig = empty._first.exact_signature[0]
        nop = nop_kernel()
        fn = ctypes.CFUNCTYPE(None)(ctypes.cast(nop, ctypes.c_void_p).value)
        n = len(inputs) + 1
        pack = pointer_array(n)
        ptrs = pack(*range(n))
        alloc = _allocator(shape, dtype, plan.pool)  # what the call plan allocates the output with
        alloc()
        watch = getattr(empty, "_watch", None)  # the model's parameters, tested per call (vtc.runtime.weights)
        unwatched = fast_call(plan, sig, None)[0] if watch is not None and empty._first.exact_signature[1] else None
        if unwatched is None:
            watch = None
        env = dict(real=real, empty=empty, watch=watch, unwatched=unwatched, inputs=inputs,
                   fast=getattr(empty, "_fast", None), args=tuple(inputs),
                   torch=torch, shape=shape, dtype=dtype, sizes=sizes, st=st, kept=kept, fn=fn, pack=pack, ptrs=ptrs,
                   alloc=alloc, T=torch.Tensor, sig=sig, n=n)
        rows = [
            ("call, real kernel", "real(*inputs)"),
            ("call, empty kernel", "empty(*inputs)"),
            *([("fast call alone, empty kernel", "fast(args)")] if env["fast"] is not None else []),
            *([("  the same without the parameter watch", "unwatched(args)"),
               (f"  the watch's test alone ({len(watch)} tensors)", "watch.changed()")] if watch is not None else []),
            ("input test (type, dtype, shape, device)",
             "for t, (d, s) in zip(args, sig):\n"
             "    type(t) is not T or t.dtype is not d or t.shape != s or not t.is_cpu"),
            ("inputs' is_contiguous", "for t in args: t.is_contiguous()"),
            ("output: the call plan's allocator", "alloc()"),
            ("output: torch.empty(*sizes)", "torch.empty(*sizes)"),
            ("output: torch.empty(0).set_(storage)", "torch.empty(0, dtype=dtype).set_(st, 0, shape)"),
            ("output: kept tensor's detach()", "kept.detach()"),
            ("addresses (data_ptr per buffer)", "for t in args: t.data_ptr()\nkept.data_ptr()"),
            ("pointer array (struct pack)", "pack(*range(n))"),
            ("ctypes call of an empty kernel", "fn(ptrs, torch.get_num_threads())"),
        ]
        pooled = shape.numel() * dtype.itemsize >= buffers.MIN_BYTES
        print(f"{args.workload}: output {list(shape)} {dtype} ({'pooled' if pooled else 'torch.empty'}), "
              f"{len(inputs)} inputs; 1 thread, CPU time, best of 7 x {args.calls} calls; "
              f"load {os.getloadavg()[0]:.2f}")
        for label, stmt in rows:
            calls = args.calls // 10 if "real" in label else args.calls
            print(f"  {label:42s} {per_call_us(stmt, calls, env):6.2f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
