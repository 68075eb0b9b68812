"""Copy-while-reading: a decode attention kernel copies the KV cache it reads into the updated cache.

A decode layer updates its KV caches out of place (``index_copy`` / ``index_put``
of the new token into the input cache ``x``, giving the output cache ``y``).
Pushed (``vtc.codegen.push``), ``y`` is a fresh buffer: a copy kernel of kind
``"push"`` copies all of ``x`` into it, the kernel that computes the new token
stores its row, and the attention kernel then reads ``y`` again.  For a 1 MB
cache that is one read of ``x``, one write of ``y`` and one more read of ``y``
(from L2 at best), in two kernels.

Here the copy kernel goes and the attention kernel copies instead: per key
block, before it reads the block, it copies the block's rows of its GQA group
from ``x`` to ``y`` (skipping the rows the update lands on, which the new
token's writer stored earlier), then reads them from L1.  One read of ``x`` and
one write of ``y`` in all.

``fuse`` runs at the end of the push lowering (``Pusher.finish``), on the step
list, before in-place writes are marked.  It fuses the base copy of a pushed
scatter into an attention kernel only where that is exactly the same result:

- the base is copied by its own kernel (a graph input: ``Pusher._base_first``)
  and the op has one update, whose push mapping lands each source row on one
  row of ``y`` along one dim ``t`` (the other dims are the identity), ``t``
  being the next-to-last dim;
- ``y`` is read by one kernel, an attention kernel in the GQA decode form
  (``AttentionKernel.shared_rows``, not tiled), at (group dims, key ``r``, last
  dim): with row = ``blk * shared_rows`` the group dims depend only on the
  task's row block ``blk``, and the row blocks cover every group of ``y`` once
  (checked by evaluating them for every ``blk``); every task of a row block
  walks its share of the keys ``[0, T)`` (splits included), so every row is
  copied by exactly one task;
- every other kernel that touches ``y`` only stores into it, before the
  attention kernel; no library op, view or gather reads ``y``.

What is not fused keeps its copy kernel, with the reason in
``Pusher.copy_through`` (pushed node -> the attention kernel, or why not).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vtc.codegen import kernel_ir as K
from vtc.codegen.kernel_ir import Buffer, Store, scalars_under
from vtc.index.expr import Expr, evaluate, free_vars, lift, subs, var, walk
from vtc.index.mapping import out_vars

ENABLED = os.environ.get("VTC_DECODE_COPY", "1") != "0"  # 0: every base keeps its copy kernel (A/B runs)
MAX_UPDATE_ROWS = 64  # update rows tested per copied row (a decode step writes a few tokens)
ORDER_FIRST = os.environ.get("VTC_DECODE_COPY_FIRST", "v")  # the cache whose block is copied first (A/B runs)


@dataclass(frozen=True)
class CacheCopy:
    """Rows of `base` copied into `out` (same shape) by an attention kernel, key block by key block.

    `index` is the row's index into both over ``blk`` (the task's row block) and ``r`` (the key), with 0
    in the last dim; the copied row is the last dim.  A row ``r`` equal to `update_row` for some ``s_``
    in ``[0, updates)`` is skipped (the update's writer stored it)."""

    base: Buffer
    out: Buffer
    index: tuple[Expr, ...]
    update_row: Expr  # over s_
    updates: int
    operand: str  # "k" or "v": which of the kernel's reads it is


def fuse(pusher, steps: list) -> list:
    """`steps` with the base copies that an attention kernel can make while reading removed (see the module
    docstring); records what happened per pushed node in ``pusher.copy_through``."""
    for node, base in list(pusher._base_first.items()):
        why = _fuse_one(pusher, steps, node, base) if ENABLED else "VTC_DECODE_COPY=0"
        if isinstance(why, str):
            pusher.copy_through[node] = f"its own kernel ({why})"
            continue
        at, copy = why
        pusher.copy_through[node] = f"by {steps[at][1].kernel.name} while it reads the rows"
        steps = [s for s in steps if s[1] is not copy]
    return steps


def _fuse_one(pusher, steps: list, node: str, base: str):
    """(position of the attention step, the base copy step it replaces), or why not."""
    low = pusher.low
    copy = pusher._base_steps.get(node)
    if copy is None or not any(s[1] is copy for s in steps):
        return "no base copy kernel"
    n = pusher._names[node]
    y = n.outputs[0]
    updates = [w for w in pusher.writes[node] if not w.base]
    x = low.values[base]
    if len(updates) != 1 or tuple(x.shape) != tuple(y.shape) or x.dtype != y.dtype or len(y.shape) < 2:
        return "not one update of a base of the output's shape and dtype"
    attn_at = None
    for at, (kind, s) in enumerate(steps):
        if kind == "kernel":
            k = s.kernel
            reads = any(b.name == y.name for b in k.inputs)
            if k.kind == "attention" and reads:
                if attn_at is not None:
                    return f"%{y.name} is read by two attention kernels"
                attn_at = at
            elif reads:
                return f"kernel {k.name} reads %{y.name}"
            elif attn_at is not None and any(st.buffer.name == y.name for st in k.stores):
                return f"kernel {k.name} writes %{y.name} after the attention kernel"
        elif kind == "run" and any(v.name == y.name for v in s.inputs):
            return f"{s.name} reads %{y.name}"
        elif kind == "view" and y.name in _sources(low, s):
            return f"the view %{s} reads %{y.name}"
        elif kind not in ("run", "view") and y.name in repr(s):
            return f"a {kind} step reads %{y.name}"
    if attn_at is None:
        return f"no attention kernel reads %{y.name}"
    k = steps[attn_at][1].kernel
    if k.tiled or not k.shared_rows:
        return f"{k.name} is not in the GQA decode form"
    found = _read_index(k, y.name)
    if isinstance(found, str):
        return found
    found, operand = found
    if (y.shape[-2], y.shape[-1]) != (k.r_extent, k.head_dim if operand == "k" else k.value_dim):
        return f"{k.name} reads {k.r_extent} keys of {y.shape[-2]} (a slice of the cache), or part of a row"
    index = _group_index(k, y.shape, found)
    if isinstance(index, str):
        return index
    row = _update_row(low, updates[0], y.shape)
    if isinstance(row, str):
        return row
    update_row, count = row
    k.copy_through.append(CacheCopy(Buffer(x.name, x.shape, x.dtype), Buffer(y.name, y.shape, y.dtype), index,
                                    update_row, count, operand))
    idx = out_vars(y.shape)
    k.stores.append(Store(Buffer(y.name, y.shape, y.dtype), idx, K.load(x.name, idx, x.dtype)))  # pointer writable
    low._finish(k)
    for t in (e.args[0] for e in walk(update_row) if e.op == "load"):
        if all(b.name != t for b in k.inputs):
            shape, dtype = low._index_tensor(t)
            k.inputs.append(Buffer(t, shape, dtype))
    return attn_at, copy


def _sources(low, name: str) -> set[str]:
    """The values virtual value `name` (realised by a view step) reads."""
    m = low.plan.mappings.get(name)
    return set(m.sources) | set(m.index_tensors) if m is not None else set()


def _read_index(k, y: str):
    """The index by which attention kernel k reads y (its K or V), with the key var ``r`` in the next-to-last
    dim and the head / value dim var last, or why not."""
    for root, last in ((k.k, "d"), (k.v, "e")):
        idx = {s.args[1] for s in scalars_under([root]) if s.op == "load" and s.args[0] == y}
        if not idx:
            continue
        if len(idx) > 1:
            return f"{k.name} reads %{y} at {len(idx)} indices"
        (idx,) = idx
        if not (_is_axis(idx[-1], last, k.head_dim if last == "d" else k.value_dim) and _is_axis(idx[-2], "r", k.r_extent)):
            return f"{k.name} reads %{y} at {idx}, not (.., key, {last})"
        if any({"r", last} & free_vars(e) for e in idx[:-2]):
            return f"{k.name} reads %{y} at {idx}: a group dim depends on the key"
        other = k.v if root is k.k else k.k
        if any(s.op == "load" and s.args[0] == y for s in scalars_under([other])):
            return f"{k.name} reads %{y} as K and as V"
        return idx, "k" if root is k.k else "v"
    return f"{k.name} does not read %{y} as K or V"


def _is_var(e: Expr, name: str) -> bool:
    return e.op == "var" and e.args[0] == name


def _is_axis(e: Expr, name: str, extent: int) -> bool:
    """e is variable `name`, or 0 where its extent is 1 (the index algebra folds such a variable away)."""
    return _is_var(e, name) or extent == 1 and e.op == "const" and e.args[0] == 0


def _group_index(k, shape, idx):
    """The read index with the row at the start of row block ``blk`` and 0 in the last dim, when the row
    blocks cover every group of the cache once; else why not."""
    rows, per_head, rb = k.domain[0] * k.domain[1], k.domain[1], k.shared_rows
    nblk = rows // rb
    o = var("blk", nblk) * rb
    env = {"i0": o // per_head, "i1": o % per_head}
    group = tuple(subs(e, env) for e in idx[:-2])
    if any(free_vars(e) - {"blk"} for e in group):
        return f"{k.name}'s cache group {group} depends on more than its row block"
    groups = 1
    for s in shape[:-2]:
        groups *= s
    blks = torch.arange(nblk)
    vals = [evaluate(e, {"blk": blks}).expand(nblk) for e in group]
    flat = torch.zeros(nblk, dtype=torch.int64)
    for v, s in zip(vals, shape[:-2]):
        if bool(((v < 0) | (v >= s)).any()):
            return f"{k.name}'s row blocks read outside %{shape}"
        flat = flat * s + v
    if nblk != groups or flat.unique().numel() != groups:
        return f"{k.name}'s {nblk} row blocks do not cover the {groups} cache groups once"
    return (*group, var("r", k.r_extent), lift(0))


def _update_row(low, w, shape):
    """(the row the update's source row ``s_`` lands on, how many source rows), when the update lands on
    whole rows along the next-to-last dim (the other dims the identity); else why not."""
    index = w.mapping.pieces[0].index
    src = low.values[w.value].shape
    t = len(shape) - 2
    if len(index) != len(shape) or len(src) != len(shape):
        return "the update's push mapping changes the rank"
    for j, e in enumerate(index):
        if j != t and not ((_is_var(e, f"i{j}") or shape[j] == 1 and e.op == "const" and e.args[0] == 0)
                           and src[j] == shape[j]):
            return f"the update lands at {index}: dim {j} is not the identity"
    row = low._fold(subs(index[t], {f"i{t}": var("s_", src[t])}))
    if free_vars(row) - {"s_"}:
        return f"the update's row {row} depends on more than its source row"
    if src[t] > MAX_UPDATE_ROWS:
        return f"{src[t]} update rows (at most {MAX_UPDATE_ROWS})"
    return row, src[t]


def block_lines(k, em, indent: str) -> list[str]:
    """C lines (inside the attention kernel's key-block loop, ``blk``, ``r0`` and ``r1`` in scope) that copy the
    block's cache rows of every `k.copy_through` from the input cache to the output cache."""
    from vtc.codegen.cpp import storage_ctype

    lines = []
    for c in sorted(k.copy_through, key=lambda c: c.operand != ORDER_FIRST):
        t, d = storage_ctype(c.out.dtype), c.out.shape[-1]  # elements copied as they are (bf16: uint16_t)
        lines += [
            f"for (int64_t r = r0; r < r1; ++r) {{  // copy-through: cache rows into %{c.out.name} "
            "(vtc.codegen.decode_copy)",
            "  bool hit_ = false;",
            f"  for (int64_t s_ = 0; s_ < {c.updates}; ++s_) hit_ = hit_ || {em.index(c.update_row)} == r;",
            "  if (hit_) continue;  // the update's writer stored it",
            f"  {t}* __restrict dst_ = {em.ptr[c.out.name]} + {em.linear(c.out.name, c.index)};",
            f"  const {t}* __restrict src_ = {em.ptr[c.base.name]} + {em.linear(c.base.name, c.index)};",
            "  #pragma omp simd",
            f"  for (int64_t c_ = 0; c_ < {d}; ++c_) dst_[c_] = src_[c_];",
            "}",
        ]
    return [indent + line for line in lines]
