"""The "weight_rows" path of the generated GEMM (vtc.codegen.gemm.kernel_path): C = A @ W^T with 12 <= M <= 128
computed as C^T = W @ A^T, W's rows read in place as the micro-kernel's broadcast operand (no B pack), A^T
packed into 32-column panels once per thread, each 12 x 32 tile transposed in registers on its way into C.

Every case compiles with ``gemm="vtc"``, compares with eager on random inputs (never zeros) and asserts through
the report that the path was taken: odd M (12 and 16: half panels; 17, 33, 127: partial 32-row panels), N < 12 and N % 12 != 0
(the 8/4/2/1-row edge kernels), K = 1, 3, 257 and K > WT_KC (two reduction slices, the second adding),
strided and transposed A, a slice or every other row of a weight (row stride != K), batched weights, fused
epilogues (bias, activation, residual), the streamed stores of a large C, every thread count, and the AVX2 /
scalar builds of the same source (which run the panels path).
"""
from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import gemm as G
from vtc.codegen.gemm import generate as generate_gemm
from vtc.runtime import cbuild

from .test_gemm import GEMM_TOL, _assert_generated_without_movement, _check, _gemm_kernels
from .util import call_gemm_kernel, gen, rand, report, run_gemm_built_for


def _paths(c) -> list[str]:
    return [g["path"] for g in report(c)["gemm"]]


