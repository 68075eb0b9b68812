"""Generated GEMM kernels (vtc.codegen.gemm): mm / bmm / addmm / baddbmm against torch.

Every case compiles with ``gemm="vtc"`` (or the default ``"auto"`` where the
test is about the choice) and compares with eager on random inputs (never
zeros) at odd sizes (1, 3, 17, 127, K up to 300, batch 1 and 16).  Operands
made by movement ops are packed through their mappings: the tests assert that
nothing was materialised (``materialized_movement_bytes == 0``, no copy
kernel) and that the GEMM ran as a generated kernel, not through torch.
``gemm="torch"`` runs the same graphs through torch on views and copies.
"""
from __future__ import annotations

import platform
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen.gemm import generate as generate_gemm
from vtc.runtime import cbuild

from .util import (assert_matches_eager, call_gemm_kernel, compile_cpu, gen, kernels, rand, report,
                   run_gemm_built_for, steps, torch_threads)

# float32 sums over K up to 300 of products of magnitude <= 4, in another order than torch's
GEMM_TOL = dict(rtol=1e-4, atol=2e-4)


def _gemm_kernels(compiled) -> list:
    return [k for k in kernels(compiled) if k.kind == "gemm"]


def _check(fn, inputs, **options):
    compiled = compile_cpu(fn, inputs, **options)
    assert_matches_eager(compiled, fn, inputs, **GEMM_TOL)
    return compiled


def _assert_generated_without_movement(compiled, n_gemm: int = 1) -> None:
    """The GEMMs ran as generated kernels and no movement was materialised on the way."""
    r = report(compiled)
    assert len(_gemm_kernels(compiled)) == n_gemm, compiled.report
    assert [g["choice"] for g in r["gemm"]] == ["vtc"] * n_gemm, r["gemm"]
    assert [s.node.op for s in steps(compiled, "run")] == []
    assert r["materialized_movement_bytes"] == 0, compiled.report
    assert [k.source_nodes for k in kernels(compiled) if k.kind == "copy"] == []


SHAPES = [(1, 1, 1), (3, 17, 5), (17, 3, 127), (127, 300, 17), (16, 256, 33), (1, 300, 127), (40, 65, 70)]


def _check_mm_per_shape(shapes: list[tuple[int, int, int]], seed: int) -> None:
    """One graph with a generated GEMM (M x K) @ (K x N) per shape, against torch, moving nothing."""
    g = gen(seed)
    inputs = tuple(t for m, k, n in shapes for t in (rand((m, k), g), rand((k, n), g)))
    c = _check(lambda *xs: tuple(xs[i] @ xs[i + 1] for i in range(0, len(xs), 2)), inputs, gemm="vtc")
    _assert_generated_without_movement(c, len(shapes))


def test_mm_matches_torch():
    """One graph with a GEMM per shape (one compile, one library)."""
    _check_mm_per_shape(SHAPES, seed=1)


@pytest.mark.parametrize("batch", [1, 16])
def test_bmm_matches_torch(batch):
    g = gen(2 + batch)
    shapes = [(3, 17, 127), (17, 300, 3), (127, 33, 65)]
    inputs = tuple(t for m, k, n in shapes for t in (rand((batch, m, k), g), rand((batch, k, n), g)))
    c = _check(lambda *xs: tuple(torch.bmm(xs[i], xs[i + 1]) for i in range(0, len(xs), 2)), inputs, gemm="vtc")
    _assert_generated_without_movement(c, len(shapes))


BIAS_SHAPES = [(), (1,), (33,), (1, 33), (17, 1), (17, 33)]  # scalar, one, row, row 2-D, column, full


@pytest.mark.parametrize("beta,alpha", [(1.0, 1.0), (0.5, 2.0), (0.0, 1.5)])
def test_addmm_bias_broadcast_alpha_beta(beta, alpha):
    g = gen(int(beta * 10))
    x, y = rand((17, 127), g), rand((127, 33), g)
    biases = tuple(rand(s, g) for s in BIAS_SHAPES)
    c = _check(lambda x, y, *bs: tuple(torch.addmm(b, x, y, beta=beta, alpha=alpha) for b in bs), (x, y, *biases),
               gemm="vtc")
    _assert_generated_without_movement(c, len(BIAS_SHAPES))


