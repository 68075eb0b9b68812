"""Smoke test of the benchmark suite: one tiny workload, eager + vtc-all, three runs, no subprocesses.

Runs `vtc bench` through the CLI (the command added to ``COMMANDS`` here, as the
lead will in vtc/cli.py), writing into tmp_path, and checks the JSON fields and
the BENCHMARKS-style markdown rendered from it.
"""
from __future__ import annotations

import json

import pytest

import vtc.cli
from vtc.commands import bench as bench_cmd


@pytest.fixture(scope="module")
def harness():
    return bench_cmd.load_harness()


def test_vtc_bench_smoke(tmp_path, monkeypatch, harness):
    from bench import report

    if "vtc.commands.bench" not in vtc.cli.COMMANDS:
        monkeypatch.setattr(vtc.cli, "COMMANDS", (*vtc.cli.COMMANDS, "vtc.commands.bench"))
    monkeypatch.setattr(report, "render_chart", lambda data, path: "skipped in the smoke test")
    rc = vtc.cli.main(["bench", "--workloads", "smoke_transpose_add", "--systems", "eager,vtc-all",
                       "--runs", "3", "--no-memory", "--out", str(tmp_path)])
    assert rc == 0
    [path] = list(tmp_path.glob("*.json"))
    data = json.loads(path.read_text())
    assert data["schema"] == 1 and data["systems"] == ["eager", "vtc-all"]
    m = data["machine"]
    for key in ("cpu", "cores", "threads", "versions", "load_avg_start", "host"):
        assert key in m, key
    assert {"torch", "onnxruntime", "openvino"} <= set(m["versions"])
    [w] = data["workloads"]
    assert w["name"] == "smoke_transpose_add" and w["group"] == "smoke"
    for s in ("eager", "vtc-all"):
        r = w["results"][s]
        assert r["status"] == "ok", r
        assert r["runs"] == 3 and len(r["times_s"]) == 3
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["max_err"] == 0.0 and "memory" not in r
    v = w["results"]["vtc-all"]["vtc"]
    assert v["compile_cold_s"] > 0 and v["compile_warm_s"] > 0
    assert v["report"]["movement_ops"] == 1 and v["report"]["eliminated_movement_ops"] == 1
    assert len(v["report"]["plan_key"]) == 16
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "# vtc benchmarks" in md and "## Goal (issue 6)" in md
    assert "| `smoke_transpose_add` |" in md and "vtc speed-up" in md
    assert "--workloads smoke_transpose_add" in md  # the exact command
    assert path.name in md


def test_failures_are_results_not_crashes(tmp_path, monkeypatch, harness):
    """A system that raises, a missing package and a vtc option vtc rejects are recorded, not raised."""
    from bench import systems

    def boom(ctx):
        raise RuntimeError("kaboom\nsecond line")

    def flaky(ctx):  # right on its first calls, then raises: a failure in the timed calls
        calls = []
        model, inputs = ctx.model, ctx.inputs

        def fn():
            calls.append(1)
            if len(calls) > 4:
                raise RuntimeError("segfault avoided")
            return model(*inputs)
        return systems.Prepared(fn, 0.0)

    monkeypatch.setitem(harness.PREPARE, "inductor", boom)
    monkeypatch.setitem(harness.PREPARE, "onnxruntime", flaky)
    monkeypatch.setattr(systems, "installed", lambda module: module != "openvino")
    monkeypatch.setitem(systems.VTC_VARIANTS, "vtc-bogus", {"plan": "no-such-plan"})
    monkeypatch.setitem(harness.PREPARE, "vtc-bogus", systems._vtc("vtc-bogus"))
    st = harness.Settings(runs=2, memory=False)
    entry = harness.run_workload(harness.W.get("smoke_transpose_add"),
                                 ["eager", "inductor", "onnxruntime", "openvino", "vtc-bogus"], st, tmp_path, print)
    r = entry["results"]
    assert r["eager"]["status"] == "ok" and r["eager"]["runs"] == 2
    assert r["inductor"] == {"status": "failed", "reason": "RuntimeError: kaboom"}
    assert r["onnxruntime"]["status"] == "failed"
    assert r["onnxruntime"]["reason"] == "failed on timed call 1: RuntimeError: segfault avoided"
    assert r["openvino"]["status"] == "not installed"
    assert r["vtc-bogus"]["status"] == "n/a" and "no-such-plan" in r["vtc-bogus"]["reason"]


