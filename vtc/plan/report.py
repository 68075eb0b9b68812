"""What vtc did to a graph, as numbers (``to_dict``) and as text (``str``).

Counts are per call of the compiled graph:

- ``movement_ops``: movement nodes in the captured graph;
- ``eliminated_movement_ops``: movement nodes whose output is never written to
  memory (read through a mapping, or handed out as a zero-copy strided view);
- ``materialized_movement_bytes``: bytes written by work whose only job is to
  move data (gathers that realise virtual tensors, movement ops kept physical,
  the copies of a pushed op's inputs that no kernel computes, e.g. the part of
  a KV cache given as a graph input that an out-of-place update keeps);
- ``kernels``: launches (compute/fallback nodes, kept movement ops, gathers);
- ``fallback_ops``: ops vtc does not know, and known ones whose definition failed on this call (a defect of
  vtc, ``Lowering.defects``), run by the framework;
- ``peak_memory_bytes``: peak of live intermediate buffers (inputs and
  parameters excluded), from the executor's liveness;
- ``gemm``: per GEMM node (mm/bmm/addmm/baddbmm) the choice between the
  generated kernel ("vtc") and torch's library on views ("torch"), why, and
  both estimated costs (``vtc.codegen.gemm.GemmChoice``; backend="cpu" only);
- ``packing``: set at the first call, when the weights are packed once (``vtc.runtime.packed``): MKL's
  (``packed_weights``) and the generated kernels' (``packed_conv_weights``) copies, their ``packed_bytes``,
  and how many weights were left unpacked because their copies would pass ``budget_bytes``
  (``unpacked_for_budget``; why per step in the call plan's ``why_not_packed``); the weights behind movement
  chains and the values computed from the model's tensors folded into constant copies (``folded_weight_chains``,
  ``folded_bytes``, and ``folded_nodes``: the nodes they replaced; ``vtc.ir.fold.fold_weight_chains``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vtc.ir.graph import Graph
from vtc.plan.cost import _bytes as _mb
from vtc.plan.virtualize import Plan, chain_of


@dataclass
class MovementEntry:
    """One movement node and its fate."""

    node: str
    op: str
    bytes: int
    fate: str  # "virtual" | "view" | "gather" | "kept" | "pushed" (inputs stored into its output, vtc.codegen.push)
    why: str = ""


@dataclass
class ChainEntry:
    """A virtual tensor that something reads, the movement nodes it composes and its mapping."""

    value: str
    nodes: list[str]
    ops: list[str]
    mapping: str
    realized_as: str  # "view" | "gather"
    strided: bool
    bytes: int


@dataclass
class Report:
    """What vtc removed and what it still moves."""

    plan: str
    movement_ops: int
    eliminated_movement_ops: int
    materialized_movement_bytes: int
    kernels: int
    fallback_ops: list[str]
    peak_memory_bytes: int
    movement: list[MovementEntry] = field(default_factory=list)
    chains: list[ChainEntry] = field(default_factory=list)
    gemm: list[dict] = field(default_factory=list)
    packing: dict = field(default_factory=dict)  # the executor's, filled in when its call plan is built

    def to_dict(self) -> dict:
        """The report as plain data (json-serialisable)."""
        return asdict(self)

    def summary(self) -> str:
        """A few lines: what was removed, what is still moved, fallbacks, peak memory."""
        views = sum(1 for c in self.chains if c.realized_as == "view")
        gathers = len(self.chains) - views
        lines = [
            f"plan={self.plan}: {self.eliminated_movement_ops}/{self.movement_ops} movement ops eliminated, "
            f"{_mb(self.materialized_movement_bytes)} of movement materialised per call",
            f"  {views} zero-copy strided views, {gathers} gathers, {self.kernels} kernel launches, "
            f"peak intermediate memory {_mb(self.peak_memory_bytes)}",
        ]
        if self.gemm:
            own = sum(1 for g in self.gemm if g["choice"] == "vtc")
            lines.append(f"  GEMMs: {own} generated, {len(self.gemm) - own} through torch")
        p = self.packing
        if p.get("packed_weights") or p.get("packed_conv_weights") or p.get("unpacked_for_budget"):
            lines.append(f"  weights packed once: {p['packed_weights'] + p['packed_conv_weights']} "
                         f"({_mb(p['packed_bytes'])}), {p['unpacked_for_budget']} left unpacked for the "
                         f"packed-weight budget of {_mb(p['budget_bytes'])}")
        if p.get("folded_weight_chains"):
            lines.append(f"  values computed from the model's tensors folded into constant copies: "
                         f"{p['folded_weight_chains']} ({_mb(p['folded_bytes'])}, within the packed-weight budget), "
                         f"{p['folded_nodes']} nodes removed")
        if self.fallback_ops:
            lines.append(f"  fallback ops (run by the framework): {', '.join(sorted(set(self.fallback_ops)))}")
        return "\n".join(lines)

    def __str__(self) -> str:
        out = [self.summary(), "", "movement ops:"]
        for e in self.movement:
            why = f"  ({e.why})" if e.why else ""
            out.append(f"  {e.node:<28} {e.op:<34} {_mb(e.bytes):>10}  {e.fate}{why}")
        out += ["", "composed chains (virtual tensors that something reads):"]
        for c in self.chains:
            kind = "strided view" if c.strided else "not a strided view"
            out.append(f"  {c.value}  <- {' -> '.join(c.ops)}  [{kind}; realised as {c.realized_as}, {_mb(c.bytes)}]")
            out.extend("      " + line for line in c.mapping.splitlines())
        if self.gemm:
            out += ["", "GEMMs (batch x M x N x K; estimated us: generated / torch):"]
            for g in self.gemm:
                b, m, n, k = g["shape"]
                out.append(f"  {g['node']:<20} {b}x{m}x{n}x{k}  {g['choice']:<5} {g['vtc_us']:.1f} / {g['torch_us']:.1f}"
                           f"  ({g['why']})" + (f"; stores into {', '.join(g['stores_into'])}"
                                                if g.get("stores_into") else ""))
        return "\n".join(out)



def build_report(graph: Graph, plan: Plan, executor) -> Report:
    """The report of `graph` run by `executor` under `plan`."""
    realized_as = {s.realization.value: s.kind for s in executor.steps if s.kind in ("view", "gather")}
    copies = [s for s in executor.steps if s.kind == "kernel" and s.kernel.step.kernel.kind == "copy"]
    realized_as.update({s.kernel.outputs[0].name: "gather" for s in copies})  # a copy kernel is a gather
    movement, eliminated = [], 0
    for n in graph.nodes:
        if n.kind != "movement":
            continue
        nbytes = sum(v.nbytes for v in n.outputs)
        if n.name in plan.kept:
            movement.append(MovementEntry(n.name, n.op, nbytes, "kept", plan.kept[n.name]))
            continue
        if n.name in plan.pushed:
            eliminated += 1
            movement.append(MovementEntry(n.name, n.op, nbytes, "pushed", _push_why(plan, n, executor)))
            continue
        kinds = {realized_as.get(v.name, "virtual") for v in n.outputs}
        fate = "gather" if "gather" in kinds else "view" if "view" in kinds else "virtual"
        eliminated += fate != "gather"
        movement.append(MovementEntry(n.name, n.op, nbytes, fate))
    values = {v.name: v for v in graph.values()}
    chains = []
    for name, kind in realized_as.items():
        r = plan.realized[name]
        nodes = chain_of(graph, plan, name)
        chains.append(ChainEntry(name, [n.name for n in nodes], [n.op.split(".")[1] if n.op.startswith("aten.") else n.op for n in nodes],
                                 str(r.mapping), kind, r.strided is not None, values[name].nbytes))
    runs = [s for s in executor.steps if s.kind == "run"]
    moved = sum(s.out_bytes for s in executor.steps if s.kind == "gather") + sum(s.out_bytes for s in copies)
    moved += sum(s.out_bytes for s in runs if s.node.kind == "movement")
    moved += sum(s.out_bytes for s in executor.steps if s.kind == "kernel" and s.kernel.step.kernel.kind == "move")
    moved += sum(_push_copy_bytes(s.kernel.step.kernel) for s in executor.steps if s.kind == "kernel")
    return Report(
        plan=plan.mode,
        movement_ops=len(movement),
        eliminated_movement_ops=eliminated,
        materialized_movement_bytes=moved,
        kernels=sum(1 for s in executor.steps if s.kind in ("run", "gather", "kernel")),
        fallback_ops=fallback_ops(graph, executor),
        peak_memory_bytes=executor.peak_bytes,
        movement=movement,
        chains=chains,
        gemm=[c.to_dict() for c in getattr(executor.lowering, "gemm_choices", {}).values()],
        packing=executor.packing,
    )


def fallback_ops(graph: Graph, executor) -> list[str]:
    """The ops of `graph` that `executor` runs through the framework: fallback nodes and known ops whose
    definition failed on this call (``Lowering.defects``)."""
    defects = getattr(executor.lowering, "defects", ())
    return [n.op for n in graph.nodes if n.kind == "fallback" or n.name in defects]


def _push_copy_bytes(k) -> int:
    """Bytes a copy kernel of a pushed op stores (kind "push": it computes nothing, it moves its input), or an
    attention kernel copies from an input cache into the updated cache while reading (vtc.codegen.decode_copy)."""
    if getattr(k, "copy_through", None):
        return sum(c.out.nbytes for c in k.copy_through)
    if k.kind != "push":
        return 0
    n = k.stores[0].buffer.nbytes // max(1, _numel(k.stores[0].buffer.shape))
    return n * _numel(k.domain)


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _push_why(plan: Plan, node, executor) -> str:
    """Why node was pushed, and which of its inputs are copied rather than stored by their producers."""
    low = getattr(executor, "lowering", None)
    copied = sorted(v for n, v in getattr(getattr(low, "push", None), "copies", ()) if n == node.name)
    tail = f"; copied into place: {', '.join('%' + v for v in copied)}" if copied else ""
    why = getattr(getattr(low, "push", None), "why_copied", {})  # a GEMM computes it but cannot store it there
    whys = [f"%{v}: {why[(node.name, v)]}" for v in copied if (node.name, v) in why]
    tail += f" (not stored by the GEMM computing it: {'; '.join(whys)})" if whys else ""
    by_gemm = getattr(getattr(low, "push", None), "by_gemm", {})  # vtc.codegen.gemm_push
    stored = sorted(f"%{v} by {g}'s GEMM kernel" for (n, v), g in by_gemm.items() if n == node.name)
    by_attention = getattr(getattr(low, "push", None), "by_attention", {})  # Pusher._attention_stores
    stored += sorted(f"%{v} by {a}'s attention kernel" for (n, v), a in by_attention.items() if n == node.name)
    tail += f"; stored: {', '.join(stored)}" if stored else ""
    through = getattr(getattr(low, "push", None), "copy_through", {}).get(node.name)  # vtc.codegen.decode_copy
    tail += f"; base copy: {through}" if through else ""
    return plan.pushed[node.name] + tail
