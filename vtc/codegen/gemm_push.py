"""A GEMM that stores its result through push mappings (a fused QKV projection writing into the KV cache).

``vtc.codegen.push`` removes a cat or scatter on the write side: the kernel
that computes an input stores it into the op's output ``y``.  A generated GEMM
(``vtc.codegen.gemm``, convolutions included) computes its result ``p`` tile by
tile into an accumulator; this module makes it store the finished tiles where
the pushed ops want them too, so the separate push copy disappears:

- **direct**: ``p`` (or its epilogue's result, e.g. ``relu(x @ w)``) is an input
  of the pushed op (GEMM -> cat, GEMM -> slice_scatter);
- **through a chain**: the input is a virtual tensor over ``p`` by views,
  splits, unbinds, slices, selects, transposes and permutes (``x @ W_qkv^T``
  split into q, k and v, k and v viewed heads-first and index_copy'd into the
  caches).  ``forward`` composes the push form of each op of the chain from
  ``p`` to the input: over ``p``'s index, where each element lands in the input,
  or nowhere (the q part is not in k).  A split feeding several destinations
  is a store per destination, each over its part of ``p``.

How the GEMM stores (``gemm_store``): a store of ``p``'s element at its index
into ``y`` at the composed index, only where the element lands in ``y`` (the
store's ``when``), in the GEMM's epilogue while the tile is in cache; ``p``
stays the accumulator.  Where the write is the only reader of ``p``, covers it
whole, and lands at an affine offset with unit stride along the GEMM's columns
(``in_place_layout``: cat along any dim, a slice_scatter's block), the GEMM
accumulates straight into ``y`` instead and ``p`` never exists.

What stays a push copy, with the reason (``Pusher.why_copied``, in the report):
an op on the chain without a push form (expand, gather), a chain that changes
the dtype (a float16 GEMM rounds its float32 sums into each output), a mapping with more than one source, an index tensor computed after
the GEMM, or a scatter base that is written after it.
"""
from __future__ import annotations

import torch

from vtc.codegen import kernel_ir as K
from vtc.codegen.kernel_ir import Buffer, Kernel, Store
from vtc.index.expr import TRUE, Expr, _terms, and_, eq, free_vars, ge, lift, loads, lt, mod, not_, subs
from vtc.index.mapping import Mapping, Piece, compose, identity, linear_offset, out_vars
from vtc.ir.graph import Node
from vtc.virtual import movement
from vtc.virtual.ops import base_name, packet_name


ENABLED = True  # False: a GEMM stores only its own result and push copies put it into place (the code before
#                this module; an ablation for bench/push_side_by_side.py, set before vtc.compile)


# -- forward (push) mappings along a chain of movement ops ----------------------------------------
def _dim(d: int, rank: int) -> int:
    return d % max(rank, 1)


def _forward_slice(self, dim=0, start=None, end=None, step=1, out_shapes=()):
    """self[..., j, ...] -> out0[..., (j - start) / step, ...] where j is one of the slice's positions."""
    d = _dim(dim, len(self.shape))
    size, n = self.shape[d], out_shapes[0][d]
    start = 0 if start is None else start
    start = max(0, min(size, start + size if start < 0 else start))
    iv = list(out_vars(self.shape))
    j = iv[d]
    when = and_(ge(j, start), lt(j, start + (n - 1) * step + 1))
    if step != 1:
        when = and_(when, eq(mod(j - start, step), 0))
    iv[d] = (j - start) // step if step != 1 else j - start
    return {self.name: Mapping(tuple(self.shape), (Piece("out0", tuple(iv), when), Piece(None, (), TRUE)),
                               {"out0": tuple(out_shapes[0])})}


def _forward_select(self, dim, index, out_shapes):
    """self[..., index, ...] -> out0[...] (dim `dim` dropped); every other element lands nowhere."""
    d = _dim(dim, len(self.shape))
    iv = list(out_vars(self.shape))
    when = eq(iv[d], index % self.shape[d])
    rest = tuple(iv[:d] + iv[d + 1:])
    return {self.name: Mapping(tuple(self.shape), (Piece("out0", rest, when), Piece(None, (), TRUE)),
                               {"out0": tuple(out_shapes[0])})}


