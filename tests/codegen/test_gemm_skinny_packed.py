"""x @ W^T at a few rows on W packed once (vtc.codegen.gemm ``_skinny_spec``, ``vtc_skinny_packed``), against torch.

At 2 <= M < WT_MIN_M rows a constant weight (B = W^T, one weight for the whole kernel) is packed once by the
call plan into ``packed_panels`` at the skinny KC (SKINNY_KC's equal slices) and the kernel reads its 32-column
panels as streams (R rows of A, packed as rows, broadcast against two panels' vectors per k step) instead of the
dot products against W's rows; one row too on a W of at least SKINNY_PACKED_WT_MIN_BYTES.  One row on a smaller W
keeps the dot path (nothing packed), as does a weight with a batch term (12-16 rows:
tests/codegen/test_gemm_2threads.py).  Checked at odd sizes: M 1-11 (the 6-row chunks of an A panel: 7 = 4 + 3,
11 = 6 + 5), N across the 32 / 64-column edges, K across the skinny KC (2049, 4100: two and three slices, the
later ones adding to C), a bias and a ReLU epilogue, a 3-D x (rows of two batches folded), 1 and 2 threads, and again after each in-place
change of the weight (packed again) and through the executor's reference path (no packed weight: the dot path).
"""
from __future__ import annotations

import pytest
import torch

import vtc
from vtc.codegen import conv_t, gemm
from vtc.runtime import packed

from .util import gen, kernels, rand, run_gemm_built_for, torch_threads

pytestmark = pytest.mark.skipif(not conv_t.has_avx512() or not packed.CONV_ENABLED,
                                reason="the packed skinny path is AVX-512 only")


def _tol(k: int) -> dict:
    """float32 sums of k products of magnitude <= ~1 (Linear's weights are uniform in +-1/sqrt(K))."""
    return dict(rtol=1e-4, atol=2e-6 * k ** 0.5 + 1e-5)


def _count(compiled) -> int:
    plan = compiled._first.executor.call_plan()
    return plan.counts["packed_conv_weights"]


def _linear(k: int, n: int, seed: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias)


SHAPES = [(2, 17, 131), (3, 257, 75), (5, 300, 1), (7, 2049, 33), (8, 1025, 97), (11, 4100, 65), (9, 64, 200),
          (4, 1023, 600)]


CASES = [(s, 1) for s in SHAPES] + [((8, 1025, 97), 2), ((4, 1023, 600), 2), ((11, 4100, 65), 2)]
# one row on a W of SKINNY_PACKED_WT_MIN_BYTES or more (N across the 32 / 64-column edges, K over two and three
# KC slices)
ONE_ROW = [((1, 600, 300), 1), ((1, 2049, 70), 1), ((1, 600, 300), 2), ((1, 4100, 45), 2)]
CASES += ONE_ROW


@pytest.mark.parametrize("shape,threads", CASES, ids=[f"{m}x{k}x{n}-t{t}" for (m, k, n), t in CASES])
def test_few_rows_on_a_weight_packed_once(shape, threads):
    """Fails before: nothing was packed at M <= SKINNY_M (count 0); one row kept the dot path until session 19."""
    m, k, n = shape
    assert m > 1 or 4 * k * n >= gemm.SKINNY_PACKED_WT_MIN_BYTES
    lin = _linear(k, n, m + k + n, bias=m % 2 == 1)
    x = rand((m, k), gen(n))
    with torch_threads(threads):
        with torch.no_grad():
            compiled = vtc.compile(lin, (x,), gemm="vtc")
            assert [q["path"] for q in compiled.report.to_dict()["gemm"]] == [gemm.SKINNY_PACKED_PATH]
            torch.testing.assert_close(compiled(x), lin(x), **_tol(k))
            assert _count(compiled) == 1, compiled._first.executor.call_plan().why_not_packed
            for change in (lambda w: w.mul_(-2.0), lambda w: w.copy_(rand(tuple(w.shape), gen(9)) / k ** 0.5)):
                change(lin.weight)
                torch.testing.assert_close(compiled(x), lin(x), **_tol(k))  # stale panels: off by the change
            torch.testing.assert_close(compiled._first.executor.run_steps([x])[0], lin(x), **_tol(k))


