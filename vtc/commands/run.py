"""``vtc run MODEL.onnx``: compile an ONNX model with vtc, run it, compare with onnxruntime.

    vtc run model.onnx [--inputs file.npz] [--dim name=value ...] [--plan all|none|...] [--runs N]

Inputs come from ``--inputs`` (arrays named like the model's inputs, or
``arr_0, arr_1, ...`` in input order, as ``np.savez`` names them) or are random,
from the model's input specs: float inputs ``randn``; integer inputs
``randint`` in ``[0, bound)``, where ``bound`` is the smallest dim that a
Gather/GatherElements of a constant table indexes with that input (so token ids
stay valid), else 2; bool inputs random.  Symbolic dims take their values from
``--dim`` (or from the ``--inputs`` arrays).  Prints the max error against
onnxruntime, the median time of both over ``--runs`` calls, and vtc's report
(its summary, then the movement-op census).  Exit code 0 when the outputs
match (``|vtc - ort| <= 1e-4 + 1e-3 |ort|``), 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

RTOL, ATOL = 1e-3, 1e-4


def register(sub) -> None:
    """Adds the `run` subcommand."""
    r = sub.add_parser("run", help="compile and run an ONNX model with vtc; compare with onnxruntime")
    r.add_argument("model", help="path to an .onnx file")
    r.add_argument("--inputs", metavar="FILE.npz", help="input arrays (by input name, or arr_0, arr_1, ...)")
    r.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                   help="value of a symbolic input dim (repeatable)")
    from vtc.compiler import PLANS

    r.add_argument("--plan", default="all", choices=tuple(PLANS), help="which movement ops become virtual")
    r.add_argument("--runs", type=int, default=5, help="timed calls of each runtime (median is printed)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    r.add_argument("--json", metavar="FILE", help="also write the errors, timings and report as JSON")
    r.set_defaults(func=run)


def parse_dims(items: list[str]) -> dict[str, int]:
    """``["batch=2", "seq=8"]`` -> ``{"batch": 2, "seq": 8}``; ValueError naming a malformed item."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"--dim {item!r}: expected NAME=INTEGER, e.g. --dim batch=2")
        out[name.strip()] = int(value)
    return out


def _index_bounds(proto) -> dict[str, int]:
    """Input name -> the smallest dim it indexes in a Gather/GatherElements of a constant table."""
    from onnx import helper

    consts = {t.name: list(t.dims) for t in proto.graph.initializer}
    for n in proto.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = list(n.attribute[0].t.dims)
    bounds: dict[str, int] = {}
    for n in proto.graph.node:
        if n.op_type in ("Gather", "GatherElements") and len(n.input) > 1 and n.input[0] in consts:
            axis = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "axis"), 0)
            dims = consts[n.input[0]]
            if dims:
                size = dims[axis % len(dims)]
                bounds[n.input[1]] = min(bounds.get(n.input[1], size), size)
    return bounds


def random_inputs(proto, dims: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs from the model's input specs (see the module docstring for the rules)."""
    import torch

    from vtc.frontend.onnx import input_specs

    rng = np.random.default_rng(seed)
    bounds = _index_bounds(proto)
    feeds = {}
    for spec in input_specs(proto):
        shape = spec.resolve(dims)
        if spec.dtype == torch.bool:
            a = rng.random(shape) < 0.5
        elif spec.dtype.is_floating_point:
            a = rng.standard_normal(shape).astype(np.float32)
        else:
            a = rng.integers(0, max(bounds.get(spec.name, 2), 1), size=shape)
        feeds[spec.name] = np.asarray(a).astype(torch.empty((), dtype=spec.dtype).numpy().dtype)
    return feeds


def load_inputs(path: str, proto) -> dict[str, np.ndarray]:
    """Arrays of an .npz file keyed by input name (or ``arr_k`` for the k-th input)."""
    from vtc.frontend.onnx import input_specs

    names = [s.name for s in input_specs(proto)]
    with np.load(path) as data:
        keys = list(data.keys())
        out = {}
        for k, name in enumerate(names):
            key = name if name in data else f"arr_{k}" if f"arr_{k}" in data else None
            if key is None:
                raise ValueError(f"{path}: no array for input {name!r} (found {keys}; name arrays like the "
                                 f"model's inputs {names}, or save them positionally)")
            out[name] = np.asarray(data[key])
    return out


def _median_ms(fn, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(max(runs, 1)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace) -> int:
    """Compiles MODEL.onnx, runs it against onnxruntime and prints errors, timings and the report."""
    import onnxruntime as ort
    import torch

    from vtc.frontend.onnx import compile_onnx, load_model, output_names

    dims = parse_dims(args.dim)
    proto = load_model(args.model)
    feeds = load_inputs(args.inputs, proto) if args.inputs else random_inputs(proto, dims, args.seed)
    t0 = time.perf_counter()
    compiled = compile_onnx(proto, feeds, dims=dims, plan=args.plan)
    compile_s = time.perf_counter() - t0

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    got = compiled(feeds)
    names = output_names(proto)
    errors = {}
    ok = True
    for name, g, w in zip(names, got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            raise ValueError(f"output {name!r}: vtc gives shape {list(g.shape)}, onnxruntime {list(w.shape)}")
        diff = np.abs(g.astype(np.float64) - w.astype(np.float64)) if g.size else np.zeros(1)
        errors[name] = float(np.nanmax(diff)) if diff.size else 0.0
        ok &= bool(np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=RTOL, atol=ATOL, equal_nan=True))
    vtc_ms = _median_ms(lambda: compiled(feeds), args.runs)
    ort_ms = _median_ms(lambda: sess.run(None, feeds), args.runs)

    graph, report = compiled.graph, compiled.report
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), "?")
    shapes = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in feeds.items())
    print(f"model {args.model}: opset {opset}, {len(proto.graph.node)} ONNX nodes -> {len(graph.nodes)} ATen nodes; "
          f"inputs {shapes}; compiled in {compile_s:.2f} s")
    worst = max(errors, key=errors.get) if errors else None
    print(f"max |vtc - onnxruntime| = {errors[worst] if worst else 0.0:.3g}"
          + (f" (output {worst!r})" if worst and len(errors) > 1 else "") + ("" if ok else "  MISMATCH"))
    print(f"median time over {args.runs} runs: vtc {vtc_ms:.3f} ms, onnxruntime {ort_ms:.3f} ms")
    reasons = graph.meta.get("fallback_reasons", {})
    if reasons:
        by_name = {n.name: n.op for n in graph.nodes}
        print("run by onnxruntime: " + "; ".join(f"{n} ({by_name.get(n, '?')}): {why}" for n, why in reasons.items()))
    print()
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": str(args.model), "max_error": errors, "match": ok, "vtc_ms": vtc_ms,
                       "onnxruntime_ms": ort_ms, "compile_s": compile_s, "report": report.to_dict()}, f, indent=1)
    return 0 if ok else 1
