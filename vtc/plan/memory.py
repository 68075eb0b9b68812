"""``objective="memory"``: the plan with the lowest peak memory within a latency budget.

The peak of a strategy (the set of movement ops made virtual) is the
executor's own liveness figure, ``report.peak_memory_bytes``: the plan is
scheduled for its backend (``Executor(..., build=False)``: kernels lowered, not
compiled; a few milliseconds) and the largest total of live intermediate
buffers is taken.  Virtual tensors lower the peak by never being stored, but a
virtual tensor also keeps its sources alive until its last reader, and a kept
op whose output is small lets a large input die early: so the memory objective
may make an op virtual that the latency plan keeps, and keep one it makes
virtual.

``lower_peak(...)`` is a local search from the latency plan's strategy.  The
budget is ``(1 + max_slowdown)`` times the latency plan's estimated latency
(compute, ``Estimator.compute``, plus movement, ``Estimator.total``).  Each
round looks at the buffers live at the peak and, for the movement ops around
them (their producers, the ops reading them, the chains realised into them,
the virtual tensors that hold them), tries flipping one op (virtual <-> kept)
and setting its connected group all virtual or all kept; it takes the move
with the lowest peak (then the lowest estimated latency) that lowers the peak
and stays within the budget, and stops when none does.  Every op whose fate
changed gets a new ``Decision`` with the peak before and after and the
estimated cost.
"""
from __future__ import annotations

from dataclasses import dataclass

from vtc.ir.graph import Graph
from vtc.plan.cost import Estimator, Saving, fmt_seconds
from vtc.plan.greedy import Decision, Strategy
from vtc.plan.virtualize import Plan, chain_of, plan_keeping
from vtc.plan.vtog import PULL, VTOG

MAX_ROUNDS = 64


@dataclass(frozen=True)
class Peak:
    """The peak of live intermediate buffers of one schedule and the buffers live at it."""

    bytes: int
    live: tuple[str, ...]


def peak_of(graph: Graph, plan: Plan, backend: str = "cpu", gemm: str = "auto") -> Peak:
    """The executor's peak for `plan` on `backend` under the compile option `gemm` (kernels not compiled) and
    the buffers live at it."""
    from vtc.runtime.executor import Executor

    ex = Executor(graph, plan, backend=backend, gemm=gemm, build=False)
    values = {v.name: v for v in graph.values()}
    live: dict[str, int] = {}
    best, at = 0, ()
    for s in ex.steps:
        for name in s.writes:
            live[name] = values[name].nbytes if s.out_bytes else 0
        total = sum(live.values())
        if total > best:
            best, at = total, tuple(n for n, b in live.items() if b)
        for name in s.frees:
            live.pop(name, None)
    return Peak(ex.peak_bytes, at)  # the same figure as the replay's maximum: the executor's own


def state_plan(graph: Graph, vtog: VTOG, state: frozenset, mode: str, why: str = "kept by the planner") -> Plan:
    """plan_keeping with every movement op outside `state` kept (`why` as its reason)."""
    keep = {op: why for op in vtog.pulls if op not in state}
    return plan_keeping(graph, mode, keep)


