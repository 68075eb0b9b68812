"""The plan cache: a warm compile reuses the plan (and gives eager's results); a changed model misses."""
from __future__ import annotations

import json

import pytest
import torch

import vtc
from vtc.plan import cache as plan_cache
from vtc.runtime.cbuild import CACHE_FORMAT


class Heads(torch.nn.Module):
    """Projection -> split heads (view + transpose) -> softmax -> merge heads -> residual."""

    def __init__(self, d: int = 24, heads: int = 3):
        super().__init__()
        self.proj, self.heads = torch.nn.Linear(d, d), heads

    def forward(self, x):
        b, s, d = x.shape
        h = self.proj(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
        p = torch.softmax(h * 0.5, dim=-1)
        return p.transpose(1, 2).reshape(b, s, d) + x


class HeadsSwapped(Heads):
    """The same module with other code: the heads are read in the other order."""

    def forward(self, x):
        b, s, d = x.shape
        h = self.proj(x).view(b, s, d // self.heads, self.heads).permute(0, 3, 1, 2)
        p = torch.softmax(h * 0.5, dim=-1)
        return p.permute(0, 2, 3, 1).reshape(b, s, d) + x


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory and fresh hit/miss counters."""
    monkeypatch.setenv("VTC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(plan_cache, "stats", plan_cache.Counter())
    return tmp_path / "cache"


def _check(compiled, model, x):
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def _entries(cache):
    return sorted((cache / f"cbuild-v{CACHE_FORMAT}" / "plans").glob("*.json"))


def test_warm_compile_hits_and_matches_eager(cache):
    torch.manual_seed(0)
    model, x = Heads().eval(), torch.randn(2, 17, 24)
    cold = vtc.compile(model, (x,))
    assert plan_cache.stats == {"miss": 1, "store": 1}
    warm = vtc.compile(model, (x,))
    assert plan_cache.stats == {"miss": 1, "store": 1, "hit": 1}
    assert warm.report.to_dict() == cold.report.to_dict()
    was, now = cold._first.plan, warm._first.plan
    assert now.decisions == was.decisions and now.kept == was.kept and now.notes == was.notes
    assert now.pushed == was.pushed
    assert {k: r.kind for k, r in now.realized.items()} == {k: r.kind for k, r in was.realized.items()}
    for xs in (torch.randn(2, 17, 24), torch.randn(2, 17, 24) * 3 + 1):
        _check(warm, model, xs)
        _check(cold, model, xs)
    assert len(_entries(cache)) == 1


def test_new_weights_reuse_the_plan_but_compute_with_the_new_weights(cache):
    torch.manual_seed(0)
    x = torch.randn(1, 3, 24)
    a, b = Heads().eval(), Heads().eval()  # same code and shapes, other weights
    assert not torch.equal(a.proj.weight, b.proj.weight)
    vtc.compile(a, (x,))
    cb = vtc.compile(b, (x,))
    assert plan_cache.stats["hit"] == 1  # weights are not part of a plan
    _check(cb, b, torch.randn(1, 3, 24))


@pytest.mark.parametrize("change", ["code", "shape", "dtype", "objective", "gemm", "push", "vtc code"])
def test_a_changed_model_or_option_misses(cache, change, monkeypatch):
    torch.manual_seed(0)
    model, x = Heads().eval(), torch.randn(2, 17, 24)
    vtc.compile(model, (x,))
    assert plan_cache.stats == {"miss": 1, "store": 1}
    options = {}
    if change == "code":
        model = HeadsSwapped().eval()
    elif change == "shape":
        x = torch.randn(2, 16, 24)
    elif change == "dtype":
        model, x = model.double(), x.double()
    elif change == "objective":
        options = {"objective": "memory"}
    elif change == "gemm":
        options = {"gemm": "vtc"}
    elif change == "push":
        options = {"push": False}
    else:
        monkeypatch.setattr(plan_cache, "code_digest", lambda: "an edited vtc")
    compiled = vtc.compile(model, (x,), **options)
    assert plan_cache.stats == {"miss": 2, "store": 2}
    assert len(_entries(cache)) == 2
    _check(compiled, model, torch.randn(*x.shape, dtype=x.dtype))


def test_measured_plans_and_plain_plans_are_not_cached(cache):
    model, x = Heads().eval(), torch.randn(1, 5, 24)
    vtc.compile(model, (x,), plan="all")
    vtc.compile(model, (x,), plan="none")
    assert not plan_cache.stats and not _entries(cache)


def test_a_corrupt_or_foreign_entry_is_a_miss_and_is_replaced(cache):
    torch.manual_seed(0)
    model, x = Heads().eval(), torch.randn(2, 5, 24)
    vtc.compile(model, (x,))
    (entry,) = _entries(cache)
    good = json.loads(entry.read_text())
    for bad in ("{not json", json.dumps({**good, "kept": {"no_such_node": "kept physical"}}),
                json.dumps({k: v for k, v in good.items() if k != "decisions"})):
        entry.write_text(bad)
        _check(vtc.compile(model, (x,)), model, torch.randn(2, 5, 24))
        assert json.loads(entry.read_text()) == good  # rewritten by the miss
    assert plan_cache.stats == {"miss": 4, "store": 4}


def test_warm_plan_keeps_the_pushes(cache):
    """softmax rows into a returned cat: greedy stores them in place (a push); the cached plan does too."""
    def fn(a, b):
        return torch.cat((torch.softmax(a, -1), torch.softmax(b, -1)), dim=1)

    torch.manual_seed(0)
    a, b = torch.randn(16, 17, 127), torch.randn(16, 3, 127)
    cold = vtc.compile(fn, (a, b))
    warm = vtc.compile(fn, (a, b))
    assert plan_cache.stats["hit"] == 1
    assert cold._first.plan.pushed and warm._first.plan.pushed == cold._first.plan.pushed
    assert warm.report.to_dict() == cold.report.to_dict()
    with torch.no_grad():
        torch.testing.assert_close(warm(a, b), fn(a, b), rtol=1e-5, atol=1e-6)
