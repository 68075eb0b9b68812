"""ONNX frontend: an ONNX model -> vtc's graph IR of ATen calls, and ``OnnxCompiled``.

ONNX is *lowered*, not interpreted: every ONNX node becomes one or more nodes of
the same graph IR that ``torch.export`` produces (``Node(target=aten op, args with
Values, kind from vtc.ir.ops.classify)``), so the planner, the mappings, the
executor and the report work unchanged.  Data-movement ONNX ops become ATen
*movement* ops (Transpose -> permute, Reshape -> view, Slice -> slice/flip,
Gather -> index_select/select/index, Resize nearest -> index_select with
constant indices, ...), which the plan then makes virtual.  The op table is
``vtc.frontend.onnx_ops``.

Shapes are static per compilation.  ``import_onnx`` takes concrete input shapes
(symbolic dims resolved from them or from ``dims``) and:

- loads and checks the model (``onnx.checker``; a malformed model is a
  ``ValueError`` with the checker's message and the offending node), inlines
  model-local functions;
- walks the nodes in order with an environment ONNX name -> *operand*: a
  ``Value`` (known only at run time) or a ``torch.Tensor`` (a compile-time
  constant: an initializer, a ``Constant``, or a folded result);
- **folds** every node whose inputs are all constants (the ATen calls of its
  lowering run at once on CPU), and every node that reads only shapes (Shape,
  Size, EyeLike), so shape subgraphs (Shape -> Gather -> Concat -> Reshape)
  vanish and their consumers see constant shapes;
- creates ATen nodes for the rest; output shapes and dtypes come from running
  the ATen op on meta tensors, and are checked against ONNX shape inference
  (an output whose dtype differs from ONNX's gets a cast);
- runs any op the table does not lower through onnxruntime (``fallback``
  nodes, ``vtc.frontend.onnx_ort.OrtOp``), listed in the report's
  ``fallback_ops``; an op onnxruntime cannot run either is a ``ValueError``
  naming it.

``OnnxCompiled`` keeps one specialisation per input shape signature and is
called like ``onnxruntime.InferenceSession.run`` returns: see its docstring.
"""
from __future__ import annotations

import math
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import onnx
import torch
import torch.utils._pytree as pytree

from vtc.frontend import onnx_ops
from vtc.frontend.onnx_ort import (DATA_DEPENDENT, NONDETERMINISTIC, ONNX_TO_TORCH, OrtOp, from_numpy,
                                   to_numpy, torch_dtype)
from vtc.ir.graph import Graph, Node, Value, op_name
from vtc.ir.ops import classify

MIN_OPSET, MAX_TESTED_OPSET = 13, 21
Operand = Any  # Value | torch.Tensor (a compile-time constant) | list of operands (an ONNX sequence)


class OnnxError(ValueError):
    """The ONNX model is malformed, or uses what vtc cannot represent; the message names the node."""


# ----------------------------------------------------------------------------- loading and checking

def load_model(model: "str | os.PathLike | bytes | onnx.ModelProto") -> onnx.ModelProto:
    """Loads (a path or serialized bytes), checks (``onnx.checker``) and inlines local functions."""
    if isinstance(model, onnx.ModelProto):
        proto = model
    elif isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.exists(path):
            raise FileNotFoundError(f"ONNX model {path!r} does not exist")
        try:
            proto = onnx.load(path)
        except Exception as e:
            raise OnnxError(f"{path!r} is not a readable ONNX model: {type(e).__name__}: {e}") from None
    elif isinstance(model, (bytes, bytearray)):
        try:
            proto = onnx.load_from_string(bytes(model))
        except Exception as e:
            raise OnnxError(f"these {len(model)} bytes are not a serialized ONNX model: {e}") from None
    else:
        raise TypeError(f"expected a path to an .onnx file, bytes or an onnx.ModelProto, "
                        f"received {type(model).__name__}")
    check_model(proto)
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
    opset = _opsets(proto).get("", 0)
    if opset < MIN_OPSET:
        try:
            proto = onnx.version_converter.convert_version(proto, MIN_OPSET)
        except Exception as e:
            raise OnnxError(f"the model uses ONNX opset {opset}; vtc supports opsets {MIN_OPSET}-"
                            f"{MAX_TESTED_OPSET}, and onnx's version converter could not convert it: {e}") from None
    return proto


