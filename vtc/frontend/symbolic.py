"""Symbolic capture: one ATen graph with symbolic sizes, instantiated for concrete sizes without tracing again.

``export_symbolic`` runs torch.export with ``Dim.AUTO`` on the input dims that
may vary; ``SymbolicGraph`` wraps an ATen fx graph whose sizes are SymInts
(from that export, or the graph dynamo hands the ``torch.compile`` backend
once it has seen a second shape):

- ``symbols``: the size symbols the inputs bind, in order of first appearance
  (a symbol is a sympy ``Symbol`` of torch's ShapeEnv, printed ``s0``, ``s70``...);
- ``bind(leaves)``: the symbol values given the flat user inputs (tensors and
  ints), checked against the shapes of the other dims, torch's value ranges of
  the symbols and the graph's runtime asserts; ``NotInstantiable`` (with the
  reason) when the inputs do not fit;
- ``instantiate(env)``: a concrete vtc ``Graph`` for those values: ``graph_from_fx``
  reads the fx graph with every SymInt argument and size computation evaluated and
  every ``meta["val"]`` a meta tensor of the concrete shape (``_AtSizes``; the fx
  graph is not copied).  Node and value names are the fx names, the same for
  every instantiation, so the kernels of two instantiations have the same names.

Everything downstream (planner, lowering, code generation) sees only concrete
sizes; ``vtc.runtime.generic`` makes the kernels size-generic.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from vtc.frontend import decomp
from vtc.frontend.torch_export import (NOT_A_SIZE, CaptureError, _as_module, capture_copy, const_sources,
                                      distinct_inputs, graph_from_fx, program_constants, quiet_fake_tensor_log,
                                      user_input_mutations)
from vtc.ir.graph import Graph

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
_ASSERTS = ("_assert_scalar", "sym_constrain_range", "_functional_sym_constrain_range", "sym_constrain_range_for_size")


class NotInstantiable(ValueError):
    """The inputs do not fit the symbolic graph (a static dim differs, a value range or an assert fails)."""


def _expr(x: Any) -> Any:
    """The sympy expression of a SymInt/SymFloat/SymBool; an int, float or bool unchanged."""
    return x.node.expr if isinstance(x, _SYM) else x


class SymbolicGraph:
    """An ATen fx graph with symbolic sizes; ``instantiate`` makes a concrete Graph for given sizes."""

    def __init__(self, gm: fx.GraphModule, consts: dict[str, torch.Tensor] | None = None, in_spec: Any = None,
                 out_spec: Any = None, ranges: dict | None = None, guards: Callable[..., None] | None = None,
                 output_specs: Any = (), const_targets: dict[str, str] | None = None) -> None:
        self.gm, self.consts, self.in_spec, self.out_spec = gm, dict(consts or {}), in_spec, out_spec
        # {constant name: the qualified name of the module's tensor}: every instantiation's meta["const_sources"],
        # which Compiled's parameter watch reads (without it a parameter replaced after vtc.compile(dynamic=True),
        # ``p.data = t``, was never seen: the old weights' result on every later call)
        self.const_targets = dict(const_targets or {})
        # torch.export's output specs: those of inputs that forward changes in place become
        # graph.meta["input_mutations"] in every instantiation (torch_export.user_input_mutations)
        self.output_specs = tuple(output_specs)
        # torch.export's shape guards (a branch on a size, e.g. "S % 4 == 0"): called on the flat user inputs,
        # AssertionError where they fail; range constraints alone do not hold them
        self.guards = guards
        self.ranges: dict[sympy.Symbol, tuple[int, float]] = {}  # symbol -> (lo, hi), hi may be inf
        for s, vr in (ranges or {}).items():
            self.ranges[s] = (_bound(vr.lower, 0), _bound(vr.upper, float("inf")))
        self.user = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name not in self.consts]
        self.symbols: list[sympy.Symbol] = []
        for n in self.user:
            for x in _leaf_sizes(n.meta.get("val")):
                for s in sorted(getattr(_expr(x), "free_symbols", ()), key=str):
                    if s not in self.symbols:
                        self.symbols.append(s)
        if not self.symbols:
            raise CaptureError("the graph has no symbolic input size")
        self.degree = self._degrees()

    def _degrees(self) -> dict[sympy.Symbol, int]:
        """Per symbol, the most dims of one tensor whose size depends on it (the degree of sizes and strides in it)."""
        deg = dict.fromkeys(self.symbols, 1)
        for n in self.gm.graph.nodes:
            for t in pytree.tree_leaves(n.meta.get("val")):
                if isinstance(t, torch.Tensor):
                    for s in self.symbols:
                        k = sum(s in getattr(_expr(d), "free_symbols", ()) for d in t.shape)
                        deg[s] = max(deg[s], k)
        return deg

    def bind(self, leaves: list[Any]) -> dict[sympy.Symbol, int]:
        """The symbol values for these flat user inputs; NotInstantiable when they do not fit."""
        if len(leaves) != len(self.user):
            raise NotInstantiable(f"{len(leaves)} inputs for {len(self.user)} graph inputs")
        env: dict[sympy.Symbol, int] = {}
        pending = []
        for n, x in zip(self.user, leaves):
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                if not isinstance(x, torch.Tensor) or x.dim() != val.dim():
                    raise NotInstantiable(f"input {n.name}: expected a rank-{val.dim()} tensor, got {x!r:.60}")
                pairs = list(zip(val.shape, x.shape))
            else:
                pairs = [(val, x)]
            for want, got in pairs:
                e = _expr(want)
                if isinstance(e, sympy.Symbol):
                    if env.setdefault(e, int(got)) != int(got):
                        raise NotInstantiable(f"size {e} is {env[e]} and {got} in the same call")
                elif isinstance(e, sympy.Expr) and e.free_symbols:
                    pending.append((n.name, e, got))
                elif isinstance(want, (int, float, bool)) and not isinstance(got, torch.Tensor) and want != got:
                    raise NotInstantiable(f"input {n.name}: captured with {want}, received {got}")
        missing = [s for s in self.symbols if s not in env]
        if missing:
            raise NotInstantiable(f"no input binds the size(s) {missing}")
        for name, e, got in pending:
            if int(e.xreplace(env)) != int(got):
                raise NotInstantiable(f"input {name}: a size is {e} = {int(e.xreplace(env))}, received {got}")
        for s, v in env.items():
            lo, hi = self.ranges.get(s, (0, float("inf")))
            if not lo <= v <= hi:
                raise NotInstantiable(f"size {s} = {v} is outside the captured range [{lo}, {hi}]")
        if self.guards is not None:
            try:
                self.guards(*leaves)
            except AssertionError as e:
                raise NotInstantiable(f"a shape guard of the capture fails: {e}") from None
            except Exception as e:  # a guard that cannot be evaluated is not known to hold
                raise NotInstantiable(f"the shape guards could not be checked: {type(e).__name__}: {e}") from None
        return env

    def instantiate(self, env: dict[sympy.Symbol, int]) -> Graph:
        """The concrete Graph for symbol values `env` (NotInstantiable when a runtime assert fails).

        The symbolic fx graph is read as it is (``graph_from_fx(concrete=...)``): no copy of it, whose nodes
        would be garbage in reference cycles after every new size."""
        at = _AtSizes(env, getattr(self, "_metas", None))
        graph = graph_from_fx(self.gm, self.consts, in_spec=self.in_spec, out_spec=self.out_spec, concrete=at)
        user_input_mutations(graph, self.output_specs)
        const_sources(graph, self.const_targets)
        self._metas = at.metas  # this instantiation's meta tensors, for the next one
        graph.meta["sizes"] = {str(s): v for s, v in env.items()}
        return graph


class _AtSizes:
    """A symbolic fx graph's sizes and values at symbol values `env` (``graph_from_fx``'s `concrete`)."""

    def __init__(self, env: dict[sympy.Symbol, int], metas: dict | None = None) -> None:
        self.env = env
        # (shape, dtype) -> a meta tensor (graph_from_fx reads only their shape and dtype): the previous
        # instantiation's are taken again (most shapes of a decode step do not change), made ones added
        self.before, self.metas = metas or {}, {}
        self.subs = {s: sympy.Integer(v) for s, v in env.items()}
        self.cache: dict[Any, Any] = {}
        self.sizes: dict[fx.Node, Any] = {}

    def arg(self, x: Any) -> Any:
        """The value of a SymInt/SymFloat/SymBool at these sizes; anything else unchanged."""
        if not isinstance(x, _SYM):
            return x
        e = x.node.expr
        hit = self.cache.get(e)
        if hit is None:
            r = e.xreplace(self.subs)
            if getattr(r, "free_symbols", None):
                raise NotInstantiable(f"size expression {e} has unbound symbols {sorted(map(str, r.free_symbols))}")
            hit = self.cache[e] = (bool(r) if isinstance(x, torch.SymBool) else
                                   float(r) if isinstance(x, torch.SymFloat) else int(r))
        return hit

    def size(self, n: fx.Node) -> Any:
        """The value of a node that computes (or asserts) a size, NOT_A_SIZE for any other node."""
        val = n.meta.get("val")
        if not (n.op == "call_function" and (isinstance(val, _SYM) or _is_size_op(n))):
            return NOT_A_SIZE
        v = self.sizes[n] = self.arg(val)
        if getattr(n.target, "_opname", "") == "_assert_scalar":
            cond = n.args[0]
            if not (self.sizes.get(cond, True) if isinstance(cond, fx.Node) else self.arg(cond)):
                raise NotInstantiable(f"runtime assert {n.args[1:]} fails for sizes {self.env}")
        return v

    def val(self, n: fx.Node) -> Any:
        """n's ``meta["val"]`` at these sizes: a tensor's as a meta tensor of the concrete shape."""
        return self._concrete(n.meta.get("val"))

    def _concrete(self, val: Any) -> Any:
        if isinstance(val, torch.Tensor):
            key = (tuple([self.arg(d) for d in val.shape]), val.dtype)
            t = self.metas.get(key)
            if t is None:
                t = self.before.get(key)
                if t is None:
                    t = torch.empty(key[0], dtype=val.dtype, device="meta")
                self.metas[key] = t
            return t
        if isinstance(val, (list, tuple)):
            return type(val)(self._concrete(v) for v in val)
        return self.arg(val)


def _bound(x: Any, unbounded: float) -> float:
    """A value-range bound as an int, `unbounded` for torch's infinities."""
    return int(x) if isinstance(x, sympy.Integer) or isinstance(x, int) else unbounded


