"""The float math of vtc/codegen/vecmath.py, this tree's forms against an older revision's, in one process.

Each function runs as the generated kernels run it: a ``#pragma omp simd`` loop over a float array (built with
the kernels' own flags by ``vtc.runtime.cbuild``), ``--n`` elements in and out (default 8192: 64 KB, in L2),
``--reps`` passes per sample.  The old forms are the older revision's ``PRELUDE`` (``git show REV:...``) with
its names renamed ``vtc_`` -> ``vtcold_``, so both sit in one library; every round times old then new for each
function (thread CPU time), and the line per function gives ns per element, min and median, and old / new of
the medians.  Both forms' results are compared first (max abs difference, NaN positions)::

    PYTHONPATH=$PWD python bench/vecmath_ab.py                      # against 0cf3489 (session 17's base)
    PYTHONPATH=$PWD python bench/vecmath_ab.py --old HEAD~1 --rounds 50 --fns silu,exp
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from vtc.codegen.cpp import PRELUDE
from vtc.runtime import cbuild

# name -> C expression of x (the old form: the same with the vtcold_ prefix), or (new, old)
FNS = {
    "exp": "vtc_exp(x)",
    "sigmoid": "vtc_sigmoid(x)",
    "silu": ("vtc_silu(x)", "x * vtcold_sigmoid(x)"),  # session 17: x / (1 + e^-x), was x * sigmoid(x)
    "tanh": "vtc_tanh(x)",
    "erf": "vtc_erf(x)",
    "gelu": "vtc_gelu(x)",
    "gelu_tanh": "vtc_gelu_tanh(x)",
    "log": "vtc_log(x)",
}
# inputs per function: uniform in a range where the function is not saturated
RANGES = {"exp": (-80.0, 80.0), "log": (1e-3, 1e3), "tanh": (-6.0, 6.0), "erf": (-4.0, 4.0)}


def old_prelude(rev: str) -> str:
    """The PRELUDE of vecmath.py at `rev`, its vtc_ names renamed vtcold_."""
    text = subprocess.run(["git", "show", f"{rev}:vtc/codegen/vecmath.py"], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parent.parent).stdout
    scope: dict = {"__name__": "vecmath_old"}
    exec(compile(text, f"{rev}:vecmath.py", "exec"), scope)
    return scope["PRELUDE"].replace("vtc_", "vtcold_")


def source(rev: str, names: list[str]) -> str:
    loops = []
    for name in names:
        new, old = FNS[name] if isinstance(FNS[name], tuple) else (FNS[name], FNS[name].replace("vtc_", "vtcold_"))
        for tag, expr in (("new", new), ("old", old)):
            loops.append(f'extern "C" void {name}_{tag}(const float* __restrict__ in, float* __restrict__ out, '
                         f'long n, long reps) {{\n  for (long r = 0; r < reps; ++r) {{\n'
                         f'    #pragma omp simd\n    for (long i = 0; i < n; ++i) {{ const float x = in[i]; '
                         f'out[i] = {expr}; }}\n    __asm__ volatile("" ::: "memory");\n  }}\n}}\n')
    return PRELUDE + old_prelude(rev) + "\n".join(loops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", default="0cf3489", help="git revision of the old vecmath.py")
    ap.add_argument("--fns", default=",".join(FNS), help="comma-separated: " + ",".join(FNS))
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    names = args.fns.split(",")
    lib = cbuild.build(source(args.old, names), name="vecmath_ab")
    g = torch.Generator().manual_seed(0)
    print(f"vecmath {args.old} (old) vs this tree (new): n={args.n} x {args.reps} reps, {args.rounds} rounds, "
          f"thread CPU time, load {os.getloadavg()[0]:.2f}")
    print(f"{'fn':10s} {'old min':>8s} {'old med':>8s} {'new min':>8s} {'new med':>8s}  old/new  (ns/element)")
    for name in names:
        lo, hi = RANGES.get(name, (-10.0, 10.0))
        x = torch.rand(args.n, generator=g) * (hi - lo) + lo
        outs = {tag: torch.empty_like(x) for tag in ("old", "new")}
        fns = {tag: getattr(lib, f"{name}_{tag}") for tag in ("old", "new")}
        for tag, f in fns.items():
            f.restype = None
            f(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(outs[tag].data_ptr()), ctypes.c_long(args.n),
              ctypes.c_long(1))
        diff = (outs["old"] - outs["new"]).abs().max().item()
        samples = {"old": [], "new": []}
        for _ in range(args.rounds):
            for tag, f in fns.items():
                t0 = time.thread_time_ns()
                f(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(outs[tag].data_ptr()), ctypes.c_long(args.n),
                  ctypes.c_long(args.reps))
                samples[tag].append((time.thread_time_ns() - t0) / (args.n * args.reps))
        mo, mn = statistics.median(samples["old"]), statistics.median(samples["new"])
        print(f"{name:10s} {min(samples['old']):8.3f} {mo:8.3f} {min(samples['new']):8.3f} {mn:8.3f}  "
              f"{mo / mn:5.2f}x  (max |old - new| {diff:.2g})")


if __name__ == "__main__":
    main()