# ops onnxruntime registers in the ONNX domain beyond the standard: onnxruntime's transformer optimizer
# (onnxruntime.transformers.optimizer) writes SimplifiedLayerNormalization there, and LayerNormalization at
# opsets below 17; onnx.checker rejects them ("No Op registered"), onnxruntime and vtc run them
ORT_ONNX_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization", "LayerNormalization"})


def check_model(model: onnx.ModelProto) -> None:
    """``onnx.checker.check_model``; its failure is an ``OnnxError`` with the checker's message and the node.

    Nodes of ``ORT_ONNX_DOMAIN_OPS`` that the checker has no schema for are checked as custom-domain ops."""
    try:
        _check_with_ort_ops(model)
    except onnx.checker.ValidationError as e:
        msg = " ".join(str(e).split())
        node = _offending_node(model, msg)
        where = f" (node {node.name!r}, op {node.op_type})" if node is not None else ""
        raise OnnxError(f"invalid ONNX model{where}: onnx.checker: {msg}") from None


def _check_with_ort_ops(model: onnx.ModelProto) -> None:
    try:
        onnx.checker.check_model(model)
        return
    except onnx.checker.ValidationError as e:
        m = re.search(r"No Op registered for (\w+) with domain_version", str(e))
        if not m or m.group(1) not in ORT_ONNX_DOMAIN_OPS:
            raise
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    domain = "ai.onnxruntime.onnx_domain"
    copy.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    for n in copy.graph.node:
        if n.domain in ("", "ai.onnx") and n.op_type in ORT_ONNX_DOMAIN_OPS and not _registered(n.op_type, copy):
            n.domain = domain
    onnx.checker.check_model(copy)


def _registered(op_type: str, model: onnx.ModelProto) -> bool:
    try:
        onnx.defs.get_schema(op_type, _opsets(model).get("", 1), "")
        return True
    except onnx.defs.SchemaError:
        return False


def _offending_node(model: onnx.ModelProto, msg: str) -> onnx.NodeProto | None:
    m = re.search(r"[Nn]ame:\s*(\S*)\s+OpType:\s*(\S+)", msg)
    nodes = list(model.graph.node)
    if m:
        for n in nodes:
            if n.name == m.group(1) and n.op_type == m.group(2):
                return n
    defined = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer} | {""}
    for n in nodes:  # the first node that reads something undefined
        if any(i not in defined for i in n.input):
            return n
        defined.update(n.output)
    return None


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}


# ----------------------------------------------------------------------------- input specs

