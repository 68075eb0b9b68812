"""A bfloat16 operand read across the rows of a tiled pointwise kernel (``vtc.codegen.low_tiles``): a full 32 x 32
tile is filled by ``vtc_tile_transpose16_bf16`` (four 16 x 16 blocks widened and transposed in vector registers,
``low_tiles.REGISTERS``), edge tiles by the staging loop.  Against eager bit for bit (the chains round as eager
does) on random inputs: sizes below a tile, edge tiles, a batch, a sliced (non-contiguous) operand, a second
transposed operand, NaN and infinities; float16 and the switch off keep the loop.  The form checks fail on the code
before (no ``vtc_tile_transpose16_bf16``).
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen import low_tiles
from vtc.codegen.cpp import generate

from .util import assert_no_movement, compile_cpu, gen, kernels, rand

REGS = "vtc_tile_transpose16_bf16(stage0 + "


def _run(fn, args):
    compiled = compile_cpu(fn, args)
    got, want = compiled(*args), fn(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert compiled.report.to_dict()["materialized_movement_bytes"] == 0
    (k,) = kernels(compiled)
    return generate(k)


@pytest.mark.parametrize("shape", [(1, 17), (3, 127), (17, 127), (127, 17), (32, 32), (33, 65), (40, 513), (2, 64, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_bf16_transposed_chain(shape):
    g = gen(100)
    x, y = rand(shape[:-2] + shape[-2:][::-1], g, torch.bfloat16), rand(shape, g, torch.bfloat16)
    src = _run(lambda x, y: torch.relu(x.transpose(-1, -2) + y) * 2, (x, y))
    assert (REGS in src) == (min(shape[-2:]) > 32), src  # tiles from 33 (cpp: TILE)


def test_sliced_operand_two_transposed_and_specials():
    """x sliced along its rows (a row stride of 70 for 64 used), a second transposed operand, NaN / inf / -0.0
    through the widening."""
    g = gen(101)
    x = rand((2, 96, 70), g, torch.bfloat16)[..., 3:67]
    z = rand((2, 96, 64), g, torch.bfloat16)
    y = rand((2, 64, 96), g, torch.bfloat16)
    x[0, 5, 7], x[1, 40, 33], x[0, 2, 2], z[1, 1, 1] = float("nan"), float("inf"), -0.0, float("-inf")
    src = _run(lambda x, z, y: torch.where(x.transpose(1, 2) > 0, x.transpose(1, 2) * y, z.transpose(1, 2) - y),
               (x, z, y))
    assert REGS in src and "vtc_tile_transpose16_bf16(stage1 + " in src, src


def test_float16_and_the_switch_keep_the_loop(monkeypatch):
    g = gen(102)
    x, y = rand((64, 48), g, torch.float16), rand((48, 64), g, torch.float16)
    src = _run(lambda x, y: x.t() + y, (x, y))
    assert "vtc_tile_transpose16_bf16(" not in src.split('extern "C"')[1] and "stage0[" in src
    xb, yb = x.to(torch.bfloat16), y.to(torch.bfloat16)
    monkeypatch.setattr(low_tiles, "REGISTERS", False)
    src = _run(lambda x, y: x.t() + y, (xb, yb))
    assert "vtc_tile_transpose16_bf16(" not in src.split('extern "C"')[1] and "stage0[" in src


def test_8mb_bf16_chain_same_as_the_loop(monkeypatch):
    """The benchmark's chain (bench/low_tiles_ab.py, 16 x 512 x 256): the same bits with and without registers."""
    g = gen(103)
    x, y = rand((16, 256, 512), g, torch.bfloat16), rand((16, 512, 256), g, torch.bfloat16)
    fn = lambda x, y: torch.relu(x.transpose(1, 2) + y) * 2
    regs = compile_cpu(fn, (x, y))
    assert REGS in generate(kernels(regs)[0])
    assert_no_movement(regs)
    monkeypatch.setattr(low_tiles, "REGISTERS", False)
    loop = compile_cpu(fn, (x, y))
    assert REGS not in generate(kernels(loop)[0])
    assert torch.equal(regs(x, y), loop(x, y)) and torch.equal(regs(x, y), fn(x, y))
