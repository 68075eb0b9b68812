"""The per-call cost of refusing an input changed in place that shares memory with another input
(``vtc.frontend.torch_export.mutation_guard``, docs/robustness.md), on models that change their inputs in place.

    PYTHONPATH=$PWD python -m bench.mutation_guard [--rounds 15] [--layers 4]

Two models, each compiled once:

- ``hf``: a transformers Llama (``--layers`` layers, hidden 64, vocab 97) decoding one token with a
  ``StaticCache`` of 64 positions, called as transformers calls it (``step(tok, cache=..., cache_position=...)``:
  the executor path, the cache's 2 x layers tensors changed in place);
- ``fast``: ``f(k_cache, v_cache, new, pos)`` updating both caches with ``index_copy_`` and reading them,
  called with positional tensors (the generated fast call, ``vtc.runtime.callplan.fast_call``).

Timed side by side in one process, 1 thread, CPU time of the calling thread
(``bench.gemm_side_by_side.time_side_by_side``): each whole call, and, on the same flat inputs, the test alone:
``guard`` (this tree's ``mutation_guard``, absent before it) and ``storage_dict`` (the test of 891b458, which ran
after the kernels: one ``untyped_storage().data_ptr()`` per input into a dict, copied here).  Run it with
``PYTHONPATH`` at another tree for that tree's whole-call numbers.
"""
from __future__ import annotations

import argparse
import copy
import os
import time
import warnings

import torch


def storage_dict(inputs: list[torch.Tensor], mutations) -> None:
    """The test of 891b458 (``_refuse_overlapping_mutated_inputs``), up to its return where no storage repeats."""
    by_storage: dict[int, list[int]] = {}
    for k, t in enumerate(inputs):
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(k)
    if len(by_storage) == len(inputs):
        return
    raise AssertionError("the benchmark's inputs share a storage")


def hf_step(layers: int):
    """(the call, its flat inputs, the graph) of a tiny transformers Llama's StaticCache decode step."""
    import transformers as tf

    import vtc
    from vtc.frontend.torch_export import flatten_inputs

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = tf.LlamaForCausalLM(cfg).eval()
    cache = tf.StaticCache(config=cfg, max_cache_len=64)
    tok, pos = torch.tensor([[5]]), torch.tensor([7])
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=cache, cache_position=torch.arange(7))
        step = vtc.compile(model, (tok,), {"cache": copy.deepcopy(cache), "cache_position": pos})
    flat = flatten_inputs(step.graph, (tok,), {"cache": cache, "cache_position": pos})

    def call():
        for layer in cache.layers:  # transformers 5's StaticCache writes at its own count, moved on by each call:
            layer.cumulative_length.fill_(7)  # back to position 7 (eager fails after max_cache_len calls too)
        step(tok, cache=cache, cache_position=pos)

    return call, flat, step.graph


def fast_step():
    """(the call, its inputs, the graph) of a positional call updating two caches in place."""
    import vtc

    def fn(kc, vc, new, pos):
        kc.index_copy_(2, pos, new)
        vc.index_copy_(2, pos, new * 2)
        return torch.softmax(new @ kc.transpose(2, 3), -1) @ vc

    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 2, 64, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g),
              torch.randn(1, 2, 1, 16, generator=g), torch.tensor([7]))
    compiled = vtc.compile(fn, tuple(t.clone() for t in inputs))
    return (lambda: compiled(*inputs)), list(inputs), compiled.graph


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    import vtc
    from bench.gemm_side_by_side import time_side_by_side

    try:
        from vtc.frontend.torch_export import mutation_guard
    except ImportError:  # a tree from before it
        mutation_guard = None
    print(f"vtc from {os.path.dirname(vtc.__file__)}")
    for name, make in (("hf", lambda: hf_step(args.layers)), ("fast", fast_step)):
        call, flat, graph = make()
        mutations = graph.meta["input_mutations"]
        fns = {"call": call, "storage_dict": lambda: storage_dict(flat, mutations)}
        if mutation_guard is not None:
            guard = mutation_guard(graph)
            fns["guard"] = lambda: guard(flat)
        with torch.no_grad():
            times = time_side_by_side(fns, args.rounds, time.thread_time)
        print(f"{name} ({len(flat)} inputs, {len(mutations)} changed in place): " + "  ".join(
            f"{k} {t['median_ms'] * 1e3:.2f}/{t['min_ms'] * 1e3:.2f}" for k, t in times.items())
            + f" us (median/min; 1 thread, CPU time; load {os.getloadavg()[0]:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
