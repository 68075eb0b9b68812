"""Kernel-cache safety checks of vtc.runtime.cbuild that no test pinned (found by mutation testing,
docs/testing.md): each test fails when one condition of ``_check_private`` or ``_verified`` is weakened."""
from __future__ import annotations

import pytest

from vtc.runtime import cbuild

from .test_cbuild import ADD1, cache, entry, ret  # noqa: F401  (cache is a fixture)


def test_cache_dir_writable_by_others_only_is_refused(cache):
    cbuild.build(ADD1)
    directory = cbuild.cache_dir()
    cbuild._loaded.clear()
    directory.chmod(0o702)  # not group-writable: others alone may plant a library
    try:
        with pytest.raises(PermissionError, match=r"mode 0702.*chmod 700"):
            cbuild.build(ADD1)
    finally:
        directory.chmod(0o700)


def test_library_writable_by_others_only_is_refused(cache):
    src = ret("4", "others")
    cbuild.build(src)
    so, _ = entry(src)
    cbuild._loaded.clear()
    so.chmod(0o602)
    with pytest.raises(PermissionError, match=r"mode 0602.*chmod 600"):
        cbuild.build(src)
    so.chmod(0o600)
    assert cbuild.build(src).ret() == 4


def test_dangling_link_in_place_of_a_library_is_refused(cache, tmp_path):
    src = ret("5", "dangling")
    so, _ = entry(src)
    so.symlink_to(tmp_path / "not-there.so")  # planted before the first build: nothing to load yet
    with pytest.raises(PermissionError, match="not a file"):
        cbuild.build(src)
    assert len(cache) == 0
