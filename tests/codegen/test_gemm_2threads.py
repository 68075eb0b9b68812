"""Small products and 12-16 rows of x @ W^T (docs/gemm.md, "2-thread small products, session 15"), against torch.

- 12..16 rows (WT_MIN_M..SKINNY_M) of A on a constant W of at least SKINNY_PACKED_WT_MIN_BYTES run
  ``vtc_skinny_packed`` on W packed once (``_skinny_packed_rows``) instead of weight_rows; a smaller W stays on
  weight_rows (nothing packed).  The report's path says what ran ("skinny_packed").
- weight_rows' M split over the threads goes by its 32-column A^T panels (``WT_SPLIT_NR``; 128 rows: 64 / 64, not
  72 / 56 rows computed as 96 / 64) and its N split by W's 12-row strips; 1-4 threads on one kernel.
"""
from __future__ import annotations

import pytest
import torch

import vtc
from vtc.codegen import conv_t, gemm
from vtc.runtime import cbuild, packed

from .util import call_gemm_kernel, compile_cpu, gen, kernels, rand, torch_threads

avx512 = pytest.mark.skipif(not conv_t.has_avx512() or not packed.CONV_ENABLED,
                            reason="W packed once is the AVX-512 kernel's layout")


def _tol(k: int) -> dict:
    """float32 sums of k products of magnitude <= ~1."""
    return dict(rtol=1e-4, atol=2e-6 * k ** 0.5 + 1e-5)


def _linear(k: int, n: int, seed: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias)


def _plan(compiled):
    return compiled._first.executor.call_plan()


def _paths(compiled) -> list[str]:
    return [q["path"] for q in compiled.report.to_dict()["gemm"]]


# rows across the 12-row A panels (13 = 12 + 1, 16 = 12 + 4), N across 32 / 64-column edges, K across SKINNY_KC
# (2049: two slices), every W at least 512 KB
ROWS = [((12, 512, 300), 1), ((13, 700, 200), 2), ((14, 2049, 97), 1), ((16, 1024, 1024), 2)]


@avx512
@pytest.mark.parametrize("shape,threads", ROWS, ids=[f"{m}x{k}x{n}-t{t}" for (m, k, n), t in ROWS])
def test_twelve_to_sixteen_rows_run_on_w_packed_once(shape, threads):
    """Fails before: weight_rows (nothing packed, path "weight_rows")."""
    m, k, n = shape
    lin = _linear(k, n, m + k + n, bias=m % 2 == 0)
    x = rand((m, k), gen(n))
    with torch_threads(threads):
        with torch.no_grad():
            compiled = vtc.compile(lin, (x,), gemm="vtc")
            assert _paths(compiled) == [gemm.SKINNY_PACKED_PATH]
            torch.testing.assert_close(compiled(x), lin(x), **_tol(k))
            assert _plan(compiled).counts["packed_conv_weights"] == 1, _plan(compiled).why_not_packed
            lin.weight.mul_(-1.5)  # packed again: stale panels would be off by the whole change
            torch.testing.assert_close(compiled(x), lin(x), **_tol(k))
            # the reference path passes no packed W: the kernel's weight_rows loops
            torch.testing.assert_close(compiled._first.executor.run_steps([x])[0], lin(x), **_tol(k))


@avx512
def test_a_small_w_at_sixteen_rows_stays_on_weight_rows():
    lin = _linear(256, 256, 5)
    x = rand((16, 256), gen(5))
    with torch.no_grad():
        compiled = vtc.compile(lin, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), lin(x), **_tol(256))
    assert _paths(compiled) == ["weight_rows"]
    assert _plan(compiled).counts["packed_conv_weights"] == 0