def test_the_kernel_text_and_the_spec():
    """The packed loop is in the kernel of every dot-path row count (one text for all M: size-generic kernels);
    the weight is asked for (``packed_weight``) at 2..WT_MIN_M - 1 rows only (one row: from a larger W).  Fails
    before: no vtc_skinny_packed."""
    for m in (1, 2, 6, 11):
        lin = _linear(300, 70, m)
        x = rand((m, 300), gen(m))
        with torch.no_grad():
            compiled = vtc.compile(lin, (x,), gemm="vtc")
            torch.testing.assert_close(compiled(x), lin(x), **_tol(300))
        (k,) = [kk for kk in kernels(compiled) if kk.kind == "gemm"]
        src = gemm.generate(k).split('extern "C"')[1]
        assert "vtc_skinny_packed(mb, nb, kb, ap, bpk + k0 * NP + n0 * kb" in src
        spec = getattr(k.gemm, "packed_weight", None)
        assert (spec is not None) == (m >= 2), m
        if spec is not None:
            assert (spec.offset, spec.row_stride, spec.rows, spec.cols) == (0, 300, 70, 300)  # W: N x K
        assert _count(compiled) == (1 if m >= 2 else 0)


def test_a_is_packed_as_rows_for_the_packed_loop():
    """vtc_skinny_pk broadcasts A's elements from rows of kc floats (``_pack_a(rows=True)``), not from an MR-row
    panel read at 48 bytes a k step.  Fails before: the packed loop packed A with vtc_pack_a_rows into panels."""
    lin = _linear(700, 900, 3, bias=False)
    x = rand((3, 700), gen(3))
    with torch.no_grad():
        compiled = vtc.compile(lin, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), lin(x), **_tol(700))
    (k,) = [kk for kk in kernels(compiled) if kk.kind == "gemm"]
    src = gemm.generate(k)
    body = src.split('extern "C"')[1]
    packed_loop = body[body.index("if (bpk) {"):body.index("vtc_skinny_packed(mb, nb, kb, ap")]
    assert "ap + ii * kb" in packed_loop and "vtc_pack_a_rows" not in packed_loop
    assert "_mm512_set1_ps(a[r * kc + p])" in src


def test_rows_of_two_batches_and_a_relu_epilogue():
    """x [2, 3, K] through Linear then ReLU: 6 rows of one weight, the epilogue reading C back."""
    lin = _linear(513, 45, 21)
    x = rand((2, 3, 513), gen(22))
    fn = torch.nn.Sequential(lin, torch.nn.ReLU())
    with torch.no_grad():
        compiled = vtc.compile(fn, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), fn(x), **_tol(513))
        assert _count(compiled) == 1
        lin.weight.mul_(0.5)
        torch.testing.assert_close(compiled(x), fn(x), **_tol(513))


def test_a_slice_of_a_weight_is_packed_from_its_offset():
    """B = W[10:77, 3:260]^T: rows of 257 floats at offset 10 * 300 + 3, 300 apart."""
    g = gen(23)
    w = torch.nn.Parameter(rand((90, 300), g))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, x):
            return x @ self.w[10:77, 3:260].t()

    mod, x = M(), rand((5, 257), g)
    with torch.no_grad():
        compiled = vtc.compile(mod, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), mod(x), **_tol(257))
        assert _count(compiled) == 1
        w[20:30].mul_(3.0)
        torch.testing.assert_close(compiled(x), mod(x), **_tol(257))


