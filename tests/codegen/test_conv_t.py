"""Convolutions over small maps as dot products (vtc/codegen/conv_t.py), against torch.

A convolution with at most ``conv_t.MAX_PIXELS`` output pixels and a reduction
(input channels x taps per group) of at least ``conv_t.MIN_K`` runs as dot
products along the reduction, the weight read in place and the im2col packed
transposed; the report's ``path`` says "conv_dot".  The tests check the values on
odd maps (1x1, 2x3, 3x3, 3x5, 5x9, 7x7), channel counts that leave partial
tiles, batch 1 and 16, groups, stride 2, a reduction cut into two slices, a
batch norm + ReLU computed in the epilogue, a channel shuffle / cat in front
(packed through its mapping, nothing materialised), the result pushed into a
cat (ShuffleNet's unit), two threads, and cases that must keep the panel form.
A one-group convolution that the dot form takes is taken by the broadcast form
(vtc/codegen/conv_bcast.py, measured faster) unless that is off: the tests of
the dot form's values turn it off (``no_bcast``); grouped ones keep the dot form.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import conv_bcast, conv_t

from .util import (ROW_TOL, assert_all_generated, assert_matches_eager, assert_no_movement, bn_relu, case_seed,
                   channel_shuffle, check_conv_bias_relu_on_two_threads, compile_cpu, gemm_paths, gen, kernels, rand,
                   report)

pytestmark = pytest.mark.skipif(not conv_t.has_avx512(), reason="the dot form is taken on AVX-512 targets only")


@pytest.fixture
def no_bcast(monkeypatch):
    """The broadcast form off: one-group convolutions over small maps take the dot form."""
    monkeypatch.setattr(conv_bcast, "ENABLED", False)


# (batch, in channels, out channels, kernel, stride, groups, height, width)
CASES = [
    (1, 259, 33, 1, 1, 1, 7, 7),     # 49 pixels: 12 tiles of 4 + 1; 33 channels: 5 x 6 + 2 + 1
    (16, 264, 17, 1, 1, 1, 1, 1),    # one pixel per image, batch 16
    (1, 30, 40, 3, 1, 1, 3, 3),      # 3x3 taps over a 3x3 map (K = 270, padding on every side)
    (2, 29, 19, 3, 2, 1, 9, 17),     # stride 2: 5x9 output pixels
    (3, 260, 18, 3, 1, 2, 3, 5),     # two groups of 130 x 9 taps, 15 pixels
    (1, 2500, 10, 1, 1, 1, 2, 3),    # K = 2500 in two slices (partial sums added), 6 pixels
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}c{}o{}k{}s{}g{}_{}x{}".format(*c))
def test_dot_form_conv_bn_relu_matches_torch(case, no_bcast):
    b, c, o, k, s, groups, h, w = case
    g = gen(case_seed(case, 997))
    weight = rand((o, c // groups, k, k), g)
    post = bn_relu(g, o)

    def fn(x):
        return post(F.conv2d(x, weight, None, s, k // 2, 1, groups))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,), plan="all")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_all_generated(compiled)
    assert gemm_paths(compiled) == [conv_t.FORM]
    assert [(kn.kind, kn.source_nodes[0]) for kn in kernels(compiled)] == [("gemm", "convolution")]  # BN + ReLU fused


def test_dot_form_on_two_threads(no_bcast):
    """Output-channel blocks split between the threads (batch 1), and whole images (batch 2)."""
    check_conv_bias_relu_on_two_threads([(1, 130, 300, 1, 14, 13), (2, 64, 300, 1, 14, 13)], conv_t.FORM)


@pytest.mark.parametrize("batch", [1, 16])
def test_channel_shuffle_and_cat_in_front_are_packed_through(batch, no_bcast):
    """cat -> channel shuffle -> 1x1 conv -> BN -> ReLU (ShuffleNet's stage 4 into its last conv): one kernel,
    no movement materialised, the dot form."""
    check_shuffle_cat_conv(batch, conv_t.FORM)


def check_shuffle_cat_conv(batch: int, form: str) -> None:
    """cat -> channel shuffle -> 1x1 264 -> 37 -> BN -> ReLU compiled: matches eager, one generated kernel of
    `form`, no movement materialised."""
    g = gen(31 + batch)
    weight = rand((37, 264, 1, 1), g)
    post = bn_relu(g, 37)

    def fn(a, b):
        return post(F.conv2d(channel_shuffle(torch.cat([a, b], 1)), weight))

    inputs = (rand((batch, 132, 7, 7), g), rand((batch, 132, 7, 7), g))
    compiled = compile_cpu(fn, inputs, plan="all")
    assert_matches_eager(compiled, fn, inputs, **ROW_TOL)
    assert_no_movement(compiled)
    assert_all_generated(compiled)
    assert gemm_paths(compiled) == [form]
    assert report(compiled)["materialized_movement_bytes"] == 0


@pytest.mark.parametrize("also_read", [False, True], ids=["in_place", "and_read"])
def test_result_pushed_into_a_cat(also_read, no_bcast):
    """The ShuffleNet unit's branch: conv -> BN -> ReLU stored straight into its part of a returned cat (the
    cat's block is the accumulator's layout); when another kernel reads the result too, the kernel stores its
    own result and the cat's part, each element twice."""
    compiled = check_conv_pushed_into_cat(also_read, conv_t.FORM)
    [k] = [k for k in kernels(compiled) if k.kind == "gemm"]
    assert [st.buffer.name for st in k.stores][-1] == "cat" and len(k.stores) == 1 + also_read