def test_addmm_beta_zero_ignores_nan_bias():
    """torch ignores the bias when beta=0 (even NaN): so does the epilogue."""
    g = gen(3)
    inputs = (torch.full((5,), float("nan")), rand((3, 17), g), rand((17, 5), g))
    _check(lambda b, x, y: torch.addmm(b, x, y, beta=0.0), inputs, gemm="vtc")


def test_linear_with_bias_is_addmm_through_the_transposed_weight():
    g = gen(4)
    lin = torch.nn.Linear(300, 127)
    c = _check(lin, (rand((17, 300), g),), gemm="vtc")
    _assert_generated_without_movement(c)


def test_skinny_rows_against_a_transposed_weight():
    """M = 1..16 against W^T (decode's Linear): the dot-product path on AVX-512, K and N tails included."""
    g = gen(12)
    w, wb = rand((127, 300), g), rand((2, 33, 17), g)
    xs = tuple(rand((m, 300), g) for m in (1, 2, 3, 16))
    c = _check(lambda w, wb, *xs: (*(x @ w.t() for x in xs), torch.bmm(rand_like_batch(xs[2]), wb.transpose(1, 2))),
               (w, wb, *xs), gemm="vtc")
    _assert_generated_without_movement(c, 5)


def test_skinny_dot_path_accumulates_over_reduction_slices():
    """K = 2051 runs the dot-product path in two KC slices: 4 x 4 blocks of sums (reduced at once) and a
    1-column tail added to what the first slice stored."""
    g = gen(13)
    x, w = rand((4, 2051), g), rand((5, 2051), g)
    c = _check(lambda x, w: x @ w.t(), (x, w), gemm="vtc")
    _assert_generated_without_movement(c)


def rand_like_batch(x):
    """[3, 300] -> [2, 3, 17] (a movement-made batched operand)."""
    return x[:, :17].expand(2, 3, 17)


@pytest.mark.parametrize("batch", [1, 16])
def test_baddbmm(batch):
    g = gen(5 + batch)
    inputs = (rand((batch, 1, 65), g), rand((batch, 17, 40), g), rand((batch, 40, 65), g))
    c = _check(lambda b, x, y: torch.baddbmm(b, x, y, beta=0.5, alpha=-1.25), inputs, gemm="vtc")
    _assert_generated_without_movement(c)


def _operand_cases():
    """(id, fn, inputs, strided): an operand of a GEMM made by movement ops; strided: torch takes it as a view."""
    g = gen(40)
    idx = torch.tensor([4, 0, 2, 2, 7, 1, 9, 3, 5, 6, 8, 0, 1])
    return [
        ("transpose_a", lambda a, b: a.transpose(0, 1) @ b, (rand((300, 17), g), rand((300, 33), g)), True),
        ("t_b", lambda a, b: a @ b.t(), (rand((17, 127), g), rand((65, 127), g)), True),
        ("permute_bmm", lambda a, b: torch.bmm(a.permute(1, 0, 2), b.permute(2, 1, 0)),
         (rand((17, 16, 40), g), rand((33, 40, 16), g)), True),
        ("slice", lambda a, b: a[1::2, 3:-2] @ b[::3], (rand((35, 300), g), rand((885, 17), g)), True),
        ("gqa_expand_reshape", lambda q, k: q @ k[:, :, None].expand(2, 4, 4, 17, 40).reshape(2, 16, 17, 40)
         .transpose(-1, -2), (rand((2, 16, 3, 40), g), rand((2, 4, 17, 40), g)), False),
        ("gqa_value", lambda p, v: p @ v[:, :, None].expand(1, 4, 4, 127, 33).reshape(1, 16, 127, 33),
         (rand((1, 16, 5, 127), g), rand((1, 4, 127, 33), g)), False),
        ("cat_k", lambda a, b, w: torch.cat([a, b], 1) @ w, (rand((17, 100), g), rand((17, 27), g), rand((127, 65), g)), False),
        ("cat_n", lambda x, u, v: x @ torch.cat([u, v], 1), (rand((17, 65), g), rand((65, 30), g), rand((65, 3), g)), False),
        ("index_select_rows", lambda t, i, w: t.index_select(0, i) @ w, (rand((10, 300), g), idx, rand((300, 17), g)), False),
        ("gather_rows", lambda t, i, w: t[i] @ w, (rand((10, 65), g), idx, rand((65, 127), g)), False),
        ("pad", lambda a, w: F.pad(a, (2, 1, 1, 3), value=0.5) @ w, (rand((17, 62), g), rand((65, 33), g)), False),
        ("expand_batch_bias", lambda b, x, y: torch.baddbmm(b.expand(16, 3, 17), x, y),
         (rand((1, 3, 17), g), rand((16, 3, 40), g), rand((16, 40, 17), g)), True),
    ]


