"""float16 convolutions in float32's forms (vtc.codegen.conv): the broadcast form (conv_bcast, its constant weight
packed once widened to float32), the direct form (conv_direct, the stem) and conv_panels' loops, each reading its
float16 operands widened to float32 as it loads them and rounding each result once, as eager's float16 convolution
(float32 sums, one rounding) does.  Before, every float16 convolution ran vtc.codegen.gemm's own loops on the panels
(path "panels", ``conv_panels`` not taken): every test here but ``test_fp16_conv_stride2_runs`` fails there.

Each result is compared with torch eager at float16's tolerance (tests/codegen/test_gemm_fp16.py's
``_assert_fp16_close``: one float16 ulp plus 2^-16 of the sum of the products' magnitudes, and at least 97% of the
elements bit for bit equal to eager's), and with float64 (the same ops on the float16 inputs in float64): vtc's
largest and mean error no larger than eager's, within 2^-16 of the magnitudes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import conv_bcast, conv_direct, conv_panels, conv_t
from vtc.runtime import packed

from .test_gemm_fp16 import _assert_fp16_close, _conv_magnitude, _ulp
from .util import compile_cpu, gemm_paths, gen, kernels, rand, steps, torch_threads

pytestmark = pytest.mark.skipif(not conv_t.has_avx512(), reason="the broadcast and direct forms are AVX-512 only")

H = torch.float16


class ConvBnRelu(torch.nn.Module):
    """Conv2d (constant weight, no bias) + eval BatchNorm2d + ReLU in float16, ShuffleNetV2's unit."""

    def __init__(self, cin: int, cout: int, k: int, stride: int, seed: int):
        super().__init__()
        g = gen(seed)
        self.conv = torch.nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)
        self.bn = torch.nn.BatchNorm2d(cout)
        with torch.no_grad():
            self.conv.weight.copy_(rand(tuple(self.conv.weight.shape), g, low=0.05, high=0.5))
            self.bn.running_mean.copy_(rand((cout,), g))
            self.bn.running_var.copy_(rand((cout,), g, positive=True))
            self.bn.weight.copy_(rand((cout,), g))
            self.bn.bias.copy_(rand((cout,), g))
        self.eval().to(H)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))

    def exact(self, x):
        """The same ops in float64 on the float16 input and parameters."""
        c, bn = self.conv, self.bn
        y = F.conv2d(x.double(), c.weight.double(), None, c.stride, c.padding)
        y = F.batch_norm(y, bn.running_mean.double(), bn.running_var.double(), bn.weight.double(), bn.bias.double(),
                         False, eps=bn.eps)
        return torch.relu(y)

    def magnitude(self, x):
        """The magnitude ``_assert_fp16_close`` takes (its tolerance 2^-16 of it): the convolution's magnitudes times
        |scale| plus |shift|, and the convolution's own float16 ulp times |scale| (eager rounds the convolution to
        float16 before the batch norm: a sum one ulp apart there is |scale| ulps of it apart after)."""
        c, bn = self.conv, self.bn
        scale = bn.weight.double() / (bn.running_var.double() + bn.eps).sqrt()
        shift = (bn.bias.double() - bn.running_mean.double() * scale).abs()[:, None, None]
        scale = scale.abs()[:, None, None]
        y = F.conv2d(x.double(), c.weight.double(), None, c.stride, c.padding)
        mag = _conv_magnitude(x, c.weight, stride=c.stride, padding=c.padding)
        return mag * scale + shift + 2.0 ** 16 * _ulp(y).double() * scale


def _check_against_eager_and_float64(got, want, exact, mag) -> None:
    _assert_fp16_close(got, want, mag)
    err, err_eager = (got.double() - exact).abs(), (want.double() - exact).abs()
    slack = 2.0 ** -16 * mag.max().item()
    assert err.max().item() <= err_eager.max().item() + slack, (err.max().item(), err_eager.max().item())
    assert err.mean().item() <= err_eager.mean().item() + slack, (err.mean().item(), err_eager.mean().item())


def _compiled(model, x, form: str, threads: int | None = None):
    with torch.no_grad(), torch_threads(threads):
        c = compile_cpu(model, (x,))
        got, want = c(x), model(x)
    assert gemm_paths(c) == [form]
    assert [k.kind for k in kernels(c)] == ["gemm"] and [s.node.op for s in steps(c, "run")] == []
    with torch.no_grad():
        _check_against_eager_and_float64(got, want, model.exact(x), model.magnitude(x))
    return c


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(58, 58, 7), (116, 232, 7), (116, 116, 14), (464, 1024, 7)],
                         ids=lambda s: f"{s[0]}to{s[1]}_{s[2]}x{s[2]}")
