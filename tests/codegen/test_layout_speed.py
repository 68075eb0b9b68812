"""Code shapes chosen for speed: transposed reads through 16 x 16 register transposes in 16-row tiles, row kernels that walk
rows sharing cache lines one after another.  Each is checked against eager on sizes with edge tiles
(17, 33, 127) and sizes below one tile, and the generated source is checked to use the intended shape.
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen.cpp import _row_order, _Emitter, generate
from vtc.codegen.tiles import tile_columns, transposed_loads

from .util import POINTWISE_TOL, ROW_TOL, assert_all_generated, assert_no_movement, check, gen, kernels, rand

TRANSPOSES = [
    pytest.param((64, 48), id="full-tiles"),
    pytest.param((33, 127), id="edge-tiles"),
    pytest.param((17, 16), id="one-tile-and-edge"),
    pytest.param((3, 127), id="below-a-tile"),
]


@pytest.mark.parametrize("shape", TRANSPOSES)
def test_transpose_add_through_register_tiles(shape):
    g = gen(40)
    x, y = rand(shape, g), rand(shape[::-1], g)
    compiled = check(lambda x, y: x.t() * 2 + y, (x, y), **POINTWISE_TOL)
    assert_no_movement(compiled)
    assert_all_generated(compiled)
    (k,) = kernels(compiled)
    tiled = min(shape) >= 16
    assert bool(transposed_loads(k, _Emitter(k).shapes)) == tiled
    assert ("vtc_tile_transpose16(tr0" in generate(k)) == tiled


@pytest.mark.parametrize("shape", [(40, 300), (16, 513), (33, 257)])
def test_transpose_add_over_several_column_tiles(shape):
    """Inner dims wider than one tile (tile_columns(1) == 256): a second, partial column tile whose full
    16-blocks read the transposed buffer and whose last columns (300 - 256 - 32 = 12, 513 - 512 = 1) read
    the plain loads; a non-contiguous operand."""
    g = gen(45)
    x, y = rand((shape[1], shape[0] + 3), g)[:, 1:-2], rand(shape, g)
    compiled = check(lambda x, y: x.t() + y, (x, y), **POINTWISE_TOL)
    assert_no_movement(compiled)
    (k,) = kernels(compiled)
    assert tile_columns(1) == 256 and shape[1] > 256
    assert "vtc_tile_transpose16(tr0" in generate(k)


def test_batched_transpose_two_transposed_operands_and_a_broadcast():
    """Two operands read across rows in one kernel, a leading batch dim, a broadcast and a contiguous operand;
    two transposed operands share tile_columns(2) == 128 columns: 140 = one full tile + 12 plain columns."""
    g = gen(41)
    a, b, c, d = rand((3, 140, 35), g), rand((3, 140, 35), g), rand((140,), g), rand((3, 35, 140), g)

    def f(a, b, c, d):
        return a.transpose(1, 2) - b.transpose(1, 2) * c + d

    compiled = check(f, (a, b, c, d), **POINTWISE_TOL)
    assert_no_movement(compiled)
    (k,) = kernels(compiled)
    assert len(transposed_loads(k, _Emitter(k).shapes)) == 2  # a and b; c and d are read along the inner dim


def test_transposed_read_under_a_piece_choice_is_left_in_place():
    """A cat piece is only in range for the elements that take it: no tile load may read it for all."""
    g = gen(42)
    x, y, z = rand((20, 32), g), rand((12, 32), g), rand((32, 32), g)
    compiled = check(lambda x, y, z: torch.cat((x, y)).t() + z, (x, y, z), **POINTWISE_TOL)
    (k,) = kernels(compiled)
    assert transposed_loads(k, _Emitter(k).shapes) == []


@pytest.mark.parametrize("shape", [(17, 33, 8), (127, 3, 8), (5, 64, 1)])
def test_permute_softmax_walks_rows_sharing_cache_lines_together(shape):
    g = gen(43)
    x = rand(shape, g)
    compiled = check(lambda x: torch.softmax(x.permute(2, 0, 1), dim=-1), (x,), **ROW_TOL)
    assert_no_movement(compiled)
    (k,) = kernels(compiled)
    order = _row_order(k, _Emitter(k))
    if shape[2] > 1:
        assert order[-1] == 0, order  # the channel dim (stride 1 in the input) varies fastest
    else:
        assert order == list(range(len(k.domain)))


def test_gather_row_index_is_read_once_per_row():
    """index_select -> sum: the row index is loaded before the reduction loop (so that loop vectorises);
    a row index under a cat piece stays in the loop body (out of range for the other piece's rows)."""
    g = gen(44)
    table, other = rand((37, 129), g), rand((37, 129), g)
    idx = torch.tensor([3, 0, 36, 17, 17])
    compiled = check(lambda t, i: t.index_select(0, i).sum(-1), (table, idx), **ROW_TOL)
    (k,) = kernels(compiled)
    src = generate(k)
    assert "const int64_t ix0 = " in src and src.index("const int64_t ix0") < src.index("for (int64_t r")
    compiled = check(lambda t, u, i: torch.cat((t.index_select(0, i), u[:2])).sum(-1), (table, other, idx),
                     **ROW_TOL)
    (k,) = kernels(compiled)
    assert "const int64_t ix" not in generate(k)
