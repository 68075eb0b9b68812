"""A pointwise kernel's inner loop takes in the dims before it where every offset allows (``_merged_inner_dims``),
and what does not change along it is computed once before it (``_Emitter.hoist_invariant``).

NCHW kernels over small maps (ShuffleNet's channel shuffle over 28 x 28) would otherwise run a W-element vector loop
per row.  Each case is checked against eager, and the merge is checked in the generated source: the cases that must
merge (offsets ``c * (W * h + w)``) and those that must not (a broadcast along H, a cat along W, a flip of H).
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen.cpp import _Emitter, _merged_inner_dims, generate

from .util import POINTWISE_TOL, check, gen, kernels, rand


def _shuffle(x, y):
    """ShuffleNetV2's stride-1 unit tail: split, one half through a pointwise op, cat, channel shuffle."""
    x1, _ = x.chunk(2, dim=1)
    out = torch.cat((x1, torch.relu(y * 1.5 - 0.25)), dim=1)
    b, c, h, w = out.shape
    return out.view(b, 2, c // 2, h, w).transpose(1, 2).contiguous().view(b, c, h, w)


@pytest.mark.parametrize("batch,h,w", [(1, 5, 7), (2, 3, 17), (16, 1, 3)])
def test_channel_shuffle_copy_walks_whole_maps(batch, h, w):
    g = gen(70)
    x, y = rand((batch, 6, h, w), g), rand((batch, 3, h, w), g)
    compiled = check(_shuffle, (x, y), **POINTWISE_TOL)
    (k,) = kernels(compiled)  # the graph output: the shuffle read through the cat, relu inlined
    assert _merged_inner_dims(k, _Emitter(k)) == (2 if h > 1 else 1)  # a size-1 dim is no loop
    assert f"i3 < {h * w};" in generate(k)


def test_contiguous_operands_with_a_per_channel_operand_merge_up_to_the_channel():
    g = gen(71)
    x, bias = rand((3, 5, 7, 9), g), rand((1, 5, 1, 1), g)
    compiled = check(lambda x, b: torch.sigmoid(x) * b + x, (x, bias), **POINTWISE_TOL)
    (k,) = kernels(compiled)
    assert _merged_inner_dims(k, _Emitter(k)) == 2
    assert "i3 < 63;" in generate(k)


@pytest.mark.parametrize("case", ["broadcast-along-h", "cat-along-w", "flip-h", "slice-w"])
def test_offsets_that_do_not_walk_whole_maps_keep_the_row_loop(case):
    g = gen(72)
    x = rand((2, 3, 5, 7), g)
    if case == "broadcast-along-h":
        y = rand((5, 1), g)
        fn = lambda x, y: x + y  # noqa: E731
    elif case == "cat-along-w":
        y = rand((2, 3, 5, 4), g)
        fn = lambda x, y: torch.cat((x, y), dim=3) * 2  # noqa: E731
    elif case == "flip-h":
        y = rand((2, 3, 5, 7), g)
        fn = lambda x, y: x.flip(2) + y  # noqa: E731
    else:
        y = rand((2, 3, 5, 4), g)
        fn = lambda x, y: x[..., 1:5] - y  # noqa: E731
    compiled = check(fn, (x, y), **POINTWISE_TOL)
    (k,) = kernels(compiled)
    assert _merged_inner_dims(k, _Emitter(k)) == 1


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 17, 1, 127), (16, 3, 4, 4)])
def test_per_channel_terms_are_computed_once_per_row(shape):
    """A batch norm in a pointwise kernel: its per-channel sqrt is a temp before the inner loop
    (``_Emitter.hoist_invariant``), not an operation per element; results as eager's."""
    g = gen(73)
    c = shape[1]
    x, m, v = rand(shape, g), rand((c, 1, 1), g), rand((c, 1, 1), g).abs() + 0.5
    compiled = check(lambda x, m, v: torch.relu((x - m) / torch.sqrt(v + 1e-5) * 1.5), (x, m, v), **POINTWISE_TOL)
    (k,) = kernels(compiled)
    src = generate(k)
    src = src[src.index('extern "C"'):]  # the kernel (the prelude has omp simd loops of its own)
    loop = src.index("#pragma omp simd")
    assert "std::sqrt" in src[:loop] and "std::sqrt" not in src[loop:]
