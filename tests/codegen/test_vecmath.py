"""The vectorised float math of the generated kernels (vtc/codegen/vecmath.py) and the softmax that
evaluates exp once per element (vtc/codegen/reuse.py).

The error bounds documented in vecmath.py are asserted here against float64 references on dense
sweeps; the ops built on them are compared with torch eager on random inputs of sizes 1, 3, 17,
127 and 4096 with large magnitudes and both signs; and the generated softmax source is checked for
what was optimised (one exp per element, no per-element division).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen.cpp import generate

from .util import POINTWISE_TOL, ROW_TOL, assert_all_generated, check, compile_cpu, gen, kernels

# (name, fn, sweep range, max abs error, max relative error where |reference| >= 1e-30): the bounds of
# vecmath.py's docstring, measured on float32 inputs against the float64 function
SWEEPS = [
    ("exp", torch.exp, (-86.0, 88.7), None, 2.4e-7),
    ("log", torch.log, (0.5, 2.0), 1.2e-7, None),  # near 1; the relative bound elsewhere: test_log_relative_error
    ("erf", torch.erf, (-6.0, 6.0), 6e-7, 6e-7),
    ("tanh", torch.tanh, (-12.0, 12.0), 5e-7, 5e-7),
    ("gelu", F.gelu, (-12.0, 12.0), 2e-6, None),
    ("gelu_pos", lambda x: F.gelu(x.abs()), (0.0, 12.0), None, 6e-7),
    ("sigmoid", torch.sigmoid, (-80.0, 80.0), None, 5e-7),
    ("sin", torch.sin, (-20.0, 20.0), 1.2e-7, None),
    ("cos", torch.cos, (-20.0, 20.0), 1.2e-7, None),
    ("sin_far", torch.sin, (-1e6, 1e6), 1.2e-7, None),  # RoPE angles: a position times a frequency <= 1
    ("cos_far", torch.cos, (-1e6, 1e6), 1.2e-7, None),
]


@pytest.fixture(scope="module")
def swept():
    """Every sweep function compiled once over a dense float32 grid: {name: (got, want in float64)}."""
    x = torch.linspace(-1.0, 1.0, 200_001, dtype=torch.float64)
    grids = {name: (x * (hi - lo) / 2 + (hi + lo) / 2).float() for name, _, (lo, hi), _, _ in SWEEPS}
    fns = [fn for _, fn, _, _, _ in SWEEPS]
    names = [name for name, *_ in SWEEPS]
    compiled = compile_cpu(lambda *xs: tuple(f(v) for f, v in zip(fns, xs)), tuple(grids[n] for n in names))
    got = compiled(*(grids[n] for n in names))
    return {n: (g.double(), f(grids[n].double())) for n, g, f in zip(names, got, fns)}


@pytest.mark.parametrize("name,abs_bound,rel_bound", [(n, a, r) for n, _, _, a, r in SWEEPS])
def test_error_bounds(swept, name, abs_bound, rel_bound):
    got, want = swept[name]
    err = (got - want).abs()
    if abs_bound is not None:
        assert err.max().item() <= abs_bound, f"{name}: max abs error {err.max().item():.3g} > {abs_bound}"
    if rel_bound is not None:
        big = want.abs() >= 1e-30
        rel = (err[big] / want.abs()[big]).max().item()
        assert rel <= rel_bound, f"{name}: max relative error {rel:.3g} > {rel_bound}"


def test_edge_values_exactly():
    """Saturation, overflow, underflow, infinities, NaN and signed zeros give torch's values exactly."""
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 88.72, 88.73, -86.5, -104.0,
                      1e-30, -1e-30, 4.0, -4.0, 9.5, -9.5, 30.0, -30.0, -5.7])
    fns = {"exp": torch.exp, "log": torch.log, "erf": torch.erf, "tanh": torch.tanh, "gelu": F.gelu, "sigmoid": torch.sigmoid,
           "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}
    compiled = compile_cpu(lambda v: tuple(f(v) for f in fns.values()), (x,))
    for (name, f), got in zip(fns.items(), compiled(x)):
        want = f(x)
        same_class = (got.isnan() == want.isnan()) & (got.isinf() == want.isinf())
        assert bool(same_class.all()), f"{name}: {got} vs {want}"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6, equal_nan=True, msg=name)
    exp, log, erf, tanh = compiled(x)[:4]
    assert log[0].item() == float("inf") and log[3].item() == float("-inf") and log[4].item() == float("-inf")
    assert log[1].isnan() and log[10].isnan()  # log(-inf), log(-1e-30): NaN
    assert exp[6].item() == float("inf") and exp[8].item() == 0.0  # e^88.73 overflows, e^-104 underflows
    assert erf[11].item() == 1.0 and erf[12].item() == -1.0 and tanh[13].item() == 1.0  # saturated exactly
    assert torch.signbit(erf[4]) and torch.signbit(tanh[4])  # -0 stays -0


