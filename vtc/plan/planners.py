"""The ``plan=`` and ``objective=`` options of ``vtc.compile``: one entry that makes the plan.

- ``plan="all"`` / ``"none"``: every movement op virtual / physical (no cost model);
- ``plan="greedy"`` (the default): the global greedy over the cost model
  (``vtc.plan.greedy``); with ``measure_budget_s > 0`` it also times the
  choices whose estimated saving is within ``MARGIN`` of zero (off by default:
  timing builds and runs extra variants of the graph, seconds per choice);
- ``plan="measured"``: the greedy, then every uncertain choice decided by
  timing both variants within ``measure_budget_s`` (``vtc.plan.measure``).

``objective="latency"`` (default) keeps the plan as is; ``objective="memory"``
then lowers its peak memory within ``max_slowdown`` of its estimated latency
(``vtc.plan.memory``).  Greedy plans that time nothing are cached on disk,
keyed by the graph's text form, the options, the machine and vtc's code
(``vtc.plan.cache``).  Every planner is made for the backend that runs the
plan: a generated kernel reads through mappings, a torch op needs a buffer.
"""
from __future__ import annotations

from vtc.ir.graph import Graph
from vtc.plan import cache as plan_cache
from vtc.plan.cost import CostModel, Estimator
from vtc.plan.greedy import PULL, Strategy, plan_of, resume, select
from vtc.plan.virtualize import Plan, plan_all, plan_keeping, plan_none
from vtc.plan.vtog import VTOG, node_kinds

PLANS = ("all", "none", "greedy", "measured")
OBJECTIVES = ("latency", "memory")
MEASURE_BUDGET_S = 5.0  # plan="measured" when measure_budget_s is not given
MARGIN = 0.01  # plan="greedy" with a budget measures choices whose |estimate| is below this share of the latency


def make_plan(graph: Graph, options: dict, model: CostModel | None = None) -> Plan:
    """The plan of `graph` under compile `options` (plan, backend, objective, max_slowdown, measure_budget_s)."""
    mode, backend = options.get("plan", "greedy"), options.get("backend", "cpu")
    objective = options.get("objective", "latency")
    if mode not in PLANS:
        raise ValueError(f"plan={mode!r} is not one of {list(PLANS)}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is not one of {list(OBJECTIVES)}")
    if mode in ("all", "none"):
        if objective != "latency":
            raise ValueError(f"objective={objective!r} needs a cost-driven plan (plan='greedy' or 'measured'), "
                             f"not plan={mode!r}")
        if mode == "none":
            return plan_none(graph)
        pushing = backend == "cpu" and options.get("push", True)
        return plan_all_pushing(graph, options.get("gemm", "auto")) if pushing else plan_all(graph)
    key = None
    if model is None:
        cached, key = plan_cache.load(graph, options)
        if cached is not None:
            return cached
    gemm = options.get("gemm", "auto")
    vtog = VTOG(graph, node_kinds(graph, backend, gemm), backend, gemm)
    est = Estimator(vtog, model)
    strategy = select(vtog, est, (PULL,))
    if backend == "cpu" and options.get("push", True):  # generated kernels store through push mappings
        from vtc.codegen.push import take_pushes

        strategy = resume(vtog, est, take_pushes(graph, vtog, est, strategy, options.get("gemm", "auto")))
    notes = []
    budget = options.get("measure_budget_s")
    if budget is None:
        budget = MEASURE_BUDGET_S if mode == "measured" else 0.0
    if budget > 0:
        from vtc.plan.measure import measure

        state0 = frozenset(c.op for c in strategy.chosen if c.direction == PULL)
        margin = MARGIN * est.latency(state0)
        state, note = measure(graph, vtog, est, strategy, backend, budget, margin, only_near_zero=mode == "greedy",
                              gemm=options.get("gemm", "auto"))
        strategy = _with_state(vtog, strategy, state)
        notes.append(note)
    if objective == "memory":
        from vtc.plan.memory import lower_peak

        slow = options.get("max_slowdown", 0.05)
        state, changed, note = lower_peak(graph, vtog, est, strategy, backend, slow, options.get("gemm", "auto"))
        ops = {d.op for d in changed}
        decisions = [d for d in strategy.decisions if not (d.direction == PULL and d.op in ops)] + changed
        strategy = _with_state(vtog, Strategy(strategy.chosen, decisions), state)
        notes.append(note)
    plan = plan_of(graph, mode, vtog, strategy)
    plan.objective, plan.notes = objective, notes
    if key is not None:
        plan_cache.store(key, plan)
    return plan


def plan_all_pushing(graph: Graph, gemm: str = "auto") -> Plan:
    """plan="all" for generated kernels: every movement op virtual, and where its pull form would be copied
    into memory anyway (a graph output, a library operand) the producers store into it instead (a push)."""
    from vtc.codegen.push import all_pushes

    return plan_keeping(graph, "all", {}, push=all_pushes(graph, gemm))


def _with_state(vtog: VTOG, strategy: Strategy, state: frozenset) -> Strategy:
    """`strategy` with its pull choices replaced by those of `state` (its decisions kept)."""
    chosen = [c for c in strategy.chosen if c.direction != PULL] + [c for c in vtog.choices
                                                                   if c.direction == PULL and c.op in state]
    return Strategy(chosen, strategy.decisions)
