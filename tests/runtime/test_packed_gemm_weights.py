"""A generated GEMM's constant B packed once into the micro-kernel's panels (vtc.codegen.gemm.packed_panels), against torch.

Where the "panels" kernel would pack B panel by panel on every call (``gemm._lazy_b``: B = W^T of a Linear
weight, or a row-major weight used as it is) and B is a constant of the graph, the call plan packs it once
(``vtc.runtime.packed.PackedConvWeight`` with the GEMM's layout) and passes it with ``gemm.PACKED_FLAG``; a
weight changed in place after compiling (its version counter moves) is packed again before the next call.  The
executor's reference path (``run_steps``) still packs per call inside the kernel, so both are checked.
"""
from __future__ import annotations

import pytest
import torch

import vtc
from vtc.codegen import conv_t, gemm
from vtc.runtime import packed

from tests.codegen.util import ROW_TOL, errors_in_threads, gen, kernels, rand, torch_threads

pytestmark = pytest.mark.skipif(not conv_t.has_avx512() or not packed.CONV_ENABLED,
                                reason="B packed once is the AVX-512 kernel's layout")


def _plan(compiled):
    return compiled._first.executor.call_plan()


def _linear(k: int, n: int, seed: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias)


@pytest.mark.parametrize("wt", [True, False], ids=["w_transposed", "row_major"])
@pytest.mark.parametrize("kn", [(300, 33), (257, 100), (600, 64), (16, 7)], ids=["300x33", "257x100", "600x64", "16x7"])
def test_packed_panels_are_b_in_kc_slices_of_32_column_panels(kn, wt):
    k, n = kn
    rows, cols = (n, k) if wt else (k, n)
    w = rand((5 + rows * (cols + 3),), gen(k + n))  # rows of `cols` floats at offset 5, cols + 3 apart
    kc = gemm.packed_kc(k)
    got = gemm.packed_panels(w, 5, cols + 3, rows, cols, kc=kc, wt=wt)
    wm = w[5:].view(rows, cols + 3)[:, :cols]
    b = wm.t() if wt else wm  # [K, N]
    npad = -(-n // 32) * 32
    assert got.shape == (k * npad,)
    for k0 in range(0, k, kc):
        kb = min(kc, k - k0)
        for j in range(npad // 32):
            panel = got[k0 * npad + j * 32 * kb: k0 * npad + (j + 1) * 32 * kb].view(kb, 32)
            want = torch.zeros(kb, 32)
            cols_j = min(32, n - 32 * j)
            want[:, :cols_j] = b[k0:k0 + kb, 32 * j: 32 * j + cols_j]
            torch.testing.assert_close(panel, want, rtol=0, atol=0)


def test_kc_is_the_kernels_equal_slices():
    assert [gemm.packed_kc(k) for k in (16, 256, 257, 1024, 1100, 3584)] == [16, 256, 129, 256, 220, 256]


# rows above gemm.WT_MAX_M (the weight_rows path reads W in place), N and K not multiples of 32 / of KC
SHAPES = [(200, 300, 100), (150, 257, 33), (136, 1024, 3584), (133, 600, 64)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
def test_linear_weight_packed_once_and_again_after_each_in_place_change(shape, threads):
    m, k, n = shape
    lin = _linear(k, n, m + k + n)
    x = rand((m, k), gen(n))
    with torch_threads(threads):
        with torch.no_grad():
            compiled = vtc.compile(lin, (x,), gemm="vtc")
            assert [q["path"] for q in compiled.report.to_dict()["gemm"]] == ["panels"]
            torch.testing.assert_close(compiled(x), lin(x), **ROW_TOL)
            assert _plan(compiled).counts["packed_conv_weights"] == 1, _plan(compiled).why_not_packed
            for change in (lambda w: w.mul_(2.0), lambda w: w.copy_(rand(tuple(w.shape), gen(9))),
                           lambda w: lin.load_state_dict({**lin.state_dict(), "weight": rand(tuple(w.shape), gen(10))})):
                change(lin.weight)
                torch.testing.assert_close(compiled(x), lin(x), **ROW_TOL)  # stale panels: off by the whole change
                torch.testing.assert_close(compiled(x), lin(x), **ROW_TOL)
                # the reference path (each step through run_step) packs per call inside the kernel: the same values
                torch.testing.assert_close(compiled._first.executor.run_steps([x])[0], lin(x), **ROW_TOL)


def test_a_row_major_weight_is_packed_once():
    """x @ W with W [K, N] used as it is (B with unit stride along n: the row-major panels)."""
    g = gen(11)
    w = torch.nn.Parameter(rand((300, 70), g))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, x):
            return torch.relu(x @ self.w)

    mod, x = M(), rand((180, 300), g)
    with torch.no_grad():
        compiled = vtc.compile(mod, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), mod(x), **ROW_TOL)
        assert _plan(compiled).counts["packed_conv_weights"] == 1, _plan(compiled).why_not_packed
        w.mul_(-0.5)
        torch.testing.assert_close(compiled(x), mod(x), **ROW_TOL)


def test_a_slice_of_a_constant_is_packed_from_its_offset():
    """B = W[50:150, 10:310]^T of a [200, 400] parameter: rows of 300 floats at offset 50 * 400 + 10, 400 apart."""
    g = gen(16)
    w = torch.nn.Parameter(rand((200, 400), g))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, x):
            return x @ self.w[50:150, 10:310].t() + 1.0

    mod, x = M(), rand((160, 300), g)
    with torch.no_grad():
        compiled = vtc.compile(mod, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), mod(x), **ROW_TOL)
        assert _plan(compiled).counts["packed_conv_weights"] == 1, _plan(compiled).why_not_packed
        w[60:70].mul_(3.0)  # rows inside the slice change
        torch.testing.assert_close(compiled(x), mod(x), **ROW_TOL)


