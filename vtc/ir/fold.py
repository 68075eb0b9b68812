"""Constant folding: values computed from nothing the caller passes or may change, computed once at compile time.

A value is *foldable* when its node reads no graph input and no parameter or buffer: an ``arange``, a
``full`` or a ``scalar_tensor`` (nodes without tensor operands) and every node computed from foldable
values only.  Swin's shifted-window attention mask is such a chain (two aranges, comparisons, a window
partition, a difference and two ``where``: [64, 49, 49] from nothing): left in the graph, the planner makes
it virtual and the attention kernel evaluates its index arithmetic (int64 divisions by 7, 8 and 24) for every
(query, key) pair, twice (the hidden-block check and the scores).  ``fold_constants`` runs such chains once
with torch and puts the values the rest of the graph reads in as constants.

Only where that pays: a floating-point value whose index arithmetic would divide (a view that splits or merges
dims, a division or remainder on the way).  A causal mask (``arange[:, None] < arange[None, :]``) stays a node:
the attention kernel turns its index arithmetic into a predicate and skips the key blocks it hides; roll's
``(arange + shift) % n`` indices stay index arithmetic (``Lowering._foldable_index_tensors``), not gathers
through a constant; a RoPE position-times-frequency table made from aranges alone stays computed, where the
kernels read it (transformers' reads an ``inv_freq`` buffer: a value of the model's tensors, below).

Values that read a parameter or buffer (the model may change it in place after compiling) are folded by
``fold_weight_chains`` instead, into constant copies computed again when what they read changes in place: a
GEMM's or convolution's weight behind a movement chain that is not a strided view, and a value a compute op
makes from the model's tensors (weight normalisation, ``W * s``, a LoRA merge, T5's relative position bias, Swin's:
a table gathered through an index buffer).

Not folded: random and uninitialised tensors (``rand*``, ``empty*``, ``bernoulli``, ...: a new value per
call), a graph output (returned to the caller, who may write to it), a value above ``MAX_BYTES`` (but a GEMM's
or convolution's weight computed from the model's tensors: held against the packed-weight budget), and in graphs
of the size-generic path (``vtc.dynamic``, whose plans are replayed by node name across sizes) a value whose shape
varies with the sizes: the nodes in ``graph.meta["size_varying"]`` and what they compute.
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.utils._pytree as pytree

from vtc.ir.graph import Graph, Node, Value
from vtc.ir.ops import classify, compute_category

MAX_BYTES = 16 << 20  # a folded value above this stays computed: a constant of that size costs memory for good
NONDETERMINISTIC = ("rand", "empty", "bernoulli", "normal", "uniform", "dropout", "multinomial", "poisson",
                    "exponential", "geometric", "cauchy", "log_normal")


def fold_constants(graph: Graph) -> Graph:
    """`graph` with its foldable values (module docstring) that are worth a constant computed once: the
    floating-point values the rest of the graph reads whose index arithmetic would divide (``_divides``), with
    the nodes only they need removed; those Value objects become "const" ones (`graph` itself is consumed).
    The same graph object when nothing folds; the count of removed nodes in ``graph.meta["folded_nodes"]``, the
    constants made in ``graph.meta["folded_from_nothing"]``.  Then the values computed from the model's tensors
    (``fold_weight_chains``)."""
    outputs = {v.name for v in graph.outputs}
    varying = graph.meta.get("size_varying", ())
    env: dict[str, torch.Tensor] = {}
    divides: dict[str, bool] = {}  # foldable value -> its index arithmetic would divide somewhere
    foldable: list[Node] = []
    for n in graph.nodes:
        ins = n.inputs
        if (n.name in varying or not all(v.name in env for v in ins) or any(v.name in outputs for v in n.outputs)
                or any(w in n.op for w in NONDETERMINISTIC) or sum(v.nbytes for v in n.outputs) > MAX_BYTES):
            continue
        try:
            with torch.no_grad():
                outs = n.run(env)
        except Exception:  # noqa: BLE001 - an op torch cannot run here stays in the graph (and fails as before)
            continue
        if len(outs) != len(n.outputs) or not all(
                isinstance(t, torch.Tensor) and tuple(t.shape) == v.shape and t.dtype == v.dtype
                for t, v in zip(outs, n.outputs)):
            continue
        d = _divides(n) or any(divides[v.name] for v in ins)
        for v, t in zip(n.outputs, outs):
            env[v.name], divides[v.name] = t, d
        foldable.append(n)
    removed = {id(n) for n in foldable}
    read_by_kept = {v.name for n in graph.nodes if id(n) not in removed for v in n.inputs}
    for n in reversed(foldable):  # readers first: a kept node's foldable inputs become constants or stay nodes
        needed = [v for v in n.outputs if v.name in read_by_kept]
        if needed and not all(v.dtype.is_floating_point and divides[v.name] for v in needed):
            removed.discard(id(n))  # cheaper as index arithmetic (a causal mask, roll's indices) or a plain value
            read_by_kept.update(v.name for v in n.inputs)
    if not removed:
        return fold_weight_chains(graph)
    consts = list(graph.consts)
    for n in foldable:
        if id(n) in removed:
            for v in n.outputs:
                if v.name in read_by_kept:  # a constant of its own memory
                    v.kind, v.producer, v.data = "const", None, env[v.name].contiguous().clone()
                    consts.append(v)
    kept = [n for n in graph.nodes if id(n) not in removed]
    out = Graph(graph.inputs, consts, kept, graph.outputs, graph.in_spec, graph.out_spec, dict(graph.meta))
    out.meta["folded_nodes"] = len(removed)
    made = [v.name for v in consts[len(graph.consts):]]
    out.meta["folded_from_nothing"] = [*graph.meta.get("folded_from_nothing", ()), *made]
    return fold_weight_chains(out)


def _divides(n: Node) -> bool:
    """True when reading node n's output through index arithmetic divides: a view that splits or merges dims
    (a window partition: i // 7, i % 7), a division or remainder."""
    if any(w in n.op for w in ("div", "fmod", "remainder")):
        return True
    if n.kind != "movement" or len(n.inputs) != 1 or len(n.outputs) != 1:
        return False
    (x,), (y,) = n.inputs, n.outputs
    return x.numel == y.numel and sorted(d for d in x.shape if d != 1) != sorted(d for d in y.shape if d != 1)


# the compute ops whose operands are weights the call plan packs once (vtc.runtime.packed) when they are constants
WEIGHT_READERS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
                  "aten.convolution.default")


