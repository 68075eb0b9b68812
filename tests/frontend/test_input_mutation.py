"""Inputs that forward changes in place: a StaticCache's ``index_copy_``, an ``add_`` on an input.

The capture turns each in-place change of a user input into one more graph output
(``graph.meta["input_mutations"]``); the compiled call copies it into the tensor
the caller passed, and returns that tensor where forward returns it, as eager
does.  Before, every such model was refused ("mutates state, which vtc does not
support"), HF's StaticCache included.  Changes to the model's own parameters or
buffers are still refused (tests/frontend/test_fx_capture.py).
"""
from __future__ import annotations

import copy

import pytest
import torch

import vtc

TOL = dict(rtol=1e-4, atol=1e-5)


def _scatter_then_read(cache, pos, k):
    cache.index_copy_(1, pos, k * 2)  # a StaticCache update of a token's keys computed by a kernel
    return cache.sum(1) * 2


def _returns_the_input(x, y):
    x.mul_(y)
    return x, x + 1


def _random(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_index_copy_into_an_input_is_written_back():
    cache, k = _random(2, 9, 5, seed=0), _random(2, 2, 5, seed=1)
    compiled = vtc.compile(_scatter_then_read, (cache.clone(), torch.tensor([3, 7]), k))
    assert compiled.graph.meta["input_mutations"] == ((0, 1),)
    for step, pos in enumerate(([3, 7], [0, 8], [5, 1])):
        k = _random(2, 2, 5, seed=10 + step)
        mine, theirs = cache.clone(), cache.clone()
        got = compiled(mine, torch.tensor(pos), k)
        want = _scatter_then_read(theirs, torch.tensor(pos), k)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)  # the rows written, the others untouched
        assert not torch.equal(mine, cache)


def test_the_scatter_stores_into_the_callers_tensor():
    """The input is read by the scatter only: its updates are stored into the caller's tensor (an alias step
    in place of the base copy) and the write-back copies nothing.  Before: the whole cache was copied into a new
    buffer, then copied back."""
    cache, k = _random(2, 64, 8, seed=5), _random(2, 1, 8, seed=6)
    compiled = vtc.compile(_scatter_then_read, (cache.clone(), torch.tensor([3]), k))
    steps = compiled._first.executor.steps
    assert [s.kind for s in steps].count("alias") == 1
    assert compiled.report.to_dict()["materialized_movement_bytes"] == 0
    mine = cache.clone()
    copies = []
    real = torch.Tensor.copy_
    try:
        torch.Tensor.copy_ = lambda self, src, *a, **kw: copies.append(self.shape) or real(self, src, *a, **kw)
        got = compiled(mine, torch.tensor([9]), k)
    finally:
        torch.Tensor.copy_ = real
    assert copies == []  # nothing written back: the kernel stored into `mine`
    theirs = cache.clone()
    torch.testing.assert_close(got, _scatter_then_read(theirs, torch.tensor([9]), k), **TOL)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_an_input_read_elsewhere_too_is_copied_then_written_back():
    """The input is read after the scatter as well (the old rows): the scatter writes a new buffer, as before,
    and the call copies it back; the read sees the old values, as eager's clone does."""
    def f(cache, pos, k):
        old = cache.clone()
        cache.index_copy_(1, pos, k)
        return cache.sum(1) - old.sum(1)

    cache, k = _random(2, 16, 8, seed=7), _random(2, 1, 8, seed=8)
    compiled = vtc.compile(f, (cache.clone(), torch.tensor([3]), k))
    assert "alias" not in [s.kind for s in compiled._first.executor.steps]
    mine, theirs = cache.clone(), cache.clone()
    torch.testing.assert_close(compiled(mine, torch.tensor([5]), k), f(theirs, torch.tensor([5]), k), **TOL)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_a_non_contiguous_input_changed_in_place():
    """The caller's tensor is a transposed view: the kernels write a contiguous copy; the call copies it back
    into the view."""
    cache, k = _random(2, 8, 16, seed=9), _random(2, 1, 8, seed=10)
    compiled = vtc.compile(_scatter_then_read, (cache.transpose(1, 2).contiguous(), torch.tensor([3]), k))
    mine, theirs = cache.clone().transpose(1, 2), cache.clone().transpose(1, 2)
    assert not mine.is_contiguous()
    got = compiled(mine, torch.tensor([6]), k)
    torch.testing.assert_close(got, _scatter_then_read(theirs, torch.tensor([6]), k), **TOL)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_an_output_that_is_the_changed_input_is_that_tensor():
    x, y = _random(3, 4, seed=2), _random(3, 4, seed=3)
    compiled = vtc.compile(_returns_the_input, (x.clone(), y))
    mine, theirs = x.clone(), x.clone()
    got = compiled(mine, y)
    want = _returns_the_input(theirs, y)
    assert got[0] is mine  # eager returns the tensor it changed
    torch.testing.assert_close(mine, theirs, **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    again = compiled(mine, y)  # the next call reads the value written back
    torch.testing.assert_close(again[1], theirs * y + 1, **TOL)


def test_a_changed_parameter_is_still_refused():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3), requires_grad=False)

        def forward(self, x):
            self.w.add_(1)
            return x * self.w

    with pytest.raises(Exception, match="mutat|state"):
        vtc.compile(Counter(), (torch.randn(3),))


