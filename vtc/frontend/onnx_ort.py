"""onnxruntime as the ONNX frontend's fallback, and the ONNX <-> torch dtype tables.

An ONNX op that the op table (``vtc.frontend.onnx_ops``) does not lower to ATen
runs as a *one-node ONNX model* through onnxruntime: ``OrtOp`` builds that model
(the node with its inputs renamed ``x0, x1, ...`` and outputs ``y0, y1, ...``,
the original model's opset imports, input types and static shapes), opens an
``onnxruntime.InferenceSession`` (cached by the model's bytes, one thread) and is
called on torch tensors.  Its ``__name__`` is ``onnx.<OpType>`` (or
``onnx.<domain>.<OpType>`` outside the default domain), which is what the graph
IR and the report print as the node's op.  An op that onnxruntime cannot run
either (an unregistered custom-domain op) raises ``ValueError`` naming the node,
the op and its domain when the session is built, i.e. at compile time.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

# ONNX element type -> torch dtype (types torch lacks, strings and float8s, are absent)
ONNX_TO_TORCH: dict[int, torch.dtype] = {
    TensorProto.FLOAT: torch.float32, TensorProto.DOUBLE: torch.float64, TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16, TensorProto.INT8: torch.int8, TensorProto.INT16: torch.int16,
    TensorProto.INT32: torch.int32, TensorProto.INT64: torch.int64, TensorProto.UINT8: torch.uint8,
    TensorProto.UINT16: torch.uint16, TensorProto.UINT32: torch.uint32, TensorProto.UINT64: torch.uint64,
    TensorProto.BOOL: torch.bool, TensorProto.COMPLEX64: torch.complex64, TensorProto.COMPLEX128: torch.complex128,
}
TORCH_TO_ONNX: dict[torch.dtype, int] = {v: k for k, v in ONNX_TO_TORCH.items()}

# ops whose results are random: never folded, always run (by onnxruntime)
NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                              "Multinomial", "Bernoulli"})
# ops whose output shape depends on input *values*: vtc's graphs have static shapes
DATA_DEPENDENT = frozenset({"NonZero", "Unique", "Compress", "NonMaxSuppression", "StringSplit",
                            "RegexFullMatch", "Loop", "Scan", "If", "SequenceMap", "Optional"})


def torch_dtype(elem_type: int, what: str) -> torch.dtype:
    """The torch dtype of an ONNX element type; ValueError naming ``what`` when torch has none."""
    dt = ONNX_TO_TORCH.get(elem_type)
    if dt is None:
        name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type
        raise ValueError(f"{what}: ONNX element type {name} is not supported by vtc "
                         f"(supported: {sorted(TensorProto.DataType.Name(k) for k in ONNX_TO_TORCH)})")
    return dt


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as a numpy array (bfloat16 is widened to float32, which numpy lacks)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def from_numpy(a) -> torch.Tensor:
    """A numpy array (or scalar) as a torch tensor that owns writable memory."""
    a = np.asarray(a)
    if not a.flags.writeable or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a).copy()
    return torch.from_numpy(a)


_SESSIONS: dict[bytes, "object"] = {}
_SESSIONS_LOCK = threading.Lock()


def session(model_bytes: bytes):
    """An onnxruntime session for a serialized model, cached by its bytes (one intra-op thread)."""
    import onnxruntime as ort

    with _SESSIONS_LOCK:
        s = _SESSIONS.get(model_bytes)
    if s is None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        s = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
        with _SESSIONS_LOCK:
            _SESSIONS[model_bytes] = s
    return s


class OrtOp:
    """One ONNX node run by onnxruntime on torch tensors (the frontend's fallback op)."""

    def __init__(self, node: onnx.NodeProto, opsets: dict[str, int], ir_version: int,
                 inputs: Sequence[tuple[tuple[int, ...], torch.dtype] | torch.Tensor | None]) -> None:
        """``inputs``: per ONNX input, None (absent), (shape, dtype) of a runtime tensor (an argument of the
        call, in order), or a constant tensor (embedded in the one-node model as an initializer)."""
        self.op_type, self.domain, self.node_name = node.op_type, node.domain, node.name
        name = f"onnx.{node.op_type}" if node.domain in ("", "ai.onnx") else f"onnx.{node.domain}.{node.op_type}"
        self.__name__ = self.__qualname__ = name
        self.__module__ = "vtc.frontend.onnx_ort"
        for a in node.attribute:
            if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                raise ValueError(f"node {node.name!r}: op {node.op_type} has a subgraph attribute {a.name!r}; "
                                 "vtc does not support control flow that depends on runtime data")
        self.in_specs = [x if x is None or isinstance(x, tuple) else (tuple(x.shape), x.dtype) for x in inputs]
        graph_inputs, in_names, inits = [], [], []
        for k, spec in enumerate(inputs):
            if spec is None:
                in_names.append("")
            elif isinstance(spec, torch.Tensor):
                in_names.append(f"c{k}")
                inits.append(onnx.numpy_helper.from_array(to_numpy(spec), in_names[-1]))
            else:
                shape, dtype = spec
                in_names.append(f"x{len(graph_inputs)}")
                graph_inputs.append(helper.make_tensor_value_info(in_names[-1], TORCH_TO_ONNX[dtype], list(shape)))
        self.runtime_specs = [spec for spec in inputs if isinstance(spec, tuple)]
        self.n_inputs = len(graph_inputs)  # the call's arguments: the runtime inputs, in order
        out_names = [f"y{k}" if o else "" for k, o in enumerate(node.output)]
        self.out_names = [o for o in out_names if o]
        one = onnx.NodeProto()
        one.CopyFrom(node)
        del one.input[:]
        one.input.extend(in_names)
        del one.output[:]
        one.output.extend(out_names)
        one.name = node.name or node.op_type
        graph = helper.make_graph([one], f"vtc_fallback_{node.op_type}", graph_inputs,
                                  [onnx.ValueInfoProto(name=o) for o in self.out_names], inits)
        self.model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
            ir_version=ir_version)
        self._bytes = self.model.SerializeToString()
        try:
            self.session = session(self._bytes)
        except Exception as e:  # onnxruntime cannot run it either
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            where = f"domain {node.domain!r}" if node.domain else "the default ONNX domain"
            raise ValueError(f"node {node.name!r}: op {node.op_type} ({where}) is not known to vtc and "
                             f"onnxruntime cannot run it either: {first}") from None

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(tensors) != self.n_inputs:
            raise TypeError(f"{self.__name__}: expected {self.n_inputs} tensors, received {len(tensors)}")
        feeds = {f"x{k}": to_numpy(t) for k, t in enumerate(tensors)}
        outs = self.session.run(self.out_names, feeds)
        return tuple(from_numpy(o) for o in outs)

    def output_specs(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the outputs: ONNX shape inference (constant inputs are initializers of the
        one-node model, so shape arguments are known), else one run on dummy runtime inputs."""
        specs = _inferred_outputs(self.model, self.out_names)
        if specs is not None:
            return specs
        dummy = [torch.ones(shape, dtype=dtype) if dtype.is_floating_point or dtype == torch.bool
                 else torch.zeros(shape, dtype=dtype) for shape, dtype in self.runtime_specs]
        try:
            outs = self(*dummy)
        except Exception as e:
            raise ValueError(f"node {self.node_name!r}: cannot tell the output shapes of op {self.op_type} "
                             f"(ONNX shape inference gives none, and a run on dummy inputs failed: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None
        return [(tuple(o.shape), o.dtype) for o in outs]

    def __repr__(self) -> str:
        return f"<{self.__name__} via onnxruntime>"

    def __reduce__(self):  # pickled as its one-node model, rebuilt (and its session reopened) on load
        return (_rebuild, (self._bytes, self.node_name))


def _rebuild(model_bytes: bytes, node_name: str) -> OrtOp:
    m = onnx.load_from_string(model_bytes)
    node = onnx.NodeProto()
    node.CopyFrom(m.graph.node[0])
    node.name = node_name
    opsets = {o.domain: o.version for o in m.opset_import}
    consts = {t.name: torch.from_numpy(onnx.numpy_helper.to_array(t).copy()) for t in m.graph.initializer}
    types = {i.name: i.type.tensor_type for i in m.graph.input}
    inputs = [None if not n else consts[n] if n in consts else
              (tuple(d.dim_value for d in types[n].shape.dim), ONNX_TO_TORCH[types[n].elem_type])
              for n in node.input]
    return OrtOp(node, opsets, m.ir_version, inputs)


def _inferred_outputs(model: onnx.ModelProto, names: list[str]):
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        return None
    types = {v.name: v.type for v in inferred.graph.value_info}
    types.update({v.name: v.type for v in inferred.graph.output})
    out = []
    for n in names:
        t = types.get(n)
        if t is None or not t.HasField("tensor_type") or t.tensor_type.elem_type not in ONNX_TO_TORCH:
            return None
        tt = t.tensor_type
        if not tt.HasField("shape") or any(not d.HasField("dim_value") for d in tt.shape.dim):
            return None
        out.append((tuple(d.dim_value for d in tt.shape.dim), ONNX_TO_TORCH[tt.elem_type]))
    return out
