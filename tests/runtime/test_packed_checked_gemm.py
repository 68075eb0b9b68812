"""A GEMM whose stores are pushed into a KV cache at run-time positions gets its constant weight packed once too.

Llama-3's V projection in a prefill (``v = x @ Wv^T`` viewed as heads, transposed, ``index_copy`` into the cache at
``cache_position``) is pushed: the GEMM stores straight into the output cache, so the kernel has int64 index range
checks (the positions).  The call plan used to pass no packed weight to a kernel with range checks (it packed
``Wv`` per call); now the checks run in the same C call as before (``vtc_call_checked`` / a segment) and the
weight is passed packed once.
"""
from __future__ import annotations

import pytest
import torch

import vtc
from vtc.codegen import conv_t
from vtc.runtime import packed, segment

from tests.codegen.util import torch_threads

pytestmark = pytest.mark.skipif(not conv_t.has_avx512() or not packed.CONV_ENABLED,
                                reason="B packed once is the AVX-512 kernel's layout")


class VCache(torch.nn.Module):
    """(x [1, S, D], cache [1, KV, T, hd], positions [S]) -> (cache with the projected rows at positions, y):
    the V-cache update of a decoder layer, plus a reader of the same x so that the kernel is not alone."""

    def __init__(self, d: int, kv: int, hd: int):
        super().__init__()
        self.kv, self.hd = kv, hd
        self.v = torch.nn.Linear(d, kv * hd, bias=False)

    def forward(self, x, cache, positions):
        s = x.shape[1]
        v = self.v(x).view(1, s, self.kv, self.hd).transpose(1, 2)
        return cache.index_copy(2, positions, v), torch.relu(x) * 2.0


def _case(s: int, d: int, kv: int, hd: int, t: int, seed: int):
    torch.manual_seed(seed)
    model = VCache(d, kv, hd).eval()
    x = torch.randn(1, s, d)
    cache = torch.randn(1, kv, t, hd)
    positions = torch.randperm(t)[:s].sort().values if seed % 2 else torch.arange(t - s, t)
    return model, (x, cache, positions)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("segments", [True, False], ids=["segment", "own_call"])
@pytest.mark.parametrize("shape", [(40, 256, 2, 64, 100), (256, 300, 4, 32, 300), (133, 1024, 1, 64, 200)],
                         ids=["40x256->128", "256x300->128", "133x1024->64"])
def test_pushed_v_projection_is_packed_once_and_still_checked(shape, segments, threads, monkeypatch):
    s, d, kv, hd, t = shape
    monkeypatch.setattr(segment, "SEGMENTS", segments)
    model, inputs = _case(s, d, kv, hd, t, seed=s + d)
    with torch_threads(threads), torch.no_grad():
        c = vtc.compile(model, inputs)
        plan = c._first.executor.call_plan()
        kernels = [s for s in c._first.executor.steps if s.kind == "kernel"]
        assert any(k.kernel.step.checks for k in kernels), "the GEMM is not pushed into the cache (no range checks)"
        assert plan.why_not_packed == {}, plan.why_not_packed  # before: {'k_mm': 'the kernel has index range checks'}
        assert plan.counts["packed_conv_weights"] == 1
        for r in range(3):
            if r == 2:
                with torch.no_grad():
                    model.v.weight.mul_(-0.5)  # packed again after an in-place change
            x, cache, positions = inputs
            x = torch.randn_like(x)
            got = c(x, cache, positions)
            want = model(x, cache, positions)
            torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        bad = positions.clone()
        bad[s // 2] = t  # one past the cache: the range check still stops the call
        with pytest.raises(IndexError):
            c(x, cache, bad)


@pytest.mark.parametrize("runs", [True, False], ids=["runs", "per_element"])
@pytest.mark.parametrize("shape", [(40, 256, 2, 64, 100), (37, 200, 3, 16, 64), (256, 300, 4, 32, 300)],
                         ids=["hd64", "hd16", "hd32"])
def test_pushed_store_copies_runs_of_a_head(shape, runs, monkeypatch):
    """The pushed store of the V projection (column jc to head jc / hd, element jc % hd of the row at the token's
    position) copies each head's hd columns as one vector run (``gemm._store_runs``), not element by element
    with a division and a remainder per column (before: the kernel's text had ``jc % hd``)."""
    from vtc.codegen import gemm

    monkeypatch.setattr(gemm, "PUSH_RUNS", runs)
    s, d, kv, hd, t = shape
    model, inputs = _case(s, d, kv, hd, t, seed=s + hd)
    with torch.no_grad():
        c = vtc.compile(model, inputs)
        got, want = c(*inputs), model(*inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    mms = [s.kernel.step.kernel for s in c._first.executor.steps
           if s.kind == "kernel" and getattr(s.kernel.step.kernel, "gemm", None) is not None]
    assert len(mms) == 1
    src = gemm.generate(mms[0])
    assert (f"(jc % {hd})" not in src and "jh = " in src) if runs else f"(jc % {hd})" in src, src[-1500:]
