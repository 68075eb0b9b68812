"""The ONNX frontend itself: folding, fallbacks, errors, OnnxCompiled's calling rules, vtc.compile."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import vtc
from onnx_helpers import check, model, node, ort_run
from vtc.frontend.onnx import OnnxCompiled, compile_onnx, import_onnx
from vtc.ir.verify import verify

R = np.random.default_rng(3)


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def i64(*v):
    return np.array(v, dtype=np.int64)


def shape_subgraph_model():
    """x: [batch, seq, 8] -> Reshape(x, Concat(Shape(x)[0], Shape(x)[1], 2, -1)) -> Relu."""
    nodes = [node("Shape", ["x"], ["s"], name="shape"),
             node("Gather", ["s", "zero"], ["b"], name="g0", axis=0),
             node("Gather", ["s", "one"], ["t"], name="g1", axis=0),
             node("Unsqueeze", ["b", "ax"], ["b1"], name="u0"),
             node("Unsqueeze", ["t", "ax"], ["t1"], name="u1"),
             node("Concat", ["b1", "t1", "tail"], ["shp"], name="cat", axis=0),
             node("Reshape", ["x", "shp"], ["r"], name="reshape"),
             node("Relu", ["r"], ["y"], name="relu")]
    inits = {"zero": np.array(0, np.int64), "one": np.array(1, np.int64), "ax": i64(0), "tail": i64(2, -1)}
    x = f32(2, 3, 8)
    return model(nodes, {"x": x}, ["y"], inits, dims={"x": ["batch", "seq", 8]}), x


def test_shape_subgraph_is_folded():
    m, x = shape_subgraph_model()
    c = check(m, {"x": x})
    assert [n.op for n in c.graph.nodes] == ["aten.view.default", "aten.relu.default"]
    reshape = c.graph.nodes[0]
    assert reshape.kind == "movement" and reshape.args[1] == [2, 3, 2, 4]
    assert c.graph.meta["onnx_node_of"][reshape.name] == "reshape"
    assert not any(v.name == "s" for v in c.graph.consts)  # nothing of the shape arithmetic is left
    verify(c.graph, deep=True)


def test_symbolic_dims_specialise_per_shape():
    m, x = shape_subgraph_model()
    c = compile_onnx(m, backend="torch", dims={"batch": 2, "seq": 3})
    assert c.graph.inputs[0].shape == (2, 3, 8)
    x2 = f32(4, 5, 8)
    (got,) = c(x2)  # new sizes: specialised again, folded for them
    np.testing.assert_array_equal(got, ort_run(m, {"x": x2})[0])
    assert c.graph.inputs[0].shape == (2, 3, 8)  # .graph stays the first specialisation
    with pytest.raises(ValueError, match="symbolic dims.*'seq'"):
        compile_onnx(m, backend="torch", dims={"batch": 2})
    g = import_onnx(m, {"x": (1, 7, 8)})
    assert g.nodes[0].args[1] == [1, 7, 2, 4]


def test_constant_inputs_fold_everything_even_unknown_ops():
    """Range/ConstantOfShape/Det on constants are evaluated at compile time: no node is left for them."""
    nodes = [node("Range", ["a", "b", "d"], ["r"], name="range"),
             node("ConstantOfShape", ["shp"], ["z"], name="cos",
                  value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5])),
             node("Det", ["m"], ["det"], name="det"),
             node("Mul", ["r", "det"], ["rd"], name="mul0"),
             node("Add", ["z", "rd"], ["zr"], name="add0"),
             node("Add", ["x", "zr"], ["y"], name="add1")]
    inits = {"a": np.array(0.5, np.float32), "b": np.array(3.0, np.float32), "d": np.array(0.75, np.float32),
             "shp": i64(4), "m": np.array([[2, 1], [1, 3]], np.float32)}
    x = f32(4)
    c = check(m := model(nodes, {"x": x}, ["y"], inits), {"x": x})
    assert [n.op for n in c.graph.nodes] == ["aten.add.Tensor"]
    assert c.report.fallback_ops == []
    np.testing.assert_allclose(c.graph.consts[0].data.numpy(), ort_run(m, {"x": np.zeros(4, np.float32)})[0])


def test_unknown_standard_op_runs_through_onnxruntime():
    x = f32(2, 3, 3)
    nodes = [node("Transpose", ["x"], ["t"], name="t", perm=[0, 2, 1]),
             node("Hardmax", ["t"], ["h"], name="hardmax", axis=-1),
             node("Det", ["x"], ["d"], name="det"),
             node("Unsqueeze", ["d", "ax"], ["d1"], name="u"),
             node("Add", ["h", "d1"], ["y"], name="add")]
    m = model(nodes, {"x": x}, ["y"], {"ax": i64(1, 2)})
    c = check(m, {"x": x})
    assert c.report.fallback_ops == ["onnx.Hardmax", "onnx.Det"]
    assert "fallback ops (run by the framework): onnx.Det, onnx.Hardmax" in c.report.summary()
    reasons = c.graph.meta["fallback_reasons"]
    assert reasons["hardmax"] == "vtc does not lower ONNX op Hardmax"
    assert c.graph.nodes[0].kind == "movement"  # the transpose read by Hardmax is still a movement op
    assert "onnx.Hardmax(" in str(c.graph)


def test_op_that_a_handler_declines_falls_back():
    x = f32(2, 3)
    m = model([node("ScatterND", ["x", "i", "u"], ["y"], name="sc", reduction="mul")], {"x": x}, ["y"],
              {"i": i64(1).reshape(1, 1), "u": f32(1, 3)})
    c = check(m, {"x": x})
    assert c.report.fallback_ops == ["onnx.ScatterND"]
    assert "reduction='mul'" in c.graph.meta["fallback_reasons"]["sc"]


def test_contrib_op_runs_through_onnxruntime():
    x, b = f32(2, 3, 8), f32(8)
    m = model([node("BiasGelu", ["x", "b"], ["y"], name="bg", domain="com.microsoft")], {"x": x, "b": b}, ["y"],
              domains={"com.microsoft": 1}, out_shapes={"y": [2, 3, 8]})
    c = check(m, {"x": x, "b": b}, rtol=1e-5, atol=1e-5)
    assert c.report.fallback_ops == ["onnx.com.microsoft.BiasGelu"]


def test_custom_op_onnxruntime_cannot_run_is_a_clear_error():
    x = f32(2, 3)
    m = model([node("Relu", ["x"], ["r"], name="relu"),
               node("FancyOp", ["r"], ["y"], name="fancy1", domain="my.ops")], {"x": x}, ["y"],
              domains={"my.ops": 1}, out_shapes={"y": [2, 3]})
    with pytest.raises(ValueError, match=r"node 'fancy1': op FancyOp \(domain 'my.ops'\) is not known to vtc "
                                         r"and onnxruntime cannot run it either"):
        compile_onnx(m, {"x": x})


def test_malformed_model_names_the_node():
    x = f32(2, 3)
    g = helper.make_graph([node("Relu", ["x"], ["r"], name="ok"), node("Add", ["r", "nowhere"], ["y"], name="bad")],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(ValueError) as e:
        vtc.compile(m, (x,))
    msg = str(e.value)
    assert "onnx.checker" in msg and "node 'bad', op Add" in msg and "'nowhere'" in msg
    with pytest.raises(FileNotFoundError):
        compile_onnx("/no/such/model.onnx")


def test_errors_name_the_bad_value():
    x = f32(2, 3)
    m = model([node("Reshape", ["x", "s"], ["y"], name="rs")], {"x": x, "s": i64(3, 2)}, ["y"])
    with pytest.raises(ValueError, match=r"node 'rs' \(Reshape\): input 'shape' must be a compile-time constant"):
        compile_onnx(m, {"x": x, "s": i64(3, 2)})
    m = model([node("Transpose", ["x"], ["y"], name="tr", perm=[0, 0])], {"x": x}, ["y"], out_shapes={"y": [2, 2]})
    with pytest.raises(ValueError, match=r"node 'tr' \(Transpose\): perm \[0, 0\] is not a permutation"):
        compile_onnx(m, {"x": x})


def test_calling_conventions():
    a, b = f32(2, 3), f32(2, 3)
    m = model([node("Add", ["a", "b"], ["s"], name="add"), node("Transpose", ["s"], ["t"], name="tr")],
              {"a": a, "b": b}, ["s", "t"])
    c = compile_onnx(m, (a, b), backend="torch")
    assert isinstance(c, OnnxCompiled) and c.input_names == ["a", "b"] and c.output_names == ["s", "t"]
    s, t = c(a, b)  # positional numpy -> a list of numpy arrays in output order
    assert isinstance(s, np.ndarray) and t.shape == (3, 2)
    np.testing.assert_allclose(s, a + b)
    s2, t2 = c({"b": b, "a": a})  # by name
    np.testing.assert_array_equal(t2, t)
    st, tt = c(torch.from_numpy(a), torch.from_numpy(b))  # torch in -> torch out
    assert isinstance(st, torch.Tensor) and torch.equal(tt, torch.from_numpy(t))
    with pytest.raises(TypeError, match=r"input 'b': expected dtype torch.float32, received torch.float64"):
        c(a, b.astype(np.float64))
    with pytest.raises(TypeError, match="takes 2 inputs"):
        c(a)
    with pytest.raises(ValueError, match=r"input 'a': dim 0 must be 2"):
        c(f32(3, 3), f32(3, 3))
    with pytest.raises(TypeError, match="missing \\['b'\\]"):
        c({"a": a})
    s3, _ = c(b=b, a=a)  # by name as keywords (was: "got an unexpected keyword argument 'b'")
    np.testing.assert_array_equal(s3, s)
    with pytest.raises(TypeError, match="either positionally or by name"):
        c(a, b=b)
    assert "OnnxCompiled" in repr(c)


def test_vtc_compile_routes_onnx(tmp_path):
    x = f32(2, 3)
    m = model([node("Transpose", ["x"], ["y"], name="tr")], {"x": x}, ["y"])
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    for src in (m, str(path), path):
        c = vtc.compile(src, (x,), backend="torch")
        assert isinstance(c, OnnxCompiled)
        np.testing.assert_array_equal(c(x)[0], x.T)
    c = vtc.compile(path, example_kwargs={"x": x}, plan="none", backend="torch")
    assert c.report.plan == "none"
    with pytest.raises(TypeError, match="unknown vtc.compile option"):
        vtc.compile(m, (x,), nonsense=1)
    with pytest.raises(TypeError, match="path ending in .onnx"):
        vtc.compile("model.pt", ())
