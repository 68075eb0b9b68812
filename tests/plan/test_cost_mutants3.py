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

from vtc.index.expr import eq, floordiv, ge, lt, or_
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
    monkeypatch.setattr(cost, "_library_ratio_timer", lambda dtype=torch.float32: lambda: 0.9)
    monkeypatch.setattr(cost, "_few_rows_ratio_timer", lambda: lambda: 0.6)


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
    """The probe turns row-major positions into indices, dividing by each dim's size: a cat of rows with a size-1
    dim in the middle reads as the same cat without it (cost.py:545, `rest // max(shape, 1)` as `max(shape, 2)`:
    the rows above a size-1 dim are halved)."""
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


def _halves(n: int, split: int) -> Mapping:
    """n positions: a contiguous source up to `split`, then another read at stride 4."""
    (i0,) = out_vars((n,))
    return Mapping((n,), (Piece("a", (i0,), lt(i0, split)), Piece("b", ((i0 - split) * 4,))),
                   {"a": (split,), "b": (4 * (n - split),)})


@pytest.mark.parametrize("n,split,chunk_bytes,lines", [
    (1024, 512, 512 * 4, 32 / 512),  # up to 2 * PROBE positions: the first PROBE only (one run of 512)
    (1536, 512, (512 + 512) / 513 * 4, (32 + 128) / 1024),  # more: also PROBE from the middle (512 runs of 1)
    (4096, 2048, (512 + 512) / 513 * 4, (32 + 128) / 1024),
])
def test_the_probe_samples_the_first_positions_and_as_many_from_the_middle(n, split, chunk_bytes, lines):
    """The probe walks the first PROBE positions and, of more than 2 * PROBE, PROBE from the middle, rounded down
    to a multiple of PROBE (cost.py:565, `min(numel, PROBE)` as `max`: every position; cost.py:567, `numel // 2`
    as `%` or `// 1`, `* k` as `// k`, `> 2 * k` as `>=`, `> 1 * k` or `> 3 * k`: other samples)."""
    a = access(_halves(n, split), 4)
    assert (a.chunk_bytes, a.lines_per_element) == (pytest.approx(chunk_bytes), lines)


def test_library_gemm_speed_counts_a_ratio_at_the_noise_bound_as_the_assumed_one(monkeypatch):
    """A measured ratio exactly LIBRARY_SPEED_NOISE off the assumed one is noise (cost.py:364, `<=` as `<`);
    rates and noise made exact in binary here."""
    from vtc.codegen import gemm

    monkeypatch.setattr(gemm, "TORCH_GFLOPS", gemm.VTC_GFLOPS)
    monkeypatch.setattr(cost, "LIBRARY_SPEED_NOISE", 0.25)
    for ratio, speed in ((1.25, 1.0), (0.75, 1.0), (1.5, 1.5), (0.5, 0.5)):
        m = cost.Machine(bandwidth_gbs=20.0, measured=True, library_gemm_ratio=ratio)
        assert cost.library_gemm_speed(m) == speed, ratio


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


def test_a_probe_window_without_reads_is_skipped_and_one_with_one_read_counts():
    """4096 positions, fills up to 2048 then a contiguous source: the first probe window reads nothing and
    is skipped, the middle one reads one run (cost.py:573 forced False: a run of 1 counted for it; cost.py:574,
    `continue` as `break`: nothing probed).  A first window that reads one element counts its run of 1
    (cost.py:573, `== 0` as `== 1`: skipped)."""
    (i0,) = out_vars((4096,))
    late = Mapping((4096,), (Piece(None, (), lt(i0, 2048), fill=0.0), Piece("x", (i0 - 2048,))), {"x": (2048,)})
    a = access(late, 4)
    assert (a.chunk_bytes, a.lines_per_element) == (512 * 4, 1 / 16)
    once = Mapping((4096,), (Piece("x", (i0,), or_(eq(i0, 0), ge(i0, 2048))), Piece(None, (), fill=0.0)),
                   {"x": (4096,)})
    a = access(once, 4)
    assert (a.chunk_bytes, a.lines_per_element) == ((1 + 512) / 2 * 4, (1 + 32) / 513)


def test_deriving_a_scatter_s_inverse_costs_a_few_torch_calls_per_call():
    """derive(): 30 µs per derived index tensor a mapping loads (an index_copy's inverse), 330 µs more amid a
    graph that evicts the cache, nothing for a mapping of real index tensors only (cost.py:765, `cold` by
    default; 771, `+` as `-`; 772, `is not` as `is`, `*` as `//`)."""
    ic = pull(torch.ops.aten.index_copy.default, Src("x", (6, 4)), 0, Src("idx", (2,), torch.int64),
              Src("s", (2, 4)), out=(6, 4))
    gather = pull(torch.ops.aten.index_select.default, Src("x", (6, 4)), 0, Src("idx", (2,), torch.int64),
                  out=(2, 4))
    assert model.derive(ic) == pytest.approx(30e-6) and model.derive(ic, cold=True) == pytest.approx(360e-6)
    assert model.derive(gather) == model.derive(gather, cold=True) == 0.0


