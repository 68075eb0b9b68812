"""A/B of the transposed tiles' two forms in one process: ``vtc.codegen.tiles.BLOCKED`` (each 16 x 16 block
transposed and consumed at once) against the whole tile transposed first, with eager and Inductor alongside; ``-plain``: the same with no streaming stores.
Systems ``nest`` / ``split``: a roll's kernel as one loop nest / split at the wrap (``vtc.codegen.cpp.WRAP_SPLIT``);
``loops``: split, its two pieces in two loops one after the other (``cpp.WRAP_ROWS`` off; ``split``: row by row).
``buffer``: the block form with every block through its 1 KB buffer (``tiles.REGISTERS`` off; ``blocked``: full
blocks in registers).  ``stream``: the block form with a large output staged per tile and written with streaming
stores (``tiles.STREAM`` on).  ``nopf``: no prefetch of the next blocks' lines (``tiles.PREFETCH_BLOCKS`` 0);
``pfhalf``: that prefetch from half the last-level cache (``tiles.PREFETCH_CACHE_SHARE`` 0.5; ``blocked``: from the
whole of it).

    PYTHONPATH=$PWD python -m bench.tiles_ab micro_transpose_add_1mb,micro_transpose_add_8mb [--threads 1 --clock cpu]

Rounds interleave every system (``bench.gemm_side_by_side.time_side_by_side``); median / min ms per system.
"""
from __future__ import annotations

import argparse
import os

import torch

from bench import workloads as W
from bench.gemm_side_by_side import CLOCKS, time_side_by_side
from bench.micro_side_by_side import baselines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--systems", default="eager,inductor,tile,blocked,tile-plain,blocked-plain")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import vtc
    from vtc.codegen import cpp, stream, tiles

    default_share = stream.TILED_CACHE_SHARE
    default_pf, default_pf_share = tiles.PREFETCH_BLOCKS, tiles.PREFETCH_CACHE_SHARE

    systems = args.systems.split(",")
    for name in args.workloads.split(","):
        model, inputs = W.get(name).build(False)
        with torch.no_grad():
            ref = model(*inputs)
            fns = baselines(model, inputs, systems)
            for label, blocked, share, split in (("tile", False, None, True), ("blocked", True, None, True),
                                                 ("tile-plain", False, 1e9, True), ("blocked-plain", True, 1e9, True),
                                                 ("nest", True, None, False), ("split", True, None, True),
                                                 ("loops", True, None, True), ("buffer", True, None, True),
                                                 ("stream", True, None, True), ("nopf", True, None, True),
                                                 ("pfhalf", True, None, True)):
                if label in systems:  # -plain: no streaming stores; nest / split: cpp.WRAP_SPLIT off / on
                    tiles.BLOCKED, cpp.WRAP_SPLIT, cpp.WRAP_ROWS = blocked, split, label != "loops"
                    tiles.REGISTERS, tiles.STREAM = label != "buffer", label == "stream"
                    tiles.PREFETCH_BLOCKS = 0 if label == "nopf" else default_pf
                    tiles.PREFETCH_CACHE_SHARE = 0.5 if label == "pfhalf" else default_pf_share
                    stream.TILED_CACHE_SHARE = share or default_share
                    cv = vtc.compile(model, inputs, plan="all")
                    torch.testing.assert_close(cv(*inputs), ref, rtol=1e-4, atol=1e-4)
                    fns[label] = cv
            tiles.BLOCKED, stream.TILED_CACHE_SHARE, cpp.WRAP_SPLIT, cpp.WRAP_ROWS = True, default_share, True, True
            tiles.REGISTERS, tiles.STREAM = True, False
            tiles.PREFETCH_BLOCKS, tiles.PREFETCH_CACHE_SHARE = default_pf, default_pf_share
            res = time_side_by_side({k: (v if k in ("eager", "inductor") else (lambda v=v: v(*inputs)))
                                     for k, v in fns.items()}, args.rounds, CLOCKS[args.clock])
        print(name, f"threads={args.threads} clock={args.clock}",
              " ".join(f"{k} {r['median_ms']:.4f}/{r['min_ms']:.4f}" for k, r in res.items()),
              "| load %.2f" % os.getloadavg()[0], flush=True)


if __name__ == "__main__":
    main()
