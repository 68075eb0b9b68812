"""Movement-chain micro-benchmarks: one movement chain feeding one compute op, at 1 MB, 8 MB and 64 MB.

Each size names the bytes of the tensor that the chain moves (float32).
Chains: transpose -> add, permute -> softmax, cat -> relu, rotate_half
(slice + neg + cat) -> mul (the RoPE expression), roll -> add (Swin's shifted
window), index_select -> sum, window partition (view + permute + reshape) ->
layer_norm; and pure gelu / softmax (and, when named, layer_norm / RMSNorm / argmax)
over rows of 4096 with no movement (the floor: what a compute op costs
alone).  A plain ``vtc bench`` runs every chain at 64 MB and three of them at
1 MB (the others at 1 MB, and the norms, run with ``--workloads all``; the 8 MB
ones, between 1 MB (in cache) and 64 MB (memory bound), run by name, with the
group or ``all``).  ``smoke_transpose_add`` is a 16 KB case for the tests.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import Workload, randn
from .llama3 import rotate_half

MB = 1 << 20


class Fn(nn.Module):
    """A module around a function of tensors (so every exporter sees an nn.Module)."""

    def __init__(self, fn: Callable, name: str, **buffers: torch.Tensor):
        super().__init__()
        self.fn, self.label = fn, name
        for k, v in buffers.items():
            self.register_buffer(k, v)

    def forward(self, *xs):
        return self.fn(self, *xs)


def _transpose_add(n: int):
    side = int(round(n ** 0.5))
    return Fn(lambda m, x, y: x.transpose(0, 1) + y, "transpose_add"), (randn(side, side, seed=1), randn(side, side, seed=2))


def _transpose_relu(n: int):
    side = int(round(n ** 0.5))
    return Fn(lambda m, x, y: torch.relu(x.transpose(0, 1) + y), "transpose_relu"), (
        randn(side, side, seed=1), randn(side, side, seed=2))


def _transpose_where(n: int):
    side = int(round(n ** 0.5))
    return Fn(lambda m, x, y: torch.where(x.transpose(0, 1) > y, x.transpose(0, 1), y * 2), "transpose_where"), (
        randn(side, side, seed=1), randn(side, side, seed=2))


def _permute_softmax(n: int):
    s = 128 if n <= MB // 4 else 1024
    t = n // (8 * s)
    return Fn(lambda m, x: torch.softmax(x.permute(2, 0, 1), dim=-1), "permute_softmax"), (randn(s, t, 8),)


def _cat_relu(n: int):
    hw = 64 if n <= MB // 4 else 256
    c = n // (2 * hw * hw)
    return Fn(lambda m, a, b: torch.relu(torch.cat((a, b), dim=1)), "cat_relu"), (
        randn(1, c, hw, hw, seed=1), randn(1, c, hw, hw, seed=2))


def _rope_mul(n: int):
    h, s = (8, 256) if n <= MB // 4 else (32, 1024) if n <= 8 * MB // 4 else (32, 4096)
    d = n // (h * s)  # 64, 64, 128
    pos = torch.arange(s, dtype=torch.float32)[:, None] / (10000.0 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat((pos, pos), dim=-1)
    return Fn(lambda m, x, cos, sin: x * cos + rotate_half(x) * sin, "rope_mul"), (randn(1, h, s, d), emb.cos(), emb.sin())


def _roll_add(n: int):
    b, hw = (1, 64) if n <= MB // 4 else (2, 128) if n <= 8 * MB // 4 else (16, 128)
    c = n // (b * hw * hw)  # 64 channels
    return Fn(lambda m, x, y: torch.roll(x, shifts=(-3, -3), dims=(1, 2)) + y, "roll_add"), (
        randn(b, hw, hw, c, seed=1), randn(b, hw, hw, c, seed=2))


def _index_select_sum(n: int):
    d = 256
    k = n // d
    idx = torch.randint(0, k, (k,), generator=torch.Generator().manual_seed(5))
    return Fn(lambda m, table, i: table.index_select(0, i).sum(dim=-1), "index_select_sum"), (randn(k, d), idx)


def _window_ln(n: int):
    c, w = 96, 7
    b, hw = (1, 56) if n <= MB // 4 else (max(1, round(n / (112 * 112 * c))), 112)  # 64 MB: 14 images

    def f(m, x):
        bb, h, ww, cc = x.shape
        x = x.view(bb, h // w, w, ww // w, w, cc).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, cc)
        return F.layer_norm(x, (cc,), m.weight, m.bias)

    return Fn(f, "window_partition_ln", weight=1 + 0.1 * randn(c, seed=3), bias=0.1 * randn(c, seed=4)), (randn(b, hw, hw, c),)


def _gelu(n: int):
    return Fn(lambda m, x: F.gelu(x), "gelu"), (randn(n // 4096, 4096),)


def _softmax(n: int):
    return Fn(lambda m, x: torch.softmax(x, dim=-1), "softmax"), (randn(n // 4096, 4096),)


def _layer_norm(n: int):
    return Fn(lambda m, x: F.layer_norm(x, (4096,), m.weight, m.bias), "layer_norm",
              weight=1 + 0.1 * randn(4096, seed=3), bias=0.1 * randn(4096, seed=4)), (randn(n // 4096, 4096),)


def _rms_norm(n: int):
    def f(m, x):  # as Llama's RMSNorm writes it
        return m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    return Fn(f, "rms_norm", weight=1 + 0.1 * randn(4096, seed=3)), (randn(n // 4096, 4096),)


def _argmax(n: int):
    return Fn(lambda m, x: x.argmax(-1), "argmax"), (randn(n // 4096, 4096),)


def _permute_argmax(n: int):
    return Fn(lambda m, x: x.permute(1, 0).argmax(-1), "permute_argmax"), (randn(4096, n // 4096),)


_CHAINS = {
    "transpose_add": (_transpose_add, "transpose -> add"),
    "permute_softmax": (_permute_softmax, "permute -> softmax"),
    "cat_relu": (_cat_relu, "cat -> relu"),
    "rope_mul": (_rope_mul, "rotate_half (slice + neg + cat) -> mul (x*cos + rotate_half(x)*sin)"),
    "roll_add": (_roll_add, "roll -> add"),
    "index_select_sum": (_index_select_sum, "index_select -> sum"),
    "window_partition_ln": (_window_ln, "window partition (view/permute/reshape, window 7) -> layer_norm"),
    "gelu": (_gelu, "gelu over rows of 4096 (no movement)"),
    "softmax": (_softmax, "softmax over rows of 4096 (no movement)"),
    "layer_norm": (_layer_norm, "layer_norm over rows of 4096 (no movement)"),
    "rms_norm": (_rms_norm, "RMSNorm (Llama's) over rows of 4096 (no movement)"),
    "argmax": (_argmax, "argmax over rows of 4096 (no movement)"),
    "permute_argmax": (_permute_argmax, "permute -> argmax over a strided dim of 4096"),
    "transpose_relu": (_transpose_relu, "transpose -> add -> relu (a unary op after the transposed read)"),
    "transpose_where": (_transpose_where, "transpose -> where(x.t() > y, x.t(), 2 y)"),
}
_ASKED = {"layer_norm", "rms_norm", "argmax", "permute_argmax", "transpose_relu", "transpose_where"}  # run only when named (or with --workloads all)
_QUICK = {"transpose_add", "rope_mul", "window_partition_ln"}  # 1 MB ones in a plain run
_QUICKER = {"transpose_add", "rope_mul"}  # 1 MB ones in --quick


def _make(fn: Callable, n: int):
    return lambda quick: fn(n)


WORKLOADS = [
    Workload(f"micro_{name}_{mb}mb", "micro", f"{desc}, {mb} MB", _make(fn, mb * MB // 4),
             in_quick=mb == 1 and name in _QUICKER, default=(mb == 64 or name in _QUICK) and name not in _ASKED,
             params=dict(mbytes=mb))
    for mb in (1, 64) for name, (fn, desc) in _CHAINS.items()
] + [Workload(f"micro_{name}_8mb", "micro", f"{desc}, 8 MB", _make(fn, 8 * MB // 4), default=False,
              params=dict(mbytes=8)) for name, (fn, desc) in _CHAINS.items()
] + [Workload("smoke_transpose_add", "smoke", "transpose -> add, 64x64 (for the tests)", _make(_transpose_add, 64 * 64))]
