"""Streaming (non-temporal) stores of large outputs (``vtc.codegen.stream``), against torch eager.

The thresholds (``STREAM_MIN_BYTES``, ``CACHE_BYTES``) are lowered to 0 bytes so that odd small shapes (1, 3,
17, 127) take the streamed loops:
rows shorter than a block, an unaligned head (rows of 17 or 127 floats start at any offset in a line), a
tail, a store into a cat's output at an odd offset, two stores in one loop.  At given cache sizes the
generated source streams exactly when the kernel's working set does not fit in the last-level cache.
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
STAGED = "vtc_stream_row(b"  # the transposed tiles stage a tile's output and stream it row by row


def _streams(src: str) -> bool:
    return STREAMED in src or STAGED in src


def _always(monkeypatch):
    """Every qualifying store streams, whatever its size (the transposed tiles' block form too)."""
    from vtc.codegen import tiles

    monkeypatch.setattr(stream, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(stream, "CACHE_BYTES", 0)
    monkeypatch.setattr(tiles, "STREAM", True)


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
    _always(monkeypatch)
    fn, shapes, tol = CASES[case]
    g = gen(11)
    inputs = tuple(rand(s, g) for s in shapes)
    compiled = check(fn, inputs, **tol)
    assert any(_streams(src) for src in _sources(compiled)), _sources(compiled)
    assert_no_movement(compiled)


def test_streamed_stores_non_contiguous_inputs(monkeypatch):
    """Strided views as inputs (the runtime passes them contiguous) and the output of a row kernel."""
    _always(monkeypatch)
    g = gen(12)
    x = rand((17, 254), g)[:, ::2]
    y = rand((127, 17), g).t()
    compiled = check(lambda x, y: torch.softmax(x, -1) * 0 + x * y, (x, y), **ROW_TOL)
    assert any(STREAMED in src for src in _sources(compiled))


def test_streamed_kernels_built_in_one_library(monkeypatch):
    """Several streamed kernels in one translation unit (one compiler job): the streaming helpers are
    defined once (a GEMM + pointwise model failed to build with them defined twice)."""
    from vtc.runtime import cbuild

    _always(monkeypatch)
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
    _always(monkeypatch)
    g = gen(13)
    x = rand((37, cols), g)

    def fn(x):
        y = x * 2
        return torch.cat((x[:, :1] * 3, y), dim=-1), y

    compiled = check(fn, (x,), **POINTWISE_TOL)
    two = [k for k in kernels(compiled) if len(k.stores) == 2]
    assert two and STREAMED in generate(two[0]) and "vtc_stream16(sp1_" in generate(two[0])
    assert_no_movement(compiled)


MB = 1 << 20


@pytest.mark.parametrize("chain, cache_mb, streams", [
    ("cat_relu", 32, False),  # 8 MB in + 8 MB out = 16 MB: fits a 32 MB cache, plain stores
    ("cat_relu", 12, True),
    ("roll_add", 32, False),  # 16 MB in + 8 MB out = 24 MB
    ("roll_add", 16, True),
    ("transpose_add", 32, False),  # 24 MB, tiles: the block form never streams (tiles.STREAM)
    ("transpose_add", 8, False),
    ("transpose_add", 64, False),
    ("index_select_sum", 4, False),  # 32 KB out: under STREAM_MIN_BYTES whatever the cache
])
def test_threshold_is_the_cache_on_8mb_chains(chain, cache_mb, streams, monkeypatch):
    """The 8 MB micro chains stream exactly when their working set (bytes read + stored) is larger than the
    last-level cache and the output is at least 1 MB (the transposed tiles: never, ``tiles.STREAM``).  With the
    previous rule (every output of 1 MB or more) the cases with streams=False fail."""
    monkeypatch.setattr(stream, "CACHE_BYTES", cache_mb * MB)
    fn, _ = micro._CHAINS[chain]
    model, inputs = fn(8 * micro.MB // 4)
    compiled = check(model, inputs, **ROW_TOL)
    src = "".join(_sources(compiled))
    assert _streams(src) == streams, (chain, cache_mb)
    assert ("vtc_stream_fence();" in src) == streams
    assert_no_movement(compiled)


def test_small_outputs_never_stream(monkeypatch):
    """Below STREAM_MIN_BYTES of output nothing streams, even with no cache at all."""
    monkeypatch.setattr(stream, "CACHE_BYTES", 0)
    for chain in ("roll_add", "cat_relu", "transpose_add"):
        fn, _ = micro._CHAINS[chain]
        model, inputs = fn(micro.MB // 16 // 4)
        compiled = check(model, inputs, **ROW_TOL)
        assert STREAMED not in "".join(_sources(compiled)), chain


def test_working_set_counts_reads_and_stores(monkeypatch):
    """An add of two 3 x 5 x 7 float32 inputs into one output: 3 buffers of 420 bytes; an int64 index read
    counts 8 bytes an element."""
    g = gen(15)
    compiled = check(lambda x, y: x + y, (rand((3, 5, 7), g), rand((3, 5, 7), g)), **POINTWISE_TOL)
    (k,) = kernels(compiled)
    assert stream.working_set_bytes(k) == 3 * 420
    table, idx = rand((17, 9), g), torch.tensor([3, 0, 16, 3], dtype=torch.int64)
    compiled = check(lambda t, i: t.index_select(0, i).sum(-1), (table, idx), **ROW_TOL)
    (k,) = kernels(compiled)
    assert stream.working_set_bytes(k) == 17 * 9 * 4 + 4 * 8 + 4 * 4


def _cache_dir(root, entries):
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return str(root)


def test_machine_cache_bytes_reads_the_last_level(tmp_path):
    root = _cache_dir(tmp_path / "a", [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                       (3, "Unified", "32768K")])
    assert stream.machine_cache_bytes.__wrapped__(root) == 32 << 20
    root = _cache_dir(tmp_path / "b", [(1, "Data", "32K"), (2, "Unified", "2M"), (3, "Instruction", "64K")])
    assert stream.machine_cache_bytes.__wrapped__(root) == 2 << 20  # an instruction cache does not count
    assert stream.machine_cache_bytes.__wrapped__(str(tmp_path / "missing")) is None
    assert stream.machine_cache_bytes.__wrapped__(root, level=2) == 2 << 20
    assert stream.machine_cache_bytes.__wrapped__(root, level=1) == 32 << 10
    assert stream.machine_cache_bytes.__wrapped__(root, level=3) is None  # an instruction cache only


def test_cache_bytes_falls_back(monkeypatch):
    monkeypatch.setattr(stream, "machine_cache_bytes", lambda: None)
    assert stream.cache_bytes() == stream.FALLBACK_CACHE_BYTES
    monkeypatch.setattr(stream, "CACHE_BYTES", 5)
    assert stream.cache_bytes() == 5
