"""A generated GEMM storing through push mappings (vtc.codegen.gemm_push): no push copy after a GEMM.

Each case is compared with eager on random inputs (odd sizes, batch 1 and 16) and asserts what is
optimised: the cat / scatter is "pushed", the GEMM kernel stores into it (``report["gemm"][..]
["stores_into"]``), no copy or push kernel writes what the GEMM computes, and the kernel count.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.codegen.util import ROW_TOL, check, compile_cpu, executor, gen, kernels, rand, report

TOL = dict(rtol=1e-4, atol=2e-4)


def fates(compiled) -> dict[str, str]:
    """The movement ops that are not read through a mapping or a zero-copy view: pushed, gathered, kept."""
    return {e["node"]: e["fate"] for e in report(compiled)["movement"] if e["fate"] not in ("virtual", "view")}


def kinds(compiled) -> list[str]:
    return [k.kind for k in kernels(compiled)]


def stores_into(compiled) -> list[list[str]]:
    return [g["stores_into"] for g in report(compiled)["gemm"]]


class FusedQKV(nn.Module):
    """One projection for Q, K and V (x @ W_qkv^T, split), K and V heads-first index_copy'd into the caches."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.h, self.hk, self.hd = heads, kv_heads, head_dim
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)

    def forward(self, x, k_cache, v_cache, pos):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.hd, self.hk * self.hd, self.hk * self.hd], dim=-1)
        q = q.view(b, t, self.h, self.hd).transpose(1, 2)
        k = k.view(b, t, self.hk, self.hd).transpose(1, 2)
        v = v.view(b, t, self.hk, self.hd).transpose(1, 2)
        k_cache = k_cache.index_copy(2, pos, k)
        v_cache = v_cache.index_copy(2, pos, v)
        return torch.softmax(q @ k_cache.transpose(2, 3), -1) @ v_cache, k_cache, v_cache


def qkv_case(batch: int, t: int, pos: list[int], cache: int = 17, seed: int = 0):
    torch.manual_seed(seed)
    model = FusedQKV(dim=33, heads=3, kv_heads=1, head_dim=17).eval()
    g = gen(seed)
    inputs = (rand((batch, t, 33), g), rand((batch, 1, cache, 17), g), rand((batch, 1, cache, 17), g),
              torch.tensor(pos))
    return model, inputs


@pytest.mark.parametrize("batch,t,pos", [(1, 1, [16]), (16, 3, [1, 2, 0])])
def test_fused_qkv_writes_k_and_v_into_the_caches(batch, t, pos):
    """The GEMM stores the K and V columns of each token straight into the caches (through split, view,
    transpose and index_copy's positions); the only bytes moved are the input caches, copied once (torch's
    index_copy is out of place); attention reads the updated caches plainly."""
    model, inputs = qkv_case(batch, t, pos, seed=batch + t)
    with torch.no_grad():
        compiled = check(model, inputs, gemm="vtc", **TOL)
    assert set(fates(compiled).values()) == {"pushed"} and len(fates(compiled)) == 2, compiled.report
    cache_bytes = inputs[1].numel() * 4
    assert report(compiled)["materialized_movement_bytes"] == 2 * cache_bytes, compiled.report
    assert stores_into(compiled)[0] == sorted(fates(compiled)), report(compiled)["gemm"]
    push = executor(compiled).lowering.push
    assert sorted(push.by_gemm.values()) == [report(compiled)["gemm"][0]["node"]] * 2
    assert push.why_copied == {}
    # the two cache copies (base first), the QKV GEMM, then attention: no copy kernel, no K/V copy
    copies = [k for k in kernels(compiled) if k.kind == "push"]
    assert kinds(compiled)[:3] == ["push", "push", "gemm"] and "copy" not in kinds(compiled)
    assert {b.name for k in copies for b in k.inputs} == {v.name for v in compiled.graph.inputs[1:3]}


def test_fused_qkv_out_of_range_position_raises():
    model, inputs = qkv_case(1, 1, [16])
    compiled = compile_cpu(model, inputs, gemm="vtc")
    bad = list(inputs)
    bad[3] = torch.tensor([17])
    with pytest.raises(IndexError, match=r"index_(copy|put): index 17 is out of range"):
        compiled(*bad)
    bad[3] = torch.tensor([-18])
    with pytest.raises(IndexError, match=r"index -18 is out of range"):
        compiled(*bad)
    with torch.no_grad():
        for got, want in zip(compiled(*inputs), model(*inputs)):  # still fine after
            torch.testing.assert_close(got, want, **TOL)


