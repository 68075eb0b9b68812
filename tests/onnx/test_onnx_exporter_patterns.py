"""What ONNX exporters write differently from torch.export, lowered to the graph torch.export gives.

bench/onnx_side_by_side.py compares vtc from an exported ONNX file with vtc from the torch model; these are
the gaps it found (docs/onnx.md), each checked against onnxruntime and torch on random inputs, with the plan
property that made the ONNX path slower:

- a constant MatMul B [K, N] (the exporters' transposed Linear weight) and Gemm transB=1 are a Linear's
  ``t(W)`` of a constant [N, K], not a folded row-major constant, so the GEMM path matches the torch path's
  (decode's skinny GEMM reads W's rows in place instead of going to the library);
- Transpose -> ScatterND -> Transpose back (the dynamo exporter's KV-cache update on the sequence dim) is
  ``index_put(cache, [None, None, positions], new)`` with no permute left, as torch.export gives it;
- two Transposes compose into one permute, and none when they cancel;
- Pow with a constant exponent is ``pow.Tensor_Scalar`` (x * x in the kernel, not a scalar std::pow).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vtc
from onnx_helpers import check, model, node, ort_run
from vtc.frontend.onnx import compile_onnx

A = torch.ops.aten
rng = np.random.default_rng(0)


def _randn(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _gemm_paths(report):
    return [(g["choice"], g.get("path")) for g in report.to_dict()["gemm"]]


def _weight_read_as_t(c, n_rows, k):
    """The GEMM's B is permute([1, 0]) of a constant [N, K] (a Linear's t(W)), not a folded [K, N] constant."""
    (mm,) = [n for n in c.graph.nodes if n.op in ("aten.mm.default", "aten.addmm.default")]
    b = mm.args[2] if mm.op == "aten.addmm.default" else mm.args[1]
    assert b.producer is not None and b.producer.op == "aten.permute.default", b
    w = b.producer.args[0]
    assert w.kind == "const" and w.shape == (n_rows, k)


@pytest.mark.parametrize("m_rows", [1, 16])
def test_matmul_constant_b_is_linear_weight(m_rows):
    k, n = 512, 384
    x, w = _randn(1, m_rows, k), _randn(k, n, scale=0.05)
    m = model([node("MatMul", ["x", "w"], ["y"])], {"x": x}, ["y"], {"w": w})
    c = check(m, {"x": x}, rtol=1e-4, atol=1e-4, backend="cpu", plan="greedy")
    np.testing.assert_allclose(c({"x": x})[0], (torch.from_numpy(x) @ torch.from_numpy(w)).numpy(),
                               rtol=1e-4, atol=1e-4)
    _weight_read_as_t(c, n, k)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = torch.from_numpy(np.ascontiguousarray(w.T))
    assert _gemm_paths(c.report) == _gemm_paths(vtc.compile(lin, (torch.from_numpy(x),)).report)


def test_matmul_shared_constant_b_is_transposed_once():
    x, w = _randn(4, 64), _randn(64, 32, scale=0.1)
    m = model([node("MatMul", ["x", "w"], ["a"], name="m1"), node("Relu", ["x"], ["r"], name="r"),
               node("MatMul", ["r", "w"], ["b"], name="m2")], {"x": x}, ["a", "b"], {"w": w})
    c = check(m, {"x": x}, rtol=1e-5, atol=1e-5)
    perms = [n for n in c.graph.nodes if n.op == "aten.permute.default"]
    assert len(perms) == 2 and perms[0].args[0] is perms[1].args[0]  # one W^T constant for both
    assert len(c.graph.consts) == 1


@pytest.mark.parametrize("bias", [True, False])
def test_gemm_transb_reads_weight_in_place(bias):
    k, n = 256, 200
    x, w, b = _randn(1, k), _randn(n, k, scale=0.05), _randn(n)
    inits = {"w": w, **({"b": b} if bias else {})}
    m = model([node("Gemm", ["x", "w"] + (["b"] if bias else []), ["y"], transB=1)], {"x": x}, ["y"], inits)
    c = check(m, {"x": x}, rtol=1e-4, atol=1e-4, backend="cpu", plan="greedy")
    want = torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b) if bias else None)
    np.testing.assert_allclose(c({"x": x})[0], want.numpy(), rtol=1e-4, atol=1e-4)
    _weight_read_as_t(c, n, k)
    (const,) = [v for v in c.graph.consts if v.shape == (n, k)]
    assert torch.equal(const.data, torch.from_numpy(w))  # W itself, not a transposed copy
    lin = torch.nn.Linear(k, n, bias=bias)
    lin.weight.data = torch.from_numpy(w)
    if bias:
        lin.bias.data = torch.from_numpy(b)
    assert _gemm_paths(c.report) == _gemm_paths(vtc.compile(lin, (torch.from_numpy(x),)).report)


def _kv_update_model(cache, pos, new):
    """The dynamo exporter's cache[:, :, pos] = new: Transpose, Unsqueeze, ScatterND, Transpose back."""
    nodes = [node("Transpose", ["cache"], ["ct"], name="t1", perm=[2, 0, 1, 3]),
             node("Unsqueeze", ["pos", "axes"], ["idx"], name="u"),
             node("Transpose", ["new"], ["nt"], name="t2", perm=[2, 0, 1, 3]),
             node("ScatterND", ["ct", "idx", "nt"], ["st"], name="s"),
             node("Transpose", ["st"], ["updated"], name="t3", perm=[1, 2, 0, 3]),
             node("ReduceSum", ["updated", "ax"], ["total"], name="r", keepdims=0)]
    return model(nodes, {"cache": cache, "pos": pos, "new": new}, ["updated", "total"],
                 {"axes": np.array([-1], np.int64), "ax": np.array([2], np.int64)})


