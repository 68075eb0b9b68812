"""Winograd F(2x2, 3x3) for small 3x3 "same" convolutions (vtc/codegen/winograd.py), against torch eager.

The form runs a float32 3x3 stride-1 padding-1 convolution of 16..256 input and output channels (multiples
of 16) over a map of at least 14x14 output pixels: the report names its path "winograd", the convolution is
one kernel with its batch norm, SiLU and residual in the epilogue.  Values on random inputs (odd sizes, tile
rows cut between threads, batch 1 and 3, one and two threads) within the convolution tests' tolerances, a
YOLOv11 C3k2 unit (its four bottleneck convolutions), and the convolutions that keep the other paths.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import conv_panels, winograd

from .util import (ROW_TOL, assert_all_generated, assert_matches_eager, case_seed, compile_cpu, gen, kernels, rand,
                   report, torch_threads)

pytestmark = pytest.mark.skipif(not winograd.conv_t.has_avx512(), reason="the Winograd form is AVX-512 only")

# (batch, in channels, out channels, height, width)
CASES = [
    (1, 32, 32, 40, 40),  # C3k2's bottleneck conv
    (3, 32, 48, 17, 23),  # odd sizes: a half tile at the right and bottom; 48 = one pair of vectors and one vector
    (1, 64, 16, 16, 31),
    (2, 16, 64, 29, 16),  # two images: one per thread
    (1, 32, 32, 21, 130),  # several sub-bands per image (130 columns: 65 tiles a row)
    (1, 128, 128, 14, 14),  # the smallest side; 128 channels
]


def _bn_silu(g, c):
    mean, var = rand((c,), g), rand((c,), g, positive=True)
    gamma, beta = rand((c,), g), rand((c,), g)
    return lambda y: F.silu(F.batch_norm(y, mean, var, gamma, beta, training=False, eps=1e-5))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}c{}o{}_{}x{}".format(*c))
def test_winograd_convolution_matches_eager(case):
    b, c, o, h, w = case
    g = gen(case_seed(case, 877))
    weight = rand((o, c, 3, 3), g)
    post = _bn_silu(g, o)

    def fn(x):
        return post(F.conv2d(x, weight, None, 1, 1))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
    for threads in (1, 2):  # the kernel takes torch's thread count at each call
        with torch_threads(threads):
            assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_all_generated(compiled)
    assert [q["path"] for q in report(compiled)["gemm"]] == [winograd.FORM]
    assert [kn.kind for kn in kernels(compiled)] == ["gemm"]  # BN + SiLU in the epilogue


def test_max_channels():
    """256 -> 256 on 14x14 (MAX_CHANNELS), weights x 0.25: with the default magnitudes the 2304 products per output
    put every float32 form near the tolerance against float64 (eager 0.49x of it, conv_bcast 0.76x, this 0.83x),
    and comparing with eager adds eager's own error."""
    g = gen(256)
    weight = rand((256, 256, 3, 3), g) * 0.25
    post = _bn_silu(g, 256)

    def fn(x):
        return post(F.conv2d(x, weight, None, 1, 1))

    x = rand((1, 256, 14, 14), g)
    compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert [q["path"] for q in report(compiled)["gemm"]] == [winograd.FORM]


def test_bottleneck_residual_and_bias():
    """Two chained Winograd convolutions, the second with a bias and the residual in its epilogue (weights of
    0.02..0.1: with the default 0.25..2 the chain reaches thousands and the taps path misses the tolerances too)."""
    g = gen(41)
    w1, w2 = rand((32, 32, 3, 3), g, low=0.02, high=0.1), rand((32, 32, 3, 3), g, low=0.02, high=0.1)
    bias = rand((32,), g)
    bn1, bn2 = _bn_silu(g, 32), _bn_silu(g, 32)

    def fn(x):
        return x + bn2(F.conv2d(bn1(F.conv2d(x, w1, None, 1, 1)), w2, bias, 1, 1))

    x = rand((1, 32, 19, 33), g)
    compiled = compile_cpu(fn, (x,), plan="greedy", gemm="auto")
    for threads in (1, 2):
        with torch_threads(threads):
            assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert [q["path"] for q in report(compiled)["gemm"]] == [winograd.FORM] * 2
    assert len(kernels(compiled)) == 2


def test_pushed_into_a_cat():
    """The epilogue's store goes through a push mapping: the convolution's output is half of a cat."""
    g = gen(42)
    weight = rand((32, 32, 3, 3), g)
    post = _bn_silu(g, 32)

    def fn(x, y):
        return torch.cat((post(F.conv2d(x, weight, None, 1, 1)), y), 1) * 2.0

    x, y = rand((1, 32, 24, 20), g), rand((1, 16, 24, 20), g)
    compiled = compile_cpu(fn, (x, y), plan="greedy", gemm="auto")
    assert_matches_eager(compiled, fn, (x, y), **ROW_TOL)
    assert [q["path"] for q in report(compiled)["gemm"]] == [winograd.FORM]


