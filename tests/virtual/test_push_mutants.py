"""Push mappings on arguments no case in tests/virtual/cases.py used: found by the second mutation audit
(docs/testing.md).  Each push is checked against torch on every element by the harness (check_push)."""
from __future__ import annotations

from vtc.virtual.movement import Src, push

from .cases import A


def test_split_of_an_empty_tensor_pushes_nothing():
    """A tensor without elements has nothing to write into the outputs of its split."""
    assert push(A.split.Tensor, (Src("x", (0, 3)), 2), {}, [(0, 3)]) == {}
    assert push(A.split_with_sizes.default, (Src("x", (0, 3)), [0, 0]), {}, [(0, 3), (0, 3)]) == {}
