"""The graph IR's text form, verifier and op classification, on hand-built graphs."""
from __future__ import annotations

import math

import pytest
import torch

from vtc.ir.graph import Graph, Node, Value
from vtc.ir.ops import classify, compute_category
from vtc.ir.printer import format_arg, parse_graph, print_graph
from vtc.ir.verify import GraphError, verify
from vtc.runtime.reference import run_graph

aten = torch.ops.aten


def small_graph() -> Graph:
    x = Value("x", (2, 8), torch.float32, "input")
    w = Value("w", (8, 8), torch.float32, "const", data=torch.randn(8, 8))
    mm = Value("mm", (2, 8), torch.float32)
    s0, s1 = Value("split_0", (2, 4), torch.float32), Value("split_1", (2, 4), torch.float32)
    m = Value("odd name/0", (2, 4), torch.float32)
    nodes = [
        Node("mm", aten.mm.default, (x, w), {}, (mm,), "compute"),
        Node("split", aten.split_with_sizes.default, (mm, [4, 4], 1), {}, (s0, s1), "movement"),
        Node("fill", aten.masked_fill.Scalar, (s1, Value("gt", (2, 4), torch.bool), -math.inf), {}, (m,), "compute"),
    ]
    gt = nodes[2].args[1]
    nodes.insert(2, Node("gt", aten.gt.Scalar, (s0, 0.5), {}, (gt,), "compute"))
    return Graph([x], [w], nodes, [m, s0])


def test_print_form():
    text = print_graph(small_graph())
    assert text.splitlines()[0] == "graph(%x: f32[2, 8], %w: f32[8, 8] const) {"
    assert ("  %split_0: f32[2, 4], %split_1: f32[2, 4] = movement aten.split_with_sizes.default(%mm, [4, 4], 1)"
            in text)
    assert '%"odd name/0": f32[2, 4] = compute aten.masked_fill.Scalar(%split_1, %gt, -inf)  # node fill' in text
    assert text.rstrip().endswith('return (%"odd name/0", %split_0)\n}')


def test_round_trip_and_run():
    g = small_graph()
    text = print_graph(g)
    p = parse_graph(text, {"w": g.consts[0].data})
    assert print_graph(p) == text
    assert [n.name for n in p.nodes] == ["mm", "split", "gt", "fill"]
    verify(p, deep=True)
    x = torch.randn(2, 8)
    for a, b in zip(run_graph(p, [x]), run_graph(g, [x])):
        torch.testing.assert_close(a, b)
    assert parse_graph(text).consts[0].data is None  # consts not given: no tensor


@pytest.mark.parametrize("arg", [
    None, True, False, 0, -3, 1.5, 1e-5, -0.0, math.inf, -math.inf, "tanh", "it's", [1, [2, 3]], (4,), (),
    [], torch.float32, torch.bfloat16, torch.bool, torch.strided, torch.contiguous_format,
    torch.preserve_format, torch.channels_last, torch.device("cpu"), torch.device("cuda", 1), complex(1, -2),
])
def test_args_round_trip(arg):
    x = Value("x", (3,), torch.float32, "input")
    out = Value("y", (3,), torch.float32)
    g = Graph([x], [], [Node("y", aten.clone.default, (x, arg), {"k": arg}, (out,), "movement")], [out])
    p = parse_graph(print_graph(g))
    assert print_graph(p) == print_graph(g)
    got = p.nodes[0].args[1]
    assert type(got) is type(arg) and (got == arg or got != got)  # nan != nan
    assert p.nodes[0].kwargs == {"k": got}


def test_nan_prints_and_parses():
    assert format_arg(math.nan) == "nan" and format_arg([math.inf, -math.inf]) == "[inf, -inf]"


def test_parse_errors_name_the_line():
    with pytest.raises(ValueError, match="not a vtc graph"):
        parse_graph("hello")
    with pytest.raises(ValueError, match=r"line 2: %y is used before it is defined"):
        parse_graph("graph(%x: f32[2]) {\n  %z: f32[2] = compute aten.add.Tensor(%x, %y)\n  return (%z)\n}\n")
    with pytest.raises(ValueError, match="unknown op 'aten.nosuchop.default'"):
        parse_graph("graph(%x: f32[2]) {\n  %z: f32[2] = compute aten.nosuchop.default(%x)\n  return (%z)\n}\n")
    with pytest.raises(ValueError, match="declared f32\\[2\\], tensor given is f32\\[3\\]"):
        parse_graph("graph(%w: f32[2] const) {\n  return (%w)\n}\n", {"w": torch.ones(3)})


def test_verify_catches_bad_graphs():
    g = small_graph()
    g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]
    with pytest.raises(GraphError, match=r"node split .*reads %mm before node mm defines it"):
        verify(g)

    g = small_graph()
    g.nodes[1].outputs[1].name = "mm"
    with pytest.raises(GraphError, match=r"node split .*value name %mm is defined twice"):
        verify(g)

    g = small_graph()
    g.outputs.append(Value("ghost", (1,), torch.float32))
    with pytest.raises(GraphError, match=r"graph output: reads %ghost, which no input, const or node defines"):
        verify(g)

    g = small_graph()
    g.nodes[0].outputs[0].shape = (2, 9)
    verify(g)  # shapes are only re-derived when deep
    with pytest.raises(GraphError, match=r"node mm .*%mm is declared \[2, 9\] torch.float32, the op gives \[2, 8\]"):
        verify(g, deep=True)

    g = small_graph()
    g.consts[0].shape = (8, 7)
    with pytest.raises(GraphError, match=r"const %w is declared \(8, 7\) torch.float32 but holds a tensor \(8, 8\)"):
        verify(g)


def test_classify():
    t = torch.zeros(2, 3)
    assert classify(aten.permute.default, (t, [1, 0]), {}) == "movement"
    assert classify(aten._to_copy.default, (t,), {"dtype": torch.float16}) == "compute"  # a cast
    assert classify(aten._to_copy.default, (t,), {"dtype": torch.float32}) == "movement"
    assert classify(aten.add.Tensor, (t, t), {}) == "compute"
    assert classify(aten.special_bessel_j0.default, (t,), {}) == "fallback"
    assert compute_category(aten.max.other) == "pointwise" and compute_category(aten.max.dim) == "reduction"
    assert compute_category(aten.addmm.default) == "matmul"
    assert compute_category(aten._native_batch_norm_legit_no_training.default) == "norm"
    assert compute_category(aten.where.default) is None  # nonzero: data-dependent shape
