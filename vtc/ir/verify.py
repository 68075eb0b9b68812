"""Structural checks of a Graph, with messages that name the node and the bad value.

``verify(graph)`` checks what every pass may assume: unique value and node names,
values of the right kind in the right list (``input``/``const``/``node``), static
integer shapes and torch dtypes, each node reading only values defined before it
(topological order) and each graph output defined.  ``deep=True`` also re-runs
every ATen op on fake tensors (meta kernels) and compares the output count, shapes and
dtypes with the declared ones (ops without a meta kernel, or whose output shape
depends on data, are skipped).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from vtc.ir.graph import NODE_KINDS, Graph, Node, Value


class GraphError(ValueError):
    """A graph breaks an IR invariant; the message names the node and the value."""


def verify(graph: Graph, deep: bool = False) -> None:
    """Raises ``GraphError`` unless ``graph`` is well formed (``deep``: also meta-run every op)."""
    fake_mode = _fake_mode() if deep else None
    defined: dict[str, Value] = {}
    later = {v.name: n for n in graph.nodes for v in n.outputs}

    def define(v: Value, kind: str, where: str) -> None:
        if not isinstance(v, Value):
            raise GraphError(f"{where}: {v!r} is a {type(v).__name__}, not a Value")
        if v.name in defined:
            raise GraphError(f"{where}: value name %{v.name} is defined twice")
        if v.kind != kind:
            raise GraphError(f"{where}: %{v.name} has kind {v.kind!r}, expected {kind!r}")
        if not isinstance(v.dtype, torch.dtype):
            raise GraphError(f"{where}: %{v.name} has dtype {v.dtype!r}, not a torch.dtype")
        if not isinstance(v.shape, tuple) or not all(type(s) is int and s >= 0 for s in v.shape):
            raise GraphError(f"{where}: %{v.name} has shape {v.shape!r}, expected a tuple of ints >= 0")
        if kind == "const" and v.data is not None and (tuple(v.data.shape) != v.shape or v.data.dtype != v.dtype):
            raise GraphError(f"{where}: const %{v.name} is declared {v.shape} {v.dtype} but holds "
                             f"a tensor {tuple(v.data.shape)} {v.data.dtype}")
        defined[v.name] = v

    for v in graph.inputs:
        define(v, "input", "graph input")
    for v in graph.consts:
        define(v, "const", "graph const")
    node_names: set[str] = set()
    for node in graph.nodes:
        where = f"node {node.name} ({node.op})"
        if node.name in node_names:
            raise GraphError(f"{where}: node name {node.name!r} is used twice")
        node_names.add(node.name)
        if node.kind not in NODE_KINDS:
            raise GraphError(f"{where}: kind {node.kind!r} is not one of {NODE_KINDS}")
        for v in node.inputs:
            _check_use(v, defined, later, where)
        for v in node.outputs:
            define(v, "node", where)
            if v.producer is not node:
                raise GraphError(f"{where}: output %{v.name} names {v.producer and v.producer.name} as its producer")
        if fake_mode is not None:
            _check_meta(node, where, fake_mode)
    for v in graph.outputs:
        _check_use(v, defined, later, "graph output")


def _check_use(v: Value, defined: dict[str, Value], later: dict[str, Node], where: str) -> None:
    if v.name not in defined:
        if v.name in later:
            raise GraphError(f"{where}: reads %{v.name} before node {later[v.name].name} defines it "
                             "(nodes are not in topological order)")
        raise GraphError(f"{where}: reads %{v.name}, which no input, const or node defines")
    if defined[v.name] is not v:
        raise GraphError(f"{where}: reads a Value named %{v.name} that is not the one the graph defines")


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _check_meta(node: Node, where: str, fake_mode) -> None:
    """Runs the op on fake tensors (meta kernels) and compares outputs with the declared ones."""
    with fake_mode:
        args, kwargs = pytree.tree_map(
            lambda x: torch.empty(x.shape, dtype=x.dtype) if isinstance(x, Value) else x, (node.args, node.kwargs))
        try:
            out = node.target(*args, **kwargs)
        except Exception:  # no meta kernel, or a data-dependent output shape: not checkable
            return
    outs = (out,) if isinstance(out, torch.Tensor) else tuple(out) if isinstance(out, (tuple, list)) else None
    if outs is None or len(outs) != len(node.outputs):
        got = "a non-tensor result" if outs is None else f"{len(outs)} outputs"
        raise GraphError(f"{where}: declares {len(node.outputs)} outputs, the op returns {got}")
    for v, t in zip(node.outputs, outs):
        if not isinstance(t, torch.Tensor):
            continue
        if tuple(t.shape) != v.shape or t.dtype != v.dtype:
            raise GraphError(f"{where}: output %{v.name} is declared {list(v.shape)} {v.dtype}, "
                             f"the op gives {list(t.shape)} {t.dtype}")
