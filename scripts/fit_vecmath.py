"""Fits the rational approximations of erf and tanh used by the generated kernels (vtc/codegen/vecmath.py).

Both functions are odd and saturate at +-1, so each is approximated on [0, c] by

    f(x) ~ x * P(x^2) / Q(x^2),   Q(0) = 1,

with x clamped to [-c, c] (c = 4 for erf, 9 for tanh: beyond, the float result is within an ulp of
+-1).  The fit minimises the largest relative error over a dense grid by Lawson's iteratively
reweighted least squares, each step linearised around the previous denominator (Loeb's method);
the best iterate is kept.  Run it to reproduce the coefficients in vecmath.py:

    python scripts/fit_vecmath.py

The error bounds quoted in vecmath.py are those of the float32 C code with fused multiply-adds
(measured by tests/codegen/test_vecmath.py against float64), not of this float64 fit.
"""
from __future__ import annotations

import math

import numpy as np

SPECS = {  # name: (function, clamp c, numerator terms, denominator terms)
    "erf": (np.vectorize(math.erf), 4.0, 7, 5),
    "tanh": (np.tanh, 9.0, 5, 5),
}


def fit(f, c: float, n_num: int, n_den: int, iters: int = 200) -> tuple[float, np.ndarray, np.ndarray]:
    """(max relative error, numerator coefficients, denominator coefficients), lowest power first."""
    x = np.concatenate([np.linspace(0, c, 20000)[1:], np.geomspace(1e-6, 0.5, 2000)])
    x.sort()
    y = f(x)
    t = x * x
    num = np.stack([x * t ** j for j in range(n_num)], 1)
    den = np.stack([-y * t ** k for k in range(1, n_den)], 1)
    a = np.concatenate([num, den], 1)
    w = np.ones_like(x)
    q_prev = np.ones_like(x)
    best = (math.inf, None, None)
    for _ in range(iters):
        s = np.sqrt(w) / (np.abs(y) * q_prev)
        coef, *_ = np.linalg.lstsq(a * s[:, None], y * s, rcond=None)
        p, q = coef[:n_num], np.concatenate([[1.0], coef[n_num:]])
        q_prev = sum(q[k] * t ** k for k in range(n_den))
        err = (x * sum(p[j] * t ** j for j in range(n_num)) / q_prev - y) / y
        worst = float(np.max(np.abs(err)))
        if worst < best[0]:
            best = (worst, p, q)
        w = np.maximum(w * np.abs(err), 1e-300)
        w /= w.sum()
    return best


def main() -> None:
    for name, (f, c, n_num, n_den) in SPECS.items():
        worst, p, q = fit(f, c, n_num, n_den)
        print(f"{name} on [0, {c}]: max relative error of the float64 fit {worst:.3g}")
        print("  P:", ", ".join(f"{v:.9e}f" for v in p))
        print("  Q:", ", ".join(f"{v:.9e}f" for v in q))


if __name__ == "__main__":
    main()
