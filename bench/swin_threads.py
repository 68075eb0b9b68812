"""Swin-T's steps at 1 and 2 threads, by CPU time: a vtc switch off (A) and on (B), in one process, interleaved.

    PYTHONPATH=$PWD python bench/swin_threads.py [MODULE.ATTR[,MODULE.ATTR]] [N]
    PYTHONPATH=$PWD python bench/swin_threads.py vtc.ir.fold.FOLD_GATHERS 20

The model is compiled twice (the switches False, then True) with torch at 2 threads (the bench's plan), both
checked against eager.  Each round runs one call of A and of B at 1 thread, then at 2 threads, each call through
the call plan's closures one by one (``bench/step_profile.timed_plan_call``'s loop).  At 1 thread a step's time
is the calling thread's CPU time; at 2 threads it is the busiest thread's: every thread of the process is read
(``clock_gettime`` on its thread CPU clock) before and after the step and the largest difference is kept.  With
``OMP_WAIT_POLICY=passive`` (set here unless given) a waiting OpenMP worker sleeps instead of spinning, so this is
the step's critical path without the waits for a core: on a loaded machine the comparison that holds.  A call's
figure is the sum of its steps' (the reads of the other threads' clocks add a few µs per step to both A and B).
Prints per step category (the kernel's kind and its name without the number: ``row k_native_layer_norm``) the
median over rounds of the call's sum, per call the min / median, and the load.  N rounds (default 15), the first 3
dropped.  STEPS=1: per kernel.  WALL=1: wall time per step at both thread counts (an indication on a loaded
machine; the wait policy left as it is).  CENSUS=1: each kernel's parallel pragmas, nothing timed.  Without a switch, A and B are the same build (the noise of the method).
"""
import os

WALL = bool(os.environ.get("WALL"))  # wall time per step at both thread counts (the OpenMP wait policy as given)
if not WALL:
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
import importlib  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(2)
import vtc  # noqa: E402
from bench.step_profile import label  # noqa: E402  (also: each kernel on its own, segments off)
from bench.systems import flat_outputs  # noqa: E402
from bench.workloads import get  # noqa: E402


STEPS = bool(os.environ.get("STEPS"))  # per kernel instead of per category


def category(s) -> str:
    if s.kind == "kernel":
        k = s.kernel.step.kernel
        return f"{k.kind} {k.name if STEPS else re.sub(r'_[0-9]+$', '', k.name)}"
    return re.sub(r" \(.*", "", re.sub(r"_[0-9]+ ", " ", label(s)))


def thread_clocks() -> list[int]:
    """The CPU clock ids of every thread of this process (the calling thread's last)."""
    me = threading.get_native_id()
    tids = [int(t) for t in os.listdir("/proc/self/task") if int(t) != me] + [me]
    return [((~t) << 3) | 6 for t in tids]


def timed_call(ex, inputs, times: dict, threads: int, work: dict) -> float:
    """One call through the call plan, each closure timed; returns the call's time (the sum of its steps').  `work`
    gets the CPU time of all threads together per category (the busiest thread's share of it: how the work split)."""
    plan = ex.call_plan()
    if plan.const_copies:
        ex.refresh_const_copies()
    slots = plan.template.copy()
    for i, t in zip(plan.inputs, inputs):
        slots[i] = t
    arena = slots[plan.arena_slot] = plan.acquire_arena() if plan.arena_kernels or plan.segment_arena else None
    clocks = [time.CLOCK_MONOTONIC] if WALL else thread_clocks() if threads > 1 else [time.CLOCK_THREAD_CPUTIME_ID]
    get = time.clock_gettime
    total, key = 0.0, None
    for fn, s in zip(plan.fns, plan.fn_steps):
        before = [get(c) for c in clocks]
        fn(slots)
        after = [get(c) for c in reversed(clocks)][::-1]
        used = [b - a for a, b in zip(before, after)]
        took = max(used)
        total += took
        if s is not None:
            key = category(s)
            times[key] = times.get(key, 0.0) + took
            work[key] = work.get(key, 0.0) + sum(used)
        elif key is not None:
            times[key] += took
            work[key] += sum(used)
    if arena is not None:
        plan._arenas.append(arena)
    return total


