"""The virtual tensor opportunity graph (VTOG): which tensor could be virtual over which.

Nodes are the graph's values (tensors).  An edge ``a -> b`` says "a can be made
a virtual tensor of b by removing one movement op":

- **pull** edges: for a movement op with a pull mapping, one edge from each
  output to each data input its mapping reads (``out -> in``): the op's
  readers read ``in`` through the mapping;
- **push** edges: for a movement op with a push mapping
  (``vtc.virtual.movement.push``), one edge from each data input to each output
  it lands in (``in -> out``): the producer of ``in`` writes straight into
  ``out`` (a movement producer pushes further: split -> reshape -> index_copy
  lets a GEMM write into a KV cache).  Graph inputs and constants have no
  producer that could write elsewhere.

A node is **pinned** physical when it must exist in memory for its readers:
graph inputs and constants, graph outputs, index tensors of gathers and
scatters, operands of library nodes (GEMM, conv, fallbacks) whose composed
mapping (every movement op in front virtual) is not a strided view.  A pinned
node gets no push edges (nothing may write it elsewhere); its pull edges stay:
taking one removes the movement op and materialises the value once through its
composed mapping (a zero-copy view or one copy kernel) instead of running the op.

Edges are grouped into **choices**, the units a planner takes or leaves: all
pull edges of one op (the executor keeps or removes an op as a whole, so the
outputs of a split go together), or all push edges of one op (the op only
disappears when every input writes through).  Edges within a choice are
compatible (a cat's output over each input for a disjoint range of indices).
Per node, ``conflicts`` lists pairs of edges that cannot coexist:

- a tensor cannot be virtual over two different tensors (a pull out of it and a
  push out of it, or pushes into two different ops);
- the push and the pull of the same op exclude each other;
- two pushes into one target conflict when their index ranges may overlap.

A conflict-free set of choices is a *strategy*.  ``str(vtog)`` prints it all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.utils._pytree as pytree

from vtc.index.mapping import Mapping
from vtc.ir.graph import Graph, Node, Value
from vtc.ir.ops import compute_category
from vtc.plan.virtualize import plan_all, pull_of
from vtc.virtual import movement

PULL, PUSH = "pull", "push"


@dataclass(frozen=True, eq=False)
class Edge:
    """`src` can be virtual over `dst` by removing movement node `op` (in `direction`)."""

    src: str
    dst: str
    op: str
    direction: str  # "pull" | "push"
    mapping: Mapping  # pull: src index -> op's input; push: src index -> op's output (named out0, out1, ...)
    key: str = ""  # dst's name among mapping.sources ("out0", ... for a push; dst for a pull)

    def __str__(self) -> str:
        return f"%{self.src} -> %{self.dst} ({self.direction} via {self.op})"


@dataclass(frozen=True)
class Conflict:
    """Two edges that cannot both be taken, and why."""

    a: Edge
    b: Edge
    reason: str

    def __str__(self) -> str:
        return f"{self.a}  x  {self.b}: {self.reason}"


@dataclass(eq=False)
class Choice:
    """The edges a planner takes together: all pulls or all pushes of one movement op."""

    op: str
    direction: str
    edges: list[Edge]
    invalid: str | None = None  # why this choice can never be taken (it conflicts with itself)

    @property
    def name(self) -> str:
        return f"{self.direction} {self.op}"

    @property
    def values(self) -> list[str]:
        """The tensors made virtual by this choice (sources of its edges), in order."""
        return list(dict.fromkeys(e.src for e in self.edges))

    def __str__(self) -> str:
        return self.name


@dataclass(eq=False)
class VNode:
    """One tensor of the VTOG: its out-edges, whether it is pinned physical, its conflicts."""

    value: Value
    pinned: str | None = None  # why it must exist in memory
    edges: list[Edge] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # edges that do not exist, and why


class VTOG:
    """The opportunity graph of `graph` (see the module docstring).

    `kinds` (node name -> "kernel" | "library" | "movement") says which compute
    nodes run as generated kernels (they read virtual tensors through mappings)
    and which through a library (they need a buffer); default: ``node_kinds``
    for the CPU backend.
    """

    def __init__(self, graph: Graph, kinds: dict[str, str] | None = None, backend: str = "cpu",
                 gemm: str = "auto") -> None:
        self.graph, self.backend = graph, backend  # the backend `kinds` are for (cpu: generated kernels)
        self.gemm = gemm  # the compile option `kinds` are for (under "auto" the lowering picks each GEMM's side)
        self.kinds = kinds if kinds is not None else node_kinds(graph, "cpu")
        self.producer: dict[str, Node] = {o.name: n for n in graph.nodes for o in n.outputs}
        self.users = graph.users()
        self.nodes: dict[str, VNode] = {v.name: VNode(v) for v in graph.values()}
        self.no_edges: dict[str, str] = {}  # movement node name -> why it has no pull edges
        self.pulls: dict[str, tuple[Mapping, ...]] = {}  # movement node name -> pull mapping per output
        self.choices: list[Choice] = []
        self._pairs: dict[tuple[int, int], str] = {}  # (id(edge), id(edge)) -> why they conflict
        self._pin()
        self._edges()
        self._conflicts()

    # -- construction ---------------------------------------------------------
    def _pin(self) -> None:
        g = self.graph
        for v in g.inputs:
            self.nodes[v.name].pinned = "graph input"
        for v in g.consts:
            self.nodes[v.name].pinned = "constant"
        for v in g.outputs:
            self.nodes[v.name].pinned = self.nodes[v.name].pinned or "graph output"
        for n in g.nodes:
            if n.kind != "movement":
                continue
            maps = pull_of(n)
            if isinstance(maps, str):
                self.no_edges[n.name] = maps
                continue
            self.pulls[n.name] = maps
            for m in maps:
                for t in m.index_tensors:
                    if t in self.nodes:
                        self.nodes[t].pinned = self.nodes[t].pinned or f"index tensor of {n.name} ({n.op})"
        every = plan_all(g).mappings  # composed mappings with every movement op in front virtual
        for n in g.nodes:
            if self.kinds.get(n.name) != "library":
                continue
            for v in n.inputs:
                m = every.get(v.name)
                if m is not None and m.strided() is None and not self.nodes[v.name].pinned:
                    self.nodes[v.name].pinned = (f"operand of {n.name} ({n.op}): its composed mapping is not a "
                                                 f"strided view")

    def _edges(self) -> None:
        for n in self.graph.nodes:
            if n.kind != "movement":
                continue
            pulls = []
            for out, m in zip(n.outputs, self.pulls.get(n.name, ())):
                for s in m.used_sources():
                    e = Edge(out.name, s, n.name, PULL, m, s)
                    self.nodes[out.name].edges.append(e)
                    pulls.append(e)
            if pulls:
                self.choices.append(Choice(n.name, PULL, pulls))
            pushes = self._push_edges(n)
            if pushes:
                self.choices.append(Choice(n.name, PUSH, pushes))

    def _push_edges(self, n: Node) -> list[Edge]:
        try:
            maps = movement.push(n.target, n.args, n.kwargs, [o.shape for o in n.outputs])
        except (NotImplementedError, ValueError, IndexError, TypeError, KeyError) as e:
            self.nodes[n.outputs[0].name].notes.append(f"no push via {n.name}: {type(e).__name__}: {e}")
            return []
        reads = [v.name for v in _data_inputs(n)]
        out = []
        for src, m in maps.items():
            node = self.nodes.get(src)
            if node is None:
                continue
            why = None
            if node.pinned:
                why = f"it is pinned ({node.pinned})"
            elif self.producer.get(src) is None:
                why = "nothing in the graph produces it"
            elif reads.count(src) > 1:
                why = f"{n.name} reads it {reads.count(src)} times (one element, several places)"
            if why:
                node.notes.append(f"no push via {n.name}: {why}")
                continue
            for k, o in enumerate(n.outputs):
                if f"out{k}" in m.sources:
                    e = Edge(src, o.name, n.name, PUSH, m, f"out{k}")
                    node.edges.append(e)
                    out.append(e)
        return out

    def _conflicts(self) -> None:
        by_op: dict[tuple[str, str], list[Edge]] = {}
        for c in self.choices:
            by_op[(c.op, c.direction)] = c.edges
        # a tensor cannot be virtual over two tensors (edges of one choice are compatible); a pull out of it
        # and a push of it into another op can coexist: the push's writer reads it through the pull
        for node in self.nodes.values():
            es = node.edges
            for i, a in enumerate(es):
                for b in es[i + 1:]:
                    if a.direction != b.direction and a.op != b.op:
                        continue
                    if (a.op, a.direction) != (b.op, b.direction):
                        self._add(node, a, b, f"%{node.value.name} cannot be virtual over both %{a.dst} and %{b.dst}")
        # the push and the pull of one op exclude each other
        for c in self.choices:
            if c.direction != PUSH:
                continue
            for a in by_op.get((c.op, PULL), []):
                for b in c.edges:
                    self._add(self.nodes[a.src], a, b, f"push and pull of {c.op} exclude each other")
        # pushes into one target whose index ranges may overlap
        for c in self.choices:
            if c.direction != PUSH:
                continue
            for i, a in enumerate(c.edges):
                for b in c.edges[i + 1:]:
                    if a.src != b.src and a.dst == b.dst and _may_overlap(a, b):
                        why = f"%{a.src} and %{b.src} may write the same elements of %{a.dst}"
                        self._add(self.nodes[a.dst], a, b, why)
                        c.invalid = c.invalid or why

    def _add(self, node: VNode, a: Edge, b: Edge, reason: str) -> None:
        node.conflicts.append(Conflict(a, b, reason))
        self._pairs[(id(a), id(b))] = self._pairs[(id(b), id(a))] = reason

    # -- queries --------------------------------------------------------------
    @property
    def edges(self) -> list[Edge]:
        return [e for node in self.nodes.values() for e in node.edges]

    @property
    def conflicts(self) -> list[Conflict]:
        return [c for node in self.nodes.values() for c in node.conflicts]

    def conflict(self, a: Choice, b: Choice) -> str | None:
        """Why choices a and b cannot both be taken, or None when they are compatible."""
        if a is b:
            return None
        for x in a.edges:
            for y in b.edges:
                why = self._pairs.get((id(x), id(y)))
                if why:
                    return why
        return None

    def choice(self, op: str, direction: str = PULL) -> Choice | None:
        """The choice of movement node `op` in `direction`, if it has one."""
        return next((c for c in self.choices if c.op == op and c.direction == direction), None)

    def is_strategy(self, choices: list[Choice]) -> bool:
        """True when no two of `choices` conflict and none conflicts with itself."""
        if any(c.invalid for c in choices):
            return False
        return all(self.conflict(a, b) is None for i, a in enumerate(choices) for b in choices[i + 1:])

    def __str__(self) -> str:
        n_pull = sum(e.direction == PULL for e in self.edges)
        n_push = len(self.edges) - n_pull
        lines = [f"VTOG: {len(self.nodes)} tensors, {n_pull} pull edges, {n_push} push edges, "
                 f"{len(self.conflicts)} conflicts, {len(self.choices)} choices"]
        for node in self.nodes.values():
            if not node.edges and not (node.pinned and node.value.kind == "node"):
                continue
            v = node.value
            pin = f"  pinned: {node.pinned}" if node.pinned else ""
            lines.append(f"  %{v.name} {list(v.shape)} {str(v.dtype).replace('torch.', '')}{pin}")
            for e in node.edges:
                lines.append(f"    -> %{e.dst}  {e.direction} via {e.op}")
            for note in node.notes:
                lines.append(f"    ({note})")
        for op, why in self.no_edges.items():
            lines.append(f"  {op}: no edges ({why})")
        if self.conflicts:
            lines.append("conflicts:")
            lines.extend(f"  {c}" for c in self.conflicts)
        bad = [c for c in self.choices if c.invalid]
        if bad:
            lines.append("choices that conflict with themselves:")
            lines.extend(f"  {c}: {c.invalid}" for c in bad)
        return "\n".join(lines)


def _data_inputs(n: Node) -> list[Value]:
    """n's tensor operands in argument order, repeats kept (cat([a, a]) reads a twice)."""
    return [x for x in pytree.tree_leaves((n.args, n.kwargs)) if isinstance(x, Value)]