OPERANDS = _operand_cases()


@pytest.mark.parametrize("name,fn,inputs,strided", OPERANDS, ids=[c[0] for c in OPERANDS])
def test_operand_through_movement_is_packed_through_its_mapping(name, fn, inputs, strided):
    """gemm="vtc": every movement operand is read by the pack loops, nothing is materialised.

    gemm="auto" on the same graph: a virtual operand that is not a strided view -> the generated kernel
    (torch would copy it); only strided views (or physical operands) -> torch on zero-copy views.
    """
    c = _check(fn, inputs, gemm="vtc")
    _assert_generated_without_movement(c)

    auto = c.replan(gemm="auto")
    assert_matches_eager(auto, fn, inputs, **GEMM_TOL)
    r = report(auto)
    choice = r["gemm"][0]
    assert choice["choice"] == ("torch" if strided else "vtc"), choice
    assert choice["vtc_us"] > 0 and choice["torch_us"] > 0
    assert r["materialized_movement_bytes"] == 0, auto.report
    if strided:
        assert choice["copy_bytes"] == 0
        assert [s.node.op.split(".")[1] for s in steps(auto, "run")] in (["mm"], ["bmm"], ["baddbmm"])
    else:
        assert choice["copy_bytes"] > 0 and "not a strided view" in choice["why"]


@pytest.mark.parametrize("name,fn,inputs,strided", [c for c in OPERANDS if not c[3]][:2],
                         ids=[c[0] for c in OPERANDS if not c[3]][:2])
def test_gemm_torch_still_runs_through_torch_with_a_copy(name, fn, inputs, strided):
    c = _check(fn, inputs, gemm="torch")
    r = report(c)
    assert [g["choice"] for g in r["gemm"]] == ["torch"]
    assert _gemm_kernels(c) == []
    assert r["materialized_movement_bytes"] > 0  # the operand that is not a strided view is copied first


def test_single_use_pointwise_producer_is_computed_in_the_pack():
    """relu(x * 2) read only by the GEMM is inlined into the pack loop: one kernel in all."""
    g = gen(8)
    c = _check(lambda x, w, b: F.linear(torch.relu(x * 2.0), w, b), (rand((17, 127), g), rand((33, 127), g),
                                                                    rand((33,), g)), gemm="vtc")
    assert [k.kind for k in kernels(c)] == ["gemm"]
    _assert_generated_without_movement(c)


def test_float64_gemm_stays_in_torch_with_the_reason():
    g = gen(9)
    c = _check(lambda a, b: a @ b, (rand((3, 17), g, torch.float64), rand((17, 5), g, torch.float64)), gemm="vtc")
    choice = report(c)["gemm"][0]
    assert choice["choice"] == "torch" and "float32" in choice["why"]
    assert _gemm_kernels(c) == []


