"""gemm="auto" prices torch's side of a Linear that the call plan would run on MKL's packed weight (vtc.runtime.packed)
with the ratio measured on that path (``library_few_rows_ratio``) at any number of rows, not only up to FEW_ROWS_MAX:
the square ratio (torch.mm on runtime operands, 384^3) is the one for runtime operands.  On the Zen 4 of the
benchmark (its 2-thread figures: square 0.919, packed 0.487) Swin-T's 196-row Linears went to MKL's packed GEMM
(estimated 4% apart, inside MIN_SAVING) where it ran 1.16-1.26x slower than the generated panels (1 thread, CPU
time; docs/prefill.md, session 26)."""
from __future__ import annotations

import pytest
import torch

from .util import assert_matches_eager, compile_cpu, gen, rand, report

TOL = dict(rtol=1e-4, atol=5e-4)  # float32 sums over K = 384, in another order than torch's

# (square ratio, packed ratio): the benchmark machine's (Zen 4 EPYC, MKL slow on its packed weight), an Intel Xeon's
ZEN4_BENCH, INTEL = (0.919, 0.487), (1.0, 1.0)


def _figures(monkeypatch, ratios):
    from vtc.plan import cost

    square, packed = ratios
    figures = cost.Machine(bandwidth_gbs=36.6, measured=True, gemm_gflops=196.0, library_gemm_ratio=square,
                           library_few_rows_ratio=packed)
    monkeypatch.setattr(cost, "_machine", lambda: figures)


@pytest.mark.parametrize("ratios, choice, library", [(ZEN4_BENCH, "vtc", ""), (INTEL, "torch", "mkl_packed")])
def test_a_linear_of_many_rows_on_a_packed_weight_takes_the_packed_ratio(monkeypatch, ratios, choice, library):
    """Swin-T's stage-3 fc1 (196 x 384 -> 1536 on a constant weight): generated under the benchmark's figures, on
    MKL's packed weight where MKL is as fast as the generated kernel.  Fails before (Zen 4: torch, mkl_packed: the
    square ratio for 128 rows and more)."""
    _figures(monkeypatch, ratios)
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 1536).eval()
    x = (rand((196, 384), gen(61)),)
    with torch.no_grad():
        c = compile_cpu(linear, x)
        assert_matches_eager(c, linear, x, **TOL)
    [g] = report(c)["gemm"]
    assert (g["choice"], g["library"]) == (choice, library), g
    if choice == "vtc":
        assert "torch's GEMM measured at 0.47x" in g["why"], g["why"]


def test_runtime_operands_of_many_rows_keep_the_square_ratio(monkeypatch):
    """a @ b with both operands runtime inputs (torch.mm, nothing packed) at 196 rows is priced by the square ratio
    as before: under the benchmark's figures it stays on torch (estimated within MIN_SAVING)."""
    _figures(monkeypatch, ZEN4_BENCH)
    g = gen(62)
    inputs = (rand((196, 384), g), rand((384, 1536), g))
    c = compile_cpu(lambda a, b: a @ b, inputs)
    assert_matches_eager(c, lambda a, b: a @ b, inputs, **TOL)
    [r] = report(c)["gemm"]
    assert (r["choice"], r["library"]) == ("torch", ""), r
