"""Transposed reads block by block (``vtc.codegen.tiles.BLOCKED``): each 16 x 16 block of a transposed operand
is transposed in registers into a 1 KB buffer and its 16 rows x 16 columns computed right away (before: the
tile's 16 x 256 floats transposed first, then the tile computed); a streamed output is staged per tile and
written row by row with ``vtc_stream_row``.  Against eager on sizes with edge tiles and below a tile, and
non-contiguous inputs; the generated source is checked for the form.  The form checks fail on the code
before (no ``vtc_tile_transpose16(tr0, 16,`` / ``vtc_stream_row``); the ``vtc_stream_row`` test cannot build
before.
"""
from __future__ import annotations

import pytest
import torch

from bench.workloads import micro
from vtc.codegen import stream, tiles
from vtc.codegen.cpp import _Emitter, generate
from vtc.codegen.tiles import transposed_loads

from .util import (POINTWISE_TOL, assert_all_generated, assert_no_movement, check, gen, kernels, rand,
                   run_cpp_program)

BLOCKED = "vtc_tile_transpose16(tr0, 16, "
STAGED = "vtc_stream_row(b"  # a call (the prelude defines it in every streamed kernel)


def _always(monkeypatch):
    """Every qualifying store streams, whatever its size (as tests/codegen/test_stream.py), the block form's too."""
    monkeypatch.setattr(stream, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(stream, "CACHE_BYTES", 0)
    monkeypatch.setattr(tiles, "STREAM", True)


SHAPES = [(1, 17), (3, 127), (17, 3), (16, 16), (17, 127), (127, 17), (127, 127), (33, 300), (40, 513)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_transpose_add_block_by_block(shape):
    g = gen(60)
    x, y = rand(shape[::-1], g), rand(shape, g)
    compiled = check(lambda x, y: x.t() * 2 + y, (x, y), **POINTWISE_TOL)
    assert_no_movement(compiled)
    assert_all_generated(compiled)
    (k,) = kernels(compiled)
    tiled = min(shape) >= 16
    assert bool(transposed_loads(k, _Emitter(k).shapes)) == tiled
    src = generate(k)
    assert (BLOCKED in src) == tiled, src
    assert STAGED not in src  # small outputs are not streamed
    if tiled:  # the last rows and columns read a block shifted back inside the domain, not the strided load
        assert "ra = std::min<int64_t>(ta0, " in src and "const int64_t qa = tb1 - 16;" in src
        assert "} else {" not in src and "(i0 + " not in src.split('extern "C"')[1], src


@pytest.mark.parametrize("shape", [(17, 127), (127, 17), (3, 33, 40)], ids=lambda s: "x".join(map(str, s)))
def test_non_contiguous_inputs(shape):
    """A sliced operand read across its rows and a transposed view (the runtime passes both contiguous)."""
    g = gen(61)
    *b, m, n = shape
    x = rand((*b, n, m + 3), g)[..., 1:-2]
    y = rand((*b, n, m), g).transpose(-1, -2)
    compiled = check(lambda x, y: torch.sigmoid(x.transpose(-1, -2)) - y, (x, y), **POINTWISE_TOL)
    assert_no_movement(compiled)
    (k,) = kernels(compiled)
    assert BLOCKED in generate(k)


def test_two_transposed_operands_a_broadcast_and_a_batch():
    g = gen(62)
    a, b, c, d = rand((3, 140, 35), g), rand((3, 140, 35), g), rand((140,), g), rand((3, 35, 140), g)
    compiled = check(lambda a, b, c, d: a.transpose(1, 2) - b.transpose(1, 2) * c + d, (a, b, c, d),
                     **POINTWISE_TOL)
    assert_no_movement(compiled)
    (k,) = kernels(compiled)
    src = generate(k)
    assert BLOCKED in src and "vtc_tile_transpose16(tr1, 16, " in src, src


@pytest.mark.parametrize("shape", [(17, 127), (127, 33), (16, 16), (40, 513), (3, 127)],
                         ids=lambda s: "x".join(map(str, s)))
def test_streamed_tiles_stage_the_output(shape, monkeypatch):
    """With streaming on, a tile's results go to a staging buffer and each row to memory by vtc_stream_row
    (rows of 127 or 33 floats start anywhere in a line: a plain head, whole lines, a plain tail); the rows
    of a tile of fewer than 16 rows stay plain."""
    _always(monkeypatch)
    g = gen(63)
    x, y = rand(shape[::-1], g), rand(shape, g)
    compiled = check(lambda x, y: x.t() + y, (x, y), **POINTWISE_TOL)
    assert_no_movement(compiled)
    (k,) = kernels(compiled)
    src = generate(k)
    tiled = min(shape) >= 16
    assert (STAGED in src) == tiled and (BLOCKED in src) == tiled, src
    assert "vtc_stream_fence();" in src  # the plain loops stream when not tiled


@pytest.mark.parametrize("cols", [127, 33])
def test_two_streamed_stores_two_staging_buffers(cols, monkeypatch):
    """y = x.t() * 2 stored into its own output and, through the cat's push mapping, at column 1 of the cat's
    rows of cols + 1: one kernel with two stores, each staged and streamed at its own alignment."""
    _always(monkeypatch)
    x = rand((cols, 37), gen(65))

    def fn(x):
        y = x.t() * 2
        return torch.cat((x.t()[:, :1] * 3, y), dim=-1), y

    compiled = check(fn, (x,), **POINTWISE_TOL)
    two = [generate(k) for k in kernels(compiled) if len(k.stores) == 2]
    assert two and "ob1[" in two[0] and two[0].count(STAGED) == 2, two
    assert_no_movement(compiled)


def test_tile_form_kept_for_ab(monkeypatch):
    """``BLOCKED = False`` restores the whole-tile form (bench/tiles_ab.py compares the two)."""
    monkeypatch.setattr(tiles, "BLOCKED", False)
    g = gen(64)
    x, y = rand((127, 33), g), rand((33, 127), g)
    compiled = check(lambda x, y: x.t() + y, (x, y), **POINTWISE_TOL)
    src = generate(kernels(compiled)[0])
    assert "vtc_tile_transpose16(tr0 + (q - tb0), 256, " in src and BLOCKED not in src


def test_8mb_chain_plain_stores_and_stays_virtual(monkeypatch):
    """micro_transpose_add_8mb (1448 x 1448: rows not aligned to a line, a partial last tile) at a 32 MB cache: the
    block form stores plainly (``tiles.STREAM`` off; the old tile form streamed there), nothing materialised;
    with STREAM it streams through the staging buffers."""
    monkeypatch.setattr(stream, "CACHE_BYTES", 32 << 20)
    fn, _ = micro._CHAINS["transpose_add"]
    model, inputs = fn(8 * micro.MB // 4)
    compiled = check(model, inputs, **POINTWISE_TOL)
    assert_no_movement(compiled)
    src = generate(kernels(compiled)[0])
    assert BLOCKED in src and STAGED not in src and "vtc_stream_fence();" not in src
    monkeypatch.setattr(tiles, "STREAM", True)
    assert STAGED in generate(kernels(check(model, inputs, **POINTWISE_TOL))[0])


def test_stream_row_on_every_offset_and_length(tmp_path):
    """vtc_stream_row built with the kernels' compiler and flags: dst[0:n] = src[0:n] for every dst offset
    within a line (0..15 floats), src offset (0..3) and n in 0..70, nothing outside dst[0:n] written."""
    out = run_cpp_program("#include <cstdint>\n#include <cstdio>\n#include <algorithm>\n" + stream.PRELUDE + r"""
int main() {
  alignas(64) float s[128], d[128];
  for (int i = 0; i < 128; ++i) s[i] = 0.25f * i - 9.0f;
  int bad = 0;
  for (int off = 0; off < 16; ++off)
    for (int so = 0; so < 4; ++so)
      for (int n = 0; n <= 70; ++n) {
        for (int i = 0; i < 128; ++i) d[i] = -1000.0f;
        vtc_stream_row(d + off, s + so, n);
        vtc_stream_fence();
        for (int i = 0; i < 128; ++i) bad += d[i] != (i >= off && i < off + n ? s[so + i - off] : -1000.0f);
      }
  printf("%d\n", bad);
  return bad != 0;
}
""", tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stdout
