"""Depthwise convolutions as pointwise kernels (vtc/codegen/conv.py), against torch.

A depthwise convolution reads its input through any mapping in front of it
(channel shuffle, split, pad, cat), and the batch norm / activation after it
are computed in the same kernel.  The tests check the values on random shapes
(odd sizes, strides, padding, dilation, channel multipliers), that the whole
pattern is one generated kernel with no movement materialised, and that a
convolution that is not depthwise is left to torch with the reason recorded.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .util import (ROW_TOL, assert_all_generated, assert_matches_eager, assert_no_movement, compile_cpu, executor,
                   gen, kernels, rand)

# (batch, channels, multiplier, kernel, stride, padding, dilation, height, width)
CASES = [
    (1, 1, 1, 3, 1, 1, 1, 1, 1),
    (2, 3, 1, 3, 1, 1, 1, 17, 17),
    (1, 8, 2, 3, 2, 1, 1, 16, 15),
    (2, 5, 1, 5, 1, 2, 2, 13, 11),
    (1, 4, 1, 3, 2, 0, 1, 9, 9),
    (3, 6, 1, 1, 1, 0, 1, 7, 3),
    (1, 3, 3, (3, 5), (1, 2), (1, 2), 1, 12, 127),
    (16, 4, 1, 7, 1, 3, 1, 8, 8),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}c{}m{}k{}s{}p{}d{}_{}x{}".format(*c))
def test_depthwise_conv_bn_relu_is_one_kernel(case):
    b, c, mult, k, s, p, d, h, w = case
    g = gen(hash(case) % 1000)
    weight, bias = rand((c * mult, 1, *((k, k) if isinstance(k, int) else k)), g), rand((c * mult,), g)
    mean, var = rand((c * mult,), g), rand((c * mult,), g, positive=True)
    gamma, beta = rand((c * mult,), g), rand((c * mult,), g)

    def fn(x):
        y = F.conv2d(x, weight, bias, s, p, d, groups=c)
        return torch.relu(F.batch_norm(y, mean, var, gamma, beta, training=False, eps=1e-5))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,), plan="all")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_all_generated(compiled)
    assert [kn.kind for kn in kernels(compiled)] == ["pointwise"]


def _shuffle(x, groups=2):
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


MOVEMENT = {
    "channel_shuffle": lambda x: _shuffle(x),
    "split": lambda x: x.chunk(2, dim=1)[1],
    "pad": lambda x: F.pad(x, (1, 2, 0, 1)),
    "cat": lambda x: torch.cat([x, x.flip(1)], dim=1),
    "slice_hw": lambda x: x[:, :, 1:, ::2],
    "permute_nhwc": lambda x: x.permute(0, 3, 1, 2),  # an NHWC tensor read as NCHW
}


@pytest.mark.parametrize("name", sorted(MOVEMENT))
def test_movement_in_front_of_a_depthwise_conv_moves_nothing(name):
    g = gen(7)
    move = MOVEMENT[name]
    x = rand((2, 6, 10, 6), g) if name == "permute_nhwc" else rand((2, 6, 9, 10), g)
    c = move(x).shape[1]
    weight = rand((c, 1, 3, 3), g)

    def fn(x):
        return F.conv2d(torch.relu(move(x)), weight, None, 1, 1, groups=c)

    compiled = compile_cpu(fn, (x,), plan="all")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_no_movement(compiled)
    assert_all_generated(compiled)
    assert len(kernels(compiled)) == 1


def test_a_dense_conv_runs_through_torch_with_the_reason():
    g = gen(3)
    weight = rand((4, 3, 3, 3), g)

    def fn(x):
        return F.conv2d(x, weight, None, 1, 1, groups=2)

    x = rand((1, 6, 8, 8), g)
    compiled = compile_cpu(fn, (x,), plan="all")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    why = executor(compiled).lowering.why_torch
    assert any("not depthwise" in r for r in why.values()), why


def test_a_nan_in_the_padding_window_is_not_read():
    """Taps in the zero padding are never loaded: a NaN just outside a sliced view does not leak in."""
    g = gen(5)
    weight = rand((3, 1, 3, 3), g)
    big = rand((1, 3, 10, 10), g)
    big[:, :, 0, :] = float("nan")  # row 0 is outside the slice below

    def fn(x):
        return F.conv2d(x[:, :, 1:, :], weight, None, 1, 1, groups=3)

    compiled = compile_cpu(fn, (big,), plan="all")
    assert_matches_eager(compiled, fn, (big,), **ROW_TOL)
    assert not compiled(big).isnan().any()