def _leaf_sizes(val: Any) -> list[Any]:
    """The sizes a placeholder's value carries: a tensor's dims, or the value itself (a SymInt input)."""
    if isinstance(val, torch.Tensor):
        return list(val.shape)
    return [val] if isinstance(val, _SYM) else []


def _is_size_op(n: fx.Node) -> bool:
    """An op computing or asserting sizes (no tensor result): sym_size, operator.mul on sizes, _assert_scalar."""
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor) or (isinstance(val, (list, tuple)) and val):
        return False
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname.startswith(_ASSERTS) or t._opname.startswith("sym_")
    return getattr(t, "__module__", None) in ("_operator", "operator", "math", "builtins") or t in (
        operator.mul, operator.add, operator.sub, operator.floordiv, operator.mod, operator.neg)


def dynamic_dims(first: list[Any], new: list[Any]) -> list[set[int]]:
    """Per flat input leaf, the dims whose size differs between two calls (empty for non-tensors)."""
    out = []
    for a, b in zip(first, new):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim():
            out.append({d for d in range(a.dim()) if a.shape[d] != b.shape[d]})
        else:
            out.append(set())
    return out


def shapes_tree(marks: list[Any], spec: pytree.TreeSpec) -> Any:
    """The flat per-leaf `marks` in the form torch.export's ``dynamic_shapes`` wants for inputs of structure `spec`:
    the builtin containers (tuple, list, dict, namedtuple...) as they are, a registered node of another type (a
    transformers ``DynamicCache``) as the list of its children's marks (``pytree.tree_unflatten`` would call the
    node's own unflatten, which builds a cache holding the marks: export refused it, "Node type mismatch")."""
    it = iter(marks)

    def build(s: pytree.TreeSpec) -> Any:
        if s.is_leaf():
            return next(it)
        kids = [build(c) for c in s.children()]
        node = pytree.namedtuple if pytree.is_namedtuple_class(s.type) else s.type
        if node in pytree.BUILTIN_TYPES:
            return pytree.SUPPORTED_NODES[node].unflatten_fn(kids, s.context)
        return kids

    return build(spec)


