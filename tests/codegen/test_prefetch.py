"""Gathered rows of row kernels are prefetched a few rows ahead (vtc.codegen.prefetch), with the same results."""
from __future__ import annotations

import pytest
import torch

from vtc.codegen import prefetch
from vtc.codegen.cpp import generate

from .util import ROW_TOL, assert_matches_eager, compile_cpu, gathered_prefetches, gen, kernels, rand


@pytest.mark.parametrize("rows,width,picks", [(127, 17, 3), (9, 256, 40), (3, 1, 5)])
def test_index_select_then_row_reduction_prefetches_and_matches_eager(rows, width, picks):
    g = gen(90 + rows)
    table = rand((rows, width), g)
    idx = torch.randint(0, rows, (picks,), generator=g)

    def f(t, i):
        x = t.index_select(0, i)
        return x.sum(-1), torch.softmax(x * 2, -1)

    compiled = compile_cpu(f, (table, idx))
    assert_matches_eager(compiled, f, (table, idx), **ROW_TOL)
    sources = [generate(k) for k in kernels(compiled) if k.kind == "row"]
    assert sources and all(("__builtin_prefetch" in s) == (width > 1) for s in sources)  # a 1-wide row: no r
    idx2 = torch.randint(0, rows, (picks,), generator=g)  # other indices, same kernels
    assert_matches_eager(compiled, f, (table, idx2), **ROW_TOL)


def test_rows_without_a_gather_are_not_prefetched():
    g = gen(99)
    x = rand((17, 33), g)
    compiled = compile_cpu(lambda x: torch.softmax(x.t(), -1), (x,))
    assert not any("__builtin_prefetch" in generate(k) for k in kernels(compiled))


@pytest.mark.parametrize("l2,near,expected", [(1 << 30, True, [(prefetch.AHEAD, 3)]),
                                              (4096, True, [(prefetch.FAR_AHEAD, 2), (prefetch.AHEAD, 3)]),
                                              (4096, False, [(prefetch.FAR_AHEAD, 2)])])
def test_tables_larger_than_l2_are_prefetched_into_l2_further_ahead(monkeypatch, l2, near, expected):
    """A gathered table larger than L2 (here made so by ``L2_BYTES``): its rows FAR_AHEAD on into L2 (prefetcht1,
    locality 2) and, with FAR_AND_NEAR, AHEAD on into L1; else AHEAD on into L1 (prefetcht0) only.  Same results
    either way, also with fewer rows than the distance and the last rows, which prefetch nothing."""
    monkeypatch.setattr(prefetch, "L2_BYTES", l2)
    monkeypatch.setattr(prefetch, "FAR_AND_NEAR", near)
    g = gen(7)
    table = rand((300, 64), g)  # 75 KB
    for picks in (40, 5):
        idx = torch.randint(0, 300, (picks,), generator=g)
        f = lambda t, i: t.index_select(0, i).sum(-1)
        compiled = compile_cpu(f, (table, idx))
        assert_matches_eager(compiled, f, (table, idx), **ROW_TOL)
        assert gathered_prefetches(compiled) == expected


def test_the_machines_l2_decides(monkeypatch):
    """Without the override the level is chosen against the machine's L2 (sysfs), else FALLBACK_L2_BYTES."""
    monkeypatch.setattr(prefetch.stream, "machine_cache_bytes", lambda level=None: 2 << 20 if level == 2 else None)
    assert prefetch.l2_bytes() == 2 << 20
    monkeypatch.setattr(prefetch.stream, "machine_cache_bytes", lambda level=None: None)
    assert prefetch.l2_bytes() == prefetch.FALLBACK_L2_BYTES


def test_sizes_on_both_sides_of_l2_with_size_generic_kernels(monkeypatch):
    """dynamic=True: tables below and above L2 (here 50 rows of 256 B) take the two prefetch forms; sizes on both
    sides, in and out of order, are computed as eager does."""
    import vtc

    monkeypatch.setattr(prefetch, "L2_BYTES", 50 * 256)
    g = gen(11)
    f = lambda t, i: t.index_select(0, i).sum(-1)  # noqa: E731
    make = lambda n: (rand((n, 64), g), torch.randint(0, n, (n,), generator=g))  # noqa: E731
    compiled = vtc.compile(f, make(46), dynamic=True)
    for n in (46, 48, 49, 51, 53, 60, 47):
        x = make(n)
        torch.testing.assert_close(compiled(*x), f(*x), **ROW_TOL)
