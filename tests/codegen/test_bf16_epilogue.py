"""bf16 GEMMs with their epilogue fused (vtc.codegen.gemm_bf16, vtc.codegen.lower ``_epilogues``).

A bf16 ``addmm`` (nn.Linear with bias) and a bf16 GEMM whose one reader is a pointwise op at its
own index (bias, gelu / silu / relu, a residual add, a scale, a cast to float32) are one generated kernel: the
sums stay float32 until the store.  Eager's addmm adds the bias to the float32 sums and rounds once (checked
below against float64); eager's mm then a pointwise op rounds the product to bf16 first, then each op: the
fused kernel does the same (the GEMM result is cast to bf16 where the epilogue reads it).  Tolerances:
``BF16_TOL`` against eager (both sum in float32, in other orders: about one bf16 unit in the last place), and
the mean distance to a float64 reference no more than 1.05x eager's.  All tests fail before the change
(addmm in bf16 ran through torch, a bf16 GEMM's pointwise reader was a kernel of its own).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import gemm_bf16

from .util import compile_cpu, gen, kernels, rand, report, steps, torch_threads

BF16_TOL = dict(rtol=1.6e-2, atol=1e-1)
BF = torch.bfloat16
pytestmark = pytest.mark.skipif(bool(gemm_bf16.support()), reason=f"no bf16 GEMM here: {gemm_bf16.support()}")


def _one_kernel(fn, inputs, out_dtype=BF, threads: int | None = None):
    """fn compiled (gemm="vtc") is one bf16 GEMM kernel and nothing through torch; matches eager."""
    c = compile_cpu(fn, inputs, gemm="vtc")
    with torch_threads(threads):
        got, want = c(*inputs), fn(*inputs)
    assert got.dtype == out_dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **BF16_TOL)
    ks = kernels(c)
    assert [k.kind for k in ks] == ["gemm"] and ks[0].gemm.dtype == BF, [k.kind for k in ks]
    assert [s.node.op for s in steps(c, "run")] == []
    assert [g["choice"] for g in report(c)["gemm"]] == ["vtc"]
    return got, want


def _no_farther_from_float64(got, want, exact):
    """vtc's result is on average no farther from the float64 value than eager's."""
    ours = (got.double() - exact).abs().mean().item()
    theirs = (want.double() - exact).abs().mean().item()
    assert ours <= 1.05 * theirs + 1e-12, (ours, theirs)


@pytest.mark.parametrize("m", [1, 3, 17, 127])
def test_bf16_linear_with_bias_is_one_kernel(m):
    """F.linear with bias (addmm, B = W^T): the dot path (m <= 16) and the panels; K odd and past one KC slice,
    N not a multiple of 32; rounded once after the bias, as eager does."""
    g = gen(40 + m)
    x, w, b = rand((m, 301), g, BF), rand((45, 301), g, BF), rand((45,), g, BF)
    got, want = _one_kernel(lambda x, w, b: F.linear(x, w, b), (x, w, b))
    _no_farther_from_float64(got, want, x.double() @ w.double().t() + b.double())


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "relu"])
def test_bf16_linear_activation_is_one_kernel(act):
    """Linear + activation (an MLP's first half): bias and activation in the GEMM's store."""
    fn = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
          "relu": torch.relu}[act]
    g = gen(50)
    for m, k, n in [(3, 17, 127), (37, 129, 33)]:
        x, w, b = rand((m, k), g, BF), rand((n, k), g, BF), rand((n,), g, BF)
        _one_kernel(lambda x, w, b: fn(F.linear(x, w, b)), (x, w, b))


def test_bf16_mm_residual_scale_and_cast():
    """mm, then a residual add and a scale (eager rounds the product, then each op); the same into float32;
    a bias read across its rows (a column vector) and A transposed."""
    g = gen(51)
    a, b, r = rand((13, 129), g, BF), rand((129, 7), g, BF), rand((13, 7), g, BF)
    _one_kernel(lambda a, b, r: (a @ b + r) * 0.5, (a, b, r))
    _one_kernel(lambda a, b, r: (a @ b + r).float(), (a, b, r), out_dtype=torch.float32)
    at, col = rand((129, 40), g, BF), rand((40, 1), g, BF)
    _one_kernel(lambda at, b, col: torch.tanh(at.t() @ b - col), (at, b, col))


def test_bf16_bmm_bias_broadcast():
    """bmm then a bias broadcast over the batch and rows, and a per-batch scale: the epilogue's index has the
    batch.  (torch.baddbmm in bf16 is decomposed through float32 by the frontend: not this kernel.)"""
    g = gen(52)
    a, b, bias, s = rand((3, 17, 65), g, BF), rand((3, 65, 31), g, BF), rand((31,), g, BF), rand((3, 1, 1), g, BF)
    _one_kernel(lambda a, b, bias, s: F.silu(a @ b + bias) * s, (a, b, bias, s))


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_bf16_fused_linear_on_threads(threads):
    """Products large enough to fork (dot path: 16 rows; panels: 127 rows, N past a chunk) on 1-4 threads."""
    g = gen(60 + threads)
    for m, k, n in [(16, 1023, 300), (127, 257, 129)]:
        x, w, b = rand((m, k), g, BF), rand((n, k), g, BF), rand((n,), g, BF)
        _one_kernel(lambda x, w, b: F.gelu(F.linear(x, w, b)), (x, w, b), threads=threads)