def test_gemm_report_lists_every_gemm_with_both_costs():
    g = gen(10)
    c = _check(lambda a, b, w: torch.relu(a @ b) @ w, (rand((17, 40), g), rand((40, 33), g), rand((33, 3), g)))
    r = report(c)
    assert [g["node"] for g in r["gemm"]] == ["mm", "mm_1"]
    assert all(set(g) >= {"choice", "why", "vtc_us", "torch_us", "shape", "copy_bytes"} for g in r["gemm"])
    assert r["gemm"][0]["shape"] == (1, 17, 33, 40)
    assert "GEMMs" in str(c.report)


def test_unknown_gemm_option_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"gemm='blas' is not one of \['auto', 'vtc', 'torch'\]"):
        compile_cpu(lambda a, b: a @ b, (torch.ones(2, 2), torch.ones(2, 2)), gemm="blas")


def test_tiles_and_threads_cover_large_and_multi_block_shapes():
    """More than one MC/NC/KC block in every direction and partial edge tiles, on the threads torch uses."""
    g = gen(11)
    inputs = (rand((2, 263, 517), g), rand((2, 517, 545), g))
    c = _check(torch.bmm, inputs, gemm="vtc")
    _assert_generated_without_movement(c)


def test_auto_keeps_copy_plus_torch_when_the_gemm_dwarfs_the_copy():
    """A cat in front of a large GEMM (1 GFLOP): torch's slightly faster kernel after a 256 KB copy is
    estimated cheaper."""
    g = gen(13)
    inputs = (rand((256, 128), g), rand((256, 128), g), rand((256, 8192), g))
    c = _check(lambda a, b, w: torch.cat([a, b], 1) @ w, inputs)
    choice = report(c)["gemm"][0]
    assert choice["choice"] == "torch" and "estimated cheaper" in choice["why"], choice
    assert choice["torch_us"] < choice["vtc_us"]
    assert report(c)["materialized_movement_bytes"] == choice["copy_bytes"] == 256 * 256 * 4


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "scalar"])
def test_avx2_and_scalar_micro_kernels_match_torch(march, tmp_path):
    """The same generated source built for AVX2 (6x16) and for no vector ISA (4x8, plain loops)."""
    g = gen(14)
    fn = lambda b, x, y, w: torch.addmm(b, torch.cat([x, y], 1), w, beta=0.5, alpha=2.0)  # noqa: E731
    inputs = (rand((29,), g), rand((19, 20), g), rand((19, 13), g), rand((33, 29), g))
    c = _check(fn, inputs, gemm="vtc")
    (k,) = _gemm_kernels(c)
    out = run_gemm_built_for(march, k, c, inputs, tmp_path)
    torch.testing.assert_close(out, fn(*inputs), **GEMM_TOL)


# -- the BLIS loops: edge tiles, equal KC slices, skinny rows, thread splits ---------------------------
EDGE_SHAPES = [(1, 257, 129), (3, 129, 257), (17, 127, 3), (127, 1, 257), (129, 257, 17), (257, 17, 129),
               (13, 300, 33), (257, 129, 127)]  # (M, K, N)


def test_odd_shapes_cross_every_tile_edge():
    """M, N, K in 1 .. 257 (one graph): partial MR x NR tiles (8/4/2/1-row edge kernels, masked edge columns),
    K = 257 as two equal KC slices, skinny M <= 16 with a row-major B read in place (its last, narrower
    panel zero-padded), A packed by register transposes with row and K tails."""
    _check_mm_per_shape(EDGE_SHAPES, seed=20)