def fold_weight_chains(graph: Graph) -> Graph:
    """`graph` with the values computed from the model's tensors alone that pay for a constant folded into copies.

    Two kinds of such values are computed on every call when left in the graph:

    - a GEMM's or convolution's weight behind a movement chain that is not a strided view (roll, cat,
      index_select, gather, pad, flip: a negative stride).  The paths for weights packed once
      (``vtc.runtime.packed``: MKL's packed weight, the generated kernels' packed panels) take a constant or a
      strided view of one, not such a chain: the generated kernel packed it through the chain's mapping on every
      call or read it so in its dot loop (x @ W.roll(3, 0)^T, 5 rows, W 1024 x 1024: 2.2 ms against 0.10 on W
      itself, 1 thread; docs/robustness.md, session 22);
    - a value that a compute op makes from the model's tensors (``_made_by_compute``): weight normalisation
      (g * v / ||v||), ``W * s``, a LoRA merge ``W + B @ A``, ``logit_scale.exp()``, T5's relative position
      bias (an embedding of a parameter at buckets computed from aranges), Swin's (a table gathered through an
      index buffer: ``_gathers_from_memory``).  Its nodes ran at every call, and a
      GEMM reading it took it as a runtime operand, packed per call.

    Such a value (the last one before the strided views its reader reads it through: W.roll(3, 0) or W * s, not
    its transpose) becomes a constant of its own memory, computed once with torch from the constants it reads
    (``vtc.runtime.weights.ConstCopy``, in ``graph.meta["const_copies"]``; the count of nodes removed in
    ``graph.meta["const_copy_nodes"]``) and computed again at a call where one of them changed in place since
    (``load_state_dict``, ``p.mul_`` under ``no_grad``).  The constants it reads stay constants of the graph (the
    parameter watch, ``vtc.runtime.weights.watch``, sees them replaced).  A value a pointwise op makes as a broadcast
    (T5's bias without a mask: [B, H, S, S], the same for every batch row) is held without its broadcast dims
    ([1, H, S, S]) and read through an expand of it.  Graphs that fold the same recipe from the same tensors (a
    model's specializations for several input sizes) share one copy.  Not folded: graph outputs, random ops,
    fallback ops, a value that is not a GEMM's or convolution's operand above ``MAX_BYTES`` (the values it is
    computed from are considered instead).

    The copy takes as much memory as the value, counted with the packed copies against
    ``vtc.runtime.packed.BUDGET_BYTES`` (made before them: a call plan's copies are admitted when it is built);
    one that would pass it, or whose constants include an inference tensor (no version counter), is not made
    and the value stays computed: why in ``graph.meta["weight_chains_not_folded"]`` ({value: the reason, or the
    ``OverBudget`` that refused the copy}; the call plan's ``why_not_packed`` and ``report.packing``).
    ``VTC_PACKED_WEIGHTS=0`` makes none."""
    from vtc.runtime import packed

    if not packed.CONV_ENABLED:
        return graph
    consts = {v.name: v.data for v in graph.consts if isinstance(v.data, torch.Tensor)}
    outputs = {v.name for v in graph.outputs}
    varying = graph.meta.get("size_varying", ())
    made: dict[str, Node] = {}  # value computed by torch from constants alone -> its node
    for n in graph.nodes:
        if (n.kind != "fallback" and n.name not in varying and all(v.name in consts or v.name in made for v in n.inputs)
                and not any(w in n.op for w in NONDETERMINISTIC)):
            made.update((v.name, n) for v in n.outputs)
    by_compute = _made_by_compute(graph, made, set(consts) - set(graph.meta.get("folded_from_nothing", ())))
    targets: dict[str, Value] = {}
    seen: set[str] = set()

    def consider(v: Value, weight: bool) -> None:
        """Folds the value `v` is a strided view of where that pays; a computed one too large for a constant is
        computed per call from the values it reads, considered in turn."""
        t = _behind_views(v, made)
        n = made.get(t.name)
        if (n is None or t.name in seen or t.name in outputs or len(n.outputs) != 1
                or not all(isinstance(d, int) for d in t.shape)):
            return
        seen.add(t.name)
        if weight and (n.kind == "movement" or t.name in by_compute):
            targets[t.name] = t
        elif t.name in by_compute:
            if t.nbytes <= MAX_BYTES:
                targets[t.name] = t
            else:
                for u in n.inputs:
                    consider(u, False)

    readers = [n for n in graph.nodes if any(v.name not in made or v.name in outputs for v in n.outputs)]
    for weight in (True, False):  # a weight first: it is folded whatever its size
        for n in readers:
            if (n.op in WEIGHT_READERS) == weight:
                for v in n.inputs:
                    consider(v, weight)
    copies, recipes, not_folded = {}, [], {}
    same: dict[str, str] = {}  # value -> the folded one the same ops make from the same constants (T5's bias
    folded_as: dict[int, str] = {}  # per layer): one copy for both
    keys = _recipe_keys(graph, made)
    for t in targets.values():
        key = keys[t.name]
        if key in folded_as:
            same[t.name] = folded_as[key]
            recipes += _recipe(graph, t, made)
            continue
        folded = _fold(graph, t, made, consts)
        if not isinstance(folded, tuple):
            not_folded[t.name] = folded
        else:
            copies[t.name], recipe = folded
            recipes += recipe
            folded_as[key] = t.name
    if not copies:
        if not_folded:
            graph.meta["weight_chains_not_folded"] = not_folded
        return graph
    removed = {id(n) for n in recipes}
    read_by_kept = outputs | {v.name for n in graph.nodes if id(n) not in removed for v in n.inputs}
    for n in reversed(graph.nodes):  # a node something kept reads (other than through a folded value) stays
        if id(n) in removed and any(v.name in read_by_kept and v.name not in copies and v.name not in same
                                    for v in n.outputs):
            removed.discard(id(n))
            read_by_kept.update(v.name for v in n.inputs)
    consts_out = list(graph.consts)
    expands: dict[int, Node] = {}  # the node that made a value folded without its broadcast dims -> its expand
    for name in [*copies, *same]:
        v, value = targets[name], copies[same.get(name, name)].value
        if tuple(value.shape) == v.shape:
            v.kind, v.producer, v.data = "const", None, value
            consts_out.append(v)
        else:  # the copy without the dims v is a broadcast over; v its expand, read through the mapping
            one = Value(f"{name}_unbroadcast", tuple(value.shape), v.dtype, "const", data=value)
            consts_out.append(one)
            args, producer = (one, list(v.shape)), v.producer
            expands[id(producer)] = Node(f"{name}_broadcast", torch.ops.aten.expand.default, args, {}, (v,),
                                           classify(torch.ops.aten.expand.default, args, {}))
    kept = [expands.get(id(n), n) for n in graph.nodes if id(n) not in removed or id(n) in expands]
    out = Graph(graph.inputs, consts_out, kept, graph.outputs, graph.in_spec, graph.out_spec, dict(graph.meta))
    out.meta["const_copies"] = {**graph.meta.get("const_copies", {}), **copies}
    out.meta["const_copy_nodes"] = graph.meta.get("const_copy_nodes", 0) + len(removed)
    if not_folded:
        out.meta["weight_chains_not_folded"] = not_folded
    return out


