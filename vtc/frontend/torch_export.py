"""torch.export frontend: a model (or function) -> ExportedProgram (core ATen) -> vtc Graph.

``export_graph`` captures the model in core ATen by one ``make_fx`` trace
(``vtc.frontend.fx_capture``: the graph of torch.export in a third of the
time); a model that capture refuses (state mutation, data-dependent control
flow, ...) goes to ``torch.export.export(strict=False)`` under ``no_grad`` and
``run_decompositions()`` (the core ATen op set) — in one trace instead of two,
see ``vtc.frontend.core_export``.  ``graph_from_fx`` turns the ATen fx graph
into vtc's IR:

- placeholders that the graph signature names as parameters, buffers or lifted
  tensor constants become ``const`` Values holding their tensor; user inputs
  become ``input`` Values in torch.export's flat order (non-tensor user inputs,
  which export specialises, are kept aside in ``graph.meta["input_consts"]``);
- each ATen call becomes a Node whose kind comes from ``vtc.ir.ops.classify``
  (an unknown op is a ``fallback``, still runnable);  ``operator.getitem`` on a
  multi-output op is folded into that node's ``outputs`` (named ``<node>_<i>``),
  assertion ops are dropped;  shapes and dtypes come from ``meta["val"]``;
- ``Graph.in_spec``/``out_spec`` are torch.export's pytree specs of
  ``(args, kwargs)`` and of what the model returns: ``flatten_inputs`` and
  ``unflatten_outputs`` go between them and the graph's flat tensor lists
  (non-tensor outputs are kept in ``graph.meta["output_consts"]``).

Only static shapes are supported: a symbolic size raises ``CaptureError``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import sys
import threading
import types
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from vtc.frontend.core_export import export_core_aten
from vtc.ir.graph import Graph, Node, Value
from vtc.ir.ops import classify

_TRY_COMPILE = 'Try torch.compile(model, backend="vtc"), which tolerates graph breaks.'


class CaptureError(RuntimeError):
    """torch.export could not capture the model, or its graph uses what vtc cannot represent."""


class ConstantInputChanged(ValueError):
    """A non-tensor input (captured as a constant) has another value than in the capture."""


class InputShapeError(CaptureError, ValueError):
    """A call's input sizes differ from the example's and the model does not run with them (a ValueError)."""


class _QuietFakeTensorLog(logging.Filter):
    """Drops fake-tensor's log of an op that failed on fake tensors: the capture raises with the cause."""

    def __init__(self) -> None:
        super().__init__()
        self.users, self.lock = 0, threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


_QUIET = _QuietFakeTensorLog()


@contextlib.contextmanager
def quiet_fake_tensor_log():
    """While a capture runs: an op failing on fake tensors raises (and vtc names it) without torch logging its
    traceback at ERROR level (``torch._subclasses.fake_tensor``) as well."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    with _QUIET.lock:
        _QUIET.users += 1
        logger.addFilter(_QUIET)
    try:
        yield
    finally:
        with _QUIET.lock:
            _QUIET.users -= 1
            if not _QUIET.users:
                logger.removeFilter(_QUIET)


def _as_module(fn: Callable) -> torch.nn.Module:
    """Wraps a plain callable in an nn.Module whose forward has fn's signature (so inputs keep their names)."""

    class FnModule(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return fn(*args, **kwargs)

    try:
        sig = inspect.signature(fn)
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        FnModule.forward.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])
    except (TypeError, ValueError):  # a builtin without a signature: args_0, args_1, ...
        pass
    return FnModule()


def program_constants(ep: Any, name: str) -> dict[str, torch.Tensor]:
    """The parameters, buffers and constant tensors of ExportedProgram `ep` by graph input name.

    Raises CaptureError (naming `name`) for an input of another kind than those
    and the user inputs, or an output that mutates state.
    """
    from torch.export.graph_signature import InputKind, OutputKind

    consts: dict[str, torch.Tensor] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            t = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
            consts[spec.arg.name] = t.detach()
        elif spec.kind != InputKind.USER_INPUT:
            raise CaptureError(f"{name}: graph input {spec.arg.name} of kind {spec.kind.name} "
                               f"({spec.target}) is not supported by vtc")
    bad = [f"{s.arg.name} ({s.kind.name} of {s.target})" for s in ep.graph_signature.output_specs
           if s.kind not in (OutputKind.USER_OUTPUT, OutputKind.USER_INPUT_MUTATION)]  # (user_input_mutations)
    if bad:
        raise CaptureError(f"{name} mutates state, which vtc does not support: {', '.join(bad)}. "
                           "Call model.eval() and build transformers models with use_cache=False.")
    return consts