@pytest.mark.parametrize("batch", [1, 16])
def test_movement_operands_at_batch_1_and_16(batch):
    """Transposed A, a GQA-expanded B^T (decode: one query row per head), gathered rows: batch 1 and 16."""
    g = gen(21 + batch)
    heads, kv = 4 * batch, batch
    idx = torch.tensor([5, 0, 3, 3, 1, 2, 4, 0, 1, 6, 2, 5, 3, 1, 0, 4, 6])
    inputs = (rand((batch, 129, 17), g), rand((batch, 129, 33), g), rand((1, heads, 1, 40), g),
              rand((1, kv, 129, 40), g), rand((7, 127), g), idx, rand((127, 33), g))

    def fn(a, b, q, k, t, i, w):
        kk = k[:, :, None].expand(1, kv, 4, 129, 40).reshape(1, heads, 129, 40)
        return torch.bmm(a.transpose(1, 2), b), q @ kk.transpose(-1, -2), t[i] @ w
    c = _check(fn, inputs, gemm="vtc")
    _assert_generated_without_movement(c, 3)


@pytest.mark.parametrize("fn,shapes", [
    (torch.bmm, [(3, 129, 257), (3, 257, 65)]),  # odd batch: M split into a multiple of the threads
    (torch.mm, [(5, 2048), (2048, 257)]),  # skinny: N split
    (torch.mm, [(40, 2000), (2000, 33)]),  # N < M but M too small to split: N split
    (torch.mm, [(300, 64), (64, 600)]),  # one column block, N > M: N split so B is not packed twice (3 threads)
    (torch.mm, [(37, 96), (96, 3584)]),  # 3.5 column blocks of 1024: four of 896 (EQUAL_BLOCKS)
    (torch.mm, [(301, 128), (128, 70)]),  # 2.1 row blocks of 144: three of 108
], ids=["batch3", "skinny", "small_m", "wide_b", "uneven_n", "uneven_m"])
def test_every_thread_count_covers_the_output_once(fn, shapes):
    """The same kernel on 1, 2, 3 and 4 threads (each case above the parallel threshold, 4 MFLOP): each
    output block is computed by exactly one thread."""
    g = gen(22)
    inputs = tuple(rand(s, g) for s in shapes)
    c = _check(fn, inputs, gemm="vtc")
    (k,) = _gemm_kernels(c)
    want = fn(*inputs)
    lib = cbuild.build(generate_gemm(k), name="gemm_direct")
    for nthreads in (1, 2, 3, 4):
        torch.testing.assert_close(call_gemm_kernel(lib, k, c, inputs, nthreads), want, **GEMM_TOL)


def test_auto_generates_skinny_rows_against_a_weight_and_keeps_torch_on_large_squares():
    """gemm="auto" on physical / strided operands compares the two estimates: decode's x @ W^T (4 rows,
    bound by reading W) runs the generated dot-product path, a contiguous 256^3 square torch's kernel."""
    g = gen(24)
    inputs = (rand((4, 1024), g), rand((1024, 1024), g), rand((256, 256), g), rand((256, 256), g))
    c = _check(lambda x, w, a, b: (x @ w.t(), a @ b), inputs)
    r = report(c)["gemm"]
    assert [x["choice"] for x in r] == ["vtc", "torch"], r
    assert r[0]["vtc_us"] <= r[0]["torch_us"] and r[1]["vtc_us"] > r[1]["torch_us"]
    assert "estimated faster" in r[0]["why"] and r[0]["copy_bytes"] == 0
    assert len(_gemm_kernels(c)) == 1


@pytest.fixture
def slow_library(monkeypatch):
    """The machine figures of an AMD EPYC (Zen 5), where torch's float32 GEMM (MKL) ran at 0.55x the
    generated one's speed (384^3, 1 thread, CPU time)."""
    from vtc.plan import cost

    monkeypatch.setattr(cost, "_machine", lambda: cost.Machine(bandwidth_gbs=20.0, measured=True, gemm_gflops=100.0,
                                                               library_gemm_ratio=0.55))


