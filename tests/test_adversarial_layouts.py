"""Adversarial tests (session 18) of what the session-17 sweep did not cover, layouts and precisions: float16
inputs through movement chains into pointwise and reduction kernels; channels_last inputs into convolutions,
pointwise kernels and pooling; max / avg pooling and interpolation behind permute, pad, cat and slice.  Compared
with torch eager (and torch.compile(backend="vtc") where it is cheap) with explicit tolerances on random inputs.
None of these found a wrong answer (docs/robustness.md, "Session 18"); tests/test_adversarial_updates.py has the
rest of the sweep."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

import vtc
from tests.adversarial import (F32_TOL, SETTINGS, SIZES, Draw, check_outputs, close_outputs, describe, draw_chain, rand,
                               run_chain, seeded)
from tests.codegen.util import torch_threads

F16_TOL = dict(rtol=1e-2, atol=1e-2)  # a float16 result is rounded to 11 bits: a few ulps after a reduction
BF16_TOL = dict(rtol=3e-2, atol=5e-2)  # a bf16 convolution sums 54 products rounded to 8 bits


# -- float16 through movement chains into pointwise and reduction kernels ---------------------------------------
def _f16_consumer(r: Draw, rank: int):
    kind = r.choice(["pointwise", "sum", "amax_mean", "softmax", "layer_norm", "var", "logsumexp", "to_float"])
    d = r.randrange(rank)
    return kind, {
        "pointwise": lambda t: torch.sigmoid(t) * 2 + t * t,
        "sum": lambda t: t.sum(d),
        "amax_mean": lambda t: t.amax(-1) + t.mean(-1),
        "softmax": lambda t: torch.softmax(t, d),
        "layer_norm": lambda t: F.layer_norm(t, (t.shape[-1],)),
        "var": lambda t: t.var(d),
        "logsumexp": lambda t: t.logsumexp(d),
        "to_float": lambda t: t.float().cumsum(d) + t.sum(d, keepdim=True),
    }[kind]


@settings(max_examples=6, **SETTINGS)
@given(st.data())
def test_a_drawn_chain_on_float16_into_a_pointwise_or_reduction_kernel(data):
    r = Draw(data)
    shape = [r.choice(SIZES) for _ in range(r.choice([2, 3, 3]))]
    ops, out_shape = draw_chain(r, shape, r.randrange(1, 5))
    kind, consumer = _f16_consumer(r, len(out_shape))
    g = seeded(r.randrange(1000))
    x = rand(shape, g, torch.float16, noncontiguous=r.choice([False, True]))
    plan, threads = r.choice(["all", "greedy"]), r.choice([1, 2])
    what = f"float16 {shape}: {describe(ops)} -> {out_shape} -> {kind}; plan={plan} threads={threads}"
    note(what)

    def fn(x):
        return consumer(run_chain(ops, x))

    with torch_threads(threads):
        check_outputs(fn, (x,), F16_TOL, what, plan=plan)


@pytest.mark.parametrize("plan", ["greedy", "all"])
def test_float16_chains_into_reductions_and_a_float16_gemm(plan):
    g = seeded(1)
    x, w = rand((5, 17, 8), g, torch.float16), rand((3, 17), g, torch.float16)

    def fn(x):
        t = F.pad(x.flip(1), [1, 2], value=0.5).transpose(0, 2)  # [11, 17, 5]
        return (t.sum(-1), torch.softmax(t, 1), t.amax(0) - t.mean(0), F.rms_norm(t.transpose(1, 2), (17,)),
                F.linear(t.transpose(1, 2), w), t.argmax(1))

    check_outputs(fn, (x,), dict(rtol=2e-2, atol=2e-2), plan=plan, torch_compile=plan == "greedy")


def test_float16_and_float32_inputs_mixed_behind_chains():
    g = seeded(2)

    def fn(h, f):
        return h.transpose(0, 2)[::2] + f.roll(1, 0)[::2], (h.permute(2, 1, 0).float() * f).sum(-1)

    check_outputs(fn, (rand((5, 17, 8), g, torch.float16), rand((8, 17, 5), g)), F16_TOL)


# -- channels_last inputs ---------------------------------------------------------------------------------------
def _channels_last(shape, g, dtype=torch.float32):
    return rand(shape, g, dtype).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("threads", [1, 2])
def test_channels_last_into_convolutions_pointwise_and_pooling(threads):
    g = seeded(3)
    w, b, dw = rand((5, 6, 3, 3), g), rand((5,), g), rand((6, 1, 3, 3), g)

    def fn(x):
        y = torch.relu(F.conv2d(x, w, b, padding=1))
        return (y, F.conv2d(x, dw, groups=6, padding=1, stride=2), torch.sigmoid(x) * x + 1,
                F.max_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 2, ceil_mode=True), F.adaptive_avg_pool2d(x, 1),
                x.mean((2, 3)), F.group_norm(x, 3))

    x = _channels_last((2, 6, 9, 7), g)
    assert not x.is_contiguous()
    with torch_threads(threads):
        compiled = check_outputs(fn, (x,), torch_compile=threads == 1)
        close_outputs(compiled(x.contiguous()), fn(x), F32_TOL, "the same values in NCHW")


def test_channels_last_in_half_precision():
    g = seeded(4)
    w = rand((5, 6, 3, 3), g)

    def fn16(x):
        return torch.relu(x.permute(0, 1, 3, 2)) * 2, F.max_pool2d(x, 2), x.sum(1)

    def fnbf(x):
        return F.conv2d(x, w.bfloat16(), padding=1), F.avg_pool2d(x, 3, 2, 1)

    check_outputs(fn16, (_channels_last((2, 6, 9, 7), g, torch.float16),), F16_TOL)
    check_outputs(fnbf, (_channels_last((2, 6, 9, 7), g, torch.bfloat16),), BF16_TOL)


# -- pooling and interpolation behind movement chains -----------------------------------------------------------
POOLS = {
    "max_pool(permute)": lambda x: F.max_pool2d(x.permute(0, 3, 2, 1), 2),
    "max_pool(transpose, k3 s2 p1)": lambda x: F.max_pool2d(x.transpose(2, 3), 3, 2, 1),
    "max_pool(pad -5)": lambda x: F.max_pool2d(F.pad(x, [1, 2, 0, 1], value=-5.0), 2),
    "max_pool(cat channels)": lambda x: F.max_pool2d(torch.cat([x, x.flip(3)], 1), 3, 2),
    "max_pool(strided slice, ceil)": lambda x: F.max_pool2d(x[:, 1::2, 1:, ::2], 2, ceil_mode=True),
    "max_pool(flip, dilation 2)": lambda x: F.max_pool2d(x.flip(3), 3, 1, 1, dilation=2),
    "max_pool with indices(transpose)": lambda x: F.max_pool2d(x.transpose(2, 3), 2, return_indices=True),
    "adaptive_max_pool(transpose)": lambda x: F.adaptive_max_pool2d(x.permute(0, 1, 3, 2), (2, 3)),
    "max_pool1d(flatten, transpose)": lambda x: F.max_pool1d(x.flatten(2).transpose(1, 2), 3),
    "avg_pool(pad 1.5, k3 s2 p1)": lambda x: F.avg_pool2d(F.pad(x, [1, 2, 0, 1], value=1.5), 3, 2, 1),
    "avg_pool(cat width)": lambda x: F.avg_pool2d(torch.cat([x, x.flip(3) * 2], 3), 2),
    "avg_pool(slice, ceil, no pad count)": lambda x: F.avg_pool2d(x[:, :, 1:], 3, 2, 1, ceil_mode=True,
                                                                  count_include_pad=False),
    "avg_pool1d(flatten, slice)": lambda x: F.avg_pool1d(x.flatten(2)[..., 1:], 4, 2),
    "pool(chain(pool))": lambda x: F.avg_pool2d(F.max_pool2d(x, 2).roll(1, 3).flip(2), 2, ceil_mode=True),
    "nearest(transpose)": lambda x: F.interpolate(x.permute(0, 1, 3, 2), scale_factor=2, mode="nearest"),
    "nearest(slice, size)": lambda x: F.interpolate(x[:, :, 1:], size=(5, 11), mode="nearest"),
    "nearest-exact(step slice)": lambda x: F.interpolate(x[..., ::2], scale_factor=3, mode="nearest-exact"),
    "bilinear(pad)": lambda x: F.interpolate(F.pad(x, [1, 1, 1, 1]), scale_factor=2, mode="bilinear"),
    "bilinear align_corners(cat)": lambda x: F.interpolate(torch.cat([x, x.flip(2)], 2), size=(7, 13),
                                                           mode="bilinear", align_corners=True),
    "bicubic(transpose)": lambda x: F.interpolate(x.transpose(2, 3), scale_factor=1.5, mode="bicubic"),
    "area(transpose)": lambda x: F.interpolate(x.transpose(2, 3), size=(3, 4), mode="area"),
    "linear 1d(flatten, transpose)": lambda x: F.interpolate(x.flatten(2).transpose(1, 2), scale_factor=2,
                                                             mode="linear"),
}


@pytest.mark.parametrize("plan", ["greedy", "all"])
def test_pooling_and_interpolation_behind_movement_chains(plan):
    """Every case in one graph (one compile), each output compared."""
    names = list(POOLS)

    def fn(x):
        return tuple(POOLS[n](x) for n in names)

    x = rand((2, 6, 9, 7), seeded(5))
    want = fn(x)
    compiled = vtc.compile(fn, (x,), plan=plan)
    for got in (compiled(x), compiled(x.contiguous(memory_format=torch.channels_last))):
        for n, gv, wv in zip(names, got, want):
            pairs = list(zip(gv, wv)) if isinstance(wv, tuple) else [(gv, wv)]
            for a, b in pairs:
                torch.testing.assert_close(a, b, **F32_TOL, msg=lambda m, n=n: f"{n}, plan={plan}\n{m}")


def test_pooling_behind_chains_in_half_precision():
    def fn(x):
        return F.max_pool2d(x.transpose(2, 3), 2), F.avg_pool2d(F.pad(x, [1, 1]), 3)

    x = rand((2, 6, 9, 7), seeded(6))
    check_outputs(fn, (x.half(),), F16_TOL)
    check_outputs(fn, (x.bfloat16(),), dict(rtol=2e-2, atol=2e-2))
