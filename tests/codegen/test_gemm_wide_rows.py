"""One or two rows of A against a row-major B read in place (vtc.codegen.gemm ``_wide_rows``, ``vtc_ukr_rows``).

At M <= WIDE_ROWS_M the kernel cuts N into blocks of up to WIDE_NC columns (whole blocks per thread) and per
block runs vtc_ukr_rows: WIDE_U rows of B per pass over all the block's columns, C read back and stored per pass
(masked past N, the last K % WIDE_U rows one pass each).  Compared with torch at odd sizes: N across 16-column
and block edges (1, 3, 17, 127, 129, 300, 2049, 4097), K across WIDE_U and the KC slice (1, 3, 7, 9, 127, 2051,
4097: slices after the first add to what it stored), a B that is a column slice (row stride != N), a batched
product (decode's probabilities @ V), an epilogue, and 1-4 threads on the same kernel.
"""
from __future__ import annotations

import platform

import pytest
import torch

from vtc.codegen import gemm
from vtc.codegen.conv_t import has_avx512
from vtc.runtime import cbuild

from .util import assert_matches_eager, call_gemm_kernel, compile_cpu, gen, kernels, rand

GEMM_TOL = dict(rtol=1e-4, atol=1e-3)  # float32 sums over K up to 2051 of products of magnitude <= 4
LONG_TOL = dict(rtol=1e-4, atol=4e-3)  # K up to 4097

avx512 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not has_avx512(),
                            reason="the path is AVX-512 only")


def _gemm_sources(compiled) -> list[str]:
    return [gemm.generate(k) for k in kernels(compiled) if k.kind == "gemm"]


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("k,n", [(1, 1), (3, 17), (300, 128), (127, 129), (2051, 300)])
def test_rows_against_a_row_major_b(m, k, n):
    g = gen(31)
    a, b = rand((m, k), g), rand((k, n), g)
    c = compile_cpu(lambda a, b: a @ b, (a, b), gemm="vtc")
    assert_matches_eager(c, lambda a, b: a @ b, (a, b), **GEMM_TOL)


@avx512
@pytest.mark.parametrize("m,wide", [(1, True), (2, True), (3, False), (17, False)])
def test_the_path_is_taken_for_one_or_two_rows_only(m, wide):
    """Fails before the path: no vtc_ukr_rows call in any kernel."""
    g = gen(32)
    a, b = rand((m, 300), g), rand((300, 129), g)
    c = compile_cpu(lambda a, b: a @ b, (a, b), gemm="vtc")
    assert_matches_eager(c, lambda a, b: a @ b, (a, b), **GEMM_TOL)
    (src,) = _gemm_sources(c)
    assert ("vtc_ukr_rows<" in src.split('extern "C"')[1]) == wide


def test_b_a_column_slice_and_a_batch():
    """B = w[:, 5:134] (its rows 300 floats apart, not N = 129) and decode's probabilities @ V per head."""
    g = gen(33)
    x, w = rand((2, 257), g), rand((257, 300), g)
    p, v = rand((16, 1, 77), g), rand((16, 77, 64), g)
    fn = lambda x, w, p, v: (x @ w[:, 5:134], torch.bmm(p, v))
    c = compile_cpu(fn, (x, w, p, v), gemm="vtc")
    assert_matches_eager(c, fn, (x, w, p, v), **GEMM_TOL)
    if platform.machine() in ("x86_64", "AMD64") and has_avx512():
        assert all("vtc_ukr_rows<" in s.split('extern "C"')[1] for s in _gemm_sources(c))


def test_rows_off_is_the_panel_path(monkeypatch):
    monkeypatch.setattr(gemm, "WIDE_ROWS", False)
    g = gen(34)
    a, b = rand((1, 300), g), rand((300, 129), g)
    c = compile_cpu(lambda a, b: a @ b, (a, b), gemm="vtc")
    assert_matches_eager(c, lambda a, b: a @ b, (a, b), **GEMM_TOL)
    assert not any("vtc_ukr_rows<" in s.split('extern "C"')[1] for s in _gemm_sources(c))


@pytest.mark.parametrize("m,k,n", [(1, 4096, 1100), (2, 2051, 257), (1, 4097, 4097), (2, 1031, 1000), (1, 600, 2100)])
def test_every_thread_count_covers_the_output_once(m, k, n):
    """Above the parallel threshold (N split across the threads in equal blocks of at most WIDE_NC columns rounded
    to 32, the last one narrower and not a multiple of 16: 1345 / 929 columns at N = 4097, 488 / 296 / 232 at
    N = 1000), K not a multiple of WIDE_U or of the slice, 1-4 threads on one kernel."""
    _matches_torch_on_every_thread_count(m, k, n, seed=35, name="gemm_wide_rows")


def _matches_torch_on_every_thread_count(m: int, k: int, n: int, seed: int, name: str) -> None:
    """a @ b's generated kernel (gemm="vtc") built once and called at 1-4 threads, each result against torch."""
    g = gen(seed)
    a, b = rand((m, k), g), rand((k, n), g)
    c = compile_cpu(lambda a, b: a @ b, (a, b), gemm="vtc")
    (k_,) = [k_ for k_ in kernels(c) if k_.kind == "gemm"]
    lib = cbuild.build(gemm.generate(k_), name=name)
    want = a @ b
    for nthreads in (1, 2, 3, 4):
        torch.testing.assert_close(call_gemm_kernel(lib, k_, c, (a, b), nthreads), want, **LONG_TOL)


