"""Store-side virtual tensors ("push"): producers write straight into a movement op's output.

On the read side (the pull form) a concatenation or scatter stays virtual and
its readers read through its pull mapping: a choice between sources per
element.  That is free when a kernel reads it, but where its output must exist
in memory (a graph output such as an updated KV cache, an operand of a library
GEMM) a copy kernel realises it, and every reader pays the choice.  The write
side removes the op instead: its output ``y`` is an ordinary physical buffer
and each data input ``x`` is stored at its place in ``y`` through the op's
push mapping (``x`` index -> ``y`` index, ``vtc.virtual.movement.push``).

Ops (``PUSH_OPS``): cat and stack, and the scatters slice_scatter,
select_scatter, index_copy, index_put and scatter.  Who writes each input:

- **direct**: ``x``'s producer is a generated pointwise or row kernel; only
  its store stage changes: it stores through the push mapping into ``y``
  (the compute stage is the same).  When something else reads ``x`` too, the
  kernel stores ``x`` as well.  A generated GEMM or convolution stores ``x``
  too when ``x`` is its result (or its epilogue's) or a virtual tensor over
  its result by views, splits, slices and permutes (a fused QKV projection
  writing V into the KV cache; ``vtc.codegen.gemm_push``, in ``finish``).
- **copy**: anything else (a graph input, a library result, a virtual tensor
  read through its own mapping, a value that loads nothing): one kernel of
  kind ``"push"`` at the op's place reads ``x`` (inlining its single-use
  pointwise producers) and stores it through the push mapping.

A scatter also has a *base* (``self``): ``y`` is the base except where an
update lands, so the base is written first, then the updates overwrite their
elements.  A base that is a graph input (the KV cache of a decode layer) is
copied once into the fresh ``y``: torch's out-of-place index_copy/index_put
must not change its input, so ``y`` cannot be the input's storage.  That copy
is a plain vectorised copy (the pull form copies the same bytes, but through a
per-element choice, and every reader of the cache reads through it too); the
new token is then stored by the kernel that computes it (RoPE's add), and
attention reads ``y`` without a choice.  A base that a kernel computes is
stored by that kernel (identity mapping), nothing copied.

The first writer of ``y`` in step order allocates it; the others are given it
(``y`` is among their kernel's inputs and stored: they write in place, see
``vtc.runtime.executor.CompiledKernel``).  Index tensors of a push mapping
(index_copy's positions) are range-checked before the writer runs: an
out-of-range index raises IndexError naming the op and the value.

``push_writes(node)`` says whether an op can be pushed (and why not);
``Pusher`` is the lowering's part; ``all_pushes`` is ``plan="all"``'s rule:
push where the pull form would copy the op's output into memory anyway.
"""
from __future__ import annotations

from dataclasses import dataclass

from vtc.codegen import decode_copy, gemm_push
from vtc.codegen import kernel_ir as K
from vtc.codegen.gemm import GEMM_OPS, _operands
from vtc.codegen.kernel_ir import Buffer, Kernel, Store
from vtc.codegen.ops import C_TYPES
from vtc.index.expr import subs
from vtc.index.mapping import Mapping, Piece, Strided, contiguous_strides, identity, out_vars
from vtc.ir.graph import Graph, Node, Value
from vtc.plan.virtualize import Realization
from vtc.virtual import movement
from vtc.virtual.ops import base_name, packet_name

PUSH_OPS = frozenset({"cat", "stack", "slice_scatter", "select_scatter", "index_copy", "index_put", "scatter"})
# identity copies (a transpose's ``reshape`` decomposes to clone + view): pushed only where an attention kernel
# computes their input, through a chain of views and permutes (it stores its rows in the copy's layout; see
# ``attention_computes``); any other producer keeps its own store and the copy
COPY_OPS = frozenset({"clone", "contiguous"})
# a head merge (COPY_OPS) that a generated GEMM would pack through its mapping is pushed too, the attention kernel
# storing the merged layout (``merged_heads_reader``; False: the code before session 17, for A/B runs)
MERGE_HEADS = True
MERGED = "pushed: the attention kernel stores the merged heads"  # worth_pushing's reason for those
_UPDATE_ARG = {"slice_scatter": "src", "select_scatter": "src", "index_copy": "source", "index_put": "values",
               "scatter": "src"}  # the scatters' update operand; their base is `self`
