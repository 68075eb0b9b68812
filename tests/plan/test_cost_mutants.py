"""Behaviour of the cost model (vtc/plan/cost.py: the access classes and the traffic and compute prices) that
tests/plan/test_cost.py did not pin: found by mutation testing (docs/testing.md).  Each test fails with one
small change to cost.py that test_cost.py lets pass.  Prices are computed on the fixed FALLBACK machine."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vtc.index.expr import floordiv, lt
from vtc.index.mapping import Mapping, Piece, identity, out_vars
from vtc.plan.cost import (BROADCAST, CHUNKED, CONTIGUOUS, FALLBACK, INDIRECT, SCATTERED, VIEW, Access, CostModel,
                           access, op_counts)
from vtc.virtual import movement
from vtc.virtual.movement import Src


def pull(op, *args, out, **kw):
    return movement.pull(op, args, kw, [out])[0]


def test_the_inner_loop_runs_over_the_last_dim_of_more_than_one_element():
    """Trailing size-1 dims are not the inner loop: a div by the last dim of size > 1 is computed per element."""
    i0, i1, _ = out_vars((3, 4, 1))
    m = Mapping((3, 4, 1), (Piece("x", (floordiv(i1, 2), i0)),), {"x": (2, 3)})
    assert op_counts(m) == (1, 0)
    a = access(m, 4)
    assert (a.run, a.run_ops) == (4, 0)
    assert access(identity("x", (3, 2, 1)), 4).run == 2
    assert access(identity("x", (5, 1)), 4).run == 5
    assert access(identity("x", (1, 1)), 4).run == 1
    assert access(identity("x", ()), 4).run == 1


def test_source_bytes_are_the_bytes_of_every_source():
    i0, i1 = out_vars((5, 3))
    cat = Mapping((5, 3), (Piece("a", (i0, i1), lt(i0, 3)), Piece("b", (i0 - 3, i1))), {"a": (3, 3), "b": (2, 3)})
    assert access(cat, 4).source_bytes == (9 + 6) * 4
    assert access(identity("x", (3, 4)), 2).source_bytes == 24


def test_a_dense_read_with_size_one_dims_is_contiguous():
    assert access(identity("x", (3, 1, 4)), 4).kind == CONTIGUOUS
    assert access(identity("x", (1, 5)), 4).kind == CONTIGUOUS
    assert access(identity("x", (4, 2)), 4).kind == CONTIGUOUS


def test_runs_of_exactly_a_cache_line_are_chunked():
    """"chunked" is contiguous runs of at least a cache line: a cat of rows of 16 floats reads runs of 64 B."""
    a = access(pull(torch.ops.aten.cat.default, [Src("a", (8, 16)), Src("b", (8, 16))], 1, out=(8, 32)), 4)
    assert (a.kind, a.chunk_bytes) == (CHUNKED, 64)


def test_sourced_pieces_count_the_pieces_that_read_a_source():
    cat = access(pull(torch.ops.aten.cat.default, [Src("a", (8, 32)), Src("b", (8, 32))], 1, out=(8, 64)), 4)
    pad = access(pull(torch.ops.aten.constant_pad_nd.default, Src("x", (8, 30)), [1, 1], 0.0, out=(8, 32)), 4)
    assert (cat.sourced_pieces, pad.sourced_pieces) == (2, 1)


@pytest.mark.parametrize("shape,dims,stride", [((8, 16, 1), [1, 0, 2], 16), ((2, 16), [1, 0], 16),
                                               ((16, 2), [1, 0], 2), ((3, 1, 4), [1, 0, 2], 1)])
def test_a_strided_walk_skips_size_one_dims(shape, dims, stride):
    """The inner stride of a permuted read is that of its last dim of more than one element."""
    out = tuple(shape[d] for d in dims)
    a = access(pull(torch.ops.aten.permute.default, Src("x", shape), dims, out=out), 4)
    assert a.stride == stride
    if stride > 1:  # a line per element from 16 floats on, a share of one below
        assert a.lines_per_element == pytest.approx(min(1.0, stride * 4 / 64))


def test_a_single_element_is_read_at_stride_one():
    for shape in [(1, 1), ()]:
        a = access(identity("x", shape), 4)
        assert (a.kind, a.chunk_bytes, a.stride, a.lines_per_element) == (CONTIGUOUS, 4.0, 1, 4 / 64)


def test_a_repeated_middle_dim_does_not_break_a_contiguous_run():
    """Rows of 8 floats, each read 3 times: the repeats come from cache, so the contiguous run goes on into the
    next row (4 rows of 32 B: 128 B) and a line serves 16 elements."""
    a = access(pull(torch.ops.aten.expand.default, Src("x", (4, 1, 8)), [4, 3, 8], out=(4, 3, 8)), 4)
    assert (a.stride, a.chunk_bytes, a.lines_per_element) == (1, 128.0, 4 / 64)


def test_a_contiguous_run_ends_at_the_first_gap():
    """Rows of 8 floats (32 B) 32 apart: a run is one row, each on a line of its own (1/8 line per element);
    and a dim whose stride continues the run again after a gap does not extend it (as_strided)."""
    rows = access(pull(torch.ops.aten.slice.Tensor, Src("x", (8, 32)), 1, 0, 8, out=(8, 8)), 4)
    assert (rows.chunk_bytes, rows.lines_per_element) == (32.0, 1 / 8)
    gap = access(pull(torch.ops.aten.as_strided.default, Src("x", (300,)), [2, 3, 4], [4, 100, 1], out=(2, 3, 4)), 4)
    assert gap.strided is not None and gap.strided.strides == (4, 100, 1)
    assert (gap.chunk_bytes, gap.lines_per_element) == (16.0, 1 / 4)


def _acc(kind, lines, source_bytes, stride=16, window_lines=float("inf"), window_bytes=float("inf")):
    return Access(kind, 64.0, stride, lines, 0, source_bytes, None, window_lines, window_bytes)


BIG = 8 << 20  # a source larger than FALLBACK's 1 MiB cache


@pytest.mark.parametrize("acc,cache_bytes,want", [
    # contiguous: the bytes read, whatever else the access says
    (_acc(CONTIGUOUS, 1.0, BIG, stride=1), 1 << 20, 4000),
    # broadcast: the source once, at most the bytes read and at least one element
    (_acc(BROADCAST, 0.5, 400, stride=0), 1 << 20, 400),
    (_acc(BROADCAST, 0.5, 40000, stride=0), 1 << 20, 4000),
    (_acc(BROADCAST, 0.5, 0, stride=0), 1 << 20, 4),
    # a view: a share of a line per element
    (_acc(VIEW, 0.5, BIG), 1 << 20, 32000),
    # ... unless the lines of a block of rows fit the cache (up to its size), each is then read once
    (_acc(VIEW, 1.0, BIG, window_lines=0.25, window_bytes=1 << 20), 1 << 20, 16000),
    (_acc(VIEW, 1.0, BIG, window_lines=0.25, window_bytes=(1 << 20) + 1), 1 << 20, 64000),
    # ... or the whole source fits (up to its size): the source once, at least the bytes read
    (_acc(VIEW, 1.0, 8000), 8000, 8000),
    (_acc(VIEW, 1.0, 8001), 8000, 64000),
    (_acc(VIEW, 1.0, 2000), 8000, 4000),
    # chunked: 5% more for the lines partly used at the run ends; scattered and indirect: 25% more
    (_acc(CHUNKED, 0.1, BIG), 1 << 20, 6400 * 1.05),
    (_acc(CHUNKED, 0.05, BIG), 1 << 20, 4000 * 1.05),
    (_acc(SCATTERED, 0.1, BIG), 1 << 20, 6400 * 1.25),
    (_acc(INDIRECT, 0.05, BIG), 1 << 20, 4000 * 1.25),
])
def test_traffic_of_1000_floats_through_each_kind_of_access(acc, cache_bytes, want):
    model = CostModel(replace(FALLBACK, cache_bytes=cache_bytes))
    assert model.traffic(1000, 4, acc) == pytest.approx(want)


def _ops(stride, index_ops=3, sourced_pieces=1, source_bytes=BIG):
    return Access(VIEW, 64.0, stride, 1.0, index_ops, source_bytes, None, sourced_pieces=sourced_pieces)


@pytest.mark.parametrize("acc,itemsize,threads,want_ns", [
    # inner stride 0 or 1: vectorised, the index ops shared by the lanes of a 32-byte vector
    (_ops(1), 4, 1, 3 * 0.4 * 4 / 32),
    (_ops(0), 4, 1, 3 * 0.4 * 4 / 32),
    (_ops(1), 8, 1, 3 * 0.4 * 8 / 32),
    (_ops(1), 64, 1, 3 * 0.4),  # an element wider than a vector: a vector per element
    # other strides: every element pays its index ops and a scalar load ...
    (_ops(16), 4, 1, 3 * 0.4 + 0.25),
    (_ops(16, sourced_pieces=2, source_bytes=32 << 10), 4, 1, 3 * 0.4 + 0.25),  # ... a choice within L1
    (_ops(16, sourced_pieces=2, source_bytes=(32 << 10) + 1), 4, 1, 3 * 0.4 + 0.25 + 6.0),  # ... gathered
    (_ops(16, sourced_pieces=3, source_bytes=BIG), 4, 1, 3 * 0.4 + 0.25 + 6.0),
    # split over the threads (none given counts as one)
    (_ops(16), 4, 2, (3 * 0.4 + 0.25) / 2),
    (_ops(16), 4, 0, 3 * 0.4 + 0.25),
])
def test_compute_of_1000_elements(acc, itemsize, threads, want_ns):
    model = CostModel(replace(FALLBACK, threads=threads))
    assert model.compute(1000, acc, itemsize) == pytest.approx(1000 * want_ns * 1e-9)
