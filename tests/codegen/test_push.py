"""Store-side virtual tensors (vtc.codegen.push): producers store into a cat's / scatter's output.

Every case is compared with eager on random inputs; each also asserts what push optimises: the op is
"pushed", no copy kernel realises it, the bytes copied are only those no kernel computes (an input given
to the graph), and the kernel count (one per producer, none for the op).
"""
from __future__ import annotations

import pytest
import torch

from tests.codegen.util import (POINTWISE_TOL, ROW_TOL, check, compile_cpu, gen, kernels, rand, report,
                                steps)

BATCHES = (1, 16)


def fates(compiled) -> dict[str, str]:
    return {e["op"].split(".")[1]: e["fate"] for e in report(compiled)["movement"]}


def assert_pushed(compiled, op: str, moved: int = 0) -> None:
    """`op` is removed on the write side, no copy kernel or gather realises anything, `moved` bytes copied."""
    assert fates(compiled)[op] == "pushed", compiled.report
    r = report(compiled)
    assert r["materialized_movement_bytes"] == moved, compiled.report
    assert [k.name for k in kernels(compiled) if k.kind == "copy"] == [] and steps(compiled, "gather") == []


def push_kernels(compiled) -> list:
    return [k for k in kernels(compiled) if k.kind == "push"]


# -- cat / stack --------------------------------------------------------------------------------
@pytest.mark.parametrize("dim,batch,n", [(0, 1, 1), (1, 16, 3), (2, 1, 17), (-1, 16, 127), (1, 1, 127)])
def test_pointwise_producers_into_a_returned_cat(dim, batch, n):
    """Three pointwise producers write their slices of the cat's buffer; the cat costs nothing."""
    def fn(a, b):
        return torch.cat((torch.relu(a), torch.sigmoid(b), a * b), dim=dim)

    g = gen(dim + 7 * batch + n)
    shape = [batch, n, 5]
    compiled = check(fn, (rand(shape, g), rand(shape, g)), **POINTWISE_TOL)
    assert_pushed(compiled, "cat")
    assert len(kernels(compiled)) == 3 and push_kernels(compiled) == []


@pytest.mark.parametrize("batch", BATCHES)
def test_row_and_pointwise_producers_into_a_cat_of_uneven_parts(batch):
    """softmax (a row kernel) and relu of different extents along the cat dim; 17 + 3 + 1 rows."""
    def fn(a, b, c):
        return torch.cat((torch.softmax(a, -1), torch.relu(b), torch.exp(c)), dim=1)

    g = gen(batch)
    inputs = (rand((batch, 17, 127), g), rand((batch, 3, 127), g), rand((batch, 1, 127), g, high=1.0))
    compiled = check(fn, inputs, **ROW_TOL)
    assert_pushed(compiled, "cat")
    assert len(kernels(compiled)) == 3


def test_cat_with_an_input_copied_into_place():
    """An input no kernel computes (a graph input) is copied into its slice: exactly its bytes move."""
    def fn(a, b):
        return torch.cat((torch.tanh(a), b), dim=-1)

    g = gen(3)
    a, b = rand((3, 17, 5), g), rand((3, 17, 127), g)
    compiled = check(fn, (a, b), **POINTWISE_TOL)
    assert_pushed(compiled, "cat", moved=b.numel() * 4)
    assert [k.source_nodes for k in push_kernels(compiled)] == [[n.name for n in compiled.graph.nodes
                                                                 if n.op == "aten.cat.default"]]


def test_producer_read_elsewhere_is_stored_twice():
    """A pushed value that another kernel also reads is stored both into the cat and on its own."""
    def fn(a, b):
        r = torch.relu(a)
        return torch.cat((r, torch.sigmoid(b)), dim=0), torch.softmax(r, -1)

    g = gen(4)
    compiled = check(fn, (rand((17, 3), g), rand((1, 3), g)), **ROW_TOL)
    assert_pushed(compiled, "cat")


