"""Adversarial tests (session 17): convolutions (dense, 1x1, grouped, depthwise; stride, padding, dilation, a
pointwise epilogue) behind drawn rank-keeping movement chains, and scaled_dot_product_attention (GQA as
enable_gqa or repeat_interleave, causal / bool / additive / input masks, [B, S, H, D] layouts, decode and
prefill lengths), float32 and bf16, 1 and 2 threads, compared with torch eager.  The session's drawn cases
found no wrong answer here once the folded roll index was fixed (tests/test_adversarial_chains.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

import vtc
from tests.adversarial import SETTINGS, Draw, close, describe, draw_chain, rand, run_chain
from tests.codegen.util import torch_threads

BF16_ATTENTION_TOL = dict(rtol=3e-2, atol=3e-2)


def _close(got, want, dtype, what):
    if dtype == torch.float32:
        close(got, want, dtype, what)
    else:
        torch.testing.assert_close(got, want, **BF16_ATTENTION_TOL, msg=lambda m: f"{what}\n{m}")


@settings(max_examples=6, **SETTINGS)
@given(st.data())
def test_a_drawn_convolution_behind_a_drawn_chain(data):
    r = Draw(data)
    dtype = r.choice([torch.float32, torch.float32, torch.bfloat16])
    shape = [r.choice([1, 3]), r.choice([1, 3, 4, 8, 16]), r.choice([1, 3, 5, 8, 17]), r.choice([1, 3, 7, 17])]
    ops, (_, c, _, _) = draw_chain(r, shape, r.randrange(0, 4), keep_rank=True)
    kind = r.choice(["dense", "1x1", "grouped", "depthwise"])
    k = 1 if kind == "1x1" else r.choice([1, 3])
    stride = r.choice([1, 1, 2])
    padding = r.choice([0, 1, "same"]) if stride == 1 else r.choice([0, 1])
    dilation = r.choice([1, 1, 2])
    if kind == "depthwise":
        groups, out = c, c * r.choice([1, 2])
    elif kind == "grouped":
        groups = r.choice([q for q in (1, 2, 3, 4) if c % q == 0])
        out = groups * r.choice([1, 2, 3])
    else:
        groups, out = 1, r.choice([1, 5, 16, 33])
    g = torch.Generator().manual_seed(r.randrange(1000))
    weight = rand((out, c // groups, k, k), g).to(dtype)
    bias = rand((out,), g).to(dtype) if r.choice([False, True]) else None
    post = r.choice(["none", "relu", "affine"])
    threads, gemm = r.choice([1, 2]), r.choice(["auto", "vtc"])
    what = (f"{dtype} x {shape}: {describe(ops)} -> conv2d({kind}, out={out}, groups={groups}, k={k}, stride={stride},"
            f" padding={padding}, dilation={dilation}, bias={bias is not None}) -> {post}; threads={threads} gemm={gemm}")
    note(what)

    def fn(x):
        y = F.conv2d(run_chain(ops, x), weight, bias, stride=stride, padding=padding, dilation=dilation, groups=groups)
        return torch.relu(y) if post == "relu" else y * 0.5 - 0.25 if post == "affine" else y

    x = rand(shape, g, dtype)
    try:
        want = fn(x)
    except RuntimeError:  # the kernel does not fit the drawn map: nothing to compare
        return
    with torch_threads(threads):
        compiled = vtc.compile(fn, (x,), gemm=gemm)
        _close(compiled(x), want, dtype, what)


@settings(max_examples=6, **SETTINGS)
@given(st.data())
def test_a_drawn_attention(data):
    r = Draw(data)
    dtype = r.choice([torch.float32, torch.float32, torch.bfloat16])
    b, hq = r.choice([1, 3]), r.choice([1, 2, 4, 8])
    hkv = r.choice([h for h in (1, 2, 4, 8) if hq % h == 0])
    sq = r.choice([1, 3, 17, 33, 127])
    sk = r.choice([sq, sq, 1, 5, 40, 130])
    d = r.choice([8, 16, 17, 64])
    mask = r.choice(["none", "causal", "bool", "additive", "input"])
    if mask == "causal" and sq > sk:
        mask = "none"
    scale = r.choice([None, 0.3])
    gqa = r.choice(["enable_gqa", "repeat_interleave"]) if hkv != hq else "none"
    layout = r.choice(["BHSD", "BSHD"])
    threads = r.choice([1, 2])
    g = torch.Generator().manual_seed(r.randrange(1000))
    bool_mask = torch.rand(sq, sk, generator=g) < 0.8
    bool_mask[:, 0] = True
    add_mask = rand((b, 1, sq, sk), g).to(dtype)
    what = (f"{dtype} b={b} hq={hq} hkv={hkv} sq={sq} sk={sk} d={d} mask={mask} scale={scale} gqa={gqa} "
            f"layout={layout} threads={threads}")
    note(what)

    def fn(q, k, v, m):
        if layout == "BSHD":
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if gqa == "repeat_interleave":
            k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        kw = {"scale": scale, "enable_gqa": gqa == "enable_gqa", "is_causal": mask == "causal",
              "attn_mask": {"bool": bool_mask, "additive": add_mask, "input": m}.get(mask)}
        return F.scaled_dot_product_attention(q, k, v, **kw).transpose(1, 2).reshape(b, sq, hq * d)

    def qkv(h, s):
        return rand((b, s, h, d) if layout == "BSHD" else (b, h, s, d), g, dtype)

    inputs = (qkv(hq, sq), qkv(hkv, sk), qkv(hkv, sk), rand((b, 1, sq, sk), g, dtype))
    want = fn(*inputs)
    with torch_threads(threads):
        compiled = vtc.compile(fn, inputs, gemm=r.choice(["auto", "vtc"]))
        _close(compiled(*inputs), want, dtype, what)


def test_attention_rows_that_see_no_key_and_a_soft_capped_sliding_window():
    """A bool mask with a row of no key, the same as -inf in an additive mask input, and Gemma-2's soft-capped
    sliding-window attention with GQA keys expanded by hand (the flash kernel's mask, soft-cap and GQA forms)."""
    g = torch.Generator().manual_seed(11)
    b, h, kv, s, d = 1, 4, 2, 17, 16
    q, k, v = rand((b, h, s, d), g), rand((b, kv, s, d), g), rand((b, kv, s, d), g)
    sees = torch.rand(s, s, generator=g) < 0.5
    sees[3] = False
    minus_inf = torch.zeros(s, s).masked_fill(~sees, float("-inf")).expand(b, 1, s, s).contiguous()

    def masked(q, k, v, m):
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=sees, enable_gqa=True),
                F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True))

    def capped(q, k, v, cap=30.0, window=5):
        kk = k[:, :, None].expand(b, kv, h // kv, s, d).reshape(b, h, s, d)
        vv = v[:, :, None].expand(b, kv, h // kv, s, d).reshape(b, h, s, d)
        w = torch.tanh(q @ kk.transpose(-1, -2) * d ** -0.5 / cap) * cap
        i = torch.arange(s)
        w = w.masked_fill((i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= window), float("-inf"))
        return torch.softmax(w, -1) @ vv

    for got, want in zip(vtc.compile(masked, (q, k, v, minus_inf))(q, k, v, minus_inf), masked(q, k, v, minus_inf)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
    close(vtc.compile(capped, (q, k, v))(q, k, v), capped(q, k, v), torch.float32)
