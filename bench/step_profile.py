"""Where a compiled workload's time goes, step by step, under several plans (one process, interleaved).

    PYTHONPATH=$PWD python bench/step_profile.py gemma2_local_decode_b16 [greedy,all] [top]
    PYTHONPATH=$PWD python bench/step_profile.py llama_model gemm=auto,gemm=torch   # other compile options

Each plan is a ``replan`` of one captured graph.  A call runs the closures of
the executor's call plan (``vtc.runtime.callplan``: what ``Executor.__call__``
runs, a conv_bcast kernel's weight packed once included) one by one with a
clock around each, a closure that drops values counted with its step; with
STEPS=1 (or ISOLATE) each step goes through ``Executor.run_step`` instead (the
slower reference path: a few µs more per step); calls alternate between plans, N (env, default 20)
rounds with the first 5 dropped; per step the median is printed, the steps of
all plans side by side, matched by what they do (a kernel's name, a torch
op's node), then the plans' kept / pushed movement ops that differ.  T (env,
default 2) threads; with CPU=1 (and T=1) each step is timed by the calling thread's CPU time, the
comparison that holds on a machine loaded above its core count.  A profile, not the benchmark: the clock and the Python
loop add a few µs per step.  Each kernel is called on its own (consecutive kernels are one C call in a
normal call, ``vtc.runtime.segment``); with SEGMENTS=1 a segment is timed as its first kernel.
"""
import os
import statistics
import sys
import time

import torch

T = int(os.environ.get("T", 2))
torch.set_num_threads(T)
CLOCK = time.thread_time if os.environ.get("CPU") else time.perf_counter  # CPU=1 with T=1 on a busy machine

import vtc  # noqa: E402
from vtc.runtime import segment  # noqa: E402

segment.SEGMENTS = bool(os.environ.get("SEGMENTS"))  # per step: each kernel on its own
from bench.workloads import get  # noqa: E402


def label(s) -> str:
    if s.kind == "kernel":
        k = s.kernel.step.kernel
        return f"kernel {k.name}"
    if s.kind == "run":
        return f"run {s.node.name} ({s.node.op})"
    return f"{s.kind} {s.realization.value}"


def timed_call(ex, inputs, times: dict, isolate: int = 0) -> None:
    """One call, each step timed; with `isolate` > 0 each step is run that many times more (on the same
    operands) and timed alone, and nothing is freed."""
    env = dict(ex.consts)
    for v, t in zip(ex.graph.inputs, inputs):
        env[v.name] = t
    clk = CLOCK
    for s in ex.steps:
        t0 = clk()
        ex.run_step(s, env)
        took = [clk() - t0]
        for _ in range(isolate):
            t0 = clk()
            ex.run_step(s, env)
            took.append(clk() - t0)
        times.setdefault(label(s), []).append(statistics.median(took))
        if not isolate:
            for name in s.frees:
                env.pop(name, None)


def timed_plan_call(ex, inputs, times: dict) -> None:
    """One call through the executor's call plan, each closure timed (a freer with the step before it)."""
    plan = ex.call_plan()
    if plan.const_copies:
        ex.refresh_const_copies()
    slots = plan.template.copy()
    for i, t in zip(plan.inputs, inputs):
        slots[i] = t
    arena = slots[plan.arena_slot] = plan.acquire_arena() if plan.arena_kernels or plan.segment_arena else None
    clk, key = CLOCK, None
    for fn, s in zip(plan.fns, plan.fn_steps):
        t0 = clk()
        fn(slots)
        took = clk() - t0
        if s is not None:
            key = label(s)
            times.setdefault(key, []).append(took)
        elif key is not None:
            times[key][-1] += took
    if arena is not None:
        plan._arenas.append(arena)


def options(p: str) -> dict:
    """A plan name ("greedy") or compile options joined by '+' ("gemm=torch", "plan=all+gemm=vtc")."""
    return dict(kv.split("=", 1) for kv in p.split("+")) if "=" in p else {"plan": p}


def main(name: str, plans: list[str], top: int) -> None:
    model, inputs = get(name).build()
    base = vtc.compile(model, inputs, **options(plans[0]))
    comps = {p: base if p == plans[0] else base.replan(**options(p)) for p in plans}
    flat = [t for t in inputs if isinstance(t, torch.Tensor)]
    times = {p: {} for p in plans}
    total = {p: [] for p in plans}
    rounds = int(os.environ.get("N", 20))
    with torch.no_grad():
        for r in range(rounds):
            for p, c in comps.items():
                ex = c._first.executor
                t0 = CLOCK()
                if os.environ.get("STEPS") or os.environ.get("ISOLATE"):
                    timed_call(ex, flat, times[p] if r >= 5 else {}, int(os.environ.get("ISOLATE", 0)))
                else:
                    timed_plan_call(ex, flat, times[p] if r >= 5 else {})
                if r >= 5:
                    total[p].append(CLOCK() - t0)
    med = {p: {k: statistics.median(v) * 1e3 for k, v in times[p].items()} for p in plans}
    print(f"{name}: " + "  ".join(f"{p} {statistics.median(total[p]) * 1e3:.3f} ms "
                                  f"({len(comps[p]._first.executor.steps)} steps)" for p in plans))
    keys = sorted({k for p in plans for k in med[p]}, key=lambda k: -max(med[p].get(k, 0) for p in plans))
    for k in keys[:top]:
        print("  " + "  ".join(f"{med[p].get(k, float('nan')):8.3f}" for p in plans) + f"  {k[:110]}")
    differ = set()  # movement ops kept / pushed under some plans but not all
    for kind in ("kept", "pushed"):
        sets = {p: set(getattr(comps[p]._first.plan, kind)) for p in plans}
        differ |= set.union(*sets.values()) - set.intersection(*sets.values())
        for p in plans:
            only = sorted(sets[p] - set.intersection(*sets.values()))
            if only:
                print(f"  {kind} only under {p}: {only}")
    for d in comps[plans[0]]._first.plan.decisions:
        if d.op in differ:
            print(f"  [{plans[0]}] {d}"[:400])


if __name__ == "__main__":
    main(sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "greedy,all").split(","),
         int(sys.argv[3]) if len(sys.argv) > 3 else 25)