# held while a model is captured (vtc.Compiled): one capture at a time (torch's tracing keeps process-wide
# state); the user's module is not touched by a capture (``capture_copy``), so eager calls may run meanwhile
CAPTURE_LOCK = threading.RLock()


def capture_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s module tree that shares every tensor, for a capture to swap fake tensors into.

    Both captures (``fx_capture`` and torch.export's non-strict trace) put fake tensors into the parameter,
    buffer and attribute slots of the module they trace until they return; on the user's module, another
    thread running it eagerly meanwhile met fake tensors (an AssertionError, or an abort).  Each module
    reachable through ``_modules`` is copied (its ``__dict__``, parameter, buffer and submodule tables are
    new dicts); a plain attribute holding one of those modules, directly or in a list, tuple or dict, is
    pointed at its copy, and so is a method or ``functools.partial`` bound to one (a forward replaced on the
    instance).  Tensors, hooks and other attributes are shared, not copied.  A module that cannot be
    copied this way (a ScriptModule) is returned as it is."""
    if isinstance(model, torch.jit.ScriptModule):
        return model
    try:
        copies: dict[int, torch.nn.Module] = {}
        for m in model.modules():
            c = type(m).__new__(type(m))
            vars(c).update(vars(m))
            copies[id(m)] = c

        def remap(x: Any) -> Any:
            if isinstance(x, torch.nn.Module):
                return copies.get(id(x), x)
            if isinstance(x, types.MethodType) and id(x.__self__) in copies:  # m.forward = MethodType(f, m)
                return types.MethodType(x.__func__, copies[id(x.__self__)])
            if type(x) is functools.partial and any(id(a) in copies for a in x.args):  # accelerate's hooks
                return functools.update_wrapper(functools.partial(x.func, *map(remap, x.args), **x.keywords), x)
            if type(x) in (list, tuple) and any(isinstance(y, torch.nn.Module) for y in x):
                return type(x)(remap(y) for y in x)
            if type(x) is dict and any(isinstance(y, torch.nn.Module) for y in x.values()):
                return {k: remap(y) for k, y in x.items()}
            return x

        for m in model.modules():
            d = vars(copies[id(m)])
            for key, v in list(d.items()):
                if key in ("_parameters", "_buffers"):
                    d[key] = dict(v)
                elif key == "_modules":
                    d[key] = {k: remap(c) for k, c in v.items()}
                else:
                    d[key] = remap(v)
        return copies[id(model)]
    except Exception:  # noqa: BLE001 - an unusual module class: the capture traces the module itself
        return model


def register_transformers_caches(model: Any) -> None:
    """transformers' KV caches (``DynamicCache`` and every other ``Cache`` class) as pytree nodes, as
    transformers' own exporter registers them, so that a model returning one (every causal LM built with its
    default ``use_cache=True``) or taking one (``past_key_values=``) is captured: the cache's tensors become
    graph outputs / inputs and the call returns a working cache object.  Only where transformers is already
    imported and has its exporter's ``register_cache_pytrees_for_model`` (a process-wide registration, done
    again for classes defined since; without it a cache output stays a capture error)."""
    if "transformers" not in sys.modules:
        return
    try:
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except Exception:  # noqa: BLE001 - another transformers version: the capture reports the cache type
        return
    try:
        register_cache_pytrees_for_model(model)
    except Exception:  # noqa: BLE001 - as above: a registration that fails leaves the capture's own error
        pass


def _cache_class() -> type | None:
    """transformers' ``Cache`` base class where transformers is imported, else None."""
    mod = sys.modules.get("transformers.cache_utils")
    return getattr(mod, "Cache", None)