def test_gemm_epilogue_into_a_cat():
    """relu(a @ w) is the generated GEMM's epilogue; the GEMM accumulates straight into its columns of the
    cat (row stride 8), so neither a @ w nor relu(a @ w) exists; the sigmoid is stored by its own kernel."""
    def fn(a, w, b):
        return torch.cat((torch.relu(a @ w), torch.sigmoid(b)), dim=1)

    g = gen(9)
    a, w, b = rand((17, 33), g), rand((33, 3), g), rand((17, 5), g)
    compiled = check(fn, (a, w, b), gemm="vtc", rtol=1e-4, atol=1e-4)
    assert_pushed(compiled, "cat")
    assert [k.kind for k in kernels(compiled)] == ["gemm", "pointwise"]
    offset, row_stride = kernels(compiled)[0].gemm.out_layout
    assert offset.value == 0 and row_stride == 8


def test_stack_of_producers():
    """torch.export turns stack into cat + view: the cat is pushed, the view is a zero-copy view of it."""
    def fn(a, b):
        return torch.stack((torch.relu(a), torch.neg(b)), dim=1)

    g = gen(5)
    compiled = check(fn, (rand((16, 3, 17), g), rand((16, 3, 17), g)), **POINTWISE_TOL)
    assert_pushed(compiled, "cat")
    assert len(kernels(compiled)) == 2


# -- scatters ------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", BATCHES)
def test_slice_scatter_into_a_computed_base(batch):
    """Both the base and the update are computed: each kernel stores its part, nothing is copied."""
    def fn(x, u):
        return torch.slice_scatter(x * 2.0, torch.relu(u), dim=1, start=3, end=20)

    g = gen(batch + 1)
    compiled = check(fn, (rand((batch, 127, 3), g), rand((batch, 17, 3), g)), **POINTWISE_TOL)
    assert_pushed(compiled, "slice_scatter")
    assert len(kernels(compiled)) == 2


def test_slice_scatter_with_step_into_an_input_base():
    """A base given to the graph is copied once (out of place), then the update lands over it."""
    def fn(x, u):
        return torch.slice_scatter(x, torch.sigmoid(u), dim=0, start=1, step=3)

    g = gen(6)
    x, u = rand((127, 3), g), rand((42, 3), g)
    compiled = check(fn, (x, u), **POINTWISE_TOL)
    assert_pushed(compiled, "slice_scatter", moved=x.numel() * 4)
    assert len(kernels(compiled)) == 2 and push_kernels(compiled)[0] is kernels(compiled)[0]  # base first


def test_base_computed_after_the_update_keeps_the_order():
    """The base's producer comes after the update's in graph order: both are written at the op, base first."""
    def fn(x, u):
        upd = torch.relu(u)
        return torch.slice_scatter(torch.exp(x) + upd.sum(), upd, dim=0, start=1, end=2)

    g = gen(8)
    compiled = check(fn, (rand((3, 17), g, high=1.0), rand((1, 17), g)), **ROW_TOL)
    assert fates(compiled)["slice_scatter"] == "pushed"
    base, update = push_kernels(compiled)
    assert base.domain == (3, 17) and update.domain == (1, 17)


def kv_update(cache, k, cos, sin, pos, q):
    """RoPE'd keys written into a KV cache at `pos` (StaticCache.update, out of place), then read."""
    half = k.shape[-1] // 2
    rot = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    cache = cache.index_copy(2, pos, k * cos + rot * sin)
    return cache, torch.softmax((cache * q).sum(-1), -1)


def kv_inputs(batch: int, t: int, pos: list[int], g) -> tuple:
    s = len(pos)
    return (rand((batch, 4, t, 16), g), rand((batch, 4, s, 16), g), rand((s, 16), g), rand((s, 16), g),
            torch.tensor(pos), rand((batch, 4, t, 16), g))