def test_scatternd_through_transposes_is_index_put():
    h, s, d, n = 4, 32, 16, 3
    cache, new = _randn(1, h, s, d), _randn(1, h, n, d)
    pos = rng.permutation(s)[:n].astype(np.int64)
    feeds = {"cache": cache, "pos": pos, "new": new}
    c = check(_kv_update_model(cache, pos, new), feeds, backend="cpu", plan="greedy")
    want = torch.from_numpy(cache).clone()
    want[:, :, torch.from_numpy(pos)] = torch.from_numpy(new)
    got = c(feeds)
    np.testing.assert_allclose(got[0], want.numpy(), rtol=0, atol=0)
    np.testing.assert_allclose(got[1], want.sum(2).numpy(), rtol=1e-5, atol=1e-5)
    assert not [n for n in c.graph.nodes if n.op == "aten.permute.default"]
    (put,) = [n for n in c.graph.nodes if n.op == "aten.index_put.default"]
    cache_v, pos_v, _ = c.graph.inputs
    assert put.args[0] is cache_v and put.args[1][:2] == [None, None] and put.args[1][2] is pos_v

    def torch_fn(cache, pos, new):
        out = torch.ops.aten.index_put(cache, [None, None, pos], new)
        return out, out.sum(2)

    t = vtc.compile(torch_fn, tuple(torch.from_numpy(feeds[k]) for k in ("cache", "pos", "new")))
    assert c.report.materialized_movement_bytes == t.report.materialized_movement_bytes


def test_scatternd_through_transpose_with_runtime_update_layout():
    """The update is not itself a Transpose: it is permuted into the cache's layout (a virtual permute)."""
    h, s, d, n = 2, 8, 4, 2
    cache = _randn(1, h, s, d)
    upd = _randn(n, 1, h, d)
    pos = np.array([5, 1], np.int64)
    nodes = [node("Transpose", ["cache"], ["ct"], name="t1", perm=[2, 0, 1, 3]),
             node("Unsqueeze", ["pos", "axes"], ["idx"], name="u"),
             node("ScatterND", ["ct", "idx", "upd"], ["st"], name="s")]
    m = model(nodes, {"cache": cache, "pos": pos, "upd": upd}, ["st"], {"axes": np.array([1], np.int64)})
    c = check(m, {"cache": cache, "pos": pos, "upd": upd})
    want = torch.from_numpy(cache).permute(2, 0, 1, 3).clone()
    want[torch.from_numpy(pos)] = torch.from_numpy(upd)
    np.testing.assert_array_equal(c({"cache": cache, "pos": pos, "upd": upd})[0], want.numpy())
    (put,) = [n for n in c.graph.nodes if n.op == "aten.index_put.default"]
    assert put.args[0] is c.graph.inputs[0]


