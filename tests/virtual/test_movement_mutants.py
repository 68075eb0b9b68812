"""Movement mappings on arguments no case in tests/virtual/cases.py used (found by mutation testing,
docs/testing.md), each checked against torch on every index (and read in bounds) by the harness."""
from __future__ import annotations

import pytest

from vtc.virtual.movement import Src, pull, push

from .cases import A, T, case
from .harness import check_pull

CASES = [
    case("slice-start-none", A.slice.Tensor, T(5, 3), 0, None, 4),
    case("slice-start-zero", A.slice.Tensor, T(5, 3), 1, 0, 2),
    case("slice-start-before-the-start", A.slice.Tensor, T(5, 3), 0, -100, 3),
    case("slice-start-past-the-end", A.slice.Tensor, T(5, 3), 0, 7, 9),
    case("expand-size-one-dims", A.expand.default, T(1, 3, 1), [2, 4, 3, 5]),
    case("select-first-from-the-end", A.select.int, T(3, 5), 0, -3),
    case("select-last", A.select.int, T(3, 5), 1, 4),
    case("narrow-start-zero", A.narrow.default, T(3, 7), 1, 0, 4),
]


@pytest.mark.parametrize("target,args,kwargs", CASES)
def test_pull(target, args, kwargs):
    check_pull(target, args, kwargs)


@pytest.mark.parametrize("index", [3, -4])
def test_select_out_of_range_raises_like_torch(index):
    with pytest.raises(IndexError):
        A.select.int(T(3, 5), 0, index)
    with pytest.raises(IndexError, match=f"select: index {index} is out of range for dimension 0 of size 3"):
        pull(A.select.int, (Src("x", (3, 5)), 0, index), {}, [(5,)])


def test_cat_pushes_every_input_after_a_legacy_empty_one():
    """cat skips a legacy empty (0,) input: the inputs after it still get their push mappings."""
    a, empty, b = Src("a", (2, 3)), Src("e", (0,)), Src("b", (2, 3))
    pushes = push(A.cat.default, ([a, empty, b],), {}, [(4, 3)])
    assert {name: str(m.pieces[0]) for name, m in pushes.items()} == {"a": "out0[i0, i1]", "b": "out0[(i0 + 2), i1]"}
