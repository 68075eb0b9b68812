"""Row sums as vectors of partial sums (vtc.codegen.cpp._lane_sum_loop) against torch eager.

A sum over a row adds into one vector of partial sums (16 floats, 8 doubles or int64s), one per position
modulo 16 (8), folded by halves after the row (two vectors from LONG_ROW elements on; so do a float max and min); the elements after the last full vector in a tail loop.  Rows of odd
lengths (a tail after the last full vector), rows whose mean is large next to their spread (a layer norm
of 1000 + N(0, 1): the variance must stay a two-pass sum of squared deviations), sums of integers (exact).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen.cpp import LONG_ROW, PRELUDE, generate

from .util import ROW_TOL, assert_all_generated, compile_cpu, gen, kernels, rand



def _sources(compiled) -> str:
    return "".join(generate(k).replace(PRELUDE, "") for k in kernels(compiled))


@pytest.mark.parametrize("n", [1, 17, 127])
def test_layer_norm_of_rows_far_from_zero_is_as_accurate_as_torch(n):
    g = gen(400 + n)
    x = 1000 + torch.randn(16, n, generator=g)  # mean 1000, spread 1: the variance is the hard part
    w, b = 1 + 0.1 * torch.randn(n, generator=g), 0.1 * torch.randn(n, generator=g)
    f = lambda x, w, b: F.layer_norm(x, (n,), w, b)  # noqa: E731
    compiled = compile_cpu(f, (x, w, b))
    assert_all_generated(compiled)
    got, eager = compiled(x, w, b), f(x, w, b)
    exact = F.layer_norm(x.double(), (n,), w.double(), b.double())
    err, torch_err = (got.double() - exact).abs().max().item(), (eager.double() - exact).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"vtc {err:.3g} vs float64, torch {torch_err:.3g}"
    torch.testing.assert_close(got, eager, rtol=0, atol=5e-4)  # float32 carries 6e-5 at 1000
    assert _sources(compiled).count("_part[16] = {}") == 2  # the mean's sum, the squared deviations' sum


@pytest.mark.parametrize("n, dtype", [(7, torch.float32), (17, torch.float32), (4099, torch.float32),
                                      (7, torch.float64), (17, torch.float64)])
def test_sum_mean_var_over_rows_of_odd_lengths(n, dtype):
    f = lambda x: (x.sum(-1), x.mean(-1), x.var(-1, correction=0))  # noqa: E731
    x = rand((16, n), gen(500 + n), dtype)
    compiled = compile_cpu(f, (x,))
    assert_all_generated(compiled)
    for got, want in zip(compiled(x), f(x)):
        torch.testing.assert_close(got, want, **ROW_TOL)
    x1 = rand((1, n), gen(501 + n), dtype)  # another batch size: the same kernels' sizes as arguments
    for got, want in zip(compiled(x1), f(x1)):
        torch.testing.assert_close(got, want, **ROW_TOL)
    lanes = (128 if n >= LONG_ROW else 64) // dtype.itemsize  # sum, mean, var's mean and squared deviations
    assert _sources(compiled).count(f"_part[{lanes}] = {{}}") == 4


@pytest.mark.parametrize("n", [7, 17])
def test_integer_sums_are_exact(n):
    g = gen(600 + n)
    i = torch.randint(-2 ** 40, 2 ** 40, (3, n), generator=g)
    f = lambda i: (i.sum(-1), (i % 1000).to(torch.int32).sum(-1), (i > 0).sum(-1))  # noqa: E731
    compiled = compile_cpu(f, (i,))
    assert_all_generated(compiled)
    for got, want in zip(compiled(i), f(i)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_softmax_and_rms_norm_rows_use_the_partial_sums():
    g = gen(700)
    x, w = rand((5, 96), g), rand((96,), g)
    f = lambda x, w: (torch.softmax(x, -1), w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))  # noqa
    compiled = compile_cpu(f, (x, w))
    for got, want in zip(compiled(x, w), f(x, w)):
        torch.testing.assert_close(got, want, **ROW_TOL)
    assert _sources(compiled).count("_part[16]") == 2  # softmax's sum of exp, RMSNorm's sum of squares


def _with_specials(x: torch.Tensor, n: int) -> torch.Tensor:
    """x with NaN in a full block (row 1) and in the tail (row 2), +-inf (rows 3, 4), a row of -inf (5)."""
    x = x.clone()
    x[1, min(40, n - 1)] = float("nan")
    x[2, n - 1] = float("nan")
    x[3, n // 2] = float("inf")
    x[4, 0] = -float("inf")
    x[5] = -float("inf")
    return x


@pytest.mark.parametrize("n", [1, 3, 17, 127, 511, 512, 513, 1027, 4099])
def test_max_min_over_rows_of_every_length_with_nan_and_inf(n):
    """Float max / min over a row: gcc's omp simd reduction below LONG_ROW, two vectors of partials with NaN
    flags from there on; NaN anywhere in the row gives NaN, +-inf kept, a row of -inf."""
    g = gen(800 + n)
    f = lambda x: (x.amax(-1), x.amin(-1), torch.softmax(x, -1), torch.log_softmax(x, -1))  # noqa: E731
    x = _with_specials(rand((7, n), g), n)
    compiled = compile_cpu(f, (x,))
    assert_all_generated(compiled)
    for got, want in zip(compiled(x), f(x)):
        torch.testing.assert_close(got, want, equal_nan=True, **ROW_TOL)
    long = _sources(compiled).count("_npart[32] = {}")
    assert long == (4 if n >= LONG_ROW else 0), long  # amax, amin, the max of softmax and of log_softmax


@pytest.mark.parametrize("n", [513, 4099])
def test_long_row_max_min_through_a_permute_and_a_broadcast(n):
    """The long-row max / min read through movement: a transposed (non-contiguous) source, and a broadcast
    add in front of it, odd batch sizes; plan="all" materialises nothing."""
    import vtc

    g = gen(900 + n)
    f = lambda x, b: ((x.t() + b).amax(-1), (x.t() - b).amin(-1))  # noqa: E731
    x, b = rand((n, 3), g), rand((1, n), g)
    x[n - 1, 2] = float("nan")
    compiled = vtc.compile(f, (x, b), plan="all")
    for got, want in zip(compiled(x, b), f(x, b)):
        torch.testing.assert_close(got, want, equal_nan=True, **ROW_TOL)
    assert compiled.report.to_dict()["materialized_movement_bytes"] == 0
    assert _sources(compiled).count("_npart[32] = {}") == 2


@pytest.mark.parametrize("c, h, w", [(1024, 7, 7), (37, 5, 3), (19, 4, 4), (5, 1, 3)])
def test_global_mean_of_bn_relu_sums_its_tail_apart(c, h, w):
    """ShuffleNetV2's head: a global mean over h x w of BN + ReLU of a conv's output (one row kernel, the BN and
    ReLU inlined).  The elements after the last full vector are summed into their own scalar (``acc_*_tail``),
    not into the vector of partial sums (whose scalar store stalled the fold's load: 13.5 -> 6.5 us at 1024 x
    49); rows shorter than a vector are all tail."""
    g = gen(700 + c + h * w)
    mean, var = rand((c,), g), rand((c,), g, positive=True)
    gamma, beta = rand((c,), g), rand((c,), g)
    f = lambda x: torch.relu(F.batch_norm(x, mean, var, gamma, beta, False, eps=1e-5)).mean((2, 3))  # noqa: E731
    x = rand((2, c, h, w), g)
    compiled = compile_cpu(f, (x,))
    torch.testing.assert_close(compiled(x), f(x), **ROW_TOL)
    assert [kn.kind for kn in kernels(compiled)] == ["row"]
    src = _sources(compiled)
    assert src.count("_tail = 0;") == 1 and "_part[1]) + acc_" in src, src[-1500:]
