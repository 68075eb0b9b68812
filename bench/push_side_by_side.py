"""Store-side push (vtc.codegen.push) timed side by side with the pull form and eager, in one process.

Systems, each run once per round, round after round (the same load falls on all; min and median kept):

- eager: the PyTorch module;
- vtc-pull: plan="all", push=False: every movement op read through its pull mapping (the code before push);
- vtc-push: plan="all" (pushes where the pull form would be copied into memory);
- vtc-greedy: the default planner.

Workloads: producers into a cat that is a graph output (pointwise and softmax producers), the KV-cache
update of a decode step (RoPE'd keys written into a cache given as an input and returned), the cat -> relu
micro-benchmark (pull stays: nothing is copied) and the Llama-3 decode layers::

    python -m bench.push_side_by_side [--threads 2] [--rounds 15] [--workloads a,b] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

from bench import workloads as W
from bench.gemm_side_by_side import time_side_by_side
from bench.workloads.llama3 import apply_rope

class CatOut(nn.Module):
    """cat(relu(a), sigmoid(b), a * b) along `dim`: three pointwise producers into a returned cat."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, a, b):
        return torch.cat((torch.relu(a), torch.sigmoid(b), a * b), dim=self.dim)


class SoftmaxCat(nn.Module):
    """cat(softmax(a), softmax(b)) along dim 1 (row kernels into a returned cat)."""

    def forward(self, a, b):
        return torch.cat((torch.softmax(a, -1), torch.softmax(b, -1)), dim=1)


class KVUpdate(nn.Module):
    """The decode-step cache update: k after RoPE index_copy'd into the cache, which is returned and read."""

    def forward(self, k_cache, k, cos, sin, pos, q):
        k_cache = k_cache.index_copy(2, pos, apply_rope(k, cos, sin))
        return k_cache, (k_cache * q).sum(-1)


def _kv(batch: int, cache: int = 1024, heads: int = 4, d: int = 64):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return KVUpdate(), (r(batch, heads, cache, d), r(batch, heads, 1, d), r(1, d), r(1, d),
                        torch.tensor([cache - 7]), r(batch, heads, 1, d))


def _cat(dim: int):
    g = torch.Generator().manual_seed(0)
    return CatOut(dim), (torch.randn(8, 128, 128, 128, generator=g), torch.randn(8, 128, 128, 128, generator=g))


CASES = {
    "cat_out_dim1_64mb": lambda: _cat(1),
    "cat_out_dim3_64mb": lambda: _cat(3),
    "softmax_cat_out": lambda: (SoftmaxCat(), (torch.randn(64, 256, 1024), torch.randn(64, 128, 1024))),
    "kv_update_b1": lambda: _kv(1),
    "kv_update_b16": lambda: _kv(16),
    "micro_cat_relu_64mb": lambda: W.get("micro_cat_relu_64mb").build(),
    "llama3_decode_b1": lambda: W.get("llama3_decode_b1").build(),
    "llama3_decode_b16": lambda: W.get("llama3_decode_b16").build(),
}


def systems(model, inputs) -> dict:
    import vtc

    return {"eager": model, "vtc-pull": vtc.compile(model, inputs, plan="all", push=False),
            "vtc-push": vtc.compile(model, inputs, plan="all"), "vtc-greedy": vtc.compile(model, inputs)}


def _flat(x):
    return [x] if isinstance(x, torch.Tensor) else [t for y in x for t in _flat(y)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--workloads", default=",".join(CASES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {"load": os.getloadavg(), "threads": args.threads, "workloads": {}}
    for name in args.workloads.split(","):
        model, inputs = CASES[name]()
        model = model.eval() if isinstance(model, nn.Module) else model
        with torch.no_grad():
            ref = _flat(model(*inputs))
            fns = systems(model, inputs)
            errs = {}
            for s, f in fns.items():
                got = _flat(f(*inputs))
                errs[s] = max(float((a - b).abs().max()) for a, b in zip(ref, got))
            times = time_side_by_side({s: (lambda f=f: f(*inputs)) for s, f in fns.items()}, args.rounds)
        rep = {s: f.report.to_dict() for s, f in fns.items() if hasattr(f, "report")}
        row = {s: {**times[s], "max_err": errs[s],
                   **({"kernels": rep[s]["kernels"], "moved_bytes": rep[s]["materialized_movement_bytes"]}
                      if s in rep else {})} for s in fns}
        results["workloads"][name] = row
        base = times["eager"]["median_ms"]
        print(f"{name}  (load {os.getloadavg()[0]:.2f})")
        for s, r in row.items():
            extra = f"  kernels {r['kernels']:>3}  moved {r['moved_bytes'] / 2**20:8.2f} MB" if "kernels" in r else ""
            print(f"  {s:<11} median {r['median_ms']:9.3f} ms  min {r['min_ms']:9.3f} ms  "
                  f"eager/this {base / r['median_ms']:5.2f}x  err {r['max_err']:.1e}{extra}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