# (M, K, N): M >= WT_MIN_M; N below and across the 12-row strips, M across the 32-column panels
SHAPES = [(12, 33, 25), (16, 70, 40), (17, 1, 3), (33, 3, 1), (40, 3, 5), (127, 17, 13), (17, 257, 127), (100, 130, 37), (128, 512, 50), (20, 64, 12)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_linear_weight_read_in_place(m, k, n):
    g = gen(40 + m + k + n)
    x, w = rand((m, k), g), rand((n, k), g)
    c = _check(lambda x, w: x @ w.t(), (x, w), gemm="vtc")
    _assert_generated_without_movement(c)
    # K = 1 or N = 1: W's index along that dim is constant, W^T has a unit stride along n too (panels path)
    assert _paths(c) == ["weight_rows" if k > 1 and n > 1 else "panels"], report(c)["gemm"]


def test_two_reduction_slices_add_into_the_first():
    """K = 2100 > WT_KC: the second slice adds its transposed tiles to what the first stored."""
    g = gen(41)
    x, w = rand((40, 2100), g), rand((29, 2100), g)
    c = _check(lambda x, w: x @ w.t(), (x, w), gemm="vtc")
    assert G.WT_KC < 2100 and _paths(c) == ["weight_rows"]


def test_strided_and_transposed_a_and_strided_weights():
    """A a column slice (row stride 310) or transposed (unit stride along m: packed by the scalar loop); W a
    column slice of a wider weight, every other row (row strides 310 and 600) or its rows flipped (a negative
    row stride): one graph."""
    g = gen(42)
    xa, xt, wa, wb = rand((37, 310), g), rand((300, 45), g), rand((19, 310), g), rand((26, 300), g)

    def fn(xa, xt, wa, wb):
        return (xa[:, 5:305] @ wa[:, 3:303].t(), xt.t() @ wb[::2].t(), xa[:, :300] @ wb[1::2].t(),
                xa[:, :300] @ wb.flip(0).t())
    c = _check(fn, (xa, xt, wa, wb), gemm="vtc")
    _assert_generated_without_movement(c, 4)
    assert _paths(c) == ["weight_rows"] * 4, report(c)["gemm"]


@pytest.mark.parametrize("epilogue", ["bias", "gelu", "residual"])
def test_fused_epilogues(epilogue):
    """Bias (addmm), an activation and a residual add run in the epilogue over the transposed-stored block (64
    rows: at 70 the constant W is packed once and the panels run, gemm._panels_pad_less)."""
    g = gen(43)
    lin = torch.nn.Linear(129, 45, bias=epilogue == "bias")
    x, r = rand((64, 129), g), rand((64, 45), g)
    fns = {"bias": lambda x, r: lin(x), "gelu": lambda x, r: F.gelu(lin(x)), "residual": lambda x, r: lin(x) + r}
    c = _check(fns[epilogue], (x, r), gemm="vtc")
    (k,) = _gemm_kernels(c)
    assert _paths(c) == ["weight_rows"] and k.stores[0].value.op != "acc", k.stores[0].value


@pytest.mark.parametrize("batch", [1, 16])
def test_batched_weights(batch):
    """bmm against transposed per-batch weights: each batch's A^T is packed (the pack is keyed by batch)."""
    g = gen(44 + batch)
    a, w = rand((batch, 19, 65), g), rand((batch, 27, 65), g)
    c = _check(lambda a, w: torch.bmm(a, w.transpose(1, 2)), (a, w), gemm="vtc")
    _assert_generated_without_movement(c)
    assert _paths(c) == ["weight_rows"]


def test_large_c_is_streamed(monkeypatch):
    """With the streaming threshold lowered, C is staged 48 columns at a time and written by streaming stores
    where a row starts on a cache line (N = 160: rows 640 bytes apart), else by masked stores (N = 101, and the
    last group of 16 / 5 columns)."""
    monkeypatch.setattr(G, "WT_STREAM_BYTES", 0)
    g = gen(45)
    x, w1, w2 = rand((33, 70), g), rand((160, 70), g), rand((101, 70), g)
    c = _check(lambda x, w1, w2: (x @ w1.t(), x @ w2.t()), (x, w1, w2), gemm="vtc")
    assert _paths(c) == ["weight_rows"] * 2
    assert all("vtc_stream_rows(stage" in generate_gemm(k) for k in _gemm_kernels(c))


@pytest.mark.parametrize("m,n", [(127, 600), (120, 100)], ids=["n_split", "m_split"])
def test_every_thread_count_covers_the_output_once(m, n):
    """1 to 4 threads: N split into chunks (each thread packs A^T once), or M split into blocks (M >= N: each
    thread packs its own block)."""
    g = gen(46)
    inputs = (rand((m, 257), g), rand((n, 257), g))
    fn = lambda x, w: x @ w.t()  # noqa: E731
    c = _check(fn, inputs, gemm="vtc")
    (k,) = _gemm_kernels(c)
    assert _paths(c) == ["weight_rows"]
    lib = cbuild.build(generate_gemm(k), name="gemm_direct")
    for nthreads in (1, 2, 3, 4):
        torch.testing.assert_close(call_gemm_kernel(lib, k, c, inputs, nthreads), fn(*inputs), **GEMM_TOL)


def test_auto_generates_llama_projections():
    """gemm="auto" runs x @ W^T at 128 rows (llama_model's MLP, K = 512, N = 1376) on the weight_rows path
    (estimated faster than torch's library kernel), a 384 x 1024 x 1024 one through torch."""
    g = gen(47)
    inputs = (rand((128, 512), g), rand((1376, 512), g), rand((384, 1024), g), rand((1024, 1024), g))
    c = _check(lambda x, w, a, b: (x @ w.t(), a @ b.t()), inputs)
    r = report(c)["gemm"]
    assert [(x["choice"], x["path"]) for x in r] == [("vtc", "weight_rows"), ("torch", "")], r


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "scalar"])
def test_avx2_and_scalar_builds_run_the_panels_path(march, tmp_path):
    g = gen(48)
    inputs = (rand((29, 37), g), rand((45, 37), g))
    fn = lambda x, w: x @ w.t()  # noqa: E731
    c = _check(fn, inputs, gemm="vtc")
    (k,) = _gemm_kernels(c)
    torch.testing.assert_close(run_gemm_built_for(march, k, c, inputs, tmp_path), fn(*inputs), **GEMM_TOL)
