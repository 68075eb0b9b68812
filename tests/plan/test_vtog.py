"""The opportunity graph: edges, pins, conflicts, choices, printing."""
from __future__ import annotations

import torch

from vtc.plan.vtog import PULL, PUSH, VTOG

from .graphs import capture, cat_read_by_kernel, kv_cache_update, kv_inputs, node, two_cats


def test_conflicting_edges_one_tensor_over_two_tensors():
    """relu can be written into cat or into cat_1 (push), not both: the VTOG says so, with the reason."""
    g, _ = capture(two_cats, torch.randn(4, 8), torch.randn(2, 8), torch.randn(4, 3))
    v = VTOG(g)
    relu = node(g, "relu").outputs[0].name
    cat, cat_1 = node(g, "cat"), node(g, "cat", 1)
    pushes = [e for e in v.nodes[relu].edges if e.direction == PUSH]
    assert sorted(e.dst for e in pushes) == sorted([cat.outputs[0].name, cat_1.outputs[0].name])
    a, b = v.choice(cat.name, PUSH), v.choice(cat_1.name, PUSH)
    why = v.conflict(a, b)
    assert why == f"%{relu} cannot be virtual over both %{cat.outputs[0].name} and %{cat_1.outputs[0].name}"
    assert not v.is_strategy([a, b]) and v.is_strategy([a]) and v.is_strategy([b])
    # the push and the pull of one op exclude each other
    assert v.conflict(a, v.choice(cat.name, PULL)) == f"push and pull of {cat.name} exclude each other"
    # pulls of two different ops over the same tensor are compatible
    assert v.is_strategy([v.choice(cat.name, PULL), v.choice(cat_1.name, PULL)])
    text = str(v)
    assert f"%{relu} cannot be virtual over both" in text and "pinned: graph output" in text


def test_compatible_edges_of_a_cat():
    """cat's output is virtual over a for some indices and over d for the others: one choice, no conflict."""
    g, _ = capture(cat_read_by_kernel, torch.randn(4, 3), torch.randn(4, 5))
    v = VTOG(g)
    cat = node(g, "cat")
    out = cat.outputs[0].name
    c = v.choice(cat.name, PULL)
    assert [(e.src, e.dst) for e in c.edges] == [(out, "a"), (out, "d")]
    assert not v.nodes[out].conflicts and v.is_strategy([c])
    assert v.nodes["a"].pinned == "graph input" and not v.nodes["a"].edges  # inputs have no producer to push


def test_pins_and_push_chain_of_the_kv_cache():
    """Index tensors and graph inputs are pinned; split -> reshape -> index_put pushes chain up to the GEMM."""
    g, _ = capture(kv_cache_update, *kv_inputs())
    v = VTOG(g)
    assert v.nodes["pos"].pinned == "graph input"
    put = node(g, "index_put")
    k = put.args[2].name  # the reshaped K
    assert [(e.dst, e.direction) for e in v.nodes[k].edges if e.direction == PUSH] == [(put.outputs[0].name, PUSH)]
    mm = node(g, "mm").outputs[0].name
    split = node(g, "split_with_sizes")
    assert {e.dst for e in v.nodes[mm].edges} == {o.name for o in split.outputs}  # the GEMM could write q, k, v
    assert v.choice(split.name, PUSH).invalid is None  # q, k, v land in disjoint column ranges


def test_overlapping_pushes_conflict():
    """Two scatters of the same data-dependent positions may overlap: their pushes into one target conflict."""

    def f(x, y, base):
        return torch.cat([x.relu(), y.relu()], 0) * 1.0, base.index_put([torch.tensor([0, 1])], x.relu())

    g, _ = capture(f, torch.randn(2, 4), torch.randn(2, 4), torch.randn(5, 4))
    v = VTOG(g)
    cat = node(g, "cat")
    assert v.choice(cat.name, PUSH).invalid is None  # rows [0, 2) and [2, 4): disjoint boxes
    # a push mapping that loads its target index spans the whole declared range: it may overlap anything
    from vtc.plan.vtog import Edge, _may_overlap

    put = v.choice(node(g, "index_put").name, PUSH).edges[0]
    twin = Edge("other", put.dst, put.op, PUSH, put.mapping, put.key)
    assert _may_overlap(put, twin)
