"""Movement chain -> pointwise / reduction consumer: the micro-benchmark patterns of issue 3 and the read
paths made for them, against torch eager on random inputs of odd sizes (1, 3, 17, 127), non-contiguous.

- every micro-benchmark chain of ``bench/workloads/micro.py`` itself (shrunk), with plan="all": the
  result matches eager and no byte of movement is materialised;
- reductions over a permuted dim read with rows as vector lanes (``vtc.codegen.lanes``): softmax,
  log_softmax, sum, amax, amin, NaN and infinities, lane dims with and without a partial block.
"""
from __future__ import annotations

import pytest
import torch

from bench.workloads import micro
from vtc.codegen.cpp import PRELUDE, generate

from vtc.codegen import lanes, prefetch

from .util import (ROW_TOL, assert_all_generated, assert_no_movement, check, compile_cpu, gathered_prefetches, gen,
                   kernels, rand)

MB = micro.MB


@pytest.mark.parametrize("chain", ["transpose_add", "permute_softmax", "cat_relu", "rope_mul", "roll_add",
                                   "index_select_sum", "window_partition_ln"])
def test_micro_chain_moves_nothing(chain):
    """The benchmark chain as benchmarked (its smallest size, a quarter of 1 MB or less) with plan="all"."""
    fn, _ = micro._CHAINS[chain]
    model, inputs = fn(MB // 16)
    compiled = compile_cpu(model, inputs)
    torch.testing.assert_close(compiled(*inputs), model(*inputs), **ROW_TOL)
    assert compiled.report.to_dict()["materialized_movement_bytes"] == 0, compiled.report
    assert_no_movement(compiled)
    assert_all_generated(compiled)


@pytest.mark.parametrize("mb,expected", [(1, [(prefetch.AHEAD, 3)]), (8, [(prefetch.FAR_AHEAD, 2), (prefetch.AHEAD, 3)])])
def test_index_select_sum_prefetches_big_tables_into_l2(monkeypatch, mb, expected):
    """The benchmark's index_select -> sum: a table larger than a 1 MB L2 (8 MB) has its gathered rows prefetched
    FAR_AHEAD on into L2 (prefetcht1: 64 MB, 1 thread, 8.1-8.6 -> 4.9-5.7 ms; docs/chains.md, session 27) and AHEAD
    on into L1; the 1 MB table AHEAD on into L1 only, as before."""
    monkeypatch.setattr(prefetch, "L2_BYTES", 1 << 20)
    fn, _ = micro._CHAINS["index_select_sum"]
    model, inputs = fn(mb * MB // 4)
    compiled = compile_cpu(model, inputs)
    torch.testing.assert_close(compiled(*inputs), model(*inputs), **ROW_TOL)
    assert gathered_prefetches(compiled) == expected


def _lane_kernels(compiled) -> list[str]:
    return [k.name for k in kernels(compiled) if "accv_" in generate(k)]


@pytest.mark.parametrize("shape", [(3, 17, 8), (127, 5, 17), (2, 33, 16), (1, 3, 4), (17, 1, 127), (5, 9, 4),
                                   (2, 4200, 8)])
def test_softmax_over_permuted_dim_reads_rows_as_lanes(shape):
    """Lane blocks of 8 and 4 rows take 2 and 4 steps of r per vector (lanes.r_unroll; 17 and 9 steps: a
    tail step), 16 rows one; 4200 steps x 8 rows (beyond lanes.TERM_BUFFER) store the exp term in the output, not a
    block buffer."""
    g = gen(3)
    x = rand(shape, g)
    fn = lambda x: torch.softmax(x.permute(2, 0, 1), dim=-1)  # noqa: E731
    compiled = check(fn, (x,), **ROW_TOL)
    assert_no_movement(compiled)
    lane = shape[2] >= 4 and shape[1] > 1  # rows of the softmax step shape[2] apart, neighbours adjacent
    assert bool(_lane_kernels(compiled)) == lane, [generate(k) for k in kernels(compiled)]
    if lane:  # exp(x - max) evaluated once: stored by the sum pass, read back by the store pass
        (src,) = [generate(k).replace(PRELUDE, "") for k in kernels(compiled)]
        assert (f"rr += {16 // shape[2]})" in src) == (shape[2] < 16 and shape[1] >= 16 // shape[2]), src
        assert ("term_buf" in src) == (shape[1] * min(shape[2], 16) <= lanes.TERM_BUFFER), src
        store_pass = src.rsplit("for (int64_t l = 0; l < ln; ++l) {", 1)[1]
        assert "vtc_exp(" in src and "vtc_exp(" not in store_pass and "const float term_ = " in store_pass, src


def test_lanes_softmax_stored_exp_with_infinities_and_nan():
    """The lane kernel's stored exp term on rows with -inf (exp 0), +inf (NaN row) and NaN, and a
    partial lane block (17 rows of lanes: 16 + 1)."""
    g = gen(6)
    x = rand((9, 31, 17), g)
    x[0, 4, 3], x[2, 0, 16], x[5, 30, 0], x[:, 7, 9] = float("-inf"), float("inf"), float("nan"), float("-inf")
    fn = lambda x: torch.softmax(x.permute(2, 0, 1), dim=-1) * 2.0  # noqa: E731
    compiled = check(fn, (x,), **ROW_TOL)
    assert_no_movement(compiled)
    assert _lane_kernels(compiled)


@pytest.mark.parametrize("op", ["sum", "amax", "amin", "log_softmax", "mean"])
@pytest.mark.parametrize("shape", [(5, 127, 17), (5, 37, 8)])  # 8 lanes: 2 steps of r per vector and a tail
def test_reductions_over_permuted_dim(op, shape):
    g = gen(4)
    x = rand(shape, g)
    x[1, 3, 2], x[2, 7, -1], x[4, 0, 0], x[3, -1, 5] = float("nan"), float("inf"), float("-inf"), float("nan")
    f = {"sum": lambda t: t.sum(-1), "amax": lambda t: t.amax(-1), "amin": lambda t: t.amin(-1),
         "log_softmax": lambda t: torch.log_softmax(t, -1), "mean": lambda t: t.mean(-1)}[op]
    fn = lambda x: f(x.permute(0, 2, 1))  # noqa: E731
    compiled = check(fn, (x,), **ROW_TOL)
    assert_no_movement(compiled)
    assert _lane_kernels(compiled), [generate(k) for k in kernels(compiled)]


def test_lanes_on_a_non_contiguous_input_and_a_pointwise_prologue():
    g = gen(5)
    base = rand((17, 40, 19), g)
    x = base[:, 3:36, 1:18]  # non-contiguous input
    fn = lambda x: torch.softmax((x * 2.0 + 1.0).transpose(1, 2), dim=-1)  # noqa: E731
    compiled = check(fn, (x,), **ROW_TOL)
    assert_no_movement(compiled)
    assert _lane_kernels(compiled)


def test_index_check_in_c_raises_like_torch():
    """The C range check (vtc.runtime.checks) passes good indices and leaves every failure to IndexCheck.run."""
    from vtc.index.mapping import IndexCheck
    from vtc.runtime.checks import check_range

    c = IndexCheck("i", 0, 126, "index_select")
    check_range(c, torch.arange(127))
    for bad, value in ((torch.tensor([0, 127, 3]), 127), (torch.tensor([-1]), -1),
                       (torch.tensor([[1, 2], [3, 200]]).t(), 200)):  # the last one non-contiguous
        with pytest.raises(IndexError, match=f"index_select: index {value} is out of range"):
            check_range(c, bad)


@pytest.mark.parametrize("rows", [1, 3, 17, 127])
def test_index_select_sum_checks_its_indices(rows):
    g = gen(6)
    table = rand((rows, 33), g)
    idx = torch.randint(0, rows, (rows + 2,), generator=g)
    fn = lambda t, i: t.index_select(0, i).sum(-1)  # noqa: E731
    compiled = check(fn, (table, idx), **ROW_TOL)
    assert_no_movement(compiled)
    with pytest.raises(IndexError, match=f"index {rows} is out of range"):
        compiled(table, torch.full_like(idx, rows))