@avx512
@pytest.mark.parametrize("m", [1, 2])
def test_one_call_per_column_block_of_wide_nc(m):
    """The kernel's loops (session 15): blocks of WIDE_NC columns (KC slices of WIDE_BLOCK / min(N, WIDE_NC) rows,
    128 at least), one vtc_ukr_rows call per block and slice over all its nb columns, WIDE_U rows of B per pass.
    Fails before: 128-column blocks, vtc_ukr_rows<m, 8, 16> per 128 columns."""
    g = gen(36)
    a, b = rand((m, 300), g), rand((300, 129), g)
    c = compile_cpu(lambda a, b: a @ b, (a, b), gemm="vtc")
    assert_matches_eager(c, lambda a, b: a @ b, (a, b), **GEMM_TOL)
    (src,) = _gemm_sources(c)
    body = src.split('extern "C"')[1]
    assert f"nc = {gemm.WIDE_NC}; kc = std::max<int64_t>(128, {gemm.WIDE_BLOCK} / std::min<int64_t>(N, nc));" in body
    assert f"vtc_ukr_rows<{m}, {gemm.WIDE_U}>(kb, ap, bsrc, ldb, ct, LDC, k0 > 0, nb);" in body
    assert body.count("vtc_ukr_rows<") == (2 if gemm.WIDE_KSPLIT else 1)  # + the K split's (N <= WIDE_NC)


@pytest.mark.parametrize("m", [1, 2])
def test_odd_sizes_across_the_blocks_and_the_row_groups(m):
    """N across 16-column tails and the 2048-column block (2049, 4097: two or three equal blocks, the last 993 /
    1345 columns), K below, at and across WIDE_U (1, 3, 7, 9, 127) and over three KC slices of 100 rows (300 x
    2049); N <= 128 (vtc_ukr_rows_narrow: 16 / 32 / 64 / 128 columns of registers, K not a multiple of their row
    sets: 4097 x 45, 77 x 64, 5 x 128, 1031 x 100); one compiled function, several kernels."""
    g = gen(37)
    shapes = [(1, 4097), (3, 17), (7, 2049), (300, 2049), (9, 33), (127, 1), (4097, 45), (77, 64), (5, 128), (1031, 100)]
    ins = tuple(t for k, n in shapes for t in (rand((m, k), g), rand((k, n), g)))
    fn = lambda *xs: tuple(xs[i] @ xs[i + 1] for i in range(0, len(xs), 2))
    c = compile_cpu(fn, ins, gemm="vtc")
    assert_matches_eager(c, fn, ins, **LONG_TOL)


def test_an_epilogue_and_a_second_slice():
    """relu(x @ b + bias) over two KC slices at one row (K = 1000, N = 300: slices of 500 rows): the epilogue reads
    what the slices accumulated."""
    g = gen(38)
    x, b, bias = rand((1, 1000), g), rand((1000, 300), g), rand((300,), g)
    fn = lambda x, b, bias: torch.relu(x @ b + bias)
    c = compile_cpu(fn, (x, b, bias), gemm="vtc")
    assert_matches_eager(c, fn, (x, b, bias), **GEMM_TOL)



@avx512
@pytest.mark.parametrize("m", [1, 2])
def test_one_column_block_splits_k_over_the_threads(m):
    """N <= WIDE_NC on 2+ threads (session 18): each thread runs vtc_ukr_rows over a contiguous range of B's rows
    (a multiple of WIDE_U apart) and all N columns, into C or its scratch; the partial rows are summed after the
    threads join, then the epilogue.  Fails before: no K split in the kernel."""
    g = gen(39)
    a, b = rand((m, 1031), g), rand((1031, 1000), g)
    c = compile_cpu(lambda a, b: a @ b, (a, b), gemm="vtc")
    (src,) = _gemm_sources(c)
    body = src.split('extern "C"')[1]
    assert f"const bool ksplit = {gemm._ksplit_condition()};" in body
    assert f"vtc_ukr_rows<{m}, {gemm.WIDE_U}>(kb, ap, bsrc, ldb, ct, LDC, k0 > kl, nb);" in body
    assert "if (ksplit) tn = 0;" in body and "cg[ii * LDC + jj] += s[ii * LDC + jj];" in body


@pytest.mark.parametrize("m,k,n", [(1, 1031, 1000), (2, 4096, 128), (1, 600, 2048), (2, 300, 2049)])
def test_k_split_values_on_every_thread_count(m, k, n):
    """The K split (N <= WIDE_NC, K >= WIDE_KSPLIT_MIN_ROWS per thread) at 1-4 threads on one kernel against torch:
    K not a multiple of WIDE_U or of the threads, row ranges cut inside a KC slice (600 / 3 threads: 200 -> 192 +
    200 + 208 rows), the narrow kernel (128 columns), the widest block (2048), and 2049 columns (two blocks: the
    column split, as before)."""
    _matches_torch_on_every_thread_count(m, k, n, seed=40, name="gemm_wide_rows_ksplit")


def test_k_split_with_an_epilogue_on_every_thread_count():
    """relu(x @ b + bias) with the K split: the epilogue runs once over the summed rows, after the threads join."""
    g = gen(41)
    x, b, bias = rand((2, 1500), g), rand((1500, 700), g), rand((700,), g)
    fn = lambda x, b, bias: torch.relu(x @ b + bias)
    c = compile_cpu(fn, (x, b, bias), gemm="vtc")
    (k_,) = [k_ for k_ in kernels(c) if k_.kind == "gemm"]
    lib = cbuild.build(gemm.generate(k_), name="gemm_wide_rows_ksplit_epi")
    want = fn(x, b, bias)
    for nthreads in (1, 2, 3, 4):
        torch.testing.assert_close(call_gemm_kernel(lib, k_, c, (x, b, bias), nthreads), want, **LONG_TOL)
    assert_matches_eager(c, fn, (x, b, bias), **LONG_TOL)