def takes_a_cache(spec: Any) -> bool:
    """Whether the inputs of structure `spec` (a TreeSpec) hold a transformers ``Cache``."""
    cache = _cache_class()
    if cache is None or spec is None:
        return False
    todo = [spec]
    while todo:
        s = todo.pop()
        if isinstance(s.type, type) and issubclass(s.type, cache):
            return True
        todo.extend(s.children())
    return False


def update_caches_in_place(args: tuple, kwargs: dict, result: Any) -> Any:
    """`result` with each transformers ``Cache`` it returns replaced by the input cache of the same class, updated
    to the returned one's state, as eager forward appends to the cache it is given and returns that object (the
    compiled graph is functional: it returns new tensors and leaves the input cache as it was)."""
    cache = _cache_class()
    is_cache = lambda x: isinstance(x, cache)  # noqa: E731
    given = [x for x in pytree.tree_leaves((args, kwargs), is_leaf=is_cache) if is_cache(x)]
    if not given:
        return result
    returned = [x for x in pytree.tree_leaves(result, is_leaf=is_cache) if is_cache(x)]
    pairs = {}
    for out in returned:
        same = [c for c in given if type(c) is type(out) and id(c) not in pairs.values()]
        if same:
            pairs[id(out)] = id(same[0])
            vars(same[0]).clear()
            vars(same[0]).update(vars(out))
    by_id = {id(c): c for c in given}
    return pytree.tree_map(lambda x: by_id[pairs[id(x)]] if is_cache(x) and id(x) in pairs else x, result,
                           is_leaf=is_cache)


def export_graph(model_or_fn: Callable, example_inputs: Any, example_kwargs: dict | None = None) -> Graph:
    """Captures ``model_or_fn(*example_inputs, **example_kwargs)`` with torch.export as a core-ATen Graph."""
    model = model_or_fn if isinstance(model_or_fn, torch.nn.Module) else _as_module(model_or_fn)
    register_transformers_caches(model_or_fn)
    args = tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)
    args, example_kwargs = distinct_inputs(model, args, example_kwargs)
    model = capture_copy(model)  # the user's module keeps its tensors while this traces fakes
    name = type(model_or_fn).__name__ if isinstance(model_or_fn, torch.nn.Module) else getattr(
        model_or_fn, "__name__", repr(model_or_fn))
    with quiet_fake_tensor_log():
        graph, refused = _fast_capture(model, args, example_kwargs)
    if graph is not None:
        graph.meta["source"] = f"torch.export of {name}"
        return graph
    try:
        with torch.no_grad(), quiet_fake_tensor_log():
            ep, how = export_core_aten(model, args, example_kwargs)
    except Exception as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()][:4]
        cause = f"{type(e).__name__}: " + "\n    ".join(lines)
        err = CaptureError(f"torch.export could not capture {name}: {cause}\n{_TRY_COMPILE}")
        err.refused = refused  # why the fast capture refused it (its trace error names concrete sizes)
        raise err from e

    consts = program_constants(ep, name)
    try:
        graph = graph_from_fx(ep.graph_module, consts, in_spec=ep.call_spec.in_spec, out_spec=ep.call_spec.out_spec)
        user_input_mutations(graph, ep.graph_signature.output_specs)
    except CaptureError as e:
        raise CaptureError(f"{name}: {e}\n{_TRY_COMPILE}") from e
    graph.meta["source"] = f"torch.export of {name}"
    graph.meta["capture"] = how
    graph.meta["fast_capture_refused"] = refused
    const_sources(graph, {s.arg.name: s.target for s in ep.graph_signature.input_specs if s.arg.name in consts})
    return graph


