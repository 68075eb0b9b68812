"""Adversarial tests (session 17) of how a compiled model is called: aliasing (the same tensor passed twice, an
output that is a view of an input), in-place ops in the model, inputs that are expanded / offset / transposed
views, new sizes, two Python threads at once, and both entry points (vtc.compile, torch.compile).  Compared with
torch eager; the caller's tensors compared too where the model changes them in place."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.adversarial import close, rand
from tests.codegen.util import errors_in_threads, torch_threads


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mutate_a_read_b(a, b):
    a.add_(1)
    return b * 2


def test_the_same_tensor_twice_where_the_model_changes_one_in_place_is_refused_by_name():
    """f(t, t) with f changing its first input in place: eager's second input sees the change.  vtc compiled
    them as two tensors and returned 2 * t from before the change, a silent wrong answer; now a ValueError
    names both inputs (vtc/frontend/torch_export.py, write_back)."""
    x = rand((4, 6), _g(0))
    compiled = vtc.compile(_mutate_a_read_b, (x.clone(), x.clone()))
    t = x.clone()
    with pytest.raises(ValueError, match=r"input 0 \(%a\) is changed in place by the model and shares memory "
                                         r"with input 1 \(%b\)"):
        compiled(t, t)
    t = x.clone()
    with pytest.raises(ValueError, match="shares memory"):
        compiled(t, t[:, :])  # a view of it: the same
    # separate tensors, and disjoint halves of one tensor, run as eager does
    for a, b in [(x.clone(), x.clone() * 0.5), tuple(torch.cat([x, x * 0.5]).clone().split(4))]:
        want_a, want = a.clone(), None
        want = _mutate_a_read_b(want_a, b.clone())
        got = compiled(a, b)
        close(got, want, torch.float32)
        close(a, want_a, torch.float32, "the input changed in place")


def test_torch_compile_sees_the_same_tensor_twice():
    x = rand((4, 6), _g(1))
    fn = torch.compile(_mutate_a_read_b, backend="vtc")
    t, u = x.clone(), x.clone()
    close(fn(t, t), _mutate_a_read_b(u, u), torch.float32)
    close(t, u, torch.float32)


def _update_two_caches(kc, vc, new, pos):
    kc.index_copy_(2, pos, new)  # stored into the caller's cache by the kernel that computes it (vtc.codegen.push)
    vc.index_copy_(2, pos, new * 2)
    return torch.softmax(new @ kc.transpose(2, 3), -1) @ vc


def _caches_call(path: str, kc, vc, new, pos):
    """``call(a, b)``: _update_two_caches compiled for these inputs, called on caches a and b with `new` and `pos`;
    path "executor": new and pos given by keyword (the executor's path), "fast call": positional, called once
    (the first call makes the fast call), else positional, not called yet."""
    if path == "executor":
        compiled = vtc.compile(_update_two_caches, (kc.clone(), vc.clone()), {"new": new, "pos": pos})
        return lambda a, b: compiled(a, b, new=new, pos=pos)
    compiled = vtc.compile(_update_two_caches, (kc.clone(), vc.clone(), new, pos))
    if path == "fast call":
        compiled(kc.clone(), vc.clone(), new, pos)
    return lambda a, b: compiled(a, b, new, pos)


@pytest.mark.parametrize("path", ["first call", "fast call", "executor", "new sizes"])
def test_a_refused_call_leaves_its_inputs_as_they_were(path):
    """The overlap test ran after the kernels, which had stored the new rows into the caller's cache already
    (kc and vc given as one tensor: refused, but the tensor changed).  Now it runs before any kernel, in the
    generated fast call (its first call, and the later ones), the executor's path (keyword inputs) and a
    specialization at new sizes (vtc/frontend/torch_export.py, mutation_guard)."""
    g = _g(20)
    kc, new, pos = rand((2, 3, 10, 4), g), rand((2, 3, 1, 4), g), torch.tensor([4])
    call = _caches_call(path, kc, kc, new, pos)
    if path == "new sizes":
        kc = rand((2, 3, 12, 4), g)
    for _ in range(2):
        t = kc.clone()
        with pytest.raises(ValueError, match=r"input 0 \(%kc\) is changed in place by the model and shares memory "
                                             r"with input 1 \(%vc\)"):
            call(t, t)
        assert torch.equal(t, kc), "a refused call changed its input"
        halves = torch.cat([kc, kc * 0.5]).clone()
        a, b = halves[:2], halves[2:]
        with pytest.raises(ValueError, match="shares memory"):
            call(a, halves[1:3])  # overlapping rows of one tensor
        assert torch.equal(halves, torch.cat([kc, kc * 0.5])), "a refused call changed its input"
    want_a, want_b = a.clone(), b.clone()  # disjoint halves of one tensor: run as eager does
    want = _update_two_caches(want_a, want_b, new, pos)
    close(call(a, b), want, torch.float32)
    close(halves, torch.cat([want_a, want_b]), torch.float32, "the caches changed in place")


@pytest.mark.parametrize("path", ["fast call", "executor"])
def test_an_expanded_input_changed_in_place_is_refused_before_the_other_one_changes(path):
    """vc given as an expanded tensor, which eager refuses to write: vtc's write-back copy raised eager's
    RuntimeError once the kernels had stored kc's new rows and kc had been written back, so kc had changed.
    Now the test before the kernels raises, naming the input, and kc is as it was (mutation_guard)."""
    g = _g(22)
    kc, vc, new, pos = rand((2, 3, 10, 4), g), rand((2, 3, 10, 4), g), rand((2, 3, 1, 4), g), torch.tensor([4])
    call = _caches_call(path, kc, vc, new, pos)
    t, expanded = kc.clone(), vc[:1].expand(2, 3, 10, 4)
    with pytest.raises(RuntimeError, match=r"input 1 \(%vc\) is changed in place by the model, but more than one "
                                           r"of its elements refers to a single memory location"):
        call(t, expanded)
    assert torch.equal(t, kc), "a refused call changed its input"
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        _update_two_caches(kc.clone(), expanded, new, pos)  # eager's refusal
    a, b = kc.clone(), vc.clone().transpose(0, 2).contiguous().transpose(0, 2)  # strided, no overlap: runs
    want_a, want_b = kc.clone(), vc.clone()
    close(call(a, b), _update_two_caches(want_a, want_b, new, pos), torch.float32)
    close((a, b), (want_a, want_b), torch.float32, "the caches changed in place")


def test_torch_compile_updates_one_tensor_given_as_both_caches_as_eager_does():
    """torch.compile(backend="vtc") does not take this path: aot_autograd sees the aliased inputs and hands vtc a
    graph without input mutations, copying the result back itself."""
    g = _g(21)
    kc, new, pos = rand((2, 3, 10, 4), g), rand((2, 3, 1, 4), g), torch.tensor([4])
    fn = torch.compile(_update_two_caches, backend="vtc")
    t, u = kc.clone(), kc.clone()
    close(fn(t, t, new, pos), _update_two_caches(u, u, new, pos), torch.float32)
    close(t, u, torch.float32, "the cache changed in place")


def test_an_input_read_twice_without_changes_may_be_the_same_tensor():
    x = rand((5, 7), _g(2))

    def fn(a, b):
        return a @ b.t() + a.sum() - torch.softmax(b, 0).sum(-1)

    compiled = vtc.compile(fn, (x, x.clone()))
    close(compiled(x, x), fn(x, x), torch.float32)
    y = rand((7, 7), _g(3))
    close(compiled(y[:5], y[2:]), fn(y[:5], y[2:]), torch.float32)  # overlapping views, read only


def test_inputs_that_are_expanded_offset_or_transposed_views():
    g = _g(4)

    def fn(a):
        return a.t() @ a + torch.softmax(a, -1).sum(0)

    compiled = vtc.compile(fn, (rand((4, 6), g),))
    storage = rand((100,), g)
    for a in [rand((1, 6), g).expand(4, 6), storage[3:27].view(4, 6), storage[50:74].view(6, 4).t(),
              rand((4, 12), g)[:, ::2], rand((4, 6), g)]:
        close(compiled(a), fn(a), torch.float32, f"strides {a.stride()} offset {a.storage_offset()}")


def test_outputs_that_are_views_of_an_input_own_their_memory():
    x = rand((4, 6), _g(5))

    def fn(a):
        return a.t(), a[1], a.reshape(24), a

    compiled = vtc.compile(fn, (x,))
    a = x.clone()
    outs = compiled(a)
    for got, want in zip(outs, fn(x)):
        close(got, want, torch.float32)
    ptrs = {o.untyped_storage().data_ptr() for o in outs}
    assert len(ptrs) == 4 and a.untyped_storage().data_ptr() not in ptrs
    a.add_(1)  # changing the input after the call leaves the outputs as they were
    close(outs[0], x.t(), torch.float32)


def test_in_place_ops_on_an_intermediate_and_through_a_view_of_an_input():
    g = _g(6)

    def fn(a):
        b = a * 2
        b.add_(1)
        b[:, 1] = 0.5
        b.relu_()
        v = a[:, 1:3]
        v.mul_(2)  # changes the caller's a
        return b.t() @ a, a.sum(0)

    x = rand((4, 6), g)
    compiled = vtc.compile(fn, (x.clone(),))
    a, b = x.clone(), x.clone()
    want = fn(a)
    got = compiled(b)
    for gv, wv in zip(got, want):
        close(gv, wv, torch.float32)
    close(b, a, torch.float32, "the input changed in place")


def test_a_kv_cache_changed_in_place_at_positions_given_per_call():
    g = _g(7)

    def fn(cache, new, pos):
        cache.index_copy_(2, pos, new)
        return torch.softmax(new @ cache.transpose(2, 3), -1) @ cache

    cache, new = rand((2, 3, 10, 4), g), rand((2, 3, 1, 4), g)
    compiled = vtc.compile(fn, (cache.clone(), new, torch.tensor([4])))
    for p in (4, 9, 0):
        c1, c2 = cache.clone(), cache.clone()
        want = fn(c1, new, torch.tensor([p]))
        close(compiled(c2, new, torch.tensor([p])), want, torch.float32, f"position {p}")
        close(c2, c1, torch.float32, f"the cache after position {p}")


def test_new_sizes_from_three_python_threads_at_once():
    """Every thread calls with sizes no call has used yet: specializations made concurrently."""
    def fn(a):
        return F.layer_norm(a.t() @ a, (a.shape[1],)).roll(1, 0)

    compiled = vtc.compile(fn, (rand((4, 6), _g(8)),))

    def work(k: int) -> None:
        for j in range(2):
            a = rand((3 + k + j, 5 + (k * j) % 4), _g(10 * k + j))
            close(compiled(a), fn(a), torch.float32, f"thread {k}, shape {list(a.shape)}")

    with torch_threads(2):
        assert errors_in_threads(work, 3) == []


def test_torch_compile_from_three_python_threads_at_once():
    def fn(a, b):
        return torch.cat([a.flip(0), b], 0).softmax(-1) @ b.t()

    compiled = torch.compile(fn, backend="vtc")

    def work(k: int) -> None:
        a, b = rand((2 + k, 6), _g(50 + k)), rand((3 + k, 6), _g(60 + k))
        for _ in range(2):
            close(compiled(a, b), fn(a, b), torch.float32, f"thread {k}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert errors_in_threads(work, 3) == []


def test_bad_calls_name_the_bad_value():
    x = rand((4, 6), _g(9))
    compiled = vtc.compile(torch.nn.Linear(6, 3), (x,))
    with pytest.raises(TypeError, match=r"input 0 .*expected dtype torch.float32, received torch.float64"):
        compiled(x.double())
    with pytest.raises(ValueError, match=r"expected rank 2 .*received rank 1"):
        compiled(x[0])
    with pytest.raises(vtc.InputShapeError, match=r"dim 1 is 7, expected 6"):
        compiled(rand((4, 7), _g(10)))