def test_hf_llama_decodes_with_a_static_cache():
    """transformers' StaticCache (what HF recommends for compiled decoding) updates its tensors in place with
    index_copy_: the compiled steps leave the cache exactly as eager's steps do, and give eager's logits."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(4))
    want_cache = tf.StaticCache(config=cfg, max_cache_len=16)
    with torch.no_grad():
        want = model(ids, cache=want_cache, cache_position=torch.arange(5))
    got_cache = copy.deepcopy(want_cache)
    tensors = [t for layer in got_cache.layers for t in (layer.keys, layer.values)]
    tok = want.logits[:, -1:].argmax(-1)
    step = vtc.compile(model, (tok,), {"cache": copy.deepcopy(got_cache), "cache_position": torch.tensor([5])})
    report = step.report.to_dict()
    # SDPA's decomposition scales the GQA-expanded keys (repeat_kv's clone): the scale is recomputed where the
    # attention kernel reads K, so the clone stays virtual (before: kept, a copy of every layer's keys per step)
    assert [e["node"] for e in report["movement"] if e["fate"] in ("kept", "gather")] == []
    assert report["materialized_movement_bytes"] <= 2 * cfg.num_hidden_layers * (2 * 2 * 16 * 4)  # new K/V rows
    for pos in range(5, 9):
        with torch.no_grad():
            want = model(tok, cache=want_cache, cache_position=torch.tensor([pos]))
        got = step(tok, cache=got_cache, cache_position=torch.tensor([pos]))
        torch.testing.assert_close(got.logits, want.logits, **TOL)
        for g, w in zip(got_cache.layers, want_cache.layers):
            torch.testing.assert_close(g.keys, w.keys, **TOL)
            torch.testing.assert_close(g.values, w.values, **TOL)
        tok = want.logits[:, -1:].argmax(-1)
    shape = tuple(tensors[0].shape)  # one more step: no copy of a cache tensor, the updates land in place
    copied, real = [], (torch.Tensor.copy_, torch.Tensor.clone)
    try:
        torch.Tensor.copy_ = lambda t, *a, **k: copied.append(tuple(t.shape)) or real[0](t, *a, **k)
        torch.Tensor.clone = lambda t, *a, **k: copied.append(tuple(t.shape)) or real[1](t, *a, **k)
        step(tok, cache=got_cache, cache_position=torch.tensor([9]))
    finally:
        torch.Tensor.copy_, torch.Tensor.clone = real
    assert shape not in copied, copied
    after = [t for layer in got_cache.layers for t in (layer.keys, layer.values)]
    assert len(after) == len(tensors) and all(a is b for a, b in zip(after, tensors))  # the same tensors, as eager


# -- the same through torch.export (the path a model takes when the fast capture refuses it for another reason)

@pytest.fixture
def export_path(monkeypatch):
    """Every capture through torch.export (vtc.frontend.core_export): the fast capture refuses."""
    from vtc.frontend import torch_export

    monkeypatch.setattr(torch_export, "_fast_capture", lambda model, args, kwargs: (None, "refused by the test"))


def test_export_path_writes_back_an_index_copy(export_path):
    """Before session 15 torch.export's path raised "mutates state ... USER_INPUT_MUTATION of cache"."""
    cache, k = _random(2, 9, 5, seed=20), _random(2, 2, 5, seed=21)
    compiled = vtc.compile(_scatter_then_read, (cache.clone(), torch.tensor([3, 7]), k))
    assert "torch.export" in compiled.graph.meta["capture"]
    assert compiled.graph.meta["input_mutations"] == ((0, 1),)
    for step, pos in enumerate(([3, 7], [0, 8], [5, 1])):
        k = _random(2, 2, 5, seed=30 + step)
        mine, theirs = cache.clone(), cache.clone()
        got = compiled(mine, torch.tensor(pos), k)
        torch.testing.assert_close(got, _scatter_then_read(theirs, torch.tensor(pos), k), **TOL)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def _two_inputs_changed(a, b, c):
    b.add_(c)  # changed in place: b, then a (torch.export lists them in input order)
    a.mul_(2)
    return {"n": 3, "s": (a * b).sum(0), "flag": True, "a": a, "t": c - 1}


def test_export_path_two_inputs_and_non_tensor_outputs(export_path):
    a, b, c = _random(4, 6, seed=24), _random(4, 6, seed=25), _random(4, 6, seed=26)
    compiled = vtc.compile(_two_inputs_changed, (a.clone(), b.clone(), c))
    assert "torch.export" in compiled.graph.meta["capture"]
    assert sorted(k for k, _ in compiled.graph.meta["input_mutations"]) == [0, 1]
    mine, theirs = (a.clone(), b.clone()), (a.clone(), b.clone())
    got = compiled(*mine, c)
    want = _two_inputs_changed(*theirs, c)
    assert got.keys() == want.keys() and got["n"] == 3 and got["flag"] is True
    assert got["a"] is mine[0]  # eager returns the tensor it changed
    for key in ("s", "t"):
        torch.testing.assert_close(got[key], want[key], **TOL)
    for m, t in zip(mine, theirs):
        torch.testing.assert_close(m, t, **TOL)


def test_export_path_still_refuses_a_changed_buffer(export_path):
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros(3))

        def forward(self, x):
            self.n.add_(1)
            return x * self.n

    with pytest.raises(vtc.CaptureError, match="BUFFER_MUTATION"):
        vtc.compile(Counter(), (torch.randn(3),))
