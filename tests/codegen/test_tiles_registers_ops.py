"""Transposed tiles in registers beyond + - * / (``vtc.codegen.tiles._register_block``): a negation, a ``where`` on a
comparison, other float unary ops (relu, abs, exp, sigmoid, ...) and binary ops without a vector operator (max,
min, pow) keep the 16 transposed vectors in registers (``vtc_map16`` / ``vtc_map16_2`` lane by lane, a vector
select), where before such a kernel kept every block in the 1 KB buffer.  Against eager on random inputs with
edge tiles and non-contiguous inputs, the same floats as the buffer form bit for bit, and what still keeps the
buffer.  The form checks (``REGS``) fail on the code before (those kernels had no ``vtc_tile_transpose16_regs``).
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen import tiles
from vtc.codegen.cpp import generate

from .util import POINTWISE_TOL, assert_no_movement, check, gen, kernels, rand

REGS = "vtc_tile_transpose16_regs(v0, "
BUFFER = "vtc_tile_transpose16(tr0, 16, "

OPS = {
    "neg": lambda a, b: -a + b,
    "relu": lambda a, b: torch.relu(a + b),
    "abs": lambda a, b: a / (b.abs() + 1),
    "exp": lambda a, b: torch.exp(a) * b,
    "sigmoid": lambda a, b: torch.sigmoid(a - b),
    "tanh": lambda a, b: torch.tanh(a) + b,
    "where": lambda a, b: torch.where(a > b, a, b * 2),
    "where_const": lambda a, b: torch.where(a <= 0.5, 0.0, a * b),
    "max": lambda a, b: torch.maximum(a, b) - torch.minimum(a, -b),
    "pow": lambda a, b: torch.pow(a.abs() + 1, b),
    "silu_shared": lambda a, b: torch.nn.functional.silu(a * b) + a * b,
}
SHAPES = [(17, 127), (127, 17), (40, 513)]  # edge rows and columns; (1, 17), (3, 127), (16, 16): below
SMALL = [(1, 17), (3, 127), (16, 16), (127, 127)]


def _src(compiled) -> str:
    (k,) = kernels(compiled)
    return generate(k)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_ops_in_registers(shape, op):
    g = gen(90)
    x, y = rand(shape[::-1], g), rand(shape, g)
    f = OPS[op]
    compiled = check(lambda x, y: f(x.t(), y), (x, y), **POINTWISE_TOL)
    assert compiled.report.to_dict()["materialized_movement_bytes"] == 0
    src = _src(compiled)
    tiled = min(shape) >= 16
    assert (REGS in src) == tiled and (BUFFER in src) == tiled, src


@pytest.mark.parametrize("op", ["relu", "where"])
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "x".join(map(str, s)))
def test_small_and_square(shape, op):
    test_ops_in_registers(shape, op)


def test_forms_written():
    """A negation is a vector negation, a where a vector select on the comparison, relu lane by lane, a value used
    twice computed once per row."""
    g = gen(91)
    x, y = rand((40, 33), g), rand((33, 40), g)
    src = _src(check(lambda x, y: torch.where(x.t() > y, torch.relu(-x.t()), y), (x, y), **POINTWISE_TOL))
    assert REGS in src and "(-v0[r_])" in src and "vtc_map16(" in src and "vtc_relu(z_)" in src
    assert "vtc_select16((v0[r_] > l0), " in src, src
    src = _src(check(lambda x, y: OPS["silu_shared"](x.t(), y), (x, y), **POINTWISE_TOL))
    assert "const auto e0 = (v0[r_] * l0);" in src, src


@pytest.mark.parametrize("shape", [(17, 127), (3, 33, 40)], ids=lambda s: "x".join(map(str, s)))
def test_non_contiguous_inputs_and_broadcasts(shape):
    """A sliced operand read across its rows, a transposed view along them, a per-column vector and a per-row
    float, under a where and an exp."""
    g = gen(92)
    *b, m, n = shape
    x = rand((*b, n, m + 3), g)[..., 1:-2]
    y = rand((*b, n, m), g).transpose(-1, -2)
    col, row = rand((n,), g), rand((m, 1), g)
    compiled = check(lambda x, y, c, r: torch.where(x.transpose(-1, -2) < r, torch.exp(y * c), -r),
                     (x, y, col, row), **POINTWISE_TOL)
    assert_no_movement(compiled)
    assert REGS in _src(compiled)


def test_nan_and_signed_zero_as_eager():
    """relu keeps NaN and -0.0 (torch's), a where with a NaN comparison takes the false side, max propagates NaN."""
    g = gen(93)
    x, y = rand((33, 40), g), rand((40, 33), g)
    x[3, 5], x[7, 9], y[2, 2], x[20, 17] = float("nan"), -0.0, float("nan"), 0.0
    fn = lambda x, y: (torch.relu(x.t()) + torch.where(x.t() > y, y, x.t() * 0) * torch.maximum(x.t(), y))
    compiled = check(fn, (x, y), **POINTWISE_TOL)
    assert REGS in _src(compiled)
    torch.testing.assert_close(compiled(x, y), fn(x, y), rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.equal(torch.signbit(compiled(x, y)), torch.signbit(fn(x, y)))


@pytest.mark.parametrize("op", ["relu", "where", "sigmoid", "max", "exp"])
def test_same_values_as_the_buffer_form(monkeypatch, op):
    """The register form computes the same floats as the buffer form, bit for bit."""
    g = gen(94)
    x, y = rand((40, 513), g), rand((513, 40), g)
    fn = lambda x, y: OPS[op](x.t(), y)
    regs = check(fn, (x, y), **POINTWISE_TOL)
    assert REGS in _src(regs)
    monkeypatch.setattr(tiles, "REGISTERS", False)
    buffer = check(fn, (x, y), **POINTWISE_TOL)
    assert REGS not in _src(buffer)
    a, b = regs(x, y), buffer(x, y)
    assert a.abs().max() > 0.1 and torch.equal(a, b)


def test_a_bool_condition_keeps_the_buffer():
    """A where on a bool tensor (not a comparison of floats) has no vector form here: the buffer, and right."""
    g = gen(95)
    x, y = rand((40, 33), g), rand((33, 40), g)
    m = rand((33, 40), g) > 0
    src = _src(check(lambda x, y, m: torch.where(m, x.t(), y), (x, y, m), **POINTWISE_TOL))
    assert REGS not in src and BUFFER in src, src