@pytest.mark.parametrize("name", ["sin", "cos", "sin_far", "cos_far"])
def test_sin_cos_relative_error(swept, name):
    """sin / cos: relative error < 2.4e-7 (2 ulp) wherever the result is at least 1e-3 in magnitude."""
    got, want = swept[name]
    big = want.abs() >= 1e-3
    rel = ((got - want).abs()[big] / want.abs()[big]).max().item()
    assert rel <= 2.4e-7, f"{name}: max relative error {rel:.3g}"


def test_sin_cos_edge_values():
    """sin / cos: torch's values at 0, -0 (sin keeps its sign), tiny, large and huge angles (from 2^51 on through
    the table of 2^k mod 2 pi, up to the largest float); NaN for inf and NaN."""
    huge = [2.0 ** 51, -(2.0 ** 51) - 2.0 ** 29, 1e16, -3e20, 7.7e25, 1e30, -3e38, 3.4028235e38, 2.0 ** 104]
    x = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-5, 0.7853982, 1.5707964, 3.1415927, 1e4, -1e4, 16777216.0,
                      1e9, -1e12, 2.0 ** 50, float("inf"), float("-inf"), float("nan")] + huge)
    x = torch.cat([x, torch.rand(200, generator=torch.Generator().manual_seed(3)).mul(80).sub(40).exp2().mul(
        torch.tensor([1.0, -1.0]).repeat(100))])  # magnitudes 2^-40 .. 2^40 ... and the huge ones above
    x = torch.cat([x, torch.rand(100, generator=torch.Generator().manual_seed(4)).mul(76).add(51).exp2()])
    compiled = compile_cpu(lambda v: (torch.sin(v), torch.cos(v)), (x,))
    for got, f in zip(compiled(x), (torch.sin, torch.cos)):
        ok = x.isfinite()
        torch.testing.assert_close(got[ok], f(x[ok]), rtol=3e-7, atol=1.2e-7)
        assert bool(got[~ok].isnan().all()), got
    sin = compiled(x)[0]
    assert torch.signbit(sin[1]) and not torch.signbit(sin[0])


OPS = [
    ("sin", torch.sin),
    ("cos", torch.cos),
    ("gelu", F.gelu),
    ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
    ("erf", torch.erf),
    ("tanh", torch.tanh),
    ("exp", lambda x: torch.exp(x.clamp(max=80))),
    ("sigmoid", torch.sigmoid),
    ("silu", F.silu),
]


@pytest.mark.parametrize("n", [1, 3, 17, 127, 4096])
def test_ops_against_eager(n):
    """Random values of both signs and magnitudes from 1e-3 to 60, every size's vector tail included."""
    g = gen(n)
    x = torch.randn(5, n, generator=g) * torch.logspace(-3, 1.8, 5)[:, None]
    compiled = check(lambda x: tuple(f(x) for _, f in OPS), (x,), names=[name for name, _ in OPS], **POINTWISE_TOL)
    assert_all_generated(compiled)