def test_weight_rows_and_skinny_gemms_read_w_in_place(monkeypatch):
    """A W above WT_PACKED_MAX_BYTES at WT_MIN_M..WT_MAX_M rows (weight_rows) or one row (dot products): the kernel
    packs no B, nothing to pack once (2..WT_MIN_M - 1 rows: W packed once for vtc_skinny_packed,
    tests/codegen/test_gemm_skinny_packed.py)."""
    monkeypatch.setattr(gemm, "WT_PACKED_MAX_BYTES", 256 * 96 * 4 - 1)
    for m in (100, 1):
        lin = _linear(256, 96, m)
        x = rand((m, 256), gen(m))
        with torch.no_grad():
            compiled = vtc.compile(lin, (x,), gemm="vtc")
            torch.testing.assert_close(compiled(x), lin(x), **ROW_TOL)
        assert _plan(compiled).counts["packed_conv_weights"] == 0


WT_SHAPES = [(17, 257, 127), (49, 768, 65), (33, 1025, 97), (100, 300, 33), (80, 64, 200)]
WT_CASES = [(s, 1) for s in WT_SHAPES] + [((49, 768, 65), 2), ((100, 300, 33), 2)]


@pytest.mark.parametrize("shape,threads", WT_CASES, ids=[f"{m}x{k}x{n}-t{t}" for (m, k, n), t in WT_CASES])
def test_weight_rows_rows_run_the_panels_on_a_small_weight_packed_once(shape, threads):
    """17..WT_MAX_M rows that 12-row tiles pad less than 32-row panels, on a constant W of at most
    WT_PACKED_MAX_BYTES: W packed once, the kernel's wt_rows off where it gets the pointer (the report says "panels",
    the path that ran; session 14 named the one without the pointer); again after each in-place change
    and through the reference path (no pointer: weight_rows).  Fails before: nothing packed (count 0)."""
    m, k, n = shape
    lin = _linear(k, n, m + k + n)
    x = rand((m, k), gen(n))
    with torch_threads(threads):
        with torch.no_grad():
            compiled = vtc.compile(lin, (x,), gemm="vtc")
            assert [q["path"] for q in compiled.report.to_dict()["gemm"]] == ["panels"]  # what ran (weight_rows before)
            (kern,) = [kk for kk in kernels(compiled) if kk.kind == "gemm"]
            assert f"M <= {gemm.WT_MAX_M} && !wpk;" in gemm.generate(kern)
            torch.testing.assert_close(compiled(x), lin(x), **ROW_TOL)
            assert _plan(compiled).counts["packed_conv_weights"] == 1, _plan(compiled).why_not_packed
            for change in (lambda w: w.mul_(-2.0), lambda w: w.copy_(rand(tuple(w.shape), gen(9)) / k ** 0.5)):
                change(lin.weight)
                torch.testing.assert_close(compiled(x), lin(x), **ROW_TOL)
            torch.testing.assert_close(compiled._first.executor.run_steps([x])[0], lin(x), **ROW_TOL)


