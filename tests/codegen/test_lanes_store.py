"""The store pass of a lane row kernel (``vtc.codegen.lanes``) reading the block buffer through a register
transpose: ``softmax(x.permute(2, 0, 1), -1)`` stores exp(x - max) lane-interleaved (``term_buf[r * width + l]``);
the store pass takes 16 r at a time, transposes the width x 16 tile (``vtc_tile_transpose16``; 8 lanes:
``vtc_tile_transpose8x16``) and stores 16 contiguous floats per row, instead of reading term_buf with a stride
of `width` floats per output element.
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen import lanes
from vtc.codegen.cpp import PRELUDE, generate

from .util import assert_no_movement, check, gen, kernels, rand, run_cpp_program

TOL = dict(rtol=1e-5, atol=1e-6)  # softmax in float32: the same exp and sum order per row up to rounding
TILE_CALL = "vtc_tile_transpose16(tile_, 16, term_buf + rb * "
TILE_CALL_8 = "vtc_tile_transpose8x16(tile_, 16, term_buf + rb * 8);"


def _tile_call(width: int) -> str:
    return TILE_CALL_8 if width == 8 else TILE_CALL + f"{width}, {width});"


def _softmax(x):
    return torch.softmax(x.permute(2, 0, 1), dim=-1)


def _source(compiled) -> str:
    return "\n".join(generate(k).replace(PRELUDE, "") for k in kernels(compiled))


def test_micro_permute_softmax_store_pass_is_transposed():
    """The benchmark's shape ([s, t, 8], t * 8 floats of a block in the block buffer): the store pass reads
    term_buf as transposed 16 x 16 tiles, and only the steps of r after the last whole tile lane by lane."""
    x = rand((128, 256, 8), gen(11))
    src = _source(check(_softmax, (x,), **TOL))
    assert TILE_CALL_8 in src, src
    assert "for (int64_t r = (256 / 16 * 16); r < 256; ++r)" in src, src  # the (empty) tail loop


# t 1 (no lane kernel), 3 (no whole tile), 17 and 127 (whole tiles and a tail); 12 channels: a block of 12 lanes
# (a 16 x 16 tile, 4 rows ignored), 20: a block of 16 lanes and a partial one of 4
@pytest.mark.parametrize("t, channels", [(1, 8), (3, 8), (17, 8), (127, 8), (1, 16), (3, 16), (17, 16),
                                         (127, 16), (3, 12), (17, 12), (127, 20)])
def test_transposed_store_matches_eager(t, channels):
    g = gen(100 * t + channels)
    x = rand((5, t, channels), g) * 4.0
    compiled = check(_softmax, (x,), **TOL)
    assert_no_movement(compiled)
    src = _source(compiled)
    width = min(channels, 16)
    assert (_tile_call(width) in src) == (t >= 16), src


@pytest.mark.parametrize("shape", [(2, 4096, 8), (2, 2730, 12), (2, 2048, 16)])
def test_transposed_store_at_a_full_block_buffer(shape):
    """t * width up to TERM_BUFFER (32768) floats: a tile of fewer than 16 lanes reads past the block's last r (the
    slack of the buffer), lanes that the store ignores."""
    x = rand(shape, gen(sum(shape)))
    src = _source(check(_softmax, (x,), **TOL))
    assert _tile_call(min(shape[2], 16)) in src and f"term_buf[{lanes.TERM_BUFFER + 16}]" in src, src


def test_transposed_store_with_infinities_nan_and_an_epilogue():
    x = rand((9, 47, 8), gen(12))
    x[0, 4, 3], x[2, 0, 7], x[5, 30, 0], x[:, 7, 5] = float("-inf"), float("inf"), float("nan"), float("-inf")
    fn = lambda x: torch.softmax(x.permute(2, 0, 1), dim=-1) * 2.0  # noqa: E731
    assert TILE_CALL_8 in _source(check(fn, (x,), **TOL))


def test_narrow_blocks_and_the_flag_keep_the_lane_by_lane_store(monkeypatch):
    """4 lanes (a tile would be 3/4 unused) and TRANSPOSED_STORE off: the store pass reads term_buf per lane."""
    x = rand((6, 40, 4), gen(13))
    src = _source(check(_softmax, (x,), **TOL))
    assert "term_buf" in src and "vtc_tile_transpose" not in src, src
    monkeypatch.setattr(lanes, "TRANSPOSED_STORE", False)
    x = rand((6, 40, 8), gen(14))
    src = _source(check(_softmax, (x,), **TOL))
    assert "term_buf" in src and "vtc_tile_transpose" not in src, src


def test_transpose8x16_on_every_index(tmp_path):
    """vtc_tile_transpose8x16 built with the kernels' compiler and flags: dst[l * ld + b] = src[b * 8 + l] for
    every l < 8, b < 16, and nothing else of dst written (ld 20: 4 untouched floats after each row)."""
    from vtc.codegen.tiles import PRELUDE as TILES

    out = run_cpp_program("#include <cstdint>\n#include <cstdio>\n" + TILES + r"""
int main() {
  float s[128], d[8 * 20];
  for (int i = 0; i < 128; ++i) s[i] = 0.5f * i - 17.0f;
  for (int i = 0; i < 160; ++i) d[i] = -1000.0f;
  vtc_tile_transpose8x16(d, 20, s);
  int bad = 0;
  for (int l = 0; l < 8; ++l)
    for (int b = 0; b < 20; ++b) bad += d[l * 20 + b] != (b < 16 ? s[b * 8 + l] : -1000.0f);
  printf("%d\n", bad);
  return bad != 0;
}
""", tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stdout