READER = "push:"  # reader-name prefix: the write of one input of a pushed op (push:<node>:<input>)


@dataclass(frozen=True)
class Write:
    """Input `value` of a pushed op stored into its output through `mapping` (value index -> out0 index)."""

    value: str
    mapping: Mapping
    base: bool = False  # a scatter's self: written before the updates


def push_writes(node: Node) -> list[Write] | str:
    """The writes that replace movement node `node` (base first), or why it cannot be pushed."""
    name = base_name(packet_name(node.target) or "")
    if name not in PUSH_OPS | COPY_OPS:
        return f"no store-side lowering for {node.op}"
    if len(node.outputs) != 1:
        return f"{node.op} has {len(node.outputs)} outputs"
    out = node.outputs[0]
    if out.numel == 0:
        return "its output has no elements"
    args = movement.bind(node.target, node.args, node.kwargs)
    if name in ("cat", "stack"):
        data = [t for t in args["tensors"] if not (name == "cat" and len(t.shape) == 1 and t.shape[0] == 0)]
        base = None
    elif name in COPY_OPS:
        data, base = [args["self"]], None
    else:
        base, data = args["self"], [args.get(_UPDATE_ARG[name])]
        if not isinstance(data[0], Value):
            return f"{node.op} writes a constant, not a tensor"
    every = [base, *data] if base is not None else data
    names = [v.name for v in every]
    if len(set(names)) != len(names):
        return f"{node.op} reads one tensor twice (one element, several places)"
    bad = [v for v in [*every, out] if v.dtype not in C_TYPES]
    if bad:
        return f"dtype {bad[0].dtype} of %{bad[0].name} has no generated code"
    try:
        maps = movement.push(node.target, node.args, node.kwargs, [out.shape])
    except (NotImplementedError, ValueError, IndexError, TypeError, KeyError) as e:
        return f"push mapping failed: {type(e).__name__}: {e}"
    writes = []
    if base is not None:
        if tuple(base.shape) != tuple(out.shape):
            return f"base %{base.name} of shape {base.shape} is broadcast to {out.shape}"
        writes.append(Write(base.name, Mapping(base.shape, (Piece("out0", out_vars(base.shape)),),
                                               {"out0": out.shape}), base=True))
    for v in data:
        m = maps.get(v.name)
        if m is None:
            return f"{node.op} has no push mapping for %{v.name}"
        if len(m.pieces) != 1 or m.pieces[0].source != "out0":
            return f"the push mapping of %{v.name} is not one store per element"
        if set(m.index_tensors) & set(names):
            return f"{node.op} indexes with one of its data inputs"
        writes.append(Write(v.name, m))
    return writes


def push_index_tensors(node: Node) -> list[str]:
    """The index tensors the writes of pushed `node` load (index_copy's positions)."""
    writes = push_writes(node)
    if isinstance(writes, str):
        return []
    return list(dict.fromkeys(t for w in writes for t in w.mapping.index_tensors))