def test_transposes_compose_and_cancel():
    x = _randn(2, 3, 4, 5)
    m = model([node("Relu", ["x"], ["r"], name="relu"),
               node("Transpose", ["r"], ["a"], name="t1", perm=[0, 2, 3, 1]),
               node("Transpose", ["a"], ["b"], name="t2", perm=[0, 3, 1, 2]),
               node("Transpose", ["a"], ["c"], name="t3", perm=[3, 0, 2, 1])], {"x": x}, ["r", "b", "c"])
    c = check(m, {"x": x}, rtol=0, atol=0)
    got = c({"x": x})
    r = np.maximum(x, 0)
    np.testing.assert_array_equal(got[1], r)
    np.testing.assert_array_equal(got[2], r.transpose(0, 2, 3, 1).transpose(3, 0, 2, 1))
    perms = [n for n in c.graph.nodes if n.op == "aten.permute.default"]
    assert len(perms) == 1 and perms[0].args[0].producer.op == "aten.relu.default"
    m2 = model([node("Transpose", ["x"], ["a"], name="t1", perm=[1, 0, 2, 3]),
                node("Transpose", ["a"], ["b"], name="t2", perm=[1, 0, 2, 3])], {"x": x}, ["b"])
    c2 = check(m2, {"x": x}, rtol=0, atol=0)  # cancels to the input itself: returned through an alias
    assert [n.op for n in c2.graph.nodes] == ["aten.alias.default"]
    assert perms[0].args[1] == [1, 0, 3, 2]


@pytest.mark.parametrize("e", [2.0, 3.0, 0.5, -1.0, 1.7])
def test_pow_constant_exponent_is_scalar(e):
    x = np.abs(_randn(3, 40)) + 0.1
    m = model([node("Pow", ["x", "e"], ["y"])], {"x": x}, ["y"], {"e": np.array(e, np.float32)})
    c = check(m, {"x": x}, rtol=1e-5, atol=1e-6, backend="cpu", plan="greedy")
    np.testing.assert_allclose(c({"x": x})[0], (torch.from_numpy(x) ** e).numpy(), rtol=1e-5, atol=1e-6)
    (p,) = [n for n in c.graph.nodes if n.op.startswith("aten.pow")]
    assert p.op == "aten.pow.Tensor_Scalar" and p.args[1] == float(np.float32(e))


def test_pow_broadcasting_exponent_keeps_tensor_form():
    """A one-element exponent of higher rank than x broadcasts x up: it stays Tensor_Tensor."""
    x = np.abs(_randn(4)) + 0.1
    m = model([node("Pow", ["x", "e"], ["y"])], {"x": x}, ["y"], {"e": np.full((1, 1), 2.0, np.float32)})
    c = check(m, {"x": x})
    assert c({"x": x})[0].shape == (1, 4)
    assert ort_run(m, {"x": x})[0].shape == (1, 4)


# ----------------------------------------------------------------------------- onnxruntime's fused norms
# onnxruntime.transformers.optimizer rewrites an exported Llama's RMSNorms into SimplifiedLayerNormalization
# (ONNX domain: onnx.checker has no schema for it) and SkipSimplifiedLayerNormalization (residual add + norm);
# vtc refused such a file (the checker) and would have run the ops through onnxruntime


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_simplified_layer_norm_lowered_like_torch_rmsnorm():
    x, w = _randn(2, 5, 64), _randn(64)
    m = model([node("SimplifiedLayerNormalization", ["x", "w"], ["y"], axis=-1, epsilon=1e-6),
               node("Relu", ["y"], ["r"], name="relu")], {"x": x}, ["r"], {"w": w}, out_shapes={"r": [2, 5, 64]})
    c = check(m, {"x": x}, rtol=1e-5, atol=1e-5, backend="cpu", plan="greedy")
    want = torch.relu(_rms(torch.from_numpy(x), torch.from_numpy(w), 1e-6))
    np.testing.assert_allclose(c({"x": x})[0], want.numpy(), rtol=1e-5, atol=1e-5)
    assert c.report.fallback_ops == []
    t = vtc.compile(lambda x: torch.relu(_rms(x, torch.from_numpy(w), 1e-6)), (torch.from_numpy(x),))
    assert c.report.kernels == t.report.kernels


