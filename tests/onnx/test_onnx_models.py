"""Real models exported with torch.onnx.export, compiled by vtc and compared with onnxruntime.

torch 2.13's exporter is ``dynamo=True`` (torch.export + onnxscript); the
TorchScript exporter (``dynamo=False``) still works for some models and gives
graphs full of shape arithmetic (Shape, Gather, ConstantOfShape, Range, Where),
which exercises compile-time folding.  These run with the default backend
(generated C++ kernels).
"""
from __future__ import annotations

import io
import logging
import warnings

import numpy as np
import onnx
import pytest
import torch

from onnx_helpers import ort_run
from vtc import zoo
from vtc.frontend.onnx import compile_onnx

TOL = dict(rtol=1e-4, atol=1e-4)


def export(name: str, dynamo: bool = True):
    """(ModelProto, numpy feeds) of zoo model `name` (tiny), random inputs that are never all zeros."""
    torch.manual_seed(0)
    m, inputs = zoo.load(name, size="tiny")
    for t in inputs:
        assert t.float().abs().sum() > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        if dynamo:
            proto = torch.onnx.export(m, inputs, dynamo=True, verbose=False).model_proto
        else:
            f = io.BytesIO()
            torch.onnx.export(m, inputs, f, dynamo=False)
            proto = onnx.load_from_string(f.getvalue())
    names = [i.name for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]
    return proto, {n: t.numpy() for n, t in zip(names, inputs)}


# dynamo export costs 2-10 s a model (swin the most), the TorchScript one well under a second: the
# dynamo exporter covers llama_layer and gpt2 (gpt2 only exports that way: aten::diff), TorchScript the others
@pytest.mark.parametrize("name,dynamo", [("llama_layer", True), ("gpt2", True), ("shufflenet", False),
                                         ("swin", False)],
                         ids=["llama_layer", "gpt2", "shufflenet-torchscript", "swin-torchscript"])
def test_exported_model_matches_onnxruntime(name, dynamo):
    proto, feeds = export(name, dynamo)
    want = ort_run(proto, feeds)
    c = compile_onnx(proto, feeds)
    got = c(feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, **TOL)
    r = c.report
    assert r.fallback_ops == [], c.graph.meta["fallback_reasons"]
    assert r.movement_ops > 0 and r.eliminated_movement_ops > r.movement_ops // 2, r.summary()
    ops = {n.op_type for n in proto.graph.node}
    shape_nodes = {n.name for n in proto.graph.node if n.op_type in ("Shape", "ConstantOfShape", "Range")}
    assert not shape_nodes & set(c.graph.meta["onnx_node_of"].values())  # folded away
    if name == "swin" and not dynamo:
        assert {"Shape", "ConstantOfShape", "Range"} <= ops  # there was shape arithmetic to fold
    assert not c.graph.meta["shape_notes"]
    if name == "llama_layer":  # the same graph on the torch backend, planned all / none / oracle
        t = c.replan(backend="torch")
        for options in ({}, {"plan": "none"}, {"oracle": True}):
            for g, w in zip(t.replan(**options)(feeds), want):
                np.testing.assert_allclose(g, w, **TOL)
        none = t.replan(plan="none").report
        assert none.eliminated_movement_ops == 0
        assert t.report.materialized_movement_bytes < none.materialized_movement_bytes