@pytest.mark.parametrize("n", [1, 3, 17, 127, 4096])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_against_eager(n, log):
    g = gen(100 + n)
    x = torch.randn(6, n, generator=g) * torch.tensor([1e-3, 1.0, 10.0, 100.0, -50.0, 1e3])[:, None]
    x[5, 0] = float("-inf")  # a masked position: exactly 0 after softmax
    fn = (lambda v: torch.log_softmax(v, -1)) if log else (lambda v: torch.softmax(v, -1))
    compiled = check(fn, (x,), **ROW_TOL)
    assert_all_generated(compiled)
    if not log and n > 1:
        assert compiled(x)[5, 0].item() == 0.0


def _body(kernel) -> str:
    src = generate(kernel)
    return src[src.index('extern "C"'):]


def _loops(body: str) -> list[str]:
    """The text of each innermost `for (... r ...)` loop over the reduced index (a sum's loop over full
    vectors of partial sums and its tail loop are two)."""
    return re.findall(r"for \(int64_t r = [^;]*;[^\n]*\n(.*?)\n *\}", body, re.S)


def test_softmax_evaluates_exp_once_per_element():
    """The sum pass stores exp(x - max) into the output; the store pass only scales it (no exp, no division)."""
    x = torch.randn(4, 300, generator=gen(7))
    compiled = check(lambda v: torch.softmax(v, -1), (x,), **ROW_TOL)
    (k,) = kernels(compiled)
    body = _body(k)
    max_loop, *sum_loops, store_loop = _loops(body)  # the sum pass: full vectors of 16, then the tail
    assert body.count("vtc_exp(") == len(sum_loops) == 2, body  # each element goes through one of them
    for sum_loop in sum_loops:
        assert "vtc_exp(" in sum_loop and "b1[" in sum_loop  # computed once, stored
    assert "vtc_exp(" not in store_loop, store_loop
    assert "/" not in store_loop.replace("((float)1 / acc_s)", ""), store_loop  # 1 / sum: once per row


def test_cheap_sum_terms_are_recomputed():
    """layer_norm's terms are arithmetic: storing and reloading them would cost more, so nothing is stored
    by its reduction passes (only the per-element store writes the output)."""
    x = torch.randn(4, 300, generator=gen(8))
    compiled = check(lambda v: F.layer_norm(v, (300,)), (x,), **ROW_TOL)
    k = next(k for k in kernels(compiled) if k.kind == "row")
    body = _body(k)
    reduction_loops = _loops(body)[:-1]
    assert reduction_loops and all("term_" not in loop for loop in reduction_loops), body


def test_float_math_has_no_library_calls_in_loops():
    """gelu, erf, tanh, sin and cos compile to arithmetic (no call to the C library's erff/tanhf/expf/sinf/cosf
    in the source)."""
    x = torch.randn(3, 17, generator=gen(9))
    compiled = compile_cpu(lambda v: (F.gelu(v), torch.erf(v), torch.tanh(v), torch.exp(v), torch.sin(v),
                                      torch.cos(v), torch.log(v.abs())), (x,))
    for k in kernels(compiled):
        body = _body(k)
        assert not re.search(r"std::(erf|tanh|exp|sin|cos|log)\(", body), body


def test_log_relative_error():
    """vtc_log: < 2 ulp relative where |log x| >= 1e-3, from the smallest denormal to FLT_MAX (log-spaced)."""
    x = torch.logspace(-44.5, 38.5, 400_001, dtype=torch.float64).float()
    x = x[torch.isfinite(x) & (x > 0)]
    got, want = compile_cpu(torch.log, (x,))(x).double(), x.double().log()
    big = want.abs() >= 1e-3
    rel = ((got - want).abs()[big] / want.abs()[big]).max().item()
    assert rel <= 2.4e-7, rel