def census() -> None:
    """Each kernel of the compiled model (in call order): its kind, name, domain and the OpenMP parallel pragmas
    of its generated source (the parallel loops, their ``if`` size thresholds and schedules)."""
    from vtc.codegen.cpp import generate

    model, inputs = get("swin_t_model").build()
    for s in vtc.compile(model, inputs)._first.executor.steps:
        if s.kind == "kernel":
            k = s.kernel.step.kernel
            pragmas = [x.strip() for x in generate(k).splitlines() if "#pragma omp parallel" in x]
            print(f"{k.kind:9s} {k.name:28s} {k.domain} | " + " ;; ".join(pragmas))
        else:
            print(f"{s.kind:9s} {label(s)}")


def main(switch: str, rounds: int) -> None:
    switches = [(importlib.import_module(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1]) for n in switch.split(",") if n]
    model, inputs = get("swin_t_model").build()
    flat = [t for t in inputs if isinstance(t, torch.Tensor)]
    with torch.no_grad():
        ref = model(*inputs)
    comps = {}
    for tag, value in (("A", False), ("B", True)):
        for mod, attr in switches:
            setattr(mod, attr, value)
        comps[tag] = vtc.compile(model, inputs)
        with torch.no_grad():
            out = comps[tag](*inputs)
        err = max(float((a - b).abs().max()) for a, b in zip(flat_outputs(ref), flat_outputs(out)))
        steps = len(comps[tag]._first.executor.call_plan().fns)
        print(f"{tag} ({switch or 'no switch'} {value}): {steps} closures, max |error| against eager {err:.2e}")
    calls = {(t, tag): [] for t in (1, 2) for tag in comps}
    cats = {(t, tag): {} for t in (1, 2) for tag in comps}
    shares = {(t, tag): {} for t in (1, 2) for tag in comps}
    loads = []
    with torch.no_grad():
        for r in range(rounds):
            loads.append(os.getloadavg()[0])
            for t in (1, 2):
                torch.set_num_threads(t)
                for tag, c in comps.items():
                    times, work = {}, {}
                    total = timed_call(c._first.executor, flat, times, t, work)
                    if r >= 3:
                        calls[t, tag].append(total)
                        for k, v in times.items():
                            cats[t, tag].setdefault(k, []).append(v)
                            shares[t, tag].setdefault(k, []).append(v / work[k] if work[k] else 1.0)
    what = ("wall ms per step, summed" if WALL else "1 thread: the calling thread's CPU ms, 2 threads: the busiest "
            "thread's CPU ms per step, summed")
    print(f"swin_t_model, {rounds - 3} rounds, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, load "
          f"{min(loads):.2f}-{max(loads):.2f}; {what}")
    for t in (1, 2):
        print(f"  {t} thread(s), call min / median: " + ", ".join(
            f"{tag} {min(calls[t, tag]) * 1e3:.2f} / {statistics.median(calls[t, tag]) * 1e3:.2f}" for tag in comps))
    keys = sorted({k for v in cats.values() for k in v}, key=lambda k: -statistics.median(cats[1, "A"].get(k, [0])))
    print(f"  {'category (median ms per call)':40s} {'1t A':>7s} {'1t B':>7s} {'2t A':>7s} {'2t B':>7s} "
          f"{'A 1t/2t':>7s} {'B 1t/2t':>7s} {'2t share A':>10s} {'B':>5s}")
    for k in keys:
        m = {key: statistics.median(v[k]) * 1e3 if k in v else 0.0 for key, v in cats.items()}
        ratio = [f"{m[1, tag] / m[2, tag]:7.2f}" if m[2, tag] else "      -" for tag in comps]
        share = [f"{statistics.median(shares[2, tag][k]):5.2f}" if k in shares[2, tag] else "    -" for tag in comps]
        print(f"  {k:40s} " + " ".join(f"{m[t, tag]:7.3f}" for t in (1, 2) for tag in comps) + " " + " ".join(ratio)
              + "      " + " ".join(share))


if __name__ == "__main__":
    if os.environ.get("CENSUS"):
        census()
        sys.exit()
    main(sys.argv[1] if len(sys.argv) > 1 else "", int(sys.argv[2]) if len(sys.argv) > 2 else 15)
