"""Recycled large kernel outputs (vtc.runtime.buffers): reused only when nothing outside refers to them."""
from __future__ import annotations

import gc

import torch

from vtc.runtime import buffers

from .util import POINTWISE_TOL, compile_cpu, errors_in_threads, executor, gen, rand, steps

N = (buffers.MIN_BYTES // 4) // 1021 + 3  # rows of 1021 floats: just above the recycling threshold


def _f(x, y):
    return torch.relu(x.transpose(0, 1) + y) * 2


def _inputs(seed: int):
    g = gen(seed)
    return rand((1021, N), g), rand((N, 1021), g)


def test_dropped_output_storage_is_reused_and_held_ones_are_not():
    x, y = _inputs(70)
    compiled = compile_cpu(_f, (x, y))
    assert [s.kind for s in steps(compiled)] == ["kernel"]
    first = compiled(x, y)
    ptr = first.data_ptr()
    torch.testing.assert_close(first, _f(x, y), **POINTWISE_TOL)
    del first
    gc.collect()
    again = compiled(x, y)
    assert again.data_ptr() == ptr and again._base is None and again.is_contiguous()
    pooled = [st.data_ptr() for st in executor(compiled).pool._kept]
    assert pooled == [ptr]  # the one storage, kept by the pool between the calls
    # held by the caller (as the tensor, a view, a numpy array): the next call writes elsewhere
    x2, y2 = _inputs(71)
    for hold in (lambda t: t, lambda t: t[3:, 5], lambda t: t.numpy()):
        kept = hold(again)
        snapshot = again.clone()
        del again
        new = compiled(x2, y2)
        assert new.data_ptr() != ptr
        torch.testing.assert_close(torch.as_tensor(kept), torch.as_tensor(hold(snapshot)), rtol=0, atol=0)
        torch.testing.assert_close(new, _f(x2, y2), **POINTWISE_TOL)
        del kept, snapshot, new
        gc.collect()
        again = compiled(x, y)
        torch.testing.assert_close(again, _f(x, y), **POINTWISE_TOL)
        ptr = again.data_ptr()


def test_a_held_storage_object_is_not_reused():
    """A caller keeping only ``out.untyped_storage()`` holds the Python object the pool keeps (its C++ use
    count stays 1): the next call must not write into it (it did: found by the session-10 sweep); once the
    caller drops it, the storage is reused."""
    x, y = _inputs(72)
    compiled = compile_cpu(_f, (x, y))
    out = compiled(x, y)
    ptr = out.data_ptr()
    st, snapshot = out.untyped_storage(), out.clone()
    del out
    gc.collect()
    x2, y2 = _inputs(73)
    new = compiled(x2, y2)
    assert new.data_ptr() != ptr
    torch.testing.assert_close(new, _f(x2, y2), **POINTWISE_TOL)
    held = torch.empty(0).set_(st, 0, snapshot.shape, snapshot.stride())
    assert torch.equal(held, snapshot)
    del held, st, new
    gc.collect()
    assert compiled(x, y).data_ptr() == ptr  # dropped: reused (the oldest kept storage first)


def test_small_outputs_are_plain_allocations():
    pool = buffers.BufferPool()
    a = pool.empty(torch.Size([3, 17]), torch.float32)
    assert a.shape == (3, 17) and pool._kept == []
    big = pool.empty(torch.Size([N, 1021]), torch.float32)
    assert big.shape == (N, 1021) and big.stride() == (1021, 1) and len(pool._kept) == 1


def test_pool_stays_bounded_over_many_sizes():
    """A new size replaces the oldest free storage; held ones stay; never more than MAX_KEPT."""
    pool = buffers.BufferPool()
    held = pool.empty(torch.Size([N, 1021]), torch.float32)
    for k in range(1, 3 * buffers.MAX_KEPT):
        t = pool.empty(torch.Size([N + k, 1021]), torch.float32)
        del t
        assert len(pool._kept) <= buffers.MAX_KEPT
    assert held.untyped_storage().data_ptr() in [st.data_ptr() for st in pool._kept]


def test_pool_never_hands_one_storage_to_two_threads():
    sets = [_inputs(80 + k) for k in range(3)]
    compiled = compile_cpu(_f, sets[0])
    expected = [_f(*s) for s in sets]
    def work(k: int) -> None:
        held = []
        for i in range(6):
            got = compiled(*sets[k])
            held.append(got)  # some outputs stay alive while other threads call
            if i % 2:
                held.pop(0)
        for got in held:
            torch.testing.assert_close(got, expected[k], **POINTWISE_TOL)

    assert errors_in_threads(work, 3) == []


def test_pool_off_keeps_nothing(monkeypatch):
    """VTC_BUFFER_POOL=0 (the benchmark's memory probes): every large buffer is a fresh torch.empty."""
    monkeypatch.setattr(buffers, "ENABLED", False)
    x, y = _inputs(75)
    compiled = compile_cpu(_f, (x, y))
    for _ in range(2):
        torch.testing.assert_close(compiled(x, y), _f(x, y), **POINTWISE_TOL)
    assert executor(compiled).pool._kept == []
