"""Fixtures shared by the runtime tests."""
from __future__ import annotations

import gc
import warnings

import pytest

from vtc.runtime import packed


@pytest.fixture
def budget(monkeypatch):
    """set(extra): the budget made the bytes held now (other tests' copies still alive) plus `extra`."""
    gc.collect()

    def set_budget(extra: int) -> None:
        monkeypatch.setattr(packed, "BUDGET_BYTES", packed.HELD.bytes + extra)
    return set_budget


@pytest.fixture
def quiet():
    """The test's warnings ignored (fallback and budget warnings it provokes on purpose)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
