"""Why each movement op ended up where it did, as text.

``explain(graph, plan, report, baseline)`` lists every movement op with its
fate: virtual over which tensors and through which composed mapping (read
through by kernels, a zero-copy view, or realised by one copy), or kept
physical and why, with the planner's estimated saving (and the measured one
in measured mode), or pushed (its inputs stored into its output by the kernels
that compute them, ``vtc.codegen.push``); the planner's notes (memory search,
measurements); then the push alternatives the planner priced, the estimated movement
time of plan none / all / this plan, and the peak memory line
"peak X MB -> Y MB" against ``plan="none"`` (``peak_line``).
"""
from __future__ import annotations

from vtc.ir.graph import Graph
from vtc.plan.cost import fmt_seconds
from vtc.plan.virtualize import Plan

FATES = {
    "virtual": "read through its mapping by generated kernels",
    "view": "a zero-copy strided view",
    "gather": "realised by one copy through its composed mapping",
}


def explain(graph: Graph, plan: Plan, report=None, baseline=None, estimate: bool = True,
            backend: str = "cpu") -> str:
    """Every movement op of `graph` with its fate under `plan` (and `report`'s realisations), and why.

    `baseline`: the report of plan="none" for the peak-memory line.
    `estimate`: also print the estimated movement time of plans none / all / this one.
    """
    fates = {e.node: e.fate for e in report.movement} if report is not None else {}
    pulls = {d.op: d for d in plan.decisions if d.direction == "pull"}
    moves = [n for n in graph.nodes if n.kind == "movement"]
    kept = sum(n.name in plan.kept for n in moves)
    lines = [f"plan={plan.mode} (objective={plan.objective}): {len(moves) - kept}/{len(moves)} movement ops removed, "
             f"{kept} kept physical"]
    lines += [f"  {note}" for note in plan.notes]
    for n in moves:
        op = n.op.split(".")[1] if n.op.startswith("aten.") else n.op
        d = pulls.get(n.name)
        if n.name in plan.kept:
            why = plan.kept[n.name]
            lines.append(f"  {n.name} ({op}): {why if why.startswith('kept') else 'kept physical: ' + why}")
            continue
        if n.name in plan.pushed:
            lines.append(f"  {n.name} ({op}): %{n.outputs[0].name} physical, {plan.pushed[n.name]}")
            continue
        fate = fates.get(n.name, "virtual")
        for o in n.outputs:
            m = plan.mappings.get(o.name)
            if m is None:
                continue
            over = ", ".join(f"%{s}" for s in m.used_sources()) or "constants"
            lines.append(f"  {n.name} ({op}): %{o.name} virtual over {over}, {FATES.get(fate, fate)}")
            lines.extend("      " + line for line in str(m).splitlines())
        if d is not None:
            when = f"round {d.round}" if d.round else "taken"
            measured = f", measured {fmt_seconds(d.measured)}" if d.measured is not None else ""
            lines.append(f"      {when}, estimated {fmt_seconds(d.saving.seconds)}{measured}: {d.reason}")
    pushes = [d for d in plan.decisions if d.direction == "push"]
    if pushes:
        lines += ["", "push alternatives (the producer writes into the op's output):"]
        for d in pushes:
            lines.append(f"  {d.op}: %{d.value} written in place, estimated {fmt_seconds(d.saving.seconds)}: "
                         f"{d.reason}")
    if estimate:
        lines += ["", estimated_times(graph, plan, backend)]
    if report is not None and baseline is not None:
        lines.append(peak_line(baseline.peak_memory_bytes, report.peak_memory_bytes, plan.mode))
    return "\n".join(lines)


def estimated_times(graph: Graph, plan: Plan, backend: str = "cpu") -> str:
    """The cost model's estimate of all movement-related work under plans none, all and `plan`."""
    from vtc.plan.cost import Estimator
    from vtc.plan.vtog import VTOG, node_kinds

    vtog = VTOG(graph, node_kinds(graph, backend), backend)
    est = Estimator(vtog)
    every = frozenset(vtog.pulls)
    mine = frozenset(op for op in vtog.pulls if op not in plan.kept)
    return (f"estimated movement time: plan=none {fmt_seconds(est.total(frozenset()))}, "
            f"plan=all {fmt_seconds(est.total(every))}, plan={plan.mode} {fmt_seconds(est.total(mine))}")


def peak_line(before: int, after: int, mode: str) -> str:
    """ "peak X MB -> Y MB" of live intermediate buffers, plan none against `mode`."""
    change = f" ({(after - before) / before:+.0%})" if before else ""
    return f"peak {_mb(before)} -> {_mb(after)}{change} (plan=none -> plan={mode})"


def compare_peak(graph: Graph, plan: Plan, backend: str = "torch") -> tuple[int, int]:
    """Peak bytes of live intermediate buffers with plan none and with `plan` (the executor's liveness)."""
    from vtc.plan.virtualize import plan_none
    from vtc.runtime.executor import Executor

    return (Executor(graph, plan_none(graph), backend=backend).peak_bytes,
            Executor(graph, plan, backend=backend).peak_bytes)


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.3f} MB" if n < 1 << 24 else f"{n / (1 << 20):.1f} MB"