def test_every_timed_block_starts_after_the_settle_pause(monkeypatch, harness):
    """Before each system's block (its untimed call, then its timed calls) the harness pauses settle_s, so that
    the spinning thread pool of the system before it is idle when the block's timed calls run."""
    events = []
    monkeypatch.setattr(harness.time, "sleep", lambda s: events.append(("sleep", s)))
    st = harness.Settings(runs=4, memory=False)
    st.block = 2
    fns = {name: (lambda name=name: events.append(("call", name))) for name in ("a", "b")}
    times, errors = harness.time_interleaved(fns, {"a": 1e-3, "b": 1e-3}, st)
    assert not errors and {n: len(t) for n, t in times.items()} == {"a": 4, "b": 4}
    blocks = [i for i, e in enumerate(events) if e[0] == "sleep"]
    assert len(blocks) == 4 and all(events[i] == ("sleep", harness.SETTLE_S) for i in blocks)
    # each pause is followed by one system's untimed call and its 2 timed calls, nothing else
    for i in blocks:
        assert len({e for e in events[i + 1:i + 4]}) == 1 and events[i + 1][0] == "call"
    assert harness.SETTLE_S >= 0.05  # ONNX Runtime's pool spins ~45 ms after a call on this machine


def test_every_block_records_the_waits_for_a_core(monkeypatch, harness):
    """Per system and block, the seconds per timed call this process's threads were runnable without a core (from
    /proc/self/task/*/schedstat: here a fake counter that each call of "b" advances by 2 ms), so that a median
    inflated by other processes' load can be told from a slow system (session 18)."""
    clock = [0.0]
    monkeypatch.setattr(harness, "run_delay_s", lambda: clock[0])
    monkeypatch.setattr(harness.time, "sleep", lambda s: None)
    st = harness.Settings(runs=4, memory=False)
    st.block = 2

    def b():
        clock[0] += 2e-3
    waited: dict = {}
    times, errors = harness.time_interleaved({"a": lambda: None, "b": b}, {"a": 1e-3, "b": 1e-3}, st, waited)
    assert not errors and {n: len(t) for n, t in times.items()} == {"a": 4, "b": 4}
    assert waited["a"] == [0.0, 0.0] and waited["b"] == pytest.approx([2e-3, 2e-3])


def test_run_delay_reads_this_process(harness):
    """The real reader: a count of seconds that never goes down."""
    w0 = harness.run_delay_s()
    x = 0
    for i in range(200000):
        x += i
    assert 0.0 <= w0 <= harness.run_delay_s()


def test_tolerance_follows_the_output_dtype(harness):
    """A float16 / bfloat16 output is held to its own tolerance, a float32 one to RTOL: 5e-3 of the largest
    element passes in float16 and fails in float32; 2e-2 fails in float16 and passes in bfloat16."""
    import torch

    ref = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    ref[0, 0] = 4.0  # the largest magnitude
    for rel, dtype, ok in ((5e-3, torch.float32, False), (5e-3, torch.float16, True),
                           (2e-2, torch.float16, False), (2e-2, torch.bfloat16, True)):
        a = ref.to(dtype)
        b = a.clone()
        b[1, 1] += 4.0 * rel
        got_ok, err, why = harness.compare([a], [b])
        assert got_ok is ok, (rel, dtype, err, why)


def test_fp16_workloads_cast_weights_and_inputs():
    """The named float16 twins of the whole models and of the decode step build in float16 and stay off a plain run."""
    import torch

    from bench.workloads import get, select

    for name in ("llama_model_fp16", "shufflenet_v2_model_fp16", "llama3_decode_b1_fp16"):
        w = get(name)
        model, inputs = w.build(quick=True)
        assert {p.dtype for p in model.parameters()} == {torch.float16}, name
        assert all(x.dtype == torch.float16 for x in inputs if x.is_floating_point()), name
        assert name not in {x.name for x in select(None)}


def test_report_goal_and_speedup_from_raw_numbers(harness):
    """Speed-up = best other median / headline vtc median; the goal is judged on units only."""
    from bench import report

    def res(ms, mem=None):
        r = {"status": "ok", "median_s": ms / 1e3, "min_s": ms / 1e3, "max_s": ms / 1e3}
        if mem is not None:
            r["memory"] = {"status": "ok", "peak_delta_bytes": mem}
        return r

    data = {"others": ["eager", "onnxruntime"], "vtc_variants": ["vtc-none", "vtc-all"],
            "vtc_headline_order": ["vtc-all", "vtc-greedy"], "workloads": [
                {"name": "u1", "group": "unit", "results": {"eager": res(4, 100), "onnxruntime": res(2, 50),
                                                             "vtc-none": res(8), "vtc-all": res(1, 40)}},
                {"name": "u2", "group": "unit", "results": {"eager": res(4, 100), "onnxruntime": res(3),
                                                             "vtc-all": res(6, 80)}},
                {"name": "m", "group": "micro", "results": {"eager": res(1), "vtc-all": res(100)}}]}
    s = report.summarize(data["workloads"][0], data)
    assert s["best_other"] == "onnxruntime" and s["speedup"] == pytest.approx(2.0)
    assert s["memory_reduction"] == pytest.approx(0.6)
    g = report.goal_status(data)
    assert g["geomean_speedup"] == pytest.approx((2.0 * 0.5) ** 0.5)
    assert g["min_speedup"] == pytest.approx(0.5) and g["mean_memory_reduction"] == pytest.approx(0.4)
    assert g["met"] == {"geomean_speedup": False, "min_speedup": False, "mean_memory_reduction": True}


