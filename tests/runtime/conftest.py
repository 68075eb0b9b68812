"""Fixtures shared by the runtime tests."""
from __future__ import annotations

import gc

import pytest

from vtc.runtime import packed


@pytest.fixture
def budget(monkeypatch):
    """set(extra): the budget made the bytes held now (other tests' copies still alive) plus `extra`."""
    gc.collect()

    def set_budget(extra: int) -> None:
        monkeypatch.setattr(packed, "BUDGET_BYTES", packed.HELD.bytes + extra)
    return set_budget
