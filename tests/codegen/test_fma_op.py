"""The kernel IR's fused multiply-add (vtc/codegen/kernel_ir.py ``fma``) is emitted only where a lowering asks for
one (the 16-bit batch norm, tests/codegen/test_pool_low_precision.py); a user's explicit float64 chain
``(x.double() * y.double() + z.double()).float()`` rounds twice, as eager does: the float64 sum, then the float32
result.  The two differ where the float64 sum rounds onto a float32 tie (1 in ~2^29 of random inputs), so the
inputs here are built to land there.  Before the fma was an operation of the IR, cpp.py fused every
``float32(float64 x * y + z)`` of float32 values by a pattern match, and this test failed.
"""
from __future__ import annotations

import torch

from vtc.codegen.cpp import generate

from .util import assert_all_generated, compile_cpu, gen, kernels, rand


def _onto_ties(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 x, y, z whose float64 x * y + z is z + ulp(z) / 2 + a little (under half a float64 ulp), so the
    float64 sum rounds onto the float32 tie z + ulp(z) / 2: rounded again (ties to even), it is z where z's last
    bit is 0, but the exact value, rounded once (a fused multiply-add), is z + ulp(z).

    With z = m * 2^e (m in [1, 2)), x = 2^(e-24) (1 + 2^-12) 2^k, y = (1 - 2^-12 + 2^-24) 2^-k: x * y is exactly
    2^(e-24) (1 + 2^-36) = ulp(z) / 2 + 2^(e-60), and every factor is a float32."""
    e = torch.randint(-8, 9, (n,), generator=g).double()
    k = torch.randint(-6, 7, (n,), generator=g).double()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    m = rand((n,), g, low=1.0, high=2.0).abs().double()
    x = sign * 2.0 ** (e - 24) * (1 + 2.0 ** -12) * 2.0 ** k
    y = (1 - 2.0 ** -12 + 2.0 ** -24) * 2.0 ** -k
    z = sign * m * 2.0 ** e
    assert torch.equal(x.float().double(), x) and torch.equal(y.float().double(), y)
    return x.float(), y.float(), z.float()


def test_explicit_float64_chain_rounds_as_eager():
    g = gen(7)
    tx, ty, tz = _onto_ties(600, g)
    rx, ry, rz = (rand((400,), g) for _ in range(3))  # and ordinary values beside them
    x, y, z = torch.cat([tx, rx]), torch.cat([ty, ry]), torch.cat([tz, rz])
    fn = lambda x, y, z: (x.double() * y.double() + z.double()).float()  # noqa: E731
    want = fn(x, y, z)
    wide = x.double() * y.double() + z.double()
    tie = (wide - want.double()).abs() * 2 == (torch.nextafter(want, want * 2) - want).double().abs()
    assert tie[:600].float().mean() > 0.9  # the built inputs are ties ...
    assert (want[:600] == tz).float().mean() > 0.3  # ... many of them rounded down (a fused multiply-add: up)
    compiled = compile_cpu(fn, (x, y, z))
    assert_all_generated(compiled)
    assert "std::fma(" not in "\n".join(generate(k) for k in kernels(compiled))
    got = compiled(x, y, z)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {want.numel()} differ from eager"