def user_input_mutations(graph: Graph, specs: Sequence[Any]) -> None:
    """torch.export's outputs for user inputs that forward changes in place (``USER_INPUT_MUTATION``, before the
    user's outputs) moved after forward's own outputs, with ``graph.meta["input_mutations"]`` (input index, output
    index) pairs: the form ``fx_capture._outputs_for_input_mutations`` gives, written back by the call
    (``write_back``).  Non-tensor outputs' positions in ``graph.meta["output_consts"]`` are counted among the
    user's outputs.  `specs`: the program's ``graph_signature.output_specs``."""
    from torch.export.graph_signature import OutputKind

    if not any(s.kind == OutputKind.USER_INPUT_MUTATION for s in specs):
        return
    consts = graph.meta["output_consts"]
    it = iter(graph.outputs)
    leaves = [("const", consts[i]) if i in consts else ("value", next(it)) for i in range(len(specs))]
    position = {v.name: k for k, v in enumerate(graph.inputs)}
    user, user_consts, written, values = [], {}, [], []
    for s, (what, x) in zip(specs, leaves):
        if s.kind == OutputKind.USER_OUTPUT:
            if what == "const":
                user_consts[len(user) + len(user_consts)] = x
            else:
                user.append(x)
        elif what != "value" or s.target not in position:
            raise CaptureError(f"forward changes input {s.target} in place, but its new value is {x!r:.60}: "
                               "vtc writes back tensor inputs of the graph only")
        else:
            written.append(position[s.target])
            values.append(x)
    graph.outputs = [*user, *values]
    graph.meta["output_consts"] = user_consts
    graph.meta["input_mutations"] = tuple((k, len(user) + i) for i, k in enumerate(written))


def const_sources(graph: Graph, targets: dict[str, str]) -> None:
    """Sets ``graph.meta["const_sources"]``: {constant name: the qualified name of the module's tensor it was
    captured from} for the constants the graph reads (``vtc.runtime.weights`` watches them for being replaced)."""
    read = {v.name for n in graph.nodes for v in n.inputs} | {v.name for v in graph.outputs}
    graph.meta["const_sources"] = {v.name: targets[v.name] for v in graph.consts
                                   if v.name in targets and v.name in read}


def distinct_inputs(model: torch.nn.Module, args: tuple, kwargs: dict | None) -> tuple[tuple, dict | None]:
    """args and kwargs where a tensor sharing memory with an earlier input or with a parameter / buffer of the
    model is replaced by a copy.  A capture traces fake tensors made per storage: the same tensor given twice
    (self-attention's ``mha(x, x, x)``) became one graph input read for both, so a later call with two
    different tensors used the first for both; a buffer given as an input became that input."""
    taken = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel()}
    flat, spec = pytree.tree_flatten((args, kwargs))
    changed = False
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor) and x.numel() and x.device.type != "meta":
            ptr = x.untyped_storage().data_ptr()
            if ptr in taken:
                flat[i], changed = x.detach().clone(), True
            taken.add(ptr)
    return pytree.tree_unflatten(flat, spec) if changed else (args, kwargs)


def _fast_capture(model: torch.nn.Module, args: tuple, kwargs: dict | None) -> tuple[Graph | None, str]:
    """(the Graph of vtc.frontend.fx_capture's one make_fx trace, "") or (None, why it was refused)."""
    from vtc.frontend import fx_capture

    try:
        gm, weights, in_spec, out_spec, input_consts = fx_capture.capture(model, args, kwargs)
        graph = graph_from_fx(gm, weights, in_spec=in_spec, out_spec=out_spec)
    except (fx_capture.Refused, CaptureError) as e:
        return None, str(e)
    graph.meta["input_consts"] = input_consts
    graph.meta["capture"] = fx_capture.CAPTURE
    const_sources(graph, gm.meta.get("const_targets", {}))
    written = gm.meta.get("input_mutations", ())
    if written:  # forward's outputs, then one per input that forward changes in place
        first = len(graph.outputs) - len(written)
        graph.meta["input_mutations"] = tuple((k, first + i) for i, k in enumerate(written))
    return graph, ""


# ----------------------------------------------------------------------------- fx -> Graph

# ops with no result that only check things: dropped
NOT_A_SIZE = object()  # graph_from_fx's `concrete.size(node)` for a node that is not a size computation
_DROPPED = ("_assert", "sym_constrain_range", "_check", "_functional_sym_constrain_range")