def worth_pushing(graph: Graph, plan, gemm: str = "auto", merge: bool = False) -> dict[str, str]:
    """Ops of `plan` whose pull form the generated code copies into memory, and that a push removes.

    Every op the plan keeps physical is one (its output is a copy).
    A value R that the lowering realises by a copy kernel (a graph output, a library operand) whose
    chain holds a pushable op O is a candidate when pushing O leaves nothing to copy: R is O's output,
    or R's mapping over O's output is a strided view (cat -> view -> output).  Pushing O where R stays
    a copy (a cat in front of a channel shuffle) would only move the producers out of that copy kernel.
    With `merge` (the greedy's ``take_pushes``; not plan="all", whose pulls stay pulls), also a head merge
    that a generated GEMM would pack through its mapping (``merged_heads_reader``).
    """
    from vtc.codegen.lower import Lowering
    from vtc.plan.virtualize import chain_of, plan_keeping

    low = Lowering(graph, plan, gemm)

    def gains(n: Node) -> bool:
        """A kernel computes one of its inputs (stored in place), or a kernel reads its output (then plainly).
        Else every input would be copied into place: the same bytes as the pull form's copy, more launches,
        and a GEMM in front of which gemm="auto" may read through the cat would lose that choice."""
        writes = push_writes(n)
        if isinstance(writes, str):
            return False
        if base_name(packet_name(n.target) or "") in COPY_OPS:
            return attention_computes(low, writes[0].value)
        made = any(w.value in low.producer and low.kind.get(low.producer[w.value].name) in ("pointwise", "row")
                   or gemm_computes(low, w.value) for w in writes)
        y = n.outputs[0].name  # virtual (pull form) or kept physical (torch's copy into a fresh buffer)
        read = any(low._is_kernel(r) and not r.startswith("realize:") for r in low.readers(y))
        return made or read

    out = {n: f"pushed: its updates are stored into the input %{x}, which the model changes in place"
           for n, x in in_place_scatters(graph).items()}
    for n in graph.nodes:  # a kept op copies its output: its producers can store there instead
        if n.name in plan.kept and n.name not in out and gains(n):
            out[n.name] = f"pushed: its inputs are stored into %{n.outputs[0].name} instead of a copy"
    for name, how in low.realize.items():
        if how != "copy":
            continue
        for n in chain_of(graph, plan, name):
            if n.name in out or not gains(n):
                continue
            y = n.outputs[0].name
            if name != y:
                r = plan_keeping(graph, plan.mode, dict(plan.kept), {**plan.pushed, n.name: ""}).realized.get(name)
                if r is None or r.strided is None:
                    continue
            out[n.name] = (f"pushed: its inputs are stored into %{y}, which the pull form would copy"
                           + ("" if name == y else f" for %{name}"))
    for n in graph.nodes:  # a head merge read by a generated GEMM: the attention kernel stores it merged
        if not (merge and MERGE_HEADS) or n.name in out or n.name in plan.kept or \
                base_name(packet_name(n.target) or "") not in COPY_OPS:
            continue
        reader = merged_heads_reader(low, n)
        if reader is not None and gains(n):
            out[n.name] = (f"{MERGED} into %{n.outputs[0].name}, so {reader} reads a plain A instead of packing "
                           "it through the head merge")
    return out


def merged_heads_reader(low, n: Node) -> str | None:
    """The generated GEMM that reads its A operand through virtual copy `n` (attn [B*H, S, D] viewed
    [B, H, S, D], transposed, cloned, viewed [B*S, H*D]: the head merge in front of an o-projection) by a
    mapping that is not a strided view, so its pack gathers A's rows by runs through a column table
    (``vtc.codegen.gemm_pack``, ``vtc_pack_a_cols``); None when there is none.  Pushed, the attention kernel
    stores its rows into the merged layout (``Pusher._attention_stores``) and the GEMM reads a plain A."""
    from vtc.plan.virtualize import chain_of

    plan, graph = low.plan, low.graph
    found = gemm_push.forward(low, n.inputs[0].name) if n.inputs else "no input"
    if not plan.is_virtual(n.outputs[0].name) or isinstance(found, str):
        return None
    p = found[0]  # the attention output: the GEMM must be its one reader (else the kernel keeps its own store)
    readers = low.readers(p)
    r = low._nodes.get(next(iter(readers))) if len(readers) == 1 else None
    if p in low.outputs or r is None or r.op not in GEMM_OPS or low.kind.get(r.name) != "gemm":
        return None
    a = _operands(r, movement.bind(r.target, r.args, r.kwargs))[0]
    if not isinstance(a, Value) or not plan.is_virtual(a.name):
        return None
    chain = chain_of(graph, plan, a.name)  # n must be its last copy (SDPA's decomposition adds one before)
    if [c for c in chain if base_name(packet_name(c.target) or "") in COPY_OPS][-1:] != [n]:
        return None
    return r.name if plan.mappings[a.name].strided() is None else None  # else it reads a plain strided A


