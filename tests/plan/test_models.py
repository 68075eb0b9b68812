"""plan="greedy" on real architectures (tiny): same results as eager, every kept op with a logged reason."""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import vtc
from vtc import zoo

# What the greedy keeps physical (op, ATen packet) with the fixed machine figures when GEMMs run through
# torch (gemm="torch"; with the default the attention and GEMM kernels read these chains, and the census
# test pins that nothing is kept), and why: each is a
# chain in front of a GEMM whose composed mapping is not a strided view; the framework's own copy
# (the kept op) costs the same bytes as a copy kernel without its per-element index arithmetic.
KEPT = {
    # node names as the fast capture (vtc.frontend.fx_capture) makes them: an eval-mode dropout is no clone
    # a chain whose first op reads a physical tensor keeps that op where the rest would be a torch copy of a
    # transposed view (priced with its scalar loop, CostModel.torch_strided_ns): the generated copy kernel runs it
    # since session 17 a kept op's copy kernel reads its virtual inputs through their mappings
    # (Lowering.move_kernels), so the one copy of a chain may be its last op (a clone reading through the
    # permute or expand in front, the channel shuffle's clone) where it was the first or the conv's realisation
    "llama_layer": {("clone_1", "clone"), ("clone_3", "clone"), ("expand_1", "expand")},
    "gpt2": {("clone", "clone"), ("clone_1", "clone"), ("clone_5", "clone")}
    | {(f"clone_{k}", "clone") for k in (2, 3, 4, 6, 7)},  # every repeat/head clone
    "shufflenet": {("clone_1", "clone"), ("clone_3", "clone"), ("clone_5", "clone")},  # one copy per shuffle
}


@pytest.mark.parametrize("name", sorted(KEPT))
def test_greedy_matches_eager(name):
    torch.manual_seed(0)
    model, inputs = zoo.load(name, size="tiny")
    c = vtc.compile(model, inputs, plan="greedy", gemm="torch")  # GEMMs and attention through torch
    with torch.no_grad():
        want, got = model(*inputs), c(*inputs)
    g, gs = pytree.tree_flatten(got)
    w, ws = pytree.tree_flatten(want)
    assert gs == ws
    for a, b in zip(g, w):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    plan = c._first.plan
    kept = {(n.name, n.op.split(".")[1]) for n in c.graph.nodes if n.name in plan.kept}
    assert kept == KEPT[name]
    for op in plan.kept:
        assert plan.kept[op].startswith("kept physical: not a strided view: a copy kernel realises it for ")
        assert "; estimated -" in plan.kept[op]
    r = c.report
    assert r.eliminated_movement_ops == r.movement_ops - len(kept) - sum(e.fate == "gather" for e in r.movement)
