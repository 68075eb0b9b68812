"""The reference interpreter: every node run by the framework (``Node.run``).

Everything vtc generates is checked against this (and against eager).  It checks
the inputs it receives against the graph's declared inputs, and each node's
results against the node's declared output shapes and dtypes, and frees every
intermediate after its last use.
"""
from __future__ import annotations

import torch

from vtc.ir.graph import Graph, Value
from vtc.ir.printer import format_type


def check_inputs(graph: Graph, flat_inputs: list[torch.Tensor], exact_shape: bool = True) -> None:
    """Raises TypeError (count, type, dtype) or ValueError (shape; only rank when not exact_shape)."""
    if len(flat_inputs) != len(graph.inputs):
        expected = ", ".join(f"%{v.name}: {format_type(v.shape, v.dtype)}" for v in graph.inputs)
        raise TypeError(f"graph takes {len(graph.inputs)} inputs ({expected}), received {len(flat_inputs)}")
    for i, (v, t) in enumerate(zip(graph.inputs, flat_inputs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"input {i} (%{v.name}): expected a tensor {format_type(v.shape, v.dtype)}, "
                            f"received {type(t).__name__} {t!r:.80}")
        if t.device.type != "cpu":
            raise TypeError(f"input {i} (%{v.name}): vtc compiled this graph for the CPU, received a tensor on "
                            f"{t.device} ({format_type(tuple(t.shape), t.dtype)})")
        if t.dtype != v.dtype:
            raise TypeError(f"input {i} (%{v.name}): expected dtype {v.dtype}, received {t.dtype} "
                            f"(shape {list(t.shape)})")
        if t.dim() != len(v.shape):
            raise ValueError(f"input {i} (%{v.name}): expected rank {len(v.shape)} (shape {list(v.shape)}), "
                             f"received rank {t.dim()} (shape {list(t.shape)})")
        if exact_shape and tuple(t.shape) != v.shape:
            raise ValueError(f"input {i} (%{v.name}): expected shape {list(v.shape)}, received {list(t.shape)}")


def run_graph(graph: Graph, flat_inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Runs ``graph`` node by node with torch on ``flat_inputs``; returns the flat outputs."""
    check_inputs(graph, flat_inputs)
    env: dict[str, torch.Tensor] = {v.name: t for v, t in zip(graph.inputs, flat_inputs)}
    for v in graph.consts:
        if v.data is None:
            raise ValueError(f"const %{v.name} ({format_type(v.shape, v.dtype)}) has no tensor")
        env[v.name] = v.data
    last_use = {v.name: i for i, n in enumerate(graph.nodes) for v in n.inputs}
    keep = {v.name for v in graph.outputs} | {v.name for v in graph.consts}
    for i, node in enumerate(graph.nodes):
        results = node.run(env)
        if len(results) != len(node.outputs):
            raise RuntimeError(f"node {node.name} ({node.op}) returned {len(results)} results, "
                               f"declares {len(node.outputs)}")
        for v, t in zip(node.outputs, results):
            _check_result(node.name, node.op, v, t)
            if v.name in last_use or v.name in keep:
                env[v.name] = t
        for v in node.inputs:
            if last_use[v.name] == i and v.name not in keep:
                del env[v.name]
    return [env[v.name] for v in graph.outputs]


def _check_result(node: str, op: str, v: Value, t: object) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != v.shape or t.dtype != v.dtype:
        got = format_type(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
        raise RuntimeError(f"node {node} ({op}): output %{v.name} should be "
                           f"{format_type(v.shape, v.dtype)}, the op returned {got}")
