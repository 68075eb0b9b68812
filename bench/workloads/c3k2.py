"""The YOLOv11 C3k2 block, written from Ultralytics' definition (conv -> chunk(2) -> bottlenecks -> cat -> conv).

``Conv`` is conv (no bias) + BatchNorm + SiLU.  ``C3k2`` (a C2f) splits the
output of its first 1x1 conv in two with ``chunk(2)``, feeds the last part
through its inner blocks, concatenates every intermediate and projects with a
1x1 conv.  With ``c3k=True`` (YOLO11 m/l/x and the deeper layers) each inner
block is a ``C3k`` (two 1x1 convs, a chain of 3x3 bottlenecks, concat, 1x1
conv); otherwise a residual 3x3 ``Bottleneck``.  Benchmarked: C3k2(128, 128,
n=1, c3k=True) on a 40x40 map (YOLO11 P4 at 640x640 input).
"""
from __future__ import annotations

import torch
from torch import nn

from . import Workload, randn
from .efficientvit import _randomize_bn


class Conv(nn.Module):
    """Conv2d (same padding, no bias) + BatchNorm + SiLU."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, g: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, groups=g, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    """Two convs with an optional residual."""

    def __init__(self, c1: int, c2: int, shortcut: bool = True, g: int = 1, k=(3, 3), e: float = 0.5):
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, k[0])
        self.cv2 = Conv(c_, c2, k[1], g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C3k(nn.Module):
    """C3 with k x k bottlenecks: cv3(cat(m(cv1(x)), cv2(x)))."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True, g: int = 1, e: float = 0.5, k: int = 3):
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 1)
        self.cv2 = Conv(c1, c_, 1)
        self.cv3 = Conv(2 * c_, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(c_, c_, shortcut, g, k=(k, k), e=1.0) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class C3k2(nn.Module):
    """C2f with C3k or Bottleneck inner blocks: cv2(cat(chunk(cv1(x), 2) + [m_i(...)]))."""

    def __init__(self, c1: int, c2: int, n: int = 1, c3k: bool = False, e: float = 0.5, g: int = 1, shortcut: bool = True):
        super().__init__()
        self.c = int(c2 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1)
        self.cv2 = Conv((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(
            C3k(self.c, self.c, 2, shortcut, g) if c3k else Bottleneck(self.c, self.c, shortcut, g) for _ in range(n))
        _randomize_bn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


def _build(batch: int):
    def build(quick: bool):
        hw = 20 if quick else 40
        return C3k2(128, 128, n=1, c3k=True), (randn(batch, 128, hw, hw),)
    return build


WORKLOADS = [
    Workload("c3k2_b1", "unit", "YOLOv11 C3k2(128, 128, n=1, c3k=True), 40x40, batch 1", _build(1),
             params=dict(batch=1, channels=128, hw=40)),
    Workload("c3k2_b16", "unit", "YOLOv11 C3k2(128, 128, n=1, c3k=True), 40x40, batch 16", _build(16),
             params=dict(batch=16, channels=128, hw=40)),
]
