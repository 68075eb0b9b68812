"""The attention kernel stores the merged heads when a generated GEMM reads them (vtc.codegen.push,
``merged_heads_reader``, session 17).

``attn.transpose(1, 2).reshape(B, S, H * D)`` in front of the o-projection is a
clone of a virtual tensor that is not a strided view.  Pulled (the code before),
the generated o-projection GEMM packs its A by runs through a column table
(``vtc_pack_a_cols``: a row gathered into an L1 buffer, then packed).  Now the
greedy pushes the clone: the flash attention kernel stores its rows straight
into [B, S, H, D] and the GEMM's A is a plain [B*S, H*D] operand.  Every case is
compared with eager on random inputs; each asserts what is optimised.  With
``push.MERGE_HEADS = False`` (the code before; plan cache bypassed) the four
``test_attention_stores_merged_heads...`` cases and the pricing test fail.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import vtc
from vtc.codegen import push
from vtc.codegen.gemm import generate as generate_gemm

from .util import executor, kernels, report, torch_threads

TOL = dict(rtol=1e-4, atol=5e-5)


class Layer(nn.Module):
    """GQA attention (repeat_kv by expand + reshape) with an additive causal mask, the heads merged back by
    transpose + reshape, then the o-projection; `sdpa`: torch's scaled_dot_product_attention(is_causal=True)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, out: int = 96, sdpa: bool = False,
                 causal: bool = True):
        super().__init__()
        self.kv_heads, self.sdpa, self.causal = kv_heads, sdpa, causal
        self.o_proj = nn.Linear(heads * head_dim, out, bias=False)

    def forward(self, q, k, v):
        b, h, s, d = q.shape
        r, t = h // self.kv_heads, k.shape[2]
        if r > 1:
            k = k[:, :, None].expand(b, self.kv_heads, r, t, d).reshape(b, h, t, d)
            v = v[:, :, None].expand(b, self.kv_heads, r, t, d).reshape(b, h, t, d)
        if self.sdpa:
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5
            if self.causal:
                scores = scores + torch.full((s, t), float("-inf"), dtype=q.dtype).triu(1)
            p = torch.softmax(scores, -1)
            a = torch.matmul(p, v)
        return self.o_proj(a.transpose(1, 2).reshape(b, s, h * d))


def _inputs(b, s, h, kv, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(dtype) for shape in ((b, h, s, d), (b, kv, s, d), (b, kv, s, d)))


def _compile(m, inputs, threads, tol=TOL, **options):
    with torch_threads(threads):
        compiled = vtc.compile(m, inputs, gemm="vtc", **options)
        got = compiled(*inputs)
    with torch.no_grad():
        want = m(*inputs)
    torch.testing.assert_close(got, want, **tol)
    return compiled


def _gemm_source(k) -> str:
    src = generate_gemm(k)
    return src[src.index('extern "C"'):]


def _assert_merged(compiled, b, s, h, d):
    """The attention kernel's one store is the pushed clone [B, S, H, D]; the o-projection's A is read plainly;
    nothing was materialised and nothing ran as a copy."""
    r = report(compiled)
    assert r["materialized_movement_bytes"] == 0, compiled.report
    (att,) = [k for k in kernels(compiled) if k.kind == "attention"]
    (st,) = att.stores
    # SDPA's decomposition clones [S, B, H, D] (at batch 1 the head merge is a view of that) or [B, S, H*D]
    assert tuple(st.buffer.shape) in ((b, s, h, d), (b, s, h * d), (s, 1, h, d) if b == 1 else ()), st.buffer
    fates = {e["node"]: (e["fate"], e["why"]) for e in r["movement"] if e["node"] == st.buffer.name}
    fate, why = fates[st.buffer.name]
    assert fate == "pushed" and "reads a plain A" in why and "attention kernel" in why, why
    assert executor(compiled).lowering.push.by_attention
    (gemm,) = [k for k in kernels(compiled) if k.kind == "gemm"]
    src = _gemm_source(gemm)
    assert "vtc_pack_a_cols(" not in src and "vtc_pack_a_ptrs(" not in src
    assert [k.kind for k in kernels(compiled) if k.kind in ("copy", "push", "move")] == []


