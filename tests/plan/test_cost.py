"""The cost model: contiguity classes of mappings, prices, machine figures, swapping the policy."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from vtc.index.mapping import compose
from vtc.plan import cost
from vtc.plan.cost import (BROADCAST, CHUNKED, CONTIGUOUS, FALLBACK, INDIRECT, SCATTERED, VIEW, CostModel, Saving,
                           access, blas_layout, fmt_seconds, index_ops, op_counts)
from vtc.virtual import movement
from vtc.virtual.movement import Src


def pull(op, *args, out, **kw):
    return movement.pull(op, args, kw, [out])[0]


X = Src("x", (8, 16))


def test_contiguous_reshape_is_type_i():
    m = pull(torch.ops.aten.view.default, Src("x", (2, 4, 16)), [8, 16], out=(8, 16))
    a = access(m, 4)
    assert (a.kind, a.chunk_bytes, a.stride) == (CONTIGUOUS, 8 * 16 * 4, 1) and a.type_i
    assert index_ops(m) == 0  # (i0 // 4, i0 % 4) linearises back to i0
    assert a.describe() == "Type I (contiguous)"


def test_transpose_is_a_view_with_large_stride():
    a = access(pull(torch.ops.aten.permute.default, X, [1, 0], out=(16, 8)), 4)
    assert (a.kind, a.stride, a.lines_per_element) == (VIEW, 16, 1.0) and a.type_i
    assert a.describe() == "Type I (strided view, inner stride 16)"


def test_expand_is_a_broadcast():
    a = access(pull(torch.ops.aten.expand.default, Src("x", (8, 1)), [8, 16], out=(8, 16)), 4)
    assert a.kind == BROADCAST and a.stride == 0


def test_cat_chunks():
    cat = torch.ops.aten.cat.default
    rows = access(pull(cat, [Src("a", (8, 32)), Src("b", (8, 32))], 1, out=(8, 64)), 4)
    assert rows.kind == CHUNKED and rows.chunk_bytes == 128 and rows.index_ops == 1
    short = access(pull(cat, [Src("a", (8, 3)), Src("b", (8, 5))], 1, out=(8, 8)), 4)
    assert short.kind == SCATTERED and short.chunk_bytes < 64


def test_gather_of_rows_is_indirect_with_contiguous_rows():
    m = pull(torch.ops.aten.embedding.default, Src("w", (100, 64)), Src("ids", (2, 8), torch.int64), out=(2, 8, 64))
    a = access(m, 4)
    assert a.kind == INDIRECT and a.chunk_bytes >= 64 * 4 and a.lines_per_element <= 4 / 64 * 1.01


def test_reshape_of_transpose_is_not_strided_and_counts_div_mod():
    t = pull(torch.ops.aten.permute.default, Src("x", (4, 6)), [1, 0], out=(6, 4))
    r = pull(torch.ops.aten.view.default, Src("t", (6, 4)), [24], out=(24,))
    m = compose(r, {"t": t})
    a = access(m, 4)
    assert m.strided() is None and a.kind == SCATTERED and a.index_ops == 2  # i0 // 4 and i0 % 4


def test_index_ops_that_only_an_outer_index_decides_count_once_per_run():
    """A channel shuffle read through its cat: the piece test and the div / mod of the channel depend on the
    channel only, so the kernel computes them once per row of 28 (GCC hoists them and unswitches the inner
    loop); a cat along the last dim picks its source per element."""
    cat = pull(torch.ops.aten.cat.default, [Src("a", (1, 6, 4, 28)), Src("b", (1, 6, 4, 28))], 1, out=(1, 12, 4, 28))
    shuffled = pull(torch.ops.aten.view.default, Src("c", (1, 6, 2, 4, 28)), [1, 12, 4, 28], out=(1, 12, 4, 28))
    t = pull(torch.ops.aten.permute.default, Src("v", (1, 2, 6, 4, 28)), [0, 2, 1, 3, 4], out=(1, 6, 2, 4, 28))
    v = pull(torch.ops.aten.view.default, Src("cat", (1, 12, 4, 28)), [1, 2, 6, 4, 28], out=(1, 2, 6, 4, 28))
    m = compose(shuffled, {"c": compose(t, {"v": compose(v, {"cat": cat})})})
    assert op_counts(m) == (0, 3)  # i1 % 2, i1 // 2, the choice between a and b
    a = access(m, 4)
    assert (a.index_ops, a.run_ops, a.run) == (3, 3, 28) and a.loop_ops == 3 / 28
    fixed = CostModel(FALLBACK)
    assert fixed.compute(1344, a) == pytest.approx(fixed.compute(1344, replace(a, index_ops=3, run_ops=0)) / 28)
    rows = pull(torch.ops.aten.cat.default, [Src("a", (8, 32)), Src("b", (8, 32))], 1, out=(8, 64))
    assert op_counts(rows) == (1, 0)


def test_blas_layouts():
    from vtc.index.mapping import Strided

    assert blas_layout(Strided("w", 0, (1, 64)), (64, 32))  # a transposed weight: column-major
    assert blas_layout(Strided("w", 0, (64, 1)), (32, 64))
    assert not blas_layout(Strided("b", 0, (1, 2, 128)), (2, 64, 16))  # neither of the last two strides is 1


def test_saving_and_time_format():
    assert str(Saving(-2e-4, "why")) == "-0.20 ms: why"
    assert fmt_seconds(3.5e-6) == "+3.50 µs"


def test_prices_follow_the_access():
    model = CostModel(FALLBACK)
    n = 1 << 20
    dense = access(pull(torch.ops.aten.view.default, Src("x", (1024, 1024)), [n], out=(n,)), 4)
    trans = access(pull(torch.ops.aten.permute.default, Src("x", (1024, 1024)), [1, 0], out=(1024, 1024)), 4)
    assert model.read(n, 4, dense) == pytest.approx(n * 4 / 10e9)
    # a line per element along a row, but 16 rows share those 1024 lines (64 KB): read once from memory,
    # plus a scalar load per element
    assert (trans.lines_per_element, trans.window_lines, trans.window_bytes) == (1.0, 1 / 16, 64 * 1024)
    assert model.traffic(n, 4, trans) == n * 4
    assert model.read(n, 4, trans) == pytest.approx(n * 4 / 10e9 + n * model.scalar_load_ns * 1e-9)
    small = CostModel(replace(FALLBACK, cache_bytes=32 * 1024))  # the 16 rows' lines do not fit: a line each
    assert small.read(n, 4, trans) > 10 * small.read(n, 4, dense)
    assert model.copy(n, 4, dense) == pytest.approx(1e-6 + 2 * n * 4 / 10e9)


def test_machine_fallback_and_cache(tmp_path, monkeypatch):
    """VTC_NO_MEASURE=1 gives the fixed figures; a measurement is cached in the vtc cache dir and reused.  The
    GEMMs the measurement compiles are built in one parallel build (cbuild.build_many; one each before)."""
    from vtc.runtime import cbuild

    assert cost.machine() == FALLBACK
    monkeypatch.setenv("VTC_NO_MEASURE", "0")
    monkeypatch.setenv("VTC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cost, "MEASURE_BYTES", 1 << 20)
    builds = []
    build_many = cbuild.build_many
    monkeypatch.setattr(cbuild, "build_many",
                        lambda sources, **kw: builds.append(len(sources)) or build_many(sources, **kw))
    cost.machine.cache_clear()
    try:
        m = cost.machine()
        assert m.measured and m.bandwidth_gbs > 0 and m.cache_line == 64 and m.vector_bytes in (16, 32, 64)
        assert m.gemm_gflops > 0 and m.library_gemm_ratio > 0 and len(builds) == 1 and builds[0] >= 2
        files = list((tmp_path / "cache").rglob("machine.json"))
        assert len(files) == 1 and json.loads(files[0].read_text())["machine"]["bandwidth_gbs"] == m.bandwidth_gbs
        monkeypatch.setattr(cost, "_measure_bandwidth", lambda: pytest.fail("measured twice"))
        monkeypatch.setattr(cost, "_measure_gemm", lambda: pytest.fail("measured twice"))
        cost.machine.cache_clear()
        assert cost.machine() == m
    finally:
        cost.machine.cache_clear()


def test_compute_prices_gemms_by_flops_and_the_rest_by_bytes():
    """The plan-independent part of the latency: x @ w.t() is 2 * 8 * 32 * 64 flops at the GEMM rate, plus a
    call; the budget of objective="memory" is relative to compute plus movement."""
    from vtc.plan.cost import Estimator
    from vtc.plan.vtog import VTOG

    from .graphs import capture, mm_transposed_weight

    g, _ = capture(mm_transposed_weight, torch.randn(8, 64), torch.randn(32, 64))
    est = Estimator(VTOG(g), CostModel(FALLBACK))
    assert est.compute() == pytest.approx(1e-6 + 2 * 8 * 32 * 64 / (FALLBACK.gemm_gflops * 1e9))
    state = frozenset(est.vtog.pulls)
    assert est.latency(state) == pytest.approx(est.compute() + est.total(state))


def test_a_framework_buffer_above_the_mmap_threshold_pays_its_page_faults():
    """torch allocates a kept op's output afresh on every call; from glibc's largest mmap threshold (32 MiB) on,
    every allocation is new pages, one fault per 4 KiB written (a 32 MiB V cache: +35 ms per call measured at
    load 4, 1 ms per MiB); generated kernels write into recycled storage and pay nothing."""
    m = CostModel(FALLBACK)
    assert m.fresh((32 << 20) - 1) == 0.0
    assert m.fresh(32 << 20) == pytest.approx(8192 * m.page_fault_us * 1e-6)


def test_a_kept_op_is_priced_as_the_lowering_runs_it():
    """A kept index_put with physical inputs is a generated copy kernel through its pull mapping, which derives
    the inverse of the positions on every call; with a virtual input torch runs it, computing every element's
    offset in a scalar loop.  Before, both were one framework copy that paid neither."""
    from vtc.plan.cost import Estimator
    from vtc.plan.vtog import VTOG

    from .graphs import capture, kv_cache_update, kv_inputs, node

    g, _ = capture(kv_cache_update, *kv_inputs())
    model = CostModel(FALLBACK)
    est = Estimator(VTOG(g), model)
    put = node(g, "index_put")
    source = next(v for v in put.inputs if v.name.startswith("view"))
    (generated,) = est.op_terms(put.name, frozenset())
    (torch_run,) = est.op_terms(put.name, frozenset({est.producer[source.name].name}))
    assert "(a copy kernel," in generated.note and "(torch," in torch_run.note
    plain = model.copy(put.outputs[0].numel, 4, cost.DENSE)
    assert generated.seconds > plain + model.derive_us * 1e-6 - 1e-12
    assert torch_run.seconds > plain


def test_reading_through_a_small_scatter_costs_more_than_torch_running_it():
    """The measured ordering on a 16-entry KV cache: torch's index_put into a buffer (305 µs a call, CPU time,
    1 thread) beats kernels that read through the update, each deriving its inverse first (341 µs)."""
    import vtc

    from .graphs import D, H, S, kv_cache_update, node

    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(S, 32, generator=g), torch.randn(32, 3 * H * D, generator=g),
              torch.randn(16, H, D, generator=g), torch.randn(16, H, D, generator=g), torch.tensor([3, 4, 5, 6]))
    c = vtc.compile(kv_cache_update, inputs, plan="greedy")
    torch.testing.assert_close(c(*inputs), kv_cache_update(*inputs), rtol=1e-4, atol=1e-4)
    plan = c._first.plan
    put = node(c.graph, "index_put")
    assert put.name in plan.kept and "through its mapping" in plan.kept[put.name], plan.kept


def test_structure_names_tensors_by_position():
    cat = torch.ops.aten.cat.default
    ab = pull(cat, [Src("a", (8, 32)), Src("b", (8, 32))], 1, out=(8, 64))
    cd = pull(cat, [Src("c", (8, 32)), Src("d", (8, 32))], 1, out=(8, 64))
    ba = pull(cat, [Src("b", (8, 32)), Src("a", (8, 32))], 1, out=(8, 64))
    assert cost.structure(ab) == cost.structure(cd) == cost.structure(ba)
    other = pull(cat, [Src("a", (8, 16)), Src("b", (8, 48))], 1, out=(8, 64))  # other split: other pattern
    assert cost.structure(other) != cost.structure(ab)
    assert cost.structure(pull(torch.ops.aten.permute.default, Src("i0", (4, 6)), [1, 0], out=(6, 4))) is None


def test_the_estimator_prices_a_layer_like_its_twin_as_access_does():
    """Each access the planner asks for on a 2-layer Llama (the second layer's walks come from the first's by
    structure) equals access() computed from scratch, strided view and its source included."""
    import transformers as tf

    from vtc.frontend.torch_export import export_graph
    from vtc.plan.cost import Estimator
    from vtc.plan.greedy import select
    from vtc.plan.vtog import PULL, VTOG, node_kinds

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    graph = export_graph(tf.LlamaForCausalLM(cfg).eval(), (torch.randint(1, 64, (1, 9)),))
    vtog = VTOG(graph, node_kinds(graph, "cpu", "auto"))
    est = Estimator(vtog)
    asked = []
    real = est.access
    est.access = lambda m, value: asked.append((m, value)) or real(m, value)
    select(vtog, est, (PULL,))
    assert len(est._acc_by_structure) < len(est._acc)  # twins were found
    distinct = {(m.shape, m.pieces, tuple(m.sources.items()), cost._size(est.values[v])): (m, v) for m, v in asked}
    for m, value in distinct.values():
        assert est.access(m, value) == access(m, cost._size(est.values[value]), est.model.machine.cache_line)



def test_a_kept_scatter_run_by_torch_is_priced_with_the_clone_of_its_base():
    """torch's out-of-place index_put clones the base, then writes the updates: two passes over the output.
    Priced as one, a prefill's V-cache update run by torch (0.4-0.5 ms at 512 KB, 1 thread) looked cheaper
    than its push (a copy kernel for the base and one for the update: 0.2 ms), which plan="all" takes."""
    from vtc.plan.cost import Estimator
    from vtc.plan.vtog import VTOG

    from .graphs import capture, kv_cache_update, kv_inputs, node

    g, _ = capture(kv_cache_update, *kv_inputs())
    model = CostModel(FALLBACK)
    est = Estimator(VTOG(g), model)
    put = node(g, "index_put")
    source = next(v for v in put.inputs if v.name.startswith("view"))
    (torch_run,) = est.op_terms(put.name, frozenset({est.producer[source.name].name}))  # torch runs it
    out = put.outputs[0]
    assert "(torch, the base cloned first," in torch_run.note
    clone = model.copy(out.numel, 4, cost.DENSE, generated=False)
    assert torch_run.seconds >= clone + model.copy(out.numel, 4, cost.DENSE) - model.call_us * 1e-6 - 1e-12


def test_a_scale_of_gqa_keys_on_their_way_to_a_gemm_is_walked_as_the_gemm_walks_them():
    """SDPA's decomposition scales K^T (repeat_kv's expanded clone, transposed) before its bmm.  The code
    generator recomputes that scale where the attention kernel packs K (``attention.is_cheap``), so the keys are
    read row by row, not down their columns: the estimate must not price it as a scattered walk (it kept the
    clone, a copy of every layer's keys per decode step, for an HF Llama with a 2048-token StaticCache)."""
    from vtc.plan.cost import Estimator
    from vtc.plan.virtualize import plan_all
    from vtc.plan.vtog import VTOG, node_kinds
    from .graphs import capture, node

    def sdpa_keys(q, k):  # [1, 8, 1, 32] queries, [1, 2, 256, 32] keys: GQA 4, scale on both sides
        kk = k[:, :, None].expand(1, 2, 4, 256, 32).reshape(1, 8, 256, 32)
        return torch.softmax((q * 0.42) @ (kk.transpose(-1, -2) * 0.42), dim=-1)

    def keys_summed(q, k):  # the same scale, read by a reduction: no GEMM packs it
        kk = k[:, :, None].expand(1, 2, 4, 256, 32).reshape(1, 8, 256, 32)
        return (kk.transpose(-1, -2) * 0.42).sum(-1) + q.sum()

    q, k = torch.randn(1, 8, 1, 32), torch.randn(1, 2, 256, 32)
    walks = {}
    for fn in (sdpa_keys, keys_summed):
        graph, _ = capture(fn, q, k)
        est = Estimator(VTOG(graph, node_kinds(graph, "cpu", "auto")))
        scale = next(n for n in graph.nodes if n.op == "aten.mul.Tensor" and n.inputs[0].shape == (1, 8, 32, 256))
        read = scale.inputs[0].name
        m = plan_all(graph).mappings[read]
        walks[fn.__name__] = (est._scales_a_matmul_operand(scale), est.kernel_access(m, read, scale).kind,
                              est.access(m, read).kind)
    assert walks["sdpa_keys"][0] and not walks["keys_summed"][0]
    assert walks["sdpa_keys"][1] != walks["sdpa_keys"][2] == walks["keys_summed"][1]  # reordered only for the GEMM


def test_a_gemm_operand_torch_would_copy_is_priced_as_the_generated_gemm_packing_it():
    """bmm(a, pad(v^T)): B is no strided view.  Kept, the pad is one copy kernel (through v^T's mapping) and torch's
    bmm reads it; virtual, torch's bmm needs the same copy, so the estimate was a +0.00 tie, left physical, where
    the lowering's gemm="auto" would have run the generated GEMM packing B through its mapping, no copy at all
    (EfficientViT's LiteMLA lost its packed-dot k^T v so: tests/codegen/test_gemm_dot.py).  With the GEMM a
    library node (as ``node_kinds`` may leave it, asked with every movement op virtual) the pad pays under
    gemm="auto", and stays the tie where the GEMM is torch's whatever the plan (gemm="torch")."""
    import torch.nn.functional as F

    from vtc.plan.cost import Estimator
    from vtc.plan.vtog import PULL, VTOG, node_kinds

    from .graphs import capture

    def fn(a, v):
        return torch.bmm(a, F.pad(v.transpose(1, 2), (0, 1), value=1.0))

    g, _ = capture(fn, torch.randn(4, 16, 64), torch.randn(4, 9, 64))
    kinds = {**node_kinds(g, "cpu", "auto"), "bmm": "library"}
    saved = {}
    for gemm in ("auto", "torch"):
        vtog = VTOG(g, kinds, "cpu", gemm)
        est = Estimator(vtog, CostModel(FALLBACK))
        pad = next(c for c in vtog.choices if c.op == "constant_pad_nd" and c.direction == PULL)
        saved[gemm] = est.saving(pad, frozenset({"permute"}))
    assert saved["auto"].seconds > 1e-6 and "packed through by the generated GEMM (bmm)" in saved["auto"].reason
    assert abs(saved["torch"].seconds) < 1e-12, saved


def test_a_kept_op_indexed_by_a_virtual_index_tensor_is_priced_as_torch():
    """``Lowering.move_kernels`` hands torch a kept movement op whose index tensor is virtual (its range check
    would name a tensor no step fills): ``Estimator.generated_move`` says so too."""
    from vtc.plan.cost import Estimator
    from vtc.plan.vtog import VTOG

    from .graphs import capture

    def fn(x, idx):
        return x.index_select(0, idx.view(-1)) * 2

    g, _ = capture(fn, torch.randn(10, 4), torch.randint(0, 10, (2, 3)))
    est = Estimator(VTOG(g), CostModel(FALLBACK))
    assert est.generated_move("index_select", frozenset())
    assert not est.generated_move("index_select", frozenset({"view"}))
    (run,) = est.op_terms("index_select", frozenset({"view"}))
    assert "(torch" in run.note