def test_switched_off_and_an_input_weight_read_w_in_place(monkeypatch):
    lin = _linear(300, 100, 24)
    x = rand((4, 300), gen(24))
    w2 = rand((100, 300), gen(25))
    with torch.no_grad():
        fn = lambda x, w: x @ w.t()
        compiled = vtc.compile(fn, (x, lin.weight), gemm="vtc")
        torch.testing.assert_close(compiled(x, w2), fn(x, w2), **_tol(300))
        assert _count(compiled) == 0
        monkeypatch.setattr(gemm, "SKINNY_PACKED", False)
        compiled = vtc.compile(lin, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), lin(x), **_tol(300))
        assert _count(compiled) == 0


@pytest.mark.parametrize("batch,m", [(1, 3), (16, 5)])
def test_a_batched_product_against_one_weight(batch, m):
    """bmm of x [batch, m, K] with W^T expanded over the batch: correct before and after W changes, whichever path
    (the batch's A blocks are keyed by batch where W is packed once)."""
    w = torch.nn.Parameter(rand((77, 301), gen(26)) / 301 ** 0.5)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, x):
            return torch.bmm(x, self.w.t().unsqueeze(0).expand(x.shape[0], 301, 77))

    mod, x = M(), rand((batch, m, 301), gen(27))
    with torch.no_grad():
        compiled = vtc.compile(mod, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), mod(x), **_tol(301))
        w.mul_(-1.5)
        torch.testing.assert_close(compiled(x), mod(x), **_tol(301))


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "scalar"])
def test_avx2_and_scalar_builds_of_the_same_source(march, tmp_path):
    """The kernel text with the packed lines (a runtime W: the spec is there, nothing passed) builds without AVX-512."""
    g = gen(28)
    inputs = (rand((4, 37), g), rand((45, 37), g))
    fn = lambda x, w: x @ w.t()  # noqa: E731
    with torch.no_grad():
        compiled = vtc.compile(fn, inputs, gemm="vtc")
    (k,) = [kk for kk in kernels(compiled) if kk.kind == "gemm"]
    assert "vtc_skinny_packed(" in gemm.generate(k)
    torch.testing.assert_close(run_gemm_built_for(march, k, compiled, inputs, tmp_path), fn(*inputs), **_tol(37))


A_FORMS = {
    "cat_k": lambda x, w: torch.cat([x[:, :300], torch.relu(x[:, 300:])], dim=1) @ w.t(),
    "gathered_rows": lambda x, w: x[torch.arange(x.shape[0] - 1, -1, -1)] @ w.t(),
    "transposed": lambda x, w: x.t().contiguous().t() @ w.t(),
    "columns_of_a_wider_x": lambda x, w: x[:, 1:] @ w[:, 1:].t(),
}


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("form", sorted(A_FORMS))
def test_a_through_a_mapping_on_the_packed_loop(form, m):
    """A packed as rows (``_pack_a(rows=True)``) whatever it is read through: a cat along K with a producer, gathered
    rows, a transposed copy, a column slice; W of 600 x 700 floats (1.7 MB: one row packs too)."""
    w = torch.nn.Parameter(rand((700, 600), gen(40)) / 600 ** 0.5)
    fn = A_FORMS[form]

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, x):
            return fn(x, self.w)

    mod, x = M(), rand((m, 600), gen(41 + m))
    with torch.no_grad():
        compiled = vtc.compile(mod, (x,), gemm="vtc")
        torch.testing.assert_close(compiled(x), mod(x), **_tol(600))
        assert gemm.SKINNY_PACKED_PATH in [q["path"] for q in compiled.report.to_dict()["gemm"]]
        w.mul_(-0.5)
        torch.testing.assert_close(compiled(x), mod(x), **_tol(600))


