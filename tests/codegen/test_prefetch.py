"""Gathered rows of row kernels are prefetched a few rows ahead (vtc.codegen.prefetch), with the same results."""
from __future__ import annotations

import pytest
import torch

from vtc.codegen.cpp import generate

from .util import ROW_TOL, assert_matches_eager, compile_cpu, gen, kernels, rand


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
