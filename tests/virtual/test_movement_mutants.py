"""Movement mappings on arguments no case in tests/virtual/cases.py used (found by mutation testing,
docs/testing.md), each checked against torch on every index (and read in bounds) by the harness."""
from __future__ import annotations

import pytest
import torch

from vtc.index.expr import evaluate, walk
from vtc.virtual.movement import Src, _parse_derived, derive_index_tensors, pull, push

from .cases import A, T, case
from .harness import check_pull, pull_of, realize

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


# second audit (docs/testing.md): repeating, rolling, diagonal, gather and the scatter pulls
SCATTER_CASES = [  # each leaves some positions unwritten
    case("index_copy-one-update", A.index_copy.default, T(5, 3), 0, torch.tensor([3]), T(1, 3)),
    case("index_copy-two-updates", A.index_copy.default, T(2, 5), 1, torch.tensor([4, 0]), T(2, 2)),
    case("index_put-one-update", A.index_put.default, T(5, 3), [torch.tensor([1])], T(1, 3)),
    case("index_put-kv-cache", A.index_put.default, T(1, 2, 8, 4), [None, None, torch.tensor([5, 6])],
         T(1, 2, 2, 4)),
    case("scatter-one-row", A.scatter.src, T(3, 5), 1, torch.tensor([[2], [0], [4]]), T(3, 2)),
]


@pytest.mark.parametrize("target,args,kwargs", [
    case("repeat-empty", A.repeat.default, T(0, 3), [2, 2]),
    case("tile-empty", A.tile.default, T(2, 0), [3]),
    case("roll-one-element", A.roll.default, T(1, 1), [3]),
    case("roll-empty", A.roll.default, T(0, 3), [2]),
    case("roll-empty-dim", A.roll.default, T(0, 3), [1], [0]),
    case("roll-size-one-dim", A.roll.default, T(3, 1), [2, 1], [0, 1]),
    case("diagonal-4d", A.diagonal.default, T(2, 3, 4, 5), 0, 1, 3),
    case("gather-0d", A.gather.default, torch.tensor(5.0), 0, torch.tensor([0, 0])),
    case("index-non-adjacent-from-dim-1", A.index.Tensor, T(2, 3, 4, 5),
         [None, torch.tensor([2, 0]), None, torch.tensor([4, 1])]),
    *SCATTER_CASES,
])
def test_pull_more(target, args, kwargs):
    check_pull(target, args, kwargs)


@pytest.mark.parametrize("target,args,kwargs", SCATTER_CASES)
def test_a_scatter_reads_its_inverse_index_through_exact_ranges(target, args, kwargs):
    """The inverse of a scatter's index holds -1 (not written) or the update's position in [0, n-1]; each load
    of it claims exactly the values it takes where it is read (a one-update position is the constant 0)."""
    (m,), _, env = pull_of(target, args, kwargs)
    tensors = {**env, **derive_index_tensors(m, env)}
    derived = [n for n in m.index_tensors if _parse_derived(n) is not None]
    assert derived, str(m)
    n = len(m.shape)
    grid = {f"i{k}": torch.arange(s).reshape([s if j == k else 1 for j in range(n)]) for k, s in enumerate(m.shape)}
    idx_t = {k: tensors[k] for k in m.index_tensors}
    taken = torch.zeros(m.shape, dtype=torch.bool)
    seen = 0
    for p in m.pieces:
        reached = ~taken  # where p.when is evaluated
        applies = torch.broadcast_to(evaluate(p.when, grid, idx_t).bool(), m.shape) & reached
        taken = taken | applies
        for where, exprs in ((reached, [p.when]), (applies, list(p.index))):
            for x in {id(x): x for e in exprs for x in walk(e) if x.op == "load" and x.args[0] in derived}.values():
                v = torch.broadcast_to(evaluate(x, grid, idx_t), m.shape)[where]
                assert (int(v.min()), int(v.max())) == (x.lo, x.hi), f"{m}: {x} claims [{x.lo}, {x.hi}]"
                seen += 1
    assert seen, str(m)


def test_gather_from_a_0d_tensor_accepts_only_index_0():
    (m,), _, env = pull_of(A.gather.default, (torch.tensor(5.0), 0, torch.tensor([0, 0])))
    with pytest.raises(IndexError, match=r"gather: index 1 is out of range \[0, 0\]"):
        realize(m, {**env, "t1": torch.tensor([0, 1])})


@pytest.mark.parametrize("indices", [[None], [None, None]])
def test_index_put_without_index_tensors_writes_the_values_everywhere(indices):
    """index_put with only Nones for indices: torch's CPU kernel fails an internal assert on it, but its meta
    kernel (the fake tensors torch.export traces with) accepts it, so a captured graph can hold the call and its
    pull runs: every element is the values broadcast to self (movement.py:702, the "no index tensors" branch
    forced off raised instead; part 2 had counted that branch unreachable)."""
    x, v = torch.randn(3, 4), torch.randn(4)
    with pytest.raises(RuntimeError, match="INTERNAL ASSERT"):
        A.index_put.default(x, indices, v)
    assert A.index_put.default(x.to("meta"), indices, v.to("meta")).shape == x.shape
    (m,) = pull(A.index_put.default, (Src("x", (3, 4)), indices, Src("v", (4,))), {}, [(3, 4)])
    torch.testing.assert_close(realize(m, {"x": x, "v": v}), v.expand(3, 4), rtol=0, atol=0)
