"""The ``vtc`` command line.

    vtc analyze MODEL [--size small|tiny] [--plan all|none] [--graph] [--json FILE]

MODEL is a built-in name (``vtc.zoo.NAMES``) or a ``pkg.module:factory`` path.
``analyze`` captures the model, plans it, checks the compiled result against
eager on the example inputs, and prints the movement-op census: every movement
op with its bytes and fate, the composed mapping of each chain of movement ops
and whether it is a plain strided view, and the summary counts.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.utils._pytree as pytree


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
    compiled = vtc.compile(model, inputs, plan=args.plan)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "size": args.size, "max_error": err,
                       "report": report.to_dict(), "baseline": baseline.to_dict()}, f, indent=1)
    return 0 if err <= 1e-3 else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vtc` command."""
    from vtc import zoo

    p = argparse.ArgumentParser(prog="vtc", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("analyze", help="movement-op census of a model")
    a.add_argument("model", help=f"built-in name ({', '.join(zoo.NAMES)}) or pkg.module:factory")
    a.add_argument("--size", default="small", choices=("tiny", "small"))
    a.add_argument("--plan", default="all", choices=("all", "none"))
    a.add_argument("--graph", action="store_true", help="print the captured graph IR first")
    a.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    args = p.parse_args(argv)
    try:
        return {"analyze": analyze}[args.command](args)
    except (ValueError, TypeError, RuntimeError, ImportError) as e:
        print(f"vtc {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
