"""GEMM operand A packed by runs (vtc.codegen.gemm_pack): cat parts, gathered rows, gathered columns.

Every case compiles under plan "all" and "greedy" (gemm="auto") and compares with eager on random inputs
(never zeros) at odd sizes (1, 3, 17, 127, K across a KC block) and batch 1 and 16; it asserts that the
operand stayed virtual (``materialized_movement_bytes == 0``), that the GEMM ran as a generated kernel and
that its pack loop is the one by runs (``vtc_pack_a_ptrs`` / ``vtc_pack_a_cols`` in the generated source,
``a_packing`` in the report), not an element-by-element loop.
"""
from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen.gemm import generate as generate_gemm

from .util import assert_matches_eager, compile_cpu, gen, kernels, rand, report, run_gemm_built_for, steps

# float32 sums over K up to 300 of products of magnitude <= 4, in another order than torch's
GEMM_TOL = dict(rtol=1e-4, atol=2e-4)


def _gemm_sources(compiled) -> list[str]:
    """The generated C of each GEMM kernel, from its entry point on (the runtime helpers left out)."""
    out = []
    for k in kernels(compiled):
        if k.kind == "gemm" and k.gemm is not None:
            src = generate_gemm(k)
            out.append(src[src.index('extern "C"'):])
    return out


def _check_virtual(fn, inputs, packing: list[str], plans=("all", "greedy")) -> dict:
    """fn compiled under each plan matches eager; every GEMM is generated with A packed as `packing` says
    ("runs": row pointers, "columns": gathered columns), and no movement was materialised."""
    for plan in plans:
        c = compile_cpu(fn, inputs, plan=plan)
        assert_matches_eager(c, fn, inputs, **GEMM_TOL)
        r = report(c)
        assert r["materialized_movement_bytes"] == 0, c.report
        assert [g["choice"] for g in r["gemm"]] == ["vtc"] * len(packing), r["gemm"]
        assert [g["a_packing"] for g in r["gemm"]] == packing, r["gemm"]
        assert [s.node.op for s in steps(c, "run")] == []
        srcs = _gemm_sources(c)
        assert len(srcs) == len(packing)
        for src, how in zip(srcs, packing):
            call = "vtc_pack_a_ptrs(" if how == "runs" else "vtc_pack_a_cols("
            assert call in src, src
    return r


# -- cat ----------------------------------------------------------------------------------------------
def test_cat_rows_and_cat_k_at_odd_sizes():
    """cat along M (17 + 3 rows, and 1 + 127: the boundary inside a 12-row panel) and along K (100 + 27
    inside one KC block; 300 + 17: the boundary in the second of two KC blocks), one graph."""
    g = gen(1)
    inputs = (rand((17, 127), g), rand((3, 127), g), rand((127, 33), g),
              rand((1, 65), g), rand((127, 65), g), rand((65, 17), g),
              rand((17, 100), g), rand((17, 27), g), rand((127, 65), g),
              rand((3, 300), g), rand((3, 17), g), rand((317, 1), g))

    def fn(a, b, w, c, d, v, e, f, u, h, i, t):
        return (torch.cat([a, b], 0) @ w, torch.cat([c, d], 0) @ v, torch.cat([e, f], 1) @ u,
                torch.cat([h, i], 1) @ t)
    _check_virtual(fn, inputs, ["runs"] * 4)


def test_cat_of_three_with_a_repeated_source_and_addmm_bias():
    g = gen(2)
    inputs = (rand((33,), g), rand((17, 40), g), rand((17, 7), g), rand((87, 33), g))
    fn = lambda bias, x, y, w: torch.addmm(bias, torch.cat([x, y, x], 1), w, beta=0.5, alpha=2.0)  # noqa: E731
    _check_virtual(fn, inputs, ["runs"])


@pytest.mark.parametrize("batch", [1, 16])
def test_bmm_cat_along_rows_and_k(batch):
    g = gen(3 + batch)
    inputs = (rand((batch, 17, 127), g), rand((batch, 3, 127), g), rand((batch, 127, 33), g),
              rand((batch, 17, 100), g), rand((batch, 17, 27), g), rand((batch, 127, 32), g))
    fn = lambda b0, b1, w1, c0, c1, w2: (torch.bmm(torch.cat([b0, b1], 1), w1),  # noqa: E731
                                         torch.bmm(torch.cat([c0, c1], 2), w2))
    _check_virtual(fn, inputs, ["runs"] * 2)


