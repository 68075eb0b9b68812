"""argmax / argmin as generated row kernels (vtc.codegen.ops._arg_extreme) against torch eager, exactly.

Two passes over the row: the max (min), then the first r holding it (or holding a NaN).  torch's answer is
the first index of the max / min on ties, and NaN counts as both the largest and the smallest value (the
first NaN wins for argmax and argmin); dim=None is the index into the flattened input.  Inputs: rows of 1,
3, 17, 127 (and 4099: the long-row lanes of the max pass); integer-valued floats, so that ties are common;
rows with NaN, inf, -0.0; bf16 / fp16 / integer dtypes; pointwise prologues; every movement op in front,
read through its mapping with nothing materialised.  Every case also checks that nothing ran through torch
(before this, argmax / argmin were always torch's).
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen.cpp import generate

from .util import assert_all_generated, assert_no_movement, case_seed, compile_cpu, gen, kernels, torch_threads

NAN, INF = float("nan"), float("inf")


def _ties(shape, g, dtype=torch.float32) -> torch.Tensor:
    """Integer-valued floats in [-3, 3] (ties in every row longer than 7), as dtype."""
    return torch.randint(-3, 4, shape, generator=g).to(dtype)


def _check(fn, inputs, n_kernels: int | None = None, no_movement: bool = False):
    compiled = compile_cpu(fn, inputs)
    assert_all_generated(compiled)
    if no_movement:
        assert_no_movement(compiled)
    want, got = fn(*inputs), compiled(*inputs)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for k, (w, o) in enumerate(zip(want, got)):
        assert o.dtype == w.dtype == torch.int64 and o.shape == w.shape, (k, o.dtype, o.shape, w.shape)
        assert torch.equal(o, w), f"output {k}:\n{o}\n!= eager\n{w}\ninputs {inputs}"
    if n_kernels is not None:
        assert len(kernels(compiled)) == n_kernels
    return compiled


def _all_dims(x):
    return (x.argmax(-1), x.argmin(-1), x.argmax(1, keepdim=True), x.argmin(1), x.argmax(0), x.argmin(0, keepdim=True))


@pytest.mark.parametrize("n", [1, 3, 17, 127])
def test_every_dim_with_ties(n):
    """Last dim, a strided middle dim and the first dim, keepdim or not; ties in most rows."""
    x = _ties((5, n, 7), gen(case_seed(("ties", n))))
    _check(_all_dims, (x,), n_kernels=6)


def test_nan_inf_and_signed_zero_rows():
    """The first NaN of a row wins for argmax and argmin; -0.0 and 0.0 tie (the first wins); all -inf / inf rows."""
    rows = [[1, NAN, 3, NAN, 5], [NAN, NAN, 1, 2, 3], [1, 2, 3, 4, NAN], [-0.0, 0.0, -1, 1, 1],
            [0.0, -0.0, 2, -2, -2], [-INF] * 5, [INF] * 5, [INF, -INF, INF, -INF, NAN], [2, 2, 2, 2, 2]]
    x = torch.tensor(rows)
    _check(lambda x: (x.argmax(-1), x.argmin(-1), x.t().argmax(-1), x.t().argmin(-1)), (x,))
    long = torch.randn(4, 4099, generator=gen(7))  # the max pass in partial-result lanes (cpp.LONG_ROW)
    long[1, 3000], long[2, 17], long[2, 4000], long[3, 4098] = NAN, NAN, NAN, NAN
    _check(lambda x: (x.argmax(-1), x.argmin(-1)), (long,))


def test_dim_none_and_0d():
    """dim=None: the index into the flattened input (keepdim: all ones); a 0-d input: 0."""
    x = _ties((3, 17, 5), gen(11))
    x[2, 4, 1] = NAN
    _check(lambda x: (x.argmax(), x.argmin(), x.argmax(keepdim=True), x[:2].argmin(keepdim=True),
                      x[:2].argmax()), (x,))
    _check(lambda x: (x.sum().argmax(), x.sum().argmin(0)), (x,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_values_with_a_prologue(dtype):
    """bf16 / fp16 (widened to float, as eager compares them), with a bf16 prologue rounded per op."""
    g = gen(case_seed(("16", str(dtype))))
    x, y = torch.randn(6, 127, generator=g).to(dtype), torch.randn(127, generator=g).to(dtype)
    x[1, 5] = NAN
    f = lambda x, y: (x.argmax(-1), x.argmin(0), (x * 3 + y).argmax(-1), (x - y).argmin(-1, keepdim=True))  # noqa: E731
    _check(f, (x, y))
    _check(lambda x: (x.argmax(-1), x.argmin(1)), (_ties((4, 17, 3), g, dtype),))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8, torch.float64])
def test_other_dtypes(dtype):
    x = _ties((4, 17, 9), gen(case_seed(("dt", str(dtype)))), torch.int64)
    x = (x + 3).to(dtype) if dtype == torch.uint8 else x.to(dtype)
    _check(_all_dims, (x,))


def test_fused_prologue_is_one_kernel():
    """argmax(x * 2 + y) (y broadcast) and argmin(relu(x) - x.exp()): the prologue is inlined into both passes."""
    g = gen(21)
    x, y = torch.randn(8, 33, generator=g), torch.randn(33, generator=g)
    _check(lambda x, y: (x * 2 + y).argmax(-1), (x, y), n_kernels=1)
    _check(lambda x, y: (torch.relu(x) - y.exp()).argmin(0), (x, y), n_kernels=1)


def test_non_contiguous_and_broadcast_inputs():
    g = gen(31)
    base = _ties((17, 9), g)
    _check(lambda x: (x.argmax(-1), x.argmin(0)), (base.t(),))  # a transposed graph input
    _check(lambda x: (x.argmax(-1), x.argmin(0)), (base[:, ::2],))  # a strided one
    _check(lambda x: x.expand(4, 17, 9).argmax(0), (base,))  # every row ties: index 0
    _check(lambda x, y: (x + y).argmax(-1), (_ties((5, 1), g), _ties((1, 17), g)))  # broadcast in the prologue


MOVEMENT = {
    "transpose": lambda x, y: x.transpose(0, 1).argmax(-1),
    "permute": lambda x, y: x.permute(2, 0, 1).argmin(-1),
    "permute_strided_dim": lambda x, y: x.permute(0, 2, 1).argmax(1),
    "slice": lambda x, y: x[:, 1:12, 2:].argmax(-1),
    "cat": lambda x, y: torch.cat((x, y), dim=-1).argmax(-1),
    "cat_first_dim": lambda x, y: torch.cat((x, y), dim=-1).argmin(0),
    "expand": lambda x, y: (x[:, :1, :].expand(4, 17, 9) + y[:, :, :9]).argmax(1),
    "index_select": lambda x, y: x.index_select(1, torch.tensor([3, 0, 3, 16, 5])).argmin(-1),
    "flip": lambda x, y: x.flip(-1).argmax(-1),
    "view": lambda x, y: x.reshape(4, 153).argmax(-1),
}


@pytest.mark.parametrize("name", sorted(MOVEMENT))
def test_movement_in_front_is_read_through_its_mapping(name):
    g = gen(case_seed(("mv", name)))
    x, y = _ties((4, 17, 9), g), _ties((4, 17, 11), g)
    x[1, 3, 4] = NAN
    _check(MOVEMENT[name], (x, y), n_kernels=1, no_movement=True)


def test_rows_over_two_threads():
    """Enough work for the parallel row loop (cpp.PARALLEL_MIN_WORK): the same answer on 2 threads."""
    g = gen(41)
    x = _ties((96, 1024), g)
    with torch_threads(2):
        c = _check(lambda x: (x.argmax(-1), x.t().argmin(-1)), (x,))
    assert all("#pragma omp parallel for" in generate(k) for k in kernels(c))


def test_no_rows():
    """Over the non-empty dim of a (3, 0) input: a (0,) result."""
    x = torch.zeros(3, 0)
    compiled = compile_cpu(lambda x: x.argmax(0), (x,))
    assert compiled(x).shape == (0,) and compiled(x).dtype == torch.int64


@pytest.mark.parametrize("shape", [(127, 8), (33, 16), (17, 21)])
def test_strided_rows_run_as_vector_lanes(shape):
    """permute -> argmax over the strided dim: blocks of rows as vector lanes (vtc.codegen.lanes), both passes;
    8 rows: 2 steps of r per vector (lanes.r_unroll), 21: a block of 16 and one of 5."""
    g = gen(case_seed(("lanes", shape)))
    x = _ties(shape, g)
    x[shape[0] // 2, 1], x[3, shape[1] - 1], x[shape[0] - 1, shape[1] - 1] = NAN, NAN, NAN
    c = _check(lambda x: (x.permute(1, 0).argmax(-1), x.t().argmin(-1, keepdim=True)), (x,), no_movement=True)
    for k in kernels(c):
        assert "accv_i[" in generate(k), generate(k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_max_min_over_a_dim_give_values_and_first_indices(dtype):
    """torch.max(x, dim) / torch.min(x, dim): the same two passes, storing the value too (NaN where a row has one)."""
    g = gen(case_seed(("maxdim", str(dtype))))
    x = _ties((6, 17, 5), g, dtype)
    if dtype.is_floating_point:
        x[2, 3, 1], x[4, 16, 4] = NAN, NAN
    f = lambda x: (*torch.max(x, -1), *torch.min(x, 1, keepdim=True), torch.max(x.permute(2, 0, 1), 0).indices)  # noqa: E731
    compiled = compile_cpu(f, (x,))
    assert_all_generated(compiled)
    for k, (got, want) in enumerate(zip(compiled(x), f(x))):
        assert got.dtype == want.dtype and got.shape == want.shape, k
        assert torch.equal(got.isnan() if dtype.is_floating_point else got, want.isnan() if dtype.is_floating_point
                           else want), k
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_new_sizes_with_dynamic_shapes():
    """dynamic=True: size-generic kernels (vtc.runtime.generic) give torch's indices at other row lengths and counts."""
    import vtc

    def make(b, s):
        g = gen(b * 100 + s)
        x = _ties((b, s, 24), g)
        x[0, 0, 3] = NAN
        return x, torch.randn(24, generator=g)

    f = lambda x, y: ((x * 2 + y).argmax(-1), x.permute(0, 2, 1).argmin(-1), *torch.max(x, 1))  # noqa: E731
    compiled = vtc.compile(f, make(2, 40), backend="cpu", plan="all", dynamic=True)
    for b, s in [(2, 40), (3, 57), (5, 17)]:
        xs = make(b, s)
        for k, (got, want) in enumerate(zip(compiled(*xs), f(*xs))):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"output {k} at {(b, s)}")
