"""Accuracy of vecmath.py's exp / sigmoid / SiLU / tanh / GELU / erf in compiled models (session 17's cheaper exp).

Each function is compiled as a model (plan "all") over a dense float32 sweep that runs through its extremes
(+-100, so past exp's overflow at 88.72 and its underflow, with every float near exp's thresholds), and its
error is measured against the float64 function: the maximum absolute error, and the maximum error in ulps of the
float32 nearest the reference (where that is finite and >= 2^-100).  The bounds asserted are what was measured,
rounded up.  Measured (``python -m tests.codegen.test_vecmath_accuracy`` prints the table), vtc / torch 2.13's own
float32 CPU kernels on the same inputs:

    fn        max abs (vtc / torch)   max ulp (vtc / torch)
    exp       (relative only)          0.98 / 0.56
    sigmoid   8.8e-8 / 8.8e-8          2.21 / 2.21
    silu      1.3e-6 / 1.3e-6          2.69 / 2.25   (both at x = -16.68: 1 + e^16.68 rounds)
    tanh      2.4e-7 / 3.1e-8          4.04 / 0.51   (unchanged in session 17)
    erf       3.1e-7 / 3.2e-8          5.21 / 0.66   (unchanged)
    gelu      8.7e-7 / 1.0e-6          (absolute only: its zero crossing)

exp's values are those of the form before session 17 (same polynomial and reduction) except near its underflow,
where it now keeps normal results down to x = -86.99 (it returned 0 from -86).  Special values (+-inf, NaN, +-0,
denormals, +-88, the saturation points) must give torch's values: same NaN / inf positions, same signed zeros,
close values.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from .util import compile_cpu, torch_threads

FNS = {
    "exp": torch.exp,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "tanh": torch.tanh,
    "erf": torch.erf,
    "gelu": F.gelu,
}
# max ulps (of the float32 reference, where it is a normal float) and max absolute error, measured, rounded up
BOUNDS = {"exp": (1.0, None), "sigmoid": (2.5, 1e-7), "silu": (3.0, 1.5e-6), "tanh": (4.5, 3e-7),
          "erf": (5.5, 4e-7), "gelu": (None, 1e-6)}
SPECIAL = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 88.0, -88.0, 88.72, 88.73, 88.9, -86.0, -86.98,
           -86.99, -87.0, -87.33, -87.5, -89.0, -103.0, -104.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.17e-38, -1.17e-38,
           1e-30, -1e-30, 4.0, -4.0, 9.0, -9.0, 9.5, -9.5, 30.0, -30.0, 3.4e38, -3.4e38, 16.7, -16.7, 17.0, -17.0]


def sweep() -> torch.Tensor:
    """float32: 400,001 points over [-100, 100], 200,001 over [-1, 1] and every float near the thresholds."""
    parts = [torch.linspace(-100.0, 100.0, 400_001, dtype=torch.float64).float(),
             torch.linspace(-1.0, 1.0, 200_001, dtype=torch.float64).float()]
    for t in (-87.5, -87.0, -86.0, 88.7):  # runs of consecutive floats around exp's edges
        base = torch.tensor([t], dtype=torch.float32).view(torch.int32)
        parts.append((base + torch.arange(-4000, 4000, dtype=torch.int32)).view(torch.float32))
    return torch.cat(parts)


def ulp_errors(got: torch.Tensor, want64: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max error in ulps of the float32 reference) where the reference is a finite float32 of
    magnitude >= 2^-100: below, silu and sigmoid's float32 forms underflow in their intermediate e^-x (torch's too)."""
    err = (got.double() - want64).abs()
    ref = want64.float()
    ok = torch.isfinite(ref) & torch.isfinite(got) & (ref.abs() >= 2.0 ** -100)
    ulp = (torch.nextafter(ref.abs(), torch.tensor(math.inf)) - ref.abs()).double()
    return err[ok].max().item(), (err[ok] / ulp[ok]).max().item()


@pytest.fixture(scope="module")
def swept():
    x = sweep()
    compiled = compile_cpu(lambda v: tuple(f(v) for f in FNS.values()), (x,))
    got = compiled(x)
    return {name: (g, f(x.double())) for (name, f), g in zip(FNS.items(), got)}