def test_rms_normalization_opset23():
    x, w = _randn(3, 2, 16), _randn(2, 16)
    m = model([node("RMSNormalization", ["x", "w"], ["y"], axis=1, epsilon=1e-5)], {"x": x}, ["y"], {"w": w},
              opset=23)
    c = check(m, {"x": x}, rtol=1e-5, atol=1e-5)
    xt = torch.from_numpy(x)
    want = xt * torch.rsqrt(xt.pow(2).mean((1, 2), keepdim=True) + 1e-5) * torch.from_numpy(w)
    np.testing.assert_allclose(c({"x": x})[0], want.numpy(), rtol=1e-5, atol=1e-5)
    assert c.report.fallback_ops == []


@pytest.mark.parametrize("bias", [False, True])
def test_skip_simplified_layer_norm(bias):
    x, skip, w, b = _randn(1, 7, 32), _randn(1, 7, 32), _randn(32), _randn(32)
    ins = ["x", "skip", "w"] + (["b"] if bias else [])
    m = model([node("SkipSimplifiedLayerNormalization", ins, ["y", "", "", "sum"], domain="com.microsoft",
                    epsilon=1e-5)],
              {"x": x, "skip": skip}, ["y", "sum"], {"w": w, **({"b": b} if bias else {})},
              domains={"com.microsoft": 1}, out_shapes={"y": [1, 7, 32], "sum": [1, 7, 32]})
    c = check(m, {"x": x, "skip": skip}, rtol=1e-5, atol=1e-5)
    s = torch.from_numpy(x) + torch.from_numpy(skip) + (torch.from_numpy(b) if bias else 0)
    got = c({"x": x, "skip": skip})
    np.testing.assert_allclose(got[0], _rms(s, torch.from_numpy(w), 1e-5).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], s.numpy(), rtol=1e-6, atol=1e-6)
    assert c.report.fallback_ops == []


@pytest.mark.parametrize("beta,bias", [(True, True), (False, False)])
def test_skip_layer_norm(beta, bias):
    x, skip, g, bt, b = _randn(2, 3, 48), _randn(2, 3, 48), _randn(48), _randn(48), _randn(48)
    ins = ["x", "skip", "g", "bt" if beta else "", "b" if bias else ""]
    inits = {"g": g, **({"bt": bt} if beta else {}), **({"b": b} if bias else {})}
    m = model([node("SkipLayerNormalization", ins, ["y"], domain="com.microsoft")], {"x": x, "skip": skip},
              ["y"], inits, domains={"com.microsoft": 1}, out_shapes={"y": [2, 3, 48]})
    c = check(m, {"x": x, "skip": skip}, rtol=1e-4, atol=1e-4)  # default epsilon: onnxruntime's
    s = torch.from_numpy(x) + torch.from_numpy(skip) + (torch.from_numpy(b) if bias else 0)
    want = torch.nn.functional.layer_norm(s, [48], torch.from_numpy(g), torch.from_numpy(bt) if beta else None,
                                          1e-12)
    np.testing.assert_allclose(c({"x": x, "skip": skip})[0], want.numpy(), rtol=1e-4, atol=1e-4)
    assert c.report.fallback_ops == []


def test_skip_layer_norm_statistics_fall_back():
    x, skip, g = _randn(1, 2, 8), _randn(1, 2, 8), _randn(8)
    m = model([node("SkipLayerNormalization", ["x", "skip", "g"], ["y", "mean"], name="sln",
                    domain="com.microsoft")], {"x": x, "skip": skip}, ["y", "mean"], {"g": g},
              domains={"com.microsoft": 1}, out_shapes={"y": [1, 2, 8], "mean": [1, 2, 1]})
    c = check(m, {"x": x, "skip": skip})
    assert c.report.fallback_ops == ["onnx.com.microsoft.SkipLayerNormalization"]


def test_layer_norm_below_opset17_as_onnxruntime_registers_it():
    """onnxruntime's optimizer writes LayerNormalization into files of opsets that predate it (17)."""
    x, g, b = _randn(2, 6, 32), _randn(32), _randn(32)
    m = model([node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)], {"x": x}, ["y"],
              {"g": g, "b": b}, opset=14, out_shapes={"y": [2, 6, 32]})
    c = check(m, {"x": x}, rtol=1e-5, atol=1e-5)
    want = torch.nn.functional.layer_norm(torch.from_numpy(x), [32], torch.from_numpy(g), torch.from_numpy(b), 1e-5)
    np.testing.assert_allclose(c({"x": x})[0], want.numpy(), rtol=1e-5, atol=1e-5)
    assert c.report.fallback_ops == []


