"""The global greedy planner: which movement ops to remove, chosen by estimated saving.

``select(vtog, estimator)`` starts with every tensor physical.  Each round it
takes the choice (all compatible edges into one node: the pulls of one op, or
its pushes) with the largest estimated saving, drops the choices that conflict
with it, and re-estimates the savings of the choices in its connected group of
movement ops (their composed mappings, realisations and kept copies may have
changed).  When no single choice pays, it tries each group's remaining pulls
together (a chain that is not a strided view pays only as a whole: one copy
instead of one per op) and takes the best if it pays.  It stops when nothing
is positive.  Every choice ends with one
``Decision`` — taken (in which round, saving what) or not (conflict, no gain,
not lowerable) — so every kept op has a logged reason and an estimate.

``plan_greedy(graph)`` is the ``plan="greedy"`` entry: it lowers the pull
choices taken into the same ``Plan`` as ``plan_all`` (``plan_keeping``), with
``plan.kept`` reasons like "kept physical: composed mapping reads stride 128
inside a GEMM operand (aten.bmm.default): the library copies it anyway;
estimated +0.00 µs" and ``plan.decisions`` the log.  Push choices are taken
when the planner is given them (``vtc.plan.planners``: generated kernels store
through push mappings, ``vtc.codegen.push``), else priced and logged.
``plan_of`` turns any strategy into that ``Plan``; ``vtc.plan.planners`` is the
entry of the ``plan=`` / ``objective=`` options, which may measure choices
(``vtc.plan.measure``) or trade latency for peak memory (``vtc.plan.memory``)
before it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vtc.ir.graph import Graph
from vtc.plan.cost import CostModel, Estimator, Saving, fmt_seconds
from vtc.plan.virtualize import Plan, plan_keeping
from vtc.plan.vtog import PULL, PUSH, VTOG, Choice, node_kinds

EPSILON_S = 1e-12  # a saving must beat this to be taken (ties of equal work are left physical)
NOT_LOWERED = "push: priced, not taken here: generated kernels take pushes after the pulls, other backends never"


@dataclass
class Decision:
    """What the planner did with one choice: the tensor it concerns, the op, taken or not, and why."""

    value: str  # the (first) tensor the choice would make virtual
    op: str  # the movement node removed by the choice
    chosen: bool
    saving: Saving
    reason: str
    direction: str = PULL
    round: int | None = None  # the round it was taken (or dropped by a conflict) in
    measured: float | None = None  # measured saving in seconds (vtc.plan.measure), None when not measured

    def __str__(self) -> str:
        what = f"round {self.round}: took" if self.chosen and self.round else "took" if self.chosen else "left"
        return f"{what} {self.direction} {self.op} (%{self.value}) {fmt_seconds(self.saving.seconds)}: {self.reason}"


@dataclass
class Strategy:
    """A conflict-free set of choices and the log of how it was found."""

    chosen: list[Choice] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def decision(self, op: str, direction: str = PULL) -> Decision | None:
        return next((d for d in self.decisions if d.op == op and d.direction == direction), None)


def select(vtog: VTOG, estimator: Estimator, directions: tuple[str, ...] = (PULL,)) -> Strategy:
    """The greedy strategy over the choices in `directions` (the others are priced and logged, never taken)."""
    out = Strategy()
    state: frozenset[str] = frozenset()
    alive: list[Choice] = []
    for c in vtog.choices:
        if c.invalid:
            out.decisions.append(Decision(c.values[0], c.op, False, Saving(0.0, c.invalid), c.invalid, c.direction))
        elif c.direction not in directions:
            continue  # logged at the end, priced against the final state
        else:
            alive.append(c)
    state, saving = _rounds(vtog, estimator, alive, state, out, 0)
    for c in alive:
        s = saving[c.name]
        out.decisions.append(Decision(c.values[0], c.op, False, s, s.reason, c.direction))
    for c in vtog.choices:
        if not c.invalid and c.direction not in directions:
            s = estimator.saving(c, state)
            why = NOT_LOWERED if c.direction == PUSH else f"{c.direction} choices are not taken"
            out.decisions.append(Decision(c.values[0], c.op, False, s, f"{why} ({s.reason})", c.direction))
    return out


def _rounds(vtog: VTOG, estimator: Estimator, alive: list[Choice], state: frozenset, out: Strategy,
            rnd: int) -> tuple[frozenset, dict]:
    """The greedy's rounds from `state` over the choices in `alive` (taken ones and conflicting ones leave
    it, with their decisions in `out`); returns the final state and the last saving of each choice."""
    order = {c.name: k for k, c in enumerate(vtog.choices)}
    saving = {c.name: estimator.saving(c, state) for c in alive}
    while alive:
        best = max(alive, key=lambda c: (saving[c.name].seconds, -order[c.name]))
        taken = [best] if saving[best.name].seconds > EPSILON_S else _escape(alive, estimator, state)
        if not taken:
            break
        rnd += 1
        together = None if len(taken) == 1 else estimator.saving_of({c.op for c in taken}, state)
        for c in taken:
            alive.remove(c)
            out.chosen.append(c)
            s = saving[c.name] if together is None else together
            why = s.reason if together is None else (
                f"taken with the {len(taken) - 1} other remaining ops of its group, which together save "
                f"{fmt_seconds(together.seconds)} (alone: {fmt_seconds(saving[c.name].seconds)}, "
                f"{saving[c.name].reason})")
            out.decisions.append(Decision(c.values[0], c.op, True, s, why, c.direction, rnd))
        state = state | {c.op for c in taken if c.direction == PULL}
        for c in list(alive):
            why = next((w for t in taken if (w := vtog.conflict(t, c))), None)
            if why:
                alive.remove(c)
                out.decisions.append(Decision(c.values[0], c.op, False, saving[c.name],
                                              f"conflicts with {taken[0].name}: {why}", c.direction, rnd))
        groups = {estimator.component.get(t.op) for t in taken if t.direction == PULL}
        for c in alive:
            if c.direction == PULL and estimator.component.get(c.op) in groups:
                saving[c.name] = estimator.saving(c, state)
    return state, saving


def resume(vtog: VTOG, estimator: Estimator, strategy: Strategy) -> Strategy:
    """`strategy` with the pulls it left priced again once its pushes are taken, and taken while they pay.

    Pulls come first and pushes second (``vtc.codegen.push.take_pushes``), so a
    pull was priced while the op it feeds was still kept: the V projection's
    transpose in front of a KV-cache update was kept physical because, virtual,
    torch's index_put would read it through a view.  Once the update is pushed,
    its writer reads the transpose through its mapping as a kernel does.
    """
    pushed = frozenset(c.op for c in strategy.chosen if c.direction == PUSH)
    if not pushed:
        return strategy
    estimator.pushed = pushed
    state = frozenset(c.op for c in strategy.chosen if c.direction == PULL)
    alive = [c for c in vtog.choices if c.direction == PULL and not c.invalid and c.op not in state
             and c.op not in pushed and not any(vtog.conflict(t, c) for t in strategy.chosen)]
    out = Strategy(list(strategy.chosen), [])
    rnd = max((d.round or 0 for d in strategy.decisions), default=0)
    _, saving = _rounds(vtog, estimator, alive, state, out, rnd)
    for c in alive:
        s = saving[c.name]
        out.decisions.append(Decision(c.values[0], c.op, False, s, s.reason, c.direction))
    new = {(d.op, d.direction) for d in out.decisions}
    return Strategy(out.chosen, [d for d in strategy.decisions if (d.op, d.direction) not in new] + out.decisions)


def _escape(alive: list[Choice], estimator: Estimator, state: frozenset) -> list[Choice]:
    """When no single choice pays: the remaining pulls of the connected group that save most together.

    A chain whose composed mapping is not a strided view pays off only as a
    whole (every op but one removed costs a realisation each; all removed cost
    one); a greedy over single ops stops short of it.
    """
    groups: dict[int, list[Choice]] = {}
    for c in alive:
        if c.direction == PULL:
            groups.setdefault(estimator.component[c.op], []).append(c)
    best, best_s = [], EPSILON_S
    for cs in groups.values():
        if len(cs) < 2:
            continue
        s = estimator.saving_of({c.op for c in cs}, state).seconds
        if s > best_s:
            best, best_s = cs, s
    return best


def plan_greedy(graph: Graph, backend: str = "cpu", model: CostModel | None = None) -> Plan:
    """The greedy plan of `graph` for `backend` under cost `model`; kept ops carry their reasons."""
    vtog = VTOG(graph, node_kinds(graph, backend), backend)
    return plan_of(graph, "greedy", vtog, select(vtog, Estimator(vtog, model), (PULL,)))


def plan_of(graph: Graph, mode: str, vtog: VTOG, strategy: Strategy) -> Plan:
    """The Plan that takes the pull choices of `strategy`: every other movement op kept, with its decision's
    reason and estimate; ``plan.decisions`` is the strategy's log."""
    taken = {c.op for c in strategy.chosen if c.direction == PULL}
    pushed = {d.op: f"pushed: {d.reason}; estimated {fmt_seconds(d.saving.seconds)}"
              for d in strategy.decisions if d.direction == PUSH and d.chosen}
    keep: dict[str, str] = {}
    for n in graph.nodes:
        if n.kind != "movement" or n.name in taken or n.name in pushed or n.name in vtog.no_edges:
            continue  # an op without pull mapping: plan_keeping logs why
        d = strategy.decision(n.name, PULL)
        if d is not None:
            keep[n.name] = d.reason if d.reason.startswith("kept") else (
                f"kept physical: {d.reason}; estimated {fmt_seconds(d.saving.seconds)}")
    plan = plan_keeping(graph, mode, keep, pushed)
    plan.decisions = strategy.decisions
    return plan