def test_one_thread_runs_torch_on_one_thread_and_restores_the_count():
    """_one_thread (the 1-thread CPU-time figures; cost.py:241, `set_num_threads(1)` as 2)."""
    threads = torch.get_num_threads()
    with cost._one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads


def test_one_thread_s_is_the_fastest_call_on_the_thread_s_cpu_clock(monkeypatch):
    """_one_thread_s: a warm-up call, then the fastest of `runs` timed calls, each its end minus its start on a
    (here, fake) thread CPU clock (cost.py:257, `-` as `+`; 258, `min` as `max`)."""
    clock = iter([0.0, 3.0, 10.0, 12.0, 20.0, 21.0])  # calls of 3, 2 and 1 s
    monkeypatch.setattr(cost.time, "thread_time", lambda: next(clock))
    assert cost._one_thread_s(lambda: None, runs=3) == 1.0


@pytest.mark.parametrize("n,reads,chunk_bytes", [(3, 1, 4.0), (4, 2, 8.0)])
def test_a_probe_window_of_one_or_two_reads(n, reads, chunk_bytes):
    """A pad of a 1- or 2-element tensor reads one run of that many elements, at stride 1 (cost.py:577, `> 1`
    forced True or as `>=`: a window of one read takes the mode of no steps and fails; as `> 2`: two reads are
    counted as one run of 1)."""
    a = access(pull(torch.ops.aten.constant_pad_nd.default, Src("x", (reads,)), [1, n - reads - 1], 0.0,
                    out=(n,)), 4)
    assert (a.chunk_bytes, a.stride, a.lines_per_element) == (chunk_bytes, 1, 1 / reads)


class _SlowFaults(CostModel):
    page_fault_us = 2.5


def test_page_faults_are_priced_per_fresh_page_at_the_model_s_rate():
    """fresh(): pages of 4 KiB rounded up, each at page_fault_us (a subclass's 2.5 µs here: cost.py:781, `*` as
    `//`, equal at the default 1.0)."""
    slow = _SlowFaults(FALLBACK)
    assert slow.fresh((32 << 20) - 1) == 0.0
    assert slow.fresh(32 << 20) == pytest.approx(8192 * 2.5e-6)
    assert slow.fresh((32 << 20) + 1) == pytest.approx(8193 * 2.5e-6)


def test_a_store_through_an_access_costs_its_traffic_beyond_the_dense_write_and_its_index_work():
    """store(): 1000 floats through a strided access (a line per element: 64000 B) cost 60000 B more than
    written in order, plus an index computation and a scalar store per element (cost.py:785, `-` as `+`, `*`
    as `//`, `+` as `-`)."""
    want = 60000 / 10e9 + 1000 * (3 * 0.4 + 0.25) * 1e-9
    assert model.store(1000, 4, STRIDED) == pytest.approx(want, rel=1e-12)


def test_a_node_without_flops_is_priced_by_its_bytes():
    """node(): a pointwise node reads and writes its bytes at the copy bandwidth, plus a call (cost.py:791,
    `if flops` forced True: no flops, no time)."""
    from vtc.frontend.torch_export import export_graph

    g = export_graph(lambda x: x * 2.0, (torch.randn(8, 64),))
    (mul,) = [n for n in g.nodes if n.kind != "movement"]
    assert model.node(mul) == pytest.approx(1e-6 + 2 * 8 * 64 * 4 / 10e9, rel=1e-12)


def test_a_repeated_element_continues_a_contiguous_run():
    """x[i // 2] (no strided view: the probe) steps 0, 1, 0, 1, ...: one run over the whole read (cost.py:580,
    `d != 0` as `d != 1`: every repeat ends a run)."""
    (i0,) = out_vars((64,))
    a = access(Mapping((64,), (Piece("x", (floordiv(i0, 2),)),), {"x": (32,)}), 4)
    assert a.chunk_bytes == 64 * 4


def test_what_libraries_take():
    """library_takes(): a GEMM takes a BLAS layout of an operand but not its bias, which it takes as any view;
    a convolution copies a view that is not dense and takes a dense one (cost.py:801, the matmul test forced
    True, `==` as `!=`, `and` as `or`, `not` dropped; cost.py:805, `is_dense` forced False)."""
    from vtc.frontend.torch_export import export_graph
    from vtc.index.mapping import Strided

    (addmm,) = export_graph(lambda b, x, w: torch.addmm(b, x, w),
                            (torch.randn(8), torch.randn(4, 6), torch.randn(6, 8))).nodes
    bias, x, _ = addmm.inputs
    assert model.library_takes(addmm, bias, Strided("s", 0, (2,)), (8,)) is None  # any view of the bias
    assert model.library_takes(addmm, x, Strided("s", 0, (1, 4)), (4, 6)) is None  # column-major
    assert "copies it anyway" in model.library_takes(addmm, x, Strided("s", 0, (12, 2)), (4, 6))
    (conv,) = export_graph(lambda x, w: torch.nn.functional.conv2d(x, w),
                           (torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3))).nodes
    x = conv.inputs[0]
    assert model.library_takes(conv, x, Strided("s", 0, (192, 64, 8, 1)), (1, 3, 8, 8)) is None  # dense
    assert "contiguous" in model.library_takes(conv, x, Strided("s", 0, (192, 1, 24, 3)), (1, 3, 8, 8))