_FORWARD = {"slice": _forward_slice, "select": _forward_select}  # ops a push form exists for only here: their
#                                                                 input is not written whole (no VTOG push edge)


def _forward_of(n: Node) -> dict[str, Mapping] | str:
    """Movement node n's push mapping per data input (input index -> out0, out1, ...), or why none."""
    name = base_name(packet_name(n.target) or "")
    shapes = [o.shape for o in n.outputs]
    try:
        if name in _FORWARD:
            return _FORWARD[name](out_shapes=[tuple(s) for s in shapes], **movement.bind(n.target, n.args, n.kwargs))
        maps = movement.push(n.target, n.args, n.kwargs, shapes)
    except (NotImplementedError, ValueError, IndexError, TypeError, KeyError) as e:
        return f"the push form of {n.op} failed: {type(e).__name__}: {e}"
    return maps or f"{n.op} has no push form"


def forward(low, value: str) -> tuple[str, Mapping] | str:
    """(root, mapping) for `value`, physical or virtual over one physical `root` by a chain of movement ops:
    over root's index, where each element of root lands in `value` (a piece into `value`, or nowhere: a
    piece without source).  Why not, as a string, when the chain has an op without a push form."""
    v = low.values[value]
    if not low.plan.is_virtual(value):
        return value, identity(value, v.shape)
    m = low.plan.mappings[value]
    if len(m.pieces) != 1 or m.pieces[0].source is None or m.index_tensors:
        return f"%{value} is read through a mapping with {len(m.sources)} sources or index tensors"
    root = m.pieces[0].source
    path: list[tuple[Node, str, int]] = []  # (movement node, its input on the path, its output on the path)
    cur = value
    while cur != root:
        n = low.producer[cur]
        if n.kind != "movement" or n.name in low.plan.kept or n.name in low.plan.pushed:
            return f"%{cur} is not a virtual movement op's output"
        on = [x.name for x in n.inputs if x.name == root or root in low.plan.mappings.get(x.name, _NONE).sources]
        if len(set(on)) != 1:
            return f"{n.op} reads %{root} through {len(set(on))} inputs"
        if low.values[cur].dtype != v.dtype:
            return f"{n.op} changes the dtype"
        path.append((n, on[0], [o.name for o in n.outputs].index(cur)))
        cur = on[0]
    if low.values[root].dtype != v.dtype:
        return f"the chain from %{root} changes the dtype"
    fwd = identity(root, low.values[root].shape)
    for n, x, k in reversed(path):
        maps = _forward_of(n)
        if isinstance(maps, str):
            return maps
        if x not in maps:
            return f"{n.op} has no push form for %{x}"
        fm = maps[x]
        out = n.outputs[k]
        pieces = tuple(Piece(out.name, p.index, p.when) if p.source == f"out{k}" else Piece(None, (), p.when)
                       for p in fm.pieces)
        fwd = compose(fwd, {x: Mapping(fm.shape, pieces, {out.name: tuple(out.shape)}, fm.index_tensors, fm.checks)})
    if fwd.used_sources() != [value]:
        return f"the push form of the chain from %{root} lands in {fwd.used_sources()}, not %{value}"
    return root, fwd


_NONE = Mapping((), (Piece(None, (), TRUE),), {})


def pushed_bytes(low, n: Node) -> list[int]:
    """Per write of a cat / scatter whose output must be in memory (pushed by the plan, or a graph output) that
    takes GEMM node n's result, directly or through a chain with a push form: its bytes.  A generated GEMM
    stores them in place; after torch's GEMM a copy kernel puts them there (``vtc.codegen.gemm.choose``).
    The writes of the whole lowering are walked once (the plan does not change while it lowers) and kept on
    it by the value they come from: one walk instead of one per GEMM (596 ``forward`` calls for a 4-layer
    Llama, half of its lowering)."""
    if not ENABLED:
        return []
    by_root = getattr(low, "_pushed_bytes", None)
    if by_root is None:
        by_root = low._pushed_bytes = _pushed_bytes_by_root(low)
    return list(by_root.get(n.outputs[0].name, ()))


