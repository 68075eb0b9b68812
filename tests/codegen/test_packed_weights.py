"""Library GEMMs on constant weights packed once (vtc.runtime.packed) and library GEMM results written into
recycled buffers (vtc.runtime.callplan's out=): the same results as torch eager, and which GEMMs take them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from vtc.runtime import buffers, packed

from .util import compile_cpu, gen, rand

GEMM_TOL = dict(rtol=1e-4, atol=1e-4)
G = gen(170)

needs_mkl = pytest.mark.skipif(not packed.ENABLED, reason="MKL's packed GEMM is not available in this torch")


def _plan(compiled):
    return compiled._first.executor.call_plan()


class _MLP(nn.Module):
    """Two linears (one with a bias, one without) around a GELU: an addmm and an mm on weight transposes."""

    def __init__(self, k: int, hidden: int, n: int):
        super().__init__()
        g = gen(k * 7 + n)
        self.up = nn.Linear(k, hidden)
        self.down = nn.Linear(hidden, n, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(rand(tuple(p.shape), g) * 0.2)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _libraries(compiled) -> dict[str, str]:
    return {g["node"]: g["library"] for g in compiled.report.to_dict()["gemm"]}


@needs_mkl
@pytest.mark.parametrize("batch,rows,k,hidden,n", [(1, 127, 17, 33, 3), (16, 3, 64, 127, 1), (1, 32, 1, 1, 17)])
def test_linear_weights_are_packed_once_and_match_eager(batch, rows, k, hidden, n):
    model = _MLP(k, hidden, n)
    x = rand((batch, rows, k), G)
    compiled = compile_cpu(model, (x,), gemm="torch")
    assert set(_libraries(compiled).values()) == {"mkl_packed"} and len(_libraries(compiled)) == 2
    for _ in range(2):  # the second call runs on the panels packed at the first
        x = rand((batch, rows, k), G)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), **GEMM_TOL)
    plan = _plan(compiled)
    assert plan.counts["packed_weights"] == 2 and not plan.why_not_packed


@needs_mkl
def test_a_weight_changed_in_place_after_compiling_is_packed_again():
    model = _MLP(17, 33, 5)
    x = rand((1, 64, 17), G)
    compiled = compile_cpu(model, (x,), gemm="torch")
    assert set(_libraries(compiled).values()) == {"mkl_packed"}
    with torch.no_grad():
        compiled(x)  # packs the weights
        model.up.weight.mul_(-1.5)  # an in-place change (as load_state_dict / an optimizer step makes)
        model.down.weight.copy_(rand(tuple(model.down.weight.shape), G))
        torch.testing.assert_close(compiled(x), model(x), **GEMM_TOL)


@needs_mkl
def test_a_weight_changed_while_it_is_packed_again_is_packed_once_more(monkeypatch):
    """Another thread's in-place change that lands while a call packs the weight (after the pack has read it):
    the next call packs it again.  _Packed read the version counter after packing, so it took the packed old
    values for the new version and kept them for every later call.  Fails without reading the version first."""
    model = _MLP(17, 33, 5)
    x = rand((1, 64, 17), G)
    compiled = compile_cpu(model, (x,), gemm="torch")
    assert set(_libraries(compiled).values()) == {"mkl_packed"}
    reorder, armed = torch.ops.mkl._mkl_reorder_linear_weight, []

    def reorder_then_change(w, rows):
        out = reorder(w, rows)
        if armed and w.shape == model.up.weight.shape:
            armed.clear()
            model.up.weight.mul_(-2.0)  # the other thread's change, just after this pack read the weight
        return out

    monkeypatch.setattr(torch.ops.mkl, "_mkl_reorder_linear_weight", reorder_then_change)
    with torch.no_grad():
        compiled(x)  # packs the weights
        model.up.weight.mul_(0.5)
        armed.append(True)
        compiled(x)  # packs up's weight again; the change lands meanwhile
        assert not armed
        torch.testing.assert_close(compiled(x), model(x), **GEMM_TOL)


def _packed_copies_of(weight: torch.Tensor) -> list:
    ptr = weight.untyped_storage().data_ptr()
    return [e for e in list(packed._SHARED.values()) if e.w.untyped_storage().data_ptr() == ptr]


@needs_mkl
def test_executors_of_one_model_share_one_packed_copy_per_weight():
    import gc
    model = _MLP(17, 33, 5)
    x = rand((1, 64, 17), G)
    first = compile_cpu(model, (x,), gemm="torch")
    second = first.replan(plan="all")  # another executor of the same weights
    with torch.no_grad():
        for c in (first, second):
            torch.testing.assert_close(c(x), model(x), **GEMM_TOL)
        assert len(_packed_copies_of(model.up.weight)) == 1 and len(_packed_copies_of(model.down.weight)) == 1
        model.up.weight.mul_(0.5)  # both executors follow an in-place change through the one copy
        for c in (first, second):
            torch.testing.assert_close(c(x), model(x), **GEMM_TOL)
    del first, second, c
    gc.collect()
    assert _packed_copies_of(model.up.weight) == []  # no executor left: the packed copy is freed


@needs_mkl
def test_few_rows_and_a_non_constant_b_keep_torch_mm():
    model = _MLP(17, 33, 5)
    x = rand((1, 3, 17), G)  # 3 rows: below MIN_ROWS
    compiled = compile_cpu(model, (x,), gemm="torch")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **GEMM_TOL)
    assert set(_libraries(compiled).values()) == {""} and _plan(compiled).counts["packed_weights"] == 0

    f = lambda a, b: a @ b.t()  # noqa: E731  B is an input: nothing to pack once
    a, b = rand((64, 17), G), rand((33, 17), G)
    compiled = compile_cpu(f, (a, b), gemm="torch")
    torch.testing.assert_close(compiled(a, b), f(a, b), **GEMM_TOL)
    assert set(_libraries(compiled).values()) == {""} and _plan(compiled).counts["packed_weights"] == 0


@needs_mkl
def test_a_weight_used_untransposed_is_left_to_mm():
    """x @ W with W [K, N] contiguous: MKL's packed path takes W^T of a contiguous W [N, K] only."""
    w = rand((17, 33), G)
    f = lambda a: a @ w  # noqa: E731  (w is captured as a constant of the graph)
    a = rand((64, 17), G)
    compiled = compile_cpu(f, (a,), gemm="torch")
    torch.testing.assert_close(compiled(a), f(a), **GEMM_TOL)
    assert set(_libraries(compiled).values()) == {""} and _plan(compiled).counts["packed_weights"] == 0


def test_library_gemm_result_is_written_into_a_recycled_buffer():
    rows = buffers.MIN_BYTES // 4 // 129 + 1  # a 129-column result just above the recycling threshold
    f = lambda a, b: torch.relu(a @ b) + 1.0  # noqa: E731  a library mm (gemm="torch") and a kernel after it
    a, b = rand((rows, 33), G), rand((33, 129), G)
    compiled = compile_cpu(f, (a, b), gemm="torch")
    first = compiled(a, b)
    torch.testing.assert_close(first, f(a, b), **GEMM_TOL)
    pool = compiled._first.executor.pool
    kept = {st.data_ptr() for st in pool._kept}
    assert first.data_ptr() in kept and len(kept) == 2  # the mm's result and the kernel's output
    a2 = rand((rows, 33), G)
    second = compiled(a2, b)  # `first` is held: its storage is not handed out again
    torch.testing.assert_close(second, f(a2, b), **GEMM_TOL)
    torch.testing.assert_close(first, f(a, b), **GEMM_TOL)
    assert second.data_ptr() != first.data_ptr()
