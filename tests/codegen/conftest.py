"""Fixtures of the CPU code generator tests.

Every test here builds kernels into a private cache directory made for this
test session (shared by the xdist workers of one run, so a kernel that two
workers need is compiled once), never into the user's cache.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def vtc_cache_dir(tmp_path_factory, request):
    """The session's kernel cache: <pytest base temp>/vtc-kernel-cache (0700), one for all workers."""
    base = tmp_path_factory.getbasetemp()
    is_xdist_worker = hasattr(request.config, "workerinput")  # base is <run>/popen-gwN: share <run>
    root = (base.parent if is_xdist_worker else base) / "vtc-kernel-cache"
    root.mkdir(mode=0o700, exist_ok=True)
    return root


@pytest.fixture(autouse=True)
def _use_vtc_cache_dir(vtc_cache_dir, monkeypatch):
    """VTC_CACHE_DIR points at the session's cache during each test here (and nowhere else)."""
    monkeypatch.setenv("VTC_CACHE_DIR", str(vtc_cache_dir))