@pytest.mark.parametrize("m", [32, 64, 96, 128])
def test_rows_that_fill_the_weight_rows_panels_read_w_in_place(m):
    """32 / 64 / 96 / 128 rows fill weight_rows' 32-column A^T panels (the 12-row tiles would pad them): no pack."""
    lin = _linear(200, 70, m)
    x = rand((m, 200), gen(m))
    with torch.no_grad():
        compiled = vtc.compile(lin, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), lin(x), **ROW_TOL)
    assert _plan(compiled).counts["packed_conv_weights"] == 0
    assert [gemm._panels_pad_less(r) for r in (17, 24, 33, 49, 100)] == [True] * 5


def test_switched_off_packs_per_call(monkeypatch):
    monkeypatch.setattr(gemm, "PACKED_B", False)
    lin = _linear(300, 100, 12)
    x = rand((200, 300), gen(12))
    with torch.no_grad():
        compiled = vtc.compile(lin, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), lin(x), **ROW_TOL)
        assert _plan(compiled).counts["packed_conv_weights"] == 0
        lin.weight.mul_(2.0)
        torch.testing.assert_close(compiled(x), lin(x), **ROW_TOL)


def test_an_input_weight_is_packed_per_call():
    """B computed from a graph input (not a constant) changes per call: the kernel packs it."""
    def fn(x, w):
        return x @ w.t()

    g = gen(13)
    x, w = rand((200, 300), g), rand((100, 300), g)
    compiled = vtc.compile(fn, (x, w), gemm="vtc")
    torch.testing.assert_close(compiled(x, w), fn(x, w), **ROW_TOL)
    w2 = rand((100, 300), gen(14))
    torch.testing.assert_close(compiled(x, w2), fn(x, w2), **ROW_TOL)
    assert _plan(compiled).counts["packed_conv_weights"] == 0


def test_threads_share_the_packed_weight_while_it_changes():
    """Four threads call one compiled Linear on 2 OpenMP threads; between rounds the weight changes in place:
    every result is the weight of its round."""
    lin = _linear(512, 160, 15)
    xs = [rand((144, 512), gen(30 + k)) for k in range(4)]
    with torch_threads(2):
        with torch.no_grad():
            compiled = vtc.compile(lin, (xs[0],), gemm="vtc")
            compiled(xs[0])
            assert _plan(compiled).counts["packed_conv_weights"] == 1
            for _ in range(3):
                want = [lin(x) for x in xs]

                def work(k: int) -> None:
                    with torch.no_grad():
                        for _ in range(20):
                            torch.testing.assert_close(compiled(xs[k]), want[k], **ROW_TOL)

                assert errors_in_threads(work, 4) == []
                lin.weight.mul_(-1.5)


def _packed_copies_of(weight: torch.Tensor) -> list:
    import gc
    ptr = weight.untyped_storage().data_ptr()
    # type(o), not isinstance: isinstance of a weakref.proxy whose object is gone (another test's) raises ReferenceError
    return [o for o in gc.get_objects()
            if type(o) is packed.PackedConvWeight and o.w.untyped_storage().data_ptr() == ptr]


@pytest.mark.parametrize("rows", [1, 200], ids=["one_row_skinny_packed", "panels"])
def test_executors_of_one_model_share_one_packed_copy_per_weight(rows):
    """A replan (as a dynamic model's specializations) reuses the weight packed by the first executor: one copy
    while either holds it, both follow an in-place change, none once both are gone (two copies before)."""
    import gc
    lin = _linear(300, 1024, rows)  # 1.2 MB: packed once at one row too (gemm.SKINNY_PACKED_WT_MIN_BYTES)
    x = rand((rows, 300), gen(rows))
    with torch.no_grad():
        first = vtc.compile(lin, (x,), gemm="vtc")
        second = first.replan(plan="all")
        for c in (first, second):
            torch.testing.assert_close(c(x), lin(x), **ROW_TOL)
            assert _plan(c).counts["packed_conv_weights"] == 1, _plan(c).why_not_packed
        assert len(_packed_copies_of(lin.weight)) == 1
        lin.weight.mul_(-0.5)
        for c in (first, second):
            torch.testing.assert_close(c(x), lin(x), **ROW_TOL)
    del first, second, c
    gc.collect()
    assert _packed_copies_of(lin.weight) == []
