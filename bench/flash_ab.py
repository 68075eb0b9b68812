"""A / B of the prefill attention kernel steps in one process: one workload compiled with a ``vtc.codegen.flash``
module flag off (A) and on (B), the kernel steps alone timed alternately (a model with several attention
kernels, swin_t_model's 12: the sum of their times).

    T=1 CPU=1 PYTHONPATH=$PWD python bench/flash_ab.py llama3_prefill_b1 FLAG [rounds] [calls]

FLAG: a name in vtc.codegen.flash, set to False for A and True for B, or several joined by commas ("-" : the
same code twice, to see the noise).  Each round times `calls` runs of each of a variant's attention steps (their
operands from one call of the whole executor) and records the sum of their means; prints min / median per
variant (ms) and max |A - B| of the steps' outputs.  With CPU=1 the clock is the calling thread's CPU time (the comparison that holds on a loaded machine).
"""
import os
import statistics
import sys
import time

import torch

T = int(os.environ.get("T", 1))
torch.set_num_threads(T)
CLOCK = time.thread_time if os.environ.get("CPU") else time.perf_counter

import vtc  # noqa: E402
from vtc.codegen import flash  # noqa: E402
from bench.workloads import get  # noqa: E402


def attention_steps(ex):
    return [s for s in ex.steps if s.kind == "kernel" and s.kernel.step.kernel.kind == "attention"]


def env_before(ex, flat, step):
    """The executor's values just before `step` (every step before it run once; nothing is freed, so the
    operands of every later step are there too once it has run)."""
    env = dict(ex.consts)
    for v, t in zip(ex.graph.inputs, flat):
        env[v.name] = t
    for s in ex.steps:
        if s is step:
            return env
        ex.run_step(s, env)
    raise AssertionError("step not found")


def main(name: str, flag: str, rounds: int, calls: int) -> None:
    model, inputs = get(name).build()
    flat = [t for t in inputs if isinstance(t, torch.Tensor)]
    variants = {}
    for on in (False, True):
        for f in flag.split(","):
            if f != "-":
                setattr(flash, f, on)
        c = vtc.compile(model, inputs)
        ex = c._first.executor
        sts = attention_steps(ex)
        env = env_before(ex, flat, sts[-1])
        for s in ex.steps[ex.steps.index(sts[-1]):]:
            ex.run_step(s, env)
        variants["B" if on else "A"] = (ex, sts, env)
    times = {v: [] for v in variants}
    outs = {}
    with torch.no_grad():
        for r in range(rounds + 3):
            for v, (ex, sts, env) in variants.items():
                total = 0.0
                for st in sts:
                    t0 = CLOCK()
                    for _ in range(calls):
                        ex.run_step(st, env)
                    total += (CLOCK() - t0) / calls * 1e3
                if r >= 3:
                    times[v].append(total)
                outs[v] = [env[b.name].clone() for st in sts for b in st.kernel.outputs]
    for v in variants:
        print(f"{name} {flag}={v == 'B'}: min {min(times[v]):.3f} ms  median {statistics.median(times[v]):.3f} ms")
    diff = max(float((a - b).abs().max()) for a, b in zip(outs["A"], outs["B"]))
    print(f"max |A - B| of the steps' outputs ({len(variants['A'][1])} steps): {diff:.3g}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 30,
         int(sys.argv[4]) if len(sys.argv) > 4 else 5)
