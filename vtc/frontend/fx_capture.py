"""The model captured to core ATen by one ``make_fx`` trace: the fast path of ``export_graph``.

``torch.export.export(strict=False)`` (even in one trace, ``vtc.frontend.core_export``)
runs the model twice on fake tensors — aot_autograd's metadata pass, then
its graph pass — each op through a Python functionalization mode, and
builds an ExportedProgram around the result; on a 4-layer Llama that is 3-5
s, most of a warm ``vtc.compile``.  ``capture`` runs the model once:

- the module tree's tensors (parameters, buffers and plain tensor attributes,
  which torch.export lifts as constants; a tied tensor once) and the user's
  tensor inputs become the traced function's inputs, on fake tensors
  (``make_fx(tracing_mode="fake")``, static shapes): nothing is computed, no
  real tensor of the model can be touched (a real tensor met in the trace
  raises), and control flow on a tensor's values raises, as in export;
- the model's tensors are swapped for those inputs in every slot that holds
  them, and ``forward`` runs under ``torch.func.functionalize`` (C++
  functionalization: in-place ops become out-of-place ones, views stay views)
  with torch's core-ATen decomposition table and the python dispatcher, under
  ``no_grad`` and with ``torch.compiler.is_exporting()`` true, so models take
  the code paths they take under torch.export;
- dead nodes are removed (export's graph is dead-code free) and, as in
  ``core_export``, a ``lift_fresh_copy`` becomes the ``clone`` the core table
  makes of it; an ``alias`` (a no-op view in a functional graph) is dropped;
- an in-place view op that functionalization leaves (it removes data
  mutations only) on a tensor computed in the trace, such as the
  ``as_strided_`` of ``adaptive_avg_pool1d``'s decomposition (Swin's pooler),
  becomes its view op, read by the later users of that tensor: the node
  torch.export's functionalization makes of it.

The graph is torch.export's up to node names, the order of lifted constants,
a tied tensor held once and an eval-mode dropout that is its input instead
of a ``clone`` of it (``tests/frontend/test_fx_capture.py`` compares them op
for op on five models; every capture test runs the graph against eager).

It is a fast path only: whatever it does not handle like torch.export does,
it refuses, and ``export_graph`` runs torch.export instead (``Refused`` says
why; ``graph.meta["capture"]`` records which path made the graph):

- state mutation: an in-place op left in the graph (a mutated input,
  buffer or constant is written back with ``copy_``; an in-place view op
  on one of them), a parameter, buffer,
  submodule or tensor attribute assigned in ``forward``.  Every module's
  attributes, parameters, buffers and submodules are put back as they were
  after the trace, whatever forward did;
- non-tensor inputs other than None, bool, int, float and str (torch.export
  specialises those, and so does this: they are kept in
  ``graph.meta["input_consts"]``);
- any error of the trace (data-dependent control flow, an op without a fake
  kernel, higher-order ops, a real tensor from outside the module tree, ...)
  — torch.export then reports it, or succeeds;
- torch without the private helpers used here (looked up once; torch is
  pinned).
"""
from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch._decomp
import torch.fx as fx
import torch.utils._pytree as pytree

from vtc.frontend import decomp

CAPTURE = "make_fx to core ATen in one trace"
_SPECIALIZED = (bool, int, float, str)  # non-tensor inputs captured as constants (torch.export does too)


class Refused(RuntimeError):
    """The fast capture does not handle this model; torch.export should capture it."""


@functools.lru_cache(maxsize=1)
def _private() -> tuple | None:
    """(make_fx, enable_python_dispatcher, _compiling_state_context) when torch has them with the parameters
    used here, else None."""
    try:
        from torch._dispatch.python import enable_python_dispatcher
        from torch._export.utils import _compiling_state_context
        from torch.fx.experimental.proxy_tensor import make_fx
    except ImportError:
        return None
    try:
        params = inspect.signature(make_fx).parameters
    except (TypeError, ValueError):
        return None
    if not {"decomposition_table", "tracing_mode", "_allow_non_fake_inputs"} <= set(params):
        return None
    return make_fx, enable_python_dispatcher, _compiling_state_context


@functools.lru_cache(maxsize=1)
def _decompositions() -> dict:
    """torch's core-ATen decomposition table for a trace below autograd: ``run_decompositions()``'s without its
    CompositeImplicitAutograd entries, whose decompositions the dispatcher applies here as the trace meets those
    ops (``core_aten_decompositions()`` spends a quarter of a second collecting them); vtc's overrides
    (``vtc.frontend.decomp``) in place."""
    post_autograd = getattr(torch._decomp, "_core_aten_decompositions_post_autograd", None)
    table = post_autograd() if callable(post_autograd) else torch._decomp.core_aten_decompositions()
    return decomp.with_overrides(dict(table))


