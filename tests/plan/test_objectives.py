"""Plans made for their backend, objective="memory" (peak within a slowdown) and plan="measured"."""
from __future__ import annotations

import pytest
import torch

import vtc
from vtc.plan import measure
from vtc.plan.memory import peak_of
from vtc.plan.virtualize import plan_all
from vtc.runtime.executor import Executor

from .graphs import capture, cat_read_by_kernel, node, repeat_kv_attention, repeat_kv_inputs, slice_holds_source

TOL = dict(rtol=1e-3, atol=1e-3)  # slice_holds_source sums 1024 products of exp() values in another order


def _slice_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(256, 256, generator=g), torch.randn(256, 1024, generator=g)


def compiled(fn, inputs, **options):
    c = vtc.compile(fn, inputs, **options)
    torch.testing.assert_close(c(*inputs), fn(*inputs), **TOL)
    return c, c._first.plan


def test_plan_is_made_for_the_backend_that_runs_it():
    """A cat read by a generated kernel is virtual on backend="cpu"; on backend="torch" the mul is a torch op
    that needs a buffer: a gather through the mapping would replace the cat's own copy, so it is kept."""
    inputs = (torch.randn(4, 3), torch.randn(4, 5))
    c_cpu, p_cpu = compiled(cat_read_by_kernel, inputs, backend="cpu")
    c_torch, p_torch = compiled(cat_read_by_kernel, inputs, backend="torch")
    cat = node(c_cpu.graph, "cat").name
    assert cat not in p_cpu.kept and [e.fate for e in c_cpu.report.movement] == ["virtual"]
    assert p_torch.kept[cat].startswith("kept physical: not a strided view: a copy kernel realises it for mul")
    assert [e.fate for e in c_torch.report.movement] == ["kept"]
    assert c_cpu.options["plan"] == "greedy"  # the default


def test_memory_objective_makes_virtual_what_latency_keeps():
    """Both repeated keys/values are copied before the first GEMM (the Llama-3 decode pattern): the latency
    plan keeps both clones (each realisation through the mapping is estimated dearer than torch's clone); the
    memory plan reads the values through the mapping at their GEMM instead, so the two copies are never live
    together, for an estimated slowdown within 5%."""
    inputs = repeat_kv_inputs()  # GEMMs through torch (gemm="torch"): no attention kernel reads through the clones
    c_lat, p_lat = compiled(repeat_kv_attention, inputs, gemm="torch")
    c_mem, p_mem = compiled(repeat_kv_attention, inputs, objective="memory", gemm="torch")
    clone, clone_1 = node(c_lat.graph, "clone").name, node(c_lat.graph, "clone", 1).name
    assert set(p_lat.kept) == {clone, clone_1} and set(p_mem.kept) == {clone}
    copy = 2 * 2 * 4 * 64 * 32 * 4  # one repeated tensor: 64 KB
    assert c_lat.report.peak_memory_bytes >= 2 * copy > c_mem.report.peak_memory_bytes
    assert c_mem.report.peak_memory_bytes == c_lat.replan(plan="all").report.peak_memory_bytes
    d = next(d for d in p_mem.decisions if d.op == clone_1 and d.direction == "pull")
    assert d.chosen and d.reason.startswith("made virtual (objective=memory): the latency plan's peak")
    assert p_mem.objective == "memory" and "objective=memory: peak" in p_mem.notes[0]
    # no slowdown allowed: nothing the model prices dearer is taken
    c0, p0 = compiled(repeat_kv_attention, inputs, objective="memory", max_slowdown=0.0, gemm="torch")
    assert set(p0.kept) == {clone, clone_1}


def test_memory_objective_keeps_what_latency_makes_virtual():
    """A slice read last keeps its 256 KB source alive through the GEMM when virtual: the memory plan keeps it
    (a 4 KB copy) so the source dies before the GEMM allocates its result."""
    inputs = _slice_inputs()
    c_lat, p_lat = compiled(slice_holds_source, inputs)
    c_mem, p_mem = compiled(slice_holds_source, inputs, objective="memory")
    s = node(c_lat.graph, "slice").name
    assert s not in p_lat.kept and p_mem.kept[s].startswith("kept physical (objective=memory)")
    x, y = 256 * 256 * 4, 256 * 1024 * 4
    assert c_lat.report.peak_memory_bytes - c_mem.report.peak_memory_bytes == x - 256 * 4 * 4
    assert c_mem.report.peak_memory_bytes >= y
    assert c_mem.replan(plan="none").options["objective"] == "latency"  # the objective is the planners'


