"""Behaviour of the cost model (vtc/plan/cost.py: the access classes and the traffic and compute prices) that
tests/plan/test_cost.py did not pin: found by mutation testing (docs/testing.md).  Each test fails with one
small change to cost.py that test_cost.py lets pass.  Prices are computed on the fixed FALLBACK machine."""
from __future__ import annotations

from vtc.index.expr import floordiv, lt
from vtc.index.mapping import Mapping, Piece, identity, out_vars
from vtc.plan.cost import CONTIGUOUS, access, op_counts


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