def test_a_probe_that_reads_nothing():
    """A pad of an empty tensor is all fill: the probe reads nothing, no lines (cost.py:585 forced False: a mean
    over no runs, ZeroDivisionError)."""
    a = access(pull(torch.ops.aten.constant_pad_nd.default, Src("x", (0,)), [2, 2], 0.0, out=(4,)), 4)
    assert (a.chunk_bytes, a.stride, a.lines_per_element) == (4.0, 1, 0.0)


def test_a_library_of_another_category_takes_any_view_and_blas_takes_a_vector_of_stride_one():
    """library_takes(): a reader that is none of conv, attention, pool, norm, fallback, scan takes a view that is
    not dense (cost.py:807 forced True); blas_layout() of a vector or a scalar (cost.py:814 forced False: the
    last two dims of a 1-d shape)."""
    from vtc.frontend.torch_export import export_graph
    from vtc.index.mapping import Strided
    from vtc.plan.cost import blas_layout

    (mul,) = export_graph(lambda x: x * 2.0, (torch.randn(8),)).nodes
    assert model.library_takes(mul, mul.inputs[0], Strided("s", 0, (2,)), (8,)) is None
    assert blas_layout(Strided("s", 0, (1,)), (8,)) and not blas_layout(Strided("s", 0, (2,)), (8,))
    assert blas_layout(Strided("s", 0, (5,)), (1,)) and blas_layout(Strided("s", 0, ()), ())


def test_no_bf16_ratio_is_measured_without_the_bf16_kernel(monkeypatch):
    """Where vtc.codegen.gemm_bf16 cannot run (no AVX512_BF16) the bf16 ratio is 0.0, not measured (cost.py:291
    forced False: a generated bf16 GEMM compiled for a CPU without the instructions)."""
    from vtc.codegen import gemm_bf16

    monkeypatch.setattr(gemm_bf16, "support", lambda: "no AVX512_BF16")
    monkeypatch.setattr(cost, "_cpu_time_ratio", lambda *a: pytest.fail("measured"))
    assert cost._library_ratio_timer(dtype=torch.bfloat16)() == 0.0


@pytest.mark.parametrize("strides,shape,blas", [
    ((15, 5, 1), (2, 3, 5), True),  # row-major
    ((24, 8, 1), (2, 3, 5), True),  # rows padded
    ((15, 4, 1), (2, 3, 5), False),  # rows overlap
    ((15, 1, 3), (2, 3, 5), True),  # column-major
    ((15, 1, 2), (2, 3, 5), False),  # columns overlap
    ((15, 1, 4), (2, 3, 5), True),  # columns padded
    ((5, 0, 1), (2, 1, 5), True),  # one row
    ((10, 3, 1), (2, 2, 5), False),  # two overlapping rows
    ((6, 2, 0), (2, 3, 1), True),  # one column
    ((12, 4, 2), (2, 3, 2), False),  # two columns, neither layout
    ((6, 1, 0), (2, 6, 1), True),
    ((4, 0, 2), (2, 1, 2), True),  # one row read at stride 2: column-major
    ((12, 5, 2), (2, 2, 3), False),  # two rows, neither layout
    ((6, 1, 2), (2, 3, 2), False),  # two overlapping columns
    ((2,), (2,), False),  # a vector of two at stride 2
    ((0, 1), (3, 0), False),  # empty rows that are not laid out
    ((0, 0), (0, 3), False),
])
def test_blas_layout_of_the_last_two_dims(strides, shape, blas):
    """blas_layout(): row- or column-major last two dims, size-1 dims free, padding allowed, overlap not
    (cost.py:815-819, the size-1 and stride tests and the `max` of the 2-d rules; 3-d shapes so that `shape[2]`
    is not `shape[-2]`)."""
    from vtc.index.mapping import Strided
    from vtc.plan.cost import blas_layout

    assert blas_layout(Strided("s", 0, strides), shape) == blas


def test_the_inner_stride_is_that_of_the_last_dim_of_more_than_one_element():
    """_inner() (named in library_takes' reason; cost.py:824-825)."""
    from vtc.index.mapping import Strided

    assert cost._inner(Strided("s", 0, (12, 4, 1)), (2, 3, 4)) == 1
    assert cost._inner(Strided("s", 0, (4, 2, 0)), (3, 2, 1)) == 2
    assert cost._inner(Strided("s", 0, (0, 0)), (1, 1)) == 1
