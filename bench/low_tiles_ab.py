"""A/B of ``vtc.codegen.low_tiles.REGISTERS`` in one process (a bfloat16 operand read across the rows of a tile:
widened and transposed in registers 16 x 16 at a time, against the staging loop), with eager and Inductor,
on ``bench/bf16_side_by_side.py``'s chain ``relu(x.transpose(1, 2) + y) * 2`` (16 x 512 x 256 bfloat16).

    PYTHONPATH=$PWD python -m bench.low_tiles_ab [--threads 1 --clock cpu] [--rounds 15]

Rounds interleave every system (``bench.gemm_side_by_side.time_side_by_side``); median / min ms per system.
"""
from __future__ import annotations

import argparse
import os

import torch

from bench.gemm_side_by_side import CLOCKS, time_side_by_side


class _Chain(torch.nn.Module):
    def forward(self, x, y):
        return torch.relu(x.transpose(1, 2) + y) * 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--systems", default="eager,inductor,loop,regs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import vtc
    from vtc.codegen import low_tiles

    torch.manual_seed(0)
    x, y = torch.randn(16, 256, 512).to(torch.bfloat16), torch.randn(16, 512, 256).to(torch.bfloat16)
    model, systems = _Chain(), args.systems.split(",")
    fns = {}
    with torch.no_grad():
        ref = model(x, y)
        if "eager" in systems:
            fns["eager"] = lambda: model(x, y)
        if "inductor" in systems:
            ind = torch.compile(model)
            ind(x, y)
            fns["inductor"] = lambda: ind(x, y)
        for label in ("loop", "regs"):
            if label in systems:
                low_tiles.REGISTERS = label == "regs"
                cv = vtc.compile(model, (x, y), plan="all")
                assert torch.equal(cv(x, y), ref)
                fns[label] = lambda cv=cv: cv(x, y)
        low_tiles.REGISTERS = True
        res = time_side_by_side(fns, args.rounds, CLOCKS[args.clock])
    print(f"bf16 transposed chain threads={args.threads} clock={args.clock}",
          " ".join(f"{k} {r['median_ms']:.4f}/{r['min_ms']:.4f}" for k, r in res.items()), f"| load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
