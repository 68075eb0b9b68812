"""Resampling (F.interpolate) through generated kernels, and where their index checks run.

torch.export decomposes a bilinear or bicubic interpolation into index arithmetic: clamped integer
corner indices (``_to_copy`` / ``clamp`` of a float grid) and ``aten.index`` reads of the input at
those corners.  One ``index`` mapping holds several of these index tensors, computed by different
kernels, some of them after a kernel that reads another through the same mapping.  A kernel's range
checks must name only the index tensors it loads (a check on one that is not computed yet ran on an
empty slot and crashed every call: MobileViT's and any bilinear upsampling's).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vtc

from .util import ROW_TOL, case_seed, gen, rand, steps

CASES = [  # (mode, align_corners, input H x W, output size)
    ("bilinear", False, (9, 7), (13, 11)),
    ("bilinear", True, (9, 7), (13, 5)),
    ("bilinear", False, (17, 3), (4, 3)),  # down
    ("bicubic", False, (5, 6), (10, 12)),
    ("bicubic", True, (3, 1), (7, 2)),
    ("nearest", None, (9, 7), (18, 14)),
    ("nearest-exact", None, (9, 7), (5, 4)),
]


def _model(mode: str, align: bool | None, size: tuple[int, int]) -> torch.nn.Module:
    class Resample(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 5, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.interpolate(self.conv(x), size=size, mode=mode, align_corners=align)
            return torch.sigmoid(y) * 2 + y

    return Resample().eval()


@pytest.mark.parametrize("batch,plan", [(1, "greedy"), (16, "all")])
@pytest.mark.parametrize("mode,align,hw,size", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_interpolate_matches_eager(mode, align, hw, size, batch, plan):
    torch.manual_seed(case_seed((mode, align, hw, size, batch)))
    model = _model(mode, align, size)
    x = rand((batch, 3, *hw), gen(case_seed((mode, hw, batch))))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,), plan=plan)
        torch.testing.assert_close(compiled(x), model(x), **ROW_TOL)
        torch.testing.assert_close(compiled(x * 0.5), model(x * 0.5), **ROW_TOL)  # a second call, new values


@pytest.mark.parametrize("plan", ["greedy", "all"])
def test_each_kernel_checks_only_the_index_tensors_it_loads(plan):
    model = _model("bilinear", False, (13, 11))
    x = rand((2, 3, 9, 7), gen(7))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,), plan=plan)
        compiled(x)
    checked = 0
    for s in steps(compiled, "kernel"):
        loaded = {b.name for b in s.kernel.step.kernel.inputs}
        for c in s.kernel.step.checks:
            assert c.tensor in loaded, f"{s.kernel.step.kernel.name} checks {c.tensor}, which it does not load"
            checked += 1
    assert checked > 0, "no kernel checks the corner indices: the interpolation did not read through an index"
