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
from vtc.plan.virtualize import chain_of
from vtc.plan.cost import machine

V, S, G = "virtual", "view", "gather"
EXPECTED = [  # (ATen op, fate) in graph order, plan="all", with the default CPU backend (generated kernels)
    # rotary embedding: the cos/sin tables (inv_freq's outer product with the position ids, its cat) are
    # computed from a buffer and constants only, so they are folded into constants once
    # (vtc.ir.fold.fold_weight_chains); the unsqueezes of cos and sin are read by the RoPE kernels
    ("unsqueeze", V), ("unsqueeze", V), ("unsqueeze", V), ("unsqueeze", V),
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
    # scores = q @ k^T -> scale -> mask -> softmax -> probs @ v is one attention kernel
    # (vtc.codegen.attention): q, the expanded K^T and V and the probabilities are read through their
    # mappings inside it (before it, q and probs were views for torch's bmm and K^T, V two gathers);
    # the eval-mode dropout on the probabilities is no op in the captured graph (vtc.frontend.fx_capture)
    ("permute", V), ("expand", V), ("clone", V), ("view", V), ("expand", V), ("view", V),
    ("view", V), ("expand", V), ("view", V), ("expand", V), ("view", V),
    # attention output: heads back to [B*S, H] for o_proj, packed by o_proj's generated GEMM (was a
    # 4 KB gather before torch's mm)
    ("view", V), ("permute", V), ("clone", V), ("view", V), ("permute", V), ("view", V), ("view", V),
    # MLP: gate, up, down projections
    ("permute", S), ("view", S), ("view", V), ("permute", S), ("view", S), ("view", V),
    ("permute", S), ("view", S), ("view", V),
]


@pytest.fixture(scope="module")
def layer_compiled():
    model, inputs = zoo.load("llama_layer", size="tiny")
    compiled = vtc.compile(model, inputs, plan="all")
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
    return compiled


@pytest.fixture(scope="module")
def layer_report(layer_compiled):
    return layer_compiled.report


def test_census_op_by_op(layer_report):
    got = [(e.op.split(".")[1], e.fate) for e in layer_report.movement]
    assert len(got) == len(EXPECTED)
    for k, (g, e) in enumerate(zip(got, EXPECTED)):
        assert g == e, f"movement op #{k} ({layer_report.movement[k].node}): got {g}, expected {e}"


def test_census_totals(layer_report):
    r = layer_report.to_dict()
    assert r["movement_ops"] == len(EXPECTED) == 62
    assert r["eliminated_movement_ops"] == sum(f != G for _, f in EXPECTED) == 62
    assert r["fallback_ops"] == []
    gathered = sum(c["bytes"] for c in r["chains"] if c["realized_as"] == "gather")
    assert r["materialized_movement_bytes"] == gathered == 0  # 12 KB with gemm="torch"
    assert [g["choice"] for g in r["gemm"]] == ["torch"] * 3 + ["vtc"] + ["torch"] * 3  # o_proj; the bmm are attention


def test_gqa_key_is_read_through_the_head_mapping(layer_compiled):
    """repeat_kv of K then transpose: query head h reads KV head h // 2, no expanded copy in between."""
    spec = layer_compiled._first
    assert "view_12" not in {c.value for c in spec.report.chains}  # never realised: the attention kernel reads it
    assert str(spec.plan.mappings["view_12"]).endswith("add_2[(i0 // 4), ((i0 // 2) % 2), i2, i1]")
    attn = [s.kernel.step.kernel for s in spec.executor.steps
            if s.kind == "kernel" and s.kernel.step.kernel.kind == "attention"]
    assert [k.source_nodes for k in attn] == [["bmm", "view_13", "mul_9", "add_3", "_softmax", "bmm_1"]]
    assert "add_2" in {b.name for b in attn[0].inputs}  # the un-expanded K (after RoPE), read in place


K = "kept"
# plan="greedy" (the default) makes the same choice as plan="all" for every op of this layer: the repeated
# K and V and the attention output's head merge, which the greedy kept physical while torch's bmm/mm read
# them (torch's own copy was estimated a little cheaper than a copy kernel with div/mod index arithmetic),
# are now read by generated kernels (the attention kernel, o_proj's GEMM) that pack them through their
# mappings, so removing them saves their whole copy.  One difference since session 17: the head merge
# (clone_3) is pushed into the attention kernel, which stores [B, S, H, D], so o_proj's GEMM reads a plain A
# (vtc.codegen.push.merged_heads_reader); the views after it are then views of that buffer.
GREEDY: dict[str, str] = {"clone_3": "pushed", "permute_8": "view", "view_18": "view"}


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


def test_greedy_census_totals(greedy_report, layer_report):
    """Nothing kept: as many ops eliminated and as many bytes moved (none) as plan="all"."""
    r, a = greedy_report.to_dict(), layer_report.to_dict()
    assert r["plan"] == "greedy" and r["movement_ops"] == 62
    assert sum(e["fate"] == K for e in r["movement"]) == 0 and sum(e["fate"] == G for e in r["movement"]) == 0
    assert r["eliminated_movement_ops"] == a["eliminated_movement_ops"] == 62
    assert r["materialized_movement_bytes"] == a["materialized_movement_bytes"] == 0