def test_planner_row_counts_the_same_plan_as_no_effect(harness):
    """vtc-greedy 2x slower than vtc-all on the same plan is load: 1.00x; on a different plan it is the planner's."""
    from bench import report

    def res(ms, key):
        return {"status": "ok", "median_s": ms / 1e3, "vtc": {"report": {"plan_key": key}}}

    def planner_cell(greedy_key):
        data = {"workloads": [{"name": "m", "group": "model",
                               "results": {"vtc-none": res(8, "n"), "vtc-all": res(2, "a"),
                                           "vtc-greedy": res(4, greedy_key)}}]}
        rows = {row[0]: row[1] for row in report.ablation(data)[1:]}
        assert rows["virtual tensors (vtc-none → vtc-all)"] == "4.00x"
        return rows["planner (vtc-all → vtc-greedy)"]

    assert planner_cell("a") == "1.00x (1/1 same plan)"
    assert planner_cell("g") == "0.50x"


def test_plan_key_follows_the_decisions(harness):
    """Same decisions, same key (whatever their order); a movement op's other fate or a GEMM's other path changes it."""
    from bench import systems
    from vtc.plan.report import MovementEntry, Report

    def key(fate="virtual", path="weight_rows", order=1):
        moves = [MovementEntry("t", "transpose", 64, fate), MovementEntry("c", "cat", 64, "virtual")][::order]
        return systems.plan_key(Report("greedy", 2, 2, 0, 3, [], 0, movement=moves,
                                       gemm=[{"node": "mm", "choice": "vtc", "path": path}]))

    assert key() == key(order=-1)
    assert key() != key(fate="kept") and key() != key(path="panels")


def test_clear_error_without_the_repository(tmp_path, monkeypatch):
    """vtc installed without its checkout: `vtc bench` says what is missing instead of crashing."""
    import argparse

    monkeypatch.setattr(bench_cmd, "bench_dir", lambda: tmp_path / "bench")
    with pytest.raises(RuntimeError, match="needs the vtc source repository"):
        bench_cmd.load_harness()
    p = argparse.ArgumentParser()
    bench_cmd.register(p.add_subparsers(dest="command"))
    args = p.parse_args(["bench", "--quick"])
    with pytest.raises(RuntimeError, match="needs the vtc source repository"):
        args.func(args)


def test_an_onnx_file_wrong_under_onnxruntime_is_exported_again(tmp_path, monkeypatch):
    """The ONNX systems run the first exporter's file that ONNX Runtime computes correctly: a dynamo export whose
    result differs from eager (efficientvit_b16 on this project's AMD machine: NaN in 1152 outputs) is replaced by
    the TorchScript exporter's, the reason kept in the export record."""
    import torch

    from bench.systems import Context

    pytest.importorskip("onnxruntime")
    model, inputs = torch.nn.Linear(8, 4).eval(), (torch.randn(3, 8),)
    ctx = Context("lin", model, inputs, threads=1, workdir=tmp_path)
    path = ctx.onnx()
    assert ctx.export["exporter"] == "dynamo" and ctx.export["errors"] == []
    assert ctx._wrong_under_onnxruntime(path) == ""
    other = Context("lin", torch.nn.Linear(8, 4).eval(), inputs, threads=1, workdir=tmp_path)
    assert "wrong result" in other._wrong_under_onnxruntime(path)  # another model's weights: caught

    calls = []
    real = Context._wrong_under_onnxruntime
    monkeypatch.setattr(Context, "_wrong_under_onnxruntime",
                        lambda self, p: calls.append(p) or "wrong result: output 0 max relative error nan")
    ctx2 = Context("lin2", model, inputs, threads=1, workdir=tmp_path / "b")
    (tmp_path / "b").mkdir()
    ctx2.onnx()
    assert len(calls) == 1  # only the dynamo file is checked here; the torchscript one is judged when timed
    assert ctx2.export["exporter"] == "torchscript" and "dynamo: wrong result" in ctx2.export["errors"][0]
    monkeypatch.setattr(Context, "_wrong_under_onnxruntime", real)
