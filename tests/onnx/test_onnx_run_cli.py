"""`vtc run model.onnx`: runs against onnxruntime, prints the error, timings and the report."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import vtc.cli
from onnx_helpers import model, node


@pytest.fixture
def cli(monkeypatch):
    if "vtc.commands.run" not in vtc.cli.COMMANDS:
        monkeypatch.setattr(vtc.cli, "COMMANDS", (*vtc.cli.COMMANDS, "vtc.commands.run"))
    return vtc.cli.main


def embedding_model(tmp_path):
    """ids [batch, seq] -> Gather(table[10, 8]) -> Transpose -> Relu; symbolic batch and seq."""
    table = np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)
    ids = np.zeros((2, 3), np.int64)
    m = model([node("Gather", ["table", "ids"], ["e"], name="embed"),
               node("Transpose", ["e"], ["t"], name="tr", perm=[0, 2, 1]),
               node("Relu", ["t"], ["y"], name="relu")], {"ids": ids}, ["y"], {"table": table},
              dims={"ids": ["batch", "seq"]})
    path = tmp_path / "embed.onnx"
    onnx.save(m, str(path))
    return path


def test_run_prints_error_timing_and_report(cli, tmp_path, capsys):
    path = embedding_model(tmp_path)
    out = tmp_path / "r.json"
    assert cli(["run", str(path), "--dim", "batch=2", "--dim", "seq=5", "--runs", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "max |vtc - onnxruntime| = 0" in text
    assert "median time over 2 runs: vtc" in text and "onnxruntime" in text
    assert "movement ops eliminated" in text and "movement ops:" in text  # summary, then the census
    assert "ids: int64[2, 5]" in text
    data = json.loads(out.read_text())
    assert data["match"] and data["report"]["movement_ops"] == 2


def test_run_with_inputs_file_and_plan_none(cli, tmp_path, capsys):
    path = embedding_model(tmp_path)
    npz = tmp_path / "in.npz"
    np.savez(npz, ids=np.array([[1, 9, 3, 4]], np.int64))
    assert cli(["run", str(path), "--inputs", str(npz), "--plan", "none", "--runs", "1"]) == 0
    text = capsys.readouterr().out
    assert "ids: int64[1, 4]" in text and "plan=none: 0/2 movement ops eliminated" in text


def test_run_errors_are_clear(cli, tmp_path, capsys):
    path = embedding_model(tmp_path)
    assert cli(["run", str(path), "--dim", "batch=2"]) == 2
    assert "symbolic dims ['seq']" in capsys.readouterr().err
    assert cli(["run", str(path), "--dim", "batch"]) == 2
    assert "expected NAME=INTEGER" in capsys.readouterr().err
