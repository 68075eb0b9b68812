"""The attention kernel storing its output through a push mapping (vtc.codegen.push, COPY_OPS).

``attn.transpose(1, 2).reshape(B, S, H * D)`` in front of the o-projection is a
clone of a non-strided virtual tensor ([B*H, S, D] -> [B, S, H, D]).  Where the
planner keeps that clone (a library GEMM, MKL's packed one, reads its result)
it is pushed instead: the attention kernel stores its rows straight into the
clone's layout, so no copy kernel runs and the o-projection reads a contiguous
operand.  Every case is compared with eager on random inputs and asserts that
nothing was materialised.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import vtc

from .util import executor, kernels, report, steps

TOL = dict(rtol=1e-4, atol=2e-5)


class AttentionThenProjection(nn.Module):
    """GQA attention (repeat_kv by expand + reshape), heads merged back by transpose + reshape, o-projection."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, out: int = 256):
        super().__init__()
        self.kv_heads = kv_heads
        self.o_proj = nn.Linear(heads * head_dim, out, bias=False)

    def attend(self, q, k, v):
        b, h, s, d = q.shape
        r, t = h // self.kv_heads, k.shape[2]
        k = k[:, :, None].expand(b, self.kv_heads, r, t, d).reshape(b, h, t, d)
        v = v[:, :, None].expand(b, self.kv_heads, r, t, d).reshape(b, h, t, d)
        p = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * d ** -0.5, -1)
        return torch.matmul(p, v)

    def forward(self, q, k, v):
        b, h, s, d = q.shape
        return self.o_proj(self.attend(q, k, v).transpose(1, 2).reshape(b, s, h * d))


class AlsoReturningTheHeads(AttentionThenProjection):
    """The same, with the attention output [B, H, S, D] returned too: the kernel's own store must stay."""

    def forward(self, q, k, v):
        b, h, s, d = q.shape
        a = self.attend(q, k, v)
        return self.o_proj(a.transpose(1, 2).reshape(b, s, h * d)), a


def _inputs(b, s, t, h, kv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, s, d, generator=g), torch.randn(b, kv, t, d, generator=g),
            torch.randn(b, kv, t, d, generator=g))


def _clone_fates(compiled) -> dict[str, tuple[str, str]]:
    return {e["node"]: (e["fate"], e["why"]) for e in report(compiled)["movement"] if e["op"] == "aten.clone.default"}


def _compile(m, inputs, **options):
    compiled = vtc.compile(m, inputs, **options)
    with torch.no_grad():
        want = m(*inputs)
    got = compiled(*inputs)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, **TOL)
    return compiled


# (batch, queries S, keys T, heads, KV heads, head dim, the clone pushed): where the o-projection runs in the
# library (>= 32 rows on a constant weight) the clone is pushed; the generated GEMM would read through the
# head merge, so it is pushed there too (session 17, push.merged_heads_reader); at one query the merge is a
# strided view
CASES = [(1, 127, 127, 8, 2, 32, True), (2, 32, 32, 4, 2, 64, True), (1, 64, 64, 8, 8, 32, True),
         (16, 17, 17, 8, 2, 32, True), (16, 3, 17, 4, 2, 64, None), (1, 1, 127, 8, 2, 32, False),
         (1, 3, 300, 4, 4, 24, None)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_s{}_t{}_h{}_kv{}_d{}".format(*c))
def test_heads_merge_before_the_projection_moves_nothing(case):
    """Greedy: the head merge is free, whichever way the planner takes it.  A pushed clone is stored by the
    attention kernel, whose only store is then into the clone's [B, S, H, D] buffer: its own [B*H, S, D]
    output never exists, and the o-projection reads the clone as a plain view."""
    b, s, t, h, kv, d, pushed = case
    torch.manual_seed(1)
    m = AttentionThenProjection(h, kv, d).eval()
    compiled = _compile(m, _inputs(b, s, t, h, kv, d))
    assert report(compiled)["materialized_movement_bytes"] == 0, compiled.report
    assert [k.kind for k in kernels(compiled) if k.kind in ("copy", "push", "move")] == []
    assert [s.node.op for s in steps(compiled, "run") if "clone" in s.node.op] == []
    fates = _clone_fates(compiled)
    for fate, why in fates.values():
        assert fate in ("virtual", "pushed"), why
        if fate == "pushed":
            assert "attention kernel" in why, why
    names = [n for n, (fate, _) in fates.items() if fate == "pushed"]
    if pushed is not None:
        assert bool(names) == pushed, fates
    if names:
        (att,) = [k for k in kernels(compiled) if k.kind == "attention"]
        (st,) = att.stores
        assert st.buffer.name == names[0] and tuple(st.buffer.shape) == (b, s, h, d)
        assert executor(compiled).lowering.push.by_attention


def test_attention_output_read_elsewhere_keeps_its_store_and_the_copy():
    """The attention output is also a graph output: the kernel keeps its own store and the pushed clone is
    written by a copy kernel (the reason recorded), still equal to eager."""
    torch.manual_seed(4)
    m = AlsoReturningTheHeads(8, 2, 32).eval()
    compiled = _compile(m, _inputs(1, 127, 127, 8, 2, 32, seed=5))
    (att,) = [k for k in kernels(compiled) if k.kind == "attention"]
    assert [tuple(st.buffer.shape) for st in att.stores] == [(8, 127, 32)]
    why = executor(compiled).lowering.push.why_copied
    assert all("other readers" in w for w in why.values()), why


@pytest.mark.parametrize("plan", ["all", "none"])
def test_other_plans_still_match_eager(plan):
    torch.manual_seed(6)
    m = AttentionThenProjection(8, 2, 32).eval()
    _compile(m, _inputs(2, 17, 33, 8, 2, 32, seed=7), plan=plan)


def test_demo_llama_moves_nothing(monkeypatch):
    """scripts/demo.sh's model (zoo "llama", small: 2 layers, 64 tokens) under the default greedy plan with
    the fixed machine figures: the head merges (clone_3, clone_7) are pushed into the attention kernels,
    0 B of movement materialised."""
    from vtc import zoo
    from vtc.plan.cost import machine

    monkeypatch.setenv("VTC_NO_MEASURE", "1")
    machine.cache_clear()
    try:
        model, inputs = zoo.load("llama", size="small")
        compiled = vtc.compile(model, inputs)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
    finally:
        machine.cache_clear()
    r = report(compiled)
    assert r["materialized_movement_bytes"] == 0, compiled.report
    kept = {e["node"]: e["fate"] for e in r["movement"] if e["fate"] not in ("virtual", "view")}
    assert set(kept.values()) <= {"pushed"}, kept
    fates = _clone_fates(compiled)
    assert all("attention kernel" in why for fate, why in fates.values() if fate == "pushed"), fates
    assert [k.kind for k in kernels(compiled) if k.kind in ("copy", "push", "move")] == []


def test_new_sizes_reuse_the_pushed_store():
    """Calls with other batch and query counts (vtc.dynamic: the kernels take the sizes as arguments) still
    store the merged heads right."""
    torch.manual_seed(8)
    m = AttentionThenProjection(8, 2, 32).eval()
    compiled = vtc.compile(m, _inputs(1, 64, 64, 8, 2, 32, seed=9))
    for b, s in [(2, 80)]:  # batch and queries both new: one symbolic capture
        inputs = _inputs(b, s, s, 8, 2, 32, seed=s)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs), m(*inputs), **TOL)
