"""`vtc bench --systems vtc-onnx`: vtc on the ONNX file the ONNX systems run (bench/systems.py), named only."""
from __future__ import annotations

import json

import pytest

import vtc.cli
from vtc.commands import bench as bench_cmd


@pytest.fixture(scope="module")
def harness():
    return bench_cmd.load_harness()


def test_vtc_onnx_is_named_only(harness):
    from bench.systems import parse_systems

    assert "vtc-onnx" not in parse_systems(None, quick=False)
    assert parse_systems("onnxruntime,vtc-onnx", quick=False) == ["onnxruntime", "vtc-onnx"]


def test_vtc_onnx_system_runs_the_exported_file(tmp_path, monkeypatch, harness):
    from bench import report

    if "vtc.commands.bench" not in vtc.cli.COMMANDS:
        monkeypatch.setattr(vtc.cli, "COMMANDS", (*vtc.cli.COMMANDS, "vtc.commands.bench"))
    monkeypatch.setattr(report, "render_chart", lambda data, path: "skipped in the test")
    rc = vtc.cli.main(["bench", "--workloads", "smoke_transpose_add", "--systems", "onnxruntime,vtc-onnx",
                       "--runs", "3", "--no-memory", "--out", str(tmp_path)])
    assert rc == 0
    [path] = list(tmp_path.glob("*.json"))
    [w] = json.loads(path.read_text())["workloads"]
    r = w["results"]["vtc-onnx"]
    assert r["status"] == "ok", r
    assert r["max_err"] <= 1e-6  # vs eager, relative to the output's largest magnitude
    rep = r["vtc"]["report"]
    assert rep["movement_ops"] == rep["eliminated_movement_ops"] >= 1 and rep["fallback_ops"] == []
    assert "vtc-onnx" in (tmp_path / "BENCHMARKS.md").read_text()
