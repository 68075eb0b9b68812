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

The planner issue replaces ``plan_all`` by a cost-driven choice; this module's
``Plan`` is what the executor and the report consume.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vtc.index.mapping import Mapping, Strided, compose
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
    needs: dict[str, list[str]] = field(default_factory=dict)  # node name -> virtual inputs to realise first

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
    plan = Plan("all")
    for n in graph.nodes:
        if n.kind == "movement":
            reason = _virtualize(plan, n)
            if reason:
                plan.kept[n.name] = reason
        _note_needs(plan, n, data_only=n.kind == "movement" and n.name not in plan.kept)
    for v in graph.outputs:
        _realize(plan, v.name)
    return plan


def _virtualize(plan: Plan, node: Node) -> str | None:
    """Composes node's pull with its inputs' mappings; returns why it cannot, or None."""
    if not movement.has_pull(node.target):
        return f"no pull mapping for {node.op}"
    try:
        maps = movement.pull(node.target, node.args, node.kwargs, [o.shape for o in node.outputs])
    except (NotImplementedError, ValueError, IndexError, TypeError) as e:
        return f"pull mapping failed: {type(e).__name__}: {e}"
    for out, m in zip(node.outputs, maps):
        inner = {s: plan.mappings[s] for s in m.sources if s in plan.mappings}
        plan.mappings[out.name] = compose(m, inner) if inner else m
    return None


def _note_needs(plan: Plan, node: Node, data_only: bool) -> None:
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
        _realize(plan, name)
    if need:
        plan.needs[node.name] = need


def _index_of(plan: Plan, node: Node, v: Value) -> bool:
    return any(v.name in plan.mappings[o.name].index_tensors for o in node.outputs)


def _realize(plan: Plan, name: str) -> None:
    if name in plan.mappings and name not in plan.realized:
        m = plan.mappings[name]
        plan.realized[name] = Realization(name, m, m.strided())


def chain_of(graph: Graph, plan: Plan, value: str) -> list[Node]:
    """The movement nodes whose composition gives virtual `value`, in graph order."""
    producers = {o.name: n for n in graph.nodes for o in n.outputs}
    out: dict[str, Node] = {}
    stack = [value]
    while stack:
        name = stack.pop()
        n = producers.get(name)
        if n is None or n.kind != "movement" or n.name in plan.kept or n.name in out:
            continue
        out[n.name] = n
        stack.extend(v.name for v in n.inputs)
    order = {n.name: k for k, n in enumerate(graph.nodes)}
    return sorted(out.values(), key=lambda n: order[n.name])

