"""Consecutive generated kernels run in one C call (vtc.runtime.segment), against torch and the per-step path.

A segment's kernels get their pointer arrays from a table set up once, patched per call on the C stack with
the call's few addresses.  The tests check: the same tensors as kernels called one by one (segments off) and
as running the steps through ``Executor.run_step``, close to eager; fewer calls into C per model call (the
number of ctypes calls, counted); an index out of range in the middle of a segment raises the op's
IndexError before its kernel runs, and the next call is right; non-contiguous inputs and a packed conv
weight changed in place; several threads at once; many calls; the pool's buffers not held longer.
"""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from vtc.runtime import segment

from .util import ROW_TOL, compile_cpu, errors_in_threads, executor, gen, rand, rss_growth_kb


def _plan(compiled):
    return executor(compiled).call_plan()


def _chain(g):
    w1, w2, w3, b = rand((16, 8, 3, 3), g), rand((16, 16, 1, 1), g), rand((8, 16, 1, 1), g), rand((16, 1, 1), g)

    def fn(x):
        h = torch.relu(F.conv2d(x, w1, padding=1))
        h = torch.sigmoid(F.conv2d(h, w2)) * h.mean() + b
        return F.conv2d(h, w3).tanh(), h.sum((2, 3))
    return fn


@pytest.fixture(autouse=True)
def _segments_on(monkeypatch):
    """Segments are on with the buffer pool (vtc.runtime.segment.SEGMENTS); these tests turn them on whatever
    VTC_BUFFER_POOL says."""
    monkeypatch.setattr(segment, "SEGMENTS", True)


def _solo(fn, inputs, **options):
    """fn compiled with every kernel called on its own (its plan built without segments)."""
    compiled = compile_cpu(fn, inputs, **options)
    was, segment.SEGMENTS = segment.SEGMENTS, False
    try:
        _plan(compiled)
    finally:
        segment.SEGMENTS = was
    assert _plan(compiled).counts["segments"] == 0
    return compiled


def _assert_same(got, want) -> None:
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _c_calls(compiled, inputs, monkeypatch, segments: bool = True) -> int:
    """How many ctypes functions a call of `compiled` calls: its plan built (with or without segments) with
    ctypes.CFUNCTYPE counting every call of the functions made from it (a kernel's, the segment runner's)."""
    calls = [0]
    prototype = ctypes.CFUNCTYPE

    def counting(*types):
        make = prototype(*types)

        def function(address):
            f = make(address)

            def call(*args):
                calls[0] += 1
                return f(*args)
            return call
        return function

    with monkeypatch.context() as m:
        m.setattr(ctypes, "CFUNCTYPE", counting)
        m.setattr(segment, "SEGMENTS", segments)
        compiled(*inputs)  # builds the call plan
    calls[0] = 0
    compiled(*inputs)
    return calls[0]


def test_a_chain_of_kernels_is_one_c_call_with_the_same_results(monkeypatch):
    g = gen(1)
    fn, x = _chain(g), rand((2, 8, 12, 12), g)
    compiled, solo = compile_cpu(fn, (x,)), compile_cpu(fn, (x,))
    kernels = sum(s.kind == "kernel" for s in executor(compiled).steps)
    assert kernels >= 4
    assert _c_calls(compiled, (x,), monkeypatch) == 1  # kernels called one by one: one ctypes call each
    assert _c_calls(solo, (x,), monkeypatch, segments=False) == kernels
    assert _plan(compiled).c_calls == 1 and _plan(solo).c_calls == kernels
    assert _plan(compiled).counts["segment_kernels"] == kernels
    for k in range(3):
        xk = rand(tuple(x.shape), gen(10 + k))
        got = compiled(xk)
        _assert_same(got, solo(xk))
        _assert_same(got, executor(compiled).run_steps([xk]))
        for a, b in zip(got, fn(xk)):
            torch.testing.assert_close(a, b, **ROW_TOL)