def in_place_scatters(graph: Graph) -> dict[str, str]:
    """Scatters whose result the model writes back into the input they scatter into (a StaticCache's
    ``index_copy_``: ``graph.meta["input_mutations"]``), with that input as their one reader: scatter node ->
    input.  Pushed, their updates are stored into the caller's tensor and nothing is copied
    (``Pusher._in_place``), so every planner pushes them."""
    written_back = {graph.inputs[k].name: graph.outputs[j].name for k, j in graph.meta.get("input_mutations", ())}
    if not written_back:
        return {}
    users = graph.users()
    out = {}
    for n in graph.nodes:
        writes = push_writes(n) if n.kind == "movement" else "not movement"
        if isinstance(writes, str) or not writes[0].base:
            continue
        x, y = writes[0].value, n.outputs[0]
        if (written_back.get(x) == y.name and [u.name for u in users[x]] == [n.name]
                and next(v for v in graph.inputs if v.name == x).dtype == y.dtype):
            out[n.name] = x
    return out


def gemm_computes(low, value: str) -> bool:
    """True when a generated GEMM kernel computes `value`, or a virtual tensor `value` is over such a result by
    movement ops with a push form: that kernel can store it into a pushed op's output (vtc.codegen.gemm_push)."""
    if not gemm_push.ENABLED:
        return False
    found = gemm_push.forward(low, value)
    if isinstance(found, str):
        return False
    p = low.producer.get(found[0])
    return p is not None and (low.kind.get(p.name) == "gemm" or p.name in low.epilogue) and gemm_push.stores_pushed(p)


def attention_computes(low, value: str) -> bool:
    """True when an attention kernel computes `value`, or a virtual tensor `value` is over its output by movement
    ops with a push form (its transpose back to [B, S, H, D]): the kernel can store its rows there
    (``Pusher._attention_stores``)."""
    found = gemm_push.forward(low, value)
    if isinstance(found, str):
        return False
    p = low.producer.get(found[0])
    return p is not None and p.name in low.attention


def all_pushes(graph: Graph, gemm: str = "auto") -> dict[str, str]:
    """plan="all"'s pushes: where every movement op is virtual, the ops worth pushing (``worth_pushing``)."""
    from vtc.plan.virtualize import plan_all

    return worth_pushing(graph, plan_all(graph), gemm)


def take_pushes(graph: Graph, vtog, estimator, strategy, gemm: str = "auto"):
    """The greedy's pull strategy with the pushes worth taking (``worth_pushing``) that save time.

    Pushes come second: a pull read by kernels costs nothing, and a chain of pulls may pay only as a
    whole; a push replaces a pull only where that pull's output would be copied into memory anyway.
    """
    from vtc.plan.greedy import Decision, Strategy, plan_of
    from vtc.plan.vtog import PULL, PUSH

    rule_out_unlowerable(vtog)
    pushes = {c.op: c for c in vtog.choices if c.direction == PUSH and not c.invalid}
    if not pushes:
        return strategy
    plan = plan_of(graph, "greedy", vtog, strategy)
    state = frozenset(c.op for c in strategy.chosen if c.direction == PULL)
    chosen, decisions = list(strategy.chosen), list(strategy.decisions)
    in_place = in_place_scatters(graph)
    for op, why in worth_pushing(graph, plan, gemm, merge=True).items():
        c = pushes.get(op)
        if c is None:
            continue
        # a pulled head merge (merged_heads_reader): the push is priced against the pull it replaces
        merge = why.startswith(MERGED) and op in state
        s = estimator.pull_to_push_saving(c, state) if merge else estimator.saving(c, state)
        if s.seconds <= 0 and op not in in_place:  # in place, the push copies nothing: the estimate's copy goes
            continue
        chosen = [x for x in chosen if x.op != op] + [c]
        d = Decision(c.values[0], op, True, s, f"{s.reason} ({why.removeprefix('pushed: ')})", PUSH)
        decisions = [x for x in decisions if not (x.op == op and x.direction == PUSH)] + [d]
        decisions = [x if not (x.op == op and x.direction == PULL) else
                     Decision(x.value, op, False, x.saving, f"replaced by push {op}: {x.reason}", PULL, x.round)
                     for x in decisions]
    taken = {c.op for c in chosen if c.direction == PUSH}
    decisions = [Decision(d.value, d.op, False, d.saving, "push not needed: the pull form copies nothing, or pushing "
                          f"leaves the copy ({d.reason.split(' (', 1)[-1]}", PUSH, d.round)
                 if d.direction == PUSH and not d.chosen and d.op not in taken and not vtog.choice(d.op, PUSH).invalid
                 else d for d in decisions]
    return Strategy(chosen, decisions)


