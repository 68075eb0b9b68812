"""Convolution units, session 16 (docs/gemm.md, "Convolution units, session 16"), against torch eager.

At batch 16 a unit's activations no longer stay in L2 between its convolutions: the stride-1 "same"
convolutions that read B in place (conv_taps) prefetch each input channel's lines a few strips ahead, and
a 1x1 convolution's pack prefetches each input row's next block of columns.  The tests check the values
(odd sizes where the prefetches run past the input's end, batch 1 and 16, one and two threads) and that the
sources carry the prefetches.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import conv, conv_panels, winograd
from vtc.codegen.cpp import generate

from .util import ROW_TOL, assert_matches_eager, case_seed, compile_cpu, gen, kernels, rand, report, torch_threads


def _bn_silu(g, c):
    mean, var = rand((c,), g), rand((c,), g, positive=True)
    gamma, beta = rand((c,), g), rand((c,), g)
    return lambda y: F.silu(F.batch_norm(y, mean, var, gamma, beta, training=False, eps=1e-5))


def _sources(compiled) -> str:
    return "\n".join(generate(k) for k in kernels(compiled))


# (batch, in channels, out channels, kernel, height, width)
CASES = [
    (1, 32, 32, 3, 40, 40),  # C3k2's bottleneck conv
    (16, 7, 13, 3, 9, 11),  # batch 16, odd sizes: the last strips' prefetches past the input
    (1, 5, 30, 3, 3, 37),  # one strip of three rows
    (16, 19, 11, 1, 13, 7),  # a 1x1: the pack's prefetch of the next block, past the input's end
    (1, 64, 40, 1, 20, 30),  # 600 columns: several blocks of 256
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}c{}o{}k{}_{}x{}".format(*c))
@pytest.mark.parametrize("threads", [1, 2])
def test_prefetching_convolutions_match_eager(case, threads, monkeypatch):
    monkeypatch.setattr(winograd, "ENABLED", False)  # the conv_taps path's prefetches (40x40 x 32: Winograd)
    b, c, o, k, h, w = case
    g = gen(case_seed(case, 541) + threads)
    weight = rand((o, c, k, k), g)
    post = _bn_silu(g, o)

    def fn(x):
        return post(F.conv2d(x, weight, None, 1, k // 2))

    x = rand((b, c, h, w), g)
    with torch_threads(threads):
        compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
        assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    src = _sources(compiled)
    if k == 3:
        assert [q["path"] for q in report(compiled)["gemm"]] == [conv_panels.TAPS_PATH]
        assert f"cv_shift[TAPS - 1] + {conv_panels.PREFETCH_STRIPS} * VTC_NR" in src
    else:
        assert "__builtin_prefetch(pf + l, 0, 2)" in src


def test_prefetches_can_be_switched_off(monkeypatch):
    """PREFETCH_STRIPS = 0 / PREFETCH_NEXT = False: the sources without them (the A/B switches), same values."""
    monkeypatch.setattr(conv_panels, "PREFETCH_STRIPS", 0)
    monkeypatch.setattr(conv, "PREFETCH_NEXT", False)
    g = gen(3)
    w3, w1 = rand((6, 5, 3, 3), g), rand((4, 6, 1, 1), g)

    def fn(x):
        return F.conv2d(F.silu(F.conv2d(x, w3, None, 1, 1)), w1)

    x = rand((2, 5, 7, 9), g)
    compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    src = _sources(compiled)
    assert "cv_shift[TAPS - 1]" not in src and "__builtin_prefetch(pf + l" not in src


@pytest.mark.parametrize("batch", [1, 16])
def test_inlined_producer_rows_prefetch_their_input(batch):
    """A 1x1 over cat(x, silu(bn(z))) with the BN + SiLU inlined into the pack (C3k2's projection over its
    cat): the rows of both pieces prefetch their input's next block, the inlined piece its load of z."""
    g = gen(batch + 40)
    w = rand((9, 11, 1, 1), g)
    post = _bn_silu(g, 5)

    def fn(x, z):
        return F.conv2d(torch.cat([x, post(z)], 1), w)

    x, z = rand((batch, 6, 17, 19), g), rand((batch, 5, 17, 19), g)
    compiled = compile_cpu(fn, (x, z), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x, z), **ROW_TOL)
    assert [kn.kind for kn in kernels(compiled)] == ["gemm"]  # the BN + SiLU inlined into the pack
    assert _sources(compiled).count("__builtin_prefetch(pf + l, 0, 2)") == 2


# (batch, channels, kernel (kh, kw), padding (ph, pw), dilation (dh, 1), height, width)
WIDE_DW = [
    (1, 384, (5, 5), (2, 2), (1, 1), 28, 28),  # EfficientViT's aggregation conv
    (2, 7, (5, 5), (2, 2), (1, 1), 9, 13),  # odd sizes: the last chunk past the plane
    (1, 5, (5, 5), (1, 2), (1, 1), 6, 11),  # fewer output rows than input rows
    (16, 3, (7, 7), (3, 3), (1, 1), 5, 4),  # taps wider than the plane
    (1, 4, (3, 5), (2, 2), (2, 1), 8, 17),  # dilation along the height
    (1, 6, (1, 16), (0, 8), (1, 1), 3, 21),  # 16 taps across, the widest it takes
    (1, 512, (3, 3), (1, 1), (1, 1), 28, 28),  # EfficientViT's MBConv depthwise
    (16, 9, (3, 3), (1, 1), (1, 1), 7, 7),  # ShuffleNet's stage-4 depthwise, batch 16
]


@pytest.mark.parametrize("case", WIDE_DW, ids=lambda c: "b{}c{}k{}x{}p{}x{}d{}_{}x{}".format(
    c[0], c[1], *c[2], *c[3], c[4][0], c[5], c[6]))
def test_wide_depthwise_shifts_two_loads_per_tap_row(case):
    b, c, (kh, kw), pad, dil, h, w = case
    g = gen(case_seed(case, 313))
    weight, bias = rand((c, 1, kh, kw), g), rand((c,), g)
    post = _bn_silu(g, c)

    def fn(x):
        return post(F.conv2d(x, weight, bias, 1, pad, dil, c))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,), plan="all")
    if 2 * pad[1] == kw - 1:  # output rows as long as input rows: the flat form
        assert "_mm512_alignr_epi32" in _sources(compiled)
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)


def test_wide_depthwise_after_a_channel_shuffle():
    """A channel shuffle in front: each plane's pointer picked per channel, the taps as before."""
    from .util import channel_shuffle

    g = gen(77)
    weight = rand((12, 1, 5, 5), g)

    def fn(x):
        return F.conv2d(channel_shuffle(x, 3), weight, None, 1, 2, 1, 12)

    x = rand((2, 12, 10, 10), g)
    compiled = compile_cpu(fn, (x,), plan="all")
    assert "_mm512_alignr_epi32" in _sources(compiled)
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
