"""The plan cache across re-measurements of provisional machine figures: a warm compile whose process measures the
2-thread figures again keeps the cached plan while they stay within cost.TIMED_SPREAD, and plans again beyond it."""
from __future__ import annotations

import torch

import vtc
from vtc.plan import cache as plan_cache
from vtc.plan import cost

from .test_plan_cache import Heads


def _compile_in_a_new_process(model, x, **options):
    """vtc.compile as a new process does it (machine() read from the file again), checked against eager."""
    cost.machine.cache_clear()
    try:
        compiled = vtc.compile(model, (x,), **options)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        return cost.machine()
    finally:
        cost.machine.cache_clear()


def _busy_machine(tmp_path, monkeypatch, timed: list) -> list:
    """A fresh cache and machine file; each measurement of the 2-thread figures pops ((bandwidth, waited share),
    (GEMM rate, waited share)) from `timed`; the GEMM ratios fixed; returns [time.time()], which the test moves."""
    monkeypatch.setenv("VTC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VTC_MACHINE_FILE", str(tmp_path / "machine.json"))
    monkeypatch.setenv("VTC_NO_MEASURE", "0")
    monkeypatch.setattr(plan_cache, "stats", plan_cache.Counter())
    now = [1000.0]
    monkeypatch.setattr(cost, "_measure_bandwidth", lambda: timed[0][0])
    monkeypatch.setattr(cost, "_measure_gemm", lambda: timed.pop(0)[1])
    monkeypatch.setattr(cost, "_library_ratio_timer", lambda dtype=torch.float32: lambda: 0.9)
    monkeypatch.setattr(cost, "_few_rows_ratio_timer", lambda: lambda: 0.6)
    monkeypatch.setattr(cost.time, "time", lambda: now[0])
    return now


def test_a_warm_compile_keeps_its_plan_across_a_re_measurement_within_the_spread_and_replans_beyond(
        tmp_path, monkeypatch):
    """A machine file measured under load (provisional), a cold compile; a warm compile due to measure again,
    which reads figures 10% faster (still busy: the faster are kept) hits the plan cache; a later one reading
    2x the bandwidth plans again.  Fails before: the exact figures were part of the key, so the first re-measured
    warm compile missed."""
    timed = [((20.0, 0.5), (100.0, 0.5)), ((22.0, 0.5), (110.0, 0.5)), ((40.0, 0.5), (110.0, 0.5))]
    now = _busy_machine(tmp_path, monkeypatch, timed)
    torch.manual_seed(0)
    model, x = Heads().eval(), torch.randn(2, 17, 24)

    m = _compile_in_a_new_process(model, x)
    assert (m.bandwidth_gbs, m.gemm_gflops) == (20.0, 100.0)
    assert plan_cache.stats == {"miss": 1, "store": 1}

    now[0] += cost.REMEASURE_AFTER_S
    m = _compile_in_a_new_process(model, x)
    assert (m.bandwidth_gbs, m.gemm_gflops) == (22.0, 110.0)  # measured again: new figures, within the spread
    assert plan_cache.stats == {"miss": 1, "store": 1, "hit": 1}

    now[0] += 2 * cost.REMEASURE_AFTER_S
    m = _compile_in_a_new_process(model, x)
    assert (m.bandwidth_gbs, m.gemm_gflops) == (40.0, 110.0)  # 2x the bandwidth the plan was made from
    assert plan_cache.stats == {"miss": 2, "store": 2, "hit": 1}
    assert not timed

    m = _compile_in_a_new_process(model, x)  # the new entry, made from 40 GB/s, replaced the old one
    assert plan_cache.stats == {"miss": 2, "store": 2, "hit": 2}


def test_only_a_memory_plan_is_made_again_for_another_gemm_rate(tmp_path, monkeypatch):
    """The GEMM rate prices only the compute nodes, which no saving reads: a latency plan made at 100 GFLOP/s
    stands at 180 (hit), a memory plan (whose latency budget reads it) is made again.  Fails before (both
    missed)."""
    timed = [((20.0, 0.5), (100.0, 0.5)), ((20.0, 0.5), (180.0, 0.5))]
    now = _busy_machine(tmp_path, monkeypatch, timed)
    torch.manual_seed(0)
    model, x = Heads().eval(), torch.randn(2, 17, 24)
    cost.machine.cache_clear()
    try:
        for objective in ("latency", "memory"):
            vtc.compile(model, (x,), objective=objective)
    finally:
        cost.machine.cache_clear()
    assert plan_cache.stats == {"miss": 2, "store": 2}

    now[0] += cost.REMEASURE_AFTER_S
    cost.machine.cache_clear()
    try:
        assert cost.machine().gemm_gflops == 180.0 and not timed
        _compile_in_a_new_process(model, x, objective="latency")
        assert plan_cache.stats == {"miss": 2, "store": 2, "hit": 1}
        _compile_in_a_new_process(model, x, objective="memory")
        assert plan_cache.stats == {"miss": 3, "store": 3, "hit": 1}
    finally:
        cost.machine.cache_clear()


def test_timed_figures_within_the_spread_are_the_same():
    a = {"bandwidth_gbs": 20.0, "gemm_gflops": 100.0}
    assert cost.same_timed_figures(a, {"bandwidth_gbs": 20.0 * cost.TIMED_SPREAD, "gemm_gflops": 100.0 / 1.1})
    assert not cost.same_timed_figures(a, {"bandwidth_gbs": 20.0, "gemm_gflops": 100.0 * cost.TIMED_SPREAD * 1.01})