def test_auto_generates_contiguous_gemms_where_torch_is_measured_slower(slow_library):
    """Where the machine figures say torch's GEMM runs at half the generated one's speed, gemm="auto" runs
    a contiguous square and decode's single-row x @ W^T on the generated kernel (measured on that machine,
    1 thread: 1024^3 9.75 vs 20.2 ms, x @ W^T 1 x 4096 x 4096 1.59 vs 2.75 ms); with the fixed figures of
    test_auto_generates_skinny_rows_against_a_weight_and_keeps_torch_on_large_squares it keeps torch."""
    g = gen(25)
    inputs = (rand((1, 1024), g), rand((3584, 1024), g), rand((256, 256), g), rand((256, 256), g))
    c = _check(lambda x, w, a, b: (x @ w.t(), a @ b), inputs)
    r = report(c)["gemm"]
    assert [x["choice"] for x in r] == ["vtc", "vtc"], r
    assert all(x["vtc_us"] < x["torch_us"] for x in r), r
    assert "torch's GEMM measured at 0.5" in r[1]["why"], r[1]["why"]
    assert len(_gemm_kernels(c)) == 2


def test_auto_generates_one_or_two_rows_against_a_runtime_b_where_torch_is_measured_slower(slow_library):
    """M <= 2 against a row-major runtime B runs vtc_ukr_rows (~24 GB/s of B, SKINNY["wide_rows"]): where torch's
    GEMM is measured slow, gemm="auto" generates it (Zen 5, 1 thread: 2 x 4096 @ 4096 x 4096 2.8 ms vs MKL's
    5.8); 4 rows stay on torch's side under these figures.  Fails before the rate: the 12 GB/s of the panels."""
    g = gen(26)
    inputs = (rand((2, 1024), g), rand((1024, 1024), g), rand((4, 1024), g))
    c = _check(lambda x, b, y: (x @ b, y @ b), inputs)
    r = report(c)["gemm"]
    assert [x["choice"] for x in r] == ["vtc", "torch"], r


# (square ratio, few-rows ratio): a Zen 4 EPYC's (MKL at 0.88x the generated GEMM on 384^3, ~0.57x on a Linear of 48
# rows, 1 thread CPU time), the same without the few-rows figure (as measured before it), an Intel Xeon's (MKL as fast)
ZEN4, ZEN4_SQUARE_ONLY, INTEL = (0.88, 0.57), (0.88, 0.0), (1.0, 1.0)


@pytest.mark.parametrize("ratios, few_rows_choice", [(ZEN4, "vtc"), (ZEN4_SQUARE_ONLY, "torch"), (INTEL, "torch")])
def test_auto_takes_the_few_rows_ratio_for_a_linear_of_few_rows(monkeypatch, ratios, few_rows_choice):
    """A Linear of 49 rows (Swin-T's stage 4) runs on MKL's packed weight unless the machine's few-rows ratio says
    MKL is slow there: on the Zen 4, 2.8 vs 1.5 ms at 2 threads (49 x 768 -> 3072), where the 384^3 ratio alone
    (0.88: inside the estimates' margin) left it on MKL.  A Linear of 128 rows (a prefill's) makes the same choice
    with the square ratio alone (a Linear on MKL's packed weight takes the few-rows ratio at any rows since session
    26: test_gemm_packed_ratio.py).  Fails before the few-rows figure (no such Machine field; the 49-row Linear on
    torch)."""
    from vtc.plan import cost

    square, few = ratios
    figures = cost.Machine(bandwidth_gbs=20.0, measured=True, gemm_gflops=100.0, library_gemm_ratio=square,
                           library_few_rows_ratio=few)
    g = gen(27)
    choices = {}
    for rows in (49, 128):
        torch.manual_seed(rows)
        linear = torch.nn.Linear(256, 512).eval()
        x = rand((rows, 256), g)
        for name, m in (("given", figures), ("square only", replace(figures, library_few_rows_ratio=0.0))):
            monkeypatch.setattr(cost, "_machine", lambda m=m: m)
            with torch.no_grad():
                c = _check(linear, (x,))
            choices[rows, name] = [r["choice"] for r in report(c)["gemm"]]
    assert choices[49, "given"] == [few_rows_choice], choices
    assert choices[128, "given"] == choices[128, "square only"], choices


