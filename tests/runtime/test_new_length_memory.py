"""What a decode loop with a growing cache keeps from one new length to the next: bounded.

- the hash-consed kernel-IR scalars (``kernel_ir._TABLE``) are held weakly: a strong table kept every scalar of
  every length (with its index expressions) for the life of the process;
- a size's specialization keeps a summary of its lowering (``vtc.dynamic.LoweringSummary``), not the lowering's
  per-node working state;
- the specializations are an LRU of ``max_specializations``; an evicted one is freed (by the next collection:
  its graph's values and nodes refer to each other).
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import vtc
from vtc.codegen import kernel_ir
from vtc.dynamic import LoweringSummary

from .test_new_length_cost import _decode, _inputs

pytestmark = pytest.mark.filterwarnings("ignore::vtc.NewSizesWarning")  # a new length per call, on purpose
TOL = dict(rtol=1e-4, atol=1e-4)


def _compiled():
    g = torch.Generator().manual_seed(5)
    w1, w2 = torch.randn(32, 48, generator=g) / 6, torch.randn(48, 32, generator=g) / 7
    fn = lambda tok, past: _decode(tok, past, w1, w2)  # noqa: E731
    return fn, vtc.compile(fn, _inputs(9, 0))


def test_forty_new_lengths_keep_a_bounded_number_of_objects():
    """Before: every new length left ~30 scalars in kernel_ir's strong table, with their key tuples and index
    expressions (for the 4-layer Llama: ~310 tracked objects per length), for the life of the process."""
    fn, compiled = _compiled()
    counts = {}
    for p in range(10, 50):
        x = _inputs(p, p)
        got = compiled(*x)
        if p in (18, 34, 49):
            gc.collect()
            counts[p] = (len(gc.get_objects()), len(kernel_ir._TABLE))
    for a, b in zip(got, fn(*x)):
        torch.testing.assert_close(a, b, **TOL)
    grew = counts[49][0] - counts[34][0]
    assert grew < 150, f"{grew} more tracked objects after 15 more new lengths ({counts})"
    assert counts[49][1] <= counts[34][1] + 20, f"kernel_ir's scalar table grew: {counts}"


def test_an_evicted_specialization_is_freed_and_keeps_no_lowering(monkeypatch):
    """The LRU holds max_specializations; the first of a size's specializations is gone after that many more
    (a collection later). A size's specialization holds a LoweringSummary, the first (the example's) its whole
    lowering. Before: every specialization held its whole lowering."""
    monkeypatch.setitem(vtc.compiler.OPTIONS, "max_specializations", 3)
    fn, compiled = _compiled()
    compiled(*_inputs(10, 10))
    compiled(*_inputs(11, 11))
    spec = compiled._specs[next(reversed(compiled._specs))]
    assert isinstance(spec.executor.lowering, LoweringSummary)
    assert type(compiled._first.executor.lowering).__name__ == "Lowering"
    assert spec.executor.lowering.gemm_choices  # what the call plan reads
    gone = weakref.ref(spec.executor)
    del spec
    for p in (12, 13, 14, 15):
        x = _inputs(p, p)
        got = compiled(*x)
    for a, b in zip(got, fn(*x)):
        torch.testing.assert_close(a, b, **TOL)
    assert len(compiled._specs) == 3
    gc.collect()
    assert gone() is None, "an evicted specialization is still alive after a collection"


def test_a_size_report_is_made_when_read_and_equals_the_one_from_the_whole_lowering(monkeypatch):
    """A size's report used to be made with every new length (2-3 ms for the 4-layer Llama, never read in a
    decode loop); now when it is first read, from the LoweringSummary, with the same content."""
    import vtc.dynamic
    from vtc.plan.report import build_report

    lowerings = []
    of = vtc.dynamic.LoweringSummary.of
    monkeypatch.setattr(vtc.dynamic.LoweringSummary, "of", classmethod(lambda cls, low: (lowerings.append(low),
                                                                                         of(low))[1]))
    built = []
    monkeypatch.setattr(vtc.dynamic, "build_report", lambda *a: (built.append(a), build_report(*a))[1])
    fn, compiled = _compiled()
    compiled(*_inputs(10, 10))
    x = _inputs(11, 11)
    got = compiled(*x)
    for a, b in zip(got, fn(*x)):
        torch.testing.assert_close(a, b, **TOL)
    spec = compiled._specs[next(reversed(compiled._specs))]
    assert not built and isinstance(spec, vtc.dynamic.SizeSpecialization)
    executor = spec.executor
    summary, executor.lowering = executor.lowering, lowerings[-1]
    want = build_report(spec.graph, spec.plan, executor)
    executor.lowering = summary
    assert spec.report == want and len(built) == 1
    assert spec.report is spec.report and len(built) == 1  # made once
    assert want.movement and want.gemm
