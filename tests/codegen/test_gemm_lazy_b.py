"""The panels GEMM's B pack in the block's first row strip (vtc.codegen.gemm ``_lazy_b``, ``LAZY_B``).

A plain strided B (row-major, or a Linear weight read as W^T) is packed one NR-column panel at a time just
before the block's first row strip uses it, and that strip's micro-kernel prefetches the next panel's
source (``vtc_ukr<VTC_MR, PF>``).  Each kernel is run with 1 to 4 threads (a thread's range can start in
the middle of a column chunk's M blocks: its first strip is then another block's) and compared with torch
at odd sizes: M, N and K across MR / NR / 16 / KC edges, N = 1 (one partial panel), K = 3 (no 16 x 16
transpose).
"""
from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from vtc.codegen import gemm
from vtc.codegen.cpp import buffer_order
from vtc.runtime import cbuild

from .util import assert_matches_eager, compile_cpu, gen, kernels, rand, run_gemm_built_for

GEMM_TOL = dict(rtol=1e-4, atol=4e-4)  # float32 sums over K up to 600 of products of magnitude <= 4

# (M, K, N): M > SKINNY_M (127: weight_rows on AVX-512 for W^T; 145, 300: the panels); N = 1 / 33 / 65 (a
# partial last panel), 127 / 300 (several panels, one partial);
# K = 3 (no full 16 x 16 transpose), 257 (two KC slices of 129 / 128: K tails), 600 (three slices)
SHAPES = [(17, 3, 1), (127, 257, 300), (300, 17, 127), (300, 600, 65), (145, 64, 33)]


def _gemm(compiled):
    (k,) = [k for k in kernels(compiled) if k.kind == "gemm"]
    return k


def _built(k, compiled, inputs: tuple):
    """Gemm kernel k built from its source: nthreads -> its output on `inputs`."""
    fn = getattr(cbuild.build(gemm.generate(k), name="gemm_lazy_b"), k.name)
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int], None
    env = dict(zip([v.name for v in compiled.graph.inputs], inputs))

    def run(nthreads: int) -> torch.Tensor:
        out = torch.empty(k.stores[0].buffer.shape)
        tensors = [env[b.name].contiguous() if b.name in env else out for b in buffer_order(k)]
        fn((ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors]), nthreads)
        return out
    return run


def _linear(x, w):
    return x @ w.t()


def _mm(a, b):
    return a @ b


@pytest.mark.parametrize("form", ["row_major", "weight_t"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_first_strip_pack_matches_torch_on_1_to_4_threads(form, m, k, n):
    g = gen(1000 * m + n + (7 if form == "weight_t" else 0))
    fn, inputs = ((_mm, (rand((m, k), g), rand((k, n), g))) if form == "row_major"
                  else (_linear, (rand((m, k), g), rand((n, k), g))))
    c = compile_cpu(fn, inputs, gemm="vtc")
    assert_matches_eager(c, fn, inputs, **GEMM_TOL)
    run, want = _built(_gemm(c), c, inputs), fn(*inputs)
    for nthreads in (1, 2, 3, 4):
        torch.testing.assert_close(run(nthreads), want, **GEMM_TOL, msg=lambda s: f"{nthreads} threads: {s}")


def test_batched_transposed_b_packs_per_batch(monkeypatch):
    """bmm against B^T (attention's q @ k^T form): the first strip of every (batch, column chunk) packs.  (N = 47:
    A_IN_PLACE_N off, or the tiles read A in place and the first strip only packs, test_gemm_a_in_place.py.)"""
    monkeypatch.setattr(gemm, "A_IN_PLACE_N", 0)
    monkeypatch.setattr(gemm, "A_IN_PLACE_N_SPREAD", 0)
    g = gen(5)
    inputs = (rand((3, 129, 70), g), rand((3, 47, 70), g))
    fn = lambda a, b: a @ b.transpose(1, 2)  # noqa: E731
    c = compile_cpu(fn, inputs, gemm="vtc")
    assert_matches_eager(c, fn, inputs, **GEMM_TOL)
    assert "vtc_ukr<VTC_MR, 2>" in gemm.generate(_gemm(c))
    run = _built(_gemm(c), c, inputs)
    for nthreads in (1, 2, 3):
        torch.testing.assert_close(run(nthreads), fn(*inputs), **GEMM_TOL)


def test_source_packs_b_in_the_first_strip_only_where_b_is_plain(monkeypatch):
    """Row-major B: PF 1, W^T: PF 2; a cat along N (packed by runs), skinny rows and LAZY_B = False keep the
    whole-block pack (no prefetching micro-kernel).  (N = 45: A_IN_PLACE_N off, as above.)"""
    monkeypatch.setattr(gemm, "A_IN_PLACE_N", 0)
    monkeypatch.setattr(gemm, "A_IN_PLACE_N_SPREAD", 0)
    g = gen(6)
    x, w, b = rand((40, 70), g), rand((45, 70), g), rand((70, 45), g)
    src = {name: gemm.generate(_gemm(compile_cpu(fn, inputs, gemm="vtc"))) for name, fn, inputs in [
        ("row_major", _mm, (x, b)), ("weight_t", _linear, (x, w)),
        ("cat_n", lambda a, u, v: a @ torch.cat([u, v], 1), (x, b[:, :20], b[:, 20:])),
        ("skinny", _mm, (x[:5], b))]}
    assert "vtc_ukr<VTC_MR, 1>" in src["row_major"] and "vtc_ukr<VTC_MR, 2>" not in src["row_major"]
    assert "vtc_ukr<VTC_MR, 2>" in src["weight_t"]
    for name in ("cat_n", "skinny"):
        assert "vtc_ukr<VTC_MR, 1>" not in src[name] and "vtc_ukr<VTC_MR, 2>" not in src[name], name
    c = compile_cpu(_linear, (x, w), gemm="vtc")
    saved, gemm.LAZY_B = gemm.LAZY_B, False
    try:
        assert "vtc_ukr<VTC_MR, 2>" not in gemm.generate(_gemm(c))
    finally:
        gemm.LAZY_B = saved


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "scalar"])
@pytest.mark.parametrize("form", ["row_major", "weight_t"])
def test_first_strip_pack_on_avx2_and_scalar_builds(march, form, tmp_path):
    """Without AVX-512 the first strip packs its panels the same way and runs the edge kernels."""
    g = gen(8)
    fn, inputs = ((_mm, (rand((37, 70), g), rand((70, 45), g))) if form == "row_major"
                  else (_linear, (rand((37, 70), g), rand((45, 70), g))))
    c = compile_cpu(fn, inputs, gemm="vtc")
    out = run_gemm_built_for(march, _gemm(c), c, inputs, tmp_path)
    torch.testing.assert_close(out, fn(*inputs), **GEMM_TOL)
