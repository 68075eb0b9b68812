"""Convolutions over small maps with the output channels as vectors (vtc/codegen/conv_bcast.py), against torch.

A one-group convolution with at most ``conv_bcast.MAX_PIXELS`` output pixels,
a reduction shorter than the dot form's (``conv_t.MIN_K``) and at least 16
output channels runs as the transposed product: W^T packed (once per weight version by the
call plan, else per call by 16 x 16 transposes, zero past the last channel), the im2col's pixels broadcast; the
report's ``path`` says "conv_bcast".  The tests check the values on odd maps
(1x1, 3x3, 5x9, 7x7) and channel counts (17, 127: partial vectors, tiles of 1
and 2 vectors, pixel tiles of 1-6), batch 1 and 16, a 3x3 with padding,
stride 2, a batch norm + ReLU in the epilogue, a channel shuffle / chunk in
front (ShuffleNet's unit at 7x7: nothing materialised), two threads, a weight
changed in place after compiling, and the convolutions that must not take it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import conv_bcast, conv_t
from vtc.zoo.shufflenet import ShuffleUnit

from .test_conv_t import check_conv_pushed_into_cat, check_shuffle_cat_conv
from .util import (ROW_TOL, assert_all_generated, assert_matches_eager, assert_no_movement, bn_relu, case_seed,
                   check_conv_bias_relu_on_two_threads, compile_cpu, gemm_paths, gen, kernels, rand, report)

pytestmark = pytest.mark.skipif(not conv_t.has_avx512(), reason="the broadcast form is taken on AVX-512 targets only")


# (batch, in channels, out channels, kernel, stride, height, width)
CASES = [
    (1, 232, 232, 1, 1, 7, 7),      # ShuffleNet's stage 4: 15 vectors = 5 tiles of 3, 49 pixels = 7 tiles of 7
    (1, 17, 17, 1, 1, 7, 7),        # two vectors, the second one lane
    (16, 127, 127, 1, 1, 3, 3),     # batch 16, 9 pixels: a tile of 7 and one of 2; 8 vectors: 3 + 3 + 2
    (16, 33, 17, 1, 1, 1, 1),       # one pixel per image
    (1, 17, 127, 3, 2, 14, 14),     # 3x3 stride 2 with padding, K = 153 (a stride-1 "same" one reads its im2col
    #                                 in place: test_same_3x3_on_a_small_map_takes_the_broadcast_form)
    (2, 19, 40, 3, 2, 13, 13),      # stride 2 on 13x13: 7x7 output pixels
    (1, 20, 48, 3, 2, 9, 17),       # stride 2: 5x9 = 45 pixels, 6 tiles of 7 + one of 3
    # a long reduction (>= conv_t.MIN_K, where the dot form ran before) on maps of up to conv_t.MAX_PIXELS
    (1, 259, 33, 1, 1, 7, 7),       # K = 259, 33 channels: 3 vectors, the last one lane
    (16, 264, 17, 1, 1, 1, 1),      # one pixel per image, batch 16
    (2, 29, 19, 3, 2, 9, 17),       # 3x3 stride 2, K = 261: 5x9 pixels
    (1, 2500, 17, 1, 1, 2, 3),      # K = 2500 in 5 slices of 500 (partial sums added), 6 pixels, 17 channels
    (1, 64, 48, 3, 2, 28, 28),      # 14x14 = 196 pixels (28 tiles of 7), K = 576 in two slices
    (1, 300, 40, 1, 1, 13, 14),     # 182 pixels: 26 tiles of 7
    (1, 232, 232, 1, 1, 14, 14),    # ShuffleNet's stage 4 first unit: 196 pixels (MAX_PIXELS), K = 232
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}c{}o{}k{}s{}_{}x{}".format(*c))
def test_broadcast_form_conv_bn_relu_matches_torch(case):
    b, c, o, k, s, h, w = case
    g = gen(case_seed(case, 991))
    weight = rand((o, c, k, k), g)
    post = bn_relu(g, o)

    def fn(x):
        return post(F.conv2d(x, weight, None, s, k // 2))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,), plan="all")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_all_generated(compiled)
    assert gemm_paths(compiled) == [conv_bcast.FORM]
    assert [(kn.kind, kn.source_nodes[0]) for kn in kernels(compiled)] == [("gemm", "convolution")]  # BN + ReLU fused
    # the executor's reference path: the kernel packs W^T itself (the call plan packs it once)
    torch.testing.assert_close(compiled._first.executor.run_steps([x])[0], fn(x), **ROW_TOL)


@pytest.mark.parametrize("batch", [1, 16])
def test_channel_shuffle_and_cat_in_front_of_a_long_reduction(batch):
    """cat -> channel shuffle -> 1x1 264 -> 37 -> BN -> ReLU (ShuffleNet's stage 4 into its last conv): one kernel,
    no movement materialised, the broadcast form."""
    check_shuffle_cat_conv(batch, conv_bcast.FORM)


@pytest.mark.parametrize("also_read", [False, True], ids=["in_place", "and_read"])
def test_result_pushed_into_a_cat(also_read):
    """conv -> BN -> ReLU stored straight into its part of a returned cat; when another kernel reads the result
    too, the kernel stores its own result and the cat's part."""
    check_conv_pushed_into_cat(also_read, conv_bcast.FORM)


def test_broadcast_form_with_bias_on_two_threads():
    """Blocks of output-channel vectors split between the threads (batch 1), and whole images (batch 3); 116 and
    160 channels on 14x14: blocks not rounded to whole tiles where that would give one thread more vectors."""
    check_conv_bias_relu_on_two_threads([(1, 232, 200, 1, 7, 7), (3, 50, 200, 1, 7, 7), (1, 116, 116, 1, 14, 14),
                                         (1, 160, 160, 1, 14, 14), (3, 116, 116, 1, 14, 14)], conv_bcast.FORM)


@pytest.mark.parametrize("batch", [1, 16])
def test_shufflenet_unit_at_7x7_moves_nothing(batch):
    """ShuffleNet's stage-4 unit (chunk -> 1x1 -> depthwise 3x3 -> 1x1 -> cat -> channel shuffle) and a 1x1 over
    its shuffled output, the three 1x1s in the broadcast form: no movement materialised."""
    torch.manual_seed(5 + batch)
    unit = torch.nn.Sequential(ShuffleUnit(66, 66, 1), torch.nn.Conv2d(66, 40, 1)).eval()
    for m in unit.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(batch, 66, 7, 7)
    compiled = compile_cpu(unit, (x,))
    assert_matches_eager(compiled, unit, (x,), **ROW_TOL)
    assert_no_movement(compiled)
    assert report(compiled)["materialized_movement_bytes"] == 0
    assert gemm_paths(compiled) == [conv_bcast.FORM] * 3


def test_weight_changed_in_place_is_read_by_the_next_call():
    """W^T is packed once by the call plan and again when the weight's version moves: a parameter changed in
    place after compiling is seen (more in tests/runtime/test_packed_conv_weights.py)."""
    conv = torch.nn.Conv2d(40, 56, 1, bias=False).eval()
    x = torch.randn(1, 40, 7, 7)
    compiled = compile_cpu(conv, (x,))
    assert gemm_paths(compiled) == [conv_bcast.FORM]
    assert_matches_eager(compiled, conv, (x,), **ROW_TOL)
    with torch.no_grad():
        conv.weight.mul_(-2.0).add_(0.5)
    assert_matches_eager(compiled, conv, (x,), **ROW_TOL)


@pytest.mark.parametrize("case", [(1, 116, 116, 1, 1, 16, 16, 1, "panels"), (1, 64, 64, 1, 1, 7, 7, 2, "panels"),
                                  (1, 300, 64, 1, 1, 7, 7, 1, conv_bcast.FORM), (1, 32, 8, 1, 1, 7, 7, 1, "panels"),
                                  (1, 24, 24, 3, 1, 14, 14, 1, "conv_taps"), (1, 64, 64, 1, 1, 14, 14, 1, "panels")],
                         ids=["256_pixels", "groups", "k300_broadcast", "8_channels", "same_3x3_196_pixels",
                              "196_pixels_64_channels"])
def test_other_convolutions_keep_their_form(case):
    b, c, o, k, s, h, w, groups, path = case
    g = gen(h * 10 + c + groups)
    weight = rand((o, c // groups, k, k), g)

    def fn(x):
        return F.conv2d(x, weight, None, s, k // 2, 1, groups)

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,))
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert gemm_paths(compiled) == [path]


def test_same_3x3_on_a_small_map_takes_the_broadcast_form():
    """A stride-1 "same" 3x3 on 7x7, whose im2col conv_panels could read in place (conv_taps), takes this form
    (measured faster on 6x6 and 7x7 maps: vtc/codegen/conv.py)."""
    g = gen(3)
    weight = rand((127, 17, 3, 3), g)

    def fn(x):
        return F.conv2d(x, weight, None, 1, 1)

    x = rand((1, 17, 7, 7), g)
    compiled = compile_cpu(fn, (x,))
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert gemm_paths(compiled) == [conv_bcast.FORM]


def test_switched_off_keeps_the_panel_form(monkeypatch):
    monkeypatch.setattr(conv_bcast, "ENABLED", False)
    conv = torch.nn.Conv2d(40, 56, 1, bias=False).eval()
    x = torch.randn(1, 40, 7, 7)
    compiled = compile_cpu(conv, (x,))
    assert gemm_paths(compiled) == ["panels"]
    assert "conv_bcast.ENABLED" in conv_bcast.why_not(dict(oh=7, ow=7, og=64, cg=100, kh=1, kw=1, groups=1), True)


def test_why_not_names_the_value():
    geo = dict(oh=7, ow=7, og=64, cg=100, kh=1, kw=1, groups=1, stride=(1, 1), wd=7)
    assert conv_bcast.why_not(geo, True) == ""
    assert conv_bcast.why_not({**geo, "oh": 14, "ow": 14}, True) == ""
    assert "196 output pixels" in conv_bcast.why_not({**geo, "oh": 14, "ow": 14, "cg": 64}, True)  # 64 < MID_K
    assert "256 output pixels" in conv_bcast.why_not({**geo, "oh": 16, "ow": 16}, True)
    assert "im2col in place" in conv_bcast.why_not({**geo, "oh": 8, "ow": 9, "wd": 9, "cg": 20, "kh": 3, "kw": 3}, True)
    assert "2 groups" in conv_bcast.why_not({**geo, "groups": 2}, True)
    assert conv_bcast.why_not({**geo, "cg": 300}, True) == ""  # a long reduction: as the dot form did
    assert conv_bcast.why_not({**geo, "cg": 300, "oh": 14, "ow": 14}, True) == ""
    assert "289 output pixels" in conv_bcast.why_not({**geo, "cg": 300, "oh": 17, "ow": 17}, True)
    assert "8 output channels" in conv_bcast.why_not({**geo, "og": 8}, True)
    assert "weight" in conv_bcast.why_not(geo, False)


@pytest.mark.parametrize("rows, vecs", [(8, 3), (7, 4)])
def test_other_tile_shapes_cover_every_tail(monkeypatch, rows, vecs):
    """ROWS up to 8 and VECS up to 4 (timed, not kept: docs/gemm.md): 49 pixels leave a tail of 1 / 0 pixels,
    15 vectors a tail of 3 / 0 vectors (tails of 7 pixels or 3 vectors were not handled before)."""
    monkeypatch.setattr(conv_bcast, "ROWS", rows)
    monkeypatch.setattr(conv_bcast, "VECS", vecs)
    g = gen(rows * 10 + vecs)
    for c, o, h in ((232, 232, 7), (40, 56, 3)):  # 15 vectors on 49 pixels; 4 vectors on 9 pixels (7 + 2 / 8 + 1)
        weight = rand((o, c, 1, 1), g)

        def fn(x):
            return torch.relu(F.conv2d(x, weight))

        x = rand((1, c, h, h), g)
        compiled = compile_cpu(fn, (x,))
        assert gemm_paths(compiled) == [conv_bcast.FORM]
        assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