def split_into_stacked_kv(x, w):
    """x @ w split into q, k and v; relu(q), and k and v heads-first stacked into one [2, B, 1, T, 17] buffer."""
    b, t, _ = x.shape
    q, k, v = (x @ w).split([51, 17, 17], dim=-1)
    k = k.view(b, t, 1, 17).transpose(1, 2)
    v = v.view(b, t, 1, 17).transpose(1, 2)
    return torch.relu(q), torch.stack((k, v))


@pytest.mark.parametrize("batch", [3])
def test_split_into_one_stacked_kv_buffer(batch):
    """K and V, two parts of one GEMM result, stacked into one [2, B, H, T, D] buffer: both stored by the
    GEMM, nothing moved at all."""
    g = gen(batch)
    compiled = check(split_into_stacked_kv, (rand((batch, 3, 33), g), rand((33, 85), g)), gemm="vtc", **TOL)
    assert fates(compiled) == {"cat": "pushed"} and report(compiled)["materialized_movement_bytes"] == 0
    assert kinds(compiled) == ["gemm", "pointwise"] and stores_into(compiled) == [["cat"]]


def test_cat_with_the_past_cache():
    """present = cat(past, k_new) along the sequence: the past (an input) is copied in, the new keys are
    stored by the GEMM."""
    def fn(x, w, past):
        k = (x @ w).view(x.shape[0], x.shape[1], 3, 17).transpose(1, 2)
        return torch.cat((past, k), dim=2)

    g = gen(3)
    past = rand((16, 3, 127, 17), g)
    compiled = check(fn, (rand((16, 1, 33), g), rand((33, 51), g), past), gemm="vtc", **TOL)
    assert fates(compiled) == {"cat": "pushed"}
    assert report(compiled)["materialized_movement_bytes"] == past.numel() * 4
    assert kinds(compiled) == ["gemm", "push"]


# -- GEMM -> cat / slice_scatter, accumulated in place ----------------------------------------------
@pytest.mark.parametrize("dim,m", [(0, 1), (1, 127)])
def test_gemms_accumulate_into_a_returned_cat(dim, m):
    """cat(a @ w1, a @ w2): each GEMM accumulates straight into its block of the cat (row stride the cat's
    width); neither product exists on its own."""
    g = gen(dim + m)
    a, w1, w2 = rand((m, 33), g), rand((33, 5), g), rand((33, 5 if dim == 0 else 7), g)
    compiled = check(lambda a, w1, w2: torch.cat((a @ w1, a @ w2), dim=dim), (a, w1, w2), gemm="vtc", **TOL)
    assert fates(compiled) == {"cat": "pushed"} and report(compiled)["materialized_movement_bytes"] == 0
    assert kinds(compiled) == ["gemm", "gemm"] and stores_into(compiled) == [["cat"], ["cat"]]
    layouts = [k.gemm.out_layout for k in kernels(compiled)]
    assert [ldc for _, ldc in layouts] == ([5, 5] if dim == 0 else [12, 12])
    assert [off.value for off, _ in layouts] == ([0, m * 5] if dim == 0 else [0, 5])
    assert executor(compiled).peak_bytes == compiled.graph.outputs[0].nbytes  # nothing but the cat is allocated


def test_the_writes_into_cats_are_followed_once_per_lowering(monkeypatch):
    """Which GEMM results a pushed cat takes is found by one walk over the writes per lowering, not one per
    GEMM (a decode loop lowers again at every new length): 4 GEMMs into one cat, 4 writes, 4 ``forward``
    calls per lowering (16 before), and each GEMM still stores into the cat."""
    from vtc.codegen import gemm_push

    calls, real = [], gemm_push.forward

    def counted(low, value):  # the calls made to price the GEMMs' pushed bytes (the stores call it too)
        if sys._getframe(1).f_code.co_name in ("pushed_bytes", "_pushed_bytes_by_root"):
            calls.append((id(low), value))
        return real(low, value)

    monkeypatch.setattr(gemm_push, "forward", counted)
    g = gen(5)
    a, *ws = rand((9, 33), g), *(rand((33, 5), g) for _ in range(4))
    compiled = check(lambda a, w1, w2, w3, w4: torch.cat([a @ w for w in (w1, w2, w3, w4)], dim=1),
                     (a, *ws), gemm="vtc", **TOL)
    assert stores_into(compiled) == [["cat"]] * 4
    per_lowering = {}
    for low, value in calls:
        per_lowering.setdefault(low, []).append(value)
    assert per_lowering and all(len(v) == 4 for v in per_lowering.values()), per_lowering


