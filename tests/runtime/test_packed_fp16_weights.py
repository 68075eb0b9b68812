"""A float16 Linear weight packed once, widened, into the float32 GEMM's panels (vtc.codegen.gemm ``F16_PACKED_B``),
against torch eager at float16's tolerance (tests/codegen/test_gemm_fp16.py's ``_assert_fp16_close``).

A float16 GEMM runs the float32 kernel on operands widened as the packs read them (``narrowed``); above
``gemm.SKINNY_M`` rows its constant float16 B is packed once by the call plan into the float32 panels a float32
B would take (``packed_panels``, ``vtc.runtime.packed.PackedConvWeight``), packed again when the weight changes
in place, counted against ``packed.BUDGET_BYTES`` at its float32 size (twice the weight's), and refused where over
it (the kernel then widens B per block, as before).  Every test here fails before F16_PACKED_B (no float16
weight was packed once: ``packed_conv_weights`` 0).
"""
from __future__ import annotations

import pytest
import torch

import vtc
from vtc.codegen import conv_t
from vtc.runtime import packed

from tests.codegen.test_gemm_fp16 import _assert_fp16_close, _magnitude
from tests.codegen.util import gen, rand, torch_threads

pytestmark = pytest.mark.skipif(not conv_t.has_avx512() or not packed.CONV_ENABLED,
                                reason="B packed once is the AVX-512 kernel's layout")

H = torch.float16


def _linear(k: int, n: int, seed: int) -> torch.nn.Linear:
    lin = torch.nn.Linear(k, n).to(H)
    with torch.no_grad():
        lin.weight.copy_(rand((n, k), gen(seed), H, low=0.05, high=0.5))
        lin.bias.copy_(rand((n,), gen(seed + 1), H))
    return lin


def _check(compiled, lin, x) -> None:
    with torch.no_grad():
        mag = _magnitude(x, lin.weight.t()) + lin.bias.double().abs()
        _assert_fp16_close(compiled(x), lin(x), mag)


def _plan(compiled):
    return compiled._first.executor.call_plan()


def _compiled_and_checked(lin, x, path: str, packed_copies: int):
    """lin compiled for x (gemm="vtc"), asserted to run kernel path `path`, to agree with eager and to have
    `packed_copies` weights packed once by its call plan.  Returns (compiled, its call plan)."""
    with torch.no_grad():
        compiled = vtc.compile(lin, (x,), gemm="vtc")
    assert [q["path"] for q in compiled.report.to_dict()["gemm"]] == [path]
    _check(compiled, lin, x)
    plan = _plan(compiled)
    assert plan.counts["packed_conv_weights"] == packed_copies, plan.why_not_packed
    return compiled, plan


def _f32_panels_bytes(k: int, n: int) -> int:
    return k * (-(-n // 32) * 32) * 4  # float32 panels, N rounded up to 32


SHAPES = [(40, 300, 100), (133, 257, 33), (200, 96, 70)]  # rows above SKINNY_M; N, K not multiples of 32 / KC


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
def test_float16_weight_packed_once_widened_and_again_after_an_in_place_change(shape, threads):
    m, k, n = shape
    lin = _linear(k, n, m + k + n)
    x = rand((m, k), gen(n), H)
    with torch_threads(threads):
        compiled, plan = _compiled_and_checked(lin, x, "panels", 1)
        assert sum(plan.packed_copies.values()) == _f32_panels_bytes(k, n)  # float32: twice the weight's bytes
        for change in (lambda w: w.mul_(2.0), lambda w: w.copy_(rand(tuple(w.shape), gen(9), H, low=0.05, high=0.5))):
            with torch.no_grad():
                change(lin.weight)
            _check(compiled, lin, x)  # stale panels: off by the whole change


def test_a_budget_for_the_float16_bytes_only_refuses_the_float32_copy(budget):
    m, k, n = 64, 256, 96
    lin = _linear(k, n, 5)
    x = rand((m, k), gen(6), H)
    budget(3 * lin.weight.nbytes // 2)  # room for the weight's own float16 bytes, not for its float32 panels
    with pytest.warns(packed.PackedBudgetWarning):
        with torch.no_grad():
            compiled = vtc.compile(lin, (x,), gemm="vtc")
        _check(compiled, lin, x)  # B widened per block in the kernel
    plan = _plan(compiled)
    assert plan.counts["packed_conv_weights"] == 0 and plan.over_budget == 1
    assert "packed-weight budget" in " ".join(plan.why_not_packed.values())
    with torch.no_grad():
        lin.weight.mul_(2.0)
    _check(compiled, lin, x)


def test_a_budget_for_the_float32_panels_admits_the_copy(budget):
    m, k, n = 64, 256, 96
    lin = _linear(k, n, 7)
    x = rand((m, k), gen(8), H)
    budget(_f32_panels_bytes(k, n))
    with torch.no_grad():
        compiled = vtc.compile(lin, (x,), gemm="vtc")
    _check(compiled, lin, x)
    assert _plan(compiled).counts["packed_conv_weights"] == 1


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [2, 7, 16])
def test_few_rows_on_a_float16_weight_run_vtc_skinny_packed_on_it_packed_once_widened(rows, threads):
    k, n = 512, 300  # W's float32 copy 600 KB: at least gemm.SKINNY_PACKED_WT_MIN_BYTES (16 rows take it from there)
    lin = _linear(k, n, rows)
    x = rand((rows, k), gen(rows + 1), H)
    with torch_threads(threads):
        compiled, _ = _compiled_and_checked(lin, x, "skinny_packed", 1)
        with torch.no_grad():
            lin.weight.mul_(2.0)
        _check(compiled, lin, x)


def test_one_row_on_a_float16_weight_keeps_the_dot_path_reading_it_in_place():
    k, n = 512, 300
    lin = _linear(k, n, 3)
    _compiled_and_checked(lin, rand((1, k), gen(4), H), "dot", 0)