def export_symbolic(model_or_fn: Any, args: tuple, kwargs: dict, dims: list[set[int]] | None) -> SymbolicGraph:
    """torch.export of the model with ``Dim.AUTO`` on `dims` (per flat input leaf; None: every dim of every tensor)."""
    from torch.export import Dim

    model = model_or_fn if isinstance(model_or_fn, torch.nn.Module) else _as_module(model_or_fn)
    args, kwargs = distinct_inputs(model, tuple(args), dict(kwargs))
    model = capture_copy(model)  # the user's module keeps its tensors while this traces fakes
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    if dims is None:
        dims = [set(range(x.dim())) if isinstance(x, torch.Tensor) else set() for x in leaves]
    marks = [({d: Dim.AUTO for d in ds} if isinstance(x, torch.Tensor) and ds else None) for x, ds in zip(leaves, dims)]
    m_args, m_kwargs = shapes_tree(marks, spec)
    try:
        bound = inspect.signature(model.forward).bind(*m_args, **m_kwargs)
    except TypeError as e:
        raise CaptureError(f"cannot name the inputs for dynamic_shapes: {e}") from None
    params = inspect.signature(model.forward).parameters
    shapes = {k: (tuple(v) if params[k].kind == inspect.Parameter.VAR_POSITIONAL else v)
              for k, v in bound.arguments.items()}
    try:
        with torch.no_grad(), quiet_fake_tensor_log():
            ep = torch.export.export(model, tuple(args), dict(kwargs) or None, strict=False,
                                     dynamic_shapes=shapes).run_decompositions(decomp.export_decompositions())
    except Exception as e:
        raise CaptureError(f"torch.export with dynamic sizes failed: {type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
    consts = program_constants(ep, "the model")
    return SymbolicGraph(ep.graph_module, consts, ep.call_spec.in_spec, ep.call_spec.out_spec, ep.range_constraints,
                         guards=_guards(ep), output_specs=ep.graph_signature.output_specs,
                         const_targets={s.arg.name: s.target for s in ep.graph_signature.input_specs
                                        if s.arg.name in consts})


def _guards(ep: torch.export.ExportedProgram) -> Callable[..., None]:
    """The program's shape guards as a function of the flat user inputs (torch's own, from ``ep.module()``).

    A program with guards that torch cannot turn into a function accepts no other sizes: its symbolic graph
    would take a branch that torch.export chose for the example sizes only."""
    if not getattr(ep, "_guards_code", None):
        return lambda *leaves: None
    fn = getattr(ep.module(), "_guards_fn", None)
    if fn is None:
        def refuse(*leaves):
            raise AssertionError(f"torch gave no guard function for {ep._guards_code}")
        return refuse
    return fn
