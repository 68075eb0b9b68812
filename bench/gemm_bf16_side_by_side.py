"""bf16 against float32 GEMMs, torch's and vtc's generated ones, timed side by side in one process.

For each shape four systems run round after round (alternating, so each sees the same load): torch in bf16,
vtc's generated bf16 GEMM (gemm="vtc", ``vtc.codegen.gemm_bf16``), torch in float32 and vtc's generated
float32 GEMM (gemm="vtc").  One thread, the calling thread's CPU time; min and median per system::

    PYTHONPATH=$PWD python -m bench.gemm_bf16_side_by_side [--shapes square,prefill,skinny,bmm] [--rounds 7]

Shapes: squares a @ b (256 .. 2048); the prefill units' x @ W^T (256 tokens); decode's x @ W^T of a 4096 x 4096
weight (1 / 4 / 16 rows); bmm ``gqa_scores_q<n>`` (q @ repeat_kv(k)^T over a 2048-token cache: a transposed,
GQA-expanded B, which torch copies first), ``gqa_prefill_q256_t256`` (the same over 256 prefill tokens) and
``attn_scores`` (q @ k^T of 16 heads x 256 tokens, head dim 64: a transposed strided view).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from torch import nn

import vtc

MIN_SAMPLE_S = 0.02  # CPU seconds per sample (small GEMMs repeat)


def _linear(m: int, k: int, n: int):
    lin = nn.Linear(k, n, bias=False)
    return lin, (torch.randn(m, k),)


def _mm(m: int, k: int, n: int):
    return (lambda a, b: a @ b), (torch.randn(m, k), torch.randn(k, n))


def _gqa(q: int, t: int = 2048):
    def f(q_, k_):
        return q_ @ k_[:, :, None].expand(1, 8, 4, t, 128).reshape(1, 32, t, 128).transpose(-1, -2)
    return f, (torch.randn(1, 32, q, 128), torch.randn(1, 8, t, 128))


def _scores(h: int = 16, s: int = 256, d: int = 64):
    return (lambda q, k: q @ k.transpose(-1, -2)), (torch.randn(1, h, s, d), torch.randn(1, h, s, d))


SHAPES = {
    "square": [(f"square_{n}", _mm, (n, n, n)) for n in (256, 512, 1024, 2048)],
    "prefill": [(f"prefill_{name}_{m}x{k}->{n}", _linear, (m, k, n)) for name, m, k, n in
                (("up", 256, 1024, 3584), ("down", 256, 3584, 1024), ("proj", 256, 1024, 1024),
                 ("kv", 256, 1024, 256))],
    "skinny": [(f"skinny_m{m}_4096->4096", _linear, (m, 4096, 4096)) for m in (1, 4, 16)],
    "bmm": [("gqa_scores_q16", _gqa, (16,)), ("gqa_scores_q1", _gqa, (1,)), ("gqa_scores_q64", _gqa, (64,)),
            ("gqa_prefill_q256_t256", _gqa, (256, 256)), ("attn_scores_h16_s256_d64", _scores, ())],
}


def systems(build, args) -> dict:
    """{"torch-bf16", "vtc-bf16", "torch-f32", "vtc-f32": callable} for one shape."""
    torch.manual_seed(0)
    model, inputs = build(*args)
    out = {}
    for dt, tag in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
        mod = copy.deepcopy(model).to(dt) if isinstance(model, nn.Module) else model
        xs = tuple(x.to(dt) for x in inputs)
        compiled = vtc.compile(mod, xs, plan="all", gemm="vtc")
        choices = compiled.report.to_dict()["gemm"] if hasattr(compiled, "report") else []
        if any(c["choice"] != "vtc" for c in choices):
            print(f"  {tag}: not generated: {[c['why'] for c in choices]}")
        ref, got = mod(*xs), compiled(*xs)
        err = (got.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-9)
        out[f"torch-{tag}"] = (lambda mod=mod, xs=xs: mod(*xs))
        out[f"vtc-{tag}"] = (lambda c=compiled, xs=xs: c(*xs))
        out[f"err-{tag}"] = err
    return out


def time_alternating(fns: dict, rounds: int) -> dict:
    """{name: (min ms, median ms)} of the calling thread's CPU time, the systems alternating round by round."""
    reps = {}
    for name, fn in fns.items():
        fn()
        t0 = time.thread_time()
        fn()
        reps[name] = max(1, int(MIN_SAMPLE_S / max(time.thread_time() - t0, 1e-7)))
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.thread_time()
            for _ in range(reps[name]):
                fn()
            samples[name].append((time.thread_time() - t0) / reps[name] * 1e3)
    return {n: (min(s), statistics.median(s)) for n, s in samples.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="square,prefill,skinny,bmm")
    p.add_argument("--only", default="", help="a substring of the shape names to keep")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"load {os.getloadavg()}; 1 thread, CPU time, min/median ms of {args.rounds} alternating rounds")
    print(f"{'shape':<28} {'torch-bf16':>15} {'vtc-bf16':>15} {'torch-f32':>15} {'vtc-f32':>15}  "
          f"vtc/torch bf16  GFLOPS(tb,vb,tf,vf)")
    for group in args.shapes.split(","):
        for name, build, bargs in SHAPES[group]:
            if args.only not in name:
                continue
            with torch.no_grad():
                fns = systems(build, bargs)
                errs = {k: fns.pop(k) for k in ("err-bf16", "err-f32")}
                t = time_alternating(fns, args.rounds)
            flops = _flops(build, bargs)
            gf = ",".join(f"{flops / (t[s][0] * 1e6):.0f}" for s in ("torch-bf16", "vtc-bf16", "torch-f32", "vtc-f32"))
            print(f"{name:<28} " + " ".join(f"{t[s][0]:7.3f}/{t[s][1]:7.3f}" for s in
                                            ("torch-bf16", "vtc-bf16", "torch-f32", "vtc-f32"))
                  + f"  {t['torch-bf16'][0] / t['vtc-bf16'][0]:5.2f}x  {gf}  (rel err bf16 {errs['err-bf16']:.1e})",
                  flush=True)
    print(f"load after {os.getloadavg()}")
    return 0


def _flops(build, bargs) -> int:
    if build is _gqa:
        return 2 * 32 * bargs[0] * (bargs[1] if len(bargs) > 1 else 2048) * 128
    if build is _scores:
        return 2 * 16 * 256 * 256 * 64
    m, k, n = bargs
    return 2 * m * k * n


if __name__ == "__main__":
    raise SystemExit(main())
