"""Building small ONNX models and checking vtc against onnxruntime.

Op-level checks compile with ``backend="torch"`` (compute through torch, virtual
tensors realised by views and gathers): they test the frontend's lowering and
the plan, and each C++ kernel of the default ``cpu`` backend costs about a
second to build on a cold cache.  Whole models and a movement-op mix run with
the default backend (tests/onnx/test_onnx_models.py).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from vtc.frontend.onnx import compile_onnx

NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
              np.dtype(np.int32): TensorProto.INT32, np.dtype(np.bool_): TensorProto.BOOL,
              np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.float16): TensorProto.FLOAT16,
              np.dtype(np.uint8): TensorProto.UINT8}


def model(nodes, feeds: dict[str, np.ndarray], outputs, inits: dict[str, np.ndarray] | None = None,
          opset: int = 18, domains: dict[str, int] | None = None, dims: dict[str, list] | None = None,
          out_shapes: dict[str, list] | None = None):
    """A ModelProto: inputs typed like ``feeds`` (or with ``dims``), outputs typed by shape inference (or
    float32 of ``out_shapes``), initializers."""
    inputs = [helper.make_tensor_value_info(k, NP_TO_ONNX[v.dtype], (dims or {}).get(k, list(v.shape)))
              for k, v in feeds.items()]
    g = helper.make_graph(nodes, "test", inputs, [onnx.ValueInfoProto(name=o) for o in outputs],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in (domains or {}).items()]
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = 8 if opset <= 18 else 9 if opset <= 20 else 10
    inferred = onnx.shape_inference.infer_shapes(m)  # the checker wants typed outputs
    types = {v.name: v.type for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for o in m.graph.output:
        if o.name in types and types[o.name].tensor_type.elem_type:
            o.type.CopyFrom(types[o.name])
        else:
            o.type.CopyFrom(helper.make_tensor_type_proto(TensorProto.FLOAT, (out_shapes or {}).get(o.name)))
    return m


def node(op_type, inputs, outputs, name="op", **attrs):
    return helper.make_node(op_type, inputs, outputs, name=name, **attrs)


def ort_run(m, feeds):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


OP_BACKEND = "torch"


def check(m, feeds, rtol=1e-5, atol=1e-5, **options):
    """Compiles m with vtc, runs it and onnxruntime on feeds, asserts equal outputs; returns the compiled."""
    want = ort_run(m, feeds)
    options.setdefault("backend", OP_BACKEND)
    options.setdefault("plan", "all")  # the ONNX tests check every mapping, whatever the default planner keeps
    c = compile_onnx(m, feeds, **options)
    got = c(feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, np.ndarray)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    assert not c.graph.meta["shape_notes"]
    return c


def nodes_of(c, onnx_name="op"):
    """The graph nodes lowered from ONNX node `onnx_name`."""
    of = c.graph.meta["onnx_node_of"]
    return [n for n in c.graph.nodes if of[n.name] == onnx_name]


def fates(c, onnx_name="op"):
    """{graph node name: fate} of the movement nodes lowered from `onnx_name`."""
    names = {n.name for n in nodes_of(c, onnx_name)}
    return {e.node: e.fate for e in c.report.movement if e.node in names}


def assert_virtual_movement(c, onnx_name="op", allow=()):
    """Every node lowered from `onnx_name` is a movement op that the plan did not keep physical."""
    ns = nodes_of(c, onnx_name)
    assert ns, f"nothing lowered from {onnx_name}"
    for n in ns:
        if n.op in allow:
            continue
        assert n.kind == "movement", (n.name, n.op, n.kind)
    f = fates(c, onnx_name)
    assert f and all(v != "kept" for v in f.values()), f
    return ns