@dataclass(frozen=True)
class InputSpec:
    """A graph input: its ONNX name, torch dtype and dims (an int, a symbolic name, or None)."""

    name: str
    dtype: torch.dtype
    dims: tuple[int | str | None, ...]

    def resolve(self, dims: dict[str, int]) -> tuple[int, ...]:
        """The concrete shape, symbolic dims taken from ``dims``; ValueError naming the unknown ones."""
        out, missing = [], []
        for k, d in enumerate(self.dims):
            if isinstance(d, int):
                out.append(d)
            elif isinstance(d, str) and d in dims:
                out.append(int(dims[d]))
            else:
                missing.append(d if isinstance(d, str) else f"dim {k} (unnamed)")
        if missing:
            raise OnnxError(f"input {self.name!r} has symbolic dims {missing} (shape {list(self.dims)}); give "
                            f"example inputs, or their values (dims={{'{missing[0]}': ...}}, `--dim name=value`)")
        return tuple(out)


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The model's real inputs (initializers listed as inputs excluded), in order."""
    inits = {t.name for t in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type"):
            raise OnnxError(f"input {vi.name!r} is not a tensor ({vi.type.WhichOneof('value')}); "
                            "vtc supports tensor inputs")
        tt = vi.type.tensor_type
        dtype = torch_dtype(tt.elem_type, f"input {vi.name!r}")
        if not tt.HasField("shape"):
            raise OnnxError(f"input {vi.name!r} has no declared rank; vtc needs the rank of every input")
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        out.append(InputSpec(vi.name, dtype, dims))
    return out


def output_names(model: onnx.ModelProto) -> list[str]:
    """The model's output names, in order."""
    return [o.name for o in model.graph.output]


# ----------------------------------------------------------------------------- import

def import_onnx(model: "str | os.PathLike | onnx.ModelProto", input_shapes: dict[str, tuple] | None = None,
                dims: dict[str, int] | None = None, *, _loaded: bool = False) -> Graph:
    """An ONNX model -> a vtc Graph of ATen nodes, specialised to ``input_shapes`` (missing ones: declared)."""
    proto = model if _loaded else load_model(model)
    specs = input_specs(proto)
    input_shapes = dict(input_shapes or {})
    unknown = sorted(set(input_shapes) - {s.name for s in specs})
    if unknown:
        raise OnnxError(f"input_shapes names {unknown}, which are not inputs of the model "
                        f"(its inputs: {[s.name for s in specs]})")
    shapes = {}
    for s in specs:
        if s.name in input_shapes:
            shape = tuple(int(d) for d in input_shapes[s.name])
            _check_shape(s, shape)
            shapes[s.name] = shape
        else:
            shapes[s.name] = s.resolve(dims or {})
    return _Lowering(proto, specs, shapes).run()


def _check_shape(spec: InputSpec, shape: tuple[int, ...]) -> None:
    if len(shape) != len(spec.dims):
        raise ValueError(f"input {spec.name!r}: expected rank {len(spec.dims)} (shape {list(spec.dims)}), "
                         f"received rank {len(shape)} (shape {list(shape)})")
    for k, (d, s) in enumerate(zip(spec.dims, shape)):
        if isinstance(d, int) and d != s:
            raise ValueError(f"input {spec.name!r}: dim {k} must be {d} (shape {list(spec.dims)}), "
                             f"received shape {list(shape)}")


def _clean(name: str) -> str:
    s = re.sub(r"[^\w.]", "_", name).strip("_.")
    return s or "v"


def _fresh(base: str, taken: set[str]) -> str:
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def _meta(x: Any) -> Any:
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, Value) else x


