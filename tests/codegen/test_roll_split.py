"""A roll in front of a pointwise kernel split at its wrap point (``vtc.codegen.cpp._wrap_split_kernel``): the
rolled dim's range [0, n) runs as [0, n - s) and [n - s, n), where the read ``(i + s) mod n`` is affine, so
the later dims merge into one long inner loop (roll -> add over [B, H, W, C] rolled along H and W: rows of
(W - s) * C and s * C floats instead of C).  Against eager on sizes 1, 3, 17, 127, negative and positive
shifts, shifts of a multiple of the size, a roll along the last dim, non-contiguous inputs, a streamed output.
The form checks fail on the code before (one loop nest, ``% 64`` in the inner loop's offsets).
The two pieces run row by row in one loop over the rows they share (``cpp.WRAP_ROWS``), two loops one after the
other where they stream; the checks for ``ROWS`` fail on the code before (two loops, ``omp for nowait``).
"""
from __future__ import annotations

import pytest
import torch

from bench.workloads import micro
from vtc.codegen import cpp, stream
from vtc.codegen.cpp import generate

from .util import POINTWISE_TOL, assert_all_generated, assert_no_movement, check, gen, kernels, rand

SPLIT = "#pragma omp for nowait"  # the two pieces as two loops one after the other
ROWS = cpp.WRAP_ROWS_MARK  # the two pieces row by row


def _split(src: str) -> bool:
    """The kernel split at the wrap, row by row (and then not as two loops)."""
    return ROWS in src and SPLIT not in src and src.count("omp parallel") == 1


def _src(compiled) -> str:
    (k,) = kernels(compiled)
    return generate(k)


CASES = [  # shape (B, H, W, C), shifts on dims (1, 2)
    ((1, 17, 17, 3), (-3, -3)),
    ((2, 3, 127, 1), (1, 5)),
    ((1, 127, 3, 17), (2, -1)),
    ((3, 17, 127, 17), (-16, 100)),
    ((1, 1, 17, 127), (0, 3)),
    ((1, 64, 64, 64), (-3, -3)),  # the benchmark's 1 MB shape
]


@pytest.mark.parametrize("shape, shifts", CASES, ids=lambda v: "x".join(map(str, v)))
def test_roll_add_split_at_the_wrap(shape, shifts):
    g = gen(70)
    x, y = rand(shape, g), rand(shape, g)
    compiled = check(lambda x, y: torch.roll(x, shifts=shifts, dims=(1, 2)) + y, (x, y), **POINTWISE_TOL)
    assert_no_movement(compiled)
    assert_all_generated(compiled)
    src = _src(compiled)
    w, c = shape[2], shape[3]
    if shifts[1] % w and 1 < c < cpp.INNER_MERGE_BELOW:  # the W dim wraps and its rows would merge
        assert _split(src), src


def test_roll_along_the_last_dim_reads_contiguous_runs():
    g = gen(71)
    x, y = rand((17, 127), g), rand((17, 127), g)
    compiled = check(lambda x, y: torch.roll(x, 5, dims=-1) * y, (x, y), **POINTWISE_TOL)
    src = _src(compiled)
    assert _split(src) and "% 127" not in src.split('extern "C"')[1], src


def test_shift_of_the_whole_size_and_non_contiguous_inputs():
    """A shift of n (no roll at all) keeps one nest; non-contiguous operands (passed contiguous)."""
    g = gen(72)
    x = rand((2, 19, 33, 8), g)[:, 1:-1]  # [2, 17, 33, 8]
    y = rand((2, 8, 33, 17), g).permute(0, 3, 2, 1)
    compiled = check(lambda x, y: torch.roll(x, shifts=(17, -2), dims=(1, 2)) - y, (x, y), **POINTWISE_TOL)
    assert_no_movement(compiled)
    assert _split(_src(compiled))
    compiled = check(lambda x, y: torch.roll(x, shifts=(17, 33), dims=(1, 2)) - y, (x, y), **POINTWISE_TOL)
    assert SPLIT not in _src(compiled) and ROWS not in _src(compiled)


def test_switch_off_keeps_one_nest(monkeypatch):
    monkeypatch.setattr(cpp, "WRAP_SPLIT", False)
    g = gen(73)
    x, y = rand((1, 17, 17, 3), g), rand((1, 17, 17, 3), g)
    compiled = check(lambda x, y: torch.roll(x, shifts=(-3, -3), dims=(1, 2)) + y, (x, y), **POINTWISE_TOL)
    assert SPLIT not in _src(compiled) and ROWS not in _src(compiled)


@pytest.mark.parametrize("shape, shifts", [((1, 17, 17, 3), (-3, -3)), ((2, 3, 127, 17), (1, -5))],
                         ids=lambda v: "x".join(map(str, v)))
def test_rows_switch_off_keeps_two_loops(shape, shifts, monkeypatch):
    """cpp.WRAP_ROWS off: the pieces as two loops in one parallel region (the form before), still right."""
    monkeypatch.setattr(cpp, "WRAP_ROWS", False)
    g = gen(75)
    x, y = rand(shape, g), rand(shape, g)
    compiled = check(lambda x, y: torch.roll(x, shifts=shifts, dims=(1, 2)) + y, (x, y), **POINTWISE_TOL)
    src = _src(compiled)
    assert SPLIT in src and ROWS not in src, src


def test_rows_with_a_per_row_operand_and_a_permuted_view():
    """Row by row with a broadcast operand (one value per row, hoisted in each piece's block) and an operand
    read through a permute whose inner dim is still contiguous; sizes 1 and 3 among the dims."""
    g = gen(76)
    x = rand((3, 1, 17, 127), g).permute(1, 0, 2, 3)  # [1, 3, 17, 127], not contiguous
    y, s = rand((1, 3, 17, 127), g), rand((1, 3, 1, 1), g)
    compiled = check(lambda x, y, s: torch.roll(x, shifts=(1, -7), dims=(1, 2)) * s + y, (x, y, s), **POINTWISE_TOL)
    assert _split(_src(compiled))


@pytest.mark.parametrize("shape", [(1, 17, 17, 3), (2, 3, 127, 17)], ids=lambda s: "x".join(map(str, s)))
def test_streamed_split(shape, monkeypatch):
    """Streaming on: both nests stream in one parallel region with one fence."""
    monkeypatch.setattr(stream, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(stream, "CACHE_BYTES", 0)
    g = gen(74)
    x, y = rand(shape, g), rand(shape, g)
    compiled = check(lambda x, y: torch.roll(x, shifts=(-3, 2), dims=(1, 2)) + y, (x, y), **POINTWISE_TOL)
    src = _src(compiled)
    assert SPLIT in src and ROWS not in src and src.count("vtc_stream_fence();") == 1, src
    assert src.count("omp parallel") == 1, src


def test_8mb_chain_split_and_virtual():
    fn, _ = micro._CHAINS["roll_add"]
    model, inputs = fn(8 * micro.MB // 4)
    compiled = check(model, inputs, **POINTWISE_TOL)
    assert_no_movement(compiled)
    assert _split(_src(compiled))