# (batch, tokens, heads, KV heads, head dim, threads, sdpa)
CASES = [(1, 17, 4, 2, 32, 1, False), (2, 127, 4, 2, 32, 2, False), (1, 127, 8, 2, 32, 1, True),
         (2, 33, 4, 2, 64, 2, True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_s{}_h{}_kv{}_d{}_t{}{}".format(*c[:6], "_sdpa" * c[6]))
def test_attention_stores_merged_heads_for_the_generated_o_projection(case):
    b, s, h, kv, d, threads, sdpa = case
    torch.manual_seed(s + h)
    m = Layer(h, kv, d, sdpa=sdpa).eval()
    compiled = _compile(m, _inputs(b, s, h, kv, d, seed=b * 100 + s), threads)
    _assert_merged(compiled, b, s, h, d)


def test_before_the_gemm_packed_the_head_merge_by_columns(monkeypatch):
    """The code before (push.MERGE_HEADS off): the clone stays virtual, the attention kernel stores [B*H, S, D]
    and the GEMM gathers A's columns; both plans still match eager (what the A/B compares)."""
    monkeypatch.setattr(push, "MERGE_HEADS", False)
    from vtc.plan import cache
    monkeypatch.setattr(cache, "load", lambda g, o: (None, None))
    m = Layer(4, 2, 32).eval()
    compiled = _compile(m, _inputs(1, 17, 4, 2, 32, seed=3), 1)
    (att,) = [k for k in kernels(compiled) if k.kind == "attention"]
    assert [tuple(st.buffer.shape) for st in att.stores] == [(4, 17, 32)]
    (gemm,) = [k for k in kernels(compiled) if k.kind == "gemm"]
    assert "vtc_pack_a_cols(" in _gemm_source(gemm)


def test_the_choice_is_priced_against_the_pull():
    """The push replaces a pull: its estimate is the GEMM's read through the head merge less the plain read
    and the attention kernel's store (Estimator.pull_to_push_saving), positive, and named in the decision."""
    m = Layer(4, 2, 32).eval()
    compiled = _compile(m, _inputs(1, 17, 4, 2, 32, seed=5), 1)
    plan = executor(compiled).lowering.plan
    (d,) = [d for d in plan.decisions if d.direction == "push" and d.chosen]
    assert d.saving.seconds > 0
    assert "in place of the pull" in d.reason and "through its mapping" in d.reason, d.reason
    pulls = [x for x in plan.decisions if x.op == d.op and x.direction == "pull"]
    assert all(not x.chosen and x.reason.startswith("replaced by push") for x in pulls), pulls


def test_heads_read_elsewhere_keep_the_pull():
    """The attention output is also returned: the kernel keeps its own store; the merge stays a pull read by
    the GEMM (no push taken, no copy), still equal to eager."""

    class Twice(Layer):
        def forward(self, q, k, v):
            b, h, s, d = q.shape
            a = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * d ** -0.5, -1) @ v
            return self.o_proj(a.transpose(1, 2).reshape(b, s, h * d)), a

    m = Twice(4, 4, 32).eval()
    compiled = _compile(m, _inputs(1, 17, 4, 4, 32, seed=7), 1)
    (att,) = [k for k in kernels(compiled) if k.kind == "attention"]
    assert not [e for e in report(compiled)["movement"] if e["fate"] == "pushed"], compiled.report
    assert (4, 17, 32) in [tuple(st.buffer.shape)[-3:] for st in att.stores]
    assert report(compiled)["materialized_movement_bytes"] == 0, compiled.report


def test_one_query_is_a_strided_view_and_not_pushed():
    """Decode (one query, no mask): the head merge is a strided view, the GEMM reads it plainly; nothing is
    pushed for it."""
    m = Layer(8, 2, 32, causal=False).eval()
    g = torch.Generator().manual_seed(9)
    inputs = (torch.randn(2, 8, 1, 32, generator=g), torch.randn(2, 2, 40, 32, generator=g),
              torch.randn(2, 2, 40, 32, generator=g))
    compiled = _compile(m, inputs, 1)
    assert not [e for e in report(compiled)["movement"] if e["fate"] == "pushed"], compiled.report
    assert report(compiled)["materialized_movement_bytes"] == 0, compiled.report
