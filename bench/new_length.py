"""The cost of a new cache length: a transformers decode loop with a DynamicCache, one thread, thread CPU time.

    PYTHONPATH=$PWD python -m bench.new_length [--steps 14] [--phases] [--promoted]

The model is ``bench.hf_decode``'s (transformers Llama, 4 layers, hidden 512, GQA 8/2).  Every step brings a
cache one token longer, so every step is a new specialization of vtc's symbolic graph (``vtc.dynamic``).
Prints the thread CPU time of each vtc step (step 1: the example's size, step 2: the symbolic capture), their
median and minimum from step 3 on, the full garbage collections (gen 2) that ran and their pauses, the max
abs error of the logits against eager's over all steps, and with ``--phases`` the CPU time per new length of
the stages of a specialization (instantiate, plan, lower, generate, kernel build, report, call plan).
With ``--promoted``, the objects moved into the oldest generation per new length (what brings the full
collections: one comes when those moved since the last one exceed a quarter of the objects it kept, so the average
cost of the collections per step is about 4 x promoted x the cost of one object, whatever the process's size);
counting them costs a little time at every generation-1 collection.
"""
from __future__ import annotations

import argparse
import collections
import copy
import functools
import gc
import statistics
import time

import torch


def _timed(table: dict, owner, name: str) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def g(*a, **k):
        t = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            table[name] += time.thread_time() - t

    setattr(owner, name, g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--promoted", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import vtc
    from bench.hf_decode import _model

    phases: dict = collections.defaultdict(float)
    if args.phases:
        import vtc.codegen.cpp as cpp
        import vtc.codegen.lower as lower
        import vtc.compiler as compiler
        import vtc.dynamic as dynamic
        import vtc.frontend.symbolic as symbolic
        import vtc.runtime.executor as executor
        import vtc.runtime.generic as generic

        for owner, name in [(symbolic.SymbolicGraph, "instantiate"), (dynamic.DynamicSizes, "_plan"),
                            (lower, "lower"), (generic.GenericKernels, "build"), (cpp, "generate"),
                            (executor, "build_kernels"), (compiler, "build_report"),
                            (executor.Executor, "call_plan"), (dynamic.DynamicSizes, "specialization")]:
            _timed(phases, owner, name)
    pauses, start, promoted = [], {}, [0]

    def on_gc(phase, info):
        if info["generation"] == 1 and args.promoted:  # the survivors of a generation-1 collection move up
            if phase == "start":
                start["young"] = len(gc.get_objects(0)) + len(gc.get_objects(1))
            else:
                promoted[0] += start["young"] - info["collected"]
        if info["generation"] == 2:
            if phase == "start":
                start["t"] = time.thread_time()
            else:
                pauses.append(1e3 * (time.thread_time() - start["t"]))

    cfg, model = _model()
    prompt = torch.randint(1, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        first = model(prompt)
    tok = first.logits[:, -1:].argmax(-1)
    compiled = vtc.compile(model, (tok,), {"cache": copy.deepcopy(first.past_key_values)})
    caches = [copy.deepcopy(first.past_key_values), copy.deepcopy(first.past_key_values)]
    toks, took, err = [tok, tok], [], 0.0
    with torch.no_grad():
        for i in range(args.steps):
            if i == 2:
                phases.clear()
                gc.callbacks.append(on_gc)
            t = time.thread_time()
            got = compiled(toks[0], cache=caches[0])
            took.append(1e3 * (time.thread_time() - t))
            want = model(toks[1], cache=caches[1])
            err = max(err, (got.logits - want.logits).abs().max().item())
            caches = [got.past_key_values, want.past_key_values]
            toks = [got.logits[:, -1:].argmax(-1), want.logits[:, -1:].argmax(-1)]
    gc.callbacks.remove(on_gc)
    later = took[2:]
    print("vtc thread CPU ms per step:", [round(x, 1) for x in took])
    print(f"new lengths (steps 3-{args.steps}): median {statistics.median(later):.1f} ms, min {min(later):.1f} ms, "
          f"mean {statistics.mean(later):.1f} ms; full GCs during them: {[round(p) for p in pauses]} ms")
    print(f"max abs error of the logits vs eager: {err:.3g}")
    if args.promoted:
        print(f"objects moved into the oldest generation per new length: {promoted[0] / len(later):.0f}; "
              f"tracked objects now: {len(gc.get_objects())}")
    if args.phases:
        print("per new length, ms:", {k: round(1e3 * v / len(later), 1) for k, v in phases.items()})


if __name__ == "__main__":
    main()