def test_gemms_into_slice_scatters():
    """slice_scatter(x, a @ w) along rows and along columns: each base (an input) is copied once, each
    product accumulated in its block."""
    def fn(x0, x1, a, w):
        return (torch.slice_scatter(x0, a @ w, dim=0, start=3, end=20),
                torch.slice_scatter(x1, torch.relu(a @ w.flip(1)), dim=1, start=3, end=10))

    g = gen(20)
    a, w, x0, x1 = rand((17, 33), g), rand((33, 7), g), rand((30, 7), g), rand((17, 20), g)
    compiled = check(fn, (x0, x1, a, w), gemm="vtc", **TOL)
    assert fates(compiled) == {"slice_scatter": "pushed", "slice_scatter_1": "pushed"}
    assert report(compiled)["materialized_movement_bytes"] == (x0.numel() + x1.numel()) * 4  # the bases
    gemms = [k for k in kernels(compiled) if k.kind == "gemm"]
    assert len(kernels(compiled)) == 4 and all(k.gemm.out_layout is not None for k in gemms)


@pytest.mark.parametrize("batch", [16])
def test_bmm_and_conv_into_cats(batch):
    """A batched GEMM and a convolution (an implicit GEMM) write their blocks of a cat per batch."""
    def fn(a, b, c, x, w, y):
        return torch.cat((torch.bmm(a, b), c), dim=2), torch.cat((F.conv2d(x, w, padding=1), y), dim=1)

    g = gen(batch + 30)
    inputs = (rand((batch, 17, 9), g), rand((batch, 9, 5), g), rand((batch, 17, 3), g),
              rand((batch, 3, 7, 9), g), rand((5, 3, 3, 3), g), rand((batch, 4, 7, 9), g))
    compiled = check(fn, inputs, gemm="vtc", **TOL)
    assert set(fates(compiled).values()) == {"pushed"}
    moved = (inputs[2].numel() + inputs[5].numel()) * 4  # the two inputs copied into their cats
    assert report(compiled)["materialized_movement_bytes"] == moved
    assert [k.gemm.out_layout is not None for k in kernels(compiled) if k.kind == "gemm"] == [True, True]


def test_unbind_of_a_gemm_into_two_cats():
    """A GEMM result unbound into three parts: two go to different returned cats (each stored by the GEMM,
    predicated on its part), the third is read by a kernel."""
    def fn(x, w, y1, y2):
        a, b, c = (x @ w).view(x.shape[0], 3, 17).unbind(1)
        return torch.cat((a, torch.relu(y1)), dim=1), torch.cat((torch.sigmoid(y2), b), dim=0), torch.exp(c)

    g = gen(40)
    inputs = (rand((5, 33), g), rand((33, 51), g), rand((5, 3), g), rand((2, 17), g))
    compiled = check(fn, inputs, gemm="vtc", **TOL)
    assert fates(compiled) == {"cat": "pushed", "cat_1": "pushed"}
    assert report(compiled)["materialized_movement_bytes"] == 0
    (k,) = [k for k in kernels(compiled) if k.kind == "gemm"]
    assert [st.when is not None for st in k.stores] == [False, True, True]  # the product, then its two parts
    assert "push" not in kinds(compiled) and len(kernels(compiled)) == 4


# -- what stays a copy, with the reason -----------------------------------------------------------
def test_flip_between_gemm_and_cat_is_copied_with_the_reason():
    """flip has no push form: the flipped product is copied into the cat, the reason is in the report."""
    def fn(a, w, b):
        return torch.cat((torch.flip(a @ w, [0]), torch.relu(b)), dim=1)

    g = gen(50)
    compiled = check(fn, (rand((17, 33), g), rand((33, 5), g), rand((17, 3), g)), gemm="vtc", **TOL)
    assert fates(compiled) == {"cat": "pushed"}
    assert report(compiled)["materialized_movement_bytes"] == 17 * 5 * 4
    why = executor(compiled).lowering.push.why_copied
    assert len(why) == 1 and "flip" in next(iter(why.values()))
    assert "not stored by the GEMM computing it" in str(compiled.report)


def test_positions_computed_after_the_gemm_are_copied_with_the_reason():
    """The cache positions are computed after the projection: the GEMM cannot store through them."""
    def fn(x, w, cache, pos):
        k = (x @ w).view(x.shape[0], 1, 3, 17).transpose(1, 2)
        return cache.index_copy(2, pos * 2, k)

    g = gen(60)
    inputs = (rand((3, 33), g), rand((33, 51), g), rand((3, 3, 17, 17), g), torch.tensor([4]))
    compiled = check(fn, inputs, gemm="vtc", **ROW_TOL)
    why = executor(compiled).lowering.push.why_copied
    assert len(why) == 1 and "is computed after the GEMM" in next(iter(why.values()))
    assert kinds(compiled) == ["gemm", "pointwise", "push", "push"]  # positions; cache, then the keys


def test_greedy_plan_of_a_fused_qkv_decode_matches_eager():
    """The default planner decides push or pull itself; the result is right either way."""
    model, inputs = qkv_case(16, 1, [5], cache=127)
    with torch.no_grad():
        check(model, inputs, plan="greedy", **TOL)
