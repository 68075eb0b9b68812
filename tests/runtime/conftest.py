"""Fixtures shared by the runtime tests."""
from __future__ import annotations

import gc
import warnings

import pytest

from vtc.runtime import generic, packed


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


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A kernel cache of the test's own, and no size-generic templates from other tests: a build is a compiler
    run, not a disk hit."""
    monkeypatch.setenv("VTC_CACHE_DIR", str(tmp_path / "cache"))
    generic._TEMPLATES.clear()
    generic._SIZE_FREE.clear()
    yield
    generic._TEMPLATES.clear()
    generic._SIZE_FREE.clear()
