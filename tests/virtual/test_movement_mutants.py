"""Movement mappings on arguments no case in tests/virtual/cases.py used (found by mutation testing,
docs/testing.md), each checked against torch on every index (and read in bounds) by the harness."""
from __future__ import annotations

import pytest

from vtc.virtual.movement import Src, push

from .cases import A, T, case
from .harness import check_pull

CASES = [
    case("slice-start-none", A.slice.Tensor, T(5, 3), 0, None, 4),
    case("slice-start-zero", A.slice.Tensor, T(5, 3), 1, 0, 2),
    case("slice-start-before-the-start", A.slice.Tensor, T(5, 3), 0, -100, 3),
    case("slice-start-past-the-end", A.slice.Tensor, T(5, 3), 0, 7, 9),
    case("expand-size-one-dims", A.expand.default, T(1, 3, 1), [2, 4, 3, 5]),
]


@pytest.mark.parametrize("target,args,kwargs", CASES)
def test_pull(target, args, kwargs):
    check_pull(target, args, kwargs)


def test_cat_pushes_every_input_after_a_legacy_empty_one():
    """cat skips a legacy empty (0,) input: the inputs after it still get their push mappings."""
    a, empty, b = Src("a", (2, 3)), Src("e", (0,)), Src("b", (2, 3))
    pushes = push(A.cat.default, ([a, empty, b],), {}, [(4, 3)])
    assert {name: str(m.pieces[0]) for name, m in pushes.items()} == {"a": "out0[i0, i1]", "b": "out0[(i0 + 2), i1]"}