def test_fp16_conv_bcast_weight_packed_once_widened(shape, threads):
    """1x1 convolutions on 7x7 / 14x14 maps (ShuffleNetV2's stages 3 and 4, its last 464 -> 1024): the broadcast form,
    the constant float16 weight packed once into float32 W^T (twice its bytes), packed again after an in-place
    change."""
    cin, cout, side = shape
    model = ConvBnRelu(cin, cout, 1, 1, cin + cout)
    x = rand((1, cin, side, side), gen(side), H)
    c = _compiled(model, x, conv_bcast.FORM, threads)
    if packed.CONV_ENABLED:
        plan = c._first.executor.call_plan()
        assert plan.counts["packed_conv_weights"] == 1, plan.why_not_packed
        assert sum(plan.packed_copies.values()) == -(-cout // 16) * 16 * cin * 4  # float32 W^T, 16-channel vectors
    with torch.no_grad(), torch_threads(threads):
        model.conv.weight.mul_(-0.5)
        _check_against_eager_and_float64(c(x), model(x), model.exact(x), model.magnitude(x))


def test_fp16_conv_bcast_weight_an_input():
    """The weight a graph input (not a constant): the kernel packs W^T per call, widening it."""
    g = gen(7)
    x, w = rand((2, 96, 7, 7), g, H), rand((80, 96, 1, 1), g, H, low=0.05, high=0.5)
    fn = lambda x, w: torch.relu(F.conv2d(x, w))  # noqa: E731
    c = compile_cpu(fn, (x, w))
    got, want = c(x, w), fn(x, w)
    assert gemm_paths(c) == [conv_bcast.FORM]
    exact = torch.relu(F.conv2d(x.double(), w.double()))
    _check_against_eager_and_float64(got, want, exact, _conv_magnitude(x, w))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("stride", [2, 1])
def test_fp16_conv_direct_stem(stride, threads):
    """ShuffleNetV2's stem (3x3, 3 -> 24 channels, stride 2, padding 1) on a 70x66 image, and at stride 1: the
    direct form, the float16 input rows widened as the tiles load them (the even lanes at stride 2)."""
    model = ConvBnRelu(3, 24, 3, stride, 11 + stride)
    x = rand((1, 3, 70, 66), gen(stride), H)
    _compiled(model, x, conv_direct.FORM, threads)


@pytest.mark.parametrize("shape", [(24, 58, 28), (58, 58, 28), (24, 58, 56)], ids=lambda s: f"{s[0]}to{s[1]}_{s[2]}")
def test_fp16_conv_panels_loops(shape):
    """1x1 convolutions on 28x28 / 56x56 maps (ShuffleNetV2's stage 2): conv_panels' loops, the sums of a block in
    a float32 scratch rounded once into the float16 output by the epilogue."""
    cin, cout, side = shape
    model = ConvBnRelu(cin, cout, 1, 1, cin * cout)
    x = rand((1, cin, side, side), gen(side), H)
    c = _compiled(model, x, "panels")
    assert kernels(c)[0].gemm.generate is conv_panels.generate


def test_fp16_conv_stride2_runs():
    """A grouped 3x3 stride-2 convolution (the panel form): its im2col packed by vtc_conv_run2's float16 runs (the
    even elements of one 16-bit load), where before each element was widened one by one."""
    g = gen(21)
    x, w = rand((2, 24, 29, 31), g, H), rand((48, 12, 3, 3), g, H, low=0.05, high=0.5)
    fn = lambda x, w: F.conv2d(x, w, stride=2, padding=1, groups=2)  # noqa: E731
    c = compile_cpu(fn, (x, w))
    got, want = c(x, w), fn(x, w)
    assert gemm_paths(c) == ["panels"]
    from vtc.codegen.cpp import generate
    assert "vtc_conv_run2(dst" in generate(kernels(c)[0])
    exact = F.conv2d(x.double(), w.double(), stride=2, padding=1, groups=2)
    _check_against_eager_and_float64(got, want, exact, _conv_magnitude(x, w, stride=2, padding=1, groups=2))


def _source(c) -> str:
    from vtc.codegen.cpp import generate
    return "\n".join(generate(k) for k in kernels(c))


def test_fp16_conv_epilogue_rows():
    """A float16 Conv + BN + ReLU's epilogue rounds the convolution's block in place and narrows each output row by
    vector conversions (vecmath's vtc_round_f16_n / vtc_to_f16_n) in the broadcast, direct and panel forms; a bias
    added before the convolution's rounding keeps the per-element rounding (the block is not rounded first)."""
    for cin, cout, k, stride, side, form in ((116, 116, 1, 1, 14, conv_bcast.FORM), (3, 24, 3, 2, 64, conv_direct.FORM),
                                             (24, 58, 1, 1, 28, "panels")):
        model = ConvBnRelu(cin, cout, k, stride, side)
        x = rand((1, cin, side, side), gen(cin), H)
        src = _source(_compiled(model, x, form))
        assert "vtc_round_f16_n(ct" in src and "vtc_to_f16_n(&" in src, form
    g = gen(5)
    x, w, b = rand((1, 96, 7, 7), g, H), rand((64, 96, 1, 1), g, H, low=0.05, high=0.5), rand((64,), g, H)
    fn = lambda x, w, b: torch.relu(F.conv2d(x, w, b))  # noqa: E731
    c = compile_cpu(fn, (x, w, b))
    got, want = c(x, w, b), fn(x, w, b)
    assert gemm_paths(c) == [conv_bcast.FORM] and "vtc_round_f16_n(ct" not in _source(c)
    exact = torch.relu(F.conv2d(x.double(), w.double(), b.double()))
    _check_against_eager_and_float64(got, want, exact, _conv_magnitude(x, w) + b.double().abs()[:, None, None])


@pytest.mark.parametrize("stride", [1, 2])
def test_fp16_depthwise_bn_rows_bit_exact(stride):
    """A float16 depthwise 3x3 + BN + ReLU (ShuffleNetV2's): the plane's sums rounded in place, the result narrowed
    as rows by vector conversions; bit for bit eager's (its depthwise sum rounded once, then the batch norm's fused
    multiply-add rounded once)."""
    g = gen(30 + stride)
    conv = torch.nn.Conv2d(58, 58, 3, stride, 1, groups=58, bias=False)
    bn = torch.nn.BatchNorm2d(58)
    with torch.no_grad():
        conv.weight.copy_(rand(tuple(conv.weight.shape), g, low=0.05, high=0.5))
        bn.running_mean.copy_(rand((58,), g))
        bn.running_var.copy_(rand((58,), g, positive=True))
        bn.weight.copy_(rand((58,), g))
        bn.bias.copy_(rand((58,), g))
    model = torch.nn.Sequential(conv, bn, torch.nn.ReLU()).eval().to(H)
    x = rand((1, 58, 28, 28), g, H)
    with torch.no_grad():
        c = compile_cpu(model, (x,))
        got, want = c(x), model(x)
    assert [s.node.op for s in steps(c, "run")] == [] and len(kernels(c)) == 1
    src = _source(c)
    assert "vtc_round_f16_n(tmp" in src and "vtc_to_f16_n(&" in src
    assert torch.equal(got, want)


def test_fp16_conversions_equal_torch():
    """vecmath's float16 conversions (the CPU's vector instructions where gcc targets AVX-512) equal torch's bit for
    bit: every float16 widened, and float32 values across float16's whole range (subnormals, ties, overflow to inf,
    +-0, +-inf; NaN as NaN) narrowed, in a kernel that widens, adds zero in float32 and narrows."""
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(H)
    bits = torch.arange(0, 1 << 32, 997, dtype=torch.int64)
    floats = torch.cat([(bits - (1 << 31)).to(torch.int32).view(torch.float32),
                        torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65504.0, 65519.99, 65520.0, 2.0 ** -25,
                                      3 * 2.0 ** -26, 2.0 ** -24 * 1.5, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11])])
    fn = lambda h, f: (h.float() + 0.0, (f + 0.0).to(H))  # noqa: E731
    c = compile_cpu(fn, (halves, floats))
    (wide, narrow), (wide0, narrow0) = c(halves, floats), fn(halves, floats)
    assert [s.node.op for s in steps(c, "run")] == []
    same = lambda a, b: bool(((a == b) | (a.isnan() & b.isnan())).all()) and torch.equal(a.isnan(), b.isnan())  # noqa: E731
    assert same(wide, wide0) and torch.equal(wide.view(torch.int32)[~wide.isnan()], wide0.view(torch.int32)[~wide0.isnan()])
    assert same(narrow, narrow0)
    assert torch.equal(narrow.view(torch.int16)[~narrow.isnan()], narrow0.view(torch.int16)[~narrow0.isnan()])
