"""Adversarial tests (session 20) of the fast paths of sessions 18-19: the GEMMs' weights packed once (the panels'
B above 16 rows, vtc_skinny_packed at 1..16 rows), A read in place, register transposes whose rows meet the
output modulo 4 KB, packed copies shared by a model's executors.  Found by tests/fuzz_campaign.py and its probes
(docs/robustness.md, session 20); each explicit test failed before its fix.  Compared with torch eager on random
inputs with explicit tolerances."""
from __future__ import annotations

import pytest
import torch

import vtc
from vtc.codegen import conv_t
from vtc.runtime import packed


def _tol(k: int) -> dict:
    """float32 sums of k products of magnitude <= ~1 (weights of magnitude ~1 / sqrt(k))."""
    return dict(rtol=1e-4, atol=2e-6 * k ** 0.5 + 1e-5)


class _FlippedWeight(torch.nn.Module):
    """x @ W.flip(0)^T (B's columns a negative stride apart) or x @ W.flip(0) (B's rows a negative stride apart)."""

    def __init__(self, rows: int, cols: int, transposed: bool) -> None:
        super().__init__()
        torch.manual_seed(rows + cols)
        self.w = torch.nn.Parameter(torch.randn(rows, cols) / (cols if transposed else rows) ** 0.5)
        self.transposed = transposed

    def forward(self, x):
        w = self.w.flip(0)
        return x @ (w.t() if self.transposed else w)


@pytest.mark.skipif(not conv_t.has_avx512() or not packed.CONV_ENABLED, reason="B packed once: AVX-512 only")
@pytest.mark.parametrize("transposed", [True, False], ids=["x@W.flip(0)^T", "x@W.flip(0)"])
@pytest.mark.parametrize("m", [24, 130])
def test_a_weight_read_backwards_is_packed_by_the_kernel(transposed, m):
    """A constant B whose rows (W = B^T's, or B's own) are a negative stride apart: the call plan packed it once
    through ``as_strided`` with that stride and the first call raised torch's "as_strided: Negative strides are not
    supported" (gemm auto and vtc alike).  Now the kernel packs it per call as it packs a runtime B, the reason in
    ``why_not_packed`` (vtc/runtime/packed.py, conv_weight_why_not)."""
    k, n = (1024, 300) if transposed else (300, 1024)
    model = _FlippedWeight(n if transposed else k, k if transposed else n, transposed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    with torch.no_grad():
        for gemm in ("auto", "vtc"):
            compiled = vtc.compile(model, (x,), gemm=gemm)
            torch.testing.assert_close(compiled(x), model(x), **_tol(k))
            model.w.mul_(-2.0)
            torch.testing.assert_close(compiled(x), model(x), **_tol(k), msg="after an in-place change of W")
            plan = compiled._first.executor.call_plan()
            assert plan.counts["packed_conv_weights"] == 0
            assert any("negative" in why for why in plan.why_not_packed.values()), plan.why_not_packed
