"""torch.export frontend edge cases: unknown ops, capture failures, input checks, non-tensor I/O."""
from __future__ import annotations

import pytest
import torch

from vtc.frontend.torch_export import CaptureError, export_graph, flatten_inputs, unflatten_outputs
from vtc.ir.printer import parse_graph, print_graph
from vtc.ir.verify import verify
from vtc.runtime.reference import run_graph


@torch.library.custom_op("vtc_test::scaled_sin", mutates_args=())
def scaled_sin(x: torch.Tensor, k: float) -> torch.Tensor:
    return torch.sin(x) * k


@scaled_sin.register_fake
def _(x, k):
    return torch.empty_like(x)


def _run(graph, *args, **kwargs):
    return unflatten_outputs(graph, run_graph(graph, flatten_inputs(graph, args, kwargs)))


def test_unknown_ops_become_fallback_nodes_and_run():
    def f(x):
        return torch.special.bessel_j0(x.t()) + scaled_sin(x, 2.0).t()

    x = torch.randn(4, 3)
    graph = export_graph(f, (x,))  # a plain function, not a module
    verify(graph, deep=True)
    fallback = {n.op for n in graph.nodes if n.kind == "fallback"}
    assert fallback == {"aten.special_bessel_j0.default", "vtc_test.scaled_sin.default"}
    y = torch.randn(4, 3)
    torch.testing.assert_close(_run(graph, y), f(y))
    text = print_graph(graph)
    assert "fallback vtc_test.scaled_sin.default(" in text
    parsed = parse_graph(text)
    assert print_graph(parsed) == text
    torch.testing.assert_close(run_graph(parsed, [y])[0], f(y))  # parsed graphs carry no specs


def test_data_dependent_control_flow_raises_capture_error():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x - 1

    with pytest.raises(CaptureError) as info:
        export_graph(Branchy(), (torch.randn(3),))
    msg = str(info.value)
    assert "Branchy" in msg and 'torch.compile(model, backend="vtc")' in msg
    assert isinstance(info.value, RuntimeError) and info.value.__cause__ is not None
    assert type(info.value.__cause__).__name__ in msg  # names the cause


def test_run_graph_checks_inputs():
    graph = export_graph(lambda a, b: a @ b, (torch.randn(2, 3), torch.randn(3, 4)))
    with pytest.raises(TypeError, match=r"graph takes 2 inputs \(%a: f32\[2, 3\], %b: f32\[3, 4\]\), received 1"):
        run_graph(graph, [torch.randn(2, 3)])
    with pytest.raises(TypeError, match=r"input 1 \(%b\): expected dtype torch.float32, received torch.float64"):
        run_graph(graph, [torch.randn(2, 3), torch.randn(3, 4, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"input 0 \(%a\): expected shape \[2, 3\], received \[2, 5\]"):
        run_graph(graph, [torch.randn(2, 5), torch.randn(3, 4)])
    with pytest.raises(TypeError, match=r"input 0 \(%a\): expected a tensor f32\[2, 3\], received list"):
        run_graph(graph, [[1.0], torch.randn(3, 4)])


def test_kwargs_and_non_tensor_inputs_and_outputs():
    class M(torch.nn.Module):
        def forward(self, x, scale=2, mask=None, *, bias=None):
            a, b = x.chunk(2, dim=-1)
            return {"y": a * scale + bias, "none": None, "n": 3, "pair": (b, x)}

    x, bias = torch.randn(2, 6), torch.randn(3)
    graph = export_graph(M(), (x, 3), {"bias": bias})
    assert [v.name for v in graph.inputs] == ["x", "bias"]
    x2, b2 = torch.randn(2, 6), torch.randn(3)
    got = _run(graph, x2, 3, bias=b2)
    want = M()(x2, 3, bias=b2)
    assert got.keys() == want.keys() and got["none"] is None and got["n"] == 3
    torch.testing.assert_close(got["y"], want["y"])
    torch.testing.assert_close(got["pair"], want["pair"])
    with pytest.raises(ValueError, match=r"non-tensor input 1 was 3 when captured, received 4"):
        flatten_inputs(graph, (x2, 4), {"bias": b2})
    with pytest.raises(ValueError, match=r"inputs do not match the captured structure"):
        flatten_inputs(graph, (x2, 3))


def test_parameters_buffers_and_constants_become_consts():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("persistent", torch.randn(4))
            self.register_buffer("scratch", torch.randn(4), persistent=False)
            self.table = torch.randn(4)  # a plain tensor attribute: a lifted constant

        def forward(self, x):
            return self.lin(x) + self.persistent + self.scratch + self.table

    m = M().eval()
    graph = export_graph(m, (torch.randn(2, 4),))
    assert len(graph.inputs) == 1 and len(graph.consts) == 5
    assert {v.kind for v in graph.consts} == {"const"}
    x = torch.randn(2, 4)
    torch.testing.assert_close(_run(graph, x), m(x))


def test_symbolic_sizes_are_rejected_clearly():
    from vtc.frontend.torch_export import graph_from_fx

    batch = torch.export.Dim("batch")
    ep = torch.export.export(torch.nn.ReLU(), (torch.randn(4, 3),), dynamic_shapes=({0: batch},)).run_decompositions()
    with pytest.raises(CaptureError, match=r"symbolic shape \[s\d+, 3\]; vtc supports static shapes only"):
        graph_from_fx(ep.graph_module)


def test_multi_output_names_stay_unique_and_round_trip():
    def f(x):
        a, b, c = torch.max(x, 0), torch.max(x), torch.max(x, 1)  # fx names max, max_1, max_2 ...
        d, e = x.split(1), x.split(2)  # two chunks; one chunk (a one-element list)
        return a[0] + b + c[1].sum(), d[1], e[0]

    graph = export_graph(f, (torch.randn(2, 2),))
    verify(graph, deep=True)  # unique names, shapes re-derived
    text = print_graph(graph)
    parsed = parse_graph(text)
    assert print_graph(parsed) == text and [n.name for n in parsed.nodes] == [n.name for n in graph.nodes]
    x = torch.randn(2, 2)
    for got, want in zip(run_graph(parsed, [x]), f(x)):
        torch.testing.assert_close(got, want)