class PeakSearch:
    """Peaks and latencies of strategies of one graph, memoised (see the module docstring)."""

    def __init__(self, graph: Graph, vtog: VTOG, est: Estimator, backend: str, gemm: str = "auto") -> None:
        self.graph, self.vtog, self.est, self.backend, self.gemm = graph, vtog, est, backend, gemm
        self._peaks: dict[frozenset, tuple[Peak, Plan]] = {}
        self._lat: dict[frozenset, float] = {}
        self.producer = vtog.producer
        self.users = vtog.users

    def peak(self, state: frozenset) -> tuple[Peak, Plan]:
        hit = self._peaks.get(state)
        if hit is None:
            plan = state_plan(self.graph, self.vtog, state, "memory")
            hit = self._peaks[state] = (peak_of(self.graph, plan, self.backend, self.gemm), plan)
        return hit

    def latency(self, state: frozenset) -> float:
        hit = self._lat.get(state)
        if hit is None:
            hit = self._lat[state] = self.est.latency(state)
        return hit

    def around(self, peak: Peak, plan: Plan) -> list[str]:
        """Movement ops (with pull mappings) that could change what is live at `peak`."""
        ops: set[str] = set()
        for name in peak.live:
            p = self.producer.get(name)
            if p is not None and p.kind == "movement":
                ops.add(p.name)
            ops |= {u.name for u in self.users.get(name, []) if u.kind == "movement"}
            if plan.is_virtual(name):
                ops |= {n.name for n in chain_of(self.graph, plan, name)}
        for value, m in plan.mappings.items():  # virtual tensors that keep a live buffer alive
            if set(m.used_sources()) & set(peak.live):
                ops.add(self.producer[value].name)
        return sorted(op for op in ops if op in self.vtog.pulls)

    def moves(self, state: frozenset, ops: list[str]) -> list[frozenset]:
        """Strategies one step from `state`: one op flipped, or one op's group all virtual or all kept."""
        out = [state ^ {op} for op in ops]
        comp = self.est.component
        for g in sorted({comp[op] for op in ops}):
            group = {op for op in self.vtog.pulls if comp.get(op) == g}
            out += [state | group, state - group]
        return list(dict.fromkeys(s for s in out if s != state))


def lower_peak(graph: Graph, vtog: VTOG, est: Estimator, start: Strategy, backend: str = "cpu",
               max_slowdown: float = 0.05, gemm: str = "auto") -> tuple[frozenset, list[Decision], str]:
    """The strategy of lowest peak within (1 + max_slowdown) x the latency of `start`'s strategy.

    Returns the state, a decision per op whose fate differs from `start`, and a one-line summary.
    """
    if max_slowdown < 0:
        raise ValueError(f"max_slowdown={max_slowdown!r} must be >= 0 (0.05 allows 5% over the latency plan)")
    search = PeakSearch(graph, vtog, est, backend, gemm)
    state0 = frozenset(c.op for c in start.chosen if c.direction == PULL)
    lat0 = search.latency(state0)
    budget = lat0 * (1 + max_slowdown)
    state = state0
    peak, plan = search.peak(state)
    peak0 = peak
    for _ in range(MAX_ROUNDS):
        best = None
        for s in search.moves(state, search.around(peak, plan)):
            lat = search.latency(s)
            if lat > budget:
                continue
            p, _ = search.peak(s)
            if p.bytes < peak.bytes and (best is None or (p.bytes, lat) < (best[1].bytes, best[2])):
                best = (s, p, lat)
        if best is None:
            break
        state = best[0]
        peak, plan = search.peak(state)
    lat = search.latency(state)
    summary = (f"objective=memory: peak {_mb(peak0.bytes)} -> {_mb(peak.bytes)}, estimated latency "
               f"{fmt_seconds(lat0)[1:]} -> {fmt_seconds(lat)[1:]} (budget {max_slowdown:.0%}: "
               f"{fmt_seconds(budget)[1:]})")
    decisions = []
    for op in sorted(state ^ state0, key=list(vtog.pulls).index):
        c = vtog.choice(op, PULL)
        virtual = op in state
        without = state - {op}
        s = est.saving_of({op}, without) if virtual else est.saving_of({op}, state)
        what = "made virtual" if virtual else "kept physical"
        why = (f"{what} (objective=memory): the latency plan's peak {_mb(peak0.bytes)} becomes {_mb(peak.bytes)}; "
               f"estimated latency {fmt_seconds(lat - lat0)} within the {max_slowdown:.0%} budget")
        decisions.append(Decision(c.values[0], op, virtual, Saving(s.seconds, why), why, PULL))
    return state, decisions, summary


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.2f} MB"
