"""The greedy planner on graphs with a known best strategy; every decision logged with a reason."""
from __future__ import annotations

import torch

import vtc
from vtc.plan.cost import DENSE, CostModel, Estimator
from vtc.plan.greedy import NOT_LOWERED, plan_greedy, select
from vtc.plan.vtog import PULL, PUSH, VTOG

from .graphs import (bmm_strided_operand, capture, cat_read_by_kernel, channel_shuffle, kv_cache_update, kv_inputs,
                     mm_transposed_weight, node, reshape_read_by_kernel, two_cats, v_cache_inputs, v_cache_update)

TOL = dict(rtol=1e-4, atol=1e-4)


def compiled(fn, inputs, **options):
    c = vtc.compile(fn, inputs, plan="greedy", **options)
    torch.testing.assert_close(c(*inputs), fn(*inputs), **TOL)
    return c, c._first.plan


def decision(plan, op, direction=PULL):
    return next(d for d in plan.decisions if d.op == op and d.direction == direction)


def test_every_choice_gets_one_decision():
    g, _ = capture(kv_cache_update, *kv_inputs())
    v = VTOG(g)
    plan = plan_greedy(g)
    assert sorted((d.op, d.direction) for d in plan.decisions) == sorted((c.op, c.direction) for c in v.choices)
    rounds = [d.round for d in plan.decisions if d.chosen]
    assert rounds == sorted(rounds) and all(d.saving.seconds > 0 for d in plan.decisions if d.chosen)


def test_type_i_reshape_is_always_taken():
    c, plan = compiled(reshape_read_by_kernel, (torch.randn(2, 4, 32),))
    view = node(c.graph, "view")
    d = decision(plan, view.name)
    assert d.chosen and d.reason.startswith("Type I (contiguous); removes view's copy of 1.0 KB")
    assert not plan.kept and c.report.eliminated_movement_ops == c.report.movement_ops


def test_transposed_weight_is_a_zero_copy_gemm_operand():
    """The lowering realises w.t() as a zero-copy column-major view that the GEMM takes: taken, not kept."""
    c, plan = compiled(mm_transposed_weight, (torch.randn(8, 64), torch.randn(32, 64)))
    p = node(c.graph, "permute")
    d = decision(plan, p.name)
    assert d.chosen and "Type I (strided view, inner stride 64)" in d.reason and "zero-copy view for mm" in d.reason
    assert [e.fate for e in c.report.movement] == ["view"]


def test_strided_gemm_operand_is_kept_physical():
    """b.permute(2, 1, 0) reads stride 128 inside a bmm operand: no BLAS layout, the library would copy it: kept."""
    c, plan = compiled(bmm_strided_operand, (torch.randn(2, 8, 64), torch.randn(16, 64, 2)))
    p = node(c.graph, "permute")
    assert plan.kept[p.name] == ("kept physical: composed mapping reads stride 128 inside a GEMM operand "
                                 "(aten.bmm.default): the library copies it anyway; estimated -4.10 µs")
    assert [e.fate for e in c.report.movement] == ["kept"]


def test_cat_read_by_a_kernel_is_virtual_over_both_inputs():
    c, plan = compiled(cat_read_by_kernel, (torch.randn(4, 3), torch.randn(4, 5)))
    cat = node(c.graph, "cat")
    m = plan.mappings[cat.outputs[0].name]
    assert m.used_sources() == ["a", "d"] and len(m.pieces) == 2
    assert decision(plan, cat.name).chosen and [e.fate for e in c.report.movement] == ["virtual"]


def test_conflict_resolved_by_the_larger_saving():
    """With pushes allowed, relu is written into the row-wise cat (contiguous), not into the column-wise one
    (16-byte runs, a cache line each).  Each push leaves the other input copied into place: as many elements
    both ways (with a z of one column, the column-wise push copies a quarter as much, and wins since the
    row-wise cat's piece test is priced once per row, ``cost.op_counts``)."""
    g, _ = capture(two_cats, torch.randn(64, 4), torch.randn(64, 4), torch.randn(64, 4))
    v = VTOG(g)
    est = Estimator(v)
    s = select(v, est, (PULL, PUSH))
    cat, cat_1 = node(g, "cat"), node(g, "cat", 1)
    taken = [(c.op, c.direction) for c in s.chosen]
    assert (cat.name, PUSH) in taken and (cat_1.name, PUSH) not in taken
    assert v.is_strategy(s.chosen)
    lost = s.decision(cat_1.name, PUSH)
    assert not lost.chosen and lost.reason.startswith(f"conflicts with push {cat.name}: %relu cannot be virtual")
    assert est.saving(v.choice(cat.name, PUSH), frozenset()).seconds > lost.saving.seconds > 0
    # plan_greedy selects pulls only: the push is priced and logged, not taken
    plan = plan_greedy(g)
    assert NOT_LOWERED in decision(plan, cat.name, PUSH).reason


