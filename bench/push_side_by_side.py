"""Store-side push (vtc.codegen.push) timed side by side with the pull form and eager, in one process.

Systems, each run once per round, round after round (the same load falls on all; min and median kept):

- eager: the PyTorch module;
- vtc-pull: plan="all", push=False: every movement op read through its pull mapping (the code before push);
- vtc-push: plan="all" (pushes where the pull form would be copied into memory);
- vtc-greedy: the default planner.

Workloads: producers into a cat that is a graph output (pointwise and softmax producers), the KV-cache
update of a decode step (RoPE'd keys written into a cache given as an input and returned), the cat -> relu
micro-benchmark (pull stays: nothing is copied) and the Llama-3 decode layers.

GEMMs storing through push mappings (vtc.codegen.gemm_push) have their own cases (``gemm_push_*``, a fused
QKV projection writing V into the KV cache, alone and in a Llama-3 decode layer, and GEMMs into a cat) and
systems: eager, inductor (torch.compile), vtc-before / vtc-all-before (greedy / plan="all" with the GEMM's
push stores switched off: the GEMM stores its result and a push copy puts it into place, as before) and
vtc / vtc-all (with them)::

    python -m bench.push_side_by_side [--threads 2] [--rounds 15] [--workloads a,b] [--out FILE]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
from contextlib import contextmanager

import torch
from torch import nn

from bench import workloads as W
from bench.gemm_side_by_side import CLOCKS, time_side_by_side
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


class QKVCacheUpdate(nn.Module):
    """A fused QKV projection (x @ W_qkv^T, split), RoPE on q and k, k and v index_copy'd into the caches."""

    def __init__(self, hidden: int = 1024, heads: int = 16, kv_heads: int = 4, head_dim: int = 64):
        super().__init__()
        self.h, self.hk, self.hd = heads, kv_heads, head_dim
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)

    def forward(self, x, k_cache, v_cache, cos, sin, pos):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.hd, self.hk * self.hd, self.hk * self.hd], dim=-1)
        q = q.view(b, t, self.h, self.hd).transpose(1, 2)
        k = k.view(b, t, self.hk, self.hd).transpose(1, 2)
        v = v.view(b, t, self.hk, self.hd).transpose(1, 2)
        k_cache = k_cache.index_copy(2, pos, apply_rope(k, cos, sin))
        v_cache = v_cache.index_copy(2, pos, v)
        return apply_rope(q, cos, sin), k_cache, v_cache


def _qkv(batch: int, cache: int = 1024):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return QKVCacheUpdate(), (r(batch, 1, 1024), r(batch, 4, cache, 64), r(batch, 4, cache, 64), r(1, 64), r(1, 64),
                              torch.tensor([cache - 7]))


class GemmsIntoCat(nn.Module):
    """cat(x @ W1^T, x @ W2^T) along the features (a returned concatenation of two projections)."""

    def __init__(self, hidden: int = 1024, n1: int = 1024, n2: int = 512):
        super().__init__()
        self.a, self.b = nn.Linear(hidden, n1, bias=False), nn.Linear(hidden, n2, bias=False)

    def forward(self, x):
        return torch.cat((self.a(x), self.b(x)), dim=-1)


GEMM_PUSH_CASES = {
    "gemm_push_qkv_cache_b1": lambda: _qkv(1),
    "gemm_push_qkv_cache_b16": lambda: _qkv(16),
    "gemm_push_fused_qkv_decode_b1": lambda: W.get("llama3_fused_qkv_decode_b1").build(),
    "gemm_push_fused_qkv_decode_b16": lambda: W.get("llama3_fused_qkv_decode_b16").build(),
    "gemm_push_cat_b16": lambda: (GemmsIntoCat(), (torch.randn(16, 1024, generator=torch.Generator().manual_seed(0)),)),
    "gemm_push_cat_256": lambda: (GemmsIntoCat(), (torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)),)),
}

