"""A row kernel whose passes read the row through a concat along the reduced dim (Swin's patch merging: four
strided slices joined along C, then a layer norm) computes the row once into ``xs_`` (one loop per piece, no
choice per element) before its passes (vtc.codegen.row_stage, docs/prefill.md: session 16)."""
from __future__ import annotations

import re

import pytest
import torch

import vtc
from vtc.codegen.cpp import generate

from .util import ROW_TOL, gen, kernels, rand, torch_threads


class PatchMerging(torch.nn.Module):
    """transformers' SwinPatchMerging after a residual add: [B, H * W, C] + [B, H * W, C] -> 2 x 2 patches
    joined along C -> LayerNorm(4C) (or, `kind`, a softmax / a sum over the 4C)."""

    def __init__(self, side: int, c: int, g: torch.Generator, kind: str = "layer_norm"):
        super().__init__()
        self.side, self.kind = side, kind
        self.norm = torch.nn.LayerNorm(4 * c)
        with torch.no_grad():
            self.norm.weight.copy_(rand((4 * c,), g))
            self.norm.bias.copy_(rand((4 * c,), g))

    def forward(self, a, b):
        x = (a + b).view(a.shape[0], self.side, self.side, -1)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        x = x.view(a.shape[0], -1, x.shape[-1])
        if self.kind == "softmax":
            return torch.softmax(x, -1)
        if self.kind == "sum_sq":
            return (x * x).sum(-1) + x.sum(-1)
        return self.norm(x)


# (side, channels, batch, threads, kind): 4C = 384 (Swin-T's first merge), 20 and 36 (rows that are not whole
# vectors, pieces of 5 and 9 floats), 1 and 2 threads
CASES = [
    (8, 96, 1, 1, "layer_norm"),
    (6, 5, 2, 2, "layer_norm"),
    (10, 9, 1, 2, "layer_norm"),
    (4, 24, 3, 1, "softmax"),
    (6, 7, 1, 1, "sum_sq"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "side{}_c{}_b{}_t{}_{}".format(*c))
def test_row_read_through_a_concat_is_staged_once(case):
    """The passes read ``xs_[r]`` (before: the four-way piece choice in each of them) and the result matches
    eager.  A softmax (its exp stored by the sum pass, vtc.codegen.reuse) and sums in a kernel of one pass
    each are not staged: they match eager."""
    side, c, b, threads, kind = case
    g = gen(side * 100 + c)
    m = PatchMerging(side, c, g, kind).eval()
    a, y = rand((b, side * side, c), g), rand((b, side * side, c), g)
    with torch_threads(threads):
        comp = vtc.compile(m, (a, y))
        with torch.no_grad():
            got, want = comp(a, y), m(a, y)
    torch.testing.assert_close(got, want, **ROW_TOL)
    srcs = [generate(k) for k in kernels(comp) if k.kind == "row"]
    staged = [s for s in srcs if "ROW_STAGE" in s]
    assert bool(staged) == (kind == "layer_norm"), srcs
    for src in staged:
        assert src.count("xs_[") >= 3, src  # filled, then read by the passes
        fills = re.findall(r"xs_\[(\d+) \+ r\] = ([^;]*);", src)
        assert [int(x) for x, _ in fills] == [i * c for i in range(4)], fills  # one loop per piece
        assert not any("?" in v for _, v in fills), fills  # no piece choice left


def test_row_stage_off_gives_the_same_result():
    """ROW_STAGE = False (the A/B switch): the passes choose the piece per element, as before."""
    from vtc.codegen import row_stage

    g = gen(3)
    m = PatchMerging(6, 12, g).eval()
    a, y = rand((1, 36, 12), g), rand((1, 36, 12), g)
    row_stage.ROW_STAGE = False
    try:
        comp = vtc.compile(m, (a, y))
        with torch.no_grad():
            torch.testing.assert_close(comp(a, y), m(a, y), **ROW_TOL)
        assert not any("ROW_STAGE" in generate(k) for k in kernels(comp))
    finally:
        row_stage.ROW_STAGE = True
