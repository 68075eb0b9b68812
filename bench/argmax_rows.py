"""argmax over the last dim, eager and vtc (plan="all") side by side in one process, 1 thread, CPU time.

One row of 4096 and of 32000 (a decode step's logits) and 64 rows of 4096; each line gives median / min per
system in microseconds (a vtc call includes its per-call overhead, ~4 us here: at one row of 4096 that is
most of it, docs/reductions.md)::

    PYTHONPATH=$PWD python bench/argmax_rows.py
"""
from __future__ import annotations

import os
import warnings

import torch

import vtc
from bench.gemm_side_by_side import CLOCKS, time_side_by_side


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    for shape in [(1, 4096), (1, 32000), (64, 4096)]:
        x = torch.randn(*shape)
        f = lambda x: x.argmax(-1)  # noqa: E731
        c = vtc.compile(f, (x,), plan="all")
        assert torch.equal(c(x), f(x))
        t = time_side_by_side({"eager": lambda: f(x), "vtc": lambda: c(x)}, 15, CLOCKS["cpu"])
        cols = " ".join(f"{k} {v['median_ms'] * 1e3:.1f}/{v['min_ms'] * 1e3:.1f}" for k, v in t.items())
        print(f"argmax {tuple(shape)}: {cols} us (median/min)  load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
