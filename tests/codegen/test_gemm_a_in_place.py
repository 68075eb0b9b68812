"""The panels' tiles reading a row-major A in place where N is small (vtc.codegen.gemm ``_a_in_place``,
``vtc_ukr_a``): no A pack on AVX-512, each 12-row strip of A broadcast from its rows.

Against torch at odd sizes: M above SKINNY_M across the 12-row micro-tile and the 144-row block (17, 127, 301),
N across the 32-column panel up to A_IN_PLACE_N (1, 33, 64, 127, 192) and to A_IN_PLACE_N_SPREAD where A's rows
are not 4 KB apart (384, 500, 512), K across 16 and the 256-deep slices (3,
257, 600); A a column slice of a wider tensor (row stride != K), a batched product (A's batch term), B a
runtime operand and a constant Linear weight (packed once, vtc.runtime.packed), a bias epilogue, and 1-4
threads on the same kernel.
"""
from __future__ import annotations

import platform

import pytest
import torch
from torch import nn

from vtc.codegen import gemm
from vtc.codegen.conv_t import has_avx512
from vtc.runtime import cbuild

from .util import assert_matches_eager, call_gemm_kernel, compile_cpu, gen, kernels, rand

GEMM_TOL = dict(rtol=1e-4, atol=5e-4)  # float32 sums over K up to 600 of products of magnitude <= 4
AVX512 = platform.machine() in ("x86_64", "AMD64") and has_avx512()


def _in_place(src: str) -> bool:
    return "vtc_ukr_a_edge<" in src.split('extern "C"')[1]


def _gemms(compiled) -> list:
    return [k for k in kernels(compiled) if k.kind == "gemm"]


@pytest.mark.parametrize("k", [3, 257, 600])
def test_runtime_operands_at_odd_sizes(k):
    g = gen(41)
    shapes = [(17, 1), (127, 33), (301, 64), (145, 127), (40, 192)]
    inputs = tuple(t for m, n in shapes for t in (rand((m, k), g), rand((k, n), g)))
    fn = lambda *xs: tuple(xs[i] @ xs[i + 1] for i in range(0, len(xs), 2))
    c = compile_cpu(fn, inputs, gemm="vtc")
    assert_matches_eager(c, fn, inputs, **GEMM_TOL)
    if AVX512:  # fails before the path: every A was packed
        assert all(_in_place(gemm.generate(k_)) for k_ in _gemms(c))


def test_not_taken_for_wider_n_or_skinny_m():
    g = gen(42)
    inputs = (rand((40, 100), g), rand((100, gemm.A_IN_PLACE_N_SPREAD + 1), g), rand((16, 100), g), rand((100, 64), g))
    fn = lambda a, b, x, w: (a @ b, x @ w)
    c = compile_cpu(fn, inputs, gemm="vtc")
    assert_matches_eager(c, fn, inputs, **GEMM_TOL)
    assert not any(_in_place(gemm.generate(k_)) for k_ in _gemms(c))


class _Linears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(300, 96), nn.Linear(257, 33, bias=False)

    def forward(self, x, y):
        return torch.relu(self.a(x)), self.b(y[:, 7:264])  # bias + relu epilogue; A a column slice


def test_constant_weights_a_slice_and_an_epilogue():
    """B a constant Linear weight (packed once by the call plan where it applies), A = y[:, 7:264] (rows 300
    floats apart), a bias and relu epilogue; checked again after the weights change."""
    g = gen(43)
    torch.manual_seed(0)
    m = _Linears().eval()
    x, y = rand((133, 300), g), rand((301, 300), g)
    c = compile_cpu(m, (x, y), gemm="vtc")
    assert_matches_eager(c, m, (x, y), **GEMM_TOL)
    with torch.no_grad():
        m.a.weight.mul_(-0.5)
        m.b.weight.add_(0.25)
    assert_matches_eager(c, m, (x, y), **GEMM_TOL)
    if AVX512:
        assert sum(_in_place(gemm.generate(k_)) for k_ in _gemms(c)) == 2


def test_batched_a():
    g = gen(44)
    a, b = rand((3, 129, 200), g), rand((3, 200, 65), g)
    c = compile_cpu(torch.bmm, (a, b), gemm="vtc")
    assert_matches_eager(c, torch.bmm, (a, b), **GEMM_TOL)


def test_off_packs_a(monkeypatch):
    monkeypatch.setattr(gemm, "A_IN_PLACE_N", 0)
    monkeypatch.setattr(gemm, "A_IN_PLACE_N_SPREAD", 0)
    g = gen(45)
    a, b = rand((127, 257), g), rand((257, 33), g)
    c = compile_cpu(lambda a, b: a @ b, (a, b), gemm="vtc")
    assert_matches_eager(c, lambda a, b: a @ b, (a, b), **GEMM_TOL)
    assert not any(_in_place(gemm.generate(k_)) for k_ in _gemms(c))


@pytest.mark.parametrize("m,k,n", [(2048, 300, 64), (301, 600, 127), (1000, 300, 384), (301, 257, 500)])
def test_every_thread_count_covers_the_output_once(m, k, n):
    """Above the parallel threshold (M split across threads), 1-4 threads on one kernel reading A in place (N up
    to A_IN_PLACE_N, and up to A_IN_PLACE_N_SPREAD where A's rows are not 4 KB apart)."""
    g = gen(46 if n <= gemm.A_IN_PLACE_N else 48)
    a, b = rand((m, k), g), rand((k, n), g)
    c = compile_cpu(lambda a, b: a @ b, (a, b), gemm="vtc")
    (k_,) = _gemms(c)
    src = gemm.generate(k_)
    assert _in_place(src) == AVX512
    lib = cbuild.build(src, name="gemm_a_in_place")
    want = a @ b
    for nthreads in (1, 2, 3, 4):
        torch.testing.assert_close(call_gemm_kernel(lib, k_, c, (a, b), nthreads), want, **GEMM_TOL)


def test_wider_n_in_place_where_a_rows_are_not_4kb_apart():
    """N = 193..A_IN_PLACE_N_SPREAD: A read in place where its rows are not a multiple of 4 KB apart (K = 300, 257;
    a slice of rows 1000 floats apart), packed where they are (K = 1024, a slice of a 2048-wide tensor: the 12
    rows of a strip would share one L1 set) and above the bound (N = 513).  Fails before: every A packed above
    N = 192."""
    g = gen(47)
    x, y = rand((150, 1000), g), rand((140, 2048), g)
    inputs = (rand((133, 300), g), rand((300, 384), g), rand((40, 257), g), rand((257, 512), g),
              rand((150, 1024), g), rand((1024, 256), g), rand((60, 300), g), rand((300, 513), g), x, y,
              rand((600, 300), g), rand((700, 200), g))
    fn = lambda a, b, c, d, e, f, p, q, x, y, w1, w2: (a @ b, c @ d, e @ f, p @ q, x[:, 3:603] @ w1, y[:, :700] @ w2)
    c = compile_cpu(fn, inputs, gemm="vtc")
    assert_matches_eager(c, fn, inputs, **GEMM_TOL)
    if AVX512:
        assert [_in_place(gemm.generate(k_)) for k_ in _gemms(c)] == [True, True, False, False, True, False]
