"""Fixtures of every test: the fixed machine figures (VTC_NO_MEASURE=1), never a measurement.

The figures decide plans and GEMM choices (vtc.plan.cost.machine, library_gemm_speed): measured, they would
make a test's choices depend on the machine it runs on (torch's GEMM is half as fast as the generated one on
an AMD EPYC, as fast on the Intel CPUs the rates were tuned on) and on how busy it is.  Tests of the
measurement itself set VTC_NO_MEASURE=0 with monkeypatch."""
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
