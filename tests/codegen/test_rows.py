"""Row kernels of the CPU backend (reductions, softmax, layer norm, RMSNorm) against torch eager.

Besides the numbers, each test asserts what the code generator is for: every
op here is a generated kernel (nothing through torch), one kernel per result,
and pointwise prologues are computed inside the row kernel (it reads only the
graph's inputs).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .util import (ROW_TOL, assert_all_generated, check, data_reads, gen, graph_input_names, kernel_storing,
                   kernels, rand)

# ---------------------------------------------------------------------------
# every reduction op, over the last dim and over all dims
REDUCTIONS = [
    ("sum", lambda x, q, i, d: x.sum(d)),
    ("mean", lambda x, q, i, d: x.mean(d)),
    ("amax", lambda x, q, i, d: x.amax(d)),
    ("amin", lambda x, q, i, d: x.amin(d)),
    ("var", lambda x, q, i, d: x.var(d)),
    ("var_correction0", lambda x, q, i, d: x.var(d, correction=0)),
    ("std", lambda x, q, i, d: x.std(d)),
    ("prod", lambda x, q, i, d: q.prod(d) if isinstance(d, int) else q.prod()),  # q in [0.8, 1.25)
    ("any", lambda x, q, i, d: (x > 1.5).any(d) if isinstance(d, int) else (x > 1.5).any()),
    ("any_of_float", lambda x, q, i, d: x.any(d) if isinstance(d, int) else x.any()),
    ("all", lambda x, q, i, d: (x > -1.5).all(d) if isinstance(d, int) else (x > -1.5).all()),
    ("sum_int64", lambda x, q, i, d: i.sum(d)),
    ("sum_int32", lambda x, q, i, d: i.to(torch.int32).sum(d)),
    ("sum_bool", lambda x, q, i, d: (x > 0).sum(d)),
    ("sum_dtype_float", lambda x, q, i, d: i.sum(d, dtype=torch.float32)),
    ("mean_dtype_float64", lambda x, q, i, d: x.mean(d, dtype=torch.float64)),
    ("prod_int", lambda x, q, i, d: (i % 3 + 1).prod(d) if isinstance(d, int) else (i % 2 + 1)[0].prod()),
    ("amax_int", lambda x, q, i, d: i.amax(d)),
    ("amin_int", lambda x, q, i, d: i.amin(d)),
]


@pytest.mark.parametrize("dim", [pytest.param(-1, id="last_dim"), pytest.param(None, id="all_dims")])
def test_reduction_ops(dim):
    g = gen(20)
    x, i = rand((17, 127), g), rand((17, 127), g, torch.int64)
    q = rand((17, 127), g, positive=True, low=0.8, high=1.25)
    d = dim if dim is not None else [0, 1]

    def f(x, q, i):
        return tuple(fn(x, q, i, d) for _, fn in REDUCTIONS)

    compiled = check(f, (x, q, i), names=[n for n, _ in REDUCTIONS], **ROW_TOL)
    assert_all_generated(compiled)
    kinds = [k.kind for k in kernels(compiled)]
    # one row kernel per result; prologues (comparisons, casts, % 3 + 1) are inlined into it.
    # Two epilogues are one pointwise kernel each: std's sqrt, and all's logical_not (torch.export
    # decomposes all(x) into not(any(not(x))))
    assert kinds.count("row") == len(REDUCTIONS)
    assert kinds.count("pointwise") == 2


# ---------------------------------------------------------------------------
# dims: one, several (not adjacent), all, keepdim True/False, over shapes with sizes 1, 3, 17, 127
DIMS = [0, 1, -1, (0, 2), (0, 1, 2)]


@pytest.mark.parametrize("shape", [pytest.param((3, 17, 127), id="3x17x127"),
                                   pytest.param((127, 1, 3), id="127x1x3"),
                                   pytest.param((1, 17, 1), id="1x17x1")])
def test_reduction_dims_and_keepdim(shape):
    g = gen(21)
    x = rand(shape, g)
    # var: two passes over r (mean, then squared deviations), both indexed through the dims
    cases = [(f"var(dim={d}, keepdim={kd})", d, kd) for d in DIMS for kd in (True, False)]

    def f(x):
        out = [x.var(d, correction=0, keepdim=kd) for _, d, kd in cases]
        return (*out, x.amax((0, 2), keepdim=True), x.mean(), x.sum([]))  # no dim / [] : all dims

    compiled = check(f, (x,), names=[c[0] for c in cases] + ["amax((0, 2), keepdim)", "mean()", "sum([])"], **ROW_TOL)
    assert_all_generated(compiled)
    assert len(kernels(compiled)) == len(cases) + 3


def test_reductions_of_0d_tensors():
    """dim=0 / -1 of a 0-d tensor names its single element (was an IndexError in ops._dims)."""
    s = rand((), gen(22))

    def f(s):
        return (s.sum(), s.sum(0), s.sum(0, keepdim=True), s.mean(-1), s.amax(), (s > 0).any(0),
                s.var(correction=0), torch.softmax(s, 0), torch.log_softmax(s, -1))

    compiled = check(f, (s,), **ROW_TOL)
    assert_all_generated(compiled)


# ---------------------------------------------------------------------------
# pointwise prologues (inlined into the row kernel) and epilogues (one pointwise kernel after it)
def test_reductions_with_prologues_and_epilogues():
    g = gen(23)
    x, w, b = rand((3, 17, 127), g), rand((127,), g), rand((17, 1), g)

    def f(x, w, b):
        return (
            (torch.exp(x * 0.5) + w).sum(-1) * 2 + 1,  # prologue and epilogue
            (x - b).abs().amax(1, keepdim=True) / 3,
            (x * x).mean((0, 2)).sqrt(),
            (x + 1).var(0, correction=0),  # prologue only
            (x > w).any(-1),
            torch.sigmoid(x).prod(1),
        )

    compiled = check(f, (x, w, b), **ROW_TOL)
    assert_all_generated(compiled)
    inputs = graph_input_names(compiled)
    rows = [k for k in kernels(compiled) if k.kind == "row"]
    assert len(rows) == 6
    for k in rows:  # every prologue is computed inside the row kernel, from the graph's inputs
        assert data_reads(compiled, k) <= inputs, (k.name, data_reads(compiled, k))
    assert len(kernels(compiled)) == 6 + 3  # the three epilogues: one pointwise kernel each


# ---------------------------------------------------------------------------
# softmax and log_softmax over the first, middle and last dims
@pytest.mark.parametrize("shape", [pytest.param((3, 17, 127), id="3x17x127"),
                                   pytest.param((127, 1, 3), id="127x1x3")])
def test_softmax_and_log_softmax(shape):
    g = gen(24)
    x = rand(shape, g, low=0.1, high=4.0)

    def f(x):
        return (*(torch.softmax(x, d) for d in (0, 1, 2)), *(torch.log_softmax(x, d) for d in (0, 1, -1)),
                torch.softmax(x.double(), -1), F.softmax(x, -1, dtype=torch.float64))

    compiled = check(f, (x,), names=["softmax0", "softmax1", "softmax2", "log_softmax0", "log_softmax1",
                                     "log_softmax-1", "softmax_f64", "softmax_dtype_f64"], **ROW_TOL)
    assert_all_generated(compiled)
    assert len(kernels(compiled)) == 8
    assert all(k.kind == "row" for k in kernels(compiled))


def test_softmax_with_prologue_and_epilogue_and_masking():
    g = gen(25)
    x, m = rand((4, 3, 17), g), rand((4, 1, 17), g, torch.bool)
    m[0, 0] = True  # one fully masked row: NaN in torch, and here

    def f(x, m):
        return (torch.softmax(x.masked_fill(m, float("-inf")) * 0.5, -1) * 3 + 1,
                torch.log_softmax(x / 2 + 1, 1))

    compiled = check(f, (x, m), **ROW_TOL)
    assert_all_generated(compiled)
    row = kernel_storing(compiled, 1)
    assert row.kind == "row" and data_reads(compiled, row) == {"x"}


def test_special_values_propagate_like_torch():
    g = gen(26)
    x = rand((4, 17), g)
    x[1, 3], x[2, 0], x[3, 5] = float("nan"), float("inf"), float("-inf")

    def f(x):
        return x.amax(-1), x.amin(0), x.sum(-1), x.amax(), torch.maximum(x, x.flip(1))

    compiled = check(f, (x,), **ROW_TOL)
    assert_all_generated(compiled)


# ---------------------------------------------------------------------------
# layer norm with and without weight and bias, over one and two trailing dims
def test_layer_norm():
    g = gen(27)
    x, w, b = rand((3, 17, 127), g), rand((127,), g), rand((127,), g)
    w2, x3, w3, b3 = rand((17, 127), g), rand((127, 3), g), rand((3,), g), rand((3,), g)

    def f(x, w, b, w2, x3, w3, b3):
        return (F.layer_norm(x, (127,), w, b), F.layer_norm(x, (127,)), F.layer_norm(x, (127,), w),
                F.layer_norm(x, (127,), None, b), F.layer_norm(x, (17, 127), w2, None, eps=1e-3),
                F.layer_norm(x3, (3,), w3, b3))

    compiled = check(f, (x, w, b, w2, x3, w3, b3),
                     names=["w+b", "no_affine", "w", "b", "two_dims_w", "127x3_w+b"], **ROW_TOL)
    assert_all_generated(compiled)
    assert [k.kind for k in kernels(compiled)] == ["row"] * 6


def test_layer_norm_with_pointwise_prologue():
    g = gen(28)
    x, r, w, b = rand((3, 17, 127), g), rand((3, 17, 127), g), rand((127,), g), rand((127,), g)
    f = lambda x, r, w, b: F.layer_norm(x + r * 0.5, (127,), w, b)  # residual add inlined into the norm
    compiled = check(f, (x, r, w, b), **ROW_TOL)
    assert_all_generated(compiled)
    (k,) = kernels(compiled)
    assert data_reads(compiled, k) == {"x", "r", "w", "b"}


# ---------------------------------------------------------------------------
# RMSNorm written out: x * rsqrt(mean(x^2) + eps) * w
def test_rms_norm():
    g = gen(29)
    x, w = rand((3, 17, 127), g), rand((127,), g)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    compiled = check(rms, (x, w), **ROW_TOL)
    assert_all_generated(compiled)
    # one row kernel: pass 1 sums x^2 (the square is inlined), pass 2 stores x * rsqrt(mean + eps) * w for
    # every element of the row while it is in cache; mean(x^2) is never stored
    (row,) = kernels(compiled)
    assert row.kind == "row"
    assert data_reads(compiled, row) == {"x", "w"}
    assert [s.buffer.shape for s in row.stores] == [(3, 17, 127)]


# ---------------------------------------------------------------------------
# a reduction finished by a pointwise kernel over the reduced rows: one kernel when the pointwise kernel
# reads the reduction only at its own row, else two (and the same numbers either way)
@pytest.mark.parametrize("shape", [(1, 3), (17, 1), (3, 17, 127)], ids=str)
def test_reduction_finished_in_its_own_row_kernel(shape):
    g = gen(31)
    x = rand(shape, g)

    def f(x):
        centred = x - x.mean(-1, keepdim=True)  # keepdim
        scaled = x * x.amax(-1).unsqueeze(-1)  # not keepdim, read through a virtual unsqueeze
        return centred, scaled

    compiled = check(f, (x,), **ROW_TOL)
    assert_all_generated(compiled)
    ks = kernels(compiled)
    assert [k.kind for k in ks] == ["row", "row"]
    assert all(s.per_r and s.buffer.shape == shape for k in ks for s in k.stores)


def test_reduction_not_finished_in_its_row_kernel_when_read_elsewhere():
    g = gen(32)
    x = rand((17, 17), g)

    def across(x):  # element (i, j) reads the sum of row j: not its own row
        return x * x.sum(-1, keepdim=True).transpose(0, 1)

    def also_returned(x):  # the reduction is an output: it must be stored
        s = x.sum(-1, keepdim=True)
        return x / s, s

    for fn in (across, also_returned):
        compiled = check(fn, (x,), **ROW_TOL)
        assert_all_generated(compiled)
        assert [k.kind for k in kernels(compiled)] == ["row", "pointwise"], fn.__name__
