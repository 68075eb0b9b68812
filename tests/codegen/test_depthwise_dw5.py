"""Depthwise convolutions' aligned flat form with column-only FMA masks (session 17, docs/gemm.md "Vector maths and
the 5x5 depthwise, session 17"), against torch eager.

The flat form (stride 1, output rows as long as input rows) masks each tap's FMA by the lanes whose tap column is
inside the input, read once per chunk of 16 outputs; a lane whose tap row is outside the input reads 0, because
there the tap lies outside the plane's memory and the loads are zero-filled.  Checked: 5x5 / 3x3 / 7x7 taps, odd
plane sizes, fewer output rows than input rows, a height dilation, batch 1 and 3, one and two threads, NaN and
inf in the neighbouring planes (which the row-outside lanes must not read), the stride-2 rows form beside it, and
the switch back to the old masks.  Taps 5 or more wide sum into one accumulator per tap column (up to
``FLAT_ACCUMULATORS``), so the FMAs of a chunk are short dependency chains.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import depthwise
from vtc.codegen.cpp import generate

from .util import ROW_TOL, assert_matches_eager, case_seed, compile_cpu, gen, kernels, rand, torch_threads

# (batch, channels, (kh, kw), stride, (ph, pw), (dh, dw), h, w)
CASES = [
    (1, 384, (5, 5), 1, (2, 2), (1, 1), 28, 28),  # evit_dw5: EfficientViT's aggregation conv
    (3, 7, (5, 5), 1, (2, 2), (1, 1), 9, 13),  # odd sizes, the last chunk past the plane
    (1, 5, (5, 5), 1, (1, 2), (1, 1), 6, 11),  # fewer output rows than input rows
    (3, 4, (5, 5), 1, (4, 2), (2, 1), 7, 5),  # height dilation, taps taller than the plane
    (1, 6, (3, 3), 1, (1, 1), (1, 1), 28, 28),  # evit_dw3's shape (fewer channels)
    (3, 5, (3, 3), 1, (1, 1), (1, 1), 5, 17),
    (1, 9, (7, 7), 1, (3, 3), (1, 1), 7, 7),  # ShuffleNet-like 7x7 over a 7x7 plane
    (3, 3, (7, 7), 1, (3, 3), (1, 1), 11, 3),  # taps wider than the plane
    (1, 8, (5, 5), 2, (2, 2), (1, 1), 28, 28),  # stride 2: the rows form
    (3, 5, (3, 3), 2, (1, 1), (1, 1), 13, 9),
    (1, 4, (7, 7), 2, (3, 3), (1, 1), 15, 15),
]


def _ids(c):
    return "b{}c{}k{}x{}s{}p{}x{}d{}_{}x{}".format(c[0], c[1], *c[2], c[3], *c[4], c[5][0], c[6], c[7])


def _sources(compiled) -> str:
    return "\n".join(generate(k) for k in kernels(compiled))


def _model(case, g):
    b, c, (kh, kw), stride, pad, dil, h, w = case
    weight, bias = rand((c, 1, kh, kw), g), rand((c,), g)
    return lambda x: F.hardswish(F.conv2d(x, weight, bias, stride, pad, dil, c)), rand((b, c, h, w), g)


@pytest.mark.parametrize("case,threads", [(c, 1) for c in CASES] + [(CASES[i], 2) for i in (0, 1, 3, 9)],
                         ids=lambda v: _ids(v) if isinstance(v, tuple) else f"t{v}")
def test_depthwise_against_eager(case, threads):
    fn, x = _model(case, gen(case_seed((case, threads), 911)))
    with torch_threads(threads):
        compiled = compile_cpu(fn, (x,))
        assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    src = _sources(compiled)
    flat = case[3] == 1 and 2 * case[4][1] == case[2][1] - 1
    if flat and depthwise.FLAT_COLUMN_MASKS:  # one mask per tap column, read once per chunk (fails before)
        assert "cm0 = cmask.m[" in src and "ra & cmask.m" not in src
        kw = case[2][1]
        if kw >= 5:  # one FMA chain per tap column (fails before: two)
            assert f"acc{min(kw, depthwise.FLAT_ACCUMULATORS) - 1} = _mm512_setzero_ps()" in src


@pytest.mark.parametrize("threads", [1, 2])
def test_neighbouring_planes_nan_and_inf_do_not_leak(threads):
    """Every other plane is NaN / inf: the planes between, whose row-outside lanes would read their neighbours'
    memory without the zero-filled loads, must match eager exactly where eager is finite."""
    g = gen(5)
    weight = rand((6, 1, 5, 5), g)
    x = rand((3, 6, 9, 14), g)
    x[:, 0::3] = float("nan")
    x[:, 2::3] = float("inf")

    def fn(v):
        return F.conv2d(v, weight, None, 1, 2, 1, 6)

    with torch_threads(threads):
        compiled = compile_cpu(fn, (x,))
        got = compiled(x)
    want = fn(x)
    torch.testing.assert_close(got[:, 1::3], want[:, 1::3], **ROW_TOL)
    assert bool(got[:, 1::3].isfinite().all())
    assert torch.equal(got.isnan(), want.isnan())


def test_switch_off_gives_the_old_masks_and_the_same_values():
    fn, x = _model(CASES[1], gen(3))
    new = compile_cpu(fn, (x,))
    old_flag = depthwise.FLAT_COLUMN_MASKS
    depthwise.FLAT_COLUMN_MASKS = False
    try:
        old = compile_cpu(fn, (x,))
        old_src = _sources(old)  # generate() reads the switch
    finally:
        depthwise.FLAT_COLUMN_MASKS = old_flag
    assert "ra & cmask.m" in old_src and "ra & cmask.m" not in _sources(new)
    torch.testing.assert_close(new(x), old(x), rtol=1e-6, atol=1e-6)
    assert_matches_eager(new, fn, (x,), **ROW_TOL)
