"""Module switches off vs on, side by side in one process: whole workloads, or single kernels of one.

Each switch is ``module.ATTR=off:on`` (Python literals), e.g. ``vtc.codegen.conv_direct.ENABLED=False:True``;
the workload is compiled once with every switch at its ``off`` value and once at ``on`` (the kernel cache is
keyed by the source text, so both builds coexist), then the calls alternate::

    PYTHONPATH=$PWD python bench/switch_ablation.py shufflenet_v2_model \\
        vtc.codegen.conv_direct.ENABLED=False:True vtc.codegen.depthwise.PREFETCH_ROWS=0:2 [--others] [--rounds 60]
    PYTHONPATH=$PWD python bench/switch_ablation.py shufflenet_v2_model vtc.codegen.cpp.SUM_TAIL_APART=False:True \\
        --kernels k_mean

Whole workloads: per round one call of each build (``--others``: and of ONNX Runtime and OpenVINO), 3 warm-up
calls, min / median ms.  ``--kernels``: each named kernel of both builds called alone on the same random
operands, blocks of 100 calls alternating (9 blocks), min / median us.  One thread, the calling thread's CPU
time (the comparison that holds on a machine loaded above its core count).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
clk = time.thread_time

import vtc  # noqa: E402
from bench.workloads import get  # noqa: E402


def parse_switch(text: str):
    """(module, attribute, off value, on value) of ``module.ATTR=off:on``."""
    name, values = text.split("=", 1)
    mod, attr = name.rsplit(".", 1)
    off, on = values.split(":", 1)
    return importlib.import_module(mod), attr, ast.literal_eval(off), ast.literal_eval(on)


def build(name: str, switches: list) -> tuple:
    """The workload's model and inputs, compiled with the switches off and on (restored to on's values after)."""
    model, inputs = get(name).build()
    builds = []
    for i in (0, 1):
        for mod, attr, *v in switches:
            setattr(mod, attr, v[i])
        builds.append(vtc.compile(model, inputs))
    return model, inputs, builds


def whole(name: str, switches: list, rounds: int, others: bool) -> None:
    model, inputs, (off, on) = build(name, switches)
    fns = {"off": lambda: off(*inputs), "on": lambda: on(*inputs)}
    if others:
        from bench.systems import Context, _onnxruntime, _openvino

        ctx = Context(name, model, inputs, 1, Path(tempfile.mkdtemp()))
        fns["onnxruntime"], fns["openvino"] = _onnxruntime(ctx).fn, _openvino(ctx).fn
    with torch.no_grad():
        ref = model(*inputs)
        err = (on(*inputs) - ref).abs().max().item() if torch.is_tensor(ref) else float("nan")
        times = {k: [] for k in fns}
        for f in fns.values():
            for _ in range(3):
                f()
        for _ in range(rounds):
            for k, f in fns.items():
                t0 = clk()
                f()
                times[k].append(clk() - t0)
    ratio = statistics.median(times["on"]) / statistics.median(times["off"])
    print(f"{name:22s} " + "  ".join(f"{k} {min(v) * 1e3:.3f}/{statistics.median(v) * 1e3:.3f}" for k, v in times.items())
          + f"  (min/median ms)  on/off median {ratio:.3f}  max |on - eager| {err:.1e}", flush=True)


def kernels(name: str, switches: list, names: list[str]) -> None:
    _, _, builds = build(name, switches)
    for kn in names:
        cks = [next(s.kernel for s in b._first.executor.steps if s.kind == "kernel" and s.kernel.step.kernel.name == kn)
               for b in builds]
        ts = [torch.randn(b.shape).to(b.dtype) for b in cks[1].order]
        res: list[list[float]] = [[], []]
        for _ in range(9):
            for i, ck in enumerate(cks):
                ptrs = ck._pointers(*[t.data_ptr() for t in ts])
                t0 = clk()
                for _ in range(100):
                    ck.fn(ptrs, 1)
                res[i].append((clk() - t0) / 100 * 1e6)
        print(f"{kn:32s} off {min(res[0]):8.2f}/{statistics.median(res[0]):8.2f}  on {min(res[1]):8.2f}/"
              f"{statistics.median(res[1]):8.2f}  (min/median us, alone)", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workloads", help="comma-separated bench workloads")
    p.add_argument("switches", nargs="+", help="module.ATTR=off:on")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--others", action="store_true", help="also ONNX Runtime and OpenVINO")
    p.add_argument("--kernels", default="", help="time these kernels alone instead (comma-separated names)")
    args = p.parse_args(argv)
    switches = [parse_switch(s) for s in args.switches]
    for name in args.workloads.split(","):
        if args.kernels:
            kernels(name, switches, args.kernels.split(","))
        else:
            whole(name, switches, args.rounds, args.others)


if __name__ == "__main__":
    main()
