"""Which tensors are virtual, and through which composed mapping.

``plan_all(graph)`` makes every movement op's output virtual that can be: its
pull mapping is composed with the mappings of its (virtual) inputs, so each
virtual tensor is described by one ``Mapping`` over physical tensors only.
``plan_none(graph)`` keeps everything physical (the ablation baseline).

A virtual tensor becomes physical only where something needs memory: a compute
or fallback node reads it, it is a graph output, or it is the index tensor of
another movement op.  How it is made physical is decided here too:

- ``view``: the composed mapping is a plain strided view of one contiguous
  source, so it is handed out as a zero-copy ``as_strided`` view;
- ``gather``: anything else is realised by one gather from its sources.

``plan_keeping(graph, mode, keep)`` is the mechanism under every planner: every
movement op virtual except the ones in ``keep`` (node name -> why), which run
physically.  ``plan_all`` keeps nothing; the cost-driven planner
(``vtc.plan.greedy``) decides ``keep`` and logs its ``decisions`` here.  This
module's ``Plan`` is what the executor and the report consume.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vtc.index.expr import loads
from vtc.index.mapping import Mapping, Strided, compose, contiguous_strides
from vtc.ir.graph import Graph, Node, Value
from vtc.virtual import movement


@dataclass
class Realization:
    """How a virtual value is made physical: a zero-copy strided view or one gather."""

    value: str
    mapping: Mapping
    strided: Strided | None

    @property
    def kind(self) -> str:
        return "view" if self.strided is not None else "gather"


@dataclass
class Plan:
    """The fate of every movement op and how each needed virtual value is realised."""

    mode: str
    mappings: dict[str, Mapping] = field(default_factory=dict)  # virtual value -> mapping over physical ones
    realized: dict[str, Realization] = field(default_factory=dict)  # virtual values that something reads
    kept: dict[str, str] = field(default_factory=dict)  # movement node name -> why it stays physical
    pushed: dict[str, str] = field(default_factory=dict)  # movement node -> why its inputs are stored into its
    #                                                       output (a physical buffer; vtc.codegen.push)
    needs: dict[str, list[str]] = field(default_factory=dict)  # node name -> virtual inputs to realise first
    decisions: list = field(default_factory=list)  # a planner's log (vtc.plan.greedy.Decision), in decision order
    objective: str = "latency"  # what the planner minimised: "latency" or "memory" (peak within a slowdown)
    notes: list[str] = field(default_factory=list)  # the planner's one-line summaries (memory search, measurements)

    def is_virtual(self, value: str) -> bool:
        return value in self.mappings


def plan_none(graph: Graph) -> Plan:
    """Every movement op runs and materialises its output."""
    plan = Plan("none")
    for n in graph.nodes:
        if n.kind == "movement":
            plan.kept[n.name] = "plan='none' keeps every movement op physical"
    return plan


def plan_all(graph: Graph) -> Plan:
    """Every movement op with a pull mapping becomes virtual over physical tensors."""
    return plan_keeping(graph, "all", {})


def plan_keeping(graph: Graph, mode: str, keep: dict[str, str], push: dict[str, str] | None = None,
                 memo: dict | None = None) -> Plan:
    """Every movement op virtual (composed over its virtual inputs) except those named in `keep` or `push`.

    `keep` maps a movement node's name to why it stays physical; such a node
    runs through the framework on physical (or realised) inputs.  `push` maps
    a movement node to why it is removed on the write side: its output is a
    physical buffer that its inputs are stored into (``vtc.codegen.push``;
    generated kernels only), its index tensors must be physical.

    `memo` (a dict the caller keeps between calls on graphs of the same nodes, e.g. one symbolic graph at
    several sizes) reuses a node's composed mappings when its op, arguments, input and output shapes are
    the same as last time and the mappings it composes with are the very same objects (so are the results:
    pull and compose are functions of these), and a mapping's strided form.
    """
    plan = Plan(mode)
    strided = None if memo is None else (memo.get("strided", {}), {})  # (last call's, this call's)
    for n in graph.nodes:
        if n.kind == "movement" and push and n.name in push:
            plan.pushed[n.name] = push[n.name]
            _note_push_needs(plan, n)
            continue
        if n.kind == "movement":
            reason = keep.get(n.name) or _virtualize(plan, n, memo)
            if reason:
                plan.kept[n.name] = reason
        _note_needs(plan, n, data_only=n.kind == "movement" and n.name not in plan.kept, strided=strided)
    for v in graph.outputs:
        _realize(plan, v.name, strided=strided)
    if memo is not None:
        memo["strided"] = strided[1]
    return plan


_KEYED_AS_IS = frozenset({bool, int, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout})


def _arg_key(a):
    """A hashable form of a node argument, a Value as its name, shape and dtype."""
    t = type(a)  # the common exact types first (~2,400 calls per new length of a decode step); the same keys
    if t is Value:
        return ("%", a.name, tuple(a.shape), a.dtype)
    if t is tuple or t is list:
        return (t.__name__, *map(_arg_key, a))
    if t in _KEYED_AS_IS:
        return (t.__name__, a)
    if isinstance(a, Value):
        return ("%", a.name, tuple(a.shape), a.dtype)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, *map(_arg_key, a))
    if isinstance(a, dict):
        return ("{", *((k, _arg_key(v)) for k, v in a.items()))
    if isinstance(a, float):
        return ("float", repr(a))  # -0.0 is not 0.0 (a pad value), nan is nan
    if a is None or isinstance(a, (bool, int, str, torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return (type(a).__name__, a)
    raise _NoKey  # anything else (a tensor): not compared, the node is composed again


class _NoKey(Exception):
    pass


def pull_of(node: Node) -> tuple[Mapping, ...] | str:
    """The pull mapping of each output of movement node `node`, or why there is none."""
    if not movement.has_pull(node.target):
        return f"no pull mapping for {node.op}"
    try:
        return movement.pull(node.target, node.args, node.kwargs, [o.shape for o in node.outputs])
    except (NotImplementedError, ValueError, IndexError, TypeError) as e:
        return f"pull mapping failed: {type(e).__name__}: {e}"


def _virtualize(plan: Plan, node: Node, memo: dict | None = None) -> str | None:
    """Composes node's pull with its inputs' mappings; returns why it cannot, or None (`memo`: plan_keeping)."""
    key = None
    if memo is not None:
        try:
            key = (node.target, _arg_key(node.args), _arg_key(node.kwargs),
                   tuple(tuple(o.shape) for o in node.outputs))
        except _NoKey:
            key = None
        hit = memo.get(("node", node.name)) if key is not None else None
        if hit is not None and hit[0] == key and all(plan.mappings.get(s) is m for s, m in hit[1]):
            if isinstance(hit[2], str):
                return hit[2]
            plan.mappings.update(hit[2])
            return None
    maps = pull_of(node)
    if isinstance(maps, str):
        if key is not None:
            memo[("node", node.name)] = (key, (), maps)
        return maps
    used, made = [], []
    for out, m in zip(node.outputs, maps):
        inner = {s: plan.mappings[s] for s in m.sources if s in plan.mappings}
        used += [(s, plan.mappings.get(s)) for s in m.sources]
        made.append((out.name, compose(m, inner) if inner else m))
    why = next((f"the range check of %{t} would not run: no element read loads it" for _, m in made
                for t in _unloaded_checks(m)), None)
    if key is not None:
        memo[("node", node.name)] = (key, tuple(used), why or dict(made))
    if why:
        return why
    plan.mappings.update(made)
    return None


def _unloaded_checks(m: Mapping) -> list[str]:
    """The index tensors m range-checks when no element read loads any index tensor (a gather from a 0-d tensor:
    out[i] = self[]).  A kernel runs the checks of the mappings whose index tensors it loads (a scatter's checks
    ride on the inverse it loads), so a virtual m would skip these; kept, the op's copy kernel runs them."""
    if any(loads(e) for p in m.pieces for e in (*p.index, p.when)):
        return []
    return [c.tensor for c in m.checks]