@pytest.mark.parametrize("batch,t,pos", [(1, 1, [0]), (16, 17, [16]), (1, 127, [3, 100, 40])])
def test_kv_cache_index_copy(batch, t, pos):
    """The new keys are stored into the fresh cache output by the RoPE kernel; the input cache is copied
    once (torch's index_copy does not change its input); the reader reads the updated cache plainly."""
    inputs = kv_inputs(batch, t, pos, gen(batch + t))
    compiled = check(kv_update, inputs, **ROW_TOL)
    op = next(o for o in fates(compiled) if o in ("index_copy", "index_put"))
    assert_pushed(compiled, op, moved=inputs[0].numel() * 4)
    (copy,) = push_kernels(compiled)
    assert {b.name for b in copy.inputs} == {compiled.graph.inputs[0].name}  # the cache, nothing else
    writer = next(k for k in kernels(compiled) if k.kind == "pointwise"
                  and any(st.buffer.name == compiled.graph.outputs[0].name for st in k.stores))
    assert writer.domain == tuple(inputs[1].shape)  # computed once per new token, stored into the cache


def test_kv_cache_out_of_range_position_raises():
    g = gen(12)
    inputs = kv_inputs(1, 17, [16], g)
    compiled = compile_cpu(kv_update, inputs)
    bad = list(inputs)
    bad[4] = torch.tensor([17])
    with pytest.raises(IndexError, match=r"index_(copy|put): index 17 is out of range"):
        compiled(*bad)
    torch.testing.assert_close(compiled(*inputs), kv_update(*inputs), **ROW_TOL)  # still fine after


def test_positions_computed_in_the_graph_are_folded():
    """cache positions from arange: the store index is arithmetic, no index tensor is read or checked."""
    def fn(cache, k):
        pos = torch.arange(k.shape[2]) + 5
        return cache.index_copy(2, pos, torch.relu(k))

    g = gen(13)
    compiled = check(fn, (rand((2, 3, 17, 8), g), rand((2, 3, 4, 8), g)), **POINTWISE_TOL)
    writer = next(k for k in kernels(compiled) if k.kind == "pointwise")
    assert {b.name for b in writer.inputs} == {compiled.graph.inputs[1].name, compiled.graph.outputs[0].name}
    assert all(not s.checks for s in steps(compiled, "kernel") for s in [s.kernel.step])


# -- planning ------------------------------------------------------------------------------------
def test_push_false_reads_through_the_pull_mapping():
    def fn(a, b):
        return torch.cat((torch.relu(a), torch.sigmoid(b)), dim=1)

    g = gen(14)
    inputs = (rand((3, 17), g), rand((3, 5), g))
    compiled = check(fn, inputs, push=False, **POINTWISE_TOL)
    assert fates(compiled)["cat"] == "gather" and report(compiled)["materialized_movement_bytes"] > 0


def test_cat_read_by_a_kernel_stays_pulled():
    """cat -> relu: the reader reads through the pull mapping, one kernel, nothing to push."""
    g = gen(15)
    compiled = check(lambda a, b: torch.relu(torch.cat((a, b), dim=1)), (rand((1, 3, 17), g), rand((1, 5, 17), g)),
                     **POINTWISE_TOL)
    assert fates(compiled)["cat"] == "virtual" and len(kernels(compiled)) == 1


def test_greedy_takes_the_push_when_cheaper():
    """softmax rows into a returned cat: the default planner stores them in place (its decision says so)."""
    def fn(a, b):
        return torch.cat((torch.softmax(a, -1), torch.softmax(b, -1)), dim=1)

    g = gen(16)
    compiled = check(fn, (rand((16, 17, 127), g), rand((16, 3, 127), g)), plan="greedy", **ROW_TOL)
    assert_pushed(compiled, "cat")
    plan = compiled._first.plan
    (d,) = [d for d in plan.decisions if d.direction == "push"]
    assert d.chosen and "written in place" in d.reason
