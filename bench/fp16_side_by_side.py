"""float16 GEMMs, convolutions and a Llama forward: eager and vtc (gemm="auto", gemm="vtc"; --fp32: vtc on float32)
side by side in one process.

    PYTHONPATH=$PWD python bench/fp16_side_by_side.py [--threads 1] [--only linear,bmm,conv,llama] [--fp32]
        [--out bench/results/x.json]

Per workload the variants are timed interleaved (one round of each in turn, ``rounds`` times); each round is the
CPU time of the calling thread (``time.thread_time``, the figure that moves least on a shared machine) per call
at 1 thread, wall-clock (``time.perf_counter``) at more (the other threads' time is not the caller's).  Printed
and written: min / median ms per variant, what vtc chose for each GEMM, the largest difference to eager and the
fraction of elements equal to eager's (docs/low_precision.md, "float16 GEMMs")."""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import time
import warnings

import torch
import torch.nn.functional as F

import vtc

H = torch.float16


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float32).to(H)


def workloads(only: set[str]):
    """(name, fn, inputs) of the measured products and models."""
    out = []
    if "linear" in only:
        for m, k, n in ((512, 512, 512), (128, 1024, 1024), (1, 1024, 4096), (4, 1024, 4096), (16, 1024, 4096)):
            w, b = _rand(n, k) * 0.05, _rand(n) * 0.1
            out.append((f"linear {m}x{k}->{n} +bias", lambda x, w=w, b=b: F.linear(x, w, b), (_rand(m, k),)))
        for m in (1, 4, 16):  # B row-major (x @ W, W [K, N]): no in-place path for float16 B, packed per call
            w = _rand(1024, 4096) * 0.05
            out.append((f"mm {m}x1024 @ 1024x4096 (B row-major)", lambda x, w=w: x @ w, (_rand(m, 1024),)))
    if "bmm" in only:
        out.append(("bmm 16x(256x256 @ 256x64)", torch.bmm, (_rand(16, 256, 256), _rand(16, 256, 64))))
        out.append(("bmm q@k^T 16x(128x64 @ (128x64)^T)", lambda q, k: q @ k.transpose(1, 2),
                    (_rand(16, 128, 64), _rand(16, 128, 64))))
        out.append(("bmm decode q @ cat(k_past, k)^T 16x(1x64 @ 64x256)",
                    lambda q, kp, kn: q @ torch.cat([kp, kn], 1).transpose(1, 2),
                    (_rand(16, 1, 64), _rand(16, 255, 64), _rand(16, 1, 64))))
    if "conv" in only:
        for cin, cout, k, size in ((64, 64, 3, 56), (116, 116, 1, 28)):
            w, b = _rand(cout, cin, k, k) * 0.05, _rand(cout) * 0.1
            out.append((f"conv2d {cin}->{cout} {k}x{k} {size}x{size} +bias+relu",
                        lambda x, w=w, b=b, p=k // 2: F.relu(F.conv2d(x, w, b, padding=p)),
                        (_rand(1, cin, size, size),)))
    if "llama" in only:
        import transformers as tf

        torch.manual_seed(0)
        cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                             use_cache=False)
        model = tf.LlamaForCausalLM(cfg).eval().half()
        logits = lambda ids: model(ids).logits  # noqa: E731
        logits.model = model
        out.append(("llama fp16 2 layers 1x128", logits, (torch.randint(1, 1000, (1, 128)),)))
    return out


def _float32(fn):
    """fn on float32: a model (``fn.model``) copied and cast, a Linear's float16 weight and bias (its lambda's
    defaults) cast once, any other fn as it is (its float32 inputs make it float32)."""
    model = getattr(fn, "model", None)
    if model is not None:
        m32 = copy.deepcopy(model).float()
        return lambda *a: m32(*a).logits
    if getattr(fn, "__defaults__", None):
        defaults = tuple(d.float() if isinstance(d, torch.Tensor) else d for d in fn.__defaults__)
        return lambda *a: fn(*a, *defaults)
    return fn


def _timed(fn, args, threads: int) -> float:
    clock = time.thread_time if threads == 1 else time.perf_counter
    t = clock()
    fn(*args)
    return (clock() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="linear,bmm,conv,llama")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="")
    ap.add_argument("--fp32", action="store_true", help="also the same workloads in float32 under vtc")
    opts = ap.parse_args()
    torch.set_num_threads(opts.threads)
    rows = []
    for name, fn, args in workloads(set(opts.only.split(","))):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = fn(*args)
            variants = {"eager": fn}
            choices = {}
            for mode in ("auto", "vtc"):
                c = vtc.compile(fn, args, gemm=mode)
                got = c(*args)
                variants[f"vtc {mode}"] = c
                choices[mode] = {"gemm": [f"{g['choice']}:{g['path']}" for g in c.report.to_dict()["gemm"]],
                                 "max_diff": (got.float() - want.float()).abs().max().item(),
                                 "equal": (got == want).float().mean().item()}
            if opts.fp32:  # the same workload in float32 under gemm="auto", for reference
                args32 = tuple(a.float() if a.is_floating_point() else a for a in args)
                fn32 = _float32(fn)
                variants["vtc fp32"] = (lambda c: lambda *_: c(*args32))(vtc.compile(fn32, args32))
            times = {v: [] for v in variants}
            for f in variants.values():
                for _ in range(2):
                    f(*args)
            for _ in range(opts.rounds):
                for v, f in variants.items():
                    times[v].append(_timed(f, args, opts.threads))
        row = {"workload": name, **{v: (round(min(t), 3), round(statistics.median(t), 3)) for v, t in times.items()},
               "choices": choices}
        rows.append(row)
        print(f"{name:40s} " + "  ".join(f"{v} {row[v][0]:.3f}/{row[v][1]:.3f}" for v in variants)
              + f"  auto={choices['auto']['gemm']} eq={choices['vtc']['equal']:.4f}", flush=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f}")
    if opts.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(opts.out, "w") as f:
            json.dump({"threads": opts.threads, "clock": "thread_time" if opts.threads == 1 else "perf_counter",
                       "load": load, "commit": commit, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