@pytest.mark.parametrize("m", [2, 3, 17, 127, 300])  # two rows at least: both pieces of the cat
def test_epilogue_row_terms_through_a_piece_choice(m):
    """A per-row factor of the epilogue read through a cat (a piece choice on the row index alone) is a row
    temp, computed before the column loop as the whole choice; a per-column bias stays in the loop."""
    g = gen(m)
    h = m // 2
    s1, s2, w, bias = rand((h, 1), g), rand((m - h, 1), g), rand((33, 17), g), rand((17,), g)

    def fn(a):
        return torch.tanh(a @ w * torch.cat([s1, s2]) + bias)

    a = rand((m, 33), g)
    compiled = _check(fn, (a,), plan="all", gemm="vtc")
    assert [k.kind for k in kernels(compiled)] == ["gemm"]
    src = "\n".join(generate_gemm(k) for k in _gemm_kernels(compiled))
    epilogue = src[src.index("for (int64_t ii = 0; ii < mb; ++ii) {", src.index("k0 > 0);")):]
    row, column = epilogue.split("#pragma omp simd", 1)
    assert row.count("const float t") == 1 and " ? " in row, row  # the cat's choice, once per row
    assert "(acc_gemm * t0)" in column and "[i1]" in column, column  # the bias, per column


def test_threads_split_n_where_they_would_each_pack_all_of_b():
    """A prefill down projection (256 x 3584 -> 1024: one 1024-column block of B, two 144-row blocks of A)
    split by M gave each thread the whole B (14.7 MB) to pack; the kernel now splits N where the threads
    would share B's column blocks and N > M (2 threads, one process, medians: 4.77 -> 4.08 ms; 256 x 1024 ->
    1024 1.36 -> 1.17 ms; where B already splits, unchanged)."""
    g = gen(26)
    inputs = (rand((40, 64), g), rand((64, 300), g))
    c = _check(torch.mm, inputs, gemm="vtc")
    (k,) = _gemm_kernels(c)
    assert "|| (BATCH * tn < nt && N > M" in generate_gemm(k)  # (&& !m_split where B may come packed once)


def test_blocks_are_cut_equal_so_threads_get_equal_work():
    """An up projection's 3584 columns were cut 1024 + 1024 + 1024 + 512: of two threads one computed 2048
    columns, the other 1536.  Blocks are now cut equal (4 x 896), rounded to the micro-tile (2 threads, one
    process, min: 256 x 1024 -> 3584 4.43 -> 3.87 ms, llama3_prefill_b1 20.2 -> 18.5 ms)."""
    g = gen(27)
    inputs = (rand((37, 96), g), rand((96, 3584), g))
    c = _check(torch.mm, inputs, gemm="vtc")
    (k,) = _gemm_kernels(c)
    src = generate_gemm(k)
    assert "nc = ((N + tn - 1) / tn + VTC_NR - 1) / VTC_NR * VTC_NR; tn = (N + nc - 1) / nc;" in src.split(
        "if ((BATCH * tm * tn) % nt")[0]  # before (and whatever) the split for the thread count


@pytest.mark.parametrize("m,k", [(37, 300), (12, 17), (130, 1024)])
def test_inlined_producer_of_a_is_computed_as_rows_then_transposed(m, k):
    """Llama's down projection: silu(gate) * up computed in A's pack.  Per MR-row strip each row is one vector
    loop along the reduction into a row-major scratch, then transposed into the panel (ROWS_THEN_PANEL: the
    element-by-element loop stored each value MR floats from the last); odd rows and reductions cross the
    strip's and the 16 x 16 transposes' edges."""
    g = gen(28)
    lin = torch.nn.Linear(k, 70, bias=False)
    with torch.no_grad():
        lin.weight.copy_(rand((70, k), g))
    inputs = (rand((m, k), g), rand((m, k), g))
    fn = lambda a, b: lin(torch.nn.functional.silu(a) * b)  # noqa: E731
    c = _check(fn, inputs, gemm="vtc")
    (k_,) = _gemm_kernels(c)
    assert "vtc_pack_a_rows(a_rows, kb, strip, kb, ap + ir * kb);" in generate_gemm(k_)


