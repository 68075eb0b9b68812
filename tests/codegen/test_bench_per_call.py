"""``bench.micro_side_by_side.per_call_times`` (``--per-call``): each call timed alone, systems interleaved."""
from __future__ import annotations

import time

from bench.micro_side_by_side import per_call_times


def test_per_call_times_counts_and_orders():
    calls = {"fast": 0, "slow": 0}
    order = []

    def make(name, pause):
        def fn():
            calls[name] += 1
            order.append(name)
            time.sleep(pause)
        return fn

    t = per_call_times({"fast": make("fast", 0.0), "slow": make("slow", 0.002)}, rounds=3, block=4)
    assert t["fast"]["calls"] == t["slow"]["calls"] == 12
    assert calls == {"fast": 2 + 3 * 5, "slow": 2 + 3 * 5}  # 2 warm-up calls, then 1 untimed + 4 timed per round
    assert order[4:9] == ["fast"] * 5 and order[9:14] == ["slow"] * 5  # interleaved by rounds
    assert t["slow"]["min_ms"] >= 2.0 and t["slow"]["median_ms"] >= t["slow"]["min_ms"]
    assert t["fast"]["median_ms"] < t["slow"]["min_ms"]