@dataclass
class _Tensors:
    """The tensors held by a module tree: parameters, then buffers, then plain tensor attributes (torch.export
    lifts those as constants), each tensor once, with every slot (a dict and a key) that holds it."""

    kinds: list[str]  # "p", "b" or "c" (the placeholder-name prefix torch.export gives each kind)
    names: list[str]  # qualified name of the first slot
    tensors: list[torch.Tensor]
    slots: list[list[tuple[dict, str]]]

    @staticmethod
    def of(model: torch.nn.Module) -> "_Tensors":
        out = _Tensors([], [], [], [])
        index: dict[int, int] = {}
        modules = list(model.named_modules())
        for kind in ("p", "b", "c"):
            for prefix, mod in modules:
                table = {"p": mod._parameters, "b": mod._buffers, "c": vars(mod)}[kind]
                for key, t in table.items():
                    if not isinstance(t, torch.Tensor):
                        continue
                    if id(t) not in index:
                        index[id(t)] = len(out.tensors)
                        out.kinds.append(kind)
                        out.names.append(f"{prefix}.{key}" if prefix else key)
                        out.tensors.append(t)
                        out.slots.append([])
                    out.slots[index[id(t)]].append((table, key))
        return out

    def swap_in(self, stand_ins: tuple) -> None:
        """Puts stand_ins[i] in every slot of tensor i (until `restore`)."""
        for t, slots in zip(stand_ins, self.slots):
            for table, key in slots:
                table[key] = t

    def changed(self, stand_ins: tuple) -> list[str]:
        """Slots that no longer hold their stand-in (forward reassigned them)."""
        return [self.names[i] for i, (t, slots) in enumerate(zip(stand_ins, self.slots))
                if any(table.get(key) is not t for table, key in slots)]

    def restore(self) -> None:
        """Puts every tensor back in its slots."""
        for t, slots in zip(self.tensors, self.slots):
            for table, key in slots:
                table[key] = t


def _snapshot(model: torch.nn.Module) -> list[tuple]:
    """Every module's attributes, parameters, buffers and submodules (shallow copies), for `_restore`."""
    return [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in model.modules()]


def _restore(snapshot: list[tuple]) -> list[str]:
    """Puts every module back as `_snapshot` found it; returns what forward had changed that torch.export
    would not capture: tensor attributes assigned, parameters, buffers or submodules added or replaced."""
    changed = []
    for m, attrs, params, buffers, modules in snapshot:
        now = dict(vars(m))
        for key in now.keys() | attrs.keys():
            new, old = now.get(key), attrs.get(key)
            if new is not old and any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves([new, old])):
                changed.append(f"{type(m).__name__}.{key}")
        for what, before, table in (("parameter", params, m._parameters), ("buffer", buffers, m._buffers),
                                    ("submodule", modules, m._modules)):
            if table.keys() != before.keys() or any(table[k] is not before[k] for k in before):
                changed.append(f"a {what} of {type(m).__name__}")
        vars(m).clear()
        vars(m).update(attrs)
        for before, table in ((params, m._parameters), (buffers, m._buffers), (modules, m._modules)):
            table.clear()
            table.update(before)
    return changed


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None) -> tuple[fx.GraphModule, dict, Any, Any, dict]:
    """(fx graph in core ATen, {placeholder name: parameter/buffer/constant tensor}, in_spec, out_spec, {flat
    input index: non-tensor constant}) of ``model(*args, **kwargs)`` traced once; raises Refused when
    torch.export should capture it instead.  The model is left as it was, whatever forward does."""
    private = _private()
    if private is None:
        raise Refused(f"torch {torch.__version__} lacks the private make_fx helpers used by the fast capture")
    make_fx, python_dispatcher, compiling = private
    kwargs = dict(kwargs or {})
    state = _Tensors.of(model)
    n = len(state.tensors)
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    tensor_at = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    consts = {i: x for i, x in enumerate(flat) if not isinstance(x, torch.Tensor)}
    bad = {i: type(x).__name__ for i, x in consts.items() if not isinstance(x, _SPECIALIZED)}
    if bad:
        raise Refused(f"non-tensor inputs of types {sorted(set(bad.values()))} (flat positions {sorted(bad)})")
    out_specs: list = []
    reassigned: list[str] = []

    def forward(*tensors):
        leaves = list(flat)
        for i, t in zip(tensor_at, tensors[n:]):
            leaves[i] = t
        a, k = pytree.tree_unflatten(leaves, in_spec)
        try:
            state.swap_in(tensors[:n])
            out = model(*a, **k)
            reassigned.extend(state.changed(tensors[:n]))
        finally:
            state.restore()
        outs, spec = pytree.tree_flatten(out)
        out_specs.append(spec)
        return outs

    snapshot = _snapshot(model)
    try:
        with torch.no_grad(), compiling(), python_dispatcher():
            gm = make_fx(torch.func.functionalize(forward, remove="mutations"), decomposition_table=_decompositions(),
                         tracing_mode="fake")(*state.tensors, *(flat[i] for i in tensor_at))
    except Exception as e:  # noqa: BLE001 - torch.export decides what this means
        raise Refused(f"{type(e).__name__}: {str(e).strip()[:300]}") from e
    finally:
        changed = _restore(snapshot)
    if changed or reassigned:
        raise Refused(f"forward changes the model's state: {sorted(set(changed + reassigned))[:5]}")
    _outputs_for_input_mutations(gm, n)
    _inplace_views_as_views(gm)
    mutating = [f"{nd.name} ({nd.target})" for nd in gm.graph.nodes
                if nd.op == "call_function" and isinstance(nd.target, torch._ops.OpOverload)
                and nd.target._schema.is_mutable]
    if mutating:
        raise Refused(f"in-place ops left after functionalization (state mutation): {', '.join(mutating[:5])}")
    _tidy(gm)
    placeholders = [nd for nd in gm.graph.nodes if nd.op == "placeholder"]
    _name_placeholders(model, placeholders, state, args, kwargs, tensor_at)
    weights = {p.name: t.detach() for p, t in zip(placeholders, state.tensors)}
    gm.meta["const_targets"] = {p.name: nm for p, nm in zip(placeholders, state.names)}  # vtc.runtime.weights
    return gm, weights, in_spec, out_specs[-1], consts


