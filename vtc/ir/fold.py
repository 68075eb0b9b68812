"""Constant folding: values computed from nothing the caller passes or may change, computed once at compile time.

A value is *foldable* when its node reads no graph input and no parameter or buffer: an ``arange``, a
``full`` or a ``scalar_tensor`` (nodes without tensor operands) and every node computed from foldable
values only.  Swin's shifted-window attention mask is such a chain (two aranges, comparisons, a window
partition, a difference and two ``where``: [64, 49, 49] from nothing): left in the graph, the planner makes
it virtual and the attention kernel evaluates its index arithmetic (int64 divisions by 7, 8 and 24) for every
(query, key) pair, twice (the hidden-block check and the scores).  ``fold_constants`` runs such chains once
with torch and puts the values the rest of the graph reads in as constants.

Only where that pays: a floating-point value whose index arithmetic would divide (a view that splits or merges
dims, a division or remainder on the way).  A causal mask (``arange[:, None] < arange[None, :]``) stays a node:
the attention kernel turns its index arithmetic into a predicate and skips the key blocks it hides; roll's
``(arange + shift) % n`` indices stay index arithmetic (``Lowering._foldable_index_tensors``), not gathers
through a constant; RoPE's position-times-frequency table stays computed, where the kernels read it.

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
    """`graph` with its foldable values (module docstring) that are worth a constant computed once: the
    floating-point values the rest of the graph reads whose index arithmetic would divide (``_divides``), with
    the nodes only they need removed; those Value objects become "const" ones (`graph` itself is consumed).
    The same graph object when nothing folds; the count of removed nodes in ``graph.meta["folded_nodes"]``."""
    outputs = {v.name for v in graph.outputs}
    env: dict[str, torch.Tensor] = {}
    divides: dict[str, bool] = {}  # foldable value -> its index arithmetic would divide somewhere
    foldable: list[Node] = []
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
        d = _divides(n) or any(divides[v.name] for v in ins)
        for v, t in zip(n.outputs, outs):
            env[v.name], divides[v.name] = t, d
        foldable.append(n)
    removed = {id(n) for n in foldable}
    read_by_kept = {v.name for n in graph.nodes if id(n) not in removed for v in n.inputs}
    for n in reversed(foldable):  # readers first: a kept node's foldable inputs become constants or stay nodes
        needed = [v for v in n.outputs if v.name in read_by_kept]
        if needed and not all(v.dtype.is_floating_point and divides[v.name] for v in needed):
            removed.discard(id(n))  # cheaper as index arithmetic (a causal mask, roll's indices) or a plain value
            read_by_kept.update(v.name for v in n.inputs)
    if not removed:
        return graph
    consts = list(graph.consts)
    for n in foldable:
        if id(n) in removed:
            for v in n.outputs:
                if v.name in read_by_kept:  # a constant of its own memory
                    v.kind, v.producer, v.data = "const", None, env[v.name].contiguous().clone()
                    consts.append(v)
    kept = [n for n in graph.nodes if id(n) not in removed]
    out = Graph(graph.inputs, consts, kept, graph.outputs, graph.in_spec, graph.out_spec, dict(graph.meta))
    out.meta["folded_nodes"] = len(removed)
    return out


def _divides(n: Node) -> bool:
    """True when reading node n's output through index arithmetic divides: a view that splits or merges dims
    (a window partition: i // 7, i % 7), a division or remainder."""
    if any(w in n.op for w in ("div", "fmod", "remainder")):
        return True
    if n.kind != "movement" or len(n.inputs) != 1 or len(n.outputs) != 1:
        return False
    (x,), (y,) = n.inputs, n.outputs
    return x.numel == y.numel and sorted(d for d in x.shape if d != 1) != sorted(d for d in y.shape if d != 1)