def rule_out_unlowerable(vtog) -> None:
    """Marks the VTOG's push choices that this lowering cannot do as invalid, with the reason."""
    nodes = {n.name: n for n in vtog.graph.nodes}
    for c in vtog.choices:
        if c.direction == "push" and not c.invalid:
            why = push_writes(nodes[c.op])
            if isinstance(why, str):
                c.invalid = f"push: {why}"


class Pusher:
    """The lowering's part: who writes each input of each pushed op, and the kernels that do it."""

    def __init__(self, low) -> None:
        self.low = low
        self.writes: dict[str, list[Write]] = {}  # pushed node -> its writes, base first
        self.direct: dict[str, list[tuple[Node, Write]]] = {}  # value -> (pushed node, write) its kernel stores
        self.copies: set[tuple[str, str]] = set()  # (pushed node, value) written by a copy kernel
        self._base_first: dict[str, str] = {}  # pushed node -> its base, copied before any write lands
        self._base_steps: dict[str, object] = {}  # pushed node -> the KernelStep copying its base
        self._names: dict[str, Node] = {n.name: n for n in low.graph.nodes}
        self._copy_steps: dict[tuple[str, str], object] = {}  # (pushed node, value) -> its copy kernel's step
        self.by_gemm: dict[tuple[str, str], str] = {}  # (pushed node, value) -> the GEMM node whose kernel stores it
        self.by_attention: dict[tuple[str, str], str] = {}  # (pushed node, value) -> the attention kernel storing it
        self.why_copied: dict[tuple[str, str], str] = {}  # (pushed node, value) a GEMM computes -> why it is copied
        self.copy_through: dict[str, str] = {}  # pushed node -> the attention kernel copying its base, or why not
        order = {n.name: k for k, n in enumerate(low.graph.nodes)}
        self._order = order
        for n in low.graph.nodes:
            if low.kind[n.name] != "pushed":
                continue
            writes = push_writes(n)
            if isinstance(writes, str):  # pragma: no cover - the planners push only what push_writes accepts
                raise AssertionError(f"{n.name} is planned as pushed but cannot be: {writes}")
            self.writes[n.name] = writes
            self._fold_or_index(writes)
            self._assign(n, writes)

    # -- who writes what ------------------------------------------------------
    def _fold_or_index(self, writes: list[Write]) -> None:
        """Index tensors computed from indices alone are folded into the store index; the others are read."""
        low = self.low
        for w in writes:
            for t, shape in w.mapping.index_tensors.items():
                if t in low.folded or t in low.index_names:  # folded already, or read by a gather too
                    continue
                e = low.index_expr(t, out_vars(shape)) if t in low.values else None
                if e is not None and all(c.lo <= e.lo and e.hi <= c.hi for c in w.mapping.checks if c.tensor == t):
                    low.folded.add(t)
                else:
                    low.index_names.add(t)

    def _position(self, name: str) -> int:
        """The graph position after which value `name` can be read (-1: an input or constant)."""
        low = self.low
        p = low.producer.get(name)
        if p is None:
            return -1
        if low.plan.is_virtual(name):
            m = low.plan.mappings[name]
            return max([-1, *(self._position(s) for s in [*m.sources, *m.index_tensors] if s in low.values)])
        return self._order[p.name]

    def _can_direct(self, n: Node, w: Write) -> bool:
        """True when the producer kernel of w.value can store it into n's output itself."""
        low = self.low
        if low.plan.is_virtual(w.value) or w.value not in low.producer:
            return False
        p = low.producer[w.value]
        k = low.kind[p.name]
        writers = ("pointwise", "row", "gemm") if gemm_push.ENABLED else ("pointwise", "row")  # GEMM: gemm_push
        if k not in writers or (k == "pointwise" and not p.inputs) or (k == "gemm" and not gemm_push.stores_pushed(p)):
            return False
        here = self._order[p.name]  # index tensors must be in memory before it runs (realised at their producer)
        return all(self._order[low.producer[t].name] < here for t in w.mapping.index_tensors
                   if t not in low.folded and t in low.producer)

    def _assign(self, n: Node, writes: list[Write]) -> None:
        updates = [w for w in writes if not w.base]
        base = next((w for w in writes if w.base), None)
        direct = {w.value for w in updates if self._can_direct(n, w)}
        if base is not None:
            early = self._position(base.value) < 0
            if self._can_direct(n, base):
                first = min((self._order[self.low.producer[w.value].name] for w in updates if w.value in direct),
                            default=self._order[n.name])
                if self._order[self.low.producer[base.value].name] < first:
                    direct.add(base.value)
                else:
                    direct = set()  # the base's producer runs after an update's: every write at the op, in order
            elif early:
                self._base_first[n.name] = base.value  # copied before the first update lands
            else:
                direct = set()
        for w in writes:
            if w.value in direct:
                self.direct.setdefault(w.value, []).append((n, w))
            else:
                self.copies.add((n.name, w.value))

    # -- what the lowering asks -----------------------------------------------
    def reader_name(self, n: Node, value: str) -> str:
        """Pushed node n as a reader of `value` (its data input or index tensor)."""
        return f"{READER}{n.name}:{value}"

    def reads_as_kernel(self, reader: str) -> bool:
        """True when this push reader reads its value in a generated kernel (a copy write, a folded index)."""
        node, _, value = reader[len(READER):].partition(":")
        return (node, value) in self.copies or value in self.low.folded

    # -- kernels --------------------------------------------------------------
    def emit(self, n: Node, steps: list) -> None:
        """The copy kernels that write n's inputs that no producer stores (the base first)."""
        for w in self.writes[n.name]:
            if (n.name, w.value) in self.copies:
                step = self._copy_step(n, w)
                self._copy_steps[(n.name, w.value)] = step
                if w.base:
                    self._base_steps[n.name] = step
                steps.append(("kernel", step))

    def _store_through(self, st: Store, n: Node, w: Write) -> Store:
        """Store `st` (of w.value, at its index) redirected into n's output through w's push mapping."""
        y = n.outputs[0]
        env = {f"i{k}": e for k, e in enumerate(st.index)}
        idx = tuple(self.low._fold(subs(e, env)) for e in w.mapping.pieces[0].index)
        return Store(Buffer(y.name, y.shape, y.dtype), idx, K.cast(st.value, y.dtype), st.per_r)

    def _copy_step(self, n: Node, w: Write):
        from vtc.codegen.lower import _ident, _step

        low = self.low
        x = low.values[w.value]
        idx = out_vars(x.shape)
        value = low.value_at(w.value, idx, {})
        st = self._store_through(Store(Buffer(x.name, x.shape, x.dtype), idx, value), n, w)
        k = low._finish(Kernel(f"k_push_{_ident(x.name)}_{_ident(n.outputs[0].name)}", "push", x.shape, 0, [],
                               [st], source_nodes=[n.name]))
        step = _step(low, k)
        self._add_checks(step, w)
        return step

    def _add_checks(self, step, w: Write) -> None:
        for c in w.mapping.checks:
            if c.tensor not in self.low.folded and c not in step.checks:
                step.checks.append(c)

    def _gemm_stores(self, step) -> tuple[list, set[int]]:
        """GEMM kernel `step` stores the pushed writes of its result: the direct ones (its result, or its
        epilogue's, is a pushed op's input) and those of virtual tensors over its result that a copy kernel
        would write (``vtc.codegen.gemm_push``).  Returns the copy steps for the direct writes it cannot
        store (run right after it) and the ids of the copy steps it replaces; the reasons in why_copied."""
        low, k = self.low, step.kernel
        p = k.stores[0].buffer.name
        anchor = self._order[k.source_nodes[-1]]  # the graph position the kernel runs at
        todo = [(n, w, True) for n, w in self.direct.get(p, [])]
        for node, value in sorted(self.copies):
            w = next(w for w in self.writes[node] if w.value == value)
            if not w.base and low.plan.is_virtual(value) and p in low.plan.mappings[value].sources:
                todo.append((self._names[node], w, False))
        stores, done, copies, readers = [], set(), [], set()
        for n, w, direct in todo:
            y = n.outputs[0]
            fwd = gemm_push.forward(low, w.value)
            why = fwd if isinstance(fwd, str) else None
            if why is None and not direct:
                why = self._after(n, w, anchor)
            if why is None:
                st = gemm_push.gemm_store(low, k, Buffer(y.name, y.shape, y.dtype), fwd[1], w.value, w.mapping)
                why = st if isinstance(st, str) else None
            if why is not None:
                self.why_copied[(n.name, w.value)] = why
                if direct:  # its result stays in memory and is copied into place right after
                    self.copies.add((n.name, w.value))
                    copies.append(("kernel", self._copy_step(n, w)))
                continue
            stores.append(st)
            readers.add(self.reader_name(n, w.value))
            self._add_checks(step, w)
            self.by_gemm[(n.name, w.value)] = k.source_nodes[0]
            choice = low.gemm_choices.get(k.source_nodes[0])
            if choice is not None and n.name not in choice.stores_into:
                choice.stores_into.append(n.name)
            if not direct:
                self.copies.discard((n.name, w.value))
                done.add(id(self._copy_steps[(n.name, w.value)]))
        if not stores:
            return copies, done
        layout = gemm_push.in_place_layout(k, stores[0]) if len(stores) == 1 and not copies else None
        alone = p not in low.outputs and not (low.readers(p) - readers)
        if layout is not None and alone and stores[0].buffer.dtype == k.stores[0].buffer.dtype:
            k.stores, k.gemm.out_layout = stores, layout  # accumulated straight into the pushed op's output
        else:
            k.stores = [k.stores[0], *stores]
        low._finish(k)
        return copies, done

    def _attention_stores(self, step) -> set[int]:
        """Attention kernel `step` stores its output rows straight into a pushed copy of a virtual tensor over
        its output (``COPY_OPS``: attn [B*H, S, D] viewed [B, H, S, D], transposed to [B, S, H, D], cloned) in
        place of its own store, so the copy kernel and the kernel's output disappear.  Only where that write
        is the output's one reader and lands on every element with no predicate (the emitters store each row
        once, through the one store); else the copy stays, with the reason in why_copied.  Returns the ids
        of the copy steps it replaces."""
        low, k = self.low, step.kernel
        p = k.stores[0].buffer.name
        todo = []
        for node, value in sorted(self.copies):
            n = self._names[node]
            if base_name(packet_name(n.target) or "") not in COPY_OPS:
                continue
            w = next(w for w in self.writes[node] if w.value == value)
            if low.plan.is_virtual(value) and p in low.plan.mappings[value].sources:
                todo.append((n, w))
        done: set[int] = set()
        for n, w in todo:
            y = n.outputs[0]
            fwd = gemm_push.forward(low, w.value)
            why = fwd if isinstance(fwd, str) else None
            if why is None and (p in low.outputs or low.readers(p) != {self.reader_name(n, w.value)} or len(todo) > 1):
                why = f"the attention output %{p} has other readers"
            st = None
            if why is None:
                st = gemm_push.pushed_store(low, k.stores[0], Buffer(y.name, y.shape, y.dtype), fwd[1], w.value,
                                            w.mapping)
                why = st if isinstance(st, str) else ("it lands on part of the output only" if st.when is not None
                                                      or st.buffer.dtype != k.stores[0].buffer.dtype else None)
            if why is not None:
                self.why_copied[(n.name, w.value)] = why
                continue
            k.stores = [st]
            low._finish(k)
            self._add_checks(step, w)
            self.by_attention[(n.name, w.value)] = k.source_nodes[-1]
            self.copies.discard((n.name, w.value))
            done.add(id(self._copy_steps[(n.name, w.value)]))
        return done

    def _after(self, n: Node, w: Write, anchor: int) -> str | None:
        """Why a GEMM kernel at graph position `anchor` cannot store write w of pushed node n: an index tensor
        of w computed after it, or a scatter base written after it (None when it can)."""
        low = self.low
        for t in w.mapping.index_tensors:
            if t not in low.folded and t in low.producer and self._order[low.producer[t].name] >= anchor:
                return f"index tensor %{t} is computed after the GEMM"
        base = next((b for b in self.writes[n.name] if b.base), None)
        if base is None or n.name in self._base_first:
            return None
        if base.value in self.direct and self._order[low.producer[base.value].name] < anchor:
            return None
        return f"the base %{base.value} of {n.name} is written after the GEMM"

    def finish(self, steps: list) -> list:
        """Redirects the direct writers' stores, puts early base copies first, marks in-place writes."""
        if not self.writes:
            return steps
        low = self.low
        replaced: set[int] = set()  # copy steps whose writes a GEMM kernel stores instead
        for at, (kind, step) in reversed(list(enumerate(steps))):
            if kind != "kernel":
                continue
            k = step.kernel
            if k.kind == "gemm" and gemm_push.ENABLED:  # it stores through the push mappings too (gemm_push)
                copies, done = self._gemm_stores(step)
                steps[at + 1:at + 1] = copies
                replaced |= done
                continue
            if k.kind == "attention":  # it stores its rows through a transpose back to [B, S, H, D]
                replaced |= self._attention_stores(step)
            if not any(st.buffer.name in self.direct for st in k.stores):
                continue
            if k.kind not in ("pointwise", "row"):  # e.g. an attention kernel: it stores in its own order only
                names = [st.buffer.name for st in k.stores if st.buffer.name in self.direct]
                copies = [("kernel", self._copy_step(n, w)) for x in names for n, w in self.direct[x]]
                self.copies |= {(n.name, w.value) for x in names for n, w in self.direct[x]}
                steps[at + 1:at + 1] = copies  # x stays in memory; copied into place right after
                continue
            stores = []
            for st in k.stores:
                pushes = self.direct.get(st.buffer.name)
                if not pushes:
                    stores.append(st)
                    continue
                others = low.readers(st.buffer.name) - {self.reader_name(n, st.buffer.name) for n, _ in pushes}
                if others:
                    stores.append(st)  # something else reads it: stored as well
                for n, w in pushes:
                    stores.append(self._store_through(st, n, w))
                    self._add_checks(step, w)
            k.stores = stores
            low._finish(k)
        steps = [x for x in steps if id(x[1]) not in replaced]
        for node in self._base_first:  # an early base copy runs before the first write into y
            y = self._names[node].outputs[0].name
            first = next(i for i, (kind, s) in enumerate(steps) if kind == "kernel" and _stores(s.kernel, y))
            copy = next(i for i, (kind, s) in enumerate(steps) if s is self._base_steps[node])
            if copy > first:
                steps.insert(first, steps.pop(copy))
        steps, written = self._in_place(steps)  # the base is the input the model changes in place: no copy
        steps = decode_copy.fuse(self, steps)  # an attention kernel copies a base while reading it
        targets = {self._names[n].outputs[0].name: self._names[n].outputs[0] for n in self.writes}
        for kind, step in steps:
            if kind != "kernel":
                continue
            k = step.kernel
            for name in dict.fromkeys(st.buffer.name for st in k.stores if st.buffer.name in targets):
                if name in written and all(b.name != name for b in k.inputs):
                    y = targets[name]
                    k.inputs.append(Buffer(y.name, y.shape, y.dtype))  # given, written in place
                written.add(name)
        return steps

    def _in_place(self, steps: list) -> tuple[list, set[str]]:
        """(steps, the outputs now given to every writer) with the base copy of each scatter into an input that
        the model changes in place (``in_place_scatters``) replaced by an alias of that input: the updates are
        stored into the caller's tensor, and the call's write-back finds nothing to copy."""
        in_place = in_place_scatters(self.low.graph)
        aliased = set()
        for node, base in list(self._base_first.items()):
            y = self._names[node].outputs[0]
            at = next((i for i, (_, s) in enumerate(steps) if s is self._base_steps.get(node)), None)
            if in_place.get(node) != base or at is None:
                continue
            shape = tuple(y.shape)
            steps[at] = ("alias", Realization(y.name, identity(base, shape),
                                              Strided(base, 0, contiguous_strides(shape))))
            del self._base_first[node]
            self.copy_through[node] = f"none: the updates are stored into the input %{base}, which the model " \
                                      "changes in place"
            aliased.add(y.name)
        return steps, aliased


def _stores(k: Kernel, name: str) -> bool:
    return any(st.buffer.name == name for st in k.stores)
