"""Measured mode: decide the uncertain choices by timing both variants.

The cost model is sure of Type-I accesses (a strided view, a contiguous
reshape) and guesses about the others (chunked, scattered, indirect reads,
index arithmetic).  ``measure(...)`` takes the greedy strategy and, for each
pull choice that is uncertain — its tensor is read through a non-Type-I
mapping, or its estimated saving is within ``margin_s`` of zero — builds the
graph with and without that op virtual (the real executor, generated kernels
compiled and cached like any compile), runs both on the same random inputs
(floats normal, integer inputs zero so every index is in range), alternating,
and takes the median of each.  The measured saving (median without minus
median with) decides; it is recorded in the decision (``Decision.measured``)
next to the estimate.  Choices are measured closest-to-zero estimate first
until ``budget_s`` seconds are spent; the rest keep the model's decision with
"not measured (budget spent)".

What is timed is the whole graph, so the measured saving includes every
kernel the op affects (its readers, realisations, the copies it adds or
removes) and some noise from the others; each variant is run at least
``MIN_RUNS`` times after ``WARMUP`` calls.  The budget is checked before each
choice: a measurement once started finishes its ``MIN_RUNS``, so a tiny
budget still measures the first choice.  The budget's seconds are ``clock``'s
(wall-clock; the tests' is a fake one).
"""
from __future__ import annotations

import time

import torch

from vtc.ir.graph import Graph
from vtc.plan.cost import TYPE_I, Estimator, fmt_seconds
from vtc.plan.greedy import Decision, Strategy
from vtc.plan.memory import state_plan
from vtc.plan.vtog import PULL, VTOG

WARMUP = 2
MIN_RUNS = 7
MAX_RUNS = 31
clock = time.perf_counter  # the budget's clock (building the variants' kernels included)


def random_inputs(graph: Graph, seed: int = 0) -> list[torch.Tensor]:
    """Inputs for timing: floats normal, booleans true, integers zero (an index in range of any size)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for v in graph.inputs:
        if v.dtype.is_floating_point or v.dtype.is_complex:
            out.append(torch.randn(v.shape, generator=g).to(v.dtype))
        elif v.dtype == torch.bool:
            out.append(torch.ones(v.shape, dtype=torch.bool))
        else:
            out.append(torch.zeros(v.shape, dtype=v.dtype))
    return out


def uncertain(est: Estimator, d: Decision, state: frozenset, margin_s: float) -> bool:
    """True when the model's call on pull decision `d` is a guess: a saving near zero, or a tensor the op's
    removal makes virtual (its own or one composed through it) read through a non-Type-I mapping."""
    if abs(d.saving.seconds) <= margin_s:
        return True
    values, _ = est.affected({d.op}, state - {d.op})
    for v in values:  # the op's tensors and every virtual tensor composed through it
        m = est.mapping(v, state | {d.op})
        if m is not None and est.access(m, v).kind not in TYPE_I:
            return True
    return False


def time_pair(graph: Graph, plans: tuple, backend: str, inputs: list[torch.Tensor],
              deadline: float, gemm: str = "auto") -> tuple[float, float]:
    """Median seconds of the graph under each of two plans, run alternately on the same inputs."""
    from vtc.runtime.executor import Executor

    exs = [Executor(graph, p, backend=backend, gemm=gemm) for p in plans]
    times: list[list[float]] = [[], []]
    with torch.no_grad():
        for _ in range(WARMUP):
            for ex in exs:
                ex(inputs)
        for k in range(MAX_RUNS):
            for ex, ts in zip(exs, times):
                t0 = time.perf_counter()
                ex(inputs)
                ts.append(time.perf_counter() - t0)
            if k + 1 >= MIN_RUNS and clock() > deadline:
                break
    return tuple(sorted(ts)[len(ts) // 2] for ts in times)  # type: ignore[return-value]


def measure(graph: Graph, vtog: VTOG, est: Estimator, strategy: Strategy, backend: str = "cpu",
            budget_s: float = 5.0, margin_s: float = 0.0, only_near_zero: bool = False,
            gemm: str = "auto") -> tuple[frozenset, str]:
    """Measures the uncertain pull choices of `strategy` (in place: decisions get `measured`, fates may flip).

    `only_near_zero`: measure only choices whose estimate is within `margin_s` of zero (plan="greedy" with a
    budget); else every uncertain one (plan="measured").  Returns the final state and a one-line summary.
    """
    if budget_s < 0:
        raise ValueError(f"measure_budget_s={budget_s!r} must be >= 0")
    state = frozenset(c.op for c in strategy.chosen if c.direction == PULL)
    pulls = [d for d in strategy.decisions if d.direction == PULL and d.op in vtog.pulls]
    todo = [d for d in pulls if (abs(d.saving.seconds) <= margin_s if only_near_zero
                                 else uncertain(est, d, state, margin_s))]
    todo.sort(key=lambda d: abs(d.saving.seconds))
    t0 = clock()
    deadline = t0 + budget_s
    inputs = random_inputs(graph)
    done = flipped = 0
    for k, d in enumerate(todo):
        if clock() >= deadline:
            d.reason += "; not measured (budget spent)"
            continue
        with_op, without = state | {d.op}, state - {d.op}
        try:
            share = (deadline - clock()) / max(len(todo) - k, 1)  # this choice's part of what is left
            t_with, t_without = time_pair(graph, (state_plan(graph, vtog, with_op, "measured"),
                                                  state_plan(graph, vtog, without, "measured")), backend, inputs,
                                          clock() + share, gemm)
        except Exception as e:  # noqa: BLE001 - a variant that fails to build or run is not taken
            d.reason += f"; not measured ({type(e).__name__}: {str(e)[:80]})"
            continue
        done += 1
        d.measured = t_without - t_with
        take = d.measured > 0
        if take != (d.op in state):
            flipped += 1
            state = with_op if take else without
            d.chosen = take
            d.round = None
        d.reason += (f"; measured {fmt_seconds(d.measured)} (whole graph, median of each variant): "
                     f"{'virtual' if take else 'kept'} by measurement")
    spent = clock() - t0
    summary = (f"measured {done} of {len(todo)} uncertain choices in {spent:.1f} s (budget {budget_s:g} s), "
               f"{flipped} changed by measurement")
    return state, summary