FOLD_GATHERS = True  # a gather through an index held in memory counts as computing (False: for A/B)


def _made_by_compute(graph: Graph, made: dict[str, Node], model: set[str]) -> set[str]:
    """The values in `made` that read one of the model's tensors (`model`: constants not folded from nothing by
    ``fold_constants``) with a compute node on the way: from the tensors to them, or making an index they gather
    with (T5's buckets).  A movement chain of the model's tensors alone is not one: it costs no arithmetic where it
    is read through its mapping.  But a gather through an index held in memory is (``_gathers_from_memory``: Swin's
    relative position bias, ``table[index]``): each read of it loads the index, then gathers, and the attention
    reads the bias once per window (or a kernel per call materialises it)."""
    reads_model, computed = set(model), set()
    for n in graph.nodes:
        if n.outputs and n.outputs[0].name in made:
            names = [v.name for v in n.inputs]
            if any(x in reads_model for x in names):
                reads_model.update(v.name for v in n.outputs)
            if n.kind == "compute" or any(x in computed for x in names) or _gathers_from_memory(n, made, model):
                computed.update(v.name for v in n.outputs)
    return reads_model & computed


def _gathers_from_memory(n: Node, made: dict[str, Node], model: set[str]) -> bool:
    """True for a movement node (``index``, ``index_select``, ``gather``, ``embedding``) of floating-point values
    that reads an integer index which is one of the model's tensors (`model`) or a strided view of one: an index
    held in memory, not index arithmetic (roll's ``(arange + s) % n``, positions from an arange: unchanged)."""
    if not FOLD_GATHERS or n.kind != "movement" or not n.outputs[0].dtype.is_floating_point:
        return False
    return any(not v.dtype.is_floating_point and v.dtype != torch.bool and len(v.shape) > 0
               and _behind_views(v, made).name in model for v in n.inputs)