def test_kv_cache_example_removes_every_movement_op():
    """split -> reshape -> KV-cache update -> attention: every movement op is read through by the kernels."""
    inputs = kv_inputs()
    c, plan = compiled(kv_cache_update, inputs)
    fates = {e.op.split(".")[1]: set() for e in c.report.movement}
    for e in c.report.movement:
        fates[e.op.split(".")[1]].add(e.fate)
    assert fates == {"split_with_sizes": {"virtual"}, "view": {"virtual"}, "index_put": {"virtual"},
                     "unsqueeze": {"virtual"}}
    assert not plan.kept and c.report.materialized_movement_bytes == 0
    put = node(c.graph, "index_put")
    assert sorted(plan.mappings[put.outputs[0].name].used_sources()) == ["k_cache", "mm"]  # written from the GEMM
    assert all(decision(plan, n.name).chosen for n in c.graph.nodes if n.kind == "movement")


def test_chain_that_pays_only_as_a_whole():
    """cat + channel shuffle in front of a conv through torch (gemm="torch"; the generated implicit GEMM
    would read through both): one copy for the conv in all.  Once each op alone cost a realisation, and only the
    whole chain paid; since a kept movement op's copy kernel reads its virtual inputs through their mappings
    (``Lowering.move_kernels``, session 17) the clone may stay that one copy, reading through the rest."""
    inputs = (torch.randn(1, 4, 6, 6), torch.randn(4, 4, 1, 1), torch.randn(4, 4, 1, 1))
    c, plan = compiled(channel_shuffle, inputs, gemm="torch")
    assert set(plan.kept) <= {node(c.graph, "clone").name}
    assert not [s for s in c._first.executor.steps if s.kind == "run" and s.node.kind == "movement"]
    assert c.report.materialized_movement_bytes == c.graph.nodes[-1].inputs[0].nbytes  # one copy for the conv


def test_cost_model_is_swappable():
    """A model under which every copy is free keeps everything physical; correctness does not depend on it."""

    class NoGain(CostModel):
        def copy(self, numel, itemsize, acc, generated=True):
            return 0.0

        def read(self, numel, itemsize, acc, reads=1):
            return 0.0 if acc is DENSE else 1e-3

    g, inputs = capture(cat_read_by_kernel, torch.randn(4, 3), torch.randn(4, 5))
    plan = plan_greedy(g, model=NoGain())
    assert set(plan.kept) == {node(g, "cat").name} and not any(d.chosen for d in plan.decisions)


def test_a_kept_view_reads_a_realised_row_major_copy():
    """Mechanism under any strategy: a kept aten.view whose input is virtual and not row-major (clone over
    a transpose) gets that input as a gather, never as a strided view (torch's view would reject it)."""
    from vtc.plan.virtualize import plan_keeping
    from vtc.runtime.executor import Executor

    def f(x):
        return x.t().contiguous().view(-1) * 1.0

    x = torch.randn(4, 6)
    g, _ = capture(f, x)
    view = node(g, "view")
    plan = plan_keeping(g, "test", {view.name: "kept by the test"})
    r = plan.realized[view.inputs[0].name]
    assert r.kind == "gather"
    for backend in ("torch", "cpu"):
        got = Executor(g, plan, backend=backend)([x])[0]
        torch.testing.assert_close(got, f(x))


def test_a_cache_update_that_no_kernel_computes_is_pushed_as_under_plan_all():
    """The V-cache update of a decode layer: the new values come from a GEMM through a view and a transpose,
    the updated cache is returned and read by attention.  Its pull form needs a copy kernel through a
    per-element choice for the output, so the greedy kept it physical: torch's index_copy into a fresh
    buffer each call (gemma2_local_decode_b16: 28.4 ms vs 19.3 under plan="all").  Now it is pushed as under
    plan="all": the cache copied once by a plain copy, the new values stored at their positions."""
    inputs = v_cache_inputs()
    c, plan = compiled(v_cache_update, inputs)
    op = next(n.name for n in c.graph.nodes if n.op.split(".")[1] in ("index_copy", "index_put"))
    assert op in c.replan(plan="all")._first.plan.pushed
    assert op in plan.pushed and plan.kept == {}, plan.kept
    d = decision(plan, op, PUSH)
    assert d.chosen and d.saving.seconds > 0 and "written in place" in d.reason


