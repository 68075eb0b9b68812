"""bfloat16 / float16 values in generated kernels, against torch eager.

In memory a value of these dtypes is 16 bits; a kernel widens it to float32 at its load, computes in float32,
and rounds to the dtype (nearest even, NaN kept) the result of every op whose dtype is bfloat16 / float16 and at
its store, as eager's kernels do op by op.  So a fused chain of arithmetic equals eager bit for bit; a
transcendental (exp, tanh, erf, ...) is vtc's own vectorised float32 function, and a reduction sums in another
order (both in float32): those are within 1 unit in the last place of the dtype.  Reductions, softmax and norms
accumulate in float32 and round once, as torch's CPU kernels do.  docs/low_precision.md.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.codegen.util import (assert_all_generated, assert_no_movement, case_seed, compile_cpu, gen, kernels, rand,
                                steps)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OTHER = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """The 16-bit patterns of x as integers in the order of the values (-0 and +0 both 0)."""
    b = x.view(torch.int16).long()
    return torch.where(b < 0, -(b & 0x7FFF), b)


def assert_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int, what: str = "", atol: float = 0.0) -> None:
    """got and want of the same low-precision dtype and shape, at most `ulps` units in the last place apart (or at
    most `atol` apart); NaN where and only where want is NaN; infinities equal."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN at other places"
    inf = want.isinf()
    assert torch.equal(got[inf], want[inf]), f"{what}: infinities differ"
    d = (_ordered(got) - _ordered(want)).abs()
    d = d[~nan & ((got.float() - want.float()).abs() > atol)]
    worst = int(d.max()) if d.numel() else 0
    assert worst <= ulps, f"{what}: {worst} ulps apart (at most {ulps}); max abs diff " \
                          f"{(got.float() - want.float())[~nan].abs().max().item():.3e}"


