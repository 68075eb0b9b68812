"""Max pooling in generated kernels (vtc/codegen/pool.py), against torch.

A 2-D max pool is a pointwise kernel (the max of its window's taps), emitted
plane by plane in vector code where its input plane is a plain load
(vtc/codegen/depthwise.py, combine "max"); a producer read by several taps
stays physical rather than being recomputed per tap.  The tests check values
on odd shapes (stride, padding, dilation, ceil_mode, batch 1 and 16), NaN and
-inf, a channel shuffle in front (no movement materialised), and that a pool
whose indices are used is left to torch with the reason recorded.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .util import (case_seed, channel_shuffle, POINTWISE_TOL, assert_all_generated, assert_matches_eager, assert_no_movement,
                   compile_cpu, gen, kernels, rand)
from .test_conv import _sources

# (batch, channels, height, width, kernel, stride, padding, dilation, ceil_mode, emitted as)
CASES = [
    (1, 24, 112, 112, 3, 2, 1, 1, False, "rows"),  # ShuffleNetV2's stem pool: stride 2, two loads per tap row
    (16, 3, 17, 13, 3, 2, 1, 1, True, "rows"),  # ceil_mode: the last window hangs over the input
    (2, 5, 9, 9, 2, None, 0, 1, False, "rows"),  # stride defaults to the kernel
    (1, 3, 11, 127, (3, 2), (2, 1), (1, 0), (2, 1), True, "rows"),  # rectangular, dilated, stride 2 x 1
    (1, 4, 20, 20, 5, 1, 2, 1, False, "flat"),  # YOLO's SPPF pool: stride 1 "same"
    (3, 2, 7, 7, 3, 3, 1, 1, True, "rows"),  # stride 3: masked gathers
    (1, 1, 1, 1, 1, 1, 0, 1, False, "generic"),  # a 1x1 window inlines the ReLU: the generic loop
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}c{}_{}x{}_k{}s{}p{}d{}_{}".format(*c[:9]))
def test_max_pool_after_relu(case):
    b, c, h, w, k, s, p, d, ceil, emitted = case
    g = gen(case_seed(case, 991))

    def fn(x):
        return F.max_pool2d(torch.relu(x), k, s, p, d, ceil_mode=ceil) * 2.0

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,))
    assert_matches_eager(compiled, fn, (x,), **POINTWISE_TOL)
    assert_all_generated(compiled)
    # the ReLU is read by several taps: stored once, not recomputed per tap (a 1x1 window inlines it)
    assert len(kernels(compiled)) == (1 if k == 1 else 2)
    src = _sources(compiled)
    assert {"flat": "masks.m" in src, "rows": "cols.m" in src, "generic": "_mm512" not in src}[emitted], src


def test_max_pool_propagates_nan_and_keeps_minus_inf():
    g = gen(5)
    x = rand((2, 5, 20, 21), g)
    x[0, 1, 3, 4] = float("nan")
    x[1, 2, 0, 0] = float("nan")  # in the first window, next to the padding
    x[1, 3] = float("-inf")  # a whole plane of -inf: max is -inf, not the padding's value
    for fn in (lambda x: F.max_pool2d(x, 3, 2, 1), lambda x: F.max_pool2d(x, 5, 1, 2)):
        compiled = compile_cpu(fn, (x,))
        got, want = compiled(x), fn(x)
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("k, s, p", [(3, 2, 1), (5, 1, 2), (3, 3, 1)], ids=["s2", "same", "s3_gather"])
def test_max_pool_nan_from_the_taps_bits(k, s, p):
    """The NaN lanes come from an unsigned max of the taps' bits without the sign (``nanb``, vector ops; not a
    compare per tap into a mask): a NaN with the sign bit set, a NaN next to +inf and -inf, +inf alone, and the
    largest finite float (bits just below infinity's) give what torch gives, on an odd map."""
    g = gen(13 + k * s)
    x = rand((2, 3, 19, 23), g)
    x[0, 0, 4, 5] = -float("nan")  # sign bit set: bits 0xffc00000
    x[0, 1, 7, 7], x[0, 1, 7, 8], x[0, 1, 8, 7] = float("nan"), float("inf"), -float("inf")
    x[1, 0, 10, 12] = float("inf")
    x[1, 1, 0, 0] = torch.finfo(torch.float32).max
    x[1, 2, 18, 22] = -torch.finfo(torch.float32).max
    fn = lambda x: F.max_pool2d(x, k, s, p)  # noqa: E731
    compiled = compile_cpu(fn, (x,))
    got, want = compiled(x), fn(x)
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    src = _sources(compiled)
    assert "_mm512_max_epu32(nanb" in src and "_CMP_UNORD_Q" not in src, src


@pytest.mark.parametrize("h, w, k, s, p", [(37, 41, 3, 2, 1), (9, 50, 3, 3, 0), (5, 19, 2, 1, 1)],
                         ids=["s2", "s3", "s1_even"])
def test_rows_form_prefetches_the_input_rows_ahead(h, w, k, s, p):
    """The rows form (any stride) prefetches the tap rows of the output row PREFETCH_ROWS ahead (in a whole
    model its input comes from memory: ShuffleNetV2's stem pool 165 -> 80 us in the call); the rows near the
    bottom, past the input, are not; the values are torch's."""
    from vtc.codegen import depthwise

    g = gen(h * w + k)
    fn = lambda x: F.max_pool2d(x, k, s, p)  # noqa: E731
    x = rand((2, 3, h, w), g)
    compiled = compile_cpu(fn, (x,))
    assert_matches_eager(compiled, fn, (x,), rtol=0, atol=0)
    src = _sources(compiled)
    assert "cols.m" in src and f"(y + {depthwise.PREFETCH_ROWS}) * {s}" in src and "__builtin_prefetch(src + iy" in src


def test_channel_shuffle_in_front_of_a_max_pool_moves_nothing():
    g = gen(7)

    def fn(x):
        return F.max_pool2d(channel_shuffle(x), 3, 2, 1)

    x = rand((1, 8, 15, 16), g)
    compiled = compile_cpu(fn, (x,))
    assert_matches_eager(compiled, fn, (x,), **POINTWISE_TOL)
    assert_no_movement(compiled)
    assert [kn.kind for kn in kernels(compiled)] == ["pointwise"]
    assert "vtc_dw_even" in _sources(compiled)


def test_a_3d_input_and_used_indices():
    g = gen(9)
    x = rand((3, 9, 10), g)

    def values(x):
        return F.max_pool2d(x, 3, 2, 1) + 1.0

    compiled = compile_cpu(values, (x,))
    assert_matches_eager(compiled, values, (x,), **POINTWISE_TOL)
    assert_all_generated(compiled)

    def with_indices(x):
        v, i = F.max_pool2d(x, 3, 2, 1, return_indices=True)
        return v, i

    compiled = compile_cpu(with_indices, (x,))
    assert_matches_eager(compiled, with_indices, (x,), rtol=0, atol=0)
    why = compiled._first.executor.lowering.why_torch
    assert any("extra output" in r for r in why.values()), why
