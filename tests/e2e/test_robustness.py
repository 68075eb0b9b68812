"""Defects found by the robustness sweep of session 10 (docs/robustness.md): each test fails on the code before
its fix.  Results are compared with torch eager with explicit tolerances, on random inputs."""
from __future__ import annotations

import pytest
import torch

import vtc


@pytest.mark.parametrize("decimals", [2, 1, -1])
def test_round_with_decimals_rounds_at_that_decimal(decimals):
    torch.manual_seed(0)
    x = torch.randn(64) * 50
    compiled = vtc.compile(lambda a: torch.round(a, decimals=decimals) * 2, (x,))
    torch.testing.assert_close(compiled(x), torch.round(x, decimals=decimals) * 2, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("op", ["floor", "trunc", "remainder", "fmod"])
def test_integer_division_by_a_zero_tensor_element_raises_as_torch_does(op):
    fn = {"floor": lambda a, b: torch.div(a, b, rounding_mode="floor") + 1,
          "trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc") + 1,
          "remainder": lambda a, b: torch.remainder(a, b) + 1, "fmod": lambda a, b: torch.fmod(a, b) + 1}[op]
    torch.manual_seed(1)
    a, b = torch.randint(-9, 9, (4, 8)), torch.randint(1, 9, (4, 8)) * (1 - 2 * torch.randint(0, 2, (4, 8)))
    compiled = vtc.compile(fn, (a, b))
    torch.testing.assert_close(compiled(a, b), fn(a, b), rtol=0, atol=0)
    b[1, 2] = 0
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):  # was: the process killed by SIGFPE
        compiled(a, b)


def test_integer_floor_division_by_a_scalar_still_generates_code():
    a = torch.randint(-50, 50, (4, 8))
    compiled = vtc.compile(lambda a: a // 3 + a % 5, (a,))
    torch.testing.assert_close(compiled(a), a // 3 + a % 5, rtol=0, atol=0)
    assert compiled.report.fallback_ops == []


def test_a_value_dependent_size_is_named_as_such_and_torch_compile_runs_it():
    torch.manual_seed(2)
    a, m = torch.randn(6, 5, 4), torch.rand(6, 5) > 0.5

    def fn(a, m):
        return a[m] * 2

    with pytest.raises(vtc.CaptureError, match=r"size u\d+ depends on the values of the inputs \(a boolean mask"):
        vtc.compile(fn, (a, m))  # was: "symbolic shape ...; export without dynamic_shapes", which it was not
    compiled = torch.compile(fn, backend="vtc")
    torch.testing.assert_close(compiled(a, m), fn(a, m), rtol=1e-6, atol=1e-6)


def _one_op_graph(op, x, *args):
    """A vtc Graph of the single ATen call op(x, *args) (no decomposition on the way)."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vtc.frontend.torch_export import graph_from_fx

    g = fx.Graph()
    a = g.placeholder("a")
    v = g.call_function(op, (a, *args))
    g.output((v,))
    with FakeTensorMode() as mode:
        fa = mode.from_tensor(x)
        a.meta["val"], v.meta["val"] = fa, op(fa, *args)
    return graph_from_fx(fx.GraphModule(torch.nn.Module(), g))


@pytest.mark.parametrize("unbiased", [False, True])
def test_var_dim_reads_unbiased(unbiased):
    from vtc.compiler import compile_graph

    torch.manual_seed(3)
    x = torch.randn(4, 6)
    run = compile_graph(_one_op_graph(torch.ops.aten.var.dim, x, [1], unbiased))
    torch.testing.assert_close(run([x])[0], x.var(1, unbiased=unbiased), rtol=1e-5, atol=1e-6)
    assert run.report.fallback_ops == []


def test_a_definition_that_fails_on_a_call_runs_through_torch_with_a_warning(monkeypatch):
    from vtc.codegen import ops

    def broken(ctx, args, out):
        raise KeyError("a defect")

    monkeypatch.setitem(ops.POINTWISE, "sigmoid", broken)
    torch.manual_seed(4)
    x = torch.randn(5, 7)
    with pytest.warns(vtc.FallbackWarning, match="aten.sigmoid"):
        compiled = vtc.compile(lambda a: torch.sigmoid(a * 2) + 1, (x,))  # was: KeyError out of vtc.compile
    torch.testing.assert_close(compiled(x), torch.sigmoid(x * 2) + 1, rtol=1e-6, atol=1e-6)
    assert compiled.report.fallback_ops == ["aten.sigmoid.default"]


def test_a_new_value_of_a_non_tensor_input_is_captured_for_it():
    class Scaled(torch.nn.Module):
        def forward(self, x, scale: float = 1.0, n: int = 2):
            return x[:n] * scale

    torch.manual_seed(5)
    m, x = Scaled(), torch.randn(8, 3)
    compiled = vtc.compile(m, (x, 2.0), {"n": 3})
    for scale, n in [(2.0, 3), (3.0, 3), (2.0, 5), (0.5, 1)]:  # was: ValueError "capture again for a new value"
        torch.testing.assert_close(compiled(x, scale, n=n), m(x, scale, n=n), rtol=0, atol=0)
    y = torch.randn(6, 3)  # new sizes (a symbolic capture) and then a new constant: not the symbolic graph's
    torch.testing.assert_close(compiled(y, 2.0, n=3), m(y, 2.0, n=3), rtol=0, atol=0)
    torch.testing.assert_close(compiled(y, 4.0, n=4), m(y, 4.0, n=4), rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not match the captured structure"):
        compiled(x, 2.0)  # n missing: another structure, still an error


def test_another_input_structure_names_the_inputs_missing_and_not_expected():
    class Nest(torch.nn.Module):
        def forward(self, d, scale=1.0):
            return d["x"] @ d["y"] * scale + d["z"][0].sum()

    torch.manual_seed(6)
    d = {"x": torch.randn(3, 4), "y": torch.randn(4, 2), "z": [torch.randn(5)]}
    compiled = vtc.compile(Nest(), (d,))
    torch.testing.assert_close(compiled(d), Nest()(d), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"captured structure: missing args\[0\]\['z'\]\[0\]\n  expected"):
        compiled({"x": d["x"], "y": d["y"]})  # was: only the two TreeSpecs, printed over 10 lines
    with pytest.raises(ValueError, match=r"captured structure: not expected kwargs\['scale'\]"):
        compiled(d, scale=2.0)


def test_a_weight_without_data_is_a_capture_error_naming_it():
    class Meta(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(16, 8, device="meta"))

        def forward(self, x):
            return (x @ self.w.to("cpu")).relu()  # eager: "Cannot copy out of meta tensor"

    with pytest.raises(vtc.CaptureError, match=r"tensor %p_w \(\[16, 8\], torch.float32\) has no data \(meta"):
        vtc.compile(Meta(), (torch.randn(4, 16),))  # was: compiled, and each call read garbage