def check_conv_pushed_into_cat(also_read: bool, form: str):
    """conv 270 -> 24 -> BN -> ReLU, returned inside a cat (and, with `also_read`, read by a sigmoid too),
    compiled: matches eager, the convolution takes `form` and stores into the cat.  Returns the compiled model."""
    g = gen(41)
    weight = rand((24, 270, 1, 1), g)
    post = bn_relu(g, 24)

    def fn(x, y):
        r = post(F.conv2d(x, weight))
        return (torch.cat([y, r], 1), torch.sigmoid(r)) if also_read else torch.cat([y, r], 1)

    inputs = (rand((2, 270, 5, 9), g), rand((2, 24, 5, 9), g))
    compiled = compile_cpu(fn, inputs, plan="all")
    assert_matches_eager(compiled, fn, inputs, **ROW_TOL)
    [choice] = report(compiled)["gemm"]
    assert choice["path"] == form and choice["stores_into"] == ["cat"], choice
    return compiled


@pytest.mark.parametrize("case", [(1, 300, 40, 1, 17, 17), (1, 116, 116, 1, 7, 7), (1, 3, 24, 3, 15, 15)],
                         ids=["289_pixels", "k116", "stem_k27"])
def test_large_maps_and_short_reductions_keep_the_panel_form(case):
    b, c, o, k, h, w = case
    g = gen(h * 10 + c)
    weight = rand((o, c, k, k), g)
    post = bn_relu(g, o)

    def fn(x):
        return post(F.conv2d(x, weight, None, 1, k // 2))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,))
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    # the implicit GEMM's loops: B packed into panels, or read in place tap by tap (vtc.codegen.conv_panels); a
    # short reduction on 7x7 has the output channels as vectors (vtc.codegen.conv_bcast)
    path = "conv_taps" if k == 3 else "conv_bcast" if h == 7 else "panels"
    assert [(q["choice"], q["path"]) for q in report(compiled)["gemm"]] == [("vtc", path)]


def test_why_not_names_the_value():
    geo = dict(oh=17, ow=17, og=64, cg=300, kh=1, kw=1)
    assert "289 output pixels" in conv_t.why_not(geo, True)
    assert "reduction of 116" in conv_t.why_not({**geo, "oh": 7, "ow": 7, "cg": 116}, True)
    assert conv_t.why_not({**geo, "oh": 7, "ow": 7}, True) == ""
    assert "weight" in conv_t.why_not({**geo, "oh": 7, "ow": 7}, False)
