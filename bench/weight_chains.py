"""x @ f(W)^T with a constant weight W behind a movement chain f, timed side by side in one process.

    python -m bench.weight_chains [--rows 1,5,64,512] [--weights 1024x1024,4096x1024] [--chains ...] [--rounds 7]

For each chain (identity, flip(0), roll(3, 0), cat of two weights along N, a gather of W's columns, pad along N),
row count and weight (N x K): torch eager, vtc (gemm="auto") on f(W) and vtc on the plain W, interleaved round
after round, 1 thread, CPU time of the calling thread (median ms per call over the rounds); the path vtc took
(``report.to_dict()["gemm"]``) and the packed copies the call plan holds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import vtc


class Chain(torch.nn.Module):
    """F.linear(x, f(W)): W [N, K] one parameter, or for "cat" two [N / 2, K] ones."""

    def __init__(self, kind: str, n: int, k: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.kind = kind
        rows = n // 2 if kind == "cat" else n - 8 if kind == "pad" else n
        self.w = torch.nn.Parameter(torch.randn(rows, k, generator=g) / k ** 0.5)
        if kind == "cat":
            self.w2 = torch.nn.Parameter(torch.randn(n - rows, k, generator=g) / k ** 0.5)
        if kind == "gather":
            self.register_buffer("perm", torch.randperm(k, generator=g))

    def weight(self) -> torch.Tensor:
        w = self.w
        if self.kind == "flip":
            return w.flip(0)
        if self.kind == "roll":
            return w.roll(3, 0)
        if self.kind == "cat":
            return torch.cat([w, self.w2], 0)
        if self.kind == "gather":
            return w[:, self.perm]
        if self.kind == "pad":
            return F.pad(w, (0, 0, 0, 8))
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight())


class CatConv(torch.nn.Module):
    """A k x k convolution (c -> o channels, padding k // 2) on the cat of two weights of o / 2 output channels, or
    on one weight (`plain`)."""

    def __init__(self, c: int, o: int, k: int, plain: bool, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.plain = plain
        parts = [o] if plain else [o // 2, o - o // 2]
        self.ws = torch.nn.ParameterList(torch.randn(n, c, k, k, generator=g) / (c * k * k) ** 0.5 for n in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.ws[0] if self.plain else torch.cat(list(self.ws), 0)
        return F.conv2d(x, w, padding=w.shape[-1] // 2)


def time_side_by_side(fns: dict, rounds: int) -> dict:
    """{name: median ms per call} of 1-thread CPU time, the systems interleaved round after round."""
    reps = {}
    for name, fn in fns.items():
        fn(); fn()
        t0 = time.thread_time()
        fn()
        reps[name] = max(1, int(0.15 / max(time.thread_time() - t0, 1e-6)))
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t0 = time.thread_time()
            for _ in range(reps[name]):
                fn()
            samples[name].append((time.thread_time() - t0) / reps[name] * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def _describe(compiled) -> str:
    paths = [f"{q['choice']}:{q.get('path') or q.get('library') or '-'}" for q in compiled.report.to_dict()["gemm"]]
    plan = compiled._first.executor.call_plan()
    packed = plan.counts.get("packed_conv_weights", 0) + plan.counts.get("packed_weights", 0)
    return f"{','.join(paths)} packed={packed}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,5,64,512")
    p.add_argument("--weights", default="1024x1024,4096x1024")
    p.add_argument("--chains", default="identity,flip,roll,cat,gather,pad")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--conv", default="", help="C,O,K,HW;...: convolutions on a cat of two weights instead")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"# load {os.getloadavg()}", flush=True)
    if args.conv:
        return convs(args)
    print("| weight N x K | rows | chain | eager ms | vtc ms | vtc plain W ms | vtc / plain | vtc path | plain path |")
    print("|---|---|---|---|---|---|---|---|---|")
    for wspec in args.weights.split(","):
        n, k = map(int, wspec.split("x"))
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            plain = Chain("identity", n, k)
            with torch.no_grad():
                cplain = vtc.compile(plain, (x,))
            for kind in args.chains.split(","):
                model = Chain(kind, n, k)
                with torch.no_grad():
                    c = vtc.compile(model, (x,))
                    torch.testing.assert_close(c(x), model(x), rtol=1e-4, atol=1e-4)
                    t = time_side_by_side({"eager": lambda: model(x), "vtc": lambda: c(x),
                                           "plain": lambda: cplain(x)}, args.rounds)
                print(f"| {n} x {k} | {m} | {kind} | {t['eager']:.3f} | {t['vtc']:.3f} | {t['plain']:.3f} | "
                      f"{t['vtc'] / t['plain']:.2f} | {_describe(c)} | {_describe(cplain)} |", flush=True)
    print(f"# load {os.getloadavg()}", flush=True)


def convs(args) -> None:
    """The --conv table: eager, vtc on the cat of two weights, vtc on one weight."""
    print("| conv C -> O, K x K, H = W | eager ms | vtc ms | vtc plain W ms | vtc / plain | vtc path | plain path |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.conv.split(";"):
        c, o, k, hw = map(int, spec.split(","))
        x = torch.randn(1, c, hw, hw, generator=torch.Generator().manual_seed(hw))
        model, plain = CatConv(c, o, k, False), CatConv(c, o, k, True)
        with torch.no_grad():
            cm, cp = vtc.compile(model, (x,)), vtc.compile(plain, (x,))
            torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
            t = time_side_by_side({"eager": lambda: model(x), "vtc": lambda: cm(x), "plain": lambda: cp(x)},
                                  args.rounds)
        print(f"| {c} -> {o}, {k} x {k}, {hw} | {t['eager']:.3f} | {t['vtc']:.3f} | {t['plain']:.3f} | "
              f"{t['vtc'] / t['plain']:.2f} | {_describe(cm)} | {_describe(cp)} |", flush=True)
    print(f"# load {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