def graph_from_fx(
    gm: fx.GraphModule | fx.Graph,
    consts: dict[str, torch.Tensor] | None = None,
    in_spec: Any = None,
    out_spec: Any = None,
    concrete: Any = None,
) -> Graph:
    """An ATen fx graph -> Graph; placeholders named in ``consts`` become const Values.

    `concrete` (``vtc.frontend.symbolic``: a graph with symbolic sizes read at given sizes, without copying it)
    has ``size(node)`` (the value of a node that computes a size, or ``NOT_A_SIZE``), ``val(node)`` (a node's
    ``meta["val"]`` at those sizes) and ``arg(x)`` (a SymInt/SymFloat/SymBool argument's value)."""
    fx_graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    module = gm if isinstance(gm, fx.GraphModule) else fx_graph.owning_module
    consts = consts or {}
    sizes = {n: v for n in fx_graph.nodes if (v := concrete.size(n)) is not NOT_A_SIZE} if concrete else {}
    val_of = concrete.val if concrete else (lambda n: n.meta.get("val"))
    taken = {n.name for n in fx_graph.nodes if n not in sizes}
    env: dict[fx.Node, Any] = {}
    inputs: list[Value] = []
    const_vals: list[Value] = []
    nodes: list[Node] = []
    outs: list[Value] = []
    meta: dict[str, Any] = {"input_consts": {}, "output_consts": {}}
    n_user = 0

    def const(name: str, t: torch.Tensor) -> Value:
        if t.device.type != "cpu":  # kernels would read its data pointer as host memory (a meta tensor's is null)
            what = "has no data (meta device: load the weights first)" if t.device.type == "meta" else (
                f"is on {t.device}")
            raise CaptureError(f"the model's tensor %{name} ({list(t.shape)}, {t.dtype}) {what}; vtc compiles for "
                               "the CPU: model.to('cpu') before vtc.compile")
        v = Value(name, tuple(t.shape), t.dtype, "const", data=t)
        const_vals.append(v)
        return v

    def lookup(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = env.get(a)
            if v is None or isinstance(v, (bool, int, float, str)):
                return v  # a specialised non-tensor input
            if not isinstance(v, Value):
                raise CaptureError(f"{a.name} is used as a tensor but is {v!r} (a {type(v).__name__})")
            return v
        if isinstance(a, torch.Tensor):  # a tensor baked into the arguments
            name = _fresh("_tensor_constant", taken)
            return const(name, a.detach())
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            if concrete:
                return concrete.arg(a)
            raise CaptureError(f"symbolic value {a} in the arguments; vtc supports static shapes only")
        return a

    for n in fx_graph.nodes:
        if n in sizes:
            env[n] = sizes[n]  # a size computation at the given sizes: its value, not a node
            continue
        if n.op == "placeholder":
            val = val_of(n)
            if n.name in consts:
                env[n] = const(n.name, consts[n.name])
            elif isinstance(val, torch.Tensor):
                env[n] = Value(n.name, _static_shape(n.name, val), val.dtype, "input")
                inputs.append(env[n])
            elif val is None or isinstance(val, (bool, int, float, str)):
                meta["input_consts"][n_user] = val  # a non-tensor input that export specialised
                env[n] = val
            else:
                raise CaptureError(f"input {n.name} is a {type(val).__name__} ({val}); vtc supports "
                                   "tensor inputs with static shapes and constant non-tensor inputs")
            n_user += n.name not in consts
        elif n.op == "get_attr":
            obj = module
            for part in n.target.split("."):
                obj = getattr(obj, part)
            if not isinstance(obj, torch.Tensor):
                raise CaptureError(f"{n.name}: attribute {n.target} is a {type(obj).__name__}, not a tensor "
                                   "(higher-order ops such as cond/while_loop are not supported)")
            env[n] = const(n.name, obj.detach())
        elif n.op == "call_function":
            if n.target is operator.getitem and isinstance(env.get(n.args[0]), tuple):
                env[n] = env[n.args[0]][n.args[1]]
                continue
            if _is_check(n.target):
                continue
            args, kwargs = _plain(n.args, lookup), _plain(dict(n.kwargs), lookup)
            val = val_of(n)
            outputs = _outputs(n, taken, val)
            nodes.append(Node(n.name, n.target, args, kwargs, outputs, classify(n.target, args, kwargs)))
            env[n] = outputs[0] if isinstance(val, torch.Tensor) else outputs
        elif n.op == "output":
            for i, leaf in enumerate(pytree.tree_leaves(n.args[0], is_leaf=lambda x: x is None)):
                v = env[leaf] if isinstance(leaf, fx.Node) else leaf
                if isinstance(v, Value):
                    outs.append(v)
                elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, tuple)):
                    raise CaptureError(f"graph output {i} is {v!r}; vtc supports tensor outputs")
                else:
                    meta["output_consts"][i] = v
        else:
            raise CaptureError(f"{n.name}: fx op {n.op!r} ({n.target}) is not an ATen call; "
                               "graph_from_fx takes ATen graphs (export + run_decompositions)")
    return Graph(inputs, const_vals, nodes, outs, in_spec=in_spec, out_spec=out_spec, meta=meta)