class _Lowering:
    """The state of one import: the environment, the nodes made so far, names, the current ONNX node."""

    def __init__(self, model: onnx.ModelProto, specs: list[InputSpec], shapes: dict[str, tuple[int, ...]]) -> None:
        self.model = model
        self.opsets = _opsets(model)
        self.opset = self.opsets.get("", MIN_OPSET)
        self.specs, self.shapes = specs, shapes
        self.inputs: list[Value] = []
        self.consts: list[Value] = []
        self.nodes: list[Node] = []
        self.scopes: list[dict[str, Operand]] = [{}]
        self.value_names: set[str] = set()
        self.node_names: set[str] = set()
        self._const_of: dict[int, Value] = {}  # id(tensor) -> its const Value
        self._hint: dict[int, str] = {}  # id(tensor) -> the ONNX name it was stored under
        self._alive: list[torch.Tensor] = []  # keeps every tensor seen alive, so ids stay unique
        self._weight_t_of: dict[int, torch.Tensor] = {}  # id(constant MatMul B) -> W = B^T
        self.node: onnx.NodeProto | None = None
        self._base = ""
        self._n_in_node = 0
        self._new: list[Value] = []
        self.fallbacks: dict[str, str] = {}  # ATen/ORT node name -> why it falls back
        self.onnx_node_of: dict[str, str] = {}  # graph node name -> the ONNX node it was lowered from
        self.shape_notes: list[str] = []  # where vtc's shapes differ from ONNX shape inference
        self.expected = self._inferred_types()

    # -- environment ------------------------------------------------------------
    def bind(self, name: str, x: Operand) -> None:
        if isinstance(x, torch.Tensor):
            self._alive.append(x)
            self._hint.setdefault(id(x), name)
        self.scopes[-1][name] = x

    def lookup(self, name: str) -> Operand:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise self.error(f"input {name!r} is not defined by any graph input, initializer or earlier node")

    def weight_t(self, b: torch.Tensor) -> torch.Tensor:
        """W = B^T, contiguous, of a constant MatMul / Gemm B: one W per B tensor (onnx_ops._constant_b)."""
        w = self._weight_t_of.get(id(b))
        if w is None:
            w = self._weight_t_of[id(b)] = b.t().contiguous()
            self._alive.append(b)  # b's id stays unique while the import lives
        return w

    def const_value(self, t: torch.Tensor) -> Value:
        """The const Value holding tensor t (one per tensor)."""
        v = self._const_of.get(id(t))
        if v is None:
            self._alive.append(t)
            base = _clean(self._hint.get(id(t), f"{self._base}_const"))
            v = Value(_fresh(base, self.value_names), tuple(t.shape), t.dtype, "const", data=t)
            self._const_of[id(t)] = v
            self.consts.append(v)
        return v

    # -- what handlers use ------------------------------------------------------
    @property
    def where(self) -> str:
        n = self.node
        return f"node {n.name!r} ({n.op_type})" if n is not None else "the graph"

    def error(self, msg: str) -> OnnxError:
        """An OnnxError about the current node."""
        return OnnxError(f"{self.where}: {msg}")

    @staticmethod
    def const(x: Operand) -> torch.Tensor | None:
        """The tensor of a compile-time constant operand, else None."""
        return x if isinstance(x, torch.Tensor) else None

    def ints(self, x: Operand, what: str) -> list[int]:
        """A constant integer operand as a list of ints; an error naming ``what`` when it is not constant."""
        t = self.const(x)
        if t is None:
            raise self.error(f"input {what!r} must be a compile-time constant (vtc specialises on static "
                             f"shapes), but it depends on runtime data")
        return [int(v) for v in t.reshape(-1).tolist()]

    def floats(self, x: Operand, what: str) -> list[float]:
        """A constant operand as a list of floats; an error naming ``what`` when it is not constant."""
        t = self.const(x)
        if t is None:
            raise self.error(f"input {what!r} must be a compile-time constant, but it depends on runtime data")
        return [float(v) for v in t.reshape(-1).tolist()]

    def call(self, target: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs an ATen op now when every tensor argument is constant (folding), else adds a Node."""
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(x, Value) for x in leaves):
            with torch.no_grad():
                out = target(*args, **kwargs)
            # constants own compact memory (a folded permute must not stay a strided view)
            return out.contiguous() if isinstance(out, torch.Tensor) else tuple(o.contiguous() for o in out)
        args, kwargs = pytree.tree_map(lambda x: self.const_value(x) if isinstance(x, torch.Tensor) else x,
                                       (args, kwargs))
        margs, mkwargs = pytree.tree_map(_meta, (args, kwargs))
        try:
            res = target(*margs, **mkwargs)
        except Exception as e:
            shapes = [list(x.shape) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Value)]
            raise self.error(f"lowering to {op_name(target)} failed on input shapes {shapes}: "
                             f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        single = isinstance(res, torch.Tensor)
        res = (res,) if single else tuple(res)
        stem = f"{self._base}_{getattr(target, '_opname', 'op')}"
        outs = tuple(Value(_fresh(stem, self.value_names), tuple(r.shape), r.dtype) for r in res)
        self._add(target, args, kwargs, outs, classify(target, args, kwargs))
        return outs[0] if single else outs

    def _add(self, target: Any, args: tuple, kwargs: dict, outs: tuple[Value, ...], kind: str) -> Node:
        name = _fresh(self._base if self._n_in_node == 0 else f"{self._base}_{self._n_in_node}", self.node_names)
        self._n_in_node += 1
        node = Node(name, target, args, kwargs, outs, kind)
        self.nodes.append(node)
        self.onnx_node_of[name] = self.node.name if self.node is not None else ""
        self._new.extend(outs)
        return node

    def fallback(self, ins: Sequence[Operand | None], reason: str = "") -> list[Operand]:
        """The current node run by onnxruntime (folded when its inputs are all constant)."""
        node = self.node
        if node.op_type in DATA_DEPENDENT:
            raise self.error(f"op {node.op_type} has a data-dependent output shape or control flow; vtc "
                             "compiles static shapes only")
        if any(isinstance(x, list) for x in ins):
            raise self.error("ONNX sequences are not supported as inputs of ops vtc does not lower")
        runtime = [x for x in ins if isinstance(x, Value)]
        if not runtime and node.op_type not in NONDETERMINISTIC:  # fold: run it now on the constants
            fn = OrtOp(node, self.opsets, self.model.ir_version,
                       [None if x is None else (tuple(x.shape), x.dtype) for x in ins])
            res = list(fn(*[x for x in ins if x is not None]))
        else:  # constants become initializers of the one-node model; the node reads the runtime inputs
            fn = OrtOp(node, self.opsets, self.model.ir_version,
                       [(x.shape, x.dtype) if isinstance(x, Value) else x for x in ins])
            args = tuple(runtime)
            outs = tuple(Value(_fresh(f"{self._base}_ort", self.value_names), shape, dtype)
                         for shape, dtype in fn.output_specs())
            added = self._add(fn, args, {}, outs, classify(fn, args, {}))
            self.fallbacks[added.name] = reason or f"vtc does not lower ONNX op {node.op_type}"
            res = list(outs)
        it = iter(res)
        return [next(it) if o else None for o in node.output]

    def subgraph(self, graph: onnx.GraphProto) -> list[Operand]:
        """Lowers a subgraph (an If branch) inline in a new scope; returns its outputs."""
        saved = (self.node, self._base, self._n_in_node)
        self.scopes.append({})
        try:
            for t in graph.initializer:
                self.bind(t.name, _tensor(t))
            for n in graph.node:
                self.lower_node(n, check_types=False)
            return [self.lookup(o.name) for o in graph.output]
        finally:
            self.scopes.pop()
            self.node, self._base, self._n_in_node = saved

    # -- the walk ---------------------------------------------------------------
    def run(self) -> Graph:
        g = self.model.graph
        for t in g.initializer:
            self.bind(t.name, _tensor(t))
        for t in g.sparse_initializer:
            self.bind(t.values.name, torch.from_numpy(onnx.numpy_helper.to_array(t)).clone())
        for spec in self.specs:
            v = Value(_fresh(_clean(spec.name), self.value_names), self.shapes[spec.name], spec.dtype, "input")
            self.inputs.append(v)
            self.scopes[0][spec.name] = v
        for n in g.node:
            self.lower_node(n)
        self.node = None
        outputs = []
        for o in g.output:
            x = self.lookup(o.name)
            if isinstance(x, torch.Tensor):
                self._hint.setdefault(id(x), o.name)
                x = self.const_value(x)
            if not isinstance(x, Value):
                raise OnnxError(f"graph output {o.name!r} is a {type(x).__name__}; vtc supports tensor outputs")
            if x.kind == "input" or any(x is v for v in outputs):  # e.g. Transposes that cancelled
                self._base = _clean(o.name)
                x = self.call(torch.ops.aten.alias.default, x)
            outputs.append(x)
        self.nodes = _live(self.nodes, outputs)
        used = {id(v) for n in self.nodes for v in n.inputs} | {id(v) for v in outputs}
        consts = [v for v in self.consts if id(v) in used]
        graph = Graph(self.inputs, consts, self.nodes, outputs, meta={
            "source": f"ONNX model {g.name or '(unnamed)'} (opset {self.opset})",
            "onnx_inputs": [s.name for s in self.specs], "onnx_outputs": [o.name for o in g.output],
            "fallback_reasons": {n.name: self.fallbacks[n.name] for n in self.nodes if n.name in self.fallbacks},
            "shape_notes": list(self.shape_notes),
            "onnx_node_of": {n.name: self.onnx_node_of[n.name] for n in self.nodes}})
        from vtc.ir.verify import verify

        verify(graph)
        return graph

    def lower_node(self, node: onnx.NodeProto, check_types: bool = True) -> None:
        """Lowers one ONNX node and binds its outputs."""
        self.node = node
        self._base = _clean(node.name or (node.output[0] if node.output else node.op_type))
        self._n_in_node = 0
        self._new = []
        ins = [self.lookup(i) if i else None for i in node.input]
        domain = "" if node.domain == "ai.onnx" else node.domain
        handler = onnx_ops.OPS.get((domain, node.op_type))
        if handler is None:
            outs = self.fallback(ins)
        else:
            try:
                outs = handler(self, ins, onnx_ops.Attrs(node))
            except onnx_ops.Unsupported as e:
                self._drop_new()
                outs = self.fallback(ins, str(e))
            except OnnxError:
                raise
            except Exception as e:
                raise self.error(f"cannot lower it: {type(e).__name__}: {e}") from e
        if isinstance(outs, (Value, torch.Tensor)):
            outs = [outs]
        outs = list(outs)
        renamed: set[int] = set()
        for k, name in enumerate(node.output):
            if not name:
                continue
            if k >= len(outs) or outs[k] is None:
                raise self.error(f"output {k} ({name!r}) is not produced by vtc's lowering")
            x = outs[k]
            if check_types:
                x = self._conform(name, x)
            if isinstance(x, Value) and any(x is v for v in self._new) and id(x) not in renamed:
                self.value_names.discard(x.name)  # a fresh intermediate: it takes the ONNX output's name
                x.name = _fresh(_clean(name), self.value_names)
                renamed.add(id(x))
            self.bind(name, x)

    def _drop_new(self) -> None:
        """Removes the nodes a handler added before it declined (it raised Unsupported)."""
        new = {id(v) for v in self._new}
        self.nodes = [n for n in self.nodes if not any(id(v) in new for v in n.outputs)]
        self._new, self._n_in_node = [], 0

    def _conform(self, name: str, x: Operand) -> Operand:
        """Casts x to the dtype ONNX shape inference gives ``name``; checks its static shape."""
        exp = self.expected.get(name)
        if exp is None or not isinstance(x, (Value, torch.Tensor)):
            return x
        elem, dims = exp
        want = ONNX_TO_TORCH.get(elem)
        if dims is not None and all(isinstance(d, int) for d in dims) and tuple(dims) != tuple(x.shape):
            # recorded, not fatal: onnxruntime (whose float32 arithmetic vtc follows) and ONNX shape inference
            # (float64) can disagree, e.g. Resize of 10 by scale 0.7; a model may declare wrong output shapes
            # (onnxruntime only warns); the tests require no notes on the models they check
            self.shape_notes.append(f"{self.where}: output {name!r} is {list(x.shape)} (as onnxruntime computes "
                                    f"it), ONNX shape inference says {list(dims)}")
        if want is not None and want != x.dtype:
            x = self.call(torch.ops.aten._to_copy.default, x, dtype=want)
        return x

    def _inferred_types(self) -> dict[str, tuple[int, tuple | None]]:
        """ONNX shape inference on the model with the concrete input shapes: name -> (elem type, dims)."""
        m = _without_weights(self.model)
        for vi in m.graph.input:
            if vi.name in self.shapes:
                dims = vi.type.tensor_type.shape.dim
                for d, s in zip(dims, self.shapes[vi.name]):
                    d.Clear()
                    d.dim_value = s
        try:
            m = onnx.shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
        except Exception:
            return {}
        out = {}
        for vi in list(m.graph.value_info) + list(m.graph.output):
            if not vi.type.HasField("tensor_type"):
                continue
            tt = vi.type.tensor_type
            dims = None
            if tt.HasField("shape"):
                dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
            if tt.elem_type:
                out[vi.name] = (tt.elem_type, dims)
        return out


SHAPE_DATA_ELEMS = 64  # initializers up to this size keep their values for shape inference's data propagation


def _without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model for shape inference: initializers above ``SHAPE_DATA_ELEMS`` elements are typed graph inputs.

    Shape inference serializes the model it is given; with the weights that is most of an import's time (a
    425 MB GPT-2: copying and serializing the weights took longer than lowering and planning the graph),
    and only small integer initializers (shapes, axes) matter to its data propagation."""
    m = onnx.ModelProto()
    m.ir_version = model.ir_version
    m.opset_import.extend(model.opset_import)
    m.functions.extend(model.functions)
    g, src = m.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    g.sparse_initializer.extend(src.sparse_initializer)
    declared = {vi.name for vi in src.input}
    for t in src.initializer:
        if math.prod(t.dims) <= SHAPE_DATA_ELEMS:
            g.initializer.append(t)
        elif t.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return m


def _live(nodes: list[Node], outputs: list[Value]) -> list[Node]:
    """The nodes whose results something reads (a graph output, or a node that is itself live), in order.

    Lowerings that rewrite what an earlier node produced (a Transpose of a Transpose composed into one
    permute, a ScatterND into a permuted tensor moved in front of the permute) leave the nodes they bypass
    unread; random ops (``NONDETERMINISTIC``) are dropped too when nothing reads them, like any other."""
    needed = {id(v) for v in outputs}
    keep = []
    for n in reversed(nodes):
        if any(id(v) in needed for v in n.outputs):
            keep.append(n)
            needed.update(id(v) for v in n.inputs)
    return keep[::-1]


def _tensor(t: onnx.TensorProto) -> torch.Tensor:
    """An initializer / Constant as a torch tensor."""
    arr = onnx.numpy_helper.to_array(t)
    if t.data_type == onnx.TensorProto.BFLOAT16:
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16).copy()).view(torch.bfloat16)
    torch_dtype(t.data_type, f"tensor {t.name!r}")
    return from_numpy(np.array(arr, copy=True))


