"""The fixed cost of a call (docs/call_cost.md): the generated fast call (``vtc.runtime.callplan.fast_call``)
and pooled outputs handed out as a kept tensor's ``detach()`` (``vtc.runtime.buffers``), checked for what they
must never change: results equal to eager, outputs the caller holds never written again, errors as before."""
from __future__ import annotations

import gc

import pytest
import torch

import vtc
from vtc.codegen import conv_t
from vtc.runtime import buffers, packed
from vtc.runtime.callplan import MISS, fast_call

from .util import (POINTWISE_TOL, ROW_TOL, compile_cpu, errors_in_threads, executor, gen, rand, rss_growth_kb,
                   torch_threads)

BIG = (1, 8, 96, 96)  # two of them catted: 576 KB, an output from the buffer pool (>= buffers.MIN_BYTES)
SMALL = (2, 3, 5, 7)


def _cat_relu(a, b):
    return torch.relu(torch.cat((a, b), dim=1))


def _inputs(shape, seed: int):
    g = gen(seed)
    return rand(shape, g), rand(shape, g)


def _compiled(shape, seed: int = 0):
    a, b = _inputs(shape, seed)
    compiled = compile_cpu(_cat_relu, (a, b))
    torch.testing.assert_close(compiled(a, b), _cat_relu(a, b), **POINTWISE_TOL)
    return compiled


@pytest.mark.parametrize("shape", [SMALL, BIG], ids=["small", "pooled"])
def test_a_one_kernel_plan_calls_its_kernel_from_the_fast_call(shape):
    compiled = _compiled(shape)
    assert compiled._fast is not None  # made by the first call
    _, source = fast_call(executor(compiled).call_plan(), compiled._first.exact_signature[0], None)
    assert "fn(pack(" in source and "plan(" not in source  # the kernel itself, no call plan in between
    for seed in (1, 2):
        a, b = _inputs(shape, seed)
        torch.testing.assert_close(compiled(a, b), _cat_relu(a, b), **POINTWISE_TOL)


@pytest.mark.parametrize("shape", [SMALL, BIG], ids=["small", "pooled"])
def test_held_outputs_are_never_written_again(shape):
    compiled = _compiled(shape)
    held = []
    for seed in range(1, 6):
        a, b = _inputs(shape, seed)
        held.append((compiled(a, b), _cat_relu(a, b)))
        if seed % 2:
            held.append((compiled(a, b)[:, 1:], _cat_relu(a, b)[:, 1:]))  # a view held, its base dropped
    for got, want in held:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_fast_call_takes_only_its_signature_and_the_full_path_the_rest():
    compiled = _compiled(SMALL)
    fast = compiled._fast
    a, b = _inputs(SMALL, 3)
    assert fast((a, b)) is not MISS
    for args in [(a,), (a, b, b), (a.double(), b), (a, b[:, :2]), (a.to(torch.float16), b)]:
        assert fast(args) is MISS
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        compiled(a.double(), b)  # the full path's error, as before
    # a non-contiguous input of the captured shape and dtype: copied, then the kernel
    at = rand((SMALL[0], SMALL[2], SMALL[1], SMALL[3]), gen(4)).transpose(1, 2)
    assert at.shape == a.shape and not at.is_contiguous()
    torch.testing.assert_close(compiled(at, b), _cat_relu(at, b), **POINTWISE_TOL)
    # new sizes: a specialization of their own, and the captured sizes still take the fast call
    a2, b2 = _inputs((2, 3, 6, 7), 5)
    torch.testing.assert_close(compiled(a2, b2), _cat_relu(a2, b2), **POINTWISE_TOL)
    torch.testing.assert_close(compiled(a, b), _cat_relu(a, b), **POINTWISE_TOL)
    assert compiled._fast is fast


def test_several_outputs_and_a_constant_through_the_fast_call():
    lin = torch.nn.Linear(24, 40)
    x = rand((16, 24), gen(6))

    def f(x):
        y = lin(x)
        return y, torch.relu(y)

    compiled = compile_cpu(f, (x,), gemm="vtc")
    for seed in range(6, 9):
        x = rand((16, 24), gen(seed))
        got, want = compiled(x), f(x)
        assert isinstance(got, tuple) and len(got) == 2
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)


