"""Transposed tiles, full blocks in registers (``vtc.codegen.tiles.REGISTERS``, ``_register_block``): in a band of
16 full rows, each transposed operand's 16 x 16 block is transposed into 16 vectors that stay in registers and
each row's result is +, -, *, / of them (other ops: test_tiles_registers_ops.py) and the other operands' row vectors (or per-row floats), stored as one
vector; the last rows and a tile's last columns go through the 1 KB buffer as before.  Against eager on sizes
below a tile, with edge tiles, non-contiguous inputs, broadcasts, two outputs; the form checks (``REGS``) fail on
the code before (no ``vtc_tile_transpose16_regs``).
"""
from __future__ import annotations

import pytest
import torch

from bench.workloads import micro
from vtc.codegen import stream, tiles
from vtc.codegen.cpp import generate

from .util import POINTWISE_TOL, assert_no_movement, check, gen, kernels, rand

REGS = "vtc_tile_transpose16_regs(v0, "
BUFFER = "vtc_tile_transpose16(tr0, 16, "

SHAPES = [(1, 17), (3, 127), (16, 16), (17, 127), (127, 17), (127, 127), (33, 300), (40, 513)]
OPS = {"add": lambda a, b: a + b, "sub": lambda a, b: b - a * 2, "mul": lambda a, b: a * b + 0.5,
       "div": lambda a, b: a / (b.abs() + 1)}


def _src(compiled) -> str:
    (k,) = kernels(compiled)
    return generate(k)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_full_blocks_in_registers(shape, op):
    g = gen(80)
    x, y = rand(shape[::-1], g), rand(shape, g)
    f = OPS[op]
    compiled = check(lambda x, y: f(x.t(), y), (x, y), **POINTWISE_TOL)
    assert_no_movement(compiled)
    src = _src(compiled)
    tiled = min(shape) >= 16
    assert (REGS in src) == tiled and (BUFFER in src) == tiled, src  # the buffer: last rows and columns


def test_div_of_an_abs_in_registers_a_cast_in_the_buffer():
    """abs is applied lane by lane in the register form (session 15; before, the whole kernel kept the buffer);
    a cast through int32 has no vector form here: the whole kernel keeps the buffer form (and is right)."""
    g = gen(81)
    x, y = rand((40, 33), g), rand((33, 40), g)
    src = _src(check(lambda x, y: OPS["div"](x.t(), y), (x, y), **POINTWISE_TOL))
    assert REGS in src and "std::abs(z_)" in src, src
    src = _src(check(lambda x, y: (x.t() * 3).to(torch.int32).to(torch.float32) + y, (x, y), **POINTWISE_TOL))
    assert REGS not in src and BUFFER in src, src


@pytest.mark.parametrize("shape", [(17, 127), (127, 17), (3, 33, 40)], ids=lambda s: "x".join(map(str, s)))
def test_non_contiguous_inputs_and_broadcasts(shape):
    """A sliced operand read across its rows, a transposed view read along them, a per-column vector and a
    per-row column (one float per row, broadcast to the row's vector)."""
    g = gen(82)
    *b, m, n = shape
    x = rand((*b, n, m + 3), g)[..., 1:-2]
    y = rand((*b, n, m), g).transpose(-1, -2)
    col, row = rand((n,), g), rand((m, 1), g)
    compiled = check(lambda x, y, c, r: x.transpose(-1, -2) * c - y + r, (x, y, col, row), **POINTWISE_TOL)
    assert_no_movement(compiled)
    assert REGS in _src(compiled)


def test_two_transposed_operands_and_a_batch():
    g = gen(83)
    a, b, d = rand((3, 140, 35), g), rand((3, 140, 35), g), rand((3, 35, 140), g)
    src = _src(check(lambda a, b, d: a.transpose(1, 2) - b.transpose(1, 2) * d, (a, b, d), **POINTWISE_TOL))
    assert REGS in src and "vtc_tile_transpose16_regs(v1, " in src, src


@pytest.mark.parametrize("cols", [127, 33])
def test_two_stores_one_at_an_odd_column(cols):
    """y = x.t() * 2 stored into its own output and, through the cat's push mapping, at column 1 of the cat's
    rows of cols + 1 (rows starting anywhere in a line): one kernel, two vector stores from the same registers."""
    x = rand((cols, 37), gen(84))

    def fn(x):
        y = x.t() * 2
        return torch.cat((x.t()[:, :1] * 3, y), dim=-1), y

    compiled = check(fn, (x,), **POINTWISE_TOL)
    assert_no_movement(compiled)
    two = [generate(k) for k in kernels(compiled) if len(k.stores) == 2]
    assert two and REGS in two[0] and "&s1, 64);" in two[0], two


def test_switch_off_and_streamed_keep_the_buffer(monkeypatch):
    """``REGISTERS = False`` (bench/tiles_ab.py's ``buffer``), and a streamed output (staged: the registers form
    only writes plain stores), keep every block in the buffer."""
    g = gen(85)
    x, y = rand((127, 33), g), rand((33, 127), g)
    monkeypatch.setattr(tiles, "REGISTERS", False)
    src = _src(check(lambda x, y: x.t() + y, (x, y), **POINTWISE_TOL))
    assert REGS not in src and BUFFER in src
    monkeypatch.setattr(tiles, "REGISTERS", True)
    monkeypatch.setattr(stream, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(stream, "CACHE_BYTES", 0)
    monkeypatch.setattr(tiles, "STREAM", True)
    src = _src(check(lambda x, y: x.t() + y, (x, y), **POINTWISE_TOL))
    assert REGS not in src and "vtc_stream_row(b" in src


def test_8mb_chain_in_registers():
    fn, _ = micro._CHAINS["transpose_add"]
    model, inputs = fn(8 * micro.MB // 4)
    compiled = check(model, inputs, **POINTWISE_TOL)
    assert_no_movement(compiled)
    src = _src(compiled)
    assert REGS in src and "#pragma GCC unroll 16" in src


def test_same_values_as_the_buffer_form(monkeypatch):
    """The register form computes the same floats as the buffer form, bit for bit (the same operations per
    element), on values far from zero."""
    g = gen(86)
    x, y = rand((40, 513), g), rand((513, 40), g)
    fn = lambda x, y: x.t() * 3 - y
    regs = check(fn, (x, y), **POINTWISE_TOL)
    assert REGS in _src(regs)
    monkeypatch.setattr(tiles, "REGISTERS", False)
    buffer = check(fn, (x, y), **POINTWISE_TOL)
    assert REGS not in _src(buffer)
    a, b = regs(x, y), buffer(x, y)
    assert a.abs().max() > 0.1 and torch.equal(a, b)
