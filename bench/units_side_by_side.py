"""Units side by side in one process on a busy machine: eager, Inductor, ONNX Runtime and vtc, per call.

    PYTHONPATH=$PWD python bench/units_side_by_side.py c3k2_b1,shufflenet_unit_b16 [eager,inductor,onnxruntime,vtc-auto]

``vtc-<gemm>`` is vtc.compile with gemm=<gemm> (auto, vtc, torch); ``vtc-<plan>`` (greedy, all, none,
measured) is vtc.compile with plan=<plan> and the default gemm; ``vtc-panels`` is vtc-auto with the dot
form of convolutions over small maps off (vtc.codegen.conv_t: all implicit GEMMs in packed panels).  Calls are
interleaved system by system, N (env, default 25) rounds after warm-up calls
(bench.gemm_side_by_side.time_side_by_side: a round repeats a fast call to at least 20 ms);
min and median are printed with the speed-up of vtc over the best other
system.  With CPU=1 each call is timed by the calling thread's CPU time
(``time.thread_time``), which only makes sense with T=1 (env, threads, default
1: ORT, Inductor, torch and vtc's kernels then run on the calling thread): on a
shared machine whose load is far above its core count, wall-clock times at 2
threads are dominated by OpenMP threads waiting for their core, and CPU time at
1 thread is the comparison that still holds.  `vtc bench` remains the benchmark.
"""
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

T = int(os.environ.get("T", 1))
torch.set_num_threads(T)
clk = time.thread_time if os.environ.get("CPU") else time.perf_counter

import vtc  # noqa: E402
from bench.gemm_side_by_side import time_side_by_side  # noqa: E402
from bench.systems import Context, _eager, _inductor, _onnxruntime, _openvino  # noqa: E402
from bench.workloads import get  # noqa: E402

PLANS = ("greedy", "all", "none", "measured")  # vtc-<plan>; any other vtc-<x> is gemm=<x>


def main(names: list[str], systems: list[str], rounds: int) -> None:
    for name in names:
        model, inputs = get(name).build()
        ctx = Context(name, model, inputs, T, Path(tempfile.mkdtemp()))
        with torch.no_grad():
            ref = model(*inputs)
        fns = {}
        for s in systems:
            if s == "eager":
                fns[s] = _eager(ctx).fn
            elif s == "onnxruntime":
                fns[s] = _onnxruntime(ctx).fn
            elif s == "openvino":
                fns[s] = _openvino(ctx).fn
            elif s == "inductor":
                fns[s] = _inductor(None)(ctx).fn
            else:
                from vtc.codegen import conv_t

                keep = conv_t.MAX_PIXELS
                if s == "vtc-panels":  # vtc-auto with the dot form of convolutions over small maps off
                    conv_t.MAX_PIXELS = 0
                try:
                    opt = "auto" if s == "vtc-panels" else s.split("-", 1)[1]
                    c = vtc.compile(model, inputs, **({"plan": opt} if opt in PLANS else {"gemm": opt}))
                finally:
                    conv_t.MAX_PIXELS = keep
                got = torch.utils._pytree.tree_leaves(c(*inputs))  # a unit may return a tuple (llama3: the caches)
                err = max((g - r).abs().max().item() for g, r in zip(got, torch.utils._pytree.tree_leaves(ref)))
                if err > 1e-3:
                    raise AssertionError(f"{name} {s}: max error {err}")
                fns[s] = (lambda c: lambda: c(*inputs))(c)
        with torch.no_grad():
            times = time_side_by_side(fns, rounds, clk)
        for agg in ("min", "median"):
            ms = {s: t[f"{agg}_ms"] for s, t in times.items()}
            others = [v for s, v in ms.items() if not s.startswith("vtc")]
            ratios = ("   best other / vtc: " + " ".join(f"{min(others) / v:.2f}x" for s, v in ms.items()
                                                       if s.startswith("vtc"))) if others else ""
            print(f"{name:20s} {agg:6s} " + "  ".join(f"{s} {v:.3f}" for s, v in ms.items()) + ratios, flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), (sys.argv[2] if len(sys.argv) > 2 else "eager,inductor,onnxruntime,vtc-auto").split(","),
         int(os.environ.get("N", 25)))
