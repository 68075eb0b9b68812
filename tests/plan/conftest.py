"""Fixtures of the planner tests: the fixed machine figures (VTC_NO_MEASURE=1), never a measurement."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def no_measure():
    """VTC_NO_MEASURE=1 for the session: the cost model uses vtc.plan.cost.FALLBACK."""
    from vtc.plan.cost import machine

    old = os.environ.get("VTC_NO_MEASURE")
    os.environ["VTC_NO_MEASURE"] = "1"
    machine.cache_clear()
    yield
    machine.cache_clear()
    if old is None:
        os.environ.pop("VTC_NO_MEASURE", None)
    else:
        os.environ["VTC_NO_MEASURE"] = old