def _behind_views(v: Value, made: dict[str, Node]) -> Value:
    """The value operand `v` is a strided view of, through nodes computed from constants alone (`v` itself where it
    is no such view)."""
    from vtc.plan.virtualize import pull_of

    while v.name in made and made[v.name].kind == "movement" and len(made[v.name].inputs) == 1:
        n = made[v.name]
        pulls = pull_of(n)
        if isinstance(pulls, str):
            break
        m = pulls[n.outputs.index(v)]
        if m.checks or m.strided() is None:
            break
        v = n.inputs[0]
    return v


def _recipe(graph: Graph, t: Value, made: dict[str, Node]) -> list[Node]:
    """The nodes computing value `t` from constants, in graph order."""
    need: set[int] = set()
    stack = [t]
    while stack:
        n = made.get(stack.pop().name)
        if n is not None and id(n) not in need:
            need.add(id(n))
            stack.extend(n.inputs)
    return [n for n in graph.nodes if id(n) in need]


def _recipe_keys(graph: Graph, made: dict[str, Node]) -> dict[str, int]:
    """{value in `made`: a number, equal for two values the same ops compute from the same constants}."""
    keys: dict[str, int] = {}
    numbers: dict[tuple, int] = {}
    for n in graph.nodes:
        if n.outputs and n.outputs[0].name in made:
            args = pytree.tree_map(lambda x: keys.get(x.name, x.name) if isinstance(x, Value) else x,
                                   (n.args, n.kwargs))
            for i, v in enumerate(n.outputs):
                keys[v.name] = numbers.setdefault((n.op, repr(args), i), len(numbers))
    return keys