def test_a_dropped_output_changed_in_place_does_not_change_the_next():
    """The pool keeps a tensor per storage and hands out its detach(): metadata a caller changes on its output
    (transposed in place, strides, requires_grad) must stay with that output."""
    compiled = _compiled(BIG)
    a, b = _inputs(BIG, 7)
    want = _cat_relu(a, b)
    for change in (lambda t: t.t_() if t.dim() == 2 else t.transpose_(1, 2), lambda t: t.as_strided_((4,), (1,)),
                   lambda t: t.requires_grad_(), lambda t: t.squeeze_(0), lambda t: setattr(t, "note", 1)):
        out = compiled(a, b)
        ptr = out.data_ptr()
        change(out)
        del out
        gc.collect()
        again = compiled(a, b)
        assert again.data_ptr() == ptr  # the same storage, handed out again
        assert again.shape == want.shape and again.is_contiguous() and again._base is None
        assert not again.requires_grad and not hasattr(again, "note")
        torch.testing.assert_close(again, want, rtol=0, atol=0)
        del again
    pool = executor(compiled).pool
    assert [v is not None for v in pool._views] == [True]  # handed out as the kept tensor's detach()


@pytest.mark.parametrize("shape", [SMALL, BIG], ids=["small", "pooled"])
def test_outputs_are_inference_tensors_exactly_in_inference_mode(shape):
    compiled = _compiled(shape)
    a, b = _inputs(shape, 8)
    for mode in (False, True, False, True):
        with torch.inference_mode(mode):
            out = compiled(a, b)
            assert out.is_inference() == mode == _cat_relu(a, b).is_inference()
        torch.testing.assert_close(out, _cat_relu(a, b), rtol=0, atol=0)
        if not mode:
            (out * torch.ones_like(out, requires_grad=True)).sum().backward()  # usable in autograd
        del out
        gc.collect()


def test_a_held_storage_object_is_not_reused_with_a_kept_tensor():
    """As tests/codegen/test_buffers.py, once the pool keeps a tensor on the storage (its second use)."""
    compiled = _compiled(BIG)
    a, b = _inputs(BIG, 9)
    compiled(a, b)  # the storage's kept tensor made on its reuse
    out = compiled(a, b)
    ptr = out.data_ptr()
    st, snapshot = out.untyped_storage(), out.clone()
    del out
    gc.collect()
    a2, b2 = _inputs(BIG, 10)
    new = compiled(a2, b2)
    assert new.data_ptr() != ptr
    torch.testing.assert_close(new, _cat_relu(a2, b2), rtol=0, atol=0)
    assert torch.equal(torch.empty(0).set_(st, 0, snapshot.shape), snapshot)
    del st, new
    gc.collect()
    assert compiled(a, b).data_ptr() == ptr


@pytest.mark.parametrize("shape", [SMALL, BIG], ids=["small", "pooled"])
def test_ten_thousand_calls_do_not_grow_memory(shape):
    compiled = _compiled(shape)
    a, b = _inputs(shape, 11)
    grown = rss_growth_kb(lambda: compiled(a, b), warmup=300, calls=10_000)
    assert grown < 4 * 1024, f"RSS grew by {grown} kB over 10,000 calls"
    assert len(executor(compiled).pool._kept) <= 1


def test_threads_calling_one_model_get_their_own_outputs():
    compiled = _compiled(BIG)
    sets = [_inputs(BIG, 20 + k) for k in range(4)]
    expected = [_cat_relu(*s) for s in sets]

    def work(k: int) -> None:
        held = []
        for i in range(40):
            held.append(compiled(*sets[k]))
            if i % 3:
                held.pop(0)
        for got in held:
            torch.testing.assert_close(got, expected[k], rtol=0, atol=0)

    assert errors_in_threads(work, 4) == []


