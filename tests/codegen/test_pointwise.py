"""Fused pointwise kernels of the CPU backend against torch eager.

Each test compiles one function returning many results (one kernel each, all
built into one or two shared libraries), compares every result with eager
PyTorch, and asserts that nothing ran through torch: the ops listed here all
have code-generator definitions (vtc/codegen/ops.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .util import (POINTWISE_TOL, ROW_TOL, assert_all_generated, check, compile_cpu, data_reads, gen,
                   executor, graph_input_names, kernels, rand, report, steps)

# ---------------------------------------------------------------------------
# unary math: (id, fn(x, p)) with x of random sign and p positive (for log, sqrt, ...)
UNARY = [
    ("neg", lambda x, p: torch.neg(x)),
    ("exp", lambda x, p: torch.exp(x)),
    ("log", lambda x, p: torch.log(p)),
    ("tanh", lambda x, p: torch.tanh(x)),
    ("sigmoid", lambda x, p: torch.sigmoid(x)),
    ("relu", lambda x, p: torch.relu(x)),
    ("rsqrt", lambda x, p: torch.rsqrt(p)),
    ("sqrt", lambda x, p: torch.sqrt(p)),
    ("abs", lambda x, p: torch.abs(x)),
    ("cos", lambda x, p: torch.cos(x)),
    ("sin", lambda x, p: torch.sin(x)),
    ("erf", lambda x, p: torch.erf(x)),
    ("reciprocal", lambda x, p: torch.reciprocal(x)),
    ("floor", lambda x, p: torch.floor(x * 3)),
    ("ceil", lambda x, p: torch.ceil(x * 3)),
    ("expm1", lambda x, p: torch.expm1(x)),
    ("log1p", lambda x, p: torch.log1p(p)),
    ("exp2", lambda x, p: torch.exp2(x)),
    ("log2", lambda x, p: torch.log2(p)),
    ("sign", lambda x, p: torch.sign(x)),
    ("tan", lambda x, p: torch.tan(x * 0.5)),  # |x * 0.5| < 1: away from the poles
    ("atan", lambda x, p: torch.atan(x)),
    ("round", lambda x, p: torch.round(x * 3)),
    ("trunc", lambda x, p: torch.trunc(x * 3)),
    ("silu", lambda x, p: F.silu(x)),
    ("gelu", lambda x, p: F.gelu(x)),
    ("gelu_tanh", lambda x, p: F.gelu(x, approximate="tanh")),
    ("hardswish", lambda x, p: F.hardswish(x * 3)),
    ("hardsigmoid", lambda x, p: F.hardsigmoid(x * 3)),
    ("leaky_relu", lambda x, p: F.leaky_relu(x, 0.1)),
    ("hardtanh", lambda x, p: F.hardtanh(x * 2)),
    ("clamp", lambda x, p: torch.clamp(x, -0.5, 1.0)),
    ("clamp_max", lambda x, p: torch.clamp(x, max=0.3)),
    ("logical_not", lambda x, p: torch.logical_not(x > 0.5)),
    ("square", lambda x, p: torch.square(x)),
]


def test_unary_ops():
    g = gen(1)
    x, p = rand((3, 127), g), rand((3, 127), g, positive=True)

    def f(x, p):
        return tuple(fn(x, p) for _, fn in UNARY)

    compiled = check(f, (x, p), names=[n for n, _ in UNARY], **POINTWISE_TOL)
    assert_all_generated(compiled)
    assert len(kernels(compiled)) == len(UNARY)  # one kernel per result, nothing else


# ---------------------------------------------------------------------------
# binary arithmetic, comparisons, logic, selection, with broadcasting between operands of different ranks
BINARY = [
    ("add", lambda x, y, p, q: x + y),
    ("add_alpha", lambda x, y, p, q: torch.add(x, y, alpha=2)),
    ("sub_alpha", lambda x, y, p, q: torch.sub(x, y, alpha=3)),
    ("rsub_scalar", lambda x, y, p, q: 1.5 - x),
    ("mul", lambda x, y, p, q: x * y),
    ("div", lambda x, y, p, q: x / y),
    ("div_floor", lambda x, y, p, q: torch.div(x * 3, y, rounding_mode="floor")),
    ("div_trunc", lambda x, y, p, q: torch.div(x * 3, y, rounding_mode="trunc")),
    ("maximum", lambda x, y, p, q: torch.maximum(x, y)),
    ("minimum", lambda x, y, p, q: torch.minimum(x, y)),
    ("fmod", lambda x, y, p, q: torch.fmod(x * 3, y)),
    ("remainder", lambda x, y, p, q: torch.remainder(x * 3, y)),
    ("remainder_scalar", lambda x, y, p, q: torch.remainder(x * 3, -1.5)),
    ("atan2", lambda x, y, p, q: torch.atan2(x, y)),
    ("pow_tensor", lambda x, y, p, q: torch.pow(p, y)),
    ("pow_2", lambda x, y, p, q: x ** 2),
    ("pow_half", lambda x, y, p, q: p ** 0.5),
    ("pow_minus1", lambda x, y, p, q: x ** -1),
    ("pow_1_5", lambda x, y, p, q: p ** 1.5),
    ("pow_3", lambda x, y, p, q: x ** 3),
    ("pow_minus_half", lambda x, y, p, q: p ** -0.5),
    ("pow_minus2", lambda x, y, p, q: x ** -2),
    ("pow_scalar_base", lambda x, y, p, q: torch.pow(2.0, x)),
    ("eq", lambda x, y, p, q: torch.round(x) == torch.round(y)),
    ("ne", lambda x, y, p, q: torch.round(x) != torch.round(y)),
    ("lt", lambda x, y, p, q: x < y),
    ("le", lambda x, y, p, q: x <= y),
    ("gt", lambda x, y, p, q: x > y),
    ("ge", lambda x, y, p, q: x >= y),
    ("logical_and", lambda x, y, p, q: torch.logical_and(x > 0, y > 0)),
    ("logical_or", lambda x, y, p, q: torch.logical_or(x > 0, y > 0)),
    ("logical_xor", lambda x, y, p, q: torch.logical_xor(x > 0, y > 0)),
    ("where", lambda x, y, p, q: torch.where(x > y, x, y)),
    ("where_scalar", lambda x, y, p, q: torch.where(x > 0, y, 0.5)),
    ("masked_fill", lambda x, y, p, q: x.masked_fill(y > 0, -2.0)),
    ("masked_fill_ninf", lambda x, y, p, q: x.masked_fill(y > 0, float("-inf"))),
    ("clamp_tensors", lambda x, y, p, q: torch.clamp(x, -p, q)),
]


def test_binary_ops():
    g = gen(2)
    x, y = rand((17, 1, 127), g), rand((3, 1), g)  # broadcast both ways, operands of different ranks
    p, q = rand((17, 1, 127), g, positive=True), rand((3, 1), g, positive=True)

    def f(x, y, p, q):
        return tuple(fn(x, y, p, q) for _, fn in BINARY)

    compiled = check(f, (x, y, p, q), names=[n for n, _ in BINARY], **POINTWISE_TOL)
    assert_all_generated(compiled)
    assert len(kernels(compiled)) == len(BINARY)


def test_transcendentals_over_their_whole_range():
    """The vectorisable exp/erf/tanh (and what is built on them) at overflow, underflow, +-inf, NaN and
    signed zeros: edge values on purpose, next to a dense sweep of [-110, 110]."""
    specials = [float("inf"), float("-inf"), float("nan"), 88.72, 88.73, -87.3, -103.9, -104.0,
                1e-30, -1e-30, 0.0, -0.0]
    x = torch.cat([torch.linspace(-110, 110, 4001), torch.tensor(specials)])
    fns = {
        "exp": torch.exp, "expm1": torch.expm1, "tanh": torch.tanh, "erf": torch.erf, "sigmoid": torch.sigmoid,
        "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "softmax": lambda x: torch.softmax(x.view(-1, 1) * torch.tensor([1.0, 0.5, -1.0]), -1),
        "log_softmax": lambda x: torch.log_softmax(x.view(-1, 1) * torch.tensor([1.0, 0.5, -1.0]), -1),
    }
    compiled = check(lambda x: tuple(f(x) for f in fns.values()), (x,), names=list(fns), **POINTWISE_TOL)
    assert_all_generated(compiled)


# ---------------------------------------------------------------------------
# broadcasting between operands of different ranks, sizes 1, 3, 17, 127 in various positions:
# (x, y, z) shapes; the ops do not matter here (the test above has them all), the indices do
BROADCAST = [
    pytest.param((3, 17), (17,), (), id="3x17|17|0d"),
    pytest.param((127, 1), (1, 3), (3,), id="127x1|1x3|3"),
    pytest.param((17, 1, 127), (3, 1), (1,), id="17x1x127|3x1|1"),
    pytest.param((1, 17, 1), (3, 1, 127), (127,), id="1x17x1|3x1x127|127"),
    pytest.param((127,), (3, 1, 1), (17, 1), id="127|3x1x1|17x1"),
    pytest.param((), (), (1, 1), id="0d|0d|1x1"),
]


@pytest.mark.parametrize("xshape,yshape,zshape", BROADCAST)
def test_broadcasting(xshape, yshape, zshape):
    g = gen(10)
    x, y, z = rand(xshape, g), rand(yshape, g), rand(zshape, g)

    def f(x, y, z):
        return torch.where(x > y, x * y + z, -z), (x - y).masked_fill(z > 0, 0.5) / z

    compiled = check(f, (x, y, z), **POINTWISE_TOL)
    assert_all_generated(compiled)
    assert len(kernels(compiled)) == 2  # one fused kernel per result


# ---------------------------------------------------------------------------
# type promotion int / float / bool, integer arithmetic, casts
PROMOTION = [
    ("f32+i64", lambda x, i, j, b, d: x + i),
    ("i64+i32", lambda x, i, j, b, d: i + j),
    ("i64*int", lambda x, i, j, b, d: i * 2),
    ("i64+float", lambda x, i, j, b, d: i + 1.5),
    ("i32*float", lambda x, i, j, b, d: j * 0.25),
    ("bool+i64", lambda x, i, j, b, d: b + i),
    ("f32*bool", lambda x, i, j, b, d: x * b),
    ("f32+f64", lambda x, i, j, b, d: x + d),
    ("i64//i32", lambda x, i, j, b, d: i // j),
    ("i64%i32", lambda x, i, j, b, d: i % j),
    ("fmod_int", lambda x, i, j, b, d: torch.fmod(i, j)),
    ("div_trunc_int", lambda x, i, j, b, d: torch.div(i, j, rounding_mode="trunc")),
    ("i64/i32", lambda x, i, j, b, d: i / j),
    ("neg_int", lambda x, i, j, b, d: -i),
    ("abs_int", lambda x, i, j, b, d: torch.abs(j)),
    ("relu_int", lambda x, i, j, b, d: torch.relu(i)),
    ("sign_int", lambda x, i, j, b, d: torch.sign(i)),
    ("clamp_int", lambda x, i, j, b, d: torch.clamp(i, -3, 5)),
    ("maximum_int", lambda x, i, j, b, d: torch.maximum(i, j)),
    ("pow_2_int", lambda x, i, j, b, d: i ** 2),
    ("exp_of_int", lambda x, i, j, b, d: torch.exp(i * 0.1)),
    ("sigmoid_of_int", lambda x, i, j, b, d: torch.sigmoid(j)),
    ("eq_int", lambda x, i, j, b, d: i == j),
    ("lt_float_int", lambda x, i, j, b, d: x * 4 < i),
    ("ne_scalar", lambda x, i, j, b, d: i != 2),
    ("bitwise_and", lambda x, i, j, b, d: torch.bitwise_and(i, j)),
    ("bitwise_or", lambda x, i, j, b, d: i | j),
    ("bitwise_xor", lambda x, i, j, b, d: i ^ j),
    ("bitwise_not_int", lambda x, i, j, b, d: ~i),
    ("bitwise_not_bool", lambda x, i, j, b, d: ~b),
    ("bool_and", lambda x, i, j, b, d: b & (x > 0)),
    ("bool_or", lambda x, i, j, b, d: b | (j > 3)),
    ("logical_and_mixed", lambda x, i, j, b, d: torch.logical_and(x, i)),
    ("where_float_int", lambda x, i, j, b, d: torch.where(b, x, i)),
    ("where_int_float_scalar", lambda x, i, j, b, d: torch.where(b, i, 2.5)),
    ("where_int_int", lambda x, i, j, b, d: torch.where(x > 0, i, j)),
    ("masked_fill_int", lambda x, i, j, b, d: i.masked_fill(b, 7)),
    ("masked_fill_bool", lambda x, i, j, b, d: (x > 0).masked_fill(b, True)),
    ("f32->i32", lambda x, i, j, b, d: (x * 4).to(torch.int32)),
    ("i64->f64", lambda x, i, j, b, d: i.to(torch.float64)),
    ("bool->f32", lambda x, i, j, b, d: b.to(torch.float32)),
    ("f32->bool", lambda x, i, j, b, d: x.to(torch.bool)),
    ("i32->i8", lambda x, i, j, b, d: j.to(torch.int8)),
    ("i64->u8", lambda x, i, j, b, d: i.to(torch.uint8)),
    ("f64->f32", lambda x, i, j, b, d: (d * 3).float()),
    ("type_as", lambda x, i, j, b, d: x.type_as(i)),
]


def test_type_promotion_and_casts():
    g = gen(3)
    x, i, b = rand((3, 17), g), rand((3, 17), g, torch.int64), rand((3, 17), g, torch.bool)
    j, d = rand((17,), g, torch.int32), rand((17,), g, torch.float64)

    def f(x, i, j, b, d):
        return tuple(fn(x, i, j, b, d) for _, fn in PROMOTION)

    compiled = check(f, (x, i, j, b, d), names=[n for n, _ in PROMOTION], **POINTWISE_TOL)
    assert_generated_but_integer_division_by_tensors(compiled)


def assert_generated_but_integer_division_by_tensors(compiled) -> None:
    """assert_all_generated, except integer division / remainder / fmod by a tensor: torch runs those (it raises
    ZeroDivisionError for a 0 divisor, where the generated C division killed the process; docs/robustness.md)."""
    why = executor(compiled).lowering.why_torch
    assert all("integer division by a tensor" in w for w in why.values()), why
    runs = [s.node.op for s in steps(compiled, "run")]
    assert runs and all(op.split(".")[1] in ("div", "remainder", "fmod") for op in runs), runs
    assert report(compiled)["fallback_ops"] == []


def test_negative_integer_division_and_modulo():
    """Floor division and remainder round towards -inf, fmod and trunc division towards 0 (like torch)."""
    g = gen(4)
    i = torch.randint(-20, 21, (3, 17), generator=g)
    j = rand((17,), g, torch.int64)

    def f(i, j):
        return i // j, i % j, torch.fmod(i, j), torch.div(i, j, rounding_mode="trunc"), i // -4, i % 3

    compiled = check(f, (i, j), rtol=0, atol=0)
    assert_generated_but_integer_division_by_tensors(compiled)
    assert len(steps(compiled, "run")) == 4  # i // -4 and i % 3 are generated


# ---------------------------------------------------------------------------
# creation ops, as operands (recomputed inside their reader's kernel) and as results
def test_creation_ops():
    g = gen(5)
    x = rand((3, 17), g)

    def f(x):
        return (
            x + torch.full((17,), 2.5),
            x * torch.arange(17),
            x + torch.arange(1, 35, 2, dtype=torch.float32),
            x + torch.arange(0, 1.7, 0.1),
            torch.arange(10, -7, -1) * 2,
            x + torch.scalar_tensor(3.0),
            torch.ones_like(x) + x,
            torch.zeros(3, 17, dtype=torch.int64) + 1,
            x.new_full((3, 17), 4.0) - x,
            torch.full((3, 17), True) & (x > 0),
            torch.full((4,), -1.25),
            torch.arange(5),
            torch.scalar_tensor(4, dtype=torch.int64),
        )

    compiled = check(f, (x,), **POINTWISE_TOL)
    assert_all_generated(compiled)
    # a creation op loads nothing: it is recomputed inside the kernel that reads it, never stored
    assert len(kernels(compiled)) == 13


# ---------------------------------------------------------------------------
# fusion: a chain of pointwise ops over operands of four ranks is one kernel reading only the inputs
def test_pointwise_chain_is_one_kernel():
    g = gen(6)
    x, w, b = rand((17, 3, 127), g), rand((127,), g), rand((3, 1), g)
    s, i = rand((), g), rand((1, 127), g, torch.int64)

    def f(x, w, b, s, i):
        y = torch.where(x > 0, torch.exp(x * w) + b, -x) * torch.sigmoid(s)
        y = y.masked_fill(i > 3, 0.5) + i
        return torch.tanh(y.to(torch.float64) * 0.5).float() - (x / 2).clamp(-0.2, 0.2)

    compiled = check(f, (x, w, b, s, i), **POINTWISE_TOL)
    assert_all_generated(compiled)
    (k,) = kernels(compiled)
    assert data_reads(compiled, k) == graph_input_names(compiled)


def test_pointwise_value_read_by_two_kernels_is_stored_once():
    """A pointwise value with two kernel readers is computed once (its own kernel), not inlined twice."""
    g = gen(7)
    x = rand((3, 127), g)

    def f(x):
        e = torch.exp(x * 0.5)
        return e.sum(-1), e.amax(0)

    compiled = check(f, (x,), **ROW_TOL)
    assert_all_generated(compiled)
    assert len(kernels(compiled)) == 3


# ---------------------------------------------------------------------------
# input layouts: non-contiguous and 0-d tensors
def _layout_fn(x, y, z, s):
    return (x + y * z - s, torch.softmax(x * y, -1), (x + z).sum(0), F.layer_norm(y, (17,)),
            x.amax(-1) * s, torch.exp(s), (s > 0) & (z > 0))


def _layout_inputs():
    g = gen(8)
    x = rand((17, 3), g).t()  # transposed
    y = rand((3, 51), g)[:, ::3]  # sliced with a step
    z = rand((17,), g).expand(3, 17)  # expanded (stride 0)
    s = rand((), g)  # 0-d
    assert not x.is_contiguous() and not y.is_contiguous() and z.stride() == (0, 1)
    return x, y, z, s


def test_noncontiguous_and_0d_inputs():
    inputs = _layout_inputs()
    compiled = check(_layout_fn, inputs, **ROW_TOL)
    assert_all_generated(compiled)


def test_compiled_for_contiguous_called_with_noncontiguous():
    inputs = _layout_inputs()
    compiled = compile_cpu(_layout_fn, tuple(t.contiguous() for t in inputs))
    for got, want in zip(compiled(*inputs), _layout_fn(*inputs)):
        torch.testing.assert_close(got, want, **ROW_TOL)


# ---------------------------------------------------------------------------
def test_narrow_integer_arithmetic_wraps_like_torch():
    g = gen(9)
    u = torch.randint(100, 255, (3, 17), generator=g, dtype=torch.uint8)
    v = torch.randint(100, 255, (17,), generator=g, dtype=torch.uint8)
    a = torch.randint(60, 127, (3, 17), generator=g, dtype=torch.int8)
    b, c = rand((3, 17), g, torch.bool), rand((3, 17), g, torch.bool)

    def f(u, v, a, b, c):
        return (
            (u + v) // 2,  # uint8: 200 + 100 wraps to 44 in torch, stays 300 in C
            (a * 2) // 3,  # int8: wraps in torch
            (b + c) == 1,  # bool: True + True is True in torch, 2 in C
            (u - v).float(),  # uint8: wraps to [0, 255] in torch, negative in C
        )

    check(f, (u, v, a, b, c), rtol=0, atol=0, names=["uint8_add", "int8_mul", "bool_add", "uint8_sub"])


def test_why_torch_says_why_a_known_op_runs_through_torch():
    """The other side of assert_all_generated: a known op that a definition rejects is listed, with why."""
    i = torch.randint(1, 5, (4,))
    compiled = check(lambda i: i ** 3, (i,), rtol=0, atol=0)  # integer pow: NotSupported -> torch
    assert [s.node.op for s in steps(compiled, "run")] == ["aten.pow.Tensor_Scalar"]
    why = compiled._first.executor.lowering.why_torch
    assert list(why.values()) == ["integer pow"], why


def test_relu_keeps_negative_zero_and_nan_as_torch_does():
    """torch.relu(-0.0) is -0.0 (1 / relu(x) is then -inf, not inf); a NaN stays NaN."""
    x = torch.tensor([-0.0, 0.0, -1.5, 2.0, float("nan"), -float("inf"), float("inf"), -1e-40] * 4)
    compiled = compile_cpu(lambda a: 1 / torch.relu(a * 1.0), (x,))
    assert_all_generated(compiled)
    torch.testing.assert_close(compiled(x), 1 / torch.relu(x), rtol=0, atol=0, equal_nan=True)


def test_pow_by_small_constants_is_multiplied_out_not_a_libm_call():
    """GPT-2's gelu computes x ** 3: std::pow is a scalar libm call (the omp simd loop stays scalar; ~11 ns an
    element, 4.5 ms of a 7.4 ms GEMM whose A pack computed it).  The exponents torch itself computes without
    pow (2, 3, 0.5, -0.5, -1, -2) are multiplied out in torch's order; 1.5 keeps std::pow."""
    from vtc.codegen.cpp import generate

    g = gen(41)
    x, p = rand((3, 17, 127), g), rand((3, 17, 127), g).abs() + 0.1
    fn = lambda x, p: 0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.044715 * torch.pow(x, 3.0)))) + p ** -0.5 + x ** -2  # noqa: E731
    compiled = check(fn, (x, p), rtol=1e-5, atol=1e-5)
    (k,) = kernels(compiled)
    assert "std::pow" not in generate(k)
    assert "std::pow" in generate(kernels(check(lambda p: p ** 1.5, (p,), **POINTWISE_TOL))[0])
