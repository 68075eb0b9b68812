"""Constant folding (vtc.ir.fold): values computed from nothing the caller passes or may change."""
from __future__ import annotations

import pytest
import torch

import vtc
from vtc.ir.fold import fold_constants

TOL = dict(rtol=1e-5, atol=1e-5)


class WindowMask(torch.nn.Module):
    """Swin's shifted-window mask (aranges, comparisons, a window partition, a difference, two where) added to
    scores: [windows, 16, 16] from nothing the caller passes."""

    def forward(self, scores):  # scores [4, 16, 16]: 4 windows of 4 x 4 on an 8 x 8 map, shift 2
        h = torch.arange(8)
        region = (h >= 4).long() + (h >= 6).long()
        img = (region[:, None] * 3 + region[None, :]).float()  # [8, 8]
        windows = img.view(2, 4, 2, 4).permute(0, 2, 1, 3).reshape(4, 16)
        mask = windows[:, None, :] - windows[:, :, None]
        mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
        return torch.softmax(scores + mask, dim=-1)


def test_a_mask_computed_from_nothing_is_folded_into_a_constant():
    """Before folding, the planner made the mask virtual and every kernel reading it evaluated its index
    arithmetic (divisions by the window size) per element (Swin-T at 1 thread: attention 8.6 -> 6.9 ms with
    the masks folded)."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(4, 16, 16, generator=g)
    c = vtc.compile(WindowMask(), (scores,))
    assert c.graph.meta["folded_nodes"] >= 10, c.graph
    assert [n.op for n in c.graph.nodes] == ["aten.add.Tensor", "aten._softmax.default"], c.graph
    (mask,) = [v for v in c.graph.consts if v.shape == (4, 16, 16)]
    assert mask.data.abs().max() == 100.0 and (mask.data == 0).any()
    torch.testing.assert_close(c(scores), WindowMask()(scores), **TOL)
    other = torch.randn(4, 16, 16, generator=g)
    torch.testing.assert_close(c(other), WindowMask()(other), **TOL)


class FromBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((5,), 2.0))

    def forward(self, x):
        return x * (self.scale + torch.arange(5))


def test_values_from_a_buffer_follow_an_in_place_change():
    """Folded into a constant copy computed again when the buffer changes (vtc.ir.fold.fold_weight_chains)."""
    m = FromBuffer()
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    c = vtc.compile(m, (x,))
    torch.testing.assert_close(c(x), m(x), **TOL)
    with torch.no_grad():
        m.scale.mul_(3.0)
    torch.testing.assert_close(c(x), m(x), **TOL)


def test_random_values_graph_outputs_and_cheap_index_arithmetic_are_not_folded():
    def fn(x):
        causal = torch.arange(4)[:, None] < torch.arange(4)[None, :]  # a predicate for the kernels: kept
        return x + torch.rand(x.shape) * 0, torch.arange(6) * 2, x[:, :4].masked_fill(causal[:2], 0.0)

    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(3))
    with pytest.warns(vtc.FallbackWarning, match="aten.rand"):  # rand runs through torch
        c = vtc.compile(fn, (x,))
    assert "folded_nodes" not in c.graph.meta, c.graph
    first = c(x)[1]
    first.add_(100)  # the caller owns the returned tensor: the next call is not affected
    torch.testing.assert_close(c(x)[1], torch.arange(6) * 2)
    torch.testing.assert_close(c(x)[2], fn(x)[2])


def test_a_graph_without_foldable_nodes_is_returned_as_it_is():
    c = vtc.compile(lambda x: torch.relu(x) + 1, (torch.randn(4),))
    assert fold_constants(c.graph) is c.graph
