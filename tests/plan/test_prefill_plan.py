"""The greedy plan of a Llama prefill layer: the V-cache update is pushed (docs/prefill.md).

A scatter read through its pull mapping derives the inverse of its positions on every call (about nine small
torch calls).  Inside a layer whose GEMMs evict the caches those calls cost 6-7x what they cost in a loop of
their own (``CostModel.derive_cold_us``); priced warm, the greedy read the prefill's V-cache update through the
inverse (0.5 ms per call) instead of pushing it (the V projection stored into the cache, 0.1 ms).
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from vtc.plan.cost import FALLBACK, CostModel, Estimator
from vtc.plan.planners import make_plan
from vtc.plan.vtog import VTOG

from .graphs import capture, kv_cache_update, kv_inputs

MACHINE = replace(FALLBACK, bandwidth_gbs=8.7, vector_bytes=64, gemm_gflops=150.0)  # this 2-core VM, 1 thread


@pytest.fixture(scope="module")
def prefill_graph():
    from bench.workloads import get

    model, inputs = get("llama3_prefill_b1").build()
    return capture(model, *inputs)[0]


def _v_cache_update(graph):
    """The index_put whose output is the graph's V cache (the second cache update of the layer)."""
    puts = [n for n in graph.nodes if n.op == "aten.index_put.default"]
    assert len(puts) == 2, [n.op for n in graph.nodes]
    return puts[1]


def test_a_layer_of_large_gemms_prices_the_derive_cold_and_a_toy_graph_warm(prefill_graph):
    model = CostModel(MACHINE)
    assert Estimator(VTOG(prefill_graph), model).cold
    toy, _ = capture(kv_cache_update, *kv_inputs())
    assert not Estimator(VTOG(toy), model).cold


def test_the_greedy_pushes_the_prefill_v_cache_update(prefill_graph):
    put = _v_cache_update(prefill_graph)
    plan = make_plan(prefill_graph, {"plan": "greedy"}, CostModel(MACHINE))
    assert put.name in plan.pushed, plan.kept.get(put.name)
    assert not plan.kept  # the V projection's transpose is read through by the push's writer

    class Warm(CostModel):  # the old price: the greedy read the update through its inverse
        derive_cold_us = 0.0

    warm = make_plan(prefill_graph, {"plan": "greedy"}, Warm(MACHINE))
    assert put.name not in warm.pushed
