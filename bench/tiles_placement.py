"""vtc's call of a two-operand chain (``x``, ``y``) with ``y`` placed at chosen byte offsets from the output,
modulo 4 KB, timed side by side in one process (docs/chains.md, session 19: the 4 KB store -> load aliasing
of the tiles' 16-row walk)::

    PYTHONPATH=$PWD python -m bench.tiles_placement micro_transpose_add_1mb --offsets 0,64,1024,1984,2048
    PYTHONPATH=$PWD python -m bench.tiles_placement micro_transpose_add_1mb --offsets all   # every 64 bytes

The output is vtc's recycled buffer (the same address every call, checked), so ``y`` is copied into a fresh
tensor starting `d` bytes past the output's address modulo 4096; each placement's result is checked against
eager.  1 thread, CPU time of the calling thread by default; median / min us per placement.  ``--ab``: also the
kernel without ``vtc.codegen.tiles.LOADS_FIRST`` (each block's rows stored one by one whatever the placement),
timed in the same rounds (``<d> off``).
"""
from __future__ import annotations

import argparse
import os

import torch

from bench import workloads as W
from bench.gemm_side_by_side import CLOCKS, time_side_by_side


def placed_like(y: torch.Tensor, at: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a copy of y starting d bytes past `at` modulo 4096, the tensor holding it)."""
    n = y.numel()
    room = torch.empty(n + 4096 // y.element_size(), dtype=y.dtype)
    skip = ((at + d - room.data_ptr()) % 4096) // y.element_size()
    placed = room[skip:skip + n].view(y.shape)
    placed.copy_(y)
    return placed, room


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload")
    ap.add_argument("--offsets", default="0,64,1024,1984,2048", help="bytes, comma separated, or 'all' (0..4032 by 64)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--ab", action="store_true", help="also time the kernel with tiles.LOADS_FIRST off")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import vtc
    from vtc.codegen import tiles

    offsets = range(0, 4096, 64) if args.offsets == "all" else [int(v) for v in args.offsets.split(",")]
    model, (x, y) = W.get(args.workload).build(False)
    forms = {"": vtc.compile(model, (x, y), plan="all")}
    if args.ab:
        tiles.LOADS_FIRST = False
        forms[" off"] = vtc.compile(model, (x, y), plan="all")
        tiles.LOADS_FIRST = True
    fns, rooms = {}, []
    with torch.no_grad():
        for label, cv in forms.items():
            at = cv(x, y).data_ptr()
            for d in offsets:
                placed, room = placed_like(y, at, d)
                rooms.append(room)
                out = cv(x, placed)
                assert out.data_ptr() == at, "the output moved: placements are not comparable"
                torch.testing.assert_close(out, model(x, placed), rtol=1e-5, atol=1e-5)
                del out
                fns[f"{d}{label}"] = lambda cv=cv, placed=placed: cv(x, placed)
        res = time_side_by_side(fns, args.rounds, CLOCKS[args.clock])
    print(f"{args.workload} threads={args.threads} clock={args.clock} output % 4096 = {at % 4096}; "
          f"y - output (bytes mod 4096): median/min us")
    for d, r in res.items():
        print(f"  {d:>9}: {r['median_ms'] * 1e3:7.1f} / {r['min_ms'] * 1e3:7.1f}")
    print("load %.2f" % os.getloadavg()[0])


if __name__ == "__main__":
    main()
