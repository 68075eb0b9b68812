"""The budget on packed weight copies (vtc.runtime.packed.BUDGET_BYTES), against torch eager.

Every packed copy alive in the process (MKL's panels of a library Linear, a generated GEMM's B panels, a
conv_bcast kernel's W^T, a skinny decode GEMM's W) is counted; one that would pass the budget is not made and its
GEMM runs as it does without one (torch's mm; the kernel packing or reading W per call), the reason in the call
plan's ``why_not_packed``, the count in ``report.packing`` and a PackedBudgetWarning.  A copy's bytes come back
when no call plan holds it any more; a re-pack after an in-place change of the weight counts nothing more.
Every test here fails before the budget (``packed.BUDGET_BYTES``, ``packed.HELD`` did not exist).  A call plan
makes its copies best-first by the time each saves per byte (``packed.admit_best_first``; the last two tests' plan
order cases fail with session 20's first come, first served).
"""
from __future__ import annotations

import gc

import pytest
import torch

import vtc
from vtc.codegen import conv_bcast, conv_t, gemm
from vtc import PackedBudgetWarning
from vtc.runtime import packed

from tests.codegen.util import ROW_TOL, compile_cpu, errors_in_threads, gen, rand

needs_mkl = pytest.mark.skipif(not packed.ENABLED, reason="MKL's packed GEMM is not available in this torch")
needs_avx512 = pytest.mark.skipif(not conv_t.has_avx512() or not packed.CONV_ENABLED,
                                  reason="the generated kernels' packed weights are AVX-512 only")
GEMM_TOL = dict(rtol=1e-4, atol=1e-4)


def _plan(compiled):
    return compiled._first.executor.call_plan()


def _linear(k: int, n: int, seed: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias)


