"""Depthwise convolutions in bf16 / fp16 generated (vtc.codegen.conv ``_depthwise_conv2d``, vtc.codegen.depthwise).

Taps are widened to float32, summed in float32 with the bias and rounded once at the store, as eager's depthwise
kernels do (before this change such a convolution ran through torch).  The plane-by-plane vector code widens
16-bit taps itself (stride 1 and 2; stride 3 takes the generic loop).  Tolerance: 1 unit in the last place of
the dtype against eager (another order of float32 additions; differences under ``ATOL`` not counted, an
output that cancels to near 0), and the mean distance to a float64 reference no more than 1.05x eager's.
Every test fails before the change ("ran through torch").
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen.cpp import generate

from .test_low_precision_kernels import assert_ulps
from .util import compile_cpu, gen, kernels, rand, steps, torch_threads

ATOL = 1e-4
LOW = [torch.bfloat16, torch.float16]
# (channels, multiplier, size, kernel, stride, padding, dilation)
CASES = [(3, 1, 7, 3, 1, 1, 1), (17, 1, 13, 3, 2, 1, 1), (127, 1, 7, 5, 1, 2, 1), (17, 1, 1, 3, 1, 1, 1),
         (17, 2, 13, 3, 1, 0, 2), (24, 1, 14, 3, 2, 1, 1), (8, 1, 13, 3, 3, 1, 1), (5, 1, 7, 5, 2, 2, 1)]


def _check(fn, inputs, exact, vector: bool = True, threads: int | None = None):
    c = compile_cpu(fn, inputs)
    with torch_threads(threads):
        got, want = c(*inputs), fn(*inputs)
    assert [s.node.op for s in steps(c, "run")] == [], "ran through torch"
    ks = kernels(c)
    assert [k.kind for k in ks] == ["pointwise"]
    assert ("vtc_dw_" in generate(ks[0])) == vector  # the plane-by-plane vector code widens the taps
    assert_ulps(got, want, 1, atol=ATOL)
    ours, theirs = ((t.double() - exact).abs().mean().item() for t in (got, want))
    assert ours <= 1.05 * theirs + 1e-12, (ours, theirs)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", CASES)
def test_low_precision_depthwise_is_generated(dtype, case):
    ch, mult, size, k, stride, pad, dil = case
    g = gen(ch * 7 + size + k + stride)
    x, w, b = rand((2, ch, size, size), g, dtype), rand((ch * mult, 1, k, k), g, dtype), rand((ch * mult,), g, dtype)

    def fn(x, w, b):
        return F.conv2d(x, w, b, stride=stride, padding=pad, dilation=dil, groups=ch)

    exact = F.conv2d(x.double(), w.double(), b.double(), stride=stride, padding=pad, dilation=dil, groups=ch)
    _check(fn, (x, w, b), exact, vector=stride <= 2)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_bf16_depthwise_with_relu_and_residual_on_threads(threads):
    """No bias, then relu and a residual add (one kernel; eager rounds the convolution, then each op), on a
    plane large enough to fork."""
    g = gen(70 + threads)
    x, w, r = rand((1, 58, 28, 28), g, torch.bfloat16), rand((58, 1, 3, 3), g, torch.bfloat16), \
        rand((1, 58, 28, 28), g, torch.bfloat16)

    def fn(x, w, r):
        return torch.relu(F.conv2d(x, w, None, padding=1, groups=58)) + r

    exact = torch.relu(F.conv2d(x.double(), w.double(), None, padding=1, groups=58).to(torch.bfloat16).double()) \
        + r.double()
    _check(fn, (x, w, r), exact, threads=threads)
