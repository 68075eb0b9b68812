"""``torch.max(x)`` / ``torch.min(x)`` without a dim as generated reductions (session 15); ``torch.aminmax``.

Before, ``max.default`` / ``min.default`` ran through torch (a "run" step; the report did not name them, as
reductions are compute ops); the kernel uses amax's / amin's accumulator, so the answers are torch's exactly: the
extreme of every element (a 0-d result), NaN where an element is NaN, bfloat16 exact.  Bool inputs stay torch's.
``aminmax`` was already generated (the core-ATen table decomposes it into amin and amax): its tests here pass
before and after."""
from __future__ import annotations

import warnings

import pytest
import torch

import vtc


def _compile(fn, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vtc.compile(fn, (x,))


def _generated(compiled) -> None:
    assert compiled.report.fallback_ops == [], compiled.report.fallback_ops
    assert not [s.node.target for s in compiled._first.executor.steps if s.kind == "run"]


def _all_max_min(x):
    return torch.max(x) * 2, torch.min(x) - 1


def _aminmax_all_and_dim(x):
    lo, hi = torch.aminmax(x)
    a, b = torch.aminmax(x, dim=1, keepdim=True)
    c, d = torch.aminmax(x, dim=-1)
    return lo, hi, a + 0, b * 1, d - c


def _random(dtype, seed, shape=(6, 37, 5)):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 50
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("fn", [_all_max_min, _aminmax_all_and_dim])
def test_equal_to_eager(fn, dtype):
    compiled = _compile(fn, _random(dtype, 0))
    _generated(compiled)
    for seed in (1, 2):
        x = _random(dtype, seed)
        for got, want in zip(compiled(x), fn(x)):
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_strided_input_and_nan():
    def fn(x):
        y = x.permute(2, 0, 1)
        lo, hi = torch.aminmax(y, dim=0)
        return torch.max(y), lo, hi

    x = _random(torch.float32, 3)
    compiled = _compile(fn, x)
    _generated(compiled)
    for where in [(0, 0, 0), (5, 36, 4), (2, 17, 3)]:
        x = _random(torch.float32, 4)
        x[where] = float("nan")
        for got, want in zip(compiled(x), fn(x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    x = _random(torch.float32, 5)
    x[1, 2, 3] = float("inf")
    for got, want in zip(compiled(x), fn(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_one_element_and_a_0d_input():
    for x in (torch.tensor([[2.5]]), torch.tensor(-3.0)):
        compiled = _compile(_all_max_min, x)
        for got, want in zip(compiled(x), _all_max_min(x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bool_stays_torchs():
    x = torch.rand(4, 9, generator=torch.Generator().manual_seed(6)) > 0.5
    compiled = _compile(lambda x: (torch.max(x), torch.min(x)), x)
    assert [s.kind for s in compiled._first.executor.steps].count("run") == 2
    for got, want in zip(compiled(x), (torch.max(x), torch.min(x))):
        assert torch.equal(got, want)


def test_a_large_input_stays_torchs():
    """One row of more elements than torch's grain size: torch splits it over the threads, a row kernel would not."""
    from vtc.codegen import ops

    x = _random(torch.float32, 7, shape=(ops.EXTREME_MAX_ELEMENTS + 1,))
    compiled = _compile(_all_max_min, x)
    assert [s.kind for s in compiled._first.executor.steps].count("run") == 2
    for got, want in zip(compiled(x), _all_max_min(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
