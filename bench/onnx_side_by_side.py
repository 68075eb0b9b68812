"""vtc from the ONNX file vs vtc from the torch model vs ONNX Runtime on that file, side by side in one process.

    PYTHONPATH=$PWD T=1 CPU=1 python bench/onnx_side_by_side.py llama3_decode_b1,c3k2_b1 \
        [eager,onnxruntime,vtc-torch,vtc-onnx,vtc-onnx-plain,onnxruntime-opt,vtc-onnx-opt]

Each workload is exported once as `vtc bench` exports it for ONNX Runtime (``bench.systems.Context.onnx``:
the dynamo exporter, the TorchScript one if that fails or its file is wrong under ONNX Runtime).  Systems:
``eager``; ``onnxruntime`` (all graph optimisations, T intra-op threads); ``vtc-torch``: ``vtc.compile(model,
inputs)``; ``vtc-onnx``: ``vtc.compile(path, inputs)`` (the ONNX frontend, ``vtc.frontend.onnx``);
``vtc-onnx-plain``: the same with the exporter-pattern rewrites off (``vtc.frontend.onnx_ops.REWRITE =
False``: each ONNX node lowered on its own, the frontend before they were added); ``onnxruntime-opt`` /
``vtc-onnx-opt``: ONNX Runtime / vtc on the file rewritten by onnxruntime's transformer optimizer
(``onnxruntime.transformers.optimizer.optimize_model``, model_type "gpt2", heads and hidden size detected: an
exported Llama's RMSNorms become SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization).
Every vtc result is checked against eager and against ONNX Runtime (``bench.harness.compare``: max error
relative to the output's largest magnitude <= ``bench.harness.RTOL``), and the plan of each ONNX variant is
compared with vtc-torch's (movement ops eliminated / total, materialised movement bytes, kernel kinds, GEMM
paths, fallback ops).  ``EXPORTER=torchscript`` exports with the TorchScript exporter instead.  Timing as
bench/units_side_by_side.py: interleaved rounds (N, default 25), ``T`` threads (default 1), ``CPU=1`` for the
calling thread's CPU time (only with T=1); min and median per system, and vtc-onnx's ratio to each other system.
"""
import collections
import functools
import os
import sys
import tempfile
from pathlib import Path

import torch

T = int(os.environ.get("T", 1))
torch.set_num_threads(T)
clk = __import__("time").thread_time if os.environ.get("CPU") else __import__("time").perf_counter

import vtc  # noqa: E402
from bench.gemm_side_by_side import time_side_by_side  # noqa: E402
from bench.harness import compare  # noqa: E402
from bench.systems import Context, _eager, _onnxruntime, flat_outputs  # noqa: E402
from bench.workloads import get  # noqa: E402
from vtc.frontend import onnx_ops  # noqa: E402

DEFAULT = "eager,onnxruntime,vtc-torch,vtc-onnx"


def plan_summary(compiled) -> dict:
    """What the plan did, in the terms the torch and ONNX paths should agree on."""
    d = compiled.report.to_dict()
    kinds = collections.Counter()
    for s in compiled._first.executor.steps:
        kinds[f"kernel:{s.kernel.step.kernel.kind}" if s.kind == "kernel" else
              f"run:{s.node.op}" if s.kind == "run" else s.kind] += 1
    return {"movement eliminated": f"{d['eliminated_movement_ops']}/{d['movement_ops']}",
            "materialised bytes": d["materialized_movement_bytes"], "peak bytes": d["peak_memory_bytes"],
            "steps": dict(sorted(kinds.items())),
            "gemm": dict(sorted(collections.Counter(f"{g['choice']}:{g.get('path') or 'library'}"
                                                    for g in d["gemm"]).items())),
            "fallback": sorted(set(d["fallback_ops"]))}


def compile_onnx(path, inputs, rewrite: bool):
    keep = onnx_ops.REWRITE
    onnx_ops.REWRITE = rewrite
    try:
        return vtc.compile(str(path), [t.contiguous() for t in inputs])
    finally:
        onnx_ops.REWRITE = keep


