"""In-process A/B of the lane row kernel's L2 prefetch (``vtc.codegen.lanes.PREFETCH``) and block buffer size
(``lanes.TERM_BUFFER``), 1 thread, CPU time, with ONNX Runtime (1 intra-op thread, the bench's session options:
``bench.systems``) and eager alongside.

Compiles each workload three times (plan="all"): ``old`` (``TERM_BUFFER = 4096``, the limit before session 27, and
no prefetch), ``off`` (``PREFETCH = False``) and ``on`` (the module's settings), checks each against eager and times every system interleaved (``bench.gemm_side_by_side.time_side_by_side``);
ONNX Runtime and eager run on the calling thread with 1 thread, so CPU time of the calling thread is theirs too::

    PYTHONPATH=$PWD python -m bench.lanes_prefetch_ab micro_permute_softmax_64mb,micro_permute_softmax_8mb 21
    PYTHONPATH=$PWD python -m bench.lanes_prefetch_ab micro_permute_softmax_64mb 21 2   # 2 threads, wall time
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    import vtc
    from bench.gemm_side_by_side import time_side_by_side
    from bench.systems import PREPARE, Context, SystemFailure
    from bench.workloads import get
    from vtc.codegen import lanes

    argv = sys.argv[1:] if argv is None else argv
    rounds = int(argv[1]) if len(argv) > 1 else 15
    threads = int(argv[2]) if len(argv) > 2 else 1
    clock = time.thread_time if threads == 1 else time.perf_counter  # CPU time of the calling thread: 1 thread only
    torch.set_num_threads(threads)
    saved = lanes.PREFETCH, lanes.TERM_BUFFER
    for name in argv[0].split(","):
        model, x = get(name).build(False)
        with torch.no_grad():
            ref = model(*x)
            fns = {"eager": lambda: model(*x)}
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    fns["ort"] = PREPARE["onnxruntime"](Context(name, model, x, threads, Path(tmp))).fn
            except SystemFailure as e:
                print(name, "onnxruntime:", e.reason)
            for label, flags in (("old", (False, 4096)), ("off", (False, saved[1])), ("on", saved)):
                lanes.PREFETCH, lanes.TERM_BUFFER = flags
                c = vtc.compile(model, x, plan="all")
                lanes.PREFETCH, lanes.TERM_BUFFER = saved
                torch.testing.assert_close(c(*x), ref, rtol=1e-5, atol=1e-6)
                fns[label] = lambda c=c: c(*x)
            r = time_side_by_side(fns, rounds, clock=clock)
        print(name, f"threads={threads} clock={'cpu' if threads == 1 else 'wall'}", " ".join(f"{k} {v['median_ms']:.3f}/{v['min_ms']:.3f}" for k, v in r.items()),
              f"ms (median/min) | old/on {r['old']['median_ms'] / r['on']['median_ms']:.2f}x off/on {r['off']['median_ms'] / r['on']['median_ms']:.2f}x"
              + (f" ort/on {r['ort']['median_ms'] / r['on']['median_ms']:.2f}x" if "ort" in r else "")
              + f"  load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