def _plain(a: Any, leaf: Callable) -> Any:
    """fx's immutable lists/dicts -> plain lists/tuples/dicts, with ``leaf`` applied to the rest."""
    if isinstance(a, tuple):
        return tuple(_plain(x, leaf) for x in a)
    if isinstance(a, list):
        return [_plain(x, leaf) for x in a]
    if isinstance(a, dict):
        return {k: _plain(v, leaf) for k, v in a.items()}
    return leaf(a)


def _is_check(target: Any) -> bool:
    """Assertion ops with no result (``_assert_tensor_metadata``, ``_assert_async``, ...)."""
    if not isinstance(target, torch._ops.OpOverload) or target._schema.returns:
        return False
    if target._opname.startswith(_DROPPED):
        return True
    raise CaptureError(f"{target}: an op with side effects and no result; vtc does not keep side effects")


def _static_shape(name: str, t: torch.Tensor) -> tuple[int, ...]:
    unbacked = [s for s in t.shape if isinstance(s, torch.SymInt) and str(s.node.expr).startswith("u")]
    if unbacked:  # torch's unbacked symbols (u0, u1, ...): sizes known only once the values are
        raise CaptureError(f"%{name} has shape {list(t.shape)}: size {unbacked[0]} depends on the values of the "
                           "inputs (a boolean mask index, nonzero, unique, ...), which vtc's graphs cannot "
                           "represent (torch.compile runs such an op in eager between two graphs)")
    if any(not isinstance(s, int) for s in t.shape):
        raise CaptureError(f"%{name} has symbolic shape {list(t.shape)}; vtc supports static shapes only "
                           "(export without dynamic_shapes, or torch.compile(..., dynamic=False))")
    return tuple(t.shape)


def _outputs(n: fx.Node, taken: set[str], val: Any) -> tuple[Value, ...]:
    """The Values an fx call produces: one per tensor of its ``meta["val"]``, `val`."""
    if isinstance(val, torch.Tensor):
        return (Value(n.name, _static_shape(n.name, val), val.dtype),)
    if not isinstance(val, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in val):
        what = "no recorded result" if val is None else f"a {type(val).__name__} result {val!r:.80}"
        raise CaptureError(f"{n.name} ({n.target}) has {what}; vtc supports ops whose results are tensors")
    base = n.name
    while any(f"{base}_{i}" in taken for i in range(len(val))):
        base += "_"
    names = [f"{base}_{i}" for i in range(len(val))]
    taken.update(names)
    return tuple(Value(nm, _static_shape(nm, t), t.dtype) for nm, t in zip(names, val))


def _fresh(prefix: str, taken: set[str]) -> str:
    i = 0
    while f"{prefix}{i}" in taken:
        i += 1
    taken.add(f"{prefix}{i}")
    return f"{prefix}{i}"


# ----------------------------------------------------------------------------- specs