CASES = {
    "cat_out_dim1_64mb": lambda: _cat(1),
    "cat_out_dim3_64mb": lambda: _cat(3),
    "softmax_cat_out": lambda: (SoftmaxCat(), (torch.randn(64, 256, 1024), torch.randn(64, 128, 1024))),
    "kv_update_b1": lambda: _kv(1),
    "kv_update_b16": lambda: _kv(16),
    "micro_cat_relu_64mb": lambda: W.get("micro_cat_relu_64mb").build(),
    "llama3_decode_b1": lambda: W.get("llama3_decode_b1").build(),
    "llama3_decode_b16": lambda: W.get("llama3_decode_b16").build(),
    **GEMM_PUSH_CASES,
}


@contextmanager
def gemm_push_off():
    """vtc as before GEMM push stores (gemm_push.ENABLED off); its plans neither read from nor written to the
    plan cache, whose key does not record the switch."""
    from vtc.codegen import gemm_push
    from vtc.plan import cache

    saved = gemm_push.ENABLED, cache.cacheable
    gemm_push.ENABLED, cache.cacheable = False, lambda options: False
    try:
        yield
    finally:
        gemm_push.ENABLED, cache.cacheable = saved


def gemm_push_systems(model, inputs) -> dict:
    import vtc

    with gemm_push_off():
        before = {"vtc-before": vtc.compile(model, inputs), "vtc-all-before": vtc.compile(model, inputs, plan="all")}
    inductor = torch.compile(copy.deepcopy(model), dynamic=False)
    return {"eager": model, "inductor": inductor, **before, "vtc": vtc.compile(model, inputs),
            "vtc-all": vtc.compile(model, inputs, plan="all")}


def systems(model, inputs) -> dict:
    import vtc

    return {"eager": model, "vtc-pull": vtc.compile(model, inputs, plan="all", push=False),
            "vtc-push": vtc.compile(model, inputs, plan="all"), "vtc-greedy": vtc.compile(model, inputs)}


def _flat(x):
    return [x] if isinstance(x, torch.Tensor) else [t for y in x for t in _flat(y)]


def _uptime() -> str:
    import subprocess

    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--workloads", default=",".join(CASES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="cpu: CPU time of the calling thread (with --threads 1: the time not spent waiting for a core)")
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (other threads' time would not be counted)")
    torch.set_num_threads(args.threads)
    results = {"load": os.getloadavg(), "uptime": _uptime(), "threads": args.threads, "clock": args.clock,
               "workloads": {}}
    for name in args.workloads.split(","):
        model, inputs = CASES[name]()
        model = model.eval() if isinstance(model, nn.Module) else model
        with torch.no_grad():
            ref = _flat(model(*inputs))
            fns = (gemm_push_systems if name in GEMM_PUSH_CASES else systems)(model, inputs)
            errs = {}
            for s, f in fns.items():
                got = _flat(f(*inputs))
                errs[s] = max(float((a - b).abs().max()) for a, b in zip(ref, got))
            times = time_side_by_side({s: (lambda f=f: f(*inputs)) for s, f in fns.items()}, args.rounds,
                                      CLOCKS[args.clock])
        rep = {s: f.report.to_dict() for s, f in fns.items() if hasattr(f, "report")}
        row = {s: {**times[s], "max_err": errs[s],
                   **({"kernels": rep[s]["kernels"], "moved_bytes": rep[s]["materialized_movement_bytes"]}
                      if s in rep else {})} for s in fns}
        results["workloads"][name] = row
        base = times["eager"]["median_ms"]
        row["uptime"] = _uptime()
        print(f"{name}  ({row['uptime']})")
        for s, r in ((s, r) for s, r in row.items() if s != "uptime"):
            extra = f"  kernels {r['kernels']:>3}  moved {r['moved_bytes'] / 2**20:8.2f} MB" if "kernels" in r else ""
            print(f"  {s:<11} median {r['median_ms']:9.3f} ms  min {r['min_ms']:9.3f} ms  "
                  f"eager/this {base / r['median_ms']:5.2f}x  err {r['max_err']:.1e}{extra}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
