"""plan="none" on the CPU backend: every movement op runs as its own generated copy kernel ("move").

The ablation baseline materialises each movement op, but with the same code generator as the rest,
so that plan="all" versus plan="none" measures the movement, not torch versus generated code.
"""
from __future__ import annotations

import pytest
import torch

import vtc
from vtc import zoo

from .util import ROW_TOL, check, executor, gen, kernels, rand, report, steps


def movement_nodes(compiled) -> list:
    return [n for n in compiled.graph.nodes if n.kind == "movement"]


def assert_movement_in_kernels(compiled) -> None:
    """Each movement node runs as a move kernel, or through torch with a recorded reason."""
    why = executor(compiled).lowering.why_torch
    moved = {s for k in kernels(compiled) if k.kind == "move" for s in k.source_nodes}
    ran = {s.node.name for s in steps(compiled, "run") if s.node.kind == "movement"}
    for n in movement_nodes(compiled):
        assert (n.name in moved) != (n.name in ran), n.name
        if n.name in ran:
            assert why.get(n.name), f"{n.name} ({n.op}) runs through torch without a reason"


def chain(x, idx, y):
    a = x.transpose(0, 1)
    b = torch.cat((a, a[:, :2]), 1)
    c = b.index_select(1, idx)
    d = torch.roll(x, 2, 1)
    return c.sum(-1), d.reshape(-1) * 2, torch.flip(x, (0,)) + y.expand(5, 17, 3), x.permute(2, 0, 1)


def test_every_movement_op_is_a_copy_kernel():
    g = gen(50)
    x, y = rand((5, 17, 3), g), rand((17, 1), g)
    idx = torch.tensor([0, 4, 2, 4])
    compiled = check(chain, (x, idx, y), plan="none", **ROW_TOL)
    assert_movement_in_kernels(compiled)
    assert steps(compiled, "run") == []  # nothing at all through torch
    r = report(compiled)
    assert r["eliminated_movement_ops"] == 0
    moves = [k for k in kernels(compiled) if k.kind == "move"]
    assert len(moves) == len(movement_nodes(compiled))
    assert r["kernels"] == len(kernels(compiled))  # the copy kernels are counted
    assert r["materialized_movement_bytes"] == sum(v.nbytes for n in movement_nodes(compiled) for v in n.outputs)
    compiled_all = compiled.replan(plan="all")
    assert report(compiled_all)["kernels"] < r["kernels"]


def test_out_of_range_index_raises_in_a_copy_kernel():
    g = gen(51)
    x = rand((4, 6), g)
    compiled = vtc.compile(lambda x, i: x.index_select(1, i) + 1, (x, torch.tensor([0, 5])), plan="none")
    assert any(k.kind == "move" for k in kernels(compiled))
    with pytest.raises(IndexError, match="index_select"):
        compiled(x, torch.tensor([0, 6]))


@pytest.mark.parametrize("name", ["llama", "swin", "shufflenet"])
def test_zoo_models_with_plan_none_run_movement_as_kernels(name):
    torch.manual_seed(0)
    model, inputs = zoo.load(name, size="tiny")
    with torch.no_grad():
        want = model(*inputs)
        compiled = vtc.compile(model, inputs, plan="none")
        got = compiled(*inputs)
    want = want.logits if hasattr(want, "logits") else want
    got = got.logits if hasattr(got, "logits") else got
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert_movement_in_kernels(compiled)
    moves = [k for k in kernels(compiled) if k.kind == "move"]
    assert len(moves) >= len(movement_nodes(compiled)) // 2, executor(compiled).lowering.why_torch
