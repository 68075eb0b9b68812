"""Layer norms at Swin-T's row widths, side by side in one process: eager, OpenVINO and vtc (optionally vtc twice,
a codegen switch off and on).

Each workload is a chain of ``--chain`` LayerNorm modules over [1, rows, C] (distinct random weights and biases,
input ``randn * 0.1 + 100``: a large mean), so a call's fixed cost (OpenVINO's ``infer``: ~0.5 ms a call from
Python, vtc's call plan) is spread over the chain; the line per shape gives ms per layer norm (the call's time
divided by the chain's length), min / median over the rounds, each system timed in turn round after round
(``bench.gemm_side_by_side.time_side_by_side``).  Each result is checked against eager first (max abs error,
printed).  With ``--threads 1 --clock cpu`` the figure is the calling thread's CPU time (OpenVINO at 1 thread
infers on the calling thread: its thread and process CPU times agree)::

    PYTHONPATH=$PWD python bench/norm_side_by_side.py --threads 1 --clock cpu
    PYTHONPATH=$PWD python bench/norm_side_by_side.py --switch vtc.codegen.row_blocks.BLOCKS --shapes s1,s2
    PYTHONPATH=$PWD python bench/norm_side_by_side.py --input window   # read through Swin's window partition

``--input window``: each layer norm of the chain reads the previous one's output through Swin's
roll + window partition (7 x 7 windows over the square map of `rows` pixels, shift 3), as ``layernorm_after``
reads the attention output merged back; shapes whose rows are not a square map of 7 x 7 windows are skipped.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # name: (rows, C); Swin-T's layer norms (batch 1, 224 x 224)
    "s1": (3136, 96), "s2": (784, 192), "s3": (196, 384), "s4": (49, 768),  # the blocks' (and the embedding's)
    "m1": (784, 384), "m2": (196, 768), "m3": (49, 1536),  # after the patch mergings' concat (4C)
}


class Window(torch.nn.Module):
    """roll(-3, -3) then 7 x 7 window partition of a [1, H*W, C] map, flattened back to [1, H*W, C]."""

    def forward(self, x):
        b, n, c = x.shape
        h = int(math.isqrt(n))
        x = torch.roll(x.view(b, h, h, c), shifts=(-3, -3), dims=(1, 2))
        x = x.view(b, h // 7, 7, h // 7, 7, c).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(b, n, c)


class Chain(torch.nn.Module):
    def __init__(self, c: int, n: int, window: bool):
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(c) for _ in range(n))
        for ln in self.norms:
            torch.nn.init.normal_(ln.weight, 1.0, 0.1)
            torch.nn.init.normal_(ln.bias, 0.0, 0.1)
        self.window = Window() if window else None

    def forward(self, x):
        for ln in self.norms:
            x = ln(self.window(x) if self.window is not None else x)
        return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--systems", default="eager,openvino,vtc")
    ap.add_argument("--switch", default=None,
                    help="MODULE.ATTR[,MODULE.ATTR]: vtc compiled with them False (vtc-off) and True (vtc-on)")
    ap.add_argument("--input", choices=("plain", "window"), default="plain")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import vtc
    from bench.gemm_side_by_side import CLOCKS, time_side_by_side
    from bench.systems import Context, _openvino

    systems = args.systems.split(",")
    switches = []  # (module, attribute) of each switch named
    for name in filter(None, (args.switch or "").split(",")):
        mod, attr = name.rsplit(".", 1)
        switches.append((importlib.import_module(mod), attr))
    results = {"load": os.getloadavg(), "args": vars(args), "shapes": {}}
    print(f"load {os.getloadavg()[0]:.2f}; ms per layer norm (call / {args.chain}), min / median; "
          f"{args.threads} thread(s), {args.clock} clock, input {args.input}")
    for name in args.shapes.split(","):
        rows, c = SHAPES[name]
        if args.input == "window" and (math.isqrt(rows) ** 2 != rows or math.isqrt(rows) % 7):
            continue
        torch.manual_seed(0)
        model = Chain(c, args.chain, args.input == "window").eval()
        x = torch.randn(1, rows, c) * 0.1 + 100
        fns, errs = {}, {}
        with torch.no_grad():
            ref = model(x)
            if "eager" in systems:
                fns["eager"] = lambda: model(x)
            if "openvino" in systems:
                ov = _openvino(Context(f"ln_{name}", model, (x,), args.threads, Path(tempfile.mkdtemp()))).fn
                errs["openvino"] = float((torch.from_numpy(ov()[0]) - ref).abs().max())
                fns["openvino"] = ov
            if "vtc" in systems:
                for tag, value in ((("vtc-off", False), ("vtc-on", True)) if switches else (("vtc", None),)):
                    for mod, attr in switches:
                        setattr(mod, attr, value)
                    cm = vtc.compile(model, (x,))
                    errs[tag] = float((cm(x) - ref).abs().max())
                    fns[tag] = (lambda cm: lambda: cm(x))(cm)
            res = time_side_by_side(fns, args.rounds, CLOCKS[args.clock])
        line = {s: {"min_ms": r["min_ms"] / args.chain, "median_ms": r["median_ms"] / args.chain,
                    "max_abs_err": errs.get(s)} for s, r in res.items()}
        results["shapes"][name] = {"rows": rows, "C": c, "systems": line, "load": os.getloadavg()}
        cells = "  ".join(f"{s} {v['min_ms']:.4f} / {v['median_ms']:.4f}" for s, v in line.items())
        print(f"{name} [{rows}, {c}]  {cells}  (err {', '.join(f'{s} {e:.1e}' for s, e in errs.items())}; "
              f"load {os.getloadavg()[0]:.2f})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
