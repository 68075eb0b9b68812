"""bench/gemm_side_by_side.py: every system timed in a worker process of its own (``--process each``, the default),
the rounds still interleaved; ``--process one`` keeps them all in the calling process."""
from __future__ import annotations

import json
import os

import pytest

from bench import gemm_side_by_side as G


def test_each_system_in_its_own_process(tmp_path):
    """Two systems on a tiny workload: one worker process each (neither the calling process), both timed."""
    with G.Workers(["eager", "vtc-all"], 1, "cpu", tmp_path) as workers:
        times, failed = workers.time("smoke_transpose_add", rounds=2)
        pids = dict(workers.pids)
    assert not failed
    assert set(times) == {"eager", "vtc-all"}
    for t in times.values():
        assert 0 < t["min_ms"] <= t["median_ms"] and t["calls_per_round"] >= 1
    assert len({*pids.values(), os.getpid()}) == 3  # two workers, neither this process


def test_a_failing_system_is_a_result(tmp_path):
    with G.Workers(["eager", "vtc-no-such-variant"], 1, "cpu", tmp_path) as workers:
        times, failed = workers.time("smoke_transpose_add", rounds=1)
    assert set(times) == {"eager"} and "vtc-no-such-variant" in failed


@pytest.mark.parametrize("process", ["each", "one"])
def test_main_records_how_systems_were_placed(tmp_path, process):
    rc = G.main(["--workloads", "smoke_transpose_add", "--systems", "eager", "--threads", "1", "--clock", "cpu",
                 "--rounds", "2", "--process", process, "--out", str(tmp_path)])
    assert rc == 0
    [path] = list(tmp_path.glob("*.json"))
    data = json.loads(path.read_text())
    assert data["process"] == process and data["settle_s"] == G.SETTLE_S
    [row] = data["results"]
    assert row["workload"] == "smoke_transpose_add" and set(row["times"]) == {"eager"}
