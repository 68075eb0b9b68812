"""The movement-op census of one Llama decoder layer (transformers, GQA), op by op.

Pins what vtc does with every movement op of the layer: which are read through
mappings inside generated kernels (virtual), handed to torch's GEMMs as
zero-copy strided views, or realised by one gather (a copy kernel) of a
composed chain.  A change in the frontend, the
mappings or the simplifier that loses a view or splits a chain fails here.
"""
from __future__ import annotations

import pytest
import torch

import vtc
from vtc import zoo
from vtc.plan.virtualize import chain_of

V, S, G = "virtual", "view", "gather"
EXPECTED = [  # (ATen op, fate) in graph order, with the default CPU backend (generated kernels)
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
    # scores = q @ k^T -> scale -> mask -> softmax -> probs @ v is one attention kernel
    # (vtc.codegen.attention): q, the expanded K^T and V and the probabilities are read through their
    # mappings inside it (before it, q and probs were views for torch's bmm and K^T, V two gathers)
    ("permute", V), ("expand", V), ("clone", V), ("view", V), ("expand", V), ("view", V),
    ("view", V), ("clone", V), ("expand", V), ("view", V), ("expand", V), ("view", V),
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
    compiled = vtc.compile(model, inputs)
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
    assert r["movement_ops"] == len(EXPECTED) == 67
    assert r["eliminated_movement_ops"] == sum(f != G for _, f in EXPECTED) == 67
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