@avx512
def test_the_report_says_what_ran():
    """Fails before (the path without the packed W): 4 rows said "dot", 49 rows "weight_rows"; a runtime W (nothing
    packed) keeps those.  One row on this 750 KB W runs on it packed once too (session 19; "dot" before)."""
    class F(torch.nn.Module):
        def forward(self, x, w):
            return x @ w.t()

    for m, want_const, want_runtime in ((4, gemm.SKINNY_PACKED_PATH, "dot"), (49, "panels", "weight_rows"),
                                        (16, gemm.SKINNY_PACKED_PATH, "weight_rows"), (1, gemm.SKINNY_PACKED_PATH, "dot")):
        lin = _linear(640, 300, m, bias=False)
        x = rand((m, 640), gen(m))
        with torch.no_grad():
            compiled = vtc.compile(lin, (x,), gemm="vtc")
            torch.testing.assert_close(compiled(x), lin(x), **_tol(640))
            assert (_paths(compiled), _plan(compiled).counts["packed_conv_weights"]) == (
                [want_const], 0 if want_const == "dot" else 1), m
            w = lin.weight.detach().clone()
            compiled = vtc.compile(F(), (x, w), gemm="vtc")
            torch.testing.assert_close(compiled(x, w), x @ w.t(), **_tol(640))
            assert (_paths(compiled), _plan(compiled).counts["packed_conv_weights"]) == ([want_runtime], 0), m


def test_the_weight_rows_split_goes_by_its_panels():
    """96 x 512 -> 96 on 2 threads: N split (two strips of 48 W rows), not M (48 rows in two 32-column panels
    each); 128 rows: M split (64 / 64).  Fails before: 96 rows split M (one column block)."""
    assert gemm.column_blocks(1, 96, 96, 512, 2, weight_rows=True) == 2
    assert gemm.column_blocks(1, 128, 128, 128, 2, weight_rows=True) == 1
    assert gemm.column_blocks(1, 96, 96, 512, 2) == 1  # the panels' split is unchanged (M: 48 / 48 rows)


SPLIT = [(128, 128, 128), (96, 512, 96), (100, 200, 70), (127, 65, 129)]


@pytest.mark.parametrize("m,k,n", SPLIT, ids=[f"{m}x{k}x{n}" for m, k, n in SPLIT])
def test_weight_rows_on_one_to_four_threads(m, k, n):
    """x @ w^T with a runtime w (weight_rows at any of these rows), the same kernel on 1-4 threads."""
    g = gen(m + k + n)
    x, w = rand((m, k), g), rand((n, k), g)
    fn = lambda x, w: x @ w.t()
    c = compile_cpu(fn, (x, w), gemm="vtc")
    (k_,) = [k_ for k_ in kernels(c) if k_.kind == "gemm"]
    src = gemm.generate(k_)
    if conv_t.has_avx512():
        assert "if (wt_rows) { mr = VTC_NR; nr = VTC_MR; }" in src  # fails before
    lib = cbuild.build(src, name="gemm_2threads")
    want = x @ w.t()
    for nthreads in (1, 2, 3, 4):
        torch.testing.assert_close(call_gemm_kernel(lib, k_, c, (x, w), nthreads), want, **_tol(k))


def test_the_estimates_know_w_packed_once():
    """estimate_us: the packed skinny rates below the dot path's; the panels on B packed once pay no per-element B
    term (49 rows: below weight_rows' estimate, as measured).  Fails before: no such path / argument."""
    dot = gemm.estimate_us(1, 8, 4096, 4096, b_unit_stride="k", path="panels")[0]
    assert gemm.estimate_us(1, 8, 4096, 4096, b_unit_stride="k", path=gemm.SKINNY_PACKED_PATH)[0] < dot
    wt = gemm.estimate_us(1, 49, 768, 768, b_unit_stride="k", path="weight_rows")[0]
    assert gemm.estimate_us(1, 49, 768, 768, b_unit_stride="k", path="panels", b_packed=True)[0] < wt
    assert gemm.estimate_us(1, 49, 768, 768, b_unit_stride="k", path="panels")[0] > wt


@avx512
@pytest.mark.parametrize("m,k,n", [(4, 1024, 1024), (16, 1024, 1024), (49, 768, 300)])
def test_choose_estimates_the_path_that_runs(m, k, n):
    """choose's estimate on a constant W (the report's vtc_us, also under gemm="vtc") is the packed path's, the one
    the kernel runs."""
    lin = _linear(k, n, m, bias=False)
    x = rand((m, k), gen(m))
    with torch.no_grad():
        compiled = vtc.compile(lin, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), lin(x), **_tol(k))
    (q,) = compiled.report.to_dict()["gemm"]
    path = gemm.SKINNY_PACKED_PATH if m <= gemm.SKINNY_M else "panels"
    assert q["path"] == path
    want = gemm.estimate_us(1, m, n, k, b_unit_stride="k", path=path, b_packed=True,
                            torch_speed=gemm.library_gemm_speed())[0]
    assert q["vtc_us"] == round(want, 2)
