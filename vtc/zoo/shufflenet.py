"""ShuffleNetV2 (Ma et al., 2018), written from the paper; no torchvision needed.

Layout and parameter counts match the reference implementation
(x1.0 with 1000 classes: 2,278,604 parameters).
"""

from __future__ import annotations

import torch
from torch import nn

WIDTHS = {
    0.5: (24, 48, 96, 192, 1024),
    1.0: (24, 116, 232, 464, 1024),
    1.5: (24, 176, 352, 704, 1024),
    2.0: (24, 244, 488, 976, 2048),
}
REPEATS = (4, 8, 4)

__all__ = ["WIDTHS", "REPEATS", "channel_shuffle", "ShuffleUnit", "ShuffleNetV2", "shufflenet_v2", "unit"]


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Interleave the channels of `groups` equal channel groups (view -> transpose -> view)."""
    n, c, h, w = x.shape
    x = x.view(n, groups, c // groups, h, w).transpose(1, 2).contiguous()
    return x.view(n, c, h, w)


def _conv_bn(inp: int, oup: int, k: int, stride: int = 1, groups: int = 1, relu: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(inp, oup, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(oup)]
    return nn.Sequential(*layers, nn.ReLU()) if relu else nn.Sequential(*layers)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2 unit: channel split (stride 1) or two-branch downsampling (stride 2), concat, shuffle."""

    def __init__(self, inp: int, oup: int, stride: int):
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2, got {stride}")
        if oup % 2 or (stride == 1 and inp != oup):
            raise ValueError(f"bad channels inp={inp} oup={oup} for stride {stride}")
        self.stride = stride
        bf = oup // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                *_conv_bn(inp, inp, 3, stride, groups=inp, relu=False), *_conv_bn(inp, bf, 1)
            )
        else:
            self.branch1 = nn.Sequential()
        self.branch2 = nn.Sequential(
            *_conv_bn(inp if stride > 1 else bf, bf, 1),
            *_conv_bn(bf, bf, 3, stride, groups=bf, relu=False),
            *_conv_bn(bf, bf, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    """ShuffleNetV2: stem conv + maxpool, three stages of ShuffleUnits, 1x1 conv, global pool, fc."""

    def __init__(self, widths=WIDTHS[1.0], repeats=REPEATS, num_classes: int = 1000):
        super().__init__()
        if len(widths) != 5 or len(repeats) != 3:
            raise ValueError("need 5 widths and 3 stage repeats")
        c = widths[0]
        self.conv1 = _conv_bn(3, c, 3, 2)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        stages = []
        for n, oup in zip(repeats, widths[1:4]):
            stages.append(nn.Sequential(ShuffleUnit(c, oup, 2), *(ShuffleUnit(oup, oup, 1) for _ in range(n - 1))))
            c = oup
        self.stage2, self.stage3, self.stage4 = stages
        self.conv5 = _conv_bn(c, widths[4], 1)
        self.fc = nn.Linear(widths[4], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.conv1(x))
        x = self.conv5(self.stage4(self.stage3(self.stage2(x))))
        return self.fc(x.mean([2, 3]))


def shufflenet_v2(width: float = 1.0, num_classes: int = 1000, repeats=REPEATS) -> ShuffleNetV2:
    """Build ShuffleNetV2 at width multiplier 0.5, 1.0, 1.5 or 2.0 (random weights)."""
    if width not in WIDTHS:
        raise ValueError(f"unknown ShuffleNetV2 width {width!r}; valid: {sorted(WIDTHS)}")
    return ShuffleNetV2(WIDTHS[width], tuple(repeats), num_classes)


def unit(channels: int = 116, stride: int = 1, hw: int = 28, batch: int = 1, seed: int = 0):
    """One eval-mode ShuffleUnit and a random NCHW input: (module, (x,)) for benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = ShuffleUnit(channels, channels if stride == 1 else 2 * channels, stride).eval()
    return m, (torch.randn(batch, channels, hw, hw, generator=gen),)
