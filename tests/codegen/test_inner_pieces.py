"""A pointwise kernel whose piece choices depend on the inner index alone runs its inner loop as one loop per
range of that index over which every such choice is decided (``vtc.codegen.cpp.INNER_PIECES``,
``kernel_ir.decided_ranges``): RoPE's rotate_half (``d < D / 2 ? -x[d + D / 2] : x[d - D / 2]``) as two loops
without a branch, a pad along the last dim as three, the ranges of a row one after another; in float32 only
where every range is at least ``MIN_INNER_PIECE`` long (gcc vectorises its one loop with the choice).

Against eager on random inputs in float32 and float16 (eager rounds every float16 op's result, as the kernel
does: within one float16 unit of eager's), head dims 1, 3, 17, 64, 127.  The form checks (``_pieces``) fail on
the code before (one loop holding the choice); the gather case failed to compile with the split before its
index temps were scoped per loop nest (``_pointwise_kernel`` clears them).
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen import cpp
from vtc.codegen.cpp import generate

from .util import POINTWISE_TOL, assert_all_generated, check, gen, kernels, rand

TOL = {torch.float32: POINTWISE_TOL, torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _src(compiled) -> str:
    (k,) = [k for k in kernels(compiled) if k.kind == "pointwise"]
    return generate(k).split('extern "C" void')[-1]


def _pieces(src: str, n: int) -> bool:
    """The kernel runs its rows' inner index as `n` loops, none of them holding a choice (no ternary)."""
    return cpp.INNER_PIECES_MARK in src and src.count("#pragma omp simd") == n and not _choices(src)


def _choices(src: str) -> list[str]:
    """The stores whose value holds a choice."""
    return [line for line in src.splitlines() if "] = " in line and "?" in line]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("d", [1, 3, 17, 64, 127])
def test_rope_runs_one_loop_per_half(d, dtype):
    g = gen(d)
    x = rand((1, 2, 9, d), g, dtype)
    cos, sin = rand((1, 1, 9, d), g, dtype), rand((1, 1, 9, d), g, dtype)
    compiled = check(rope, (x, cos, sin), **TOL[dtype])
    assert_all_generated(compiled)
    src = _src(compiled)
    if d > 1 and (dtype == torch.float16 or d // 2 >= cpp.MIN_INNER_PIECE):  # d = 1: no choice (one half)
        assert _pieces(src, 2), src
    else:
        assert cpp.INNER_PIECES_MARK not in src, src


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rope_on_permuted_heads(dtype):
    """q as a projection's output viewed [B, S, H, D] and transposed to [B, H, S, D] (llama's)."""
    g = gen(5)
    x = rand((1, 9, 4, 64), g, dtype)
    cos, sin = rand((1, 1, 9, 64), g, dtype), rand((1, 1, 9, 64), g, dtype)
    compiled = check(lambda x, c, s: rope(x.transpose(1, 2), c, s), (x, cos, sin), **TOL[dtype])
    assert _pieces(_src(compiled), 2), _src(compiled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_pad_of_the_last_dim_runs_three_loops(dtype):
    g = gen(6)
    x, y = rand((3, 17, 127), g, dtype), rand((3, 17, 160), g, dtype)
    compiled = check(lambda x, y: torch.nn.functional.pad(x, (16, 17)) * y, (x, y), **TOL[dtype])
    assert _pieces(_src(compiled), 3), _src(compiled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_short_ranges_split_in_float16_only(dtype):
    g = gen(10)
    x, y = rand((300, 3), g, dtype), rand((300, 5), g, dtype)
    src = _src(check(lambda x, y: torch.cat((x, y), dim=-1) * 2, (x, y), **TOL[dtype]))
    if dtype == torch.float16:
        assert _pieces(src, 2), src
    else:
        assert cpp.INNER_PIECES_MARK not in src and _choices(src), src


def test_more_ranges_than_the_limit_keep_one_loop():
    g = gen(7)
    xs = tuple(rand((5, 16), g) for _ in range(cpp.MAX_INNER_PIECES + 1))
    compiled = check(lambda *xs: torch.cat(xs, dim=-1) + 1, xs, **POINTWISE_TOL)
    src = _src(compiled)
    assert cpp.INNER_PIECES_MARK not in src and _choices(src), src


def test_gathered_rows_read_their_index_in_every_piece():
    """The row index of an embedding (read once per row before the inner loop) in both pieces' loops."""
    g = gen(8)
    x, y = rand((11, 16), g), rand((11, 16), g)
    idx = torch.tensor([3, 0, 10, 3, 7])
    embed = torch.nn.functional.embedding
    compiled = check(lambda x, y, i: torch.cat((embed(i, x), -embed(i, y)), dim=-1) * 2, (x, y, idx),
                     **POINTWISE_TOL)
    assert _pieces(_src(compiled), 2), _src(compiled)


def test_switch_off_keeps_one_loop(monkeypatch):
    monkeypatch.setattr(cpp, "INNER_PIECES", False)
    g = gen(9)
    x = rand((1, 2, 9, 64), g, torch.float16)
    cos, sin = rand((1, 1, 9, 64), g, torch.float16), rand((1, 1, 9, 64), g, torch.float16)
    src = _src(check(rope, (x, cos, sin), **TOL[torch.float16]))
    assert cpp.INNER_PIECES_MARK not in src and _choices(src), src
