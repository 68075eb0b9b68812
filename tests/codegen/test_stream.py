"""Streaming (non-temporal) stores of large outputs (``vtc.codegen.stream``), against torch eager.

The threshold is lowered to 0 bytes so that odd small shapes (1, 3, 17, 127) take the streamed loops:
rows shorter than a block, an unaligned head (rows of 17 or 127 floats start at any offset in a line), a
tail, a store into a cat's output at an odd offset, two stores in one loop.  At the real threshold the
generated source of a large output has the streaming store and a small one does not.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.workloads import micro
from vtc.codegen import stream
from vtc.codegen.cpp import generate

from .util import POINTWISE_TOL, ROW_TOL, assert_no_movement, check, gen, kernels, rand

STREAMED = "vtc_stream16(sp0_"


def _sources(compiled) -> list[str]:
    return [generate(k) for k in kernels(compiled)]


def _window_ln(x, w, b):
    bb, h, ww, c = x.shape
    x = x.view(bb, h // 7, 7, ww // 7, 7, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 49, c)
    return F.layer_norm(x, (c,), w, b)


CASES = {  # name: (fn, input shapes, tolerance)
    "add": (lambda x, y: x + y, [(3, 17), (3, 17)], POINTWISE_TOL),
    "transpose_add": (lambda x, y: x.transpose(0, 1) + y, [(127, 33), (33, 127)], POINTWISE_TOL),
    "transpose_add_tiles": (lambda x, y: x.transpose(0, 1) + y, [(37, 53), (53, 37)], POINTWISE_TOL),
    "cat_relu": (lambda a, b: torch.relu(torch.cat((a, b), dim=1)), [(1, 3, 17, 17), (1, 5, 17, 17)], POINTWISE_TOL),
    "roll_add": (lambda x, y: torch.roll(x, shifts=(-3, 1), dims=(1, 2)) + y, [(2, 17, 5, 127), (2, 17, 5, 127)],
                 POINTWISE_TOL),
    "one_row": (lambda x: torch.relu(x.transpose(0, 1)) * 2, [(127, 1)], POINTWISE_TOL),
    "two_outputs": (lambda x: (x * 2, torch.sigmoid(x)), [(17, 127)], POINTWISE_TOL),
    "cat_at_offset_17": (lambda x, y: torch.cat((x + 1, y * 2), dim=-1), [(5, 17), (5, 127)], POINTWISE_TOL),
    "layer_norm_127": (lambda x, w, b: F.layer_norm(x, (127,), w, b), [(17, 127), (127,), (127,)], ROW_TOL),
    "window_ln": (_window_ln, [(1, 14, 21, 17), (17,), (17,)], ROW_TOL),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_stores_match_eager(case, monkeypatch):
    monkeypatch.setattr(stream, "STREAM_MIN_BYTES", 0)
    fn, shapes, tol = CASES[case]
    g = gen(11)
    inputs = tuple(rand(s, g) for s in shapes)
    compiled = check(fn, inputs, **tol)
    assert any(STREAMED in src for src in _sources(compiled)), _sources(compiled)
    assert_no_movement(compiled)


def test_streamed_stores_non_contiguous_inputs(monkeypatch):
    """Strided views as inputs (the runtime passes them contiguous) and the output of a row kernel."""
    monkeypatch.setattr(stream, "STREAM_MIN_BYTES", 0)
    g = gen(12)
    x = rand((17, 254), g)[:, ::2]
    y = rand((127, 17), g).t()
    compiled = check(lambda x, y: torch.softmax(x, -1) * 0 + x * y, (x, y), **ROW_TOL)
    assert any(STREAMED in src for src in _sources(compiled))


def test_streamed_kernels_built_in_one_library(monkeypatch):
    """Several streamed kernels in one translation unit (one compiler job): the streaming helpers are
    defined once (a GEMM + pointwise model failed to build with them defined twice)."""
    from vtc.runtime import cbuild

    monkeypatch.setattr(stream, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(cbuild, "build_jobs", lambda: 1)
    g = gen(14)
    x, y = rand((17, 127), g), rand((127, 17), g)
    compiled = check(lambda x, y: (torch.relu(x.t()) + y, x * 3 - 1, F.layer_norm(x, (127,))), (x, y), **ROW_TOL)
    assert sum(STREAMED in src for src in _sources(compiled)) >= 2, _sources(compiled)


@pytest.mark.parametrize("cols", [127, 33])
def test_two_stores_at_different_alignments(cols, monkeypatch):
    """One loop storing y = x * 2 twice: into its own output (rows of `cols` floats) and, through the cat's
    push mapping, at column 1 of the cat's rows of cols + 1: the two stores are at the same offset within
    a line in some rows only (row i: when i + 1 is a multiple of 16 for 127 columns); those rows stream after a
    common head, the others take the plain loop (checked at run time)."""
    monkeypatch.setattr(stream, "STREAM_MIN_BYTES", 0)
    g = gen(13)
    x = rand((37, cols), g)

    def fn(x):
        y = x * 2
        return torch.cat((x[:, :1] * 3, y), dim=-1), y

    compiled = check(fn, (x,), **POINTWISE_TOL)
    two = [k for k in kernels(compiled) if len(k.stores) == 2]
    assert two and STREAMED in generate(two[0]) and "vtc_stream16(sp1_" in generate(two[0])
    assert_no_movement(compiled)


@pytest.mark.parametrize("mb, streams", [(8, True), (MB_SMALL := 1 / 16, False)])
def test_threshold_on_micro_chains(mb, streams):
    """At the real threshold (1 MB stored): the 8 MB roll -> add and cat -> relu stream, their 64 KB forms do
    not; the index_select -> sum, whose output is 1 KB per MB read, never does."""
    for chain in ("roll_add", "cat_relu", "index_select_sum"):
        fn, _ = micro._CHAINS[chain]
        model, inputs = fn(int(mb * micro.MB) // 4)
        compiled = check(model, inputs, **ROW_TOL)
        src = "".join(_sources(compiled))
        assert (STREAMED in src) == (streams and chain != "index_select_sum"), (chain, mb)
        if STREAMED in src:
            assert "vtc_stream_fence();" in src
