"""The implicit-GEMM convolution's own loops (vtc/codegen/conv_panels.py), against torch.

A stride-1 "same" convolution over a plain input reads B (the im2col) straight
from the input, tap by tap with lane masks for the padding ("conv_taps" in the
report); every other one packs B by blocks of columns.  Both run their epilogue
over columns just computed and cut the pixels into equal chunks per thread.
The tests check values on random shapes (odd sizes, dilation, groups, several
reduction slices and output-channel blocks, batch 1 and 16, one and two
threads), which path the report names, and the unit they are for (YOLOv11's
C3k2, whose chunk and cat move nothing).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import conv_panels, winograd

from .util import (case_seed, ROW_TOL, assert_all_generated, assert_matches_eager, assert_no_movement, compile_cpu, gen,
                   kernels, rand, report, run_gemm_built_for, torch_threads)

# (batch, in channels, out channels, kernel, padding, dilation, groups, height, width)
TAPS = [
    (1, 32, 32, 3, 1, 1, 1, 40, 40),  # C3k2's bottleneck conv
    (1, 3, 17, 3, 1, 1, 1, 1, 127),  # one input row: the vertical taps all in the padding
    (16, 5, 7, 3, 1, 1, 1, 9, 9),
    (2, 4, 6, 3, 2, 2, 1, 11, 13),  # dilation 2
    (1, 6, 10, (3, 5), (1, 2), 1, 2, 7, 17),  # 3x5, groups
    (1, 2, 3, 3, 1, 1, 1, 5, 5),  # two input channels, a tile of three rows
    (1, 64, 13, 3, 1, 1, 1, 17, 17),  # K = 576: two reduction slices of whole channels
    (1, 8, 300, 3, 1, 1, 1, 9, 9),  # several output-channel blocks (on 6x6 the broadcast form, conv_bcast)
]


def _bn_silu(g, c):
    mean, var = rand((c,), g), rand((c,), g, positive=True)
    gamma, beta = rand((c,), g), rand((c,), g)
    return lambda y: F.silu(F.batch_norm(y, mean, var, gamma, beta, training=False, eps=1e-5))


@pytest.mark.parametrize("case", TAPS, ids=lambda c: "b{}c{}o{}k{}p{}d{}g{}_{}x{}".format(*c))
def test_same_convolution_reads_the_input_tap_by_tap(case, monkeypatch):
    monkeypatch.setattr(winograd, "ENABLED", False)  # the 32 -> 32 on 40x40 would run as Winograd
    b, c, o, k, p, d, groups, h, w = case
    g = gen(case_seed(case, 983))
    kk = (k, k) if isinstance(k, int) else k
    weight = rand((o, c // groups, *kk), g)
    post = _bn_silu(g, o)

    def fn(x):
        return post(F.conv2d(x, weight, None, 1, p, d, groups))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_all_generated(compiled)
    assert [q["path"] for q in report(compiled)["gemm"]] == [conv_panels.TAPS_PATH]
    assert [kn.kind for kn in kernels(compiled)] == ["gemm"]  # BN + SiLU in the epilogue


@pytest.mark.parametrize("front", ["cat", "pad", "stride2", "1x1"])
def test_other_convolutions_pack_b_by_columns(front):
    """A cat or pad in front (not one plain load), a stride, a 1x1 convolution: B packed, path "panels"."""
    g = gen(7)
    x, y = rand((1, 6, 13, 11), g), rand((1, 5, 13, 11), g)
    weight = rand((9, 11, 1, 1) if front == "1x1" else (9, 11 if front != "pad" else 6, 3, 3), g)

    def fn(x, y):
        if front == "cat":
            return F.relu(F.conv2d(torch.cat([x, y], 1), weight, None, 1, 1))
        if front == "pad":
            return F.relu(F.conv2d(F.pad(x, (1, 1, 1, 1)), weight))
        return F.relu(F.conv2d(torch.cat([x, y], 1), weight, None, 2 if front == "stride2" else 1,
                               0 if front == "1x1" else 1))

    compiled = compile_cpu(fn, (x, y), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x, y), **ROW_TOL)
    assert_no_movement(compiled)
    assert [q["path"] for q in report(compiled)["gemm"]] == ["panels"]


@pytest.mark.parametrize("k", [1, 3])
def test_two_threads_take_equal_chunks_of_pixels(k):
    """Batch 1: the pixels cut in two chunks (1600 -> 800 + 800), one per thread; batch 3: whole images."""
    with torch_threads(2):
        for b, hw in ((1, 40), (3, 17)):
            g = gen(b * 10 + k)
            weight = rand((20, 16, k, k), g)
            post = _bn_silu(g, 20)

            def fn(x):
                return post(F.conv2d(x, weight, None, 1, k // 2)) + x[:, :1]

            x = rand((b, 16, hw, hw), g)
            compiled = compile_cpu(fn, (x,), gemm="vtc")
            assert_matches_eager(compiled, fn, (x,), **ROW_TOL)


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_without_avx512_the_taps_path_packs(march, tmp_path):
    """Built for AVX2 or plain x86-64, the same kernel source packs B (the in-place reads are AVX-512 only)."""
    g = gen(5)
    weight = rand((7, 5, 3, 3), g)

    def fn(x, weight):
        return F.silu(F.conv2d(x, weight, None, 1, 1))

    x = rand((2, 5, 9, 11), g)
    compiled = compile_cpu(fn, (x, weight), plan="all", gemm="vtc")
    assert [q["path"] for q in report(compiled)["gemm"]] == [conv_panels.TAPS_PATH]
    out = run_gemm_built_for(march, kernels(compiled)[0], compiled, (x, weight), tmp_path, stem=f"taps_{march}")
    torch.testing.assert_close(out, fn(x, weight), **ROW_TOL)


@pytest.mark.parametrize("batch", [1, 16])
def test_c3k2_block_moves_nothing(batch):
    """YOLOv11 C3k2 (c3k=True) at 12x12: its 3x3 convs read their inputs in place, the chunk and cat move
    nothing, every conv is one generated kernel with BN + SiLU (and the residual add) in its epilogue."""
    from bench.workloads.c3k2 import C3k2

    torch.manual_seed(batch)
    model = C3k2(16, 16, n=1, c3k=True).eval()
    x = torch.randn(batch, 16, 12, 12)
    compiled = compile_cpu(model, (x,))
    with torch.no_grad():
        assert_matches_eager(compiled, model, (x,), **ROW_TOL)
    rep = report(compiled)
    assert rep["materialized_movement_bytes"] == 0
    paths = sorted(q["path"] for q in rep["gemm"])
    assert paths == ["conv_taps"] * 4 + ["panels"] * 5
    assert all(kn.kind == "gemm" for kn in kernels(compiled))
