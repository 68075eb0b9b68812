"""In-process A/B of the lane row kernel's store pass (``vtc.codegen.lanes``), 1 thread, CPU time.

Compiles each workload three times (plan="all"): the store pass reading the block buffer lane by lane
(``TRANSPOSED_STORE = False``), through 16 x 16 register transposes (``TRANSPOSE_8X16 = False``) and, for
8-lane blocks, through the 8 x 16 transpose (the default); checks each against eager and times the four
interleaved (``bench.gemm_side_by_side.time_side_by_side``)::

    PYTHONPATH=$PWD python -m bench.lanes_store_ab micro_permute_softmax_1mb,micro_permute_softmax_8mb
"""
from __future__ import annotations

import os
import sys
import time

import torch


def main(argv=None) -> int:
    import vtc
    from bench.gemm_side_by_side import time_side_by_side
    from bench.workloads import get
    from vtc.codegen import lanes

    argv = sys.argv[1:] if argv is None else argv
    rounds = int(argv[1]) if len(argv) > 1 else 11
    torch.set_num_threads(1)
    saved = lanes.TRANSPOSED_STORE, lanes.TRANSPOSE_8X16
    for name in argv[0].split(","):
        fn, x = get(name).build()
        fns = {"eager": lambda: fn(*x)}
        for label, flags in (("lane", (False, False)), ("T16", (True, False)), ("T8x16", (True, True))):
            lanes.TRANSPOSED_STORE, lanes.TRANSPOSE_8X16 = flags
            c = vtc.compile(fn, x, plan="all")
            torch.testing.assert_close(c(*x), fn(*x), rtol=1e-5, atol=1e-6)
            fns[label] = lambda c=c: c(*x)
        lanes.TRANSPOSED_STORE, lanes.TRANSPOSE_8X16 = saved
        r = time_side_by_side(fns, rounds, clock=time.thread_time)
        print(name, " ".join(f"{k} {v['median_ms']:.3f}/{v['min_ms']:.3f}" for k, v in r.items()),
              f"ms (median/min) | eager/T8x16 {r['eager']['median_ms'] / r['T8x16']['median_ms']:.2f}x"
              f"  load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
