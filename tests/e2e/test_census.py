"""The movement-op census of one Llama decoder layer (transformers, GQA), op by op.

Pins what vtc does with every movement op of the layer under plan="all":
which are read through mappings inside generated kernels (virtual), handed to
torch's GEMMs as zero-copy strided views, or realised by one gather (a copy
kernel) of a composed chain.  A change in the frontend, the mappings or the
simplifier that loses a view or splits a chain fails here.  Then the same
layer under the default plan="greedy" (fixed machine figures), which keeps
three ops physical.
"""
from __future__ import annotations

import os

import pytest
import torch

import vtc
from vtc import zoo
from vtc.plan.cost import machine

V, S, G = "virtual", "view", "gather"
EXPECTED = [  # (ATen op, fate) in graph order, plan="all", with the default CPU backend (generated kernels)
    # rotary embedding: position ids, inv_freq outer product, cos/sin — all read by generated kernels
    ("unsqueeze", V), ("expand", V), ("unsqueeze", V), ("cat", V), ("unsqueeze", V), ("unsqueeze", V),
    ("unsqueeze", V), ("unsqueeze", V),
    # q, k, v projections: weight transposes and [B*S, H] inputs are zero-copy views for the GEMM;
    # the head split (view -> view -> permute) is read by the RoPE kernels through its mapping
    ("permute", S), ("view", S), ("view", V), ("view", V), ("permute", V),
    ("permute", S), ("view", S), ("view", V), ("view", V), ("permute", V),
    ("permute", S), ("view", S), ("view", V), ("view", V), ("permute", V),
    # rotate_half on q and k: slice + neg + cat read inside the RoPE kernel, never materialised
    ("unsqueeze", V), ("unsqueeze", V), ("slice", V), ("slice", V), ("cat", V),
    ("slice", V), ("slice", V), ("cat", V),
    # GQA repeat_kv of k and v (unsqueeze -> expand -> clone -> view)
    ("unsqueeze", V), ("expand", V), ("clone", V), ("view", V),
    ("unsqueeze", V), ("expand", V), ("clone", V), ("view", V),
    # scores = q @ k^T and probs @ v run as torch bmm: q and probs are views, the expanded K^T and V
    # are gathered once each (until GEMM reads operands through mappings)
    ("permute", V), ("expand", V), ("clone", V), ("view", S), ("expand", V), ("view", G),
    ("view", V), ("clone", V), ("expand", V), ("view", S), ("expand", V), ("view", G),
    # attention output: heads back to [B*S, H] for o_proj: one gather
    ("view", V), ("permute", V), ("clone", V), ("view", V), ("permute", S), ("view", G), ("view", V),
    # MLP: gate, up, down projections
    ("permute", S), ("view", S), ("view", V), ("permute", S), ("view", S), ("view", V),
    ("permute", S), ("view", S), ("view", V),
]


@pytest.fixture(scope="module")
def layer_report():
    model, inputs = zoo.load("llama_layer", size="tiny")
    compiled = vtc.compile(model, inputs, plan="all")
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
    return compiled.report


def test_census_op_by_op(layer_report):
    got = [(e.op.split(".")[1], e.fate) for e in layer_report.movement]
    assert len(got) == len(EXPECTED)
    for k, (g, e) in enumerate(zip(got, EXPECTED)):
        assert g == e, f"movement op #{k} ({layer_report.movement[k].node}): got {g}, expected {e}"


def test_census_totals(layer_report):
    r = layer_report.to_dict()
    assert r["movement_ops"] == len(EXPECTED) == 67
    assert r["eliminated_movement_ops"] == sum(f != G for _, f in EXPECTED) == 64
    assert r["fallback_ops"] == []
    gathered = sum(c["bytes"] for c in r["chains"] if c["realized_as"] == "gather")
    assert r["materialized_movement_bytes"] == gathered


def test_gqa_key_is_read_through_the_head_mapping(layer_report):
    """repeat_kv of K then transpose: query head h reads KV head h // 2, no expanded copy in between."""
    chains = {c.value: c for c in layer_report.chains}
    k = chains["view_12"]
    assert k.ops == ["unsqueeze", "expand", "clone", "view", "permute", "expand", "view"]
    assert k.mapping.endswith("add_2[(i0 // 4), ((i0 // 2) % 2), i2, i1]")


K = "kept"
# plan="greedy" differs from plan="all" in these ops (node name: fate under greedy).  Each kept op stood in
# front of a chain that plan="all" realises with a gather for a torch bmm/mm: the framework's own copy (the
# kept op, walking its input incrementally) moves the same bytes as that copy kernel without its per-element
# div/mod index arithmetic, so keeping it is estimated a little cheaper; what follows it becomes a zero-copy
# view of its output.
GREEDY = {
    "unsqueeze_8": S, "expand_1": K,  # K of repeat_kv: expanded by torch; q @ K^T reads it as a view
    "expand_2": S, "clone_1": K,  # V of repeat_kv: cloned by torch; probs @ V reads it as a view
    "view_12": S, "view_15": S,  # the bmm operands above: views instead of gathers
    "permute_7": S, "clone_4": K, "view_18": S,  # attention output heads -> [B*S, H]: torch's clone, then a view
}


@pytest.fixture(scope="module")
def greedy_report():
    """The default plan with the fixed machine figures (VTC_NO_MEASURE=1): the same decisions on every machine."""
    old = os.environ.get("VTC_NO_MEASURE")
    os.environ["VTC_NO_MEASURE"] = "1"
    machine.cache_clear()
    try:
        model, inputs = zoo.load("llama_layer", size="tiny")
        compiled = vtc.compile(model, inputs)
        assert compiled.options["plan"] == "greedy"
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
        return compiled.report
    finally:
        machine.cache_clear()
        if old is None:
            os.environ.pop("VTC_NO_MEASURE", None)
        else:
            os.environ["VTC_NO_MEASURE"] = old


def test_greedy_census_op_by_op(greedy_report, layer_report):
    got = {e.node: e.fate for e in greedy_report.movement}
    want = {e.node: GREEDY.get(e.node, e.fate) for e in layer_report.movement}
    assert got == want
    for e in greedy_report.movement:
        if e.fate == K:
            assert e.why.startswith("kept physical: not a strided view: a copy kernel realises it for ")
            assert "; estimated -" in e.why


def test_greedy_census_totals(greedy_report, layer_report):
    """Three ops kept, three gathers fewer: as many ops eliminated and as many bytes moved as plan="all"."""
    r, a = greedy_report.to_dict(), layer_report.to_dict()
    assert r["plan"] == "greedy" and r["movement_ops"] == 67
    assert sum(e["fate"] == K for e in r["movement"]) == 3 and sum(e["fate"] == G for e in r["movement"]) == 0
    assert r["eliminated_movement_ops"] == a["eliminated_movement_ops"] == 64
    assert r["materialized_movement_bytes"] == a["materialized_movement_bytes"]
