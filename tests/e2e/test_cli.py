"""`vtc analyze` prints the census, checks against eager and writes JSON."""
from __future__ import annotations

import json

from vtc.cli import main


def test_analyze_prints_census_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["analyze", "llama_layer", "--size", "tiny", "--plan", "all", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "movement ops eliminated" in text and "composed chains" in text
    assert "strided view; realised as view" in text
    # the GQA keys/values and the attention output are not strided views: generated GEMMs pack them
    assert "GEMMs (batch x M x N x K" in text and "is not a strided view: torch would copy" in text
    data = json.loads(out.read_text())
    assert data["max_error"] < 1e-4
    assert data["report"]["materialized_movement_bytes"] < data["baseline"]["materialized_movement_bytes"]


def test_analyze_unknown_model_is_a_clear_error(capsys):
    assert main(["analyze", "no_such_model"]) == 2
    assert "unknown model 'no_such_model'" in capsys.readouterr().err


def test_analyze_factory_path(capsys, monkeypatch):
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "zoo"))
    assert main(["analyze", "zoo_factory:make", "--size", "tiny"]) == 0
    assert "max |vtc - eager| = 0" in capsys.readouterr().out


def test_run_on_a_missing_onnx_file_is_a_clear_error(tmp_path, capsys):
    """`vtc run` on a path that does not exist: one line naming it, exit status 2, no traceback."""
    missing = tmp_path / "no_such.onnx"
    assert main(["run", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "FileNotFoundError" in err and str(missing) in err and "Traceback" not in err
