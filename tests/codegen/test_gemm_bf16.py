"""bf16 GEMM kernels (vtc.codegen.gemm_bf16): mm / bmm against torch on CPUs with AVX512_BF16.

Both sides accumulate in float32 and round once to bf16, in other orders, so
results agree to about one bf16 unit in the last place (8 mantissa bits):
``BF16_TOL``.  Shapes are odd (1, 3, 17, 127; K odd, K past one KC slice, M
past one MC block, N past one 32-column panel), operands transposed, batched
(1 and 16) and GQA-expanded.  On a CPU or compiler without AVX512_BF16 the
kernel tests are skipped with the reason ``gemm_bf16.support`` gives, and
the fallback test checks that torch runs the GEMM with that reason.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import gemm_bf16

from .util import compile_cpu, gen, kernels, rand, report, steps

BF16_TOL = dict(rtol=1.6e-2, atol=1e-1)
BF = torch.bfloat16
needs_bf16 = pytest.mark.skipif(bool(gemm_bf16.support()), reason=f"no bf16 GEMM here: {gemm_bf16.support()}")


def _check(fn, inputs, n_gemm: int, **options):
    """Compiles fn, compares with eager (bf16 tolerances) and checks that n_gemm bf16 GEMM kernels ran,
    with nothing materialised on the way."""
    c = compile_cpu(fn, inputs, **options)
    want, got = fn(*inputs), c(*inputs)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for w, o in zip(want, got):
        assert o.dtype == BF and o.shape == w.shape
        torch.testing.assert_close(o, w, **BF16_TOL)
    r = report(c)
    assert [g["choice"] for g in r["gemm"]] == ["vtc"] * n_gemm, r["gemm"]
    assert [k.gemm.dtype for k in kernels(c) if k.kind == "gemm"] == [BF] * n_gemm
    assert [s.node.op for s in steps(c, "run")] == []
    assert r["materialized_movement_bytes"] == 0, c.report
    return c


@needs_bf16
def test_bf16_mm_odd_shapes():
    """Skinny dot path (B = W^T) and packed panels, every tail: rows 1..150, K odd and past a KC slice,
    N not a multiple of 32."""
    g = gen(31)
    shapes = [(1, 1, 1), (3, 17, 5), (17, 3, 127), (127, 301, 17), (150, 257, 70), (16, 300, 33)]
    inputs = tuple(t for m, k, n in shapes for t in (rand((m, k), g, BF), rand((k, n), g, BF)))
    _check(lambda *xs: tuple(xs[i] @ xs[i + 1] for i in range(0, len(xs), 2)), inputs, len(shapes), gemm="vtc")


@needs_bf16
def test_bf16_panels_rounded_in_the_micro_kernel():
    """The last KC slice's sums go to the output rounded straight from the micro-kernel's registers: one
    slice (K <= 256) and four, M past an MC block (144) with row tails of 1 and 11, N past an NC chunk (416
    columns at K = 2500) and not a multiple of 32, batched, B transposed."""
    g = gen(39)
    a1, b1 = rand((3, 157, 255), g, BF), rand((3, 255, 77), g, BF)
    a2, b2 = rand((2, 299, 771), g, BF), rand((2, 45, 771), g, BF)
    a3, b3 = rand((13, 2500), g, BF), rand((2500, 450), g, BF)
    _check(lambda a1, b1, a2, b2, a3, b3: (torch.bmm(a1, b1), torch.bmm(a2, b2.transpose(1, 2)), a3 @ b3),
           (a1, b1, a2, b2, a3, b3), 3, gemm="vtc")


@needs_bf16
def test_bf16_transposed_operands_and_linear():
    """a.t() @ b, a @ b.t() (the dot path for a few rows, panels for many) and F.linear without bias."""
    g = gen(32)
    a, b = rand((129, 19), g, BF), rand((129, 45), g, BF)
    x4, x40, w = rand((4, 257), g, BF), rand((40, 257), g, BF), rand((67, 257), g, BF)
    _check(lambda a, b, x4, x40, w: (a.t() @ b, x4 @ w.t(), x40 @ w.t(), F.linear(x4, w)),
           (a, b, x4, x40, w), 4, gemm="vtc")


@needs_bf16
@pytest.mark.parametrize("batch", [1, 16])
def test_bf16_bmm(batch):
    g = gen(33)
    a, b = rand((batch, 17, 65), g, BF), rand((batch, 33, 65), g, BF)
    _check(lambda a, b: torch.bmm(a, b.transpose(1, 2)), (a, b), 1, gemm="vtc")


@needs_bf16
def test_bf16_gqa_scores_read_through_the_head_mapping_under_auto():
    """q @ repeat_kv(k)^T: torch would copy the expanded keys first; under gemm="auto" the bf16 kernel reads
    KV head h // 4 in place."""
    g = gen(34)
    q, k = rand((2, 8, 3, 24), g, BF), rand((2, 2, 37, 24), g, BF)

    def f(q, k):
        return q @ k[:, :, None].expand(2, 2, 4, 37, 24).reshape(2, 8, 37, 24).transpose(-1, -2)
    c = _check(f, (q, k), 1)
    assert "not a strided view" in report(c)["gemm"][0]["why"]


