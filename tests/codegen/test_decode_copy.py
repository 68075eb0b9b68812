"""Copy-while-reading (vtc.codegen.decode_copy): a decode attention kernel copies the input KV caches into the
updated caches as it reads them, in place of one copy kernel per cache.

Every case compares all outputs (the hidden state and both updated caches) with eager on random inputs, checks
that the cache rows the update does not touch are the input's bits, and asserts what is optimised: no copy
kernel of kind "push", the attention kernel copies both caches (and the report still counts those bytes as
movement).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.workloads import gemma2, llama3
from vtc.codegen import decode_copy

from .util import compile_cpu, executor, kernels, report

TOL = dict(rtol=1e-4, atol=2e-5)


def push_kernels(compiled) -> list:
    return [k for k in kernels(compiled) if k.kind == "push"]


def attention_kernel(compiled):
    (k,) = [k for k in kernels(compiled) if k.kind == "attention"]
    return k


def call(compiled, model, inputs, threads: int = 1):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            return compiled(*inputs), model(*inputs)
    finally:
        torch.set_num_threads(saved)


def check_layer(model, inputs, positions, threads: int = 1):
    """Compiled vs eager on every output; the untouched cache rows are the input's, exactly; the copies are
    made by the attention kernel. Returns the compiled model."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled = compile_cpu(model, inputs)
    finally:
        torch.set_num_threads(saved)
    got, want = call(compiled, model, inputs, threads)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    keep = torch.ones(inputs[1].shape[2], dtype=torch.bool)
    keep[positions] = False
    for g, old in zip(got[1:], inputs[1:3]):
        assert torch.equal(g[:, :, keep], old[:, :, keep])
        assert not torch.equal(g[:, :, ~keep], old[:, :, ~keep])  # the new token landed
    assert push_kernels(compiled) == [], [k.name for k in push_kernels(compiled)]
    k = attention_kernel(compiled)
    assert sorted(c.base.name for c in k.copy_through) == ["k_cache", "v_cache"]
    cache_bytes = inputs[1].numel() * 4
    assert report(compiled)["materialized_movement_bytes"] == 2 * cache_bytes  # still moved, by attention
    return compiled


@pytest.mark.parametrize("batch,cache,position", [(1, 1, 0), (16, 17, 16), (1, 127, 60), (16, 1000, 999),
                                                  (1, 1000, 3)])
def test_llama3_decode_copies_the_caches_while_reading(batch, cache, position):
    """Cache lengths 1 to 1000 (one key block to several; the new token first, in the middle and last)."""
    torch.manual_seed(batch + cache)
    m = llama3.Llama3Layer(hidden=128, heads=4, kv_heads=2, inter=128).eval()
    inputs = llama3.layer_inputs(batch, 1, cache, 128, 2, 32, start=position)
    compiled = check_layer(m, inputs, [position])
    why = {e["op"]: e["why"] for e in report(compiled)["movement"] if "index_put" in e["op"]}
    assert all(f"base copy: by {attention_kernel(compiled).name}" in w for w in why.values()), why


@pytest.mark.parametrize("threads", [1, 2])
def test_keys_split_across_threads_and_hidden_blocks_are_still_copied(threads):
    """Gemma-2 local decode: a sliding window hides most key blocks (skipped by the attention, copied all the
    same); batch 1 at 2 threads splits each group's keys across tasks (each copies its share)."""
    torch.manual_seed(threads)
    m = gemma2.Gemma2Layer(hidden=128, heads=4, kv_heads=2, head_dim=32, inter=128, window=40).eval()
    inputs = llama3.layer_inputs(1, 1, 1500, 128, 2, 32, start=1100)
    check_layer(m, inputs, [1100], threads)


def test_a_second_reader_of_the_cache_keeps_the_copy_kernel():
    """The updated cache is read by another kernel too (its sum): the base is copied by its own kernel, the
    reason recorded; results as eager."""
    def fn(q, k_cache, v_cache, k, v, pos):
        kc, vc = k_cache.index_copy(2, pos, k), v_cache.index_copy(2, pos, v)
        out = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
        return out, kc, vc, kc.sum(-1)

    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    inputs = (r(1, 4, 1, 32), r(1, 2, 127, 32), r(1, 2, 127, 32), r(1, 2, 1, 32), r(1, 2, 1, 32), torch.tensor([7]))
    compiled = compile_cpu(fn, inputs)
    got = compiled(*inputs)
    for a, b in zip(got, fn(*inputs)):
        torch.testing.assert_close(a, b, **TOL)
    low = executor(compiled).lowering
    through = low.push.copy_through
    assert any("its own kernel" in w for w in through.values()), through
    assert len(push_kernels(compiled)) >= 1


def test_attention_over_a_slice_of_the_cache_keeps_the_copy_kernel():
    """Attention reads the first 40 rows of a 127-row cache (a cache cut to the current length): the rows
    after them must still be copied, so the base keeps its own copy kernel."""
    def fn(q, k_cache, v_cache, k, v, pos):
        kc, vc = k_cache.index_copy(2, pos, k), v_cache.index_copy(2, pos, v)
        return F.scaled_dot_product_attention(q, kc[:, :, :40], vc[:, :, :40], enable_gqa=True), kc, vc

    g = torch.Generator().manual_seed(6)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    inputs = (r(1, 4, 1, 32), r(1, 2, 127, 32), r(1, 2, 127, 32), r(1, 2, 1, 32), r(1, 2, 1, 32), torch.tensor([39]))
    compiled = compile_cpu(fn, inputs)
    for a, b in zip(compiled(*inputs), fn(*inputs)):
        torch.testing.assert_close(a, b, **TOL)
    assert all(not k.copy_through for k in kernels(compiled) if k.kind == "attention")
    bases = sorted(b.name for k in push_kernels(compiled) for b in k.inputs if b.name.endswith("_cache"))
    assert bases == ["k_cache", "v_cache"]  # each base copied by its own kernel


def test_switched_off_keeps_the_copy_kernels(monkeypatch):
    monkeypatch.setattr(decode_copy, "ENABLED", False)
    torch.manual_seed(3)
    m = llama3.Llama3Layer(hidden=128, heads=4, kv_heads=2, inter=128).eval()
    inputs = llama3.layer_inputs(16, 1, 17, 128, 2, 32, start=16)
    compiled = compile_cpu(m, inputs)
    got, want = call(compiled, m, inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    assert len(push_kernels(compiled)) == 2 and attention_kernel(compiled).copy_through == []
