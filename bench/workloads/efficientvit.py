"""An EfficientViT block (Cai et al., ICCV 2023): lightweight multi-scale linear attention + MBConv.

Written from the paper and its reference code: ``LiteMLA`` makes q/k/v with one
1x1 conv, aggregates multi-scale tokens with a depthwise 5x5 conv followed by a
grouped 1x1 conv, concatenates the scales, and computes ReLU linear attention
per head (reshape -> transpose -> slice q/k/v -> ReLU kernels -> pad v with
ones -> k^T v -> q (k^T v) -> divide by the padded column -> transpose ->
reshape), then a 1x1 projection with BatchNorm.  The block adds it to its input
and follows with an MBConv (1x1 expand, 3x3 depthwise, 1x1 project; BN,
Hardswish) residual, as in EfficientViT-B1 stage 3 (128 channels, head dim 16,
expand 4), here on a 28x28 map.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import Workload, randn


def _conv(cin: int, cout: int, k: int = 1, groups: int = 1, bn: bool = True, act: type | None = None) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=not bn)]
    if bn:
        layers.append(nn.BatchNorm2d(cout))
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


def _randomize_bn(m: nn.Module) -> None:
    for bn in m.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_mean.normal_(0, 0.1)
            bn.running_var.uniform_(0.5, 1.5)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.normal_(0, 0.1)


class LiteMLA(nn.Module):
    """Multi-scale ReLU linear attention (EfficientViT's LiteMLA)."""

    def __init__(self, channels: int, dim: int = 16, scales: tuple[int, ...] = (5,), eps: float = 1e-15):
        super().__init__()
        heads = channels // dim
        total = heads * dim
        self.dim, self.eps = dim, eps
        self.qkv = _conv(channels, 3 * total, 1, bn=False)
        self.aggreg = nn.ModuleList(
            nn.Sequential(nn.Conv2d(3 * total, 3 * total, s, padding=s // 2, groups=3 * total, bias=False),
                          nn.Conv2d(3 * total, 3 * total, 1, groups=3 * heads, bias=False))
            for s in scales)
        self.proj = _conv(total * (1 + len(scales)), channels, 1)

    def relu_linear_att(self, qkv: torch.Tensor) -> torch.Tensor:
        b, _, h, w = qkv.shape
        qkv = torch.reshape(qkv, (b, -1, 3 * self.dim, h * w)).transpose(-1, -2)
        q, k, v = qkv[..., : self.dim], qkv[..., self.dim: 2 * self.dim], qkv[..., 2 * self.dim:]
        q, k = F.relu(q), F.relu(k)
        v = F.pad(v, (0, 1), mode="constant", value=1.0)
        kv = torch.matmul(k.transpose(-1, -2), v)
        out = torch.matmul(q, kv)
        out = out[..., :-1] / (out[..., -1:] + self.eps)
        return torch.reshape(out.transpose(-1, -2), (b, -1, h, w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        qkv = torch.cat([qkv, *(op(qkv) for op in self.aggreg)], dim=1)
        return self.proj(self.relu_linear_att(qkv))


class MBConv(nn.Module):
    """Inverted residual: 1x1 expand, 3x3 depthwise, 1x1 project."""

    def __init__(self, channels: int, expand: int = 4):
        super().__init__()
        mid = channels * expand
        self.inverted = _conv(channels, mid, 1, act=nn.Hardswish)
        self.depth = _conv(mid, mid, 3, groups=mid, act=nn.Hardswish)
        self.point = _conv(mid, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.point(self.depth(self.inverted(x)))


class EfficientViTBlock(nn.Module):
    """x + LiteMLA(x), then + MBConv(.)."""

    def __init__(self, channels: int = 128, dim: int = 16, expand: int = 4):
        super().__init__()
        self.context = LiteMLA(channels, dim)
        self.local = MBConv(channels, expand)
        _randomize_bn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.context(x)
        return x + self.local(x)


def _build(batch: int):
    def build(quick: bool):
        hw = 14 if quick else 28
        return EfficientViTBlock(128, 16, 4), (randn(batch, 128, hw, hw),)
    return build


_CFG = "128 channels, head dim 16, scale 5, MBConv expand 4, 28x28"
_ONNX_NOTE = ("torch 2.13's ONNX exporter (default optimize=True) drops the `+ 1e-15` of the attention denominator; "
              "a token whose ReLU(q) is all zero then gives 0/0 = NaN in ONNX Runtime and OpenVINO (happens at batch 16)")
WORKLOADS = [
    Workload("efficientvit_b1", "unit", f"EfficientViT block (LiteMLA + MBConv), batch 1 ({_CFG})", _build(1),
             notes=_ONNX_NOTE, params=dict(batch=1, channels=128, hw=28)),
    Workload("efficientvit_b16", "unit", f"EfficientViT block (LiteMLA + MBConv), batch 16 ({_CFG})", _build(16),
             notes=_ONNX_NOTE, params=dict(batch=16, channels=128, hw=28)),
]
