"""Constant folding: values computed from nothing the caller passes or may change, computed once at compile time.

A value is *foldable* when its node reads no graph input and no parameter or buffer: an ``arange``, a
``full`` or a ``scalar_tensor`` (nodes without tensor operands) and every node computed from foldable
values only.  Swin's shifted-window attention mask is such a chain (two aranges, comparisons, a window
partition, a difference and two ``where``: [64, 49, 49] from nothing): left in the graph, the planner makes
it virtual and the attention kernel evaluates its index arithmetic (int64 divisions by 7, 8 and 24) for every
(query, key) pair, twice (the hidden-block check and the scores).  ``fold_constants`` runs such chains once
with torch and puts the values the rest of the graph reads in as constants.

Not folded: random and uninitialised tensors (``rand*``, ``empty*``, ``bernoulli``, ...: a new value per
call), anything reading a parameter or buffer (the model may change it in place after compiling; vtc reads
it at each call), a graph output (returned to the caller, who may write to it), a value above
``MAX_BYTES``, and graphs of the size-generic path (``vtc.dynamic``), whose plans are replayed by node name
across sizes.
"""
from __future__ import annotations

import torch

from vtc.ir.graph import Graph, Node

MAX_BYTES = 16 << 20  # a folded value above this stays computed: a constant of that size costs memory for good
NONDETERMINISTIC = ("rand", "empty", "bernoulli", "normal", "uniform", "dropout", "multinomial", "poisson",
                    "exponential", "geometric", "cauchy", "log_normal")


def fold_constants(graph: Graph) -> Graph:
    """`graph` with its foldable nodes (module docstring) run once and the values that other nodes read made
    constants of the graph (those Value objects become "const" ones: `graph` itself is consumed); the same
    graph object when nothing folds.  The count is kept in ``graph.meta["folded_nodes"]``."""
    outputs = {v.name for v in graph.outputs}
    env: dict[str, torch.Tensor] = {}
    folded: list[Node] = []
    for n in graph.nodes:
        ins = n.inputs
        if (not all(v.name in env for v in ins) or any(v.name in outputs for v in n.outputs)
                or any(w in n.op for w in NONDETERMINISTIC) or sum(v.nbytes for v in n.outputs) > MAX_BYTES):
            continue
        try:
            with torch.no_grad():
                outs = n.run(env)
        except Exception:  # noqa: BLE001 - an op torch cannot run here stays in the graph (and fails as before)
            continue
        if len(outs) != len(n.outputs) or not all(
                isinstance(t, torch.Tensor) and tuple(t.shape) == v.shape and t.dtype == v.dtype
                for t, v in zip(outs, n.outputs)):
            continue
        for v, t in zip(n.outputs, outs):
            env[v.name] = t
        folded.append(n)
    if not folded:
        return graph
    gone = {id(n) for n in folded}
    kept = [n for n in graph.nodes if id(n) not in gone]
    read = {v.name for n in kept for v in n.inputs}
    consts = list(graph.consts)
    for n in folded:
        for v in n.outputs:
            if v.name in read:  # the value the rest of the graph reads becomes a constant of its own memory
                v.kind, v.producer, v.data = "const", None, env[v.name].contiguous().clone()
                consts.append(v)
    out = Graph(graph.inputs, consts, kept, graph.outputs, graph.in_spec, graph.out_spec, dict(graph.meta))
    out.meta["folded_nodes"] = len(folded)
    return out