def test_bmm_cat_along_the_batch():
    """16 = 1 + 15 batches: the piece test reads the batch index alone (decided once per row)."""
    g = gen(4)
    inputs = (rand((1, 17, 40), g), rand((15, 17, 40), g), rand((16, 40, 33), g))
    _check_virtual(lambda a, b, w: torch.bmm(torch.cat([a, b], 0), w), inputs, ["runs"])


def test_padded_rows_and_columns_pack_the_fill():
    """F.pad along M (fill rows: null row pointers) and along K (fill segments), fill 0.5 and 0."""
    g = gen(5)
    inputs = (rand((17, 40), g), rand((40, 33), g), rand((17, 37), g), rand((40, 3), g))
    fn = lambda a, w, b, v: (F.pad(a, (0, 0, 2, 3), value=0.5) @ w, F.pad(b, (2, 1)) @ v)  # noqa: E731
    _check_virtual(fn, inputs, ["runs", "runs"])


# -- gathered rows ----------------------------------------------------------------------------------------
def test_gathered_rows_index_embedding_index_select():
    """w_emb[idx] @ w for 1 (the skinny dot-product path), 3, 17 and 127 rows, repeated and negative indices
    (the tensor-index form), torch.index_select(x, 0, idx) @ w with K = 300 (two KC blocks),
    F.embedding(idx, table) @ w; one graph."""
    g = gen(10)
    idx = [torch.randint(-50, 50, (rows,), generator=g) for rows in (1, 3, 17, 127)]
    pos = torch.randint(0, 50, (17,), generator=g)
    inputs = (rand((50, 127), g), *idx, pos, rand((127, 33), g), rand((50, 300), g), rand((300, 17), g))

    def fn(table, i1, i3, i17, i127, p, w, big, v):
        return (*(table[i] @ w for i in (i1, i3, i17, i127)), torch.index_select(big, 0, p) @ v,
                F.embedding(p, table) @ w)
    _check_virtual(fn, inputs, ["runs"] * 6)


@pytest.mark.parametrize("batch", [1, 16])
def test_bmm_gathered_rows(batch):
    g = gen(20 + batch)
    idx = torch.randint(0, 40, (17,), generator=g)
    inputs = (rand((batch, 40, 127), g), idx, rand((batch, 127, 33), g))
    _check_virtual(lambda t, i, w: torch.bmm(t[:, i], w), inputs, ["runs"])


def test_gathered_rows_out_of_range_raise_index_error_naming_the_op_and_value():
    g = gen(30)
    table, w = rand((10, 64), g), rand((64, 17), g)
    fn = lambda t, i, w: F.embedding(i, t) @ w  # noqa: E731
    good = torch.tensor([1, 9, 0])
    for plan in ("all", "greedy"):
        c = compile_cpu(fn, (table, good, w), plan=plan)
        assert report(c)["gemm"][0]["a_packing"] == "runs"
        with pytest.raises(IndexError, match=r"index 10 is out of range \[0, 9\]"):
            c(table, torch.tensor([1, 10, 0]), w)
        with pytest.raises(IndexError, match=r"index -1 is out of range"):
            c(table, torch.tensor([-1, 2, 0]), w)
        torch.testing.assert_close(c(table, good, w), fn(table, good, w), **GEMM_TOL)  # still fine after


# -- gathered columns -------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 17])
def test_gathered_columns(rows):
    """x[:, perm] @ w (repeats in perm), K = 127 and 300 (two KC blocks): the column offsets are read once
    per block, each row gathered by them."""
    g = gen(40 + rows)
    p1 = torch.randint(0, 130, (127,), generator=g)
    p2 = torch.randperm(300, generator=g)
    inputs = (rand((rows, 130), g), p1, rand((127, 33), g), rand((rows, 300), g), p2, rand((300, 5), g))
    fn = lambda x, p, w, y, q, v: (x[:, p] @ w, y[:, q] @ v)  # noqa: E731
    _check_virtual(fn, inputs, ["columns", "columns"])


