"""A float16 ``x @ W^T`` on a constant W at weight_rows rows (vtc.codegen.gemm ``_f16_weight_rows``): the call plan
widens W once into float32 rows (``widened_rows``) and the kernel runs the "weight_rows" path on them (W's rows read
as the broadcast operand, A^T packed widened from float16), summing in float32 into the thread's block C, which the
``narrowed`` epilogue rounds into the float16 output once per element, as on the panels; in one reduction slice
(K <= WT_KC) the epilogue runs over each staged group of WT_GROUP_F16 columns instead.  Before helper head16's
change (session 25) every float16 GEMM ran the panels (the report's path "panels"): these tests fail there.

Every result against torch eager at float16's tolerance (tests/codegen/test_gemm_fp16.py's ``_assert_fp16_close``:
one float16 ulp plus 2^-16 of the products' magnitudes, 97% of the elements bit for bit): the float32 sums run in
another order than the panels' (one reduction slice of up to WT_KC, not slices of 256), so the result is not the
panels' bit for bit, but it is rounded as theirs and eager's are."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import gemm
from vtc.runtime import packed

from .test_gemm_fp16 import _assert_fp16_close, _magnitude
from .util import compile_cpu, gen, kernels, rand, report, torch_threads

H = torch.float16


class _Linear(torch.nn.Module):
    """x @ W^T (+ bias) (+ a residual) with W (and the bias) constants of the compiled graph."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w, requires_grad=False)
        self.b = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x, *residual):
        y = F.linear(x, self.w, self.b)
        return y + residual[0] if residual else y


def _check(mod: _Linear, inputs: tuple, magnitude: torch.Tensor, *, path: str = "weight_rows",
           threads: int | None = None):
    c = compile_cpu(mod, inputs, gemm="vtc")
    with torch_threads(threads), torch.no_grad():
        got, want = c(*inputs), mod(*inputs)
    assert [g["path"] for g in report(c)["gemm"]] == [path]
    _assert_fp16_close(got, want, magnitude)
    return c, got, want


def _gemm(c):
    return next(k for k in kernels(c) if k.kind == "gemm")


# (M, K, N): rows that 12-row tiles pad more than 32-row A^T panels (up to 16 rows: the dot path on the float16 W),
# partial (31, 95, 127) A^T panels, N below and across W's 12-row strips, K = 3 and two reduction slices (K > WT_KC)
SHAPES = [(31, 33, 25), (32, 3, 13), (95, 129, 301), (127, 64, 7), (64, 2100, 50), (128, 512, 1000)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_linear_on_widened_rows(m, k, n):
    g = gen(400 + m + k)
    x, w = rand((m, k), g, H), rand((n, k), g, H)
    c, got, want = _check(_Linear(w), (x,), _magnitude(x, w.t()))
    kern = _gemm(c)
    assert kern.gemm.packed_weight.layout is gemm.widened_rows
    src = gemm.generate(kern)
    assert "&& wpk;  // the weight_rows path" in src
    # one reduction slice: the epilogue run over each staged group of columns; two: over the block's C after them
    assert ("// the group through the epilogue" in src) == (k <= gemm.WT_KC)
    _assert_fp16_close(c(x), want, _magnitude(x, w.t()))  # called again: the widened copy reused


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_and_a_large_result(threads):
    """128 x 256 -> 9000 (a float16 result past NARROWED_LARGE_BYTES: stored by streaming stores) on 2-3 threads."""
    g = gen(430 + threads)
    x, w = rand((128, 256), g, H), rand((9000, 256), g, H)
    _check(_Linear(w), (x,), _magnitude(x, w.t()), threads=threads)


def test_bias_and_residual_epilogue():
    """addmm's bias added to the float32 sum before the one rounding, then a residual (rounded as eager's add)."""
    g = gen(440)
    x, w, b, r = rand((62, 96), g, H), rand((200, 96), g, H), rand((200,), g, H), rand((62, 200), g, H)
    mag = _magnitude(x, w.t()) + b.double().abs() + r.double().abs()
    c, _, _ = _check(_Linear(w, b), (x, r), mag)
    assert "// the group through the epilogue" in gemm.generate(_gemm(c))


def test_transposed_a():
    """A read with unit stride along the rows (x^T of a [K, M] input): A^T packed element by element, widened."""
    g = gen(450)
    xt, w = rand((80, 64), g, H), rand((60, 80), g, H)

    class Mod(_Linear):
        def forward(self, xt):
            return F.linear(xt.t(), self.w)
    c, _, _ = _check(Mod(w), (xt,), _magnitude(xt.t(), w.t()))
    assert _gemm(c).gemm.packed_weight.layout is gemm.widened_rows


def test_rows_the_panels_pad_less_keep_the_panels():
    """49 rows (the panels' 12-row tiles pad them less than 32-row A^T panels): the panels on W packed once, as in
    float32."""
    g = gen(460)
    x, w = rand((49, 64), g, H), rand((100, 64), g, H)
    c, _, _ = _check(_Linear(w), (x,), _magnitude(x, w.t()), path="panels")
    assert _gemm(c).gemm.packed_weight.layout is not gemm.widened_rows


def test_without_the_widened_copy_the_panels_run(monkeypatch):
    """No packed copies (VTC_PACKED_WEIGHTS=0's switch): the kernel gets no wpk and runs the panels, packing the
    float16 W per block; the same result within the tolerance."""
    monkeypatch.setattr(packed, "CONV_ENABLED", False)
    g = gen(470)
    x, w = rand((64, 96), g, H), rand((150, 96), g, H)
    _check(_Linear(w), (x,), _magnitude(x, w.t()))


def test_float32_result():
    """F.linear(x, W).float() * 2: a float32 result (not ``narrowed``) of float16 operands, on W's widened rows, the
    product rounded to float16 first as eager's .float() of the float16 result."""
    g = gen(480)
    x, w = rand((64, 200), g, H), rand((96, 200), g, H)

    class Mod(_Linear):
        def forward(self, x):
            return F.linear(x, self.w).float() * 2
    mod = Mod(w)
    c = compile_cpu(mod, (x,), gemm="vtc")
    with torch.no_grad():
        got, want = c(x), mod(x)
    assert [g["path"] for g in report(c)["gemm"]] == ["weight_rows"] and got.dtype == torch.float32
    _assert_fp16_close((got / 2).to(H), (want / 2).to(H), _magnitude(x, w.t()))
    assert bool(((got / 2).to(H).float() == got / 2).all())
