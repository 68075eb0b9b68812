"""Behaviour of vtc.index.expr from ``not_`` on (negation, select, substitution, traversal, evaluation,
printing, ``affine``) that no other test pinned: found by the second mutation audit (docs/testing.md).
Each test fails with one small change to expr.py that every other test in tests/index lets pass."""
from __future__ import annotations

import pytest
import torch

from vtc.index.expr import (FALSE, TRUE, eq, evaluate, free_vars, load, loads, lt, max_, min_, not_, replace_loads,
                            select, var, walk)


def test_the_negation_of_a_constant_is_a_constant():
    """not_ folds TRUE and FALSE (a masked piece whose predicate is decided must not stay a "not" node)."""
    assert not_(TRUE) is FALSE
    assert not_(FALSE) is TRUE
    x = var("x", 5)
    assert not_(lt(x, 9)) is FALSE


def test_a_select_on_a_constant_is_its_branch():
    x, y = var("x", 5), var("y", 3)
    assert select(TRUE, x, y) is x
    assert select(FALSE, x, y) is y
    assert select(lt(x, 7), x, y) is x


def test_replace_loads_replaces_the_loads_it_is_given_and_keeps_the_others():
    """replace_loads(e, fn): each load(t, idx) becomes fn(t, idx) (idx already rewritten) where fn gives one;
    a load inside another load's index is replaced too (the lowering folds constant index tensors this way)."""
    x = var("x", 6)
    inner = load("t", [x], 0, 3)
    e = load("u", [inner + 1], 0, 9) * 2 + load("t", [5 - x], 0, 3) + x
    t = torch.tensor([3, 0, 2, 1, 1, 3])
    u = torch.arange(10) * 7 % 10
    fn = lambda name, idx: (idx[0] + 1) % 4 if name == "t" else None  # noqa: E731  t[i] replaced by (i+1) % 4
    got = replace_loads(e, fn)
    assert loads(got) == {"u"}
    xs = torch.arange(6)
    t_replaced = (xs + 1) % 4
    want = u[t_replaced[xs] + 1] * 2 + t_replaced[5 - xs] + xs
    assert torch.equal(evaluate(got, {"x": xs}, {"u": u}), want)
    assert torch.equal(evaluate(e, {"x": xs}, {"t": t, "u": u}), u[t[xs] + 1] * 2 + t[5 - xs] + xs)
    assert replace_loads(e, lambda name, idx: None) is e


def test_evaluate_names_a_missing_variable():
    with pytest.raises(KeyError, match="no value for index variable 'y'"):
        evaluate(var("x", 3) + var("y", 2), {"x": torch.arange(3)})


def test_walk_yields_every_sub_expression_once_e_first():
    """A shared sub-expression (x % 3 twice) is yielded once and does not end the walk early; the walk goes
    into every operator's arguments and into a load's index."""
    x, z, w = var("x", 7), var("z", 4), var("w", 3)
    shared = x % 3
    e = select(lt(w, 2), shared, shared + z) + load("t", [x // 2 * z], 0, 5) * max_(x, z)
    nodes = list(walk(e))
    assert nodes[0] is e
    assert len({id(n) for n in nodes}) == len(nodes)
    assert free_vars(e) == {"x", "z", "w"}
    assert {n.op for n in nodes} >= {"sum", "select", "lt", "mod", "load", "floordiv", "mul", "max", "var"}
    assert free_vars(load("t", [x], 0, 5)) == {"x"}
    assert loads(load("u", [load("t", [x], 0, 5)], 0, 9)) == {"t", "u"}
    assert free_vars(min_(x % 5, z // 3)) == {"x", "z"}


def test_evaluate_names_a_missing_index_tensor_and_a_wrong_number_of_indices():
    x = var("x", 3)
    with pytest.raises(KeyError, match="no index tensor 't'"):
        evaluate(load("t", [x], 0, 2), {"x": torch.arange(3)}, {"u": torch.arange(3)})
    with pytest.raises(ValueError, match="load from 't' with 1 indices, tensor has shape"):
        evaluate(load("t", [x], 0, 2), {"x": torch.arange(3)}, {"t": torch.arange(6).reshape(2, 3)})


def test_a_load_clamps_its_index_into_the_tensor():
    """A masked-off piece may index anywhere: evaluation clamps into [0, size - 1] (size 1 included)."""
    x = var("x", 8)
    xs = torch.arange(8)
    t = torch.tensor([5, 7, 9])
    assert evaluate(load("t", [x - 2], 5, 9), {"x": xs}, {"t": t}).tolist() == [5, 5, 5, 7, 9, 9, 9, 9]
    one = torch.tensor([[4]])
    assert evaluate(load("o", [x, x + 1], 0, 9), {"x": xs}, {"o": one}).tolist() == [4] * 8


def test_evaluate_of_an_equality():
    x = var("x", 9)
    e = eq(x % 3, 1)
    assert e.op == "eq"
    assert evaluate(e, {"x": torch.arange(9)}).tolist() == [int(v % 3 == 1) for v in range(9)]