def flatten_inputs(graph: Graph, args: Any, kwargs: dict | None = None) -> list[torch.Tensor]:
    """The user's ``(args, kwargs)`` -> the graph's flat input tensors (checked against ``in_spec``)."""
    args = tuple(args) if isinstance(args, (list, tuple)) else (args,)
    kwargs = dict(kwargs or {})
    spec = graph.in_spec
    if spec is not None and spec.num_children == 2 and spec.child(1).type is dict:
        keys = list(spec.child(1).context)
        if set(keys) == set(kwargs):
            kwargs = {k: kwargs[k] for k in keys}  # torch.export's keyword order
    leaves, got = pytree.tree_flatten((args, kwargs))
    if spec is not None and got != spec:
        raise ValueError(f"inputs do not match the captured structure: {_structure_diff(spec, (args, kwargs))}"
                         f"\n  expected {spec}\n  received {got}")
    consts = graph.meta.get("input_consts", {})
    for i, c in consts.items():
        if isinstance(leaves[i], torch.Tensor) or type(leaves[i]) is not type(c) or leaves[i] != c:
            raise ConstantInputChanged(f"non-tensor input {i} was {c!r} when captured, received {leaves[i]!r}; "
                                       "capture again for a new value")
    return [leaf for i, leaf in enumerate(leaves) if i not in consts]


def _structure_diff(spec: Any, received: Any) -> str:
    """The inputs a call lacks and those it has in excess of the captured structure, by their paths
    (``args[1]``, ``kwargs['mask']``, ``args[0]['z'][0]``); or what differs in kind."""
    def paths(tree: Any) -> list[str]:
        out = []
        for path, _ in pytree.tree_flatten_with_path(tree)[0]:
            head = ("args", "kwargs")[path[0].idx] if path else ""
            out.append(head + pytree.keystr(path[1:]))
        return out

    try:
        want = paths(pytree.tree_unflatten([0] * spec.num_leaves, spec))
        have = paths(received)
    except Exception:  # noqa: BLE001 - a spec without paths: the specs below say it
        return "see the specs"
    missing = [p for p in want if p not in have]
    extra = [p for p in have if p not in want]
    parts = ([f"missing {', '.join(missing[:6])}"] if missing else []) + (
        [f"not expected {', '.join(extra[:6])}"] if extra else [])
    return "; ".join(parts) if parts else "the same inputs in other containers"


def unflatten_outputs(graph: Graph, flat: list[torch.Tensor], inputs: list[torch.Tensor] = ()) -> Any:
    """The graph's flat output tensors -> what the model returns (via ``out_spec``).

    Where forward changes inputs in place (``graph.meta["input_mutations"]``: (input index, output index)
    pairs), their new values are first copied into the flat `inputs` the call was given, and an output that is
    such a value is returned as that input tensor, as eager returns the tensor it changed."""
    mutations = graph.meta.get("input_mutations", ())
    if mutations:
        flat = write_back(graph, flat, inputs)
    consts = graph.meta.get("output_consts", {})
    it = iter(flat)
    leaves = [consts[i] if i in consts else next(it) for i in range(len(flat) + len(consts))]
    if graph.out_spec is None:
        return leaves[0] if len(leaves) == 1 else tuple(leaves)
    return pytree.tree_unflatten(leaves, graph.out_spec)