def _mlp(seed: int) -> torch.nn.Module:
    """Two Linears (an addmm and an mm on weight transposes) around a GELU."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 64, bias=False))


def _over_budget(plan) -> list[str]:
    return sorted(n for n, why in plan.why_not_packed.items() if "packed-weight budget" in why)


def test_the_budget_from_the_environment():
    assert packed.budget_bytes({"VTC_PACKED_WEIGHTS_MB": "0"}) == 0
    assert packed.budget_bytes({"VTC_PACKED_WEIGHTS_MB": "1.5"}) == 3 << 19
    assert 0 < packed.budget_bytes({}) == packed._memory_bytes() // 4
    for bad in ("-1", "lots", "nan", ""):
        with pytest.raises(ValueError, match="VTC_PACKED_WEIGHTS_MB"):
            packed.budget_bytes({"VTC_PACKED_WEIGHTS_MB": bad})


@needs_mkl
def test_linears_over_the_budget_run_torch_mm(budget):
    model = _mlp(1)
    x = rand((1, 64, 128), gen(1))
    compiled = compile_cpu(model, (x,), gemm="torch")
    nodes = sorted(g["node"] for g in compiled.report.to_dict()["gemm"] if g["library"] == "mkl_packed")
    assert len(nodes) == 2
    budget(0)
    with torch.no_grad():
        with pytest.warns(PackedBudgetWarning, match="2 weight"):
            torch.testing.assert_close(compiled(x), model(x), **GEMM_TOL)
        x = rand((1, 64, 128), gen(2))
        torch.testing.assert_close(compiled(x), model(x), **GEMM_TOL)
    plan = _plan(compiled)
    assert plan.counts["packed_weights"] == 0 and _over_budget(plan) == nodes
    packing = compiled.report.to_dict()["packing"]
    assert packing["unpacked_for_budget"] == 2 and packing["packed_bytes"] == 0
    assert "2 left unpacked for the packed-weight budget" in compiled.report.summary()


@needs_mkl
def test_packed_bytes_come_back_when_the_model_is_freed(budget):
    """One copy counted once (a re-pack after an in-place change adds nothing); freed with the model, so that a
    budget for one copy lets a new compile pack one again (without the give-back it packed none)."""
    model = _mlp(3)
    x = rand((1, 64, 128), gen(3))
    budget(1 << 40)
    held = packed.HELD.bytes
    first = compile_cpu(model, (x,), gemm="torch")
    with torch.no_grad():
        first(x)
        sizes = sorted(_plan(first).packed_copies.values())
        assert len(sizes) == 2 and packed.HELD.bytes == held + sum(sizes)
        assert first.report.to_dict()["packing"]["packed_bytes"] == sum(sizes)
        model[0].weight.mul_(-2.0)  # packed again at the next call, in place of the old copy
        torch.testing.assert_close(first(x), model(x), **GEMM_TOL)
        assert packed.HELD.bytes == held + sum(sizes)
    del first
    gc.collect()
    assert packed.HELD.bytes == held
    budget(sizes[1] + sizes[0] // 2)  # room for one copy, either
    for _ in range(2):
        compiled = compile_cpu(model, (x,), gemm="torch")
        with torch.no_grad():
            with pytest.warns(PackedBudgetWarning, match="1 weight"):
                torch.testing.assert_close(compiled(x), model(x), **GEMM_TOL)
        plan = _plan(compiled)
        assert plan.counts["packed_weights"] == 1 and len(_over_budget(plan)) == 1
        assert packed.HELD.bytes <= packed.BUDGET_BYTES
        del compiled, plan
        gc.collect()
        assert packed.HELD.bytes == held


def _conv1x1(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(64, 96, 1), torch.nn.ReLU()).eval()


# a generated kernel whose weight would be packed once: (model, input shape, its GEMM path, tolerance); over the
# budget the panels GEMM and the convolution pack W per call, the skinny decode GEMM reads W in place
GENERATED = {
    "panels": (lambda: _linear(300, 100, 5), (200, 300), "panels", ROW_TOL),
    "conv_bcast": (lambda: _conv1x1(6), (1, 64, 7, 7), conv_bcast.FORM, ROW_TOL),
    "skinny_1x600x300": (lambda: _linear(600, 300, 1), (1, 600), gemm.SKINNY_PACKED_PATH,
                         dict(rtol=1e-4, atol=2e-6 * 600 ** 0.5 + 1e-5)),
    "skinny_4x300x70": (lambda: _linear(300, 70, 4), (4, 300), gemm.SKINNY_PACKED_PATH,
                        dict(rtol=1e-4, atol=2e-6 * 300 ** 0.5 + 1e-5)),
}


@needs_avx512
@pytest.mark.parametrize("case", list(GENERATED))
def test_a_generated_kernel_over_the_budget_runs_without_a_packed_copy(budget, case):
    make, shape, path, tol = GENERATED[case]
    model = make()
    x = rand(shape, gen(len(case)))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,), gemm="vtc")
        assert [q["path"] for q in compiled.report.to_dict()["gemm"]] == [path]
        budget(0)
        with pytest.warns(PackedBudgetWarning):
            torch.testing.assert_close(compiled(x), model(x), **tol)
        next(model.parameters()).mul_(-1.5)  # the weight changed in place: the result follows it
        torch.testing.assert_close(compiled(x), model(x), **tol)
    plan = _plan(compiled)
    assert plan.counts["packed_conv_weights"] == 0 and len(_over_budget(plan)) == 1


@needs_avx512
def test_threads_building_plans_at_once_stay_within_the_budget(budget):
    """Four models' call plans built at once by four threads, room for two copies: two are packed, two not,
    every result that of eager."""
    lins = [_linear(256, 64, 10 + j) for j in range(4)]
    x = rand((150, 256), gen(10))
    with torch.no_grad():
        compiled = [vtc.compile(lin, (x,), gemm="vtc") for lin in lins]
        copy = 256 * 64 * 4  # B [256, 64] in 32-column panels: no padding
        budget(2 * copy + copy // 2)
        outs: list = [None] * 4

        def work(j: int) -> None:
            outs[j] = compiled[j](x)
        with pytest.warns(PackedBudgetWarning):
            assert errors_in_threads(work, 4) == []
        for out, lin in zip(outs, lins):
            torch.testing.assert_close(out, lin(x), **ROW_TOL)
    assert sorted(_plan(c).counts["packed_conv_weights"] for c in compiled) == [0, 0, 1, 1]
    assert packed.HELD.bytes <= packed.BUDGET_BYTES


class _TwoLinears(torch.nn.Module):
    """x @ A^T and y @ B^T, in the call plan in this order or swapped."""

    def __init__(self, a: tuple[int, int], b: tuple[int, int], swap: bool) -> None:
        super().__init__()
        torch.manual_seed(20)
        self.a, self.b, self.swap = torch.nn.Linear(*a, bias=False), torch.nn.Linear(*b, bias=False), swap

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.b(y), self.a(x)) if self.swap else (self.a(x), self.b(y))


def _one_of_two_packed(budget, a, b, x_shape, y_shape, swap: bool, room: int):
    """_TwoLinears on the generated kernels, its plan built under a budget of `room` bytes: (its plan, the
    bytes of its packed copies), the results those of eager."""
    model = _TwoLinears(a, b, swap)
    x, y = rand(x_shape, gen(21)), rand(y_shape, gen(22))
    with torch.no_grad():
        compiled = vtc.compile(model, (x, y), gemm="vtc")
        budget(room)
        with pytest.warns(PackedBudgetWarning, match="1 weight"):
            out = compiled(x, y)
        reductions = (b[0], a[0]) if swap else (a[0], b[0])  # K of each output, in the model's order
        for got, want, k in zip(out, model(x, y), reductions):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-6 * k ** 0.5 + 1e-5)
    plan = _plan(compiled)
    assert len(_over_budget(plan)) == 1 and packed.HELD.bytes <= packed.BUDGET_BYTES
    return plan, sorted(plan.packed_copies.values())


@needs_avx512
@pytest.mark.parametrize("swap", [False, True])
def test_the_copy_worth_most_per_byte_is_packed_whatever_the_order(budget, swap):
    """A one-row GEMM's 720 KB W (the copy saves the dot path's slower reads: ~5 us per MB by the cost model)
    and a 200-row GEMM's 120 KB W (the copy saves packing B per call: ~59 us per MB), room for either but not
    both: the 200-row GEMM's is packed, first or second in the plan (before: the first one)."""
    plan, copies = _one_of_two_packed(budget, (600, 300), (300, 100), (1, 600), (200, 300), swap, 900_000)
    assert copies == [300 * 128 * 4]  # B [300, 100] in 32-column panels: 128 columns


@needs_avx512
@pytest.mark.parametrize("swap", [False, True])
def test_copies_worth_the_same_per_byte_pack_the_larger_first(budget, swap):
    """Two one-row GEMMs (the cost model rates their copies the same per byte), room for the larger (1 MB) but
    not both: the larger is packed, first or second in the plan; before, a 720 KB one first left the budget's
    1.1 MB unable to take the 1 MB one (a decode loop's LM head, last in its plan, was refused so)."""
    plan, copies = _one_of_two_packed(budget, (600, 300), (256, 1024), (1, 600), (1, 256), swap, 1_100_000)
    assert copies == [256 * 1024 * 4]
