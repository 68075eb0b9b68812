"""Packing by runs vs element by element (vtc.codegen.gemm_pack), side by side in one process.

Each case is a GEMM whose operand is a virtual cat or gather; four callables run interleaved
(``bench.gemm_side_by_side.time_side_by_side``): eager (torch's cat / gather + matmul), vtc with
gemm="vtc" packing by runs, the same with ``gemm_pack.pack_a`` / ``pack_b`` switched off (gemm.py's
element-by-element pack loops; the ablation), and vtc with gemm="torch" (a copy kernel + torch)::

    python -m bench.gemm_pack_ablation --mkn 512,2048,64 [--threads 1 --clock cpu] [--rounds 7]

N = 64 makes packing a large share of the call (A is packed once per 1024 columns of N).

``--lazy-b SHAPES`` runs the B pack ablation of the panels GEMM instead (``vtc.codegen.gemm.LAZY_B``): each
shape (``sq<n>``: a @ b of n x n; ``MxKxN``: x @ W^T of an nn.Linear(K, N) on M rows, both with gemm="vtc";
``unit:<workload>``: a bench workload with plan="greedy" and the default gemm) compiled with B's
panels packed in the block's first row strip, next panel prefetched (vtc-lazy-b), and with the whole block
packed before the strips (vtc-block-b), next to eager::

    python -m bench.gemm_pack_ablation --lazy-b sq512,sq1024,256x1024x3584 --threads 1 --clock cpu
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime
from pathlib import Path

import torch

import vtc
from bench.gemm_side_by_side import CLOCKS, time_side_by_side
from vtc.codegen import gemm_pack


def cases(m: int, k: int, n: int, g: torch.Generator) -> dict:
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "cat_rows": (lambda a, b, w: torch.cat([a, b], 0) @ w, (r(m // 2, k), r(m - m // 2, k), r(k, n))),
        "cat_k": (lambda a, b, w: torch.cat([a, b], 1) @ w, (r(m, k // 2), r(m, k - k // 2), r(k, n))),
        "gather_rows": (lambda t, i, w: t[i] @ w, (r(8 * k, k), torch.randint(0, 8 * k, (m,), generator=g), r(k, n))),
        "gather_cols": (lambda x, p, w: x[:, p] @ w, (r(m, k), torch.randperm(k, generator=g), r(k, n))),
        "b_cat_n": (lambda x, u, v: x @ torch.cat([u, v], 1), (r(m, k), r(k, n // 2), r(k, n - n // 2))),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mkn", default="512,2048,64", help="M,K,N")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--lazy-b", default="", help="shapes for the B pack ablation: sq<n> or MxKxN, comma-separated")
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error(f"--clock cpu measures the calling thread only: it needs --threads 1, not {args.threads}")
    torch.set_num_threads(args.threads)
    if args.lazy_b:
        return lazy_b(args, argv)
    m, k, n = (int(x) for x in args.mkn.split(","))
    load_before, rows = os.getloadavg(), []
    on = gemm_pack.pack_a, gemm_pack.pack_b
    for name, (fn, inputs) in cases(m, k, n, torch.Generator().manual_seed(0)).items():
        fns = {"eager": lambda fn=fn, x=inputs: fn(*x)}
        runs = vtc.compile(fn, inputs, backend="cpu", gemm="vtc")
        gemm_pack.pack_a = gemm_pack.pack_b = lambda *a, **kw: None
        try:
            elementwise = vtc.compile(fn, inputs, backend="cpu", gemm="vtc")
        finally:
            gemm_pack.pack_a, gemm_pack.pack_b = on
        copy = vtc.compile(fn, inputs, backend="cpu", gemm="torch")
        for label, c in (("vtc-runs", runs), ("vtc-elementwise", elementwise), ("vtc-copy+torch", copy)):
            torch.testing.assert_close(c(*inputs), fn(*inputs), rtol=1e-4, atol=1e-3)
            fns[label] = lambda c=c, x=inputs: c(*x)
        with torch.no_grad():
            times = time_side_by_side(fns, args.rounds, CLOCKS[args.clock])
        rows.append({"case": name, "times": times})
        print(f"{name:<12} " + "  ".join(f"{s} {t['min_ms']:.3f}" for s, t in times.items()), flush=True)
    return _write(args, argv, f"gemm-pack-ablation-{m}x{k}x{n}", rows, load_before, mkn=[m, k, n])


def _write(args, argv, stem: str, rows: list, load_before, **extra) -> int:
    """Writes the results file <out>/<stem>-<date>.json (the command, the load before and after); returns 0."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{datetime.now():%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps({"command": "python -m bench.gemm_pack_ablation " + " ".join(
        sys.argv[1:] if argv is None else argv), **extra, "threads": args.threads, "clock": args.clock,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "results": rows}, indent=1))
    print(f"wrote {path}; load average before {load_before}, after {os.getloadavg()}")
    return 0


def lazy_b(args, argv) -> int:
    """The --lazy-b ablation: per shape eager, vtc-lazy-b and vtc-block-b interleaved; writes a results file."""
    from vtc.codegen import gemm

    load_before, rows, g = os.getloadavg(), [], torch.Generator().manual_seed(0)
    for shape in args.lazy_b.split(","):
        if shape.startswith("unit:"):  # a bench workload (bench/workloads), compiled with plan="greedy"
            from bench.workloads import get
            fn, inputs = get(shape[5:]).build()
        elif shape.startswith("sq"):
            n = int(shape[2:])
            fn, inputs = (lambda a, b: a @ b), (torch.randn(n, n, generator=g), torch.randn(n, n, generator=g))
        else:
            m, k, n = (int(x) for x in shape.split("x"))
            fn, inputs = torch.nn.Linear(k, n, bias=False), (torch.randn(m, k, generator=g),)
        fns = {"eager": lambda fn=fn, x=inputs: fn(*x)}
        with torch.no_grad():
            for label, lazy in (("vtc-lazy-b", True), ("vtc-block-b", False)):
                saved, gemm.LAZY_B = gemm.LAZY_B, lazy
                try:
                    opts = dict(plan="greedy") if shape.startswith("unit:") else dict(gemm="vtc")
                    c = vtc.compile(fn, inputs, backend="cpu", **opts)
                finally:
                    gemm.LAZY_B = saved
                torch.testing.assert_close(c(*inputs), fn(*inputs), rtol=1e-4, atol=2e-3)
                fns[label] = lambda c=c, x=inputs: c(*x)
            times = time_side_by_side(fns, args.rounds, CLOCKS[args.clock])
        rows.append({"case": shape, "times": times})
        print(f"{shape:<16} " + "  ".join(f"{s} {t['min_ms']:.3f}/{t['median_ms']:.3f}" for s, t in times.items())
              + f"  | block/lazy min x{times['vtc-block-b']['min_ms'] / times['vtc-lazy-b']['min_ms']:.3f}, median x"
                f"{times['vtc-block-b']['median_ms'] / times['vtc-lazy-b']['median_ms']:.3f}", flush=True)
    return _write(args, argv, "gemm-lazy-b", rows, load_before)


if __name__ == "__main__":
    raise SystemExit(main())
