"""Shared checks for captured models (imported by the capture tests)."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from vtc.frontend.torch_export import export_graph, flatten_inputs, unflatten_outputs
from vtc.ir.graph import Graph
from vtc.ir.printer import parse_graph, print_graph
from vtc.ir.verify import verify
from vtc.runtime.reference import run_graph


def random_like(x: torch.Tensor) -> torch.Tensor:
    """A fresh random input of x's shape and dtype, never zeros (token ids >= 1)."""
    if x.dtype == torch.int64:
        return torch.randint(1, 128, x.shape)
    return torch.randn(x.shape) + 0.5


def check_capture(model: torch.nn.Module, inputs: tuple) -> Graph:
    """Exports ``model`` and checks everything the frontend promises; returns the graph."""
    model.eval()
    graph = export_graph(model, inputs)

    # every value has a static shape and a dtype; consts hold their tensors; the graph is valid
    verify(graph, deep=True)
    assert [v.shape for v in graph.inputs] == [tuple(x.shape) for x in inputs]
    for v in graph.values():
        assert isinstance(v.dtype, torch.dtype) and all(type(s) is int for s in v.shape), v
    for v in graph.consts:
        assert v.data is not None and tuple(v.data.shape) == v.shape and v.data.dtype == v.dtype, v
    assert not any("assert" in n.op or "getitem" in n.op for n in graph.nodes)
    assert {"movement", "compute"} <= {n.kind for n in graph.nodes}
    assert not [n.op for n in graph.nodes if n.kind == "fallback"]

    # run_graph on new random inputs == eager, and the outputs come back in the model's structure
    fresh = tuple(random_like(x) for x in inputs)
    with torch.no_grad():
        expected = model(*fresh)
    got = unflatten_outputs(graph, run_graph(graph, flatten_inputs(graph, fresh)))
    assert type(got) is type(expected), (type(got), type(expected))
    exp_leaves, got_leaves = pytree.tree_leaves(expected), pytree.tree_leaves(got)
    assert len(exp_leaves) == len(got_leaves) > 0
    for e, g in zip(exp_leaves, got_leaves):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)

    # print -> parse -> print is the identity, and the parsed graph computes the same
    text = print_graph(graph)
    parsed = parse_graph(text, {v.name: v.data for v in graph.consts})
    assert print_graph(parsed) == text
    assert [n.name for n in parsed.nodes] == [n.name for n in graph.nodes]
    verify(parsed)
    for a, b in zip(run_graph(parsed, list(fresh)), run_graph(graph, list(fresh))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    return graph
