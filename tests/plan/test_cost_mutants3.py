"""Behaviour of the cost model (vtc/plan/cost.py: the machine figures, the probes, the prices of reads, copies and
stores, what libraries take) that tests/plan/test_cost.py, test_robust.py and test_cost_mutants.py did not pin:
found by mutation testing, part 3 (docs/testing.md).  Each test fails with at least one small change to cost.py
(named in its docstring as FILE:LINE at main 501ea38) that those files let pass.  Prices are computed on the
fixed FALLBACK machine; nothing is timed."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from vtc.index.expr import lt
from vtc.index.mapping import Mapping, Piece, out_vars
from vtc.plan import cost
from vtc.plan.cost import BROADCAST, FALLBACK, INDIRECT, VIEW, Access, CostModel, access
from vtc.virtual import movement
from vtc.virtual.movement import Src

model = CostModel(FALLBACK)


def pull(op, *args, out, **kw):
    return movement.pull(op, args, kw, [out])[0]


def test_a_gather_from_a_0d_tensor_is_read_as_a_broadcast():
    """gather from a 0-d self (out[i] = self[], the index tensor only range-checked) loads no index: it is the
    broadcast view the executor hands out (a view step), read as an expand of the same tensor is.  Before, any
    mapping that declared an index tensor was priced as an indirect read (cost.py:480, the part-2 survivor
    `m.index_tensors or any(...)` as `and`; fails before the fix, which dropped `m.index_tensors or`)."""
    gather = access(pull(torch.ops.aten.gather.default, Src("x", ()), 0, Src("idx", (1000,), torch.int64),
                         out=(1000,)), 4)
    expand = access(pull(torch.ops.aten.expand.default, Src("x", ()), [1000], out=(1000,)), 4)
    assert gather.kind == BROADCAST and gather.strided == expand.strided
    assert gather == expand
    assert model.read(1000, 4, gather) == model.read(1000, 4, expand)


def _measure_fakes(monkeypatch, bandwidth_share: float = 0.0):
    """machine() measuring nothing: the 2-thread figures (30 GB/s, 150 GFLOP/s; the bandwidth's waited share
    as given), the GEMM ratios fixed; VTC_NO_MEASURE off."""
    monkeypatch.setenv("VTC_NO_MEASURE", "0")
    monkeypatch.setattr(cost, "_measure_bandwidth", lambda: (30.0, bandwidth_share))
    monkeypatch.setattr(cost, "_measure_gemm", lambda: (150.0, 0.0))
    monkeypatch.setattr(cost, "_measure_library_ratio", lambda dtype=torch.float32: 0.9)
    monkeypatch.setattr(cost, "_measure_few_rows_ratio", lambda: 0.6)


def _fresh_machine() -> cost.Machine:
    cost.machine.cache_clear()
    try:
        return cost.machine()
    finally:
        cost.machine.cache_clear()


def test_the_machine_file_s_folders_are_made_and_a_machine_without_a_file_still_measures(tmp_path, monkeypatch):
    """$VTC_MACHINE_FILE two folders deep that do not exist yet: both are made (cost.py:129 `parents=True` as
    False passed: the tests' files were one folder deep).  Where no machine file can be named (the cache dir
    cannot be made: machine_file() raises OSError) the figures are measured and used, nothing written
    (cost.py:127 `path is not None` forced True crashed on None.parent)."""
    _measure_fakes(monkeypatch)
    path = tmp_path / "a" / "b" / "machine.json"
    monkeypatch.setenv("VTC_MACHINE_FILE", str(path))
    m = _fresh_machine()
    assert (m.measured, m.bandwidth_gbs, m.gemm_gflops) == (True, 30.0, 150.0)
    assert json.loads(path.read_text())["machine"]["bandwidth_gbs"] == 30.0

    def no_file():
        raise OSError("no cache dir")

    monkeypatch.setattr(cost, "machine_file", no_file)
    assert _fresh_machine() == m


def test_a_figure_that_waited_exactly_busy_waited_is_quiet():
    """provisional() is a waited share strictly above BUSY_WAITED (cost.py:143 `>` as `>=`)."""
    quiet = {"waited": {"bandwidth_gbs": cost.BUSY_WAITED, "gemm_gflops": 0.0}}
    busy = {"waited": {"bandwidth_gbs": 0.0, "gemm_gflops": cost.BUSY_WAITED * 1.01}}
    assert not cost.provisional(quiet) and cost.provisional(busy)


def test_a_machine_of_an_unknown_capability_has_16_byte_vectors(monkeypatch):
    """A CPU capability torch names but _VECTOR_BYTES does not know gets 16-byte vectors; AVX512 64
    (cost.py:156, the default 16 as 17 or 15)."""
    _measure_fakes(monkeypatch)
    assert cost._measure({}, "SOME_NEW_ISA")["machine"]["vector_bytes"] == 16
    assert cost._measure({}, "AVX512")["machine"]["vector_bytes"] == 64


def test_a_size_one_dim_inside_the_output_changes_no_probe():
    """The probe turns row-major positions into indices (a size-1 dim's index is always 0): a cat of rows with a
    size-1 dim in the middle reads as the same cat without it (cost.py:544, `max(shape, 1)` as 2: odd rows
    read the next row's elements)."""
    with_one = access(pull(torch.ops.aten.cat.default, [Src("a", (64, 1, 2)), Src("b", (64, 1, 2))], 2,
                           out=(64, 1, 4)), 4)
    plain = access(pull(torch.ops.aten.cat.default, [Src("a", (64, 2)), Src("b", (64, 2))], 1, out=(64, 4)), 4)
    assert with_one == plain
    assert (plain.chunk_bytes, plain.lines_per_element, plain.window_bytes) == (8.0, 1 / 16, 1024.0)


def test_the_probe_counts_only_the_elements_a_source_gives():
    """A pad reads its source where it applies and writes fills elsewhere: the probe's offsets are -1 at the
    fills and dropped (cost.py:546, -1 as 0, 1 or 2: the fills counted as reads of the first elements); a fill
    piece before the source piece does not end the walk over the pieces (cost.py:552, `continue` as `break`)."""
    pad = access(pull(torch.ops.aten.constant_pad_nd.default, Src("x", (8, 4)), [0, 60], 0.0, out=(8, 64)), 4)
    assert (pad.chunk_bytes, pad.lines_per_element) == (128.0, 2 / 32)  # 8 rows of 4 floats: one run, 2 lines
    (i0,) = out_vars((10,))
    fill_first = Mapping((10,), (Piece(None, (), lt(i0, 2), fill=0.0), Piece("x", (i0 - 2,))), {"x": (8,)})
    source_first = pull(torch.ops.aten.constant_pad_nd.default, Src("x", (8,)), [2, 0], 0.0, out=(10,))
    assert access(fill_first, 4) == access(source_first, 4)
    assert (access(fill_first, 4).chunk_bytes, access(fill_first, 4).lines_per_element) == (32.0, 1 / 8)


def test_a_probe_of_one_element_reads_a_share_of_a_line():
    """A gather of one element is itemsize / line of a line per element, as a strided read of one (cost.py:563,
    `numel <= 1` forced False: a whole line per element)."""
    one = access(pull(torch.ops.aten.index_select.default, Src("x", (5,)), 0, Src("idx", (1,), torch.int64),
                      out=(1,)), 4)
    assert (one.kind, one.chunk_bytes, one.stride, one.lines_per_element) == (INDIRECT, 4.0, 1, 4 / 64)
    # two elements are probed: both lie on the source's one line (cost.py:563, `numel <= 1` as `<= 2`)
    two = access(pull(torch.ops.aten.index_select.default, Src("x", (5,)), 0, Src("idx", (2,), torch.int64),
                      out=(2,)), 4)
    assert two.lines_per_element == 1 / 2


def test_the_probe_samples_the_first_positions_and_as_many_from_the_middle():
    """Of 4096 positions the probe walks 0..511 (a contiguous half) and 2048..2559 (a half read at stride 4): one
    run of 512 and 512 runs of 1 (cost.py:565, `min(numel, PROBE)` as `max`: every position; cost.py:567,
    `(numel // 2)` as `%`: the first positions only)."""
    (i0,) = out_vars((4096,))
    m = Mapping((4096,), (Piece("a", (i0,), lt(i0, 2048)), Piece("b", ((i0 - 2048) * 4,))),
                {"a": (2048,), "b": (8192,)})
    a = access(m, 4)
    assert (a.chunk_bytes, a.lines_per_element) == (pytest.approx((512 + 512) / 513 * 4), (32 + 128) / 1024)


BIG = 1 << 30  # source bytes that never fit a cache
GATHER = Access(INDIRECT, 64.0, 5, 0.05, 3, BIG, run_ops=2, run=4)  # 1.5 index ops per element in a loop
STRIDED = Access(VIEW, 64.0, 16, 1.0, 3, BIG, run=4)
ROWS = Access(VIEW, 64.0, 1, 1.0, 3, BIG, run=4)


@pytest.mark.parametrize("acc,generated,threads,traffic,ns", [
    # a generated copy kernel: the read through the access (its loop's index ops, a scalar load off stride 1)
    (GATHER, True, 1, 5000, 1.5 * 0.4 + 0.25),
    (STRIDED, True, 1, 64000, 3 * 0.4 + 0.25),
    # torch's indexing kernels compute every element's offset from the index, hoisting nothing
    (GATHER, False, 1, 5000, 3 * 0.4 + 0.25),
    (GATHER, False, 2, 5000, (3 * 0.4 + 0.25) / 2),
    (GATHER, False, 0, 5000, 3 * 0.4 + 0.25),
    # torch's copy of a strided view walks it without index ops: a scalar load and its scalar loop off stride 1
    (STRIDED, False, 1, 64000, 0.25 + 2.0),
    (STRIDED, False, 2, 64000, (0.25 + 2.0) / 2),
    (STRIDED, False, 0, 64000, 0.25 + 2.0),
    (replace(STRIDED, stride=0), False, 1, 64000, 0.0),
    (ROWS, False, 1, 64000, 0.0),
])
def test_copy_of_1000_floats_by_a_kernel_and_by_torch(acc, generated, threads, traffic, ns):
    """copy(): one call, the 4000 B written, the bytes read, and the per-element work (cost.py:748-762: the
    `generated` default and branch, the indirect branch, its `+`, `*`, `max(threads, 1)`, the `no_index`
    compute, the strided surcharge and its `not in (0, 1)` had no test; test_cost.py priced one dense copy)."""
    model_ = CostModel(replace(FALLBACK, threads=threads))
    want = 1e-6 + 4000 / 10e9 + traffic / 10e9 + 1000 * ns * 1e-9
    assert model_.copy(1000, 4, acc, generated=generated) == pytest.approx(want, rel=1e-12)
    if generated:
        assert model_.copy(1000, 4, acc) == model_.copy(1000, 4, acc, generated=True)


def test_a_share_of_exactly_busy_waited_is_quiet_when_measuring_again(monkeypatch):
    """_measure_timed_again: a figure whose waited share is exactly BUSY_WAITED is quiet, old or new
    (cost.py:184, either `<=` as `<`: a quiet figure lost to a faster busy one), and new figures both exactly at
    it are quiet enough to measure the GEMM ratios again (cost.py:187 `<=` as `<`)."""
    b = cost.BUSY_WAITED
    measured = []
    monkeypatch.setattr(cost, "_measure_bandwidth", lambda: (20.0, 0.5))  # faster, busy: the quiet old one stays
    monkeypatch.setattr(cost, "_measure_gemm", lambda: (100.0, b))  # slower, quiet: replaces the busy old one
    monkeypatch.setattr(cost, "_measure_ratios", lambda: measured.append(1) or {})
    record = {"machine": {"bandwidth_gbs": 10.0, "gemm_gflops": 150.0}, "waited": {"bandwidth_gbs": b,
                                                                                   "gemm_gflops": 0.5},
              "measurements": 1, "measured_at": 0.0}
    again = cost._measure_timed_again(record)
    assert again["machine"] == {"bandwidth_gbs": 10.0, "gemm_gflops": 100.0}
    assert again["waited"] == {"bandwidth_gbs": b, "gemm_gflops": b} and not measured
    monkeypatch.setattr(cost, "_measure_bandwidth", lambda: (20.0, b))
    assert cost._measure_timed_again(record)["machine"]["bandwidth_gbs"] == 20.0 and measured == [1]
