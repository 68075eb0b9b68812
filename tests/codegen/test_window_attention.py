"""Swin's window attention (7 x 7 or 5 x 5 windows, a relative-position bias gathered from a table, the
shifted windows' mask): the bias and mask rows are staged per key block into key x query tiles
(vtc.codegen.flash.KEY_ROWS), not gathered per lane and key, and the result matches eager (docs/prefill.md)."""
from __future__ import annotations

import re

import pytest
import torch

import vtc
from vtc.codegen.cpp import generate

from .test_attention import attention_kernels
from .util import gen, rand, torch_threads

TOL = dict(rtol=1e-4, atol=2e-5)


class WindowAttention(torch.nn.Module):
    """transformers' SwinSelfAttention over a (shifted) window partition of a [B, side, side, C] map: q, k, v
    Linear layers, scores + the relative-position bias + the shift mask.  The bias is `bias`: "table" (as
    transformers: table[index] -> view [N, N, heads] -> permute -> contiguous), "nnh" (that gather done
    before: a [N, N, heads] buffer, permuted: a key stride of `heads`, as Swin-T's graph reads it where the
    planner keeps the gather physical) or "hnn" (a contiguous [heads, N, N] buffer: key stride 1)."""

    def __init__(self, side: int, window: int, heads: int, head_dim: int, shift: int, g: torch.Generator,
                 bias: str = "table"):
        super().__init__()
        c = heads * head_dim
        self.side, self.w, self.heads, self.d, self.shift, self.bias = side, window, heads, head_dim, shift, bias
        self.q, self.k, self.v = (torch.nn.Linear(c, c) for _ in range(3))
        for lin in (self.q, self.k, self.v):
            with torch.no_grad():
                lin.weight.copy_(rand(lin.weight.shape, g) * c ** -0.5)
                lin.bias.copy_(rand(lin.bias.shape, g) * 0.1)
        self.table = torch.nn.Parameter(rand(((2 * window - 1) ** 2, heads), g))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", (rel[:, :, 0] * (2 * window - 1) + rel[:, :, 1]).reshape(-1))
        n = window * window
        self.register_buffer("nnh", rand((n, n, heads), g))
        self.register_buffer("hnn", rand((heads, n, n), g))
        if shift:  # the region of each pixel after the roll; keys of another region get -100
            img = torch.zeros(1, side, side, 1)
            cnt = 0
            for hs in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
                for ws in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
                    img[:, hs, ws, :] = cnt
                    cnt += 1
            win = self._partition(img).view(-1, window * window)
            mask = win[:, None, :] - win[:, :, None]
            self.register_buffer("mask", mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0))

    def _partition(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        x = x.view(b, h // self.w, self.w, w // self.w, self.w, c).permute(0, 1, 3, 2, 4, 5)
        return x.contiguous().view(-1, self.w * self.w, c)

    def forward(self, x):  # x [B, side, side, C]
        b = x.shape[0]
        n, nw = self.w * self.w, (self.side // self.w) ** 2
        if self.shift:
            x = torch.roll(x, (-self.shift, -self.shift), (1, 2))
        win = self._partition(x)  # [B * nW, N, C]

        def heads(t):
            return t.view(b * nw, n, self.heads, self.d).permute(0, 2, 1, 3)

        q, k, v = heads(self.q(win)), heads(self.k(win)), heads(self.v(win))
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.d ** 0.5
        if self.bias == "table":
            bias = self.table[self.index].view(n, n, -1).permute(2, 0, 1).contiguous()
        else:
            bias = self.nnh.permute(2, 0, 1) if self.bias == "nnh" else self.hnn
        scores = scores + bias.unsqueeze(0)
        if self.shift:
            scores = scores.view(b, nw, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
            scores = scores.view(-1, self.heads, n, n)
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return out.permute(0, 2, 1, 3).reshape(b * nw, n, -1)


# (window, batch, windows per side, heads, head dim, shift, threads, bias): 7 x 7 windows (49 keys: one tile
# of 64 query lanes, a last key vector of one), 5 x 5 (25 keys), 3 x 3 (9: one vector); batch 2 doubles the
# tasks
CASES = [
    (7, 1, 2, 3, 32, 0, 1, "nnh"),
    (7, 2, 2, 3, 32, 3, 2, "nnh"),
    (7, 1, 3, 2, 16, 3, 1, "hnn"),
    (5, 2, 2, 4, 24, 2, 1, "nnh"),
    (5, 1, 3, 3, 32, 0, 2, "hnn"),
    (3, 2, 4, 2, 16, 1, 2, "hnn"),
    (7, 1, 2, 3, 32, 3, 2, "table"),
    (5, 2, 3, 2, 16, 0, 1, "table"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "w{}_b{}_n{}_h{}_d{}_shift{}_t{}_{}".format(*c))
def test_window_attention_stages_bias_and_mask_rows(case):
    """The score chain reads the bias and the mask as ``kt<j>[t][q]``, staged once per key block (before:
    ``b1[(i0 % 3) + 147*i1 + 3*r]`` per lane and key, a scalar loop), and matches eager.  A bias gathered
    from its table through the index buffer is folded into a [N * N, heads] constant (``vtc.ir.fold``,
    session 28; before, the planner made the gather virtual and the chain read it per lane and key, only the
    mask staged), read as "nnh" is."""
    window, b, per_side, heads, d, shift, threads, bias = case
    g = gen(window * 100 + b * 10 + shift)
    side = window * per_side
    m = WindowAttention(side, window, heads, d, shift, g, bias).eval()
    x = rand((b, side, side, heads * d), g)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        c = vtc.compile(m, (x,))
        with torch.no_grad():
            got, want = c(x), m(x)
    finally:
        torch.set_num_threads(saved)
    torch.testing.assert_close(got, want, **TOL)
    (k,) = attention_kernels(c)
    src = generate(k)
    chain = re.search(r"st\[t\]\[q\] = (.*);", src).group(1)
    staged = 1 + bool(shift)
    assert k.tiled and ("KEY_ROWS" in src) == bool(staged), src
    assert [f"kt{j}[t][q]" in chain for j in range(3)] == [j < staged for j in range(3)], chain
    assert not re.search(r"\bb\d+\[", chain), chain  # no buffer read per lane and key


def test_key_rows_off_gives_the_same_result():
    """vtc.codegen.flash.KEY_ROWS = False (the A/B switch) reads the terms per lane and key as before."""
    from vtc.codegen import flash

    g = gen(5)
    m = WindowAttention(14, 7, 3, 32, 3, g, "nnh").eval()
    x = rand((1, 14, 14, 96), g)
    flash.KEY_ROWS = False
    try:
        c = vtc.compile(m, (x,))
        with torch.no_grad():
            torch.testing.assert_close(c(x), m(x), **TOL)
        (k,) = attention_kernels(c)
        assert "kt0" not in generate(k)
    finally:
        flash.KEY_ROWS = True


# (window, batch, windows per side, heads, head dim, shift, threads): a [N, N, heads] bias read with a key stride
# of `heads`: 3 and 5 heads (a transpose one float at a time), 17 (a 16 x 16 register transpose per 16 rows
# and a last column), 7 x 7, 5 x 5 and 3 x 3 windows (N = 49, 25, 9 keys: rows of the transposed buffer that
# are not whole vectors), with and without the shift mask, 1 and 2 threads
STRIDED = [
    (7, 1, 2, 3, 32, 0, 1),
    (7, 2, 2, 3, 32, 3, 2),
    (5, 2, 2, 17, 8, 0, 2),
    (3, 1, 4, 5, 16, 1, 1),
]


@pytest.mark.parametrize("case", STRIDED, ids=lambda c: "w{}_b{}_n{}_h{}_d{}_shift{}_t{}".format(*c))
def test_strided_bias_is_transposed_once_per_call(case):
    """A bias read with a key stride above 1 (Swin-T's [N * N, heads] gather read through its permute) is
    transposed once per call into rows along the key (``kx<j>_``, flash.KEY_ROWS_T) and staged by register
    transposes like a unit-stride row, not gathered element by element in every tile (before: the
    ``gathered`` loop ``kt0[t][q] = b[lk0[q] + o_]``); the result matches eager."""
    window, b, per_side, heads, d, shift, threads = case
    g = gen(window * 1000 + heads * 10 + shift)
    side = window * per_side
    m = WindowAttention(side, window, heads, d, shift, g, "nnh").eval()
    x = rand((b, side, side, heads * d), g)
    with torch_threads(threads):
        c = vtc.compile(m, (x,))
        with torch.no_grad():
            got, want = c(x), m(x)
    torch.testing.assert_close(got, want, **TOL)
    (k,) = attention_kernels(c)
    src = generate(k)
    j = 1 if shift else 0  # the mask's rows come first
    assert f"kx{j}_" in src and "aligned_alloc" in src and f"std::free(kx{j}_)" in src, src
    assert "gathered" not in src, src
    assert f"kt{j}[t][q]" in re.search(r"st\[t\]\[q\] = (.*);", src).group(1)


def test_strided_bias_of_one_window_stays_gathered():
    """One window (the loads read as many floats as the buffer holds): the buffer is not transposed (that
    would cost as much as the loads it saves); the gathered rows match eager, and KEY_ROWS_T = False (the
    A/B switch) gathers them too."""
    from vtc.codegen import flash

    g = gen(11)
    m = WindowAttention(7, 7, 3, 16, 0, g, "nnh").eval()
    x = rand((1, 7, 7, 48), g)
    c = vtc.compile(m, (x,))
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x), **TOL)
    (k,) = attention_kernels(c)
    assert "kx0_" not in generate(k) and "gathered" in generate(k)
    m = WindowAttention(14, 7, 3, 16, 3, g, "nnh").eval()
    x = rand((1, 14, 14, 48), g)
    flash.KEY_ROWS_T = False
    try:
        c = vtc.compile(m, (x,))
        with torch.no_grad():
            torch.testing.assert_close(c(x), m(x), **TOL)
        (k,) = attention_kernels(c)
        assert "kx0_" not in generate(k) and "gathered" in generate(k)
    finally:
        flash.KEY_ROWS_T = True