@pytest.mark.parametrize("name", list(BOUNDS))
def test_sweep_error_bounds(swept, name):
    got, want = swept[name]
    assert bool((torch.isfinite(got) == torch.isfinite(want.float())).all()), name
    abs_err, ulps = ulp_errors(got, want)
    max_ulp, max_abs = BOUNDS[name]
    if max_ulp is not None:
        assert ulps <= max_ulp, f"{name}: {ulps:.2f} ulp > {max_ulp}"
    if max_abs is not None:
        assert abs_err <= max_abs, f"{name}: max abs error {abs_err:.3g} > {max_abs}"


def test_exp_relative_error_down_to_its_underflow():
    """Down to x = -86.98 (e^x = 1.7e-38, a normal float) exp is within 2 ulp; below -86.99 it is 0 (torch: a
    denormal below 1.18e-38).  Before session 17 it returned 0 from x = -86 on (e^-86 = 4.4e-38)."""
    x = torch.linspace(-86.98, -80.0, 100_001, dtype=torch.float64).float()
    got = compile_cpu(torch.exp, (x,))(x)
    want = torch.exp(x.double())
    rel = ((got.double() - want).abs() / want).max().item()
    assert rel <= 2.4e-7, rel
    low = torch.linspace(-200.0, -86.995, 10_001).float()
    assert bool((compile_cpu(torch.exp, (low,))(low) == 0).all())


def test_special_values_match_torch():
    x = torch.tensor(SPECIAL * 3)  # 123 elements: the vector loop and its remainder
    compiled = compile_cpu(lambda v: tuple(f(v) for f in FNS.values()), (x,))
    for (name, f), got in zip(FNS.items(), compiled(x)):
        want = f(x)
        if name == "gelu":  # torch's gelu(3.4e38) overflows to inf (its product's order); ours is 3.4e38
            keep = x.abs() < 1e38
            got, want = got[keep], want[keep]
        assert torch.equal(got.isnan(), want.isnan()), f"{name}: NaN at {x[got.isnan() != want.isnan()]}"
        assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()]), name
        torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6 if name == "gelu" else 1e-37, equal_nan=True, msg=name)
        zero = want == 0
        if name != "exp":  # exp: torch's denormals below e^-87.3 are 0 here
            assert torch.equal(got[zero].signbit(), want[zero].signbit()), f"{name}: sign of zero"
    exp = compiled(x)[0]
    assert exp[SPECIAL.index(88.73)].item() == math.inf and exp[SPECIAL.index(-104.0)].item() == 0.0
    assert exp[SPECIAL.index(-87.0)].item() == 0.0 and exp[SPECIAL.index(-86.98)].item() > 1.17e-38


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(1,), (17,), (3, 129), (2, 64, 7, 9)])
def test_compiled_model_against_eager(shape, threads):
    """A model of SiLU, sigmoid, GELU, tanh and exp in a chain with other ops, against eager."""
    g = torch.Generator().manual_seed(sum(shape) + threads)
    x = torch.randn(shape, generator=g) * 6
    x.view(-1)[:: 7] *= 20  # some far out: saturation and exp's overflow

    def fn(v):
        a = F.silu(v) + torch.sigmoid(v * 0.5)
        b = F.gelu(v) * torch.tanh(v - 1.0)
        return a - b, torch.exp(v.clamp(max=80.0) * 0.5) + 1.0, F.silu(v * 0.25).sum(-1)

    with torch_threads(threads):
        compiled = compile_cpu(fn, (x,))
        got = compiled(x)
    for g_, w in zip(got, fn(x)):
        torch.testing.assert_close(g_, w, rtol=3e-6, atol=1e-5)


if __name__ == "__main__":  # the table of the module docstring
    x = sweep()
    compiled = compile_cpu(lambda v: tuple(f(v) for f in FNS.values()), (x,))
    print(f"{'fn':8s} {'vtc abs':>10s} {'vtc ulp':>8s} {'torch abs':>10s} {'torch ulp':>9s}")
    for (name, f), got in zip(FNS.items(), compiled(x)):
        want = f(x.double())
        a, u = ulp_errors(got, want)
        ta, tu = ulp_errors(f(x), want)
        print(f"{name:8s} {a:10.3g} {u:8.2f} {ta:10.3g} {tu:9.2f}")
