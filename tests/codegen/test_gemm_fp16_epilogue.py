"""The float32 sums of a float16 GEMM (vtc.codegen.gemm ``narrowed``) and their epilogue: each thread sums a unit's
block into a C of its own (``_narrowed_c``: up to ``NARROWED_KEEP`` floats of row blocks, not a scratch C of the
whole product); the epilogue rounds it into the float16 output by rows (``_narrowed_rows``: vecmath's
``vtc_round_f16_n`` where the epilogue reads the product rounded, ``vtc_to_f16_n`` into the output, by streaming
stores from ``NARROWED_LARGE_BYTES`` on), on the panels path a row strip at a time as the last KC slice finishes
it (``_narrowed_strips``).  Every result against torch eager at float16's tolerance (tests/codegen/test_gemm_fp16.py's
``_assert_fp16_close``: one float16 ulp plus 2^-16 of the products' magnitudes, 97% of the elements bit for bit).

The assertions on the kernels' source fail before helper gemm16's change (session 24), which changed no result:
it is speed (docs/gemm.md)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import gemm

from tests.codegen.test_gemm_fp16 import _assert_fp16_close, _generated, _magnitude
from tests.codegen.util import compile_cpu, gen, kernels, rand, report

H = torch.float16
BLOCK_C = "vtc_gemm_scratch(3, mg * mc * LDC)"  # the thread's C of its block (``_narrowed_c``)
TO_ROWS = "(c_large ? vtc_to_f16_n_stream : vtc_to_f16_n)("  # a row of the result stored (``_narrowed_rows``)
STRIPS = "if (c_large && k0 + kb >= K) {"  # the epilogue run by row strips on the panels path (``_narrowed_strips``)


def _gemm_sources(c) -> list[str]:
    return [gemm.generate(k) for k in kernels(c) if k.kind == "gemm"]


def _assert_block_c(c, *, to_rows: bool = True, rounded_rows: bool = False) -> None:
    """Every GEMM of c narrowed into its thread's block C; `to_rows`: its output stored by rows;
    `rounded_rows`: its C rounded by rows first (the epilogue reads the product rounded to float16)."""
    srcs = _gemm_sources(c)
    assert srcs and all(BLOCK_C in s and "std::free(cacc)" not in s for s in srcs)
    assert all((TO_ROWS in s) == to_rows for s in srcs)
    assert all(("vtc_round_f16_n(ct + ii * LDC, nb)" in s) == rounded_rows for s in srcs)


@pytest.mark.parametrize("m", [1, 3, 17, 127])
def test_mm_odd_sizes(m):
    """x @ w with K and N odd (1 / 3 rows: the dot path; 17 / 127: the panels): the sums into the block C, the
    result stored by rows."""
    g = gen(300 + m)
    x, w = rand((m, 77), g, H), rand((77, 301), g, H)
    c, _, _ = _generated(lambda x, w: x @ w, (x, w), _magnitude(x, w), gemm="vtc")
    _assert_block_c(c)
    assert STRIPS in _gemm_sources(c)[0] and "if (!strips_done)" in _gemm_sources(c)[0]  # (the dot path's after)


@pytest.mark.parametrize("m", [17, 127])
def test_addmm_with_bias(m):
    """F.linear with bias (addmm): the bias added to the float32 sum before the one rounding, by rows."""
    g = gen(310 + m)
    x, w, b = rand((m, 129), g, H), rand((257, 129), g, H), rand((257,), g, H)
    c, _, _ = _generated(lambda x, w, b: F.linear(x, w, b), (x, w, b), _magnitude(x, w.t()) + b.double().abs(),
                         gemm="vtc")
    _assert_block_c(c)


def test_silu_times_up():
    """Llama's MLP: silu(x @ wg^T) * (x @ wu^T), the second GEMM's epilogue reading the first's result; its
    product rounded to float16 by rows first (as eager rounds the up projection before the multiply)."""
    g = gen(320)
    x, wg, wu = rand((40, 96), g, H), rand((200, 96), g, H), rand((200, 96), g, H)
    gate = F.silu(F.linear(x, wg))
    c, _, _ = _generated(lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu), (x, wg, wu),
                         _magnitude(x, wu.t()) * gate.double().abs() + _magnitude(x, wg.t()), gemm="vtc",
                         kinds=("gemm", "gemm"))
    srcs = _gemm_sources(c)
    assert all(BLOCK_C in s and TO_ROWS in s for s in srcs)
    assert sum("vtc_round_f16_n(ct + ii * LDC, nb)" in s for s in srcs) == 1  # the up projection's epilogue


@pytest.mark.parametrize("threads", [1, 2])
def test_residual_add(threads):
    """r + x @ w^T (a Linear's output added to the residual stream), on 1 and 2 threads."""
    g = gen(330 + threads)
    x, w, r = rand((64, 160), g, H), rand((96, 160), g, H), rand((64, 96), g, H)
    c, _, _ = _generated(lambda x, w, r: r + F.linear(x, w), (x, w, r), _magnitude(x, w.t()) + r.double().abs(),
                         gemm="vtc", threads=threads)
    _assert_block_c(c, rounded_rows=True)


@pytest.mark.parametrize("threads", [1, 2])
def test_lm_head_scaled_down(threads):
    """The logits GEMM of a float16 Llama scaled down (40 rows of 128 -> 5000 columns, N not a multiple of 32):
    column blocks of up to 1024 in each thread's C."""
    g = gen(340 + threads)
    x, w = rand((40, 128), g, H), rand((5000, 128), g, H)
    c, _, _ = _generated(lambda x, w: F.linear(x, w), (x, w), _magnitude(x, w.t()), gemm="vtc", threads=threads)
    assert [q["path"] for q in report(c)["gemm"]] == ["panels"]
    _assert_block_c(c)


@pytest.mark.parametrize("threads", [1, 2])
def test_groups_of_row_blocks_capped(monkeypatch, threads):
    """A C of the thread past NARROWED_KEEP floats (lowered here to one block): the unit loop's groups take one
    row block at a time (300 rows: 3 blocks of 100), the B block packed again for each."""
    monkeypatch.setattr(gemm, "NARROWED_KEEP", 1024)
    g = gen(350 + threads)
    x, w = rand((300, 96), g, H), rand((96, 700), g, H)
    c, _, _ = _generated(lambda x, w: x @ w, (x, w), _magnitude(x, w), gemm="vtc", threads=threads)
    assert "std::min<int64_t>(tm, 1024LL / (mc * nc))" in _gemm_sources(c)[0]
    _assert_block_c(c)


def test_transposed_result():
    """(x @ w)^T made contiguous: the GEMM's float16 elements not consecutive along its columns where it stores
    the transpose itself (rounded one by one), else stored by rows; the result as eager's either way."""
    g = gen(360)
    x, w = rand((48, 80), g, H), rand((80, 120), g, H)
    c = compile_cpu(lambda x, w: (x @ w).t().contiguous(), (x, w), gemm="vtc")
    assert [q["choice"] for q in report(c)["gemm"]] == ["vtc"]
    _assert_fp16_close(c(x, w), (x @ w).t().contiguous(), _magnitude(x, w).t())


@pytest.mark.parametrize("threads", [1, 2])
def test_large_result_streamed_by_strips(monkeypatch, threads):
    """A result from NARROWED_LARGE_BYTES on (lowered here to every one): its epilogue by row strips, its rows
    stored by streaming stores: rows of 301 float16 elements (602 bytes apart: most rows start off a 32-byte
    boundary, their first elements stored as the row's head), the bias added before the one rounding."""
    monkeypatch.setattr(gemm, "NARROWED_LARGE_BYTES", 0)
    g = gen(370 + threads)
    x, w, b = rand((37, 130), g, H), rand((301, 130), g, H), rand((301,), g, H)
    c, _, _ = _generated(lambda x, w, b: F.linear(x, w, b), (x, w, b), _magnitude(x, w.t()) + b.double().abs(),
                         gemm="vtc", threads=threads)
    assert "const bool c_large = BATCH * M * N * 2 >= 0LL;" in _gemm_sources(c)[0]
    _assert_block_c(c)
