"""bench/gemm_side_by_side.py: every system timed in a worker process of its own (``--process each``, the default),
the rounds still interleaved; ``--process one`` keeps them all in the calling process."""
from __future__ import annotations

import json
import os

from bench import gemm_side_by_side as G


def test_each_system_in_its_own_process_and_failures_are_results(tmp_path, monkeypatch):
    """Three systems on a tiny workload: one worker process each (none of them the calling process); a system vtc
    does not know fails at its preparation, and the worker of "eager" dies in its second round: both recorded as
    failures, "vtc-all" still timed over every round."""
    with G.Workers(["eager", "vtc-all", "vtc-no-such-variant"], 1, "cpu", tmp_path) as workers:
        real_ask, rounds = workers.ask, []

        def ask(system, line):
            if system == "eager" and line == "round":
                rounds.append(1)
                if len(rounds) == 2:
                    workers.procs["eager"][0].kill()
                    workers.procs["eager"][0].wait()
            return real_ask(system, line)
        monkeypatch.setattr(workers, "ask", ask)
        times, failed = workers.time("smoke_transpose_add", rounds=3)
        pids = dict(workers.pids)
    assert set(times) == {"vtc-all"} and set(failed) == {"eager", "vtc-no-such-variant"}
    assert failed["eager"].startswith("failed on a timed call: worker exited")
    t = times["vtc-all"]
    assert 0 < t["min_ms"] <= t["median_ms"] and len(t["rounds_ms"]) == 3 and t["calls_per_round"] >= 1
    assert all(w >= 0 for w in t["rounds_waited_ms"])
    assert set(pids) == {"eager", "vtc-all"} and len({*pids.values(), os.getpid()}) == 3


def test_main_records_how_systems_were_placed(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # the threading environment is stated in the JSON
    for process in ("each", "one"):
        out = tmp_path / process
        rc = G.main(["--workloads", "smoke_transpose_add", "--systems", "eager", "--threads", "1", "--clock", "cpu",
                     "--rounds", "2", "--process", process, "--out", str(out)])
        assert rc == 0
        [path] = list(out.glob("*.json"))
        data = json.loads(path.read_text())
        assert data["process"] == process and data["settle_s"] == G.SETTLE_S
        assert data["thread_env"]["OMP_WAIT_POLICY"] == "passive"
        [row] = data["results"]
        assert row["workload"] == "smoke_transpose_add" and set(row["times"]) == {"eager"}
        assert "waited_ms_median" in row["times"]["eager"]
