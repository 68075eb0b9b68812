"""The executor's call plan (vtc.runtime.callplan): the same results as running the steps one by one,
range checks inside the kernel's C call with the same IndexError, views of constants made once, inputs
checked, threads and many calls."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F

import vtc
from vtc.runtime.callplan import CallPlan

from .util import POINTWISE_TOL, ROW_TOL, gen, rand, rss_growth_kb

G = gen(90)


def _plan(compiled) -> CallPlan:
    return compiled._first.executor.call_plan()


def _same_as_steps(compiled, inputs) -> None:
    """The call plan and Executor.run_steps (step by step through run_step) give the same tensors."""
    ex = compiled._first.executor
    for got, want in zip(ex(list(inputs)), ex.run_steps(list(inputs))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_index_range_check_runs_in_the_kernel_call_and_raises_the_same_index_error():
    f = lambda t, i: t.index_select(0, i).sum(-1)  # noqa: E731
    table, idx = rand((17, 33), G), torch.randint(0, 17, (127,), generator=G)
    c = vtc.compile(f, (table, idx), plan="all")
    torch.testing.assert_close(c(table, idx), f(table, idx), **ROW_TOL)
    assert _plan(c).counts["checks_in_c"] == 1 and _plan(c).counts["checks_in_python"] == 0
    for bad, pos in ((17, 126), (-1, 0), (2 ** 40, 64)):
        i = idx.clone()
        i[pos] = bad
        with pytest.raises(IndexError, match=rf"^index_select: index {bad} is out of range \[0, 16\]"):
            c(table, i)
    torch.testing.assert_close(c(table, idx), f(table, idx), **ROW_TOL)  # still fine after the errors
    _same_as_steps(c, (table, idx))


def test_index_check_of_a_non_int64_index_runs_from_python():
    f = lambda t, i: t.index_select(0, i) * 2  # noqa: E731
    table, idx = rand((5, 3), G), torch.tensor([4, 0, 3], dtype=torch.int32)
    c = vtc.compile(f, (table, idx), plan="all")
    torch.testing.assert_close(c(table, idx), f(table, idx), **POINTWISE_TOL)
    assert _plan(c).counts["checks_in_c"] == 0 and _plan(c).counts["checks_in_python"] == 1
    with pytest.raises(IndexError, match="index_select: index 5 is out of range"):
        c(table, torch.tensor([4, 5, 3], dtype=torch.int32))


def test_a_library_gemm_reads_the_transposed_weight_as_a_view_made_once():
    lin = torch.nn.Linear(17, 3).eval()
    f = lambda x: F.relu(lin(x)) + 1  # noqa: E731
    x = rand((1, 17), G)
    c = vtc.compile(f, (x,), gemm="torch")
    with torch.no_grad():
        torch.testing.assert_close(c(x), f(x), **ROW_TOL)
        assert _plan(c).counts["constant_views"] >= 1
        assert sum(s.kind == "view" for s in c._first.executor.steps) >= 1
        _same_as_steps(c, (x,))


def test_non_contiguous_inputs_of_the_captured_shape():
    f = lambda x, y: torch.softmax(x.transpose(0, 1) + y, -1)  # noqa: E731
    x, y = rand((17, 3), G), rand((3, 17), G)
    c = vtc.compile(f, (x, y), plan="all")
    xt, yt = rand((3, 17), G).t(), rand((17, 3), G).t()  # the captured shapes, not contiguous
    assert not xt.is_contiguous() and not yt.is_contiguous()
    torch.testing.assert_close(c(xt, yt), f(xt, yt), **ROW_TOL)
    assert xt.stride() == (1, 17)  # not changed in place
    _same_as_steps(c, (xt, yt))


def test_the_executor_checks_inputs_it_is_given_directly():
    f = lambda x: x.t() * 2  # noqa: E731
    c = vtc.compile(f, (rand((3, 4), G),), plan="all")
    ex = c._first.executor
    with pytest.raises(ValueError, match=r"expected shape \[3, 4\], received \[4, 3\]"):
        ex([rand((4, 3), G)])
    with pytest.raises(TypeError, match="expected dtype torch.float32, received torch.float64"):
        ex([rand((3, 4), G, torch.float64)])


@pytest.mark.parametrize("options, kinds", [
    (dict(plan="all"), {"kernel"}), (dict(plan="none"), {"kernel", "run"}),
    (dict(backend="torch"), {"run", "gather"}), (dict(oracle=True), {"run", "gather"}),
    (dict(plan="all", gemm="torch"), {"kernel", "run"})])
def test_same_as_step_by_step(options, kinds):
    """Kernels, torch ops with list arguments (cat, index_put), gathers, views, kept movement ops."""
    def f(a, b, i):
        c = torch.cat([a, b * 2], dim=0)  # list argument
        d = torch.index_put(c, (i,), torch.ones(3))  # tuple argument with a tensor
        e = d.t()[1:].roll(1, 0) @ d
        return torch.relu(e), d.index_select(0, i).sum(-1)

    a, b, i = rand((5, 3), G), rand((4, 3), G), torch.tensor([0, 8, 3])
    c = vtc.compile(f, (a, b, i), **options)
    assert {s.kind for s in c._first.executor.steps} == kinds
    for got, want in zip(c(a, b, i), f(a, b, i)):
        torch.testing.assert_close(got, want, **ROW_TOL)
    _same_as_steps(c, (a, b, i))
    with pytest.raises(IndexError, match="index 9 is out of"):  # torch runs index_put under backend="torch"
        c(a, b, torch.tensor([0, 9, 3]))


def test_threads_with_index_checks_and_errors():
    f = lambda t, i, w: (t.index_select(0, i) * w).sum(-1)  # noqa: E731
    table, w = rand((64, 16), G), rand((16,), G)
    idx = [torch.randint(0, 64, (33,), generator=G) for _ in range(4)]
    c = vtc.compile(f, (table, idx[0], w), plan="all")
    want = [f(table, i, w) for i in idx]
    errors: list[str] = []

    def work(k: int) -> None:
        try:
            for n in range(200):
                if k == 3 and n % 2:  # one thread also hits the range check
                    with pytest.raises(IndexError, match="index 64 is out of range"):
                        c(table, torch.full((33,), 64), w)
                else:
                    torch.testing.assert_close(c(table, idx[k], w), want[k], **ROW_TOL)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_ten_thousand_calls_do_not_grow_memory():
    f = lambda t, i: torch.relu(t.index_select(0, i)).sum(-1)  # noqa: E731
    table, idx = rand((64, 16), G), torch.randint(0, 64, (32,), generator=G)
    c = vtc.compile(f, (table, idx), plan="all")
    grown = rss_growth_kb(lambda: c(table, idx), warmup=500, calls=10_000)
    assert grown < 4 * 1024, f"RSS grew by {grown} kB over 10,000 calls"


def test_a_dropped_model_frees_its_executor_without_the_cycle_collector():
    """The call plan holds its executor weakly: no cycle keeps the executor (and its pooled buffers) alive."""
    f = lambda t, i: t.index_select(0, i).sum(-1)  # noqa: E731
    table, idx = rand((17, 33), G), torch.randint(0, 17, (127,), generator=G)
    c = vtc.compile(f, (table, idx), plan="all")
    c(table, idx)
    executor = weakref.ref(c._first.executor)
    gc.disable()
    try:
        del c
        assert executor() is None
    finally:
        gc.enable()


def test_small_outputs_keep_their_dtype_when_the_default_dtype_changes():
    """Small kernel outputs of the default dtype are made without dtype= and checked: a default dtype set
    after compiling (float64) must not reach them; int64 and float64 outputs keep theirs."""
    f = lambda x, i, d: (torch.relu(x.t()) + 1, (i * 3).flip(0), d.exp())  # noqa: E731
    x, i = rand((17, 3), G), torch.randint(-50, 50, (127,), generator=G)
    d = rand((3, 1), G).double()
    c = vtc.compile(f, (x, i, d), plan="all")
    old = torch.get_default_dtype()
    try:
        for default in (torch.float64, torch.float16, old):
            torch.set_default_dtype(default)
            got = c(x, i, d)
            assert [g.dtype for g in got] == [torch.float32, torch.int64, torch.float64]
            for g, w in zip(got, f(x, i, d)):
                torch.testing.assert_close(g, w, **POINTWISE_TOL)
    finally:
        torch.set_default_dtype(old)
    assert _plan(c).counts["by_name"] == 0  # every kernel went through the call plan's fast path


def test_pointer_array_holds_every_address_in_order():
    import ctypes

    from vtc.runtime.callplan import pointer_array

    addresses = [0, 1, 2 ** 63 - 1, 2 ** 64 - 1, 123456789]
    packed = pointer_array(len(addresses))(*addresses)
    assert list((ctypes.c_uint64 * len(addresses)).from_buffer_copy(packed)) == addresses