def _outputs_for_input_mutations(gm: fx.GraphModule, n_state: int) -> None:
    """Turns functionalization's final ``copy_(input, new value)`` of each user input that forward changes in
    place (a StaticCache's ``index_copy_``) into one more graph output, after forward's own; the user input
    positions are in ``gm.meta["input_mutations"]`` (the compiled call writes the values back, as eager's
    in-place ops leave them).  A copy into a parameter or buffer (the model's state) is left for the caller to
    refuse."""
    placeholders = [nd for nd in gm.graph.nodes if nd.op == "placeholder"]
    position = {p: i - n_state for i, p in enumerate(placeholders) if i >= n_state}
    written, values = [], []
    for nd in list(gm.graph.nodes):
        if (nd.op == "call_function" and nd.target is torch.ops.aten.copy_.default and nd.args[0] in position
                and not nd.users and not nd.kwargs):
            written.append(position[nd.args[0]])
            values.append(nd.args[1])
            gm.graph.erase_node(nd)
    if written:
        out = next(nd for nd in gm.graph.nodes if nd.op == "output")
        out.args = ([*out.args[0], *values],)
        gm.recompile()
    gm.meta["input_mutations"] = tuple(written)


def _inplace_views_as_views(gm: fx.GraphModule) -> None:
    """Each in-place view op (``torch.Tag.inplace_view``: ``as_strided_``, ``transpose_``, ...) on a tensor the
    graph computes, replaced by its view op, which the users of that tensor after it read instead (torch.export
    makes the same node of it); one on a placeholder (an input, a parameter) is left for the caller to refuse."""
    order = {nd: k for k, nd in enumerate(gm.graph.nodes)}
    changed = False
    for nd in list(gm.graph.nodes):
        view = _view_op_of(nd.target) if nd.op == "call_function" else None
        base = nd.args[0] if nd.args else None
        if view is None or not isinstance(base, fx.Node) or base.op == "placeholder":
            continue
        with gm.graph.inserting_before(nd):
            out = gm.graph.call_function(view, nd.args, nd.kwargs)
        out.meta = dict(nd.meta)
        nd.replace_all_uses_with(out)
        base.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out and order.get(user, -1) > order[nd])
        gm.graph.erase_node(nd)
        changed = True
    if changed:
        gm.recompile()


def _view_op_of(target: Any) -> Any:
    """The view op (same overload) of an in-place view op such as ``aten.as_strided_.default``, else None."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.inplace_view not in target.tags:
        return None
    name = target._schema.name.split("::")[-1]
    packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
    view = getattr(packet, target._overloadname, None)
    returns = view._schema.returns if isinstance(view, torch._ops.OpOverload) else ()
    if len(returns) == 1 and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
        return view
    return None


def _tidy(gm: fx.GraphModule) -> None:
    """Removes dead nodes and no-op aliases; lift_fresh_copy -> clone (what the core table makes of it)."""
    aten = torch.ops.aten
    for nd in list(gm.graph.nodes):
        if nd.op != "call_function":
            continue
        if nd.target is aten.lift_fresh_copy.default:
            nd.target = aten.clone.default
        elif nd.target is aten.alias.default and len(nd.args) == 1 and not nd.kwargs:
            nd.replace_all_uses_with(nd.args[0])
    gm.graph.eliminate_dead_code()


def _name_placeholders(model: torch.nn.Module, placeholders: list[fx.Node], state: _Tensors, args: tuple,
                       kwargs: dict, tensor_at: list[int]) -> None:
    """Names placeholders as torch.export does: p_/b_/c_ + the parameter's / buffer's / constant's path, user
    inputs after forward's parameters (and their pytree path)."""
    for p, kind, nm in zip(placeholders, state.kinds, state.names):
        p._rename(f"{kind}_{_clean(nm)}")
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    paths = [path for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]]
    for p, i in zip(placeholders[len(state.tensors):], tensor_at):
        path = paths[i]
        if path[0].idx == 0:  # a positional argument
            pos = path[1].idx
            head = positional[pos] if pos < len(positional) else f"args_{pos - len(positional)}"
        else:
            head = str(path[1].key)
        rest = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", "")))) for k in path[2:]]
        p._rename(_clean("_".join([head, *rest])))


def _clean(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name).lower() or "x"
