"""The GEMM sweep's small cells (docs/gemm.md, session 16): gemm="auto" on a few rows of a bf16 Linear, and the
report's path of a weight the call plan does not pack once (an inference tensor), against torch eager."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import vtc
from vtc.codegen import gemm, gemm_bf16

from .util import gen, rand, report

F32_TOL = dict(rtol=1e-4, atol=1e-4)
BF16_TOL = dict(rtol=1.6e-2, atol=1e-1)
needs_bf16 = pytest.mark.skipif(bool(gemm_bf16.support()), reason=f"no bf16 GEMM here: {gemm_bf16.support()}")


def _plan(compiled):
    return compiled._first.executor.call_plan()


@needs_bf16
@pytest.mark.parametrize("rows, k, n, act", [(8, 1000, 3001, False), (12, 1031, 2049, True), (3, 4097, 515, False)])
def test_bf16_auto_generates_a_few_rows_of_a_linear(rows, k, n, act):
    """A few rows of a bf16 nn.Linear (and Linear + GELU) under gemm="auto": the generated dot path (Zen 5, 1 thread,
    8 x 1024 -> 4096: 0.17 ms against torch's 0.32-0.38, 16 x 1024 -> 4096 0.31-0.43 against 0.54-0.65) is estimated
    faster and runs.  Fails before the Zen 5 rates at 8 and 12 rows: the dot path was charged 160 GFLOPS and torch
    kept them."""
    torch.manual_seed(rows)
    lin = nn.Linear(k, n).to(torch.bfloat16).eval()
    mod = nn.Sequential(lin, nn.GELU()).eval() if act else lin
    x = rand((rows, k), gen(rows + k), torch.bfloat16)
    with torch.no_grad():
        c = vtc.compile(mod, (x,), backend="cpu")
        r = report(c)["gemm"]
        assert [g["choice"] for g in r] == ["vtc"], r
        assert r[0]["vtc_us"] < r[0]["torch_us"], r
        got, want = c(x), mod(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got, want, **BF16_TOL)


def test_bf16_skinny_estimates_follow_the_rows():
    """The dot path's estimate grows with the rows (flops) once they outweigh reading W, and stays the larger of
    the two terms."""
    est = [gemm_bf16.estimate_us(1, m, 4096, 4096, b_unit_stride="k")[0] for m in (1, 4, 8, 16)]
    assert est[0] == est[1] < est[2] < est[3], est
    w_us = 2.0 * 4096 * 4096 / (gemm_bf16.SKINNY["dot"][0] * 1e3)
    assert est[0] == pytest.approx(w_us + gemm.CALL_US)


@pytest.mark.skipif(not gemm._skinny_packed_rows(4, 1 << 20), reason="no skinny packed path")
@pytest.mark.parametrize("rows, inference, path", [(4, False, gemm.SKINNY_PACKED_PATH), (4, True, "dot"),
                                                   (40, False, "panels"), (40, True, "weight_rows")])
def test_an_inference_weight_is_reported_on_the_path_it_runs(rows, inference, path):
    """A float32 nn.Linear made in inference mode: the call plan does not pack its weight once (no version counter,
    vtc.runtime.packed), so the kernel reads W in place: the report says "dot" (4 rows) / "weight_rows" (40), not
    "skinny_packed" / "panels" as before (fails before on the path), and the values match eager.  A weight made
    outside inference mode is packed once and reported so."""
    from vtc.codegen.conv_t import has_avx512

    if not has_avx512():
        pytest.skip("W is packed once on AVX-512 targets only")
    torch.manual_seed(rows)
    ctx = torch.inference_mode() if inference else torch.no_grad()
    with ctx:
        lin = nn.Linear(301, 203)
        x = rand((rows, 301), gen(rows))
        c = vtc.compile(lin, (x,), backend="cpu", gemm="vtc")
        got, want = c(x), lin(x)
    torch.testing.assert_close(got, want, **F32_TOL)
    assert [g["path"] for g in report(c)["gemm"]] == [path], report(c)["gemm"]
    plan = _plan(c)
    assert plan.counts["packed_conv_weights"] == (0 if inference else 1), plan.why_not_packed
    assert any("inference tensor" in why for why in plan.why_not_packed.values()) == inference


def test_an_inference_weight_is_estimated_unpacked():
    """gemm="auto"'s estimate of an inference weight is the unpacked path's (the call plan would not pack it):
    equal to a runtime W's, not the packed skinny rates'."""
    torch.manual_seed(3)
    x = rand((4, 1024), gen(3))
    with torch.inference_mode():
        lin = nn.Linear(1024, 1024, bias=False)
        c_inf = vtc.compile(lin, (x,), backend="cpu")
    with torch.no_grad():
        lin2 = nn.Linear(1024, 1024, bias=False)
        c_const = vtc.compile(lin2, (x,), backend="cpu")
        c_rt = vtc.compile(lambda x, w: x @ w.t(), (x, lin2.weight.detach()), backend="cpu")
    inf, const, rt = (report(c)["gemm"][0]["vtc_us"] for c in (c_inf, c_const, c_rt))
    assert inf == rt, (inf, rt)
    if gemm._skinny_packed_rows(4, 4 << 20) and const != rt:
        assert const < rt
