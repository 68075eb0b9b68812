"""Register blocks of kernels whose working set is larger than the last-level cache (``vtc.codegen.tiles``,
``PREFETCH_BLOCKS``): each block prefetches the lines of the block PREFETCH_BLOCKS on into L2 (the transposed
operands' 16 lines, the other operands' and the output's 16 row lines), where that block is inside the row.  Here
the cache is made small (``stream.CACHE_BYTES``) so that small kernels take the form: results against eager at
sizes whose last blocks have no block 2 on (the guard), a batched transpose, a where with a per-row operand; the
form written exactly where the working set exceeds the cache, and not with ``PREFETCH_BLOCKS = 0``.  Fail before:
the form checks.
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen import stream, tiles
from vtc.codegen.cpp import generate

from .util import POINTWISE_TOL, check, gen, kernels, rand

MARK = "// the block 2 on, into L2 (tiles.PREFETCH_BLOCKS)"


def _sources(compiled) -> list[str]:
    return [generate(k) for k in kernels(compiled)]


@pytest.fixture
def small_cache(monkeypatch):
    monkeypatch.setattr(stream, "CACHE_BYTES", 1 << 10)


@pytest.mark.parametrize("shape", [(16, 16), (17, 48), (17, 49), (40, 513), (33, 300), (3, 33, 100)],
                         ids=lambda s: "x".join(map(str, s)))
def test_prefetching_blocks_match_eager(small_cache, shape):
    g = gen(sum(shape))
    x, y = rand(shape, g).transpose(-1, -2).contiguous(), rand(shape, g)
    compiled = check(lambda x, y: x.transpose(-1, -2) + y, (x, y), **POINTWISE_TOL)
    (src,) = _sources(compiled)
    assert MARK in src
    assert "__builtin_prefetch(o0 + r_ * " in src and ", 1, 2);" in src  # the output's lines, for writing


def test_a_where_with_a_per_row_float(small_cache):
    g = gen(3)
    x, y, w = rand((40, 130), g), rand((130, 40), g), rand((130, 1), g)
    f = lambda x, y, w: torch.where(x.t() > y, x.t() * w, y)  # noqa: E731
    compiled = check(f, (x, y, w), **POINTWISE_TOL)
    assert any(MARK in s for s in _sources(compiled))


def test_only_beyond_the_cache_and_not_when_off(monkeypatch):
    g = gen(5)
    x, y = rand((40, 513), g), rand((513, 40), g)
    f = lambda x, y: x.t() + y  # noqa: E731
    monkeypatch.setattr(stream, "CACHE_BYTES", 3 * 40 * 513 * 4)  # the working set exactly: within the cache
    assert not any(MARK in s for s in _sources(check(f, (x, y), **POINTWISE_TOL)))
    monkeypatch.setattr(stream, "CACHE_BYTES", 3 * 40 * 513 * 4 - 1)
    assert any(MARK in s for s in _sources(check(f, (x, y), **POINTWISE_TOL)))
    monkeypatch.setattr(tiles, "PREFETCH_BLOCKS", 0)
    assert not any(MARK in s for s in _sources(check(f, (x, y), **POINTWISE_TOL)))
