"""RoPE's cos / sin tables are vector code: the loop of a sin / cos kernel vectorises (session 18, helper prefill).

``vtc_sincos_`` (vtc/codegen/vecmath.py) chose its argument for |x| >= 2^51 as
``big ? copysign(mant * table[e - 178], x) : x``; gcc 12 turned the table load and the copysign into a branch,
so every loop calling vtc_sin / vtc_cos stayed scalar (llama3_prefill_b1's k_cos / k_sin: 33 us each for
256 x 64 floats at 1 thread).  The choice is now a blend with a masked load of the factor.
"""
from __future__ import annotations

import re

import pytest
import torch

from vtc.codegen.cpp import generate
from vtc.runtime.cbuild import vectorized_loops

from .util import compile_cpu, gen, kernels

TOL = dict(rtol=3e-7, atol=1.2e-7)  # vecmath.py's bounds for vtc_sin / vtc_cos


def _trig_loops_vectorised(compiled) -> int:
    """Asserts that the innermost loop of every kernel calling vtc_sin / vtc_cos is vectorised; returns how many
    such kernels there are."""
    n = 0
    for k in kernels(compiled):
        src = generate(k)
        lines = src.splitlines()
        calls = [i + 1 for i, line in enumerate(lines) if re.search(r"vtc_(sin|cos)\(", line)
                 and "static inline" not in line]
        if not calls:
            continue
        n += 1
        vec = {int(r.split(":")[1]) for r in vectorized_loops(src)}
        for line in calls:  # the loop header is a line or two above the call
            assert vec & set(range(line - 3, line + 1)), (
                f"{k.name}: the loop at line {line} is not vectorised ({sorted(vec)}):\n" + "\n".join(lines[line - 4:line]))
    return n


@pytest.mark.parametrize("head_dim,theta", [(64, 500000.0), (128, 10000.0), (40, 10000.0)])
def test_rope_tables_are_vector_code(head_dim, theta):
    """transformers' rotary tables: cos / sin of cat(freqs, freqs) for random (not consecutive) positions."""
    g = gen(head_dim)
    pos = torch.randint(0, 200_000, (97,), generator=g)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def fn(p):
        freqs = p.to(torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    compiled = compile_cpu(fn, (pos,))
    for got, want in zip(compiled(pos), fn(pos)):
        torch.testing.assert_close(got, want, **TOL)
    assert _trig_loops_vectorised(compiled) >= 1


def test_sin_cos_of_huge_angles_are_vector_code():
    """The |x| >= 2^51 path (the factor 2^k mod 2 pi from its table) in a vectorised loop, next to ordinary
    angles, zeros and non-finite values."""
    g = gen(5)
    x = torch.cat([torch.randn(300, generator=g) * 30,
                   torch.rand(200, generator=g).mul(76).add(51).exp2() * torch.tensor([1.0, -1.0]).repeat(100),
                   torch.tensor([0.0, -0.0, 2.0 ** 51, -(2.0 ** 51), 3.4028235e38, float("inf"), float("nan")])])
    compiled = compile_cpu(lambda v: (torch.sin(v), torch.cos(v)), (x,))
    ok = x.isfinite()
    for got, f in zip(compiled(x), (torch.sin, torch.cos)):
        torch.testing.assert_close(got[ok], f(x[ok]), **TOL)
        assert bool(got[~ok].isnan().all())
    sin = compiled(x)[0]
    assert torch.signbit(sin[501]) and not torch.signbit(sin[500])  # sin(-0) = -0
    assert _trig_loops_vectorised(compiled) >= 1