def _pushed_bytes_by_root(low) -> dict[str, list[int]]:
    from vtc.codegen.push import push_writes

    out: dict[str, list[int]] = {}
    for node in low.graph.nodes:
        if node.kind != "movement" or not (node.name in low.plan.pushed or node.outputs[0].name in low.outputs):
            continue
        writes = push_writes(node)
        if isinstance(writes, str):
            continue
        for w in writes:
            found = None if w.base else forward(low, w.value)
            if found is not None and not isinstance(found, str):
                out.setdefault(found[0], []).append(low.values[w.value].nbytes)
    return out


def _landing(m: Mapping, source: str) -> tuple[tuple[Expr, ...], Expr] | None:
    """(index, predicate) of the one piece of m into `source`: where the element lands, and when
    (m's first piece that holds decides); None when no single piece goes there."""
    hits = [k for k, p in enumerate(m.pieces) if p.source == source]
    if len(hits) != 1:
        return None
    when = m.pieces[hits[0]].when
    for p in m.pieces[:hits[0]]:
        when = and_(not_(p.when), when)
    return m.pieces[hits[0]].index, when


# -- stores of a GEMM kernel -----------------------------------------------------------------------
def stores_pushed(n: Node) -> bool:
    """True when the generated GEMM of node n can store into pushed outputs: float32 kernels and float16 ones (their
    float32 sums rounded into each output; a bf16 one, vtc.codegen.gemm_bf16, stores only its own result)."""
    return n.outputs[0].dtype in (torch.float32, torch.float16)


def gemm_store(low, k: Kernel, y: Buffer, fwd: Mapping, value: str, write: Mapping) -> Store | str:
    """GEMM kernel k's store of its result into pushed output `y`: root -> `value` (fwd) -> y (`write`, the
    pushed op's push mapping of `value`), at the GEMM's own index (its first store's); or why it cannot."""
    if k.gemm.dtype != torch.float32:  # (a float16 GEMM's sums are float32)
        return f"a {k.gemm.dtype} GEMM stores only its own result"
    return pushed_store(low, k.stores[0], y, fwd, value, write)


def pushed_store(low, st: Store, y: Buffer, fwd: Mapping, value: str, write: Mapping) -> Store | str:
    """Store `st` (of the root's element at st's index) redirected into pushed output `y`: root -> `value`
    (fwd) -> y (`write`, the pushed op's push mapping of `value`), with the predicate where it lands; or why
    it cannot be (also the attention kernel's, ``vtc.codegen.push.Pusher._attention_stores``)."""
    if len(write.pieces) != 1 or write.pieces[0].source != "out0":
        return "the push mapping is not one store per element"
    to_y = Mapping(write.shape, (Piece(y.name, write.pieces[0].index),), {y.name: tuple(y.shape)},
                   write.index_tensors, write.checks)
    into = compose(fwd, {value: to_y})
    land = _landing(into, y.name)
    if land is None:
        return f"%{value} lands in %{y.name} through several pieces"
    idx, when = land
    env = {f"i{j}": e for j, e in enumerate(st.index)}
    when = low._fold(subs(when, env))
    if loads(when):
        return "whether an element is stored depends on an index tensor"
    idx = tuple(low._fold(subs(e, env)) for e in idx)
    return Store(y, idx, K.cast(st.value, y.dtype), when=None if when is TRUE else when)


def in_place_layout(k: Kernel, st: Store) -> tuple[Expr, int] | None:
    """(offset of a tile's batch, row stride) where GEMM kernel k can accumulate straight into st's buffer:
    st stores every element (no predicate) at an offset that is affine in the row and column indices, with
    unit column stride, plus any function of the batch index, of the sums' dtype (a float16 GEMM's sums are
    float32, kept apart and rounded into its outputs); else None."""
    if st.when is not None or any(loads(e) for e in st.index) or st.buffer.dtype != k.gemm.dtype:
        return None
    bv, mv, nv = k.gemm.vars
    c, terms = _terms(linear_offset(st.index, st.buffer.shape))
    base, ldc, unit = lift(c), 0, False
    for atom, coef in terms.items():
        if atom.op == "var" and atom.args[0] == mv and mv:
            ldc = coef
        elif atom.op == "var" and atom.args[0] == nv:
            unit = coef == 1
        elif bv and free_vars(atom) <= {bv}:
            base = base + atom * coef
        else:
            return None
    if not (unit or k.gemm.n == 1) or (k.gemm.m > 1 and ldc < k.gemm.n):
        return None
    return base, ldc or k.gemm.n