def _scatter_elements_model(cache, pos, new, idx_shape):
    """The TorchScript exporter's cache[:, :, pos] = new: ScatterElements with the positions expanded."""
    nodes = [node("Unsqueeze", ["pos", "axes"], ["p4"], name="u"),
             node("Expand", ["p4", "shape"], ["idx"], name="e"),
             node("ScatterElements", ["cache", "idx", "new"], ["updated"], name="s", axis=2),
             node("ReduceSum", ["updated", "ax"], ["total"], name="r", keepdims=0)]
    return model(nodes, {"cache": cache, "pos": pos, "new": new}, ["updated", "total"],
                 {"axes": np.array([0, 1, 3], np.int64), "shape": np.array(idx_shape, np.int64),
                  "ax": np.array([2], np.int64)})


def test_scatter_elements_of_expanded_positions_is_index_put():
    h, s, d, n = 4, 32, 16, 3
    cache, new = _randn(1, h, s, d), _randn(1, h, n, d)
    pos = np.array([7, -1, 0], np.int64)  # a negative position counts from the end, as in onnxruntime
    feeds = {"cache": cache, "pos": pos, "new": new}
    c = check(_scatter_elements_model(cache, pos, new, [1, h, n, d]), feeds, backend="cpu", plan="greedy")
    want = torch.from_numpy(cache).clone()
    want[:, :, torch.from_numpy(pos)] = torch.from_numpy(new)
    got = c(feeds)
    np.testing.assert_array_equal(got[0], want.numpy())
    np.testing.assert_allclose(got[1], want.sum(2).numpy(), rtol=1e-5, atol=1e-5)
    assert not [n for n in c.graph.nodes if n.op.startswith("aten.scatter")]
    (put,) = [n for n in c.graph.nodes if n.op == "aten.index_put.default"]
    cache_v, pos_v, new_v = c.graph.inputs
    assert put.args[0] is cache_v and put.args[1] == [None, None, pos_v] and put.args[2] is new_v

    def torch_fn(cache, pos, new):
        out = torch.ops.aten.index_put(cache, [None, None, pos], new)
        return out, out.sum(2)

    t = vtc.compile(torch_fn, tuple(torch.from_numpy(feeds[k]) for k in ("cache", "pos", "new")))
    assert c.report.materialized_movement_bytes == t.report.materialized_movement_bytes


def test_scatter_elements_over_part_of_a_dim_stays_scatter():
    """Indices covering only part of another dim scatter into that part only: not an index_put."""
    h, s, d, n = 2, 8, 6, 2
    cache, new = _randn(1, h, s, d), _randn(1, h, n, 3)
    pos = np.array([5, 2], np.int64)
    feeds = {"cache": cache, "pos": pos, "new": new}
    c = check(_scatter_elements_model(cache, pos, new, [1, h, n, 3]), feeds)
    want = torch.from_numpy(cache).clone()
    want[:, :, torch.from_numpy(pos), :3] = torch.from_numpy(new)
    np.testing.assert_array_equal(c(feeds)[0], want.numpy())
    assert [n for n in c.graph.nodes if n.op == "aten.scatter.src"]


def test_shape_inference_is_given_the_graph_without_its_weights(monkeypatch):
    """Import-time shape inference serializes the model it gets: the weights stay out (compile time), the
    small initializers its data propagation reads (a Reshape's shape) stay in, and the types are the same."""
    import onnx

    x, w = _randn(2, 8, 256), _randn(256, 1024, scale=0.05)  # a 1 MB weight
    m = model([node("MatMul", ["x", "w"], ["y"], name="mm"), node("Reshape", ["y", "shape"], ["r"], name="rs")],
              {"x": x}, ["r"], {"w": w, "shape": np.array([16, 32, 32], np.int64)})
    sizes, real = [], onnx.shape_inference.infer_shapes

    def spy(proto, *args, **kwargs):
        sizes.append(proto.ByteSize())
        return real(proto, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", spy)
    c = check(m, {"x": x}, rtol=1e-4, atol=1e-4)
    assert sizes and max(sizes) < 64 << 10, sizes
    np.testing.assert_allclose(c({"x": x})[0], (torch.from_numpy(x) @ torch.from_numpy(w)).reshape(16, 32, 32).numpy(),
                               rtol=1e-4, atol=1e-4)
    assert c.graph.outputs[0].shape == (16, 32, 32)