def assert_exact(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Bit for bit (NaN where want is NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _outputs(fn, args):
    compiled = compile_cpu(fn, args)
    return compiled, compiled(*args), fn(*args)


# (batch, rows, cols): sizes 1, 3, 17, 127
SHAPES = [(1, 127, 17), (3, 3, 1)]
SIZES = (1, 3, 17, 127)  # reduced lengths: each test's function reduces rows of every one


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_chains_are_one_kernel_and_eager_bit_for_bit(dtype, shape):
    """Arithmetic chains over a transpose, broadcasting, bf16 + float32 promotion, Python scalars, where /
    masked_fill, casts between bf16 / fp16 / float32 / integers, and movement (slice, cat, expand) in front: every
    op generated, nothing materialised, one kernel per output, equal to eager bit for bit."""
    dt = DTYPES[dtype]
    b, n, m = shape
    g = gen(case_seed((dtype, shape)))
    x, y = rand((b, m, n), g, dt), rand((b, n, m), g, dt)
    z, w = rand((n, m), g), rand((m,), g, dt)
    mask = rand((b, n, 1), g, torch.bool)
    k = m // 2

    def fn(x, y, z, w, mask):
        xt = x.transpose(1, 2)
        a = torch.relu(xt + y) * 2 - w / 3  # broadcast w over rows, Python scalars
        p = xt * z + 0.1  # bf16 * float32 -> float32
        c = torch.where(mask, xt, 0.1).masked_fill(y > 0.5, -1.5)
        casts = (y.to(OTHER[dt]) * 3, (y * 7).to(torch.int32), (xt * 5).to(torch.int64).to(dt) + y,
                 y.float() * z, (z * 3).to(dt) - y)
        cat = torch.cat([xt[..., :k], y[..., k:] + 1], -1) * w.expand(b, n, m)
        # eager: bf16's x ** 3 rounds x * x to bf16 first, fp16's computes in float32 (ops._pow follows both)
        powers = y.pow(3) - xt.pow(2) + y.pow(-2) + xt.abs().pow(0.5)
        return (a, p, c, *casts, cat, powers)

    args = (x, y, z, w, mask)
    compiled, got, want = _outputs(fn, args)
    for j, (gv, wv) in enumerate(zip(got, want)):
        assert_exact(gv, wv, f"output {j}")
    assert_all_generated(compiled)
    assert_no_movement(compiled)
    assert len(kernels(compiled)) == len(want), [kn.source_nodes for kn in kernels(compiled)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_transcendental_ops_are_within_one_ulp(dtype):
    dt = DTYPES[dtype]
    g = gen(case_seed(dtype))
    x = rand((3, 17, 127), g, dt, low=0.01, high=4.0)

    def fn(x):
        xt = x.transpose(0, 2)
        return (torch.exp(xt), torch.tanh(xt), torch.sigmoid(xt), F.silu(xt), F.gelu(xt), F.gelu(xt, approximate="tanh"),
                torch.rsqrt(xt.abs()), torch.log(xt.abs()), torch.sqrt(xt.abs()) * 2, torch.erf(xt))

    compiled, got, want = _outputs(fn, (x,))
    for j, (gv, wv) in enumerate(zip(got, want)):
        # gelu: vtc_erf's / vtc_tanh's float32 absolute error (< 6e-7, vtc/codegen/vecmath.py), times |x| / 2, is
        # more than an ulp of fp16 where 1 + erf(x / sqrt(2)) cancels (x < -2, results ~1e-4): there that bound
        assert_ulps(gv, wv, 1, f"output {j}", atol=2e-6 if j in (4, 5) else 0.0)
    assert_all_generated(compiled)
    assert_no_movement(compiled)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_ties_nan_and_inf_match_eager(dtype):
    """Sums exactly halfway between two neighbours of the dtype round to the even one; NaN and inf propagate;
    overflow of the dtype (not of float32) gives inf; float32 -> dtype of every such value."""
    dt = DTYPES[dtype]
    bits = 8 if dt == torch.bfloat16 else 11  # significand bits
    big = 3.0e38 if dt == torch.bfloat16 else 60000.0
    h = 2.0 ** -bits
    x = torch.tensor([1.0, 1.0 + 2 * h, -1.0, 1.0 - h / 2, float("nan"), float("inf"), float("-inf"), big, -big, 0.5,
                      2.0, 1.0 + 4 * h], dtype=dt)
    y = torch.tensor([h, h, -h, h / 4, 1.0, 1.0, float("inf"), big, big, h / 2, 2 * h, h * 1.5], dtype=dt)
    f = torch.tensor([1.0 + h, 1.0 + 3 * h, -(1.0 + h), 1.0 + 5 * h, float("nan"), 1e39, -3.4e38, 65520.0, 65519.0,
                      2.0 ** -140, -(2.0 ** -20), 1.0 + 2.5 * h], dtype=torch.float32)

    def fn(x, y, f):
        return x + y, x * y, (x - y) * 0.5, f.to(x.dtype), f.to(x.dtype) + x, torch.relu(x) - y

    compiled, got, want = _outputs(fn, (x, y, f))
    for j, (gv, wv) in enumerate(zip(got, want)):
        assert_exact(gv, wv, f"output {j}")
    assert want[0][0] == 1.0 and want[0][1] == 1.0 + 4 * h  # the ties were ties: to even, both ways
    assert_all_generated(compiled)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_16_bit_pattern_converts_as_torch(dtype):
    """Every bit pattern of the dtype widened to float32, and float32 patterns (random, halfway cases, NaN, inf,
    subnormals) narrowed to it, equal torch's conversions."""
    dt = DTYPES[dtype]
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dt)
    g = gen(7)
    pats = torch.randint(-2**31, 2**31 - 1, (1 << 14,), generator=g, dtype=torch.int64).to(torch.int32)
    halfway = (every.float().view(torch.int32) | (1 << (15 if dt == torch.bfloat16 else 12)))
    f = torch.cat([pats, halfway]).view(torch.float32)

    def fn(a, f):
        return a.float(), f.to(a.dtype), a.to(OTHER[a.dtype])

    compiled, got, want = _outputs(fn, (every, f))
    assert_exact(got[0], want[0], "widened")
    assert_exact(got[1], want[1], "narrowed")
    assert_exact(got[2], want[2], "to the other 16-bit dtype")
    assert_all_generated(compiled)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions_accumulate_in_float32(dtype):
    """sum / mean / amax / amin / var over the last dim and over a transposed one, rows of 1, 3, 17 and 127
    (float32 accumulators, one rounding): amax / amin bit for bit, sums within 1 ulp (another order of float32
    additions)."""
    dt = DTYPES[dtype]
    g = gen(case_seed(dtype))
    xs = [rand((5, n, 9), g, dt) for n in SIZES]

    def one(x):
        xt = x.transpose(1, 2)  # [5, 9, n]
        return (xt.sum(-1), x.sum(1), xt.mean(-1), xt.amax(-1), x.amin(1), torch.var(xt, -1, correction=0),
                (xt * 2 + 1).sum(-1, keepdim=True), xt.sum(-1, dtype=torch.float32))

    def fn(*xs):
        return tuple(y for x in xs for y in one(x))

    compiled, got, want = _outputs(fn, tuple(xs))
    for j, (gv, wv) in enumerate(zip(got, want)):
        what = f"size {SIZES[j // 8]}, output {j % 8}"
        if gv.dtype == torch.float32:
            torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
        elif j % 8 in (3, 4):
            assert_exact(gv, wv, what)
        else:
            assert_ulps(gv, wv, 1, what)
    assert_all_generated(compiled)
    assert_no_movement(compiled)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_and_norms_within_one_ulp(dtype):
    """softmax, log_softmax, layer_norm (weights of the dtype), RMSNorm (transformers' float32 form and
    F.rms_norm) over rows of 1, 3, 17 and 127 read through a transpose: generated, within 1 ulp of eager."""
    dt = DTYPES[dtype]
    g = gen(case_seed((dtype, "rows")))
    args = tuple(t for n in SIZES for t in (rand((4, n, 6), g, dt), rand((n,), g, dt), rand((n,), g, dt)))

    def one(x, w, b):
        n = x.shape[1]
        xt = x.transpose(1, 2)  # [4, 6, n]
        v = xt.float()
        rms = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
        return (torch.softmax(xt, -1), torch.log_softmax(xt * 2, -1), F.layer_norm(xt, (n,), w, b, 1e-5), rms,
                F.rms_norm(xt, (n,), w, 1e-6), torch.softmax(xt, -1, dtype=torch.float32))

    def fn(*args):
        return tuple(y for k in range(0, len(args), 3) for y in one(*args[k:k + 3]))

    compiled, got, want = _outputs(fn, args)
    ref = fn(*[a.double() for a in args])
    for j, (gv, wv) in enumerate(zip(got, want)):
        what = f"size {SIZES[j // 6]}, output {j % 6}"
        if j % 6 == 1:
            # eager's bf16 / fp16 log_softmax rounds an intermediate (log of the sum) to the dtype: up to 44 ulps
            # from the float64 result on these rows; vtc's rounds once, so it is compared with float64, and is no
            # worse than eager
            r = ref[j].to(dt)
            assert_ulps(gv, r, 1, what + " (log_softmax) against float64")
            assert (gv.double() - r.double()).abs().max() <= (wv.double() - r.double()).abs().max()
        elif gv.dtype == torch.float32:
            torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
        else:
            assert_ulps(gv, wv, 1, what)
    assert_all_generated(compiled)
    assert_no_movement(compiled)


def test_no_float32_fast_path_for_low_precision_kernels():
    """The float32-only paths (register-transposed tiles, lanes of rows, streamed stores) are not taken for bf16:
    a transposed bf16 read is staged per 32 x 32 tile (vtc.codegen.low_tiles; partial tiles at the edges), a
    softmax over a permuted dim is a plain row loop; both convert."""
    from vtc.codegen.cpp import generate

    g = gen(3)
    x = rand((45, 70), g, torch.bfloat16)
    compiled = compile_cpu(lambda x: (torch.relu(x.t() * 2), torch.softmax(x, 0)), (x,))
    for k in kernels(compiled):
        src = generate(k)
        assert "vtc_from_bf16(" in src and "vtc_to_bf16(" in src
        assert "vtc_transpose16" not in src.split('extern "C"')[1] and "vtc_stream16(" not in src
        assert "accv_" not in src  # lanes.py's row lanes
    assert "stage0[" in generate(kernels(compiled)[0])
    got, want = compiled(x), (torch.relu(x.t() * 2), torch.softmax(x, 0))
    assert_exact(got[0], want[0])
    assert_ulps(got[1], want[1], 1)
    assert steps(compiled, "run") == []