def test_memory_objective_options_are_checked():
    f, inputs = cat_read_by_kernel, (torch.randn(4, 3), torch.randn(4, 5))
    with pytest.raises(ValueError, match="objective='speed' is not one of"):
        vtc.compile(f, inputs, objective="speed")
    with pytest.raises(ValueError, match="objective='memory' needs plan='greedy' or 'measured', not plan='all'"):
        vtc.compile(f, inputs, plan="all", objective="memory")
    with pytest.raises(ValueError, match="max_slowdown=-0.1 must be a number >= 0"):
        vtc.compile(f, inputs, objective="memory", max_slowdown=-0.1)


def test_a_view_holds_its_source_until_its_last_reader():
    """Liveness: a zero-copy view shares its source's storage, so the source stays live while the view is read.

    x = a + 1 (64 KB) -> v = x.t() (a view for the GEMM) -> e = b * 2 (64 KB) -> v @ e: x, e and the
    result (64 KB) are live together at the GEMM: 192 KB (the view itself owns nothing).
    """
    def f(a, b):
        x = a + 1.0
        e = b * 2.0
        return x.t() @ e

    g, _ = capture(f, torch.randn(128, 128), torch.randn(128, 128))
    plan = plan_all(g)
    ex = Executor(g, plan, backend="torch")
    assert [s.kind for s in ex.steps] == ["run", "run", "view", "run"]
    assert ex.peak_bytes == 3 * 64 * 1024
    assert peak_of(g, plan, "torch").bytes == ex.peak_bytes
    assert peak_of(g, plan, "cpu").bytes == Executor(g, plan, backend="cpu").peak_bytes == 3 * 64 * 1024


def _one_second_per_measurement(monkeypatch) -> None:
    """The measuring budget's clock (vtc.plan.measure.clock) a fake one on which each measurement of a choice
    (building and timing both variants) takes 1 s, whatever the machine's load."""
    now = [0.0]
    time_pair = measure.time_pair

    def one_second(*args, **kwargs):
        try:
            return time_pair(*args, **kwargs)
        finally:
            now[0] += 1.0

    monkeypatch.setattr(measure, "clock", lambda: now[0])
    monkeypatch.setattr(measure, "time_pair", one_second)


def test_measured_mode_records_measurements_within_the_budget(monkeypatch):
    """plan="measured" times the choices the model is unsure of (non-Type-I reads) and records the measured
    saving; the Type-I ones keep the model's call.  The result is correct whatever the timings say.  The budget
    bounds the measuring: with 1 s per measurement, 2 s measure both uncertain choices, 1 s only the first (the
    budget is on a fake clock: under load a wall-clock 2 s covered one choice)."""
    _one_second_per_measurement(monkeypatch)
    inputs = repeat_kv_inputs()
    c, plan = compiled(repeat_kv_attention, inputs, plan="measured", measure_budget_s=2.0, gemm="torch")
    clones = {node(c.graph, "clone").name, node(c.graph, "clone", 1).name}
    pulls = {d.op: d for d in plan.decisions if d.direction == "pull"}
    assert {op for op, d in pulls.items() if d.measured is not None} == clones
    for op in clones:
        d = pulls[op]
        assert "measured " in d.reason and d.chosen == (d.measured > 0) == (op not in plan.kept)
    assert plan.notes[0].startswith("measured 2 of 2 uncertain choices in 2.0 s (budget 2 s)")
    _, p1 = compiled(repeat_kv_attention, inputs, plan="measured", measure_budget_s=1.0, gemm="torch")
    measured = [d for d in p1.decisions if d.op in clones and d.measured is not None]
    spent = [d for d in p1.decisions if d.op in clones and d.reason.endswith("; not measured (budget spent)")]
    assert len(measured) == len(spent) == 1 and p1.notes[0].startswith("measured 1 of 2 uncertain choices in 1.0 s")
    # no budget: nothing measured; the greedy default measures nothing unless given a budget
    _, p0 = compiled(repeat_kv_attention, inputs, plan="measured", measure_budget_s=0)
    _, pg = compiled(repeat_kv_attention, inputs)
    assert all(d.measured is None for d in p0.decisions + pg.decisions) and not pg.notes


def test_greedy_with_a_budget_measures_only_near_zero_estimates():
    inputs = _slice_inputs()
    c, plan = compiled(slice_holds_source, inputs, plan="greedy", measure_budget_s=1.0)
    measured = [d.op for d in plan.decisions if d.measured is not None]
    assert measured == [node(c.graph, "slice").name]  # +1.8 µs estimated: within 1% of the latency of zero
    with pytest.raises(ValueError, match="measure_budget_s=-1 must be a number >= 0"):
        vtc.compile(slice_holds_source, inputs, measure_budget_s=-1)