def test_c3k2_unit():
    """YOLOv11's C3k2(64, 64, n=1, c3k=True): its four 3x3 bottleneck convolutions (32 -> 32) run as Winograd."""
    from bench.workloads.c3k2 import C3k2

    torch.manual_seed(5)
    model = C3k2(64, 64, n=1, c3k=True).eval()
    x = rand((3, 64, 20, 18), gen(43))
    with torch.no_grad():
        compiled = compile_cpu(model, (x,), plan="greedy", gemm="auto")
        for threads in (1, 2):  # 3 images on 2 threads: each image's tile rows cut between the threads
            with torch_threads(threads):
                assert_matches_eager(compiled, model, (x,), **ROW_TOL)
    paths = [q["path"] for q in report(compiled)["gemm"]]
    assert paths.count(winograd.FORM) == 4, paths


def test_input_a_slice_of_channels():
    """The input is channels 16..47 of a 64-channel tensor (a chunk): one plain load, offset by 16 planes, images
    64 planes apart."""
    g = gen(45)
    weight = rand((32, 32, 3, 3), g)
    post = _bn_silu(g, 32)

    def fn(x):
        return post(F.conv2d(x[:, 16:48], weight, None, 1, 1))

    x = rand((3, 64, 18, 21), g)
    compiled = compile_cpu(fn, (x,), plan="greedy", gemm="auto")
    for threads in (1, 2):
        with torch_threads(threads):
            assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert [q["path"] for q in report(compiled)["gemm"]] == [winograd.FORM]


def test_input_through_a_cat_keeps_the_panels():
    """A cat in front is two loads, not one plain one: the im2col is packed by runs through it instead."""
    g = gen(46)
    weight = rand((32, 32, 3, 3), g)

    def fn(a, b):
        return F.silu(F.conv2d(torch.cat((a, b), 1), weight, None, 1, 1))

    a, b = rand((1, 16, 20, 20), g), rand((1, 16, 20, 20), g)
    compiled = compile_cpu(fn, (a, b), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (a, b), **ROW_TOL)
    assert [q["path"] for q in report(compiled)["gemm"]] == ["panels"]


@pytest.mark.parametrize("case", [
    (1, 32, 32, 3, 2, 1, 1, 40, 40),  # stride 2
    (1, 32, 32, 3, 1, 2, 1, 40, 40),  # dilation 2 (padding 2)
    (1, 32, 32, 3, 1, 1, 2, 40, 40),  # two groups
    (1, 24, 32, 3, 1, 1, 1, 40, 40),  # 24 input channels
    (1, 32, 32, 3, 1, 1, 1, 12, 12),  # a small map
    (1, 32, 32, 3, 1, 1, 1, 4, 200),  # a map of four rows
    (1, 272, 32, 3, 1, 1, 1, 16, 16),  # more input channels than MAX_CHANNELS
], ids=["stride2", "dil2", "groups2", "c24", "12x12", "4x200", "c272"])
def test_other_convolutions_keep_their_paths(case):
    b, c, o, k, s, d, groups, h, w = case
    g = gen(case_seed(case, 877))
    weight = rand((o, c // groups, k, k), g)

    def fn(x):
        return F.silu(F.conv2d(x, weight, None, s, d, d, groups))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert [q["path"] for q in report(compiled)["gemm"]] != [winograd.FORM]


def test_switch_off_gives_the_taps_path(monkeypatch):
    monkeypatch.setattr(winograd, "ENABLED", False)
    g = gen(44)
    weight = rand((32, 32, 3, 3), g)

    def fn(x):
        return F.silu(F.conv2d(x, weight, None, 1, 1))

    x = rand((1, 32, 40, 40), g)
    compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert [q["path"] for q in report(compiled)["gemm"]] == [conv_panels.TAPS_PATH]


def test_band_rows():
    assert winograd.band_rows(20, 20) == 3  # 60 tiles: whole micro-kernels of 12
    assert winograd.band_rows(65, 11) == 1  # 65 tiles a row: one row a band
    assert winograd.band_rows(8, 3) == 3  # fewer rows than fit
    for tw, th in ((20, 20), (9, 30), (16, 8), (3, 100)):
        sb = winograd.band_rows(tw, th)
        assert 1 <= sb <= th and sb * tw <= max(tw, winograd.BAND_TILES)