# ----------------------------------------------------------------------------- compiled

class OnnxCompiled:
    """An ONNX model compiled by vtc, called like an onnxruntime session.

    ``compiled(*arrays)`` (in the model's input order), ``compiled([arrays])`` or
    ``compiled({name: array})`` returns a **list** of outputs in the model's output order, as
    ``InferenceSession.run(None, feeds)`` does: numpy arrays when the inputs are
    numpy arrays, torch tensors when they are torch tensors.  A call with a new
    shape signature specialises again (``max_specializations`` are kept).
    """

    def __init__(self, model: Any, example_inputs: Any = None, dims: dict[str, int] | None = None,
                 options: dict | None = None, _proto: onnx.ModelProto | None = None) -> None:
        from vtc.compiler import check_options

        self.options = check_options(dict(options or {}))
        self.proto = _proto if _proto is not None else load_model(model)
        self.source = os.fspath(model) if isinstance(model, (str, os.PathLike)) else "ModelProto"
        self.specs = input_specs(self.proto)
        self.output_names = output_names(self.proto)
        self.dims = dict(dims or {})
        self._specs: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        if isinstance(example_inputs, (np.ndarray, np.generic, torch.Tensor)):
            example_inputs = [example_inputs]  # the one input of a one-input model
        if example_inputs is not None and not (isinstance(example_inputs, (tuple, list, dict))
                                               and len(example_inputs) == 0):
            tensors, _ = self._tensors(example_inputs)
            shapes = tuple(tuple(t.shape) for t in tensors)
        else:
            shapes = tuple(s.resolve(self.dims) for s in self.specs)
        self._example_shapes = shapes
        self._first = self._specialize(shapes)

    @property
    def report(self):
        """The report of the first specialisation (example shapes)."""
        return self._first.report

    @property
    def graph(self) -> Graph:
        """The graph of the first specialisation (example shapes)."""
        return self._first.graph

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.specs]

    def replan(self, **options) -> "OnnxCompiled":
        """The same imported graph compiled with other options (no new import)."""
        from vtc.compiler import check_options, specialize

        out = OnnxCompiled.__new__(OnnxCompiled)
        out.__dict__.update(self.__dict__)
        out.options = check_options({**self.options, **options})
        out._specs, out._lock = OrderedDict(), threading.Lock()
        out._first = specialize(self.graph, out.options)
        out._specs[self._example_shapes] = out._first
        return out

    def _specialize(self, shapes: tuple[tuple[int, ...], ...]):
        from vtc.compiler import specialize

        with self._lock:
            spec = self._specs.get(shapes)
            if spec is not None:
                self._specs.move_to_end(shapes)
                return spec
        graph = import_onnx(self.proto, {s.name: shape for s, shape in zip(self.specs, shapes)}, self.dims,
                            _loaded=True)
        spec = specialize(graph, self.options)
        with self._lock:
            self._specs[shapes] = spec
            while len(self._specs) > self.options["max_specializations"]:
                self._specs.popitem(last=False)
        return spec

    def _tensors(self, args: Any) -> tuple[list[torch.Tensor], bool]:
        """The inputs as torch tensors in model order, checked; and whether they came as numpy."""
        if isinstance(args, dict):
            names = [s.name for s in self.specs]
            extra, missing = sorted(set(args) - set(names)), [n for n in names if n not in args]
            if extra or missing:
                raise TypeError(f"inputs by name: the model takes {names}; missing {missing}, unknown {extra}")
            args = [args[n] for n in names]
        args = list(args)
        if len(args) != len(self.specs):
            raise TypeError(f"the model takes {len(self.specs)} inputs "
                            f"({', '.join(s.name for s in self.specs)}), received {len(args)}")
        out, numpy_in = [], False
        for s, a in zip(self.specs, args):
            if isinstance(a, torch.Tensor):
                t = a
            elif isinstance(a, (np.ndarray, np.generic, int, float, bool)):
                numpy_in = True
                t = from_numpy(a)
            else:
                raise TypeError(f"input {s.name!r}: expected a numpy array or torch tensor, "
                                f"received {type(a).__name__}")
            if t.dtype != s.dtype:
                raise TypeError(f"input {s.name!r}: expected dtype {s.dtype}, received {t.dtype} "
                                f"(shape {list(t.shape)})")
            _check_shape(s, tuple(t.shape))
            out.append(t)
        return out, numpy_in

    def __call__(self, *args: Any, **named: Any) -> list:
        if named:  # inputs by name, as ``compiled({"x": ...})`` takes them
            if args:
                raise TypeError(f"give the inputs either positionally or by name, not both (received "
                                f"{len(args)} positional and {sorted(named)})")
            args = (named,)
        if len(args) == 1 and isinstance(args[0], (dict, list, tuple)):
            args = args[0]
        tensors, numpy_in = self._tensors(args)
        shapes = tuple(tuple(t.shape) for t in tensors)
        spec = self._first if shapes == self._example_shapes else self._specialize(shapes)
        outs = spec.executor(tensors)
        return [to_numpy(o) for o in outs] if numpy_in else list(outs)

    def __repr__(self) -> str:
        return f"<vtc.OnnxCompiled {self.source}: {self.report.summary()}>"


def compile_onnx(model: "str | os.PathLike | onnx.ModelProto", example_inputs: Any = None,
                 dims: dict[str, int] | None = None, **options) -> OnnxCompiled:
    """Compiles an ONNX model for the example inputs' shapes (or its declared shapes and ``dims``)."""
    return OnnxCompiled(model, example_inputs, dims, options)


__all__ = ["OnnxCompiled", "OnnxError", "InputSpec", "compile_onnx", "import_onnx", "load_model",
           "check_model", "input_specs", "output_names"]
