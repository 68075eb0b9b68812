"""The dot path's prefetch distance (``gemm.DOT_PF``) is a template argument of each GEMM kernel's
``vtc_dot_cols`` call, not a macro.  Before (session 25) a GEMM kernel's source began with ``#define VTC_DOT_PF
128`` while the GEMM runtime, shared once per translation unit, defined it as 0 where it was not yet defined: in
a unit where a convolution kernel (which includes that runtime without the define) came first, every GEMM of
the unit ran without the prefetch (g++ warned "VTC_DOT_PF redefined" on Swin-T's units; docs/compile_time.md),
so how fast a GEMM ran depended on which kernels shared its unit."""
from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F

from vtc.codegen import gemm
from vtc.codegen.cpp import generate

from .util import compile_cpu, gen, kernels, rand, report


class _ConvThenDot(torch.nn.Module):
    """A convolution and a skinny x @ W^T on a W given at the call (the "dot" path: W's rows read in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(5, 7, 3, padding=1)

    def forward(self, img, x, w):
        return torch.relu(self.conv(img)), F.linear(x, w)


def _compiled(seed: int):
    g = gen(seed)
    mod = _ConvThenDot().eval()
    inputs = (rand((1, 5, 9, 11), g), rand((3, 129), g), rand((17, 129), g))
    c = compile_cpu(mod, inputs, gemm="vtc")
    with torch.no_grad():
        for got, want in zip(c(*inputs), mod(*inputs)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return c


def test_the_prefetch_distance_is_each_call_s_not_the_unit_s():
    c = _compiled(0)
    assert [gm["path"] for gm in report(c)["gemm"] if gm["node"].startswith(("mm", "linear"))] == ["dot"]
    texts = [generate(k) for k in kernels(c)]
    assert len(texts) >= 2 and not any("VTC_DOT_PF" in t for t in texts)
    assert sum(f"vtc_dot_cols<{gemm.DOT_PF}>(" in t for t in texts) == 1


def test_the_knob_reaches_the_call():
    with mock.patch.object(gemm, "DOT_PF", 0):
        c = _compiled(1)
        assert sum("vtc_dot_cols<0>(" in generate(k) for k in kernels(c)) == 1
