"""Lane row kernels (``vtc.codegen.lanes``) whose working set is larger than the last-level cache: the last pass
prefetches, per step of r, the line the next block's first pass reads into L2 (``lanes.PREFETCH``); and a block's
softmax term up to ``TERM_BUFFER`` elements (the micro-benchmark's 2048 r x 8 lanes) in the block buffer, not the
output.  Here the cache is made small (``stream.CACHE_BYTES``) so that small kernels take the form: results against
eager with blocks of 8 lanes (2 steps of r per vector, with an odd r: the tail loop), 16 lanes, 24 (a partial block)
and 4; the form written exactly where the working set exceeds the cache, not with ``PREFETCH = False``, not for a
single pass (permute -> sum) nor where a step reads less than a line (5 lanes).  Fail before: the form checks.
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen import lanes, stream
from vtc.codegen.cpp import PRELUDE, generate

from .util import check, gen, kernels, rand

TOL = dict(rtol=1e-5, atol=1e-6)
MARK = "// the next block (lanes.PREFETCH)"


def _softmax(x):
    return torch.softmax(x.permute(2, 0, 1), dim=-1)


def _source(compiled) -> str:
    return "\n".join(generate(k).replace(PRELUDE, "") for k in kernels(compiled))


@pytest.fixture
def small_cache(monkeypatch):
    monkeypatch.setattr(stream, "CACHE_BYTES", 1 << 10)


@pytest.mark.parametrize("shape", [(8, 100, 8), (4, 37, 8), (3, 50, 16), (5, 40, 24), (6, 30, 4)],
                         ids=lambda s: "x".join(map(str, s)))
def test_prefetching_lane_kernels_match_eager(small_cache, shape):
    x = rand(shape, gen(sum(shape)))
    src = _source(check(_softmax, (x,), **TOL))
    assert MARK in src, src
    assert src.count("__builtin_prefetch(b0 + ") == 1 and ", 0, 2);" in src, src  # one load, into L2


def test_only_beyond_the_cache_and_not_when_off(monkeypatch):
    x = rand((8, 100, 8), gen(3))
    monkeypatch.setattr(stream, "CACHE_BYTES", 2 * x.numel() * 4)  # the working set exactly: within the cache
    assert MARK not in _source(check(_softmax, (x,), **TOL))
    monkeypatch.setattr(stream, "CACHE_BYTES", 2 * x.numel() * 4 - 1)
    assert MARK in _source(check(_softmax, (x,), **TOL))
    monkeypatch.setattr(lanes, "PREFETCH", False)
    assert MARK not in _source(check(_softmax, (x,), **TOL))


def test_not_for_one_pass_nor_less_than_a_line_per_step(small_cache):
    x = rand((8, 100, 8), gen(4))
    src = _source(check(lambda x: x.permute(2, 0, 1).sum(-1), (x,), **TOL))
    assert "accv_" in src and MARK not in src, src  # a lane kernel, one pass
    src = _source(check(_softmax, (rand((6, 30, 5), gen(5)),), **TOL))
    assert "accv_" in src and MARK not in src, src  # 5 lanes x 3 steps of r: 15 floats a step


def test_micro_permute_softmax_64mb_term_in_the_block_buffer():
    """The 64 MB benchmark's rows (2048 r, 8 lanes: 16384 floats a block) keep exp(x - max) in the block buffer and
    store through the 8 x 16 transpose, rather than writing it to the output and reading it back."""
    src = _source(check(_softmax, (rand((2, 2048, 8), gen(6)),), **TOL))
    assert "term_buf[r * 8 + l] = term_" in src or "term_buf[rr * 8 + j] = term_" in src, src
    assert "vtc_tile_transpose8x16(tile_, 16, term_buf + rb * 8);" in src, src