def write_back(graph: Graph, flat: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies each new value of an input that forward changes in place into that input tensor; returns forward's
    own outputs, those that are such a value replaced by the input tensor.  The call has run ``mutation_guard``'s
    test on `inputs` before its kernels (a kernel may store an input's new value into it in place)."""
    mutations = graph.meta["input_mutations"]
    if len(inputs) != len(graph.inputs):
        raise ValueError(f"{len(mutations)} input(s) are changed in place by the model: the call's "
                         f"{len(graph.inputs)} input tensors are needed to write them back, got {len(inputs)}")
    alias = {}
    for k, j in mutations:
        new, given = flat[j], inputs[k]
        if not (new.data_ptr() == given.data_ptr() and new.stride() == given.stride()):  # else stored in place
            with torch.no_grad():
                given.copy_(new)
        alias[graph.outputs[j].name] = given
    n = len(flat) - len(mutations)
    return [alias.get(v.name, t) for v, t in zip(graph.outputs[:n], flat[:n])]


def mutation_guard(graph: Graph) -> Callable[[Sequence[torch.Tensor]], None] | None:
    """The test a call runs on its flat input tensors before any kernel, where forward changes inputs in place;
    None where it changes none.  ``guard(inputs)`` raises

    - a ValueError where an input that forward changes in place shares memory with another input (the same
      tensor passed twice, or views of one), naming both.  The graph was captured with them as separate tensors,
      so the other one's readers would see its value from before the change, where eager's see the new one
      (``f(t, t)`` with ``a.add_(1); return b * 2``).  Inputs that are disjoint parts of one storage (k and v
      caches as halves of one tensor) pass: where a storage repeats, byte ranges are compared
      (``overlapping_mutated_inputs``);
    - eager's RuntimeError where such an input has elements that share memory (an ``expand``-ed tensor), naming
      it: eager refuses to write it before changing anything, where the write-back copy failed once the
      kernels had run.

    Before the kernels: a kernel may store an input's new value into it in place (a pushed ``index_copy_``,
    ``vtc.codegen.push``) and the write-back changes the inputs one after the other, so a call refused after
    them had changed its inputs.  `inputs`: as many tensors as the graph has inputs (the call checked their
    count).  The test is one set of the inputs' storage addresses and an ``is_contiguous()`` per input changed
    in place, in a function generated for the graph (no loop: ~80 ns an input, about half the cost of the dict
    of lists of 891b458, which ran after the kernels)."""
    mutations = graph.meta.get("input_mutations", ())
    if not mutations:
        return None
    n = len(graph.inputs)
    names = tuple(v.name for v in graph.inputs)
    changed = tuple(sorted({k for k, _ in mutations}))
    args = [f"a{k}" for k in range(n)]
    lines = ["def guard(inputs):", f"    {', '.join(args)}{',' if n == 1 else ''} = inputs"]
    if n > 1:
        pointers = ", ".join(f"{a}.untyped_storage().data_ptr()" for a in args)
        lines += [f"    if len({{{pointers}}}) != {n}:", "        refuse(names, changed, inputs)"]
    for k in changed:  # a contiguous tensor has no internal overlap: the one test of the common call
        lines += [f"    if not a{k}.is_contiguous() and overlaps(a{k}) == 1:", f"        self_overlap(names, {k})"]
    env = {"refuse": overlapping_mutated_inputs, "names": names, "changed": changed,
           "overlaps": torch._debug_has_internal_overlap, "self_overlap": _refuse_internal_overlap}
    exec(compile("\n".join(lines) + "\n", "<vtc mutation guard>", "exec"), env)  # noqa: S102 - our own text
    return env["guard"]


def _refuse_internal_overlap(names: Sequence[str], k: int) -> None:
    raise RuntimeError(f"input {k} (%{names[k]}) is changed in place by the model, but more than one of its elements "
                       "refers to a single memory location (an expanded tensor), which eager refuses to write; "
                       "pass a copy (.clone()) of it")


def overlapping_mutated_inputs(names: Sequence[str], changed: Sequence[int], inputs: Sequence[torch.Tensor]) -> None:
    """Raises the ValueError of ``mutation_guard`` for the first input among `changed` (positions) whose bytes
    overlap another input's (their ranges from the first byte to the last compared); `names`: the graph's input
    names.  Parts of one storage that do not meet pass (halves, rows; interleaved strided views, whose ranges
    cross, do not)."""
    spans = [_span(t) for t in inputs]
    for k in changed:
        lo, hi = spans[k]
        for other, (olo, ohi) in enumerate(spans):
            if other != k and lo < ohi and olo < hi:
                raise ValueError(f"input {k} (%{names[k]}) is changed in place by the model and shares memory with "
                                 f"input {other} (%{names[other]}): vtc compiled them as separate tensors, so the "
                                 f"result would differ from eager's; pass a copy (.clone()) of one of them, or use "
                                 f"torch.compile(model, backend=\"vtc\")")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """(address of the first byte, address past the last) that `t` reaches; (0, 0) where it is empty."""
    if t.numel() == 0:
        return 0, 0
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
