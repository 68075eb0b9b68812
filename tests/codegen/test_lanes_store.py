"""The store pass of a lane row kernel (``vtc.codegen.lanes``) reading the block buffer through a register
transpose: ``softmax(x.permute(2, 0, 1), -1)`` stores exp(x - max) lane-interleaved (``term_buf[r * width + l]``);
the store pass takes 16 r at a time, transposes the width x 16 tile (``vtc_tile_transpose16``) and stores 16
contiguous floats per row, instead of reading term_buf with a stride of `width` floats per output element.
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen import lanes
from vtc.codegen.cpp import PRELUDE, generate

from .util import assert_no_movement, check, gen, kernels, rand

TOL = dict(rtol=1e-5, atol=1e-6)  # softmax in float32: the same exp and sum order per row up to rounding
TILE_CALL = "vtc_tile_transpose16(tile_, 16, term_buf + rb * "


def _softmax(x):
    return torch.softmax(x.permute(2, 0, 1), dim=-1)


def _source(compiled) -> str:
    return "\n".join(generate(k).replace(PRELUDE, "") for k in kernels(compiled))


def test_micro_permute_softmax_store_pass_is_transposed():
    """The benchmark's shape ([s, t, 8], t * 8 floats of a block in the block buffer): the store pass reads
    term_buf as transposed 16 x 16 tiles, and only the steps of r after the last whole tile lane by lane."""
    x = rand((128, 256, 8), gen(11))
    src = _source(check(_softmax, (x,), **TOL))
    assert TILE_CALL + "8, 8);" in src, src
    assert "for (int64_t r = (256 / 16 * 16); r < 256; ++r)" in src, src  # the (empty) tail loop


@pytest.mark.parametrize("t", [1, 3, 17, 127])
@pytest.mark.parametrize("channels", [8, 16, 12, 20])  # 20: a block of 16 lanes and a partial one of 4
def test_transposed_store_matches_eager(t, channels):
    g = gen(100 * t + channels)
    x = rand((5, t, channels), g) * 4.0
    compiled = check(_softmax, (x,), **TOL)
    assert_no_movement(compiled)
    src = _source(compiled)
    width = min(channels, 16)
    assert (TILE_CALL + f"{width}, {width});" in src) == (t >= 16), src


@pytest.mark.parametrize("shape", [(2, 512, 8), (2, 341, 12), (3, 256, 16)])
def test_transposed_store_at_a_full_block_buffer(shape):
    """t * width up to TERM_BUFFER floats: a tile of fewer than 16 lanes reads past the block's last r (the
    slack of the buffer), lanes that the store ignores."""
    x = rand(shape, gen(sum(shape)))
    src = _source(check(_softmax, (x,), **TOL))
    assert TILE_CALL in src and "term_buf[4112]" in src, src


def test_transposed_store_with_infinities_nan_and_an_epilogue():
    x = rand((9, 47, 8), gen(12))
    x[0, 4, 3], x[2, 0, 7], x[5, 30, 0], x[:, 7, 5] = float("-inf"), float("inf"), float("nan"), float("-inf")
    fn = lambda x: torch.softmax(x.permute(2, 0, 1), dim=-1) * 2.0  # noqa: E731
    assert TILE_CALL in _source(check(fn, (x,), **TOL))


def test_narrow_blocks_and_the_flag_keep_the_lane_by_lane_store(monkeypatch):
    """4 lanes (a tile would be 3/4 unused) and TRANSPOSED_STORE off: the store pass reads term_buf per lane."""
    x = rand((6, 40, 4), gen(13))
    src = _source(check(_softmax, (x,), **TOL))
    assert "term_buf" in src and "vtc_tile_transpose16(" not in src, src
    monkeypatch.setattr(lanes, "TRANSPOSED_STORE", False)
    x = rand((6, 40, 8), gen(14))
    src = _source(check(_softmax, (x,), **TOL))
    assert "term_buf" in src and "vtc_tile_transpose16(" not in src, src
