"""Adversarial tests (session 20) of the fast paths of sessions 18-19: the GEMMs' weights packed once (the panels'
B above 16 rows, vtc_skinny_packed at 1..16 rows), A read in place, register transposes whose rows meet the
output modulo 4 KB, packed copies shared by a model's executors.  Found by tests/fuzz_campaign.py and its probes
(docs/robustness.md, session 20); each explicit test failed before its fix.  Compared with torch eager on random
inputs with explicit tolerances."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

import vtc
from tests.adversarial import SETTINGS, Draw, close, describe, draw_chain_into, rand, run_chain
from tests.codegen.util import torch_threads
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
@pytest.mark.parametrize("folded", [True, False], ids=["folded", "not-folded"])
@pytest.mark.parametrize("transposed", [True, False], ids=["x@W.flip(0)^T", "x@W.flip(0)"])
@pytest.mark.parametrize("m", [24, 130])
def test_a_weight_read_backwards_is_packed_by_the_kernel(transposed, m, folded, monkeypatch):
    """A constant B whose rows (W = B^T's, or B's own) are a negative stride apart: the call plan packed it once
    through ``as_strided`` with that stride and the first call raised torch's "as_strided: Negative strides are not
    supported" (gemm auto and vtc alike).  Since session 22 the flip is folded into a constant copy
    (``vtc.ir.fold.fold_weight_chains``) that is packed once like any weight; where it is not folded (here: the
    fold switched off, as a budget refusal leaves it), the kernel packs it per call as it packs a runtime B, the
    reason in ``why_not_packed`` (vtc/runtime/packed.py, conv_weight_why_not).  Either way an in-place change of W
    reaches the next call."""
    from vtc.ir import fold

    if not folded:
        monkeypatch.setattr(fold, "fold_weight_chains", lambda graph: graph)
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
            packed_copies = plan.counts["packed_conv_weights"] + plan.counts.get("packed_weights", 0)
            if folded:
                assert compiled.report.to_dict()["packing"]["folded_weight_chains"] == 1
                assert packed_copies == 1 and not plan.why_not_packed, plan.why_not_packed
            else:
                assert plan.counts["packed_conv_weights"] == 0
                assert any("negative" in why for why in plan.why_not_packed.values()), plan.why_not_packed


# -- drawn cases: what the campaign draws, a few of them the same every run -------------------------------------
class _DrawnLinear(torch.nn.Module):
    def __init__(self, front, w: torch.Tensor, wchain, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.front, self.wchain = front, wchain
        self.w = torch.nn.Parameter(w)
        self.b = None if bias is None else torch.nn.Parameter(bias)

    def forward(self, x):
        return F.linear(run_chain(self.front, x), run_chain(self.wchain, self.w), self.b)


# (K, N): weights of 2.4 MB, 1 MB, 1.2 MB (above SKINNY_PACKED_WT_MIN_BYTES), 400 KB and 66 KB
_WEIGHTS = [(1024, 600), (2048, 130), (1000, 300), (1024, 100), (257, 64)]


@settings(max_examples=7, **SETTINGS)
@given(st.data())
def test_a_drawn_chain_into_a_linear_on_a_weight_packed_once(data):
    """A drawn chain (drawn backwards from [rows, K] or [B, rows, K]: rows 1024 / 2048 floats apart among them) in
    front of a Linear at 1..17 or 24 rows (vtc_skinny_packed, A in place on the panels), half the time a drawn
    chain on the weight's side; called again (the fast call), after two in-place changes of the weight (packed
    again), and at another row count (a second executor sharing the packed copy) where nothing depends on it."""
    r = Draw(data)
    rows, (k, n) = r.choice([1, 2, 5, 11, 12, 16, 17, 24]), r.choice(_WEIGHTS)
    lead = r.choice([[], [r.choice([1, 2])]])
    dynamic = r.choice([False, True])
    shape, front, row = draw_chain_into(r, lead + [rows, k], r.randrange(0, 4), len(lead), dynamic)
    wshape, wchain, _ = draw_chain_into(r, [n, k], r.choice([0, 1]), max_numel=1 << 22)
    g = torch.Generator().manual_seed(r.randrange(1000))
    model = _DrawnLinear(front, rand(wshape, g) / k ** 0.5, wchain, rand((n,), g) if r.choice([False, True]) else None)
    gemm, threads = r.choice(["auto", "vtc"]), r.choice([1, 2])
    what = (f"x {shape}: {describe(front)} -> Linear({k}, {n}), W = {describe(wchain).replace('x', 'w', 1)} of "
            f"{wshape}; rows {rows}; gemm={gemm} threads={threads}")
    note(what)
    x = rand(shape, g)
    with torch.no_grad(), torch_threads(threads):
        compiled = vtc.compile(model, (x,), gemm=gemm)
        for step, change in enumerate([None, None, lambda w: w.mul_(-2.0), lambda w: w[:3].add_(0.5)]):
            if change is not None:
                change(model.w)
            torch.testing.assert_close(compiled(x), model(x), **_tol(k), msg=lambda m: f"{what}, call {step}\n{m}")
        if dynamic:
            other = list(shape)
            other[row] = 3 if rows != 3 else 7
            y = rand(other, g)
            torch.testing.assert_close(compiled(y), model(y), **_tol(k), msg=lambda m: f"{what}, {other}\n{m}")
            torch.testing.assert_close(compiled(x), model(x), **_tol(k), msg=lambda m: f"{what}, again\n{m}")


@settings(max_examples=4, **SETTINGS)
@given(st.data())
def test_a_drawn_chain_into_a_transposed_pointwise_kernel_on_rows_a_multiple_of_2kb_apart(data):
    """x^T * 1.5 + y (or a where on it) with rows of 512 / 1024 / 2048 floats, each operand behind a drawn chain:
    the register transposes whose rows meet the output modulo 4 KB make their loads first (tiles.LOADS_FIRST)."""
    r = Draw(data)
    a, b = r.choice([(512, 1024), (1024, 512), (1024, 1024), (2048, 256), (33, 2048)])
    use_where = r.choice([False, True])
    sx, fx, _ = draw_chain_into(r, [a, b], r.randrange(0, 3))
    sy, fy, _ = draw_chain_into(r, [b, a], r.randrange(0, 3))
    threads = r.choice([1, 2])
    what = f"x {sx}: {describe(fx)}, y {sy}: {describe(fy)}; where={use_where} threads={threads}"
    note(what)

    def fn(x, y):
        z = run_chain(fx, x).t() * 1.5 + run_chain(fy, y)
        return torch.where(z > 0, z, y.sum() * 0.5) if use_where else z

    g = torch.Generator().manual_seed(r.randrange(1000))
    x, y = rand(sx, g), rand(sy, g)
    with torch_threads(threads):
        compiled = vtc.compile(fn, (x, y))
        for _ in range(2):
            close(compiled(x, y), fn(x, y), torch.float32, what)
