"""Push mappings on arguments no case in tests/virtual/cases.py used: found by the second mutation audit
(docs/testing.md).  Each push is checked against torch on every element by the harness (check_push)."""
from __future__ import annotations

import pytest
import torch

from vtc.index.expr import evaluate, walk
from vtc.virtual.movement import Src, push

from .cases import A, T, case
from .harness import _named, check_push


def test_split_of_an_empty_tensor_pushes_nothing():
    """A tensor without elements has nothing to write into the outputs of its split."""
    assert push(A.split.Tensor, (Src("x", (0, 3)), 2), {}, [(0, 3)]) == {}
    assert push(A.split_with_sizes.default, (Src("x", (0, 3)), [0, 0]), {}, [(0, 3), (0, 3)]) == {}


def assert_push_claims_hold(pushes, env):
    """Every sub-expression of a push stays in its claimed range where its piece applies, and a load of a
    checked index tensor claims exactly its check's range (check_pull's test, for pushes)."""
    for m in pushes.values():
        n = len(m.shape)
        grid = {f"i{k}": torch.arange(s).reshape([s if j == k else 1 for j in range(n)])
                for k, s in enumerate(m.shape)}
        idx_t = {k: env[k] for k in m.index_tensors}
        taken = torch.zeros(m.shape, dtype=torch.bool)
        for p in m.pieces:
            mask = torch.broadcast_to(evaluate(p.when, grid, idx_t).bool(), m.shape) & ~taken
            taken = taken | mask
            for x in (x for e in (p.when, *p.index) for x in walk(e)):
                v = torch.broadcast_to(evaluate(x, grid, idx_t), m.shape)[mask]
                assert x.lo <= int(v.min()) and int(v.max()) <= x.hi, f"{m}: {x} claims [{x.lo}, {x.hi}]"
                if x.op == "load":
                    assert [(c.lo, c.hi) for c in m.checks if c.tensor == x.args[0]] == [(x.lo, x.hi)], \
                        f"{m}: {x} claims [{x.lo}, {x.hi}], its check {m.checks}"


# index tensors holding both ends of their range: a check or a load claim off by one shows
PUSH_CASES = [
    case("index_copy-both-ends", A.index_copy.default, T(5, 3), 0, torch.tensor([4, 0]), T(2, 3)),
    case("index_copy-last-dim", A.index_copy.default, T(2, 4), 1, torch.tensor([0, 3, 1]), T(2, 3)),
    case("scatter-both-ends", A.scatter.src, T(3, 5), 1, torch.tensor([[0, 4], [4, 0], [2, 3]]), T(3, 2)),
    case("index_put-both-ends", A.index_put.default, T(5, 3), [torch.tensor([4, 1, -5])], T(3, 3)),
]


@pytest.mark.parametrize("target,args,kwargs", PUSH_CASES)
def test_push_more(target, args, kwargs):
    pushes = check_push(target, args, kwargs)
    _, _, _, env = _named(target, args, kwargs)
    assert_push_claims_hold(pushes, env)


def test_no_push_for_a_scatter_that_reduces_or_writes_a_value():
    x, index, src = Src("x", (3, 5)), Src("i", (3, 2), torch.int64), Src("s", (3, 2))
    assert push(A.scatter.reduce, (x, 1, index, src), {"reduce": "add"}, [(3, 5)]) == {}
    assert push(A.scatter.value, (x, 1, index, 2.5), {}, [(3, 5)]) == {}
    assert push(A.scatter.src, (x, 1, index, src), {}, [(3, 5)])  # the plain scatter has one
