"""Adversarial tests (session 17): random chains of movement ops (transpose, permute, strided slices, narrow,
flip, roll, pad, cat, index_select, gather, chunk, expand, reshape) in front of each consumer kind (pointwise,
reductions, softmax, layer_norm, rms_norm, Linear / matmul / bmm with the chain as A and as B), on odd sizes,
float32 and bf16, contiguous and transposed inputs, 1 and 2 threads, compared with torch eager.

The explicit tests at the end are the defects the drawn chains found (docs/robustness.md, "Adversarial tests,
session 17"); each failed before its fix."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st

import vtc
from tests.adversarial import SETTINGS, SIZES, Draw, close, describe, draw_chain, rand, run_chain
from tests.codegen.util import torch_threads


def _consumer(r: Draw, shape, dtype, g):
    """A consumer of a chain's output of this shape: (description, fn)."""
    rank, kind = len(shape), r.choice(["pointwise", "sum", "amax_mean", "softmax", "layer_norm", "rms_norm",
                                       "linear", "linear_gelu", "matmul_b", "gram", "bmm_a", "bmm_b"])
    last = shape[-1]
    w, b = rand((last,), g).to(dtype), rand((last,), g).to(dtype)
    if kind == "pointwise":
        return kind, lambda t: torch.sigmoid(t) * 2 + t
    if kind == "sum":
        d = r.randrange(rank)
        return f"sum({d})", lambda t: t.sum(d)
    if kind == "amax_mean":
        return kind, lambda t: t.amax(-1) + t.mean(-1)
    if kind == "softmax":
        d = r.randrange(rank)
        return f"softmax({d})", lambda t: torch.softmax(t, d)
    if kind == "layer_norm":
        return kind, lambda t: F.layer_norm(t, (last,), w, b)
    if kind == "rms_norm":
        return kind, lambda t: F.rms_norm(t, (last,), w, eps=1e-5)
    if kind in ("linear", "linear_gelu"):
        n = r.choice([1, 3, 17, 40])
        W, B = rand((n, last), g).to(dtype), rand((n,), g).to(dtype)
        if kind == "linear":
            return f"linear(N={n})", lambda t: F.linear(t, W, B)
        return f"gelu(linear(N={n})) + t.sum(-1, keepdim)", lambda t: F.gelu(F.linear(t, W)) + t.sum(-1, keepdim=True)
    if kind == "matmul_b" and rank >= 2:
        X = rand((r.choice([1, 3, 13]), shape[-2]), g).to(dtype)
        return f"X[{X.shape[0]}] @ t", lambda t: X @ t
    if kind == "gram" and rank >= 2:
        return "t @ t^T", lambda t: t @ t.transpose(-1, -2)
    if kind == "bmm_a" and rank == 3:
        Y = rand((shape[0], shape[2], r.choice([1, 4, 33])), g).to(dtype)
        return "bmm(t, Y)", lambda t: torch.bmm(t, Y)
    if kind == "bmm_b" and rank == 3:
        X = rand((shape[0], r.choice([1, 5, 12]), shape[1]), g).to(dtype)
        return "bmm(X, t)", lambda t: torch.bmm(X, t)
    return "pointwise", lambda t: torch.sigmoid(t) * 2 + t


def _check_drawn(data, dtype):
    r = Draw(data)
    shape = [r.choice(SIZES) for _ in range(r.choice([2, 3, 3, 4]))]
    ops, out_shape = draw_chain(r, shape, r.randrange(1, 5))
    g = torch.Generator().manual_seed(r.randrange(1000))
    what, consumer = _consumer(r, out_shape, dtype, g)
    x = rand(shape, g, dtype, noncontiguous=r.choice([False, True]))
    plan, gemm, threads = r.choice(["all", "greedy"]), r.choice(["auto", "vtc"]), r.choice([1, 2])
    desc = (f"x: {dtype} {shape} (contiguous: {x.is_contiguous()}); {describe(ops)} -> {list(out_shape)} -> "
            f"{what}; plan={plan} gemm={gemm} threads={threads}")
    note(desc)

    def fn(x):
        return consumer(run_chain(ops, x))

    want = fn(x)
    with torch_threads(threads):
        compiled = vtc.compile(fn, (x,), plan=plan, gemm=gemm)
        close(compiled(x), want, dtype, desc)
        close(compiled(x.contiguous()), want, dtype, desc + " (second call, contiguous input)")


