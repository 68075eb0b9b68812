"""``vtc analyze MODEL``: capture, plan, check against eager, print the movement-op census.

MODEL is a built-in name (``vtc.zoo.NAMES``) or a ``pkg.module:factory`` path.
Prints every movement op with its bytes and fate, the composed mapping of each
chain of movement ops and whether it is a plain strided view, the summary
counts against ``plan="none"``, and a quick eager-vs-vtc latency (medians in
one process; the benchmark suite is ``vtc bench``).  ``--explain`` adds every
movement op's fate and the planner's reason as text, ``--html FILE`` the same
as a page with pictures of the graph before and after (``vtc.plan.html``).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.utils._pytree as pytree


RUNS = 10


def _median_ms(fn, inputs) -> float:
    """Median wall time of fn(*inputs) in ms over RUNS calls after two warm-up calls."""
    times = []
    with torch.no_grad():
        for k in range(RUNS + 2):
            t0 = time.perf_counter()
            fn(*inputs)
            if k >= 2:
                times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def register(sub) -> None:
    """Adds the `analyze` subcommand."""
    from vtc import zoo
    from vtc.compiler import OPTIONS, PLANS
    from vtc.plan.planners import OBJECTIVES

    a = sub.add_parser("analyze", help="movement-op census of a model")
    a.add_argument("model", help=f"built-in name ({', '.join(zoo.NAMES)}) or pkg.module:factory")
    a.add_argument("--size", default="small", choices=zoo.SIZES)
    a.add_argument("--plan", default=OPTIONS["plan"], choices=sorted(PLANS))
    a.add_argument("--objective", default=OPTIONS["objective"], choices=OBJECTIVES,
                   help="latency, or memory: the lowest peak within --max-slowdown of the latency plan")
    a.add_argument("--max-slowdown", type=float, default=OPTIONS["max_slowdown"], metavar="FRACTION")
    a.add_argument("--measure-budget", type=float, default=None, metavar="SECONDS",
                   help="seconds for timing uncertain choices (plan measured: default 5; greedy: default 0)")
    a.add_argument("--graph", action="store_true", help="print the captured graph IR first")
    a.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    a.add_argument("--explain", action="store_true",
                   help="after the census, every movement op's fate and the planner's reason (vtc.plan.explain)")
    a.add_argument("--html", metavar="FILE", help="also write the explain report as an HTML page with pictures")
    a.set_defaults(func=analyze)


def _max_error(got, want) -> float:
    a = [t for t in pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
    b = [t for t in pytree.tree_leaves(want) if isinstance(t, torch.Tensor)]
    if len(a) != len(b):
        raise AssertionError(f"compiled model returned {len(a)} tensors, eager {len(b)}")
    return max((float((x.double() - y.double()).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


def analyze(args: argparse.Namespace) -> int:
    """Captures MODEL, plans it, checks it against eager and prints the census."""
    import vtc
    from vtc import zoo

    torch.manual_seed(0)
    model, inputs = zoo.load(args.model, size=args.size)
    t0 = time.perf_counter()
    options = dict(plan=args.plan, objective=getattr(args, "objective", "latency"),
                   max_slowdown=getattr(args, "max_slowdown", 0.05),
                   measure_budget_s=getattr(args, "measure_budget", None))
    compiled = vtc.compile(model, inputs, **options)
    compile_s = time.perf_counter() - t0
    with torch.no_grad():
        want = model(*inputs)
        got = compiled(*inputs)
    err = _max_error(got, want)
    baseline = vtc.compile(model, inputs, plan="none").report if args.plan != "none" else compiled.report
    report = compiled.report
    if args.graph:
        print(compiled.graph)
        print()
    print(f"model {args.model} ({args.size}): {len(compiled.graph.nodes)} ATen nodes, "
          f"inputs {[list(t.shape) for t in inputs]}, captured and planned in {compile_s:.1f} s")
    print(report)
    print()
    print(f"max |vtc - eager| = {err:.3g}")
    print(f"materialised movement per call: {baseline.materialized_movement_bytes:,} B with plan=none -> "
          f"{report.materialized_movement_bytes:,} B with plan={args.plan}")
    print(f"peak intermediate memory: {baseline.peak_memory_bytes:,} B with plan=none -> "
          f"{report.peak_memory_bytes:,} B with plan={args.plan}")
    eager_ms, vtc_ms = _median_ms(model, inputs), _median_ms(compiled, inputs)
    print(f"latency (median of {RUNS} after warm-up, {torch.get_num_threads()} threads): eager {eager_ms:.2f} ms, "
          f"vtc {vtc_ms:.2f} ms ({eager_ms / vtc_ms:.2f}x) — one process, not a benchmark: see BENCHMARKS.md")
    if getattr(args, "explain", False):
        from vtc.plan.explain import explain

        print()
        print(explain(compiled.graph, compiled._first.plan, report, baseline, backend=compiled.options["backend"]))
    if getattr(args, "html", None):
        from vtc.plan.html import page

        with open(args.html, "w", encoding="utf-8") as f:
            f.write(page(compiled.graph, compiled._first.plan, report, baseline,
                         title=f"vtc explain: {args.model} ({args.size})"))
        print(f"wrote {args.html}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "size": args.size, "max_error": err,
                       "report": report.to_dict(), "baseline": baseline.to_dict()}, f, indent=1)
    return 0 if err <= 1e-3 else 1