@needs_bf16
def test_bf16_auto_keeps_torch_on_a_large_contiguous_square():
    """torch's bf16 GEMM (AMX tiles) is estimated far faster on a large contiguous product."""
    g = gen(35)
    a, b = rand((512, 512), g, BF), rand((512, 512), g, BF)
    c = compile_cpu(lambda a, b: a @ b, (a, b))
    choice = report(c)["gemm"][0]
    assert choice["choice"] == "torch" and choice["torch_us"] < choice["vtc_us"], choice
    torch.testing.assert_close(c(a, b), a @ b, **BF16_TOL)


# library_bf16_ratio (torch's bf16 GEMM rate / the generated kernel's, 384^3, 1 thread): AMX tiles (~8x, the fixed
# rates of gemm_bf16) and an AMD EPYC Zen 5 (AVX512_BF16, no AMX: 1.07, python -c "...cost._measure_library_ratio(
# dtype=torch.bfloat16)")
BF16_RATIO = {"amx": 8.0, "no_amx": 1.07}


@needs_bf16
@pytest.mark.parametrize("cpu", sorted(BF16_RATIO))
def test_bf16_auto_follows_the_measured_library_ratio(monkeypatch, cpu):
    """q @ repeat_kv(k)^T with 40 query rows over a 1027-token cache (packed panels; torch copies the expanded
    keys first): with AMX figures copy + torch's AMX GEMM is estimated cheaper, without AMX (torch's bf16 GEMM
    measured as fast as the generated one) the generated kernel reads KV head h // 4 in place (measured on the
    Zen 5, 1 thread, 32 heads x 64 rows x 2048 tokens: 3.18 ms against torch's 4.46).  Under both a large
    contiguous square keeps torch (at best a tie) and decode's single row x @ W^T is generated."""
    from vtc.plan import cost

    monkeypatch.setattr(cost, "_machine", lambda: cost.Machine(bandwidth_gbs=20.0, measured=True,
                                                               library_bf16_ratio=BF16_RATIO[cpu]))
    g = gen(38)
    q, k = rand((1, 8, 40, 64), g, BF), rand((1, 2, 1027, 64), g, BF)
    a, b, x, w = rand((384, 384), g, BF), rand((384, 384), g, BF), rand((1, 2051), g, BF), rand((1001, 2051), g, BF)

    def f(q, k, a, b, x, w):
        kk = k[:, :, None].expand(1, 2, 4, 1027, 64).reshape(1, 8, 1027, 64)
        return q @ kk.transpose(-1, -2), a @ b, x @ w.t()
    c = compile_cpu(f, (q, k, a, b, x, w))
    for got, want in zip(c(q, k, a, b, x, w), f(q, k, a, b, x, w)):
        assert got.dtype == BF and got.shape == want.shape
        torch.testing.assert_close(got, want, **BF16_TOL)
    r = report(c)["gemm"]
    assert [x["choice"] for x in r] == [{"amx": "torch", "no_amx": "vtc"}[cpu], "torch", "vtc"], r
    assert "not a strided view" in r[0]["why"], r[0]


@needs_bf16
def test_bf16_result_into_a_cat_output():
    """A bf16 GEMM does not store into a pushed cat itself (the cat runs as it would after torch's GEMM).
    plan="greedy": under plan="all" a bf16 cat fails with or without this kernel (no bf16 copy kernels)."""
    g = gen(36)
    a, b, y = rand((5, 33), g, BF), rand((33, 7), g, BF), rand((5, 3), g, BF)
    c = compile_cpu(lambda a, b, y: torch.cat([a @ b, y], 1), (a, b, y), gemm="vtc", plan="greedy")
    torch.testing.assert_close(c(a, b, y), torch.cat([a @ b, y], 1), **BF16_TOL)
    assert report(c)["gemm"][0]["stores_into"] == []


def test_bf16_falls_back_to_torch_with_the_reason(monkeypatch):
    """A target without AVX512_BF16 runs the GEMM through torch, the reason in the report; never a crash or a
    float32 result (addmm, which this test ran through torch before, is generated since: test_bf16_epilogue.py)."""
    g = gen(37)
    a, b = rand((17, 129), g, BF), rand((129, 33), g, BF)
    monkeypatch.setattr(gemm_bf16, "support", lambda: "the compiler's target has no AVX512_BF16 (test)")
    c = compile_cpu(lambda a, b: torch.relu(a @ b), (a, b), gemm="vtc")
    got = c(a, b)
    assert got.dtype == BF
    torch.testing.assert_close(got, torch.relu(a @ b), **BF16_TOL)
    choice = report(c)["gemm"][0]
    assert choice["choice"] == "torch" and "no AVX512_BF16 (test)" in choice["why"], choice
    assert [k for k in kernels(c) if k.kind == "gemm"] == []
