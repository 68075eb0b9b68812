"""Kernel outputs that only kernels read live in a per-call arena (vtc.runtime.callplan._arena_layout), against torch.

Such a value is never a tensor during the call: its writer and readers get its address in an arena whose
offsets the call plan fixed once (values whose spans of steps meet never share bytes).  The tests check the
values against eager over several calls, that graph outputs and values a torch op reads stay tensors, the
layout (no two live values overlap), several threads at once (each call its own arena), an error in the
middle of a call (the arena is given back), and the arena switched off.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.runtime import callplan

from .util import ROW_TOL, compile_cpu, errors_in_threads, executor, gen, rand


def _chain(w1, w2, b):
    def fn(x):
        h = torch.relu(F.conv2d(x, w1, padding=1))     # only the next conv reads it: in the arena
        h = torch.sigmoid(F.conv2d(h, w2)) * h.mean()   # h read twice, the mean by a kernel
        return (h + b).tanh(), h.sum((2, 3))
    return fn


def _case(seed: int = 1):
    g = gen(seed)
    w1, w2, b = rand((24, 8, 3, 3), g), rand((24, 24, 1, 1), g), rand((24, 1, 1), g)
    return _chain(w1, w2, b), (rand((2, 8, 12, 12), g),)


def _plan(compiled):
    return executor(compiled).call_plan()


def test_intermediates_in_the_arena_match_eager_over_calls():
    fn, (x,) = _case(1)
    compiled = compile_cpu(fn, (x,))
    for k in range(3):
        xk = rand(tuple(x.shape), gen(10 + k))
        got, want = compiled(xk), fn(xk)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **ROW_TOL)
    plan = _plan(compiled)
    assert plan.arena_offsets and plan.arena_bytes > 0, "no value was placed in the arena"
    outputs = {v.name for v in executor(compiled).graph.outputs}
    assert not outputs & set(plan.arena_offsets)
    for t in got:  # the outputs are the caller's own tensors, outside every arena
        arena = plan._arenas[0][0]
        lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
        assert not lo <= t.data_ptr() < hi


def test_no_two_live_values_share_bytes():
    fn, (x,) = _case(2)
    compiled = compile_cpu(fn, (x,))
    compiled(x)
    ex, plan = executor(compiled), _plan(compiled)
    span: dict[str, list[int]] = {}
    for k, s in enumerate(ex.steps):
        for name in [*s.writes, *s.reads]:
            span.setdefault(name, [k, k])[1] = k
    size = {b.name: b.nbytes for s in ex.steps if s.kind == "kernel" for b in s.kernel.outputs}
    placed = sorted(plan.arena_offsets.items(), key=lambda kv: kv[1])
    for i, (a, oa) in enumerate(placed):
        assert oa % callplan.ARENA_ALIGN == 0 and oa + size[a] <= plan.arena_bytes
        for b, ob in placed[i + 1:]:
            meet = span[a][0] <= span[b][1] and span[b][0] <= span[a][1]
            if meet:
                assert oa + size[a] <= ob or ob + size[b] <= oa, (a, b)


def test_a_value_a_torch_op_reads_stays_a_tensor():
    g = gen(3)
    w = rand((16, 16), g)

    def fn(x):
        h = torch.relu(x * 2 + 1)     # read by torch's mm (gemm='torch'): a tensor
        return torch.sigmoid(h @ w)

    x = rand((64, 16), g)
    compiled = compile_cpu(fn, (x,), gemm="torch")
    torch.testing.assert_close(compiled(x), fn(x), **ROW_TOL)
    ex = executor(compiled)
    read_by_torch = {v.name for s in ex.steps if s.kind == "run" for v in s.node.inputs}
    assert read_by_torch and not read_by_torch & set(_plan(compiled).arena_offsets)


def test_threads_take_their_own_arenas():
    fn, (x,) = _case(4)
    compiled = compile_cpu(fn, (x,))
    xs = [rand(tuple(x.shape), gen(40 + k)) for k in range(4)]
    want = [fn(t) for t in xs]

    def work(k: int) -> None:
        for _ in range(30):
            for a, b in zip(compiled(xs[k]), want[k]):
                torch.testing.assert_close(a, b, **ROW_TOL)

    assert errors_in_threads(work, 4) == []
    assert 1 <= len(_plan(compiled)._arenas) <= 4


def test_an_error_in_a_call_gives_the_arena_back():
    g = gen(5)
    table, w1, w2 = rand((32, 8), g), rand((8, 4, 3, 3), g), rand((6, 8, 1, 1), g)

    def fn(x, i):
        h = torch.relu(F.conv2d(x, w1, padding=1))  # read by the next convolution only: in the arena
        return F.conv2d(h, w2), table.index_select(0, i) * 2  # the index check raises in the call

    x, i = rand((1, 4, 9, 9), g), torch.randint(0, 32, (5,), generator=g)
    compiled = compile_cpu(fn, (x, i), plan="all")
    for a, b in zip(compiled(x, i), fn(x, i)):
        torch.testing.assert_close(a, b, **ROW_TOL)
    plan = _plan(compiled)
    assert plan.arena_offsets and (plan.arena_kernels or plan.segment_arena)
    kept = len(plan._arenas)
    with pytest.raises(IndexError):
        compiled(x, torch.full((5,), 40))
    assert len(plan._arenas) == kept
    for a, b in zip(compiled(x, i), fn(x, i)):
        torch.testing.assert_close(a, b, **ROW_TOL)


def test_switched_off_every_value_is_a_tensor(monkeypatch):
    monkeypatch.setattr(callplan, "ARENA", False)
    fn, (x,) = _case(6)
    compiled = compile_cpu(fn, (x,))
    for a, b in zip(compiled(x), fn(x)):
        torch.testing.assert_close(a, b, **ROW_TOL)
    assert _plan(compiled).arena_offsets == {} and _plan(compiled).arena_kernels == []


def test_a_large_intermediate_stays_with_the_buffer_pool():
    """Values up to callplan.ARENA_MAX_BYTES (2 MB) are the arena's, larger ones the pool's."""
    from vtc.runtime import buffers

    g = gen(7)
    w1, w2, w3 = rand((24, 8, 3, 3), g), rand((24, 24, 1, 1), g), rand((16, 24, 1, 1), g)

    def fn(x):
        big = torch.relu(F.conv2d(x, w1, padding=1))    # 24 x 160 x 160 floats (2.4 MB): the pool's
        mid = torch.relu(F.conv2d(big, w2, stride=2))    # 24 x 80 x 80 (600 KB), read by a kernel: the arena's
        return F.conv2d(mid, w3).exp()

    x = rand((1, 8, 160, 160), g)
    compiled = compile_cpu(fn, (x,))
    torch.testing.assert_close(compiled(x), fn(x), **ROW_TOL)
    torch.testing.assert_close(compiled(x), fn(x), **ROW_TOL)
    ex, plan = executor(compiled), _plan(compiled)
    size = {b.name: b.nbytes for s in ex.steps if s.kind == "kernel" for b in s.kernel.outputs}
    assert plan.arena_offsets and all(size[n] <= callplan.ARENA_MAX_BYTES for n in plan.arena_offsets)
    assert any(size[n] >= buffers.MIN_BYTES for n in plan.arena_offsets), "the 600 KB value is the pool's"
    assert any(nb > callplan.ARENA_MAX_BYTES for name, nb in size.items()
               if name not in {v.name for v in ex.graph.outputs}), "no large intermediate: the test tests nothing"