@functools.lru_cache(maxsize=None)
def ort_optimized(path: Path) -> Path:
    """The file as onnxruntime's transformer optimizer rewrites it (fused norms, attention where it matches)."""
    from onnxruntime.transformers.optimizer import optimize_model

    out = path.with_name(path.stem + "_ort_opt.onnx")
    optimize_model(str(path), model_type="gpt2", num_heads=0, hidden_size=0).save_model_to_file(str(out))
    return out


def main(names: list[str], systems: list[str], rounds: int) -> None:
    for name in names:
        model, inputs = get(name).build()
        ctx = Context(name, model, inputs, T, Path(tempfile.mkdtemp()))
        with torch.no_grad():
            ref = flat_outputs(model(*inputs))
        if os.environ.get("EXPORTER") == "torchscript":
            path = ctx.workdir / f"{name}.onnx"
            with torch.no_grad():
                torch.onnx.export(model, inputs, str(path), dynamo=False)
            ctx.onnx_path, ctx.export = path, {"exporter": "torchscript", "bytes": path.stat().st_size}
        path = ctx.onnx()
        ort = _onnxruntime(ctx).fn
        ort_out = flat_outputs(ort())
        print(f"== {name}: {ctx.export['exporter']} export, {ctx.export['bytes'] / 1e6:.1f} MB", flush=True)
        fns, plans = {}, {}
        for s in systems:
            if s == "eager":
                fns[s] = _eager(ctx).fn
                continue
            if s == "onnxruntime":
                fns[s] = ort
                continue
            if s == "onnxruntime-opt":
                octx = Context(name, model, inputs, T, ctx.workdir, onnx_path=ort_optimized(path))
                fns[s] = _onnxruntime(octx).fn
                continue
            if s == "vtc-torch":
                c = vtc.compile(model, inputs)
                fns[s] = (lambda c: lambda: c(*inputs))(c)
            elif s in ("vtc-onnx", "vtc-onnx-plain", "vtc-onnx-opt"):
                opt = s == "vtc-onnx-opt"
                c = compile_onnx(ort_optimized(path) if opt else path, inputs, s != "vtc-onnx-plain")
                arrays = [t.contiguous() for t in inputs]
                fns[s] = (lambda c, a: lambda: c(a))(c, arrays)
            else:
                raise ValueError(f"unknown system {s!r}")
            got = flat_outputs(fns[s]())
            got = [g.reshape(r.shape) if g.numel() == r.numel() else g for g, r in zip(got, ref)]
            for what, want in (("eager", ref), ("onnxruntime", ort_out)):
                ok, err, why = compare(want, got)
                if not ok:
                    raise AssertionError(f"{name} {s} vs {what}: {why}")
                print(f"   {s} vs {what}: max relative error {err:.2g}", flush=True)
            plans[s] = plan_summary(c)
        if "vtc-torch" in plans:
            base = plans["vtc-torch"]
            for key in base:
                line = f"   {key:20s} vtc-torch {base[key]}"
                for s, p in plans.items():
                    if s != "vtc-torch":
                        line += f" | {s} " + ("same" if p[key] == base[key] else str(p[key]))
                print(line, flush=True)
        with torch.no_grad():
            times = time_side_by_side(fns, rounds, clk)
        for agg in ("min", "median"):
            ms = {s: t[f"{agg}_ms"] for s, t in times.items()}
            ratio = "  ".join(f"{s}/vtc-onnx {v / ms['vtc-onnx']:.2f}x" for s, v in ms.items()
                              if s != "vtc-onnx" and "vtc-onnx" in ms)
            print(f"{name:24s} {agg:6s} " + "  ".join(f"{s} {v:.3f}" for s, v in ms.items()) + "   " + ratio,
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), (sys.argv[2] if len(sys.argv) > 2 else DEFAULT).split(","),
         int(os.environ.get("N", 25)))