def _note_needs(plan: Plan, node: Node, data_only: bool, strided: tuple | None = None) -> None:
    """Records which virtual inputs of node must be realised before it runs."""
    if data_only:  # a virtual movement op reads its data inputs through mappings; index tensors must be physical
        m_sources = set()
        for out in node.outputs:
            m_sources |= set(plan.mappings[out.name].index_tensors)
        names = [v.name for v in node.inputs if v.name in m_sources or _index_of(plan, node, v)]
    else:
        names = [v.name for v in node.inputs]
    need = [name for name in names if plan.is_virtual(name)]
    for name in need:
        _realize(plan, name, dense=not data_only and needs_dense(node), strided=strided)
    if need:
        plan.needs[node.name] = need


def _note_push_needs(plan: Plan, node: Node) -> None:
    """A pushed node reads its data inputs through their mappings; its index tensors must be realised."""
    from vtc.codegen.push import push_index_tensors

    need = [t for t in push_index_tensors(node) if plan.is_virtual(t)]
    for name in need:
        _realize(plan, name)
    if need:
        plan.needs[node.name] = need


def _index_of(plan: Plan, node: Node, v: Value) -> bool:
    return any(v.name in plan.mappings[o.name].index_tensors for o in node.outputs)


def _realize(plan: Plan, name: str, dense: bool = False, strided: tuple | None = None) -> None:
    """Records how virtual `name` is made physical; `dense`: a reader needs it row-major (else a gather)."""
    if name not in plan.mappings:
        return
    r = plan.realized.get(name)
    m = plan.mappings[name] if r is None else r.mapping
    if r is not None:
        st = r.strided
    elif strided is None:
        st = m.strided()
    else:  # per mapping object (held there, so that its id is not reused): its strided form, last call's or now
        before, now = strided
        hit = now.get(id(m)) or before.get(id(m))
        st = hit[1] if hit is not None and hit[0] is m else m.strided()
        now[id(m)] = (m, st)
    if dense and st is not None and not is_dense(st, m.shape):
        st = None
    if r is None or st is not r.strided:
        plan.realized[name] = Realization(name, m, st)