def test_pulls_are_priced_again_once_the_pushes_are_taken():
    """Pulls come first: while the V-cache update was still kept, the transpose in front of it was priced as
    an operand of torch's index_put (a view read element by element) and kept physical.  Once the update is
    pushed its writer reads the transpose through its mapping, and the greedy takes that pull too."""
    c, plan = compiled(v_cache_update, v_cache_inputs())
    t = node(c.graph, "permute") if any(n.op.endswith("permute.default") for n in c.graph.nodes) else \
        node(c.graph, "transpose")
    d = decision(plan, t.name)
    assert d.chosen and t.name not in plan.kept, d
    assert d.round == max(x.round or 0 for x in plan.decisions)  # taken last, after the pushes


def _qkv_through_cat(x, w, wd):
    """EfficientViT's q/k/v: a 1x1 conv and a depthwise conv of it concatenated, viewed as heads, transposed
    to tokens-first and sliced; ReLU of q and k."""
    qkv = torch.nn.functional.conv2d(x, w)
    qkv = torch.cat([qkv, torch.nn.functional.conv2d(qkv, wd, padding=1, groups=qkv.shape[1])], dim=1)
    t = qkv.reshape(1, -1, 12, 28 * 28).transpose(-1, -2)
    return torch.relu(t[..., :4]), torch.relu(t[..., 4:8])


def test_a_cat_read_through_a_transpose_element_by_element_stays_physical():
    """Virtual, the cat in front of the transposed q/k reads is a choice per element at a non-unit inner
    stride (gathered from 150 KB, more than L1: CostModel.picked_gather_ns): greedy makes it physical (its
    producers store into it),
    so the ReLUs read a strided view; plan="all" reads through the cat."""
    g = torch.Generator().manual_seed(3)
    x, w, wd = (torch.randn(s, generator=g) for s in ((1, 16, 28, 28), (24, 16, 1, 1), (24, 1, 3, 3)))
    c, plan = compiled(_qkv_through_cat, (x, w, wd))
    cat = node(c.graph, "cat").name
    assert cat in plan.pushed or cat in plan.kept, plan.decisions
    assert "a copy kernel realises it" in decision(plan, cat).reason or "replaced by push" in decision(plan, cat).reason
    picks = [k.name for k in (s.kernel.step.kernel for s in c._first.executor.steps if s.kind == "kernel")
             if k.kind == "pointwise" and "relu" in k.name and any(x.op == "pick" for x in _scalars(k))]
    assert picks == []
    c_all = vtc.compile(_qkv_through_cat, (x, w, wd), plan="all")
    assert cat not in c_all._first.plan.kept and cat not in c_all._first.plan.pushed


def _scalars(k):
    from vtc.codegen.kernel_ir import scalars_under

    return scalars_under([st.value for st in k.stores])


def test_a_channel_shuffle_is_one_copy_pass():
    """ShuffleNet's unit: split -> branch -> cat -> channel shuffle (view, transpose, clone, view) -> output.
    The output needs the shuffled layout: one copy kernel gathers it from the input's half and the branch's
    last convolution (its batch norm and ReLU computed in that kernel), whether it runs as the kept clone
    (reading through the cat, ``Lowering.move_kernels``) or as the output's realisation.  Pushing the cat is
    priced against its pull (``Estimator._against_pull``): it would only add a copy of the input's half into
    the cat (the clone stays the output's copy), so it is not taken.  Failed before: the push was priced
    against a kept cat, taken, and the unit ran two copies (``k_push_split_with_sizes_0_cat``, ``k_clone``).
    That copy writes the output itself: the view step that would hand the kept clone to the output is priced
    as the executor's step it is (one call); before, it was free, and the unit ran the clone and a view."""
    from vtc.zoo.shufflenet import unit

    model, (x,) = unit(channels=24, hw=8, batch=2)
    with torch.no_grad():
        c, plan = compiled(model, (x,))
    assert not plan.pushed
    kernels = [s.kernel.step.kernel for s in c._first.executor.steps if s.kind == "kernel"]
    copies = [k.name for k in kernels if k.kind in ("move", "copy", "push")]
    assert len(copies) == 1 and len(kernels) == 4, [k.name for k in kernels]
    assert [s.kind for s in c._first.executor.steps] == ["kernel"] * 4