def _pk_fma_memory_operands(src: str) -> dict[str, int]:
    """Per vtc_skinny_pk<R, P> instantiation in the assembly of kernel source `src` (built with the flags vtc
    builds with): its FMAs that read a whole vector from memory (a B vector folded into each row's FMA;
    embedded broadcasts `{1to16}` and stack reloads do not count)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from vtc.runtime.cbuild import compiler_info

    info = compiler_info()
    with tempfile.TemporaryDirectory(prefix="vtc-asm-") as tmp:
        path, out = Path(tmp, "kernel.cpp"), Path(tmp, "kernel.s")
        path.write_text(src)
        subprocess.run([*info.command, str(path), "-S", "-o", str(out), *[f for f in info.flags if f != "-shared"]],
                       check=True, capture_output=True)
        asm = out.read_text()
    counts, fn = {}, None
    for line in asm.splitlines():
        head = re.match(r"_Z13vtc_skinny_pkILi(\d+)ELi(\d+)E[\w.]*:", line)
        if head:
            fn = f"<{head[1]}, {head[2]}>"
            counts.setdefault(fn, 0)
        elif re.match(r"\S+:", line) and not line.startswith("."):
            fn = None  # the next function
        elif fn and re.match(r"\s*vfn?madd\d+ps\s", line) and "(" in line and "1to" not in line \
                and "%rsp" not in line and "%rbp" not in line:
            counts[fn] += 1
    return counts


def test_the_packed_loop_loads_each_b_vector_once():
    """vtc_skinny_pk loads B's 2 P vectors of a k step once into registers for its R rows (VTC_SKINNY_B_IN_REG):
    gcc folded them into every row's FMA as a memory operand at 2-4 rows of two panels (4 x 1024 -> 1024 at 1
    thread 107 -> 86 us, docs/gemm.md session 28).  In the assembly of vtc_skinny_packed (which instantiates 1..8
    rows), no FMA of 2+ rows reads B from memory; with the switch off (the form before) some do."""
    from vtc.codegen.cpp import PRELUDE

    src = (PRELUDE + gemm.RUNTIME + '\nextern "C" void f(int64_t m, int64_t n, int64_t kc, const float* a, '
           'const float* b, float* c) {\n#if defined(__AVX512F__)\n  vtc_skinny_packed(m, n, kc, a, b, c, n, false);'
           '\n#endif\n}\n')
    assert "#define VTC_SKINNY_B_IN_REG 1" in src
    now = _pk_fma_memory_operands(src)
    assert {"<2, 2>", "<4, 2>", "<6, 2>", "<8, 1>"} <= set(now), now
    assert all(n == 0 for fn, n in now.items() if not fn.startswith("<1,")), now  # R >= 2
    before = _pk_fma_memory_operands(src.replace("#define VTC_SKINNY_B_IN_REG 1", "#define VTC_SKINNY_B_IN_REG 0"))
    assert sum(before.values()) > sum(now.values()), (before, now)


ODD = [((2, 1023, 97), 3), ((3, 2049, 200), 4), ((4, 4100, 65), 3), ((5, 777, 131), 4), ((13, 1500, 161), 3),
       ((16, 2050, 129), 4)]


@pytest.mark.parametrize("shape,threads", ODD, ids=[f"{m}x{k}x{n}-t{t}" for (m, k, n), t in ODD])
def test_odd_sizes_at_three_and_four_threads(shape, threads):
    """The packed loop (B vectors in registers) against torch at 3 and 4 threads on odd sizes: N across the 32 /
    64-column edges and split in uneven column blocks, K over one to three KC slices, 2..16 rows (13: chunks of
    6 + 1 after an MR panel; 16: 6 + 6 + 4)."""
    m, k, n = shape
    lin = _linear(k, n, m * k + n, bias=m % 2 == 0)
    x = rand((m, k), gen(k))
    with torch_threads(threads):
        with torch.no_grad():
            compiled = vtc.compile(lin, (x,), gemm="vtc")
            assert [q["path"] for q in compiled.report.to_dict()["gemm"]] == [gemm.SKINNY_PACKED_PATH]
            torch.testing.assert_close(compiled(x), lin(x), **_tol(k))
            assert _count(compiled) == 1