def test_an_index_out_of_range_in_a_segment_raises_before_its_kernel_runs():
    g = gen(2)
    w, table = rand((8, 8, 1, 1), g), rand((40, 8), g)

    def fn(x, i):
        h = torch.relu(F.conv2d(x, w)).flatten(1)   # (3, 8): kernels before the gather
        e = table.index_select(0, i) * h.sum(0)     # the gather's range check, inside the segment
        return torch.softmax(e, -1) + 1             # a kernel after it

    x, i = rand((3, 8, 1, 1), g), torch.randint(0, 40, (6,), generator=g)
    compiled = compile_cpu(fn, (x, i))
    torch.testing.assert_close(compiled(x, i), fn(x, i), **ROW_TOL)
    plan = _plan(compiled)
    kernels = sum(s.kind == "kernel" for s in executor(compiled).steps)
    assert plan.counts["checks_in_c"] == 1 and plan.counts["segment_kernels"] == kernels >= 2
    for bad, pos in ((40, 5), (-1, 0), (2 ** 40, 2)):
        j = i.clone()
        j[pos] = bad
        with pytest.raises(IndexError, match=rf"^index_select: index {bad} is out of range \[0, 39\]"):
            compiled(x, j)
    torch.testing.assert_close(compiled(x, i), fn(x, i), **ROW_TOL)  # right after the errors
    _assert_same(compiled(x, i), _solo(fn, (x, i))(x, i))


def test_non_contiguous_inputs_and_a_weight_changed_in_place():
    g = gen(3)
    conv1, conv2 = torch.nn.Conv2d(16, 32, 1).eval(), torch.nn.Conv2d(32, 16, 1).eval()

    def fn(x, y):
        return conv2(torch.relu(conv1(x.transpose(2, 3)))) * y

    x, y = rand((1, 16, 14, 10), g), rand((1, 16, 10, 14), g)
    with torch.no_grad():
        compiled = compile_cpu(fn, (x, y))
        xt, yt = rand((1, 16, 10, 14), g).transpose(2, 3), rand((1, 16, 14, 10), g).transpose(2, 3)
        assert not xt.is_contiguous() and not yt.is_contiguous()
        torch.testing.assert_close(compiled(xt, yt), fn(xt, yt), **ROW_TOL)
        assert _plan(compiled).counts["segments"] >= 1
        conv2.weight.mul_(-0.5)  # a packed weight is packed again before the segment runs
        torch.testing.assert_close(compiled(xt, yt), fn(xt, yt), **ROW_TOL)
        torch.testing.assert_close(compiled(x, y), fn(x, y), **ROW_TOL)


def test_threads_calling_one_model_at_once():
    g = gen(4)
    fn, x = _chain(g), rand((2, 8, 12, 12), g)
    compiled = compile_cpu(fn, (x,))
    xs = [rand(tuple(x.shape), gen(40 + k)) for k in range(4)]
    want = [fn(t) for t in xs]

    def work(k: int) -> None:
        for _ in range(40):
            for a, b in zip(compiled(xs[k]), want[k]):
                torch.testing.assert_close(a, b, **ROW_TOL)

    assert errors_in_threads(work, 4) == []
    assert _plan(compiled).counts["segments"] >= 1


def test_two_thousand_calls_do_not_grow_memory():
    g = gen(5)
    fn, x = _chain(g), rand((1, 8, 6, 6), g)
    compiled = compile_cpu(fn, (x,))
    assert _plan(compiled).counts["segments"] >= 1
    grown = rss_growth_kb(lambda: compiled(x), warmup=300, calls=2000)
    assert grown < 4 * 1024, f"RSS grew by {grown} kB over 2,000 calls"


def test_a_pooled_buffer_freed_in_a_segment_is_reused_as_before():
    """Outputs are allocated before the segment's C call: a kernel that, called on its own, would take a pool
    buffer freed earlier in the segment starts a new segment, so the pool holds no more buffers than before."""
    g = gen(6)
    w = [rand((32, 32, 1, 1), g) for _ in range(4)]

    def fn(x):
        for k in range(4):  # 32 x 96 x 192 floats (2.4 MB) per step: from the pool
            x = torch.relu(F.conv2d(x, w[k])) + 1
        return x

    x = rand((1, 32, 96, 192), g)
    compiled, solo = compile_cpu(fn, (x,)), _solo(fn, (x,))
    for _ in range(3):
        _assert_same(compiled(x), solo(x))
    assert len(executor(compiled).pool._kept) == len(executor(solo).pool._kept)
    torch.testing.assert_close(compiled(x), fn(x), **ROW_TOL)