@settings(max_examples=8, **SETTINGS)
@given(st.data())
def test_a_drawn_chain_into_a_drawn_consumer_float32(data):
    _check_drawn(data, torch.float32)


@settings(max_examples=3, **SETTINGS)
@given(st.data())
def test_a_drawn_chain_into_a_drawn_consumer_bf16(data):
    _check_drawn(data, torch.bfloat16)


# -- defects the drawn chains found -------------------------------------------------------------------------
@pytest.mark.parametrize("gemm", ["auto", "vtc"])
def test_rows_index_selected_by_a_constant_into_both_operands_of_a_skinny_bmm(gemm):
    """B = A^T with A's batch picked by a constant index_select, 3 rows: the spec of the dot path's weight
    packed once printed B's offset, which loads the index tensor, on an emitter that had no pointer for it
    (KeyError 'c_lifted_tensor_0' at compile time; vtc/codegen/gemm.py, _packed_path)."""
    idx = torch.tensor([2])

    def fn(x):
        t = x.index_select(0, idx)
        return t @ t.transpose(-1, -2)

    x = rand((8, 3, 8), torch.Generator().manual_seed(5))
    compiled = vtc.compile(fn, (x,), plan="all", gemm=gemm)
    close(compiled(x), fn(x), torch.float32)


def test_a_roll_by_zero_under_a_convolutions_padding():
    """roll's index tensor (arange + shift) % n is folded into index arithmetic and no step computes it; read
    under the convolution's zero padding its index ran to -1, where fmod does not fold, so the load stayed in
    the kernel and the call read a buffer no step filled (AttributeError: 'NoneType' object has no attribute
    'dtype'; vtc/codegen/lower.py, Lowering._fold)."""
    g = torch.Generator().manual_seed(47)
    weight = rand((1, 3, 1, 1), g)

    def fn(x):
        return F.conv2d(x.roll(0, 3).expand(3, 3, 8, 17), weight, padding=1) + 1.5

    x = rand((3, 1, 8, 17), g)
    compiled = vtc.compile(fn, (x,))
    close(compiled(x), fn(x), torch.float32)


def test_a_roll_padded_in_front_of_bmm():
    g = torch.Generator().manual_seed(118)
    X = rand((6, 5, 2), g)

    def fn(x):
        return torch.bmm(X, F.pad(x.roll(-1, 0), [0, 0, 0, 0, 2, 1], value=1.5).expand(6, 2, 8))

    x = rand((3, 1, 8), g)
    compiled = vtc.compile(fn, (x,), plan="all", gemm="vtc")
    close(compiled(x), fn(x), torch.float32)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_cat_after_a_roll_called_with_a_wider_first_part(dynamic):
    """The same fold at a new size: the size-generic kernel reads the rolled part at (i1 - 9) for i1 in [0, 13)
    and kept the load of the folded index (the same AttributeError at the second size)."""
    g = torch.Generator().manual_seed(3)

    def fn(a, b):
        return torch.cat([a, b.roll(2, 1)], 1).softmax(-1)

    compiled = vtc.compile(fn, (rand((3, 5), g), rand((3, 4), g)), dynamic=dynamic)
    for a, b in [(rand((3, 9), g), rand((3, 4), g)), (rand((1, 9), g), rand((1, 17), g)),
                 (rand((2, 2), g), rand((2, 1), g))]:
        close(compiled(a, b), fn(a, b), torch.float32, f"{list(a.shape)} {list(b.shape)}")
