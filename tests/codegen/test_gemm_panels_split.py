"""The panels' split over the threads where B is packed once and small (docs/gemm.md, "The panels' 2-thread split",
helper panels2t): the threads split M (each packs half of A and reads all of B, a few hundred KB) instead of N
(each packed all of A: 256 x 64 -> 1024 spent ~10% of a thread's time there).  Values against torch on 1-3 threads
at the edges of the rule (rows across the 12-row tiles, N across the 32-column panels, K*N just under the bound),
and the partition: ``column_blocks`` (the planner's copy of the kernel's arithmetic) and the kernel's C.
"""
from __future__ import annotations

import pytest
import torch

import vtc
from vtc.codegen import conv_t, gemm
from vtc.runtime import packed

from .util import gen, kernels, rand, torch_threads

avx512 = pytest.mark.skipif(not conv_t.has_avx512() or not packed.CONV_ENABLED,
                            reason="B packed once is the AVX-512 kernel's layout")


def _tol(k: int) -> dict:
    return dict(rtol=1e-4, atol=2e-6 * k ** 0.5 + 1e-5)


def _gemm_sources(compiled) -> list[str]:
    from vtc.codegen.gemm import generate

    return [generate(k) for k in kernels(compiled) if getattr(k, "gemm", None) is not None]


# (M, K, N): 256 x 64 -> 1024 (the sweep's cell), 197 rows (two blocks of 108 + 89 rows; three of 72 + 72 + 53),
# N 1000 / 655 (a partial last panel), K*N = 65500 just under PACKED_M_SPLIT_B, 288 / 300 rows (at / over one
# VTC_MC block a thread on 2 threads) and 400 x 33 -> 1900 (two column blocks of 960 already: N split as before)
SHAPES = [(256, 64, 1024), (197, 61, 1000), (288, 100, 655), (300, 100, 655), (400, 33, 1900)]


@avx512
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
def test_small_packed_b_split_by_rows_matches_torch(shape, threads):
    m, k, n = shape
    torch.manual_seed(m + k + n)
    lin = torch.nn.Linear(k, n, bias=m % 2 == 0)
    x = rand((m, k), gen(n))
    with torch_threads(threads), torch.no_grad():
        compiled = vtc.compile(lin, (x,), gemm="vtc")
        assert [q["path"] for q in compiled.report.to_dict()["gemm"]] == ["panels"]
        torch.testing.assert_close(compiled(x), lin(x), **_tol(k))
        lin.weight.mul_(-0.5)  # packed again
        x2 = rand((m, k), gen(n + 1))
        torch.testing.assert_close(compiled(x2), lin(x2), **_tol(k))


def test_the_partition_mirror():
    """Fails before (no b_packed): on 2 threads 256 x 64 -> 1024 was cut into 2 column blocks (each thread all of
    A); with B packed once it is one block, the rows split.  A large B (8 MB), a runtime B, few rows or
    weight_rows keep the N split, and so do more rows than one VTC_MC block a thread (equal blocks would split
    300 rows 168 / 132)."""
    assert gemm.column_blocks(1, 256, 1024, 64, 2) == 2
    assert gemm.column_blocks(1, 256, 1024, 64, 2, b_packed=True) == 1
    assert gemm.column_blocks(1, 288, 655, 100, 2, b_packed=True) == 1
    assert gemm.column_blocks(1, 288, 656, 100, 2, b_packed=True) == 2  # K*N over 256 KB
    assert gemm.column_blocks(1, 300, 655, 100, 2, b_packed=True) == 2  # over one MC block a thread (168 / 132 rows)
    assert gemm.column_blocks(1, 300, 655, 100, 3, b_packed=True) == 1  # on 3 threads one block each (108+108+84)
    assert gemm.column_blocks(1, 256, 1024, 2048, 2, b_packed=True) == 2
    assert gemm.column_blocks(1, 180, 1024, 64, 2, b_packed=True) == 2  # under PACKED_M_SPLIT_MIN_M rows
    assert gemm.column_blocks(1, 256, 1024, 64, 2, weight_rows=True, b_packed=True) == 2
    assert gemm.column_blocks(1, 256, 1024, 64, 1, b_packed=True) == 1


@avx512
def test_the_kernel_carries_the_rule():
    """The C's condition is column_blocks' (same bound, same rows), and holds only with B packed once (``bpk``:
    null for a runtime B, whose kernel text carries the same lines)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 1024, bias=False)
    x = rand((256, 64), gen(3))
    (src,) = _gemm_sources(vtc.compile(lin, (x,), gemm="vtc"))
    assert (f"const bool m_split = bpk && K * N <= {gemm.PACKED_M_SPLIT_B // 4}LL && M >= "
            f"{gemm.PACKED_M_SPLIT_MIN_M} && M <= nt * VTC_MC;") in src
    assert "(BATCH * tn < nt && N > M && !m_split)" in src and "if ((M >= N || m_split) && M >= 2 * nt * mr)" in src


def test_switch_off_restores_the_n_split(monkeypatch):
    monkeypatch.setattr(gemm, "PACKED_M_SPLIT", False)
    assert gemm.column_blocks(1, 256, 1024, 64, 2, b_packed=True) == 2