VIEW_ONLY = frozenset({"view", "_unsafe_view", "view_as"})  # framework ops that reject most strided inputs


def needs_dense(node: Node) -> bool:
    """True when movement node `node`, run by the framework, needs a row-major input (aten.view does)."""
    from vtc.virtual.ops import base_name, packet_name

    name = packet_name(node.target)
    return node.kind == "movement" and name is not None and base_name(name) in VIEW_ONLY


def is_dense(st: Strided, shape: tuple[int, ...]) -> bool:
    """True when strided view `st` of `shape` is row-major (any offset; size-1 dims ignored)."""
    want = contiguous_strides(shape)
    return all(s == w for s, w, n in zip(st.strides, want, shape) if n > 1)


def chain_of(graph: Graph, plan: Plan, value: str) -> list[Node]:
    """The movement nodes whose composition gives virtual `value`, in graph order."""
    producers = {o.name: n for n in graph.nodes for o in n.outputs}
    out: dict[str, Node] = {}
    stack = [value]
    while stack:
        name = stack.pop()
        n = producers.get(name)
        if n is None or n.kind != "movement" or n.name in plan.kept or n.name in plan.pushed or n.name in out:
            continue
        out[n.name] = n
        stack.extend(v.name for v in n.inputs)
    order = {n.name: k for k, n in enumerate(graph.nodes)}
    return sorted(out.values(), key=lambda n: order[n.name])