def test_pool_views_follow_shape_and_dtype():
    """A kept storage handed out with another shape or dtype of the same size: a tensor of those."""
    pool = buffers.BufferPool()
    n = buffers.MIN_BYTES // 4
    for shape, dtype in [((n,), torch.float32), ((n,), torch.float32), ((2, n // 2), torch.float32),
                         ((n,), torch.int32), ((n * 2,), torch.float16)]:
        t = pool.empty(torch.Size(shape), dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t._base is None
        del t
    assert len(pool._kept) == 1


def test_allocators_take_a_kept_storage_only_when_nothing_holds_it():
    """``BufferPool.allocator`` tries the storage it took last first: never one held, by a tensor of another
    allocator of the same size, a view, or the storage object."""
    pool = buffers.BufferPool()
    n = buffers.MIN_BYTES // 4
    flat, square = pool.allocator(torch.Size([n]), torch.float32), pool.allocator(torch.Size([2, n // 2]),
                                                                                   torch.float32)
    x = flat()
    y = square()
    assert x.data_ptr() != y.data_ptr()
    px = x.data_ptr()
    x.fill_(1.5)
    del x
    z = square()  # y is held: x's storage, with square's shape
    assert z.data_ptr() == px and z.shape == (2, n // 2) and z.is_contiguous()
    for hold in (lambda t: t[1:], lambda t: t.untyped_storage(), lambda t: t.numpy()):
        held = hold(z)
        del z
        z = flat()
        assert z.data_ptr() not in (px, y.data_ptr())
        del z, held
        z = square()
        assert z.data_ptr() in (px, y.data_ptr()) or len(pool._kept) == 3
    assert len(pool._kept) <= 3


def test_index_range_checks_still_run_in_the_fast_call():
    """A gather's index range check runs in the kernel's C call (``vtc_call_checked``) from the fast call too:
    an index out of range raises the op's IndexError before the kernel runs, and the next call is right."""
    def f(x, idx):
        return torch.index_select(x, 0, idx).sum(dim=1)

    g = gen(30)
    x, idx = rand((40, 33), g), torch.randint(0, 40, (25,), generator=g)
    compiled = compile_cpu(f, (x, idx))
    torch.testing.assert_close(compiled(x, idx), f(x, idx), **POINTWISE_TOL)
    _, source = fast_call(executor(compiled).call_plan(), compiled._first.exact_signature[0], None)
    assert "call_checked(" in source and "plan(" not in source
    for bad in (40, -1, 1 << 40):
        wrong = idx.clone()
        wrong[7] = bad
        with pytest.raises(IndexError, match=r"index_select: index .* is out of range \[0, 39\]"):
            compiled(x, wrong)
        torch.testing.assert_close(compiled(x, idx), f(x, idx), **POINTWISE_TOL)


@pytest.mark.parametrize("wrap", ["tuple", "dict"])
def test_one_output_in_a_container_through_the_direct_call(wrap):
    """A one-kernel plan whose result is not the bare tensor: the kernel called directly, the result made by
    ``unflatten_outputs`` as on the full path."""
    def f(a, b):
        y = _cat_relu(a, b)
        return (y,) if wrap == "tuple" else {"y": y}

    a, b = _inputs(SMALL, 40)
    compiled = compile_cpu(f, (a, b))
    compiled(a, b)
    assert not compiled._first.exact_signature[1]
    _, source = fast_call(executor(compiled).call_plan(), compiled._first.exact_signature[0], lambda outs, args: outs)
    assert "fn(pack(" in source and "return post([o0], args)" in source
    for seed in (41, 42):
        a, b = _inputs(SMALL, seed)
        got, want = compiled(a, b), f(a, b)
        assert type(got) is type(want)
        got, want = (got[0], want[0]) if wrap == "tuple" else (got["y"], want["y"])
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not conv_t.has_avx512() or not packed.CONV_ENABLED,
                    reason="B packed once is the AVX-512 kernel's layout")
@pytest.mark.parametrize("threads", [1, 2])
def test_a_gemm_on_a_weight_packed_once_is_called_from_the_fast_call(threads):
    """x @ W^T whose plan is one "panels" kernel with W packed once (tests/runtime/test_packed_gemm_weights.py): the
    fast call runs the kernel itself with the packed panels' address and the flag, holding the state while the
    kernel runs; a weight changed in place is packed again before the next call.  Fails before: ``plan(`` in the
    source (the kernel with a packed weight went through the call plan)."""
    torch.manual_seed(50)
    lin = torch.nn.Linear(100, 655, bias=False)
    x = rand((288, 100), gen(51))
    with torch_threads(threads), torch.no_grad():
        compiled = vtc.compile(lin, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), lin(x), **ROW_TOL)
        plan = executor(compiled).call_plan()
        assert plan.counts["packed_conv_weights"] == 1, plan.why_not_packed
        _, source = fast_call(plan, compiled._first.exact_signature[0], None)
        assert "st = weight()" in source and "threads() | flag)" in source and "plan(" not in source
        for change in (lambda w: w.mul_(-2.0), lambda w: w.copy_(rand(tuple(w.shape), gen(52)))):
            change(lin.weight)
            x = rand((288, 100), gen(53))
            torch.testing.assert_close(compiled(x), lin(x), **ROW_TOL)