def _fold(graph: Graph, t: Value, made: dict[str, Node], consts: dict[str, torch.Tensor]):
    """(the ConstCopy of value `t`, the nodes computing it in graph order), or why it is not made (a str, or the
    OverBudget that refused it).  The copy holds one element along the dims `t` is a broadcast over
    (``_broadcast_dims``; `t` is then its expand); another graph's copy computed by the same recipe from the same
    tensors is taken and computed again (``_SHARED``)."""
    from vtc.runtime import packed
    from vtc.runtime.weights import ConstCopy

    recipe = _recipe(graph, t, made)
    names = sorted({v.name for n in recipe for v in n.inputs if v.name in consts})
    sources = tuple(consts[x] for x in names)
    if not sources:
        return "it reads no constant"
    if any(s.is_inference() for s in sources):
        return "it reads an inference tensor: it has no version counter to see an in-place change by"
    dims = _broadcast_dims(recipe, t, dict(zip(names, sources)))
    key = _shared_key(recipe, t, consts, dims)
    with _SHARED_LOCK:
        copy = _SHARED.get(key) if key is not None else None
        if copy is not None:  # computed again: Compiled.refresh() after a write through p.data reaches it
            copy.compute_again()
            return copy, recipe

        def compute() -> torch.Tensor:
            env = dict(zip(names, sources))
            for n in recipe:
                env.update(zip((v.name for v in n.outputs), n.run(env)))
            value = env[t.name]
            for d in dims:
                value = value.narrow(d, 0, 1)
            return value

        shape = tuple(1 if d in dims else s for d, s in enumerate(t.shape))
        nbytes = t.nbytes // t.numel * _numel(shape) if t.numel else 0
        try:
            packed.HELD.admit(nbytes, "the weight chain's folded copy of")
        except packed.OverBudget as e:
            return e
        try:
            copy = ConstCopy(sources, compute)
        except Exception as e:  # noqa: BLE001 - an op torch cannot run here stays in the graph (and fails as before)
            return f"torch could not compute it: {type(e).__name__}: {e}"
        if tuple(copy.value.shape) != shape or copy.value.dtype != t.dtype:
            return f"torch computed {copy.value.dtype} {list(copy.value.shape)}, the graph says {t.dtype} {list(shape)}"
        packed.HELD.add(copy.value, copy.value.nbytes)
        if key is not None:
            _SHARED[key] = copy
        return copy, recipe


# (a folded value's recipe: its ops and arguments, the storages of the constants it reads) -> its ConstCopy while a
# graph holds it: the executors of one model (a specialization for new input sizes, vtc.dynamic's sizes, a replan)
# share one copy and therefore one packed copy of it (vtc.runtime.packed keys those by the weight's address).  The
# copy holds its sources: no other tensor can take their addresses while the entry exists.
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def _shared_key(recipe: list[Node], t: Value, consts: dict[str, torch.Tensor], dims: tuple[int, ...]) -> tuple | None:
    """What identifies the copy of value `t` that `recipe` computes from `consts`, without dims `dims` (None: an
    argument that is a tensor)."""
    index = {v.name: (i, j) for i, n in enumerate(recipe) for j, v in enumerate(n.outputs)}

    def leaf(x):
        if isinstance(x, Value):
            if x.name in index:
                return index[x.name]
            c = consts[x.name]
            return ("const", c.untyped_storage().data_ptr(), c.storage_offset(), tuple(c.shape), c.stride(), c.dtype)
        if isinstance(x, torch.Tensor):
            raise _NotShared
        return x

    try:
        return (tuple((n.op, repr(pytree.tree_map(leaf, (n.args, n.kwargs)))) for n in recipe),
                index[t.name], t.shape, t.dtype, dims)
    except _NotShared:
        return None


class _NotShared(Exception):
    pass


def _broadcast_dims(recipe: list[Node], t: Value, sources: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """The dims (of size above 1) that value `t` does not vary along by construction: `t` is made by a pointwise op
    whose every operand, broadcast to `t`'s shape, has stride 0 there (an expand, a size-1 dim, a scalar).  T5's
    position bias without a mask is ``where(mask.expand(B, 1, S, S), bias[1, H, S, S], 0)``: the same [1, H, S, S]
    for every batch row.  The strides come from running the recipe on meta tensors (no data, no arithmetic)."""
    last = recipe[-1]
    if compute_category(last.target) != "pointwise" or len(last.outputs) != 1:
        return ()
    def meta(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")

    try:
        env = {x: meta(s) for x, s in sources.items()}
        for n in recipe[:-1]:  # an op without tensor operands (arange) makes a CPU tensor: each output as meta
            env.update(zip((v.name for v in n.outputs), map(meta, n.run(env))))
        strides = [torch.broadcast_to(env[v.name], t.shape).stride() for v in last.inputs]
    except Exception:  # noqa: BLE001 - an op without a meta kernel: the copy holds the whole value
        return ()
    return tuple(d for d, size in enumerate(t.shape) if size > 1 and all(s[d] == 0 for s in strides))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