@pytest.mark.parametrize("threads,m,n,inlined", [
    (1, 40, 300, True),  # one column block: silu(a) * b computed once, in the pack
    (2, 40, 300, False),  # the two threads split N (N > M) and each would compute all of A
    (1, 20, 2100, False),  # three column blocks of 1024
])
def test_a_producer_recomputed_per_column_block_is_stored_once(monkeypatch, threads, m, n, inlined):
    """Llama's down projection (256 x 3584 -> 1024) computed silu(gate) * up in its A pack; on two threads,
    which split N, each thread computed all of A (2 threads: the GEMM 4.72 ms against 3.85 on a plain A).
    Inlined only where the kernel packs A once (``gemm.column_blocks``); else one pointwise kernel stores it."""
    from vtc.codegen import gemm as gemm_mod
    from vtc.plan import cost

    monkeypatch.setattr(cost, "_machine", lambda: cost.Machine(bandwidth_gbs=20.0, threads=threads))
    assert gemm_mod.column_blocks(1, m, n, 256, threads) == (1 if inlined else 3 if n > 2048 else 2)
    g = gen(29)
    lin = torch.nn.Linear(256, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(rand((n, 256), g))
    inputs = (rand((m, 256), g), rand((m, 256), g))
    c = _check(lambda a, b: lin(torch.nn.functional.silu(a) * b), inputs, gemm="vtc")
    assert len(_gemm_kernels(c)) == 1
    assert len(steps(c, "kernel")) == (1 if inlined else 2), c.report  # the GEMM, and the product stored


def test_column_blocks_follows_the_kernels_blocking_constants():
    """gemm.column_blocks repeats generate's blocking arithmetic: its constants are the C's."""
    from vtc.codegen import gemm as gemm_mod

    src = gemm_mod.RUNTIME
    assert "#define VTC_MR 12\n#define VTC_NR 32" in src and f"#define VTC_NC {gemm_mod.NC}" in src
    assert f"#define VTC_MC (VTC_MR * {gemm_mod.MC_ROWS // gemm_mod.MR})" in src
    (k,) = _gemm_kernels(_check(torch.mm, (rand((3, 64), gen(30)), rand((64, 40), gen(31))), gemm="vtc"))
    assert "nc = 4 * VTC_NR;" in generate_gemm(k) and gemm_mod.SKINNY_NC == 4 * 32


@pytest.mark.parametrize("m,n,k,split", [
    (1, 1024, 1024, True),  # 2 MFLOP, 4 MB of W: decode's one-row projection, a read of W
    (1, 256, 1024, True),  # 1 MB of W: the smallest one that forks
    (3, 200, 1024, False),  # 800 KB of W, 1.2 MFLOP: one thread
    (40, 300, 300, True),  # 9.6 MFLOP: the flops alone
])
def test_a_few_rows_over_a_large_weight_are_split_over_the_threads(m, n, k, split):
    """A one-row x @ W^T over a 1024 x 1024 W has too few flops to fork by PARALLEL_MIN_FLOPS, yet it reads 4 MB:
    ~42 us on one thread, ~26 on two (session 14).  The kernel's fork condition counts B's bytes as well, and
    gemm.column_blocks (the planner's copy of the kernel's blocking) says the same as the C."""
    from vtc.codegen import gemm as gemm_mod

    g = gen(32)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(rand((n, k), g) / k ** 0.5)
    x = rand((m, k), g)
    with torch_threads(2):  # the split itself checked against eager
        c = _check(lin, (x,), gemm="vtc")
    (kern,) = _gemm_kernels(c)
    line = next(ln for ln in generate_gemm(kern).splitlines() if "const int nt = " in ln)
    cond = line.split("const int nt = ")[1].split(" && nthreads")[0]
    assert eval(cond.replace("LL", "").replace("||", " or ")) is split, line
    assert gemm_mod.parallel_worth(1, m, n, k) is split
