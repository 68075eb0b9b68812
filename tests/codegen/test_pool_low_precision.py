"""bf16 / fp16 max pools in the plane-by-plane vector code (vtc/codegen/depthwise.py, combine "max").

A max of 16-bit values needs no rounding (the result is one of the taps): the taps are widened to float32 by
masked 16-bit loads whose masked-off lanes load -inf's bits (stride 1: ``vtc_dw_f16`` / ``vtc_dw_bf16``; stride 2:
one 32-element load, the 32-bit words' low halves), maxed in float32 and narrowed exactly at the store.  So the
result equals eager's bit for bit; NaN propagates as in torch (compared as NaN: its payload is not kept).  Before
this change these pools took the generic loop (16-bit reads at stride 2 that gcc does not vectorise: ShuffleNetV2's
stem pool in float16 took ~4 ms at 1 thread), so the tests that assert the vector code fail there.  Stride 3 (no
16-bit gather) keeps the generic loop, exact too.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen.cpp import generate

from .util import assert_all_generated, case_seed, compile_cpu, gen, kernels, rand, steps

LOW = [torch.bfloat16, torch.float16]
# (batch, channels, height, width, kernel, stride, padding, emitted as)
CASES = [
    (1, 24, 112, 112, 3, 2, 1, "rows"),  # ShuffleNetV2's stem pool
    (2, 3, 17, 13, 3, 2, 1, "rows"),  # odd sizes: the last chunk of a row partly masked
    (1, 5, 9, 37, 2, 2, 0, "rows"),  # 2x2 / 2
    (2, 3, 10, 11, 2, 1, 1, "rows"),  # 2x2 / 1 with padding: the output wider than the input
    (1, 4, 20, 20, 3, 1, 1, "flat"),  # 3x3 / 1 "same"
    (1, 3, 13, 15, 5, 1, 2, "flat"),  # 5x5 / 1 "same", odd sizes
    (2, 3, 11, 19, 3, 3, 1, "generic"),  # stride 3: no 16-bit gather
]


def _special(x: torch.Tensor) -> torch.Tensor:
    """x with NaN (both signs), +-inf, a whole plane of -inf and the dtype's extremes in places a window reads
    next to the padding, and in the middle."""
    x = x.clone()
    b, c, h, w = x.shape
    info = torch.finfo(x.dtype)
    x[0, 0, 0, 0] = float("nan")  # the first window, next to the padding
    x[-1, c - 1, h // 2, w // 2] = -float("nan")  # sign bit set
    x[0, c // 2, h - 1, w - 1] = float("inf")
    x[-1, 0, h // 3, w - 1] = -float("inf")
    x[0, -1, 1, w // 3] = info.max
    x[-1, c // 2, h - 1, 0] = -info.max
    x[0, c // 2, h // 2, 1] = info.tiny  # smallest normal
    if c > 1:
        x[-1, 1] = float("-inf")  # max is -inf, not the padding's fill
    return x


def _assert_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    bits = torch.int16
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


def _sources(compiled) -> str:
    return "\n".join(generate(k) for k in kernels(compiled))


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}c{}_{}x{}_k{}s{}p{}".format(*c[:7]))
def test_low_precision_max_pool_is_exact_and_vector(case, dtype):
    b, c, h, w, k, s, p, emitted = case
    g = gen(case_seed(case, 997))
    fn = lambda x: F.max_pool2d(x, k, s, p)  # noqa: E731
    for x in (rand((b, c, h, w), g, dtype), _special(rand((b, c, h, w), g, dtype))):
        compiled = compile_cpu(fn, (x,))
        assert_all_generated(compiled)
        _assert_bit_exact(compiled(x), fn(x))
    src = _sources(compiled)
    body = src[src.index('extern "C" void k_'):]  # the kernel, after the preludes (vecmath's has vector code)
    assert {"flat": "masks.m" in src, "rows": "cols.m" in src, "generic": "_mm512" not in body}[emitted], src
    if emitted != "generic":  # the taps widened by 16-bit loads whose masked-off lanes are -inf
        fill = {torch.float16: "0xFC00", torch.bfloat16: "0xFF80"}[dtype]
        assert f"(short){fill})" in src, src


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_max_pool_with_a_consumer(dtype):
    """A pool whose result feeds a 16-bit op in the same kernel (the sum buffer holds the exact 16-bit max as a
    float; the consumer rounds as eager does)."""
    g = gen(31)
    x = rand((2, 6, 23, 29), g, dtype)
    y = rand((2, 6, 12, 15), g, dtype)
    fn = lambda x, y: F.max_pool2d(x, 3, 2, 1) * y  # noqa: E731
    compiled = compile_cpu(fn, (x, y))
    assert_all_generated(compiled)
    assert "cols.m" in _sources(compiled)
    _assert_bit_exact(compiled(x, y), fn(x, y))


# bf16 / fp16 batch norm (eval), vtc/codegen/ops.py ``_batch_norm``: eager computes x * alpha[c] + beta[c] in float32
# (alpha = rsqrt(var + eps) * w, beta = b - mean * alpha), its multiply-add fused, and rounds once; the generated
# kernel too (the kernel IR's fused multiply-add, vtc/codegen/kernel_ir.py ``fma``): bit for bit.  Before the change
# the batch norm ran through torch; unfused, the float16 cases below differ from eager in a few elements.


def _bn(g, channels: int, dtype: torch.dtype) -> torch.nn.BatchNorm2d:
    bn = torch.nn.BatchNorm2d(channels).eval()
    with torch.no_grad():
        bn.running_mean.copy_(rand((channels,), g))
        bn.running_var.copy_(rand((channels,), g, positive=True))
        bn.weight.copy_(rand((channels,), g))
        bn.bias.copy_(rand((channels,), g))
    return bn.to(dtype)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_batch_norm_is_generated(dtype):
    g = gen(41)
    bn = _bn(g, 16, dtype)
    x = rand((2, 16, 33, 35), g, dtype, high=4.0)  # enough elements that an unfused multiply-add differs somewhere
    fn = lambda x: torch.relu(bn(x))  # noqa: E731
    compiled = compile_cpu(fn, (x,))
    assert [s.node.op for s in steps(compiled, "run")] == [], "ran through torch"
    _assert_bit_exact(compiled(x), fn(x))


@pytest.mark.parametrize("groups, stride, dtype",
                         [(1, 1, torch.float16), (16, 2, torch.float16), (16, 2, torch.bfloat16)], ids=["conv3x3_fp16", "depthwise3x3s2_fp16", "depthwise3x3s2_bf16"])
def test_low_precision_conv_batch_norm_relu_one_kernel(groups, stride, dtype):
    """Conv + BN + ReLU: the batch norm in the convolution's kernel (before: a torch op after it; a bf16 dense
    convolution runs through torch, docs/low_precision.md)."""
    g = gen(43 + groups)
    conv = torch.nn.Conv2d(16, 16, 3, stride, padding=1, groups=groups, bias=False).eval()
    with torch.no_grad():
        conv.weight.copy_(rand(conv.weight.shape, g) / 8)
    conv = conv.to(dtype)
    bn = _bn(g, 16, dtype)
    x = rand((1, 16, 30, 30), g, dtype)
    fn = lambda x: torch.relu(bn(conv(x)))  # noqa: E731
    compiled = compile_cpu(fn, (x,))
    assert_all_generated(compiled)
    assert len(kernels(compiled)) == 1
    assert "std::fma(" in _sources(compiled)
    _assert_bit_exact(compiled(x), fn(x))
