"""Convolutions with a very short reduction over a large map, straight from the input (vtc/codegen/conv_direct.py).

A one-group convolution with a reduction of at most ``conv_direct.MAX_K``
(a 3x3 over up to 3 channels: a network's stem), at least
``conv_direct.MIN_PIXELS`` output pixels and a width stride of 1 or 2 runs
without an im2col: tiles of 16 output pixels of one row x up to 24 output
channels, each reduction row one masked load (two and their even lanes at
stride 2); the report's ``path`` says "conv_direct".  The tests check the
values on odd maps and channel counts (8, 17, 30: one tile, two tiles of 15),
batch 2, strides (2, 2), (1, 1), (2, 1), a 5x5 and a dilated 3x3 with
padding, a batch norm + ReLU and a bias in the epilogue, two threads, and the
convolutions that must keep the panel form (an input that is no plain load,
a longer reduction, a 1x1, a small map).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import conv_direct, conv_t
from vtc.codegen.cpp import generate

from .util import (ROW_TOL, assert_all_generated, assert_matches_eager, bn_relu, case_seed,
                   check_conv_bias_relu_on_two_threads, compile_cpu, gemm_paths, gen, kernels, rand)

pytestmark = pytest.mark.skipif(not conv_t.has_avx512(), reason="the direct form is taken on AVX-512 targets only")


# (batch, in channels, out channels, kernel, stride (h, w), padding, dilation, height, width)
CASES = [
    (1, 3, 24, 3, (2, 2), 1, 1, 224, 224),   # ShuffleNetV2's stem: 112 x 112 outputs, 7 tiles of 16 per row
    (1, 3, 17, 3, (2, 2), 1, 1, 65, 67),     # odd map: 33 x 34 outputs (a 2-lane tile per row), a tile of 17
    (2, 3, 30, 3, (2, 2), 1, 1, 64, 70),     # batch 2, 30 channels: two tiles of 15
    (1, 2, 8, 3, (1, 1), 1, 1, 40, 33),      # stride 1, 8 channels (one tile of 8), a 1-lane tile per row
    (1, 2, 19, 4, (2, 2), 2, 1, 70, 71),     # 4x4 over 2 channels, padding 2 (K = 32)
    (1, 3, 16, 3, (1, 1), 2, 2, 33, 37),     # dilation 2, padding 2
    (1, 3, 12, 3, (2, 1), 1, 1, 61, 45),     # stride 2 along the height, 1 along the width
    (1, 3, 9, 2, (2, 2), 0, 1, 90, 91),      # 2x2 without padding: the last input column unread
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}c{}o{}k{}s{}{}p{}d{}_{}x{}".format(*c[:4], *c[4], *c[5:]))
def test_direct_form_conv_bn_relu_matches_torch(case):
    b, c, o, k, s, p, d, h, w = case
    g = gen(case_seed(case, 557))
    weight = rand((o, c, k, k), g)
    post = bn_relu(g, o)

    def fn(x):
        return post(F.conv2d(x, weight, None, s, p, d))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,), plan="all")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_all_generated(compiled)
    assert gemm_paths(compiled) == [conv_direct.FORM]
    assert [(kn.kind, kn.source_nodes[0]) for kn in kernels(compiled)] == [("gemm", "convolution")]  # BN + ReLU fused
    src = generate(kernels(compiled)[0])
    assert f"vtc_cd_tile<{-(-o // -(-o // 24))}, {s[1]}>" in src and "__builtin_prefetch(" in src


def test_direct_form_with_bias_on_two_threads():
    """Output rows split between the threads (batch 1 and 3)."""
    check_conv_bias_relu_on_two_threads([(1, 24, 3, 3, 97, 101), (3, 40, 3, 3, 97, 101)], conv_direct.FORM,
                                        stride=2, padding=1)


def test_other_convolutions_keep_the_panel_form():
    """A reduction over 4 channels x 9 taps (36 > MAX_K), a 1x1, a small map, and inputs that are no plain load
    with unit stride along the width (a transposed input, a cat in front): the panel form, same values."""
    g = gen(77)
    w4, w1, w3 = rand((24, 4, 3, 3), g), rand((24, 3, 1, 1), g), rand((24, 3, 3, 3), g)
    cases = [
        (lambda x: F.conv2d(x, w4, None, 2, 1), (rand((1, 4, 80, 80), g),)),
        (lambda x: F.conv2d(x, w1), (rand((1, 3, 64, 64), g),)),
        (lambda x: F.conv2d(x, w3, None, 2, 1), (rand((1, 3, 40, 40), g),)),  # 20 x 20 = 400 outputs
        (lambda x: F.conv2d(x.transpose(2, 3), w3, None, 2, 1), (rand((1, 3, 80, 72), g),)),
        (lambda x, y: F.conv2d(torch.cat([x, y], 1), w3, None, 2, 1), (rand((1, 1, 80, 72), g),
                                                                       rand((1, 2, 80, 72), g))),
    ]
    for fn, inputs in cases:
        compiled = compile_cpu(fn, inputs, plan="all")
        assert_matches_eager(compiled, fn, inputs, **ROW_TOL)
        assert conv_direct.FORM not in gemm_paths(compiled), gemm_paths(compiled)