# -- a channel cat in front of a 1x1 convolution (vtc.codegen.conv packs its im2col by runs) -----------
@pytest.mark.parametrize("batch", [1, 16])
def test_channel_cat_before_1x1_conv(batch):
    g = gen(50 + batch)
    inputs = (rand((batch, 17, 7, 9), g), rand((batch, 3, 7, 9), g), rand((33, 20, 1, 1), g), rand((33,), g))
    fn = lambda a, b, w, bias: F.conv2d(torch.cat([a, b], 1), w, bias)  # noqa: E731
    for plan in ("all", "greedy"):
        c = compile_cpu(fn, inputs, plan=plan)
        assert_matches_eager(c, fn, inputs, **GEMM_TOL)
        r = report(c)
        assert r["materialized_movement_bytes"] == 0, c.report
        assert [g["choice"] for g in r["gemm"]] == ["vtc"], r["gemm"]


# -- element by element where runs do not apply ----------------------------------------------------------
def test_pad_on_both_dims_still_packs_element_by_element():
    """A piece test on both the row and the reduction index: gemm.py's scalar loop (same results)."""
    g = gen(60)
    inputs = (rand((17, 62), g), rand((65, 33), g))
    fn = lambda a, w: F.pad(a, (2, 1, 1, 3), value=0.5) @ w  # noqa: E731
    c = compile_cpu(fn, inputs, gemm="vtc")
    assert_matches_eager(c, fn, inputs, **GEMM_TOL)
    assert report(c)["gemm"][0]["a_packing"] == "elements"
    assert not any("vtc_pack_a_ptrs(" in s for s in _gemm_sources(c))


# -- the same source built without AVX-512 ---------------------------------------------------------------
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "scalar"])
def test_avx2_and_scalar_builds_of_the_run_packing(march, tmp_path):
    """Gathered rows, a cat along K with a fill segment and gathered columns, built for AVX2 and for no
    vector ISA (the helpers' scalar loops), called directly."""
    g = gen(70)
    idx = torch.randint(0, 20, (19,), generator=g)
    perm = torch.randint(0, 40, (43,), generator=g)
    cases = [
        (lambda t, i, w: t[i] @ w, (rand((20, 40), g), idx, rand((40, 33), g))),
        (lambda a, b, w: torch.cat([F.pad(a, (1, 0)), b], 1) @ w, (rand((19, 20), g), rand((19, 22), g),
                                                                  rand((43, 17), g))),
        (lambda x, p, w: x[:, p] @ w, (rand((19, 40), g), perm, rand((43, 5), g))),
    ]
    for n, (fn, inputs) in enumerate(cases):
        c = compile_cpu(fn, inputs, gemm="vtc")
        (k,) = [k for k in kernels(c) if k.kind == "gemm"]
        out = run_gemm_built_for(march, k, c, inputs, tmp_path, stem=f"gemm{n}")
        torch.testing.assert_close(out, fn(*inputs), **GEMM_TOL)


# -- B: a cat or pad along K, N or the batch, packed box by box -----------------------------------------
@pytest.mark.parametrize("batch", [1, 16])
def test_b_cat_along_k_n_and_batch(batch):
    """x @ cat(.., N), x @ cat(.., K) with the boundary in the second KC block, F.linear with a cat of weights
    (a transposed B cut along N), a pad of B along N, bmm with B a cat along the batch."""
    g = gen(80 + batch)
    inputs = (rand((17, 65), g), rand((65, 30), g), rand((65, 3), g),
              rand((17, 300), g), rand((290, 33), g), rand((10, 33), g),
              rand((40, 64), g), rand((20, 64), g), rand((13, 64), g),
              rand((20, 40), g), rand((40, 30), g),
              rand((batch, 20, 40), g), rand((1, 40, 33), g), rand((batch, 40, 33), g))

    def fn(x, u, v, y, p, q, z, a, b, s, t, h, e, f):
        first = torch.bmm(h, torch.cat([e, f[1:]], 0)) if batch > 1 else torch.bmm(h, torch.cat([e[:, :, :3], f[:, :, 3:]], 2))
        return (x @ torch.cat([u, v], 1), y @ torch.cat([p, q], 0), F.linear(z, torch.cat([a, b], 0)),
                s @ F.pad(t, (1, 2), value=0.5), first)
    for plan in ("all", "greedy"):
        c = compile_cpu(fn, inputs, plan=plan, gemm="vtc")
        assert_matches_eager(c, fn, inputs, **GEMM_TOL)
        assert report(c)["materialized_movement_bytes"] == 0, c.report
        srcs = _gemm_sources(c)
        assert len(srcs) == 5 and all("vtc_pack_b_box(" in s for s in srcs)