def _may_overlap(a: Edge, b: Edge) -> bool:
    """Whether two pushes into the same target may write a common element (interval boxes).

    A target index that loads from an index tensor spans its declared range, so
    data-dependent pushes (index_copy, scatter) always may overlap each other.
    """
    for ia in _target_boxes(a):
        for ib in _target_boxes(b):
            if all(x[0] <= y[1] and y[0] <= x[1] for x, y in zip(ia, ib)):
                return True
    return False


def _target_boxes(e: Edge) -> list[list[tuple[float, float]]]:
    """For each piece of e's push mapping that lands in e.dst, the interval box of its target indices."""
    return [[(i.lo, i.hi) for i in p.index] for p in e.mapping.pieces if p.source == e.key]


def node_kinds(graph: Graph, backend: str = "cpu", gemm: str = "auto") -> dict[str, str]:
    """Per node: "movement", "kernel" (a generated kernel reads its operands through mappings) or "library".

    backend="cpu" asks the code generator which compute nodes it generates
    when every movement op is virtual: pointwise and row ops it supports, the
    matmuls and convolutions it packs through their mappings (under the
    compile option `gemm`, vtc.codegen.gemm.choose: those whose operands torch
    would have to copy) and the nodes of a fused attention kernel;
    backend="torch" runs every compute node through torch.
    """
    out = {n.name: "movement" for n in graph.nodes if n.kind == "movement"}
    if backend != "cpu":
        out.update({n.name: "library" for n in graph.nodes if n.kind != "movement"})
        return out
    from vtc.codegen.lower import Lowering

    low = Lowering(graph, plan_all(graph), gemm)
    for n in graph.nodes:
        if n.kind != "movement":
            out[n.name] = "kernel" if low.kind[n.name] in ("pointwise", "row", "gemm", "attention") else "library"
    return out


def category(node: Node) -> str:
    """The compute category of a node ("matmul", "conv", ...; "fallback"; "movement")."""
    if node.kind == "movement":
        return "movement"
    return compute_category(node.target) or "fallback"
