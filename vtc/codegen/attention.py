"""Attention in one kernel: QKᵀ, the score chain, online softmax and PV, reading Q, K, V through mappings.

Captured graphs show attention as ``bmm(q, kᵀ) -> [pointwise on the scores]
-> _softmax(last dim) -> bmm(p, v)``, with q, k and v reached through views,
permutes, the GQA ``repeat_kv`` (expand + reshape) and the KV-cache update,
all of which vtc makes virtual.  Run as library calls, the two bmm need their
operands in memory: the expanded K and V are copied (4x the cache for a GQA
ratio of 4) and the scores and probabilities make a round trip through memory.

This module finds the pattern on a lowering (``find_attention``) and turns it
into one kernel (``attention_kernel``, emitted by ``emit_attention``):

- **match**: a ``_softmax`` over the last dim (float32 or float16; the float32
  softmax of float16 scores cast back to float16, transformers' eager float16
  attention, as the float16 one) whose probabilities,
  through virtual movement ops only, are read by one ``bmm`` as its left
  operand and by nothing else; its input reached from exactly one ``bmm`` (the
  scores) through generated pointwise ops and virtual movement ops, none of
  which anything outside the chain reads (no graph output, no index tensor).
  ``torch.export`` decomposes ``scaled_dot_product_attention`` into this form
  plus a guard after the softmax, ``where(all scores of the row are -inf, 0,
  p)``; that guard is matched too (a fully masked row then gives 0).
  The mappings must keep rows together: the probability row a PV row reads,
  and the score row that softmax row comes from, may not depend on the key.
  Anything else (another reader of the probabilities as in H2O's column sums,
  a float64 softmax, a softmax over another dim) is left as it was, with the
  reason in ``Lowering.why_not_attention``.
- **kernel**: rows are the PV bmm's output rows (batch*head, query).  Per row
  q is read once (through its mapping, inlined producers included); per key
  the score chain runs in registers (scale, soft-cap, the mask read through
  ``Lowering.value_at``: a causal or sliding-window predicate made of aranges
  and compares costs no mask tensor), then the online softmax (running max,
  rescaled sum and output row) and the PV update.  K and V are read through
  their composed mappings, so query head h reads KV head h // group and the
  cache rows or the token just written, with no expanded copy.  The output
  row is stored at the PV bmm's output (physical, read by whatever follows).
  Three forms, by what the rows share:

  * **prefill** (``tiled``: many queries of a head or of a GQA group, K and V
    independent of the query): flash tiles of ``vtc.codegen.flash`` (the
    queries of a group's heads together as vector lanes,
    scores and PV as register-blocked micro-kernels, key blocks that a causal
    or window predicate hides skipped);
  * **GQA decode** (``shared_rows``: the query heads of a group read the same
    K and V rows): one task per group, K and V read in place where strided,
    16 scores per permute tree, register-blocked PV (``flash.shared_*``; any
    head / value dim: rows padded to whole vectors, a row's last vector read
    by a masked load);
  * otherwise blocks of ``ROW_BLOCK`` rows, dot products and PV by ``omp simd``.

  Keys go in blocks of ``KEY_BLOCK`` (``flash.decode_key_block`` for GQA
  decode).  With fewer row blocks than twice the threads (decode of a small
  batch) the keys of a row block are split across tasks (flash-decoding,
  ``SPLIT_KEYS`` keys at least each) and the partial results merged.  In every
  form a key block that an additive mask (``flash.additive_mask``: transformers'
  ``finfo.min`` masks, from ``cache_position`` or a mask input) hides from every
  row of the task is skipped at run time (``flash.hidden_block_check``; exact:
  a task with a row that saw only hidden keys runs again without skipping, or,
  keys split, the whole kernel, found at the merge).

Numerics: the result equals softmax-then-matmul up to float rounding (the
dot products use FMA); a row whose scores are all -inf gives NaN as torch
does.  A key whose probability is exactly 0 (masked, or underflowed) does not
bring a NaN or inf of its value row into the output (torch would give NaN
there): the vector forms check each key block's values and take a key-by-key
path for a block that holds one; likewise a NaN or inf in the K or V rows of
a block skipped as hidden by an additive mask (torch: NaN) stays out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vtc.codegen import decode_copy, flash
from vtc.codegen import kernel_ir as K
from vtc.codegen.kernel_ir import Buffer, Kernel, Scalar, Store, scalars_under
from vtc.index.expr import Expr, add, free_vars, var
from vtc.index.mapping import out_vars
from vtc.ir.graph import Node, Value
from vtc.virtual.movement import bind

ROW_BLOCK = 4  # output rows per task (they share K/V rows in cache)
KEY_BLOCK = 64  # keys per online-softmax step (a block of K and V stays in L1)
SPLIT_KEYS = 512  # fewest keys per split when the keys of a row block are split across threads (decode)
TILE_ROWS = 8  # queries per head from which the tiled (flash) form is used (vtc.codegen.flash)
# queries of a GQA group (its heads' queries share the tiles' lanes) from which the tiled form is used: 3
# queries x 4 heads ran 1.7x faster tiled than as decode, 2 x 4 1.7x slower (1 thread, 1024 keys)
TILE_GROUP_ROWS = 12
CHEAP_KV_OPS = ("mul", "div", "add", "sub", "neg", "_to_copy")  # recomputed per read inside the kernel
# dtypes of the matched bmm, softmax and bmm; float16: q, K and V widened at their loads, the scores rounded to
# float16 as eager's bmm and each op of the score chain round them, softmax and PV in float32 (eager: the
# probabilities rounded to float16, then a float32 sum), the output row rounded once
DTYPES = {torch.float32: "", torch.float16: "vtc_to_f16"}


class NotAttention(Exception):
    """The nodes around a softmax are not the attention pattern (the message says why)."""


@dataclass
class AttentionMatch:
    """bmm(q, kᵀ) -> chain -> _softmax -> bmm(p, v): the nodes one attention kernel computes."""

    scores: Node  # bmm(q, kᵀ)
    softmax: Node
    output: Node  # bmm(p, v)
    chain: list[Node] = field(default_factory=list)  # pointwise and virtual movement nodes in between
    guard: list[Node] = field(default_factory=list)  # SDPA's "fully masked row -> 0" after the softmax
    # what the PV bmm reads (through virtual nodes): the softmax, the guard's where or the cast to float16 of either
    probs: Value | None = None
    narrow: list[Node] = field(default_factory=list)  # the cast of float32 probabilities to float16 (_narrowing)

    @property
    def nodes(self) -> list[Node]:
        """Every node the kernel computes, in graph order."""
        return [self.scores, *self.chain, self.softmax, *self.guard, *self.narrow, self.output]

    @property
    def members(self) -> list[Node]:
        """The nodes whose kind becomes "attention" (the chain's pointwise nodes are inlined instead)."""
        return [self.scores, self.softmax, *self.guard, *self.narrow, self.output]

    def kv_operands(self) -> set[tuple[str, str]]:
        """(node, value) pairs by which the kernel reads K and V (re-read once per query row)."""
        return {(self.scores.name, self.scores.inputs[1].name), (self.output.name, self.output.inputs[1].name)}


@dataclass
class AttentionKernel(Kernel):
    """One attention kernel: per domain row (i0, i1) and key r, score -> online softmax -> PV.

    `q` is over the row and ``d`` (head dim), `k` over the row, ``r`` and ``d``,
    `score` over the row and ``r`` with ``acc("score")`` standing for q·k, `v`
    over the row, ``r`` and ``e`` (value dim).  The one store is the output row
    (its value is a placeholder: the emitter writes the normalised accumulator).
    """

    q: Scalar | None = None
    k: Scalar | None = None
    score: Scalar | None = None
    v: Scalar | None = None
    head_dim: int = 1
    value_dim: int = 1
    zero_empty_rows: bool = False  # a row whose scores are all -inf gives 0 (SDPA's guard), else NaN (softmax)
    copy_through: list = field(default_factory=list)  # caches copied while read (vtc.codegen.decode_copy)

    def roots(self) -> list[Scalar]:
        return [*super().roots(), self.q, self.k, self.score, self.v]

    def stored(self, x: str) -> str:
        """C float expression x as an element of the output (float16: rounded once)."""
        narrow = DTYPES[self.stores[0].buffer.dtype]
        return f"{narrow}({x})" if narrow else x

    @property
    def shared_rows(self) -> int:
        """Rows per block that read the same K and V rows (the query heads of a GQA group in decode), or 0.

        Found by substituting row = block * n + j into the K and V expressions: n rows share them when j
        drops out (``((4 * blk + j) // 4`` is ``blk``).  Such rows read each K and V element once per block.
        """
        rows, per_head = math.prod(self.domain), self.domain[1]
        for n in (8, 4, 2):
            if rows % n:
                continue
            o = var("blk", rows // n) * n + var("j", n)
            env = {"i0": o // per_head, "i1": o % per_head}
            if all("j" not in _scalar_vars(K.substitute(x, env, {})) for x in (self.k, self.v)):
                return n
        return 0

    @property
    def head_group(self) -> int:
        """Consecutive heads (i0) that read the same K and V rows (a GQA group), or 1: the prefill tiles
        take the queries of the group's heads together as their lanes (a short chunk fills the lanes)."""
        heads = self.domain[0]
        for n in (8, 4, 2):
            if heads % n:
                continue
            env = {"i0": var("grp", heads // n) * n + var("j", n)}
            if all("j" not in _scalar_vars(K.substitute(x, env, {})) for x in (self.k, self.v)):
                return n
        return 1

    @property
    def tiled(self) -> bool:
        """Many queries per head (or per GQA group) whose K and V do not depend on the query: tiles of
        queries as vector lanes, scores and PV as small register-blocked GEMMs (prefill, a chunk of a few
        tokens, speculative decoding; vtc.codegen.flash)."""
        rows_per_head = self.domain[1]
        return ((rows_per_head >= TILE_ROWS or rows_per_head * self.head_group >= TILE_GROUP_ROWS) and not {"i1"} & (_scalar_vars(self.k) | _scalar_vars(self.v))
                and max(self.head_dim, self.value_dim) <= flash.MAX_DIM)


def _is(n: Node | None, opname: str) -> bool:
    t = getattr(n, "target", None)
    return isinstance(t, torch._ops.OpOverload) and t.namespace == "aten" and t._opname == opname


# ---------------------------------------------------------------------------
# matching
def find_attention(low) -> tuple[dict[str, AttentionMatch], dict[str, str]]:
    """Attention patterns of `low`'s graph, keyed by their PV bmm, and why each other softmax is not one.

    Runs on a fresh lowering (kinds known, nothing inlined yet) and sets the
    kind of the matched bmm, softmax and bmm to ``"attention"``.
    """
    matches: dict[str, AttentionMatch] = {}
    why: dict[str, str] = {}
    for n in low.graph.nodes:
        if not _is(n, "_softmax"):
            continue
        try:
            m = _match(low, n)
        except NotAttention as e:
            why[n.name] = str(e)
            continue
        if any(low.kind[x.name] == "attention" for x in m.members):
            why[n.name] = "its bmm already belongs to another attention kernel"
            continue
        for x in m.members:
            low.kind[x.name] = "attention"
            low.gemm_choices.pop(x.name, None)  # its bmm are part of the attention kernel, not GEMMs
        matches[m.output.name] = m
    return matches, why


def _match(low, sm: Node) -> AttentionMatch:
    args = bind(sm.target, sm.args, sm.kwargs)
    x, p = args["self"], sm.outputs[0]
    if low.kind[sm.name] != "row":
        raise NotAttention(f"softmax runs through torch ({low.why_torch.get(sm.name, 'no generated code')})")
    if len(x.shape) < 2 or args["dim"] % len(x.shape) != len(x.shape) - 1:
        raise NotAttention(f"softmax over dim {args['dim']} of {list(x.shape)}, not the last")
    if x.dtype not in DTYPES or p.dtype != x.dtype or args.get("half_to_float"):
        raise NotAttention(f"softmax of {x.dtype} to {p.dtype}: the attention kernel is float32 or float16 only")
    guard, probs = _guard(low, sm, x)
    narrow, probs = _narrowing(low, probs)
    dtype = probs.dtype  # of the two bmm
    pv = _only_reader(low, probs)
    if not _is(pv, "bmm") or low.kind[pv.name] not in ("library", "gemm"):
        raise NotAttention(f"probabilities {probs.name} are read by {pv.name} ({pv.op}), not a bmm")
    pv_args = bind(pv.target, pv.args, pv.kwargs)
    if not _derives_from(low, pv_args["self"], probs) or _derives_from(low, pv_args["mat2"], probs):
        raise NotAttention(f"{pv.name} does not read the probabilities as its left operand only")
    qk, chain = _scores(low, x, sm, guard)
    for n in (qk, pv):
        bad = [v for v in [*n.inputs, *n.outputs] if v.dtype != dtype]
        if bad:
            raise NotAttention(f"{n.name} has {bad[0].name} of {bad[0].dtype}, its probabilities {dtype}")
    m = AttentionMatch(qk, sm, pv, chain, guard, probs, narrow)
    saved = low.inline
    low.inline = {o.name for c in chain if low.kind[c.name] == "pointwise" for o in c.outputs}
    try:
        _rows(low, m)
    finally:
        low.inline = saved
    return m


def _guard(low, sm: Node, x: Value) -> tuple[list[Node], Value]:
    """SDPA's decomposition ``where(not any(not (x == -inf), -1), full_like(p, 0), p)``: its nodes and output.

    Without that guard (any other readers of the probabilities): no nodes and the softmax output.
    """
    p = sm.outputs[0]
    users = low.users.get(p.name, [])
    where = next((u for u in users if _is(u, "where")), None)
    if where is None or len(users) > 2:
        return [], p
    a = bind(where.target, where.args, where.kwargs)
    zeros = low.producer.get(getattr(a["self"], "name", ""))
    fill = [u for u in users if u is not where]
    if (a["other"] is not p or zeros is None or fill != [zeros] or not _is(zeros, "full_like")
            or bind(zeros.target, zeros.args, zeros.kwargs)["fill_value"] != 0
            or where.outputs[0].shape != p.shape):
        return [], p
    chain = [where]
    v = a["condition"]
    for op in ("logical_not", "any", "logical_not", "eq"):  # back from the condition to x == -inf
        n = low.producer.get(getattr(v, "name", ""))
        if not _is(n, op) or len(low.users.get(v.name, [])) != 1 or v.name in low.outputs:
            return [], p
        b = bind(n.target, n.args, n.kwargs)
        if op == "any" and (b.get("dim") not in (-1, len(x.shape) - 1, [-1], [len(x.shape) - 1])
                            or not b.get("keepdim")):
            return [], p
        if op == "eq" and (b["self"] is not x or b.get("other") != float("-inf")):
            return [], p
        chain.append(n)
        v = b["self"]
    return [*reversed(chain[1:]), zeros, where], where.outputs[0]


def _narrowing(low, p: Value) -> tuple[list[Node], Value]:
    """transformers' eager float16 attention, ``softmax(scores, dtype=float32).to(float16)``: the float32
    probabilities' one reader a ``_to_copy`` to float16 (read by the PV bmm in float16).  Its node and
    output, or no nodes and p.  The kernel computes that form as the float16 softmax: eager rounds the
    probabilities to float16 either way."""
    users = low.users.get(p.name, [])
    if p.dtype != torch.float32 or len(users) != 1 or p.name in low.outputs:
        return [], p
    (cast,) = users
    out = cast.outputs[0]
    if not _is(cast, "_to_copy") or low.kind[cast.name] != "pointwise" or out.dtype != torch.float16:
        return [], p
    return [cast], out


def _only_reader(low, v: Value) -> Node:
    """The one node that reads v through virtual movement ops (it and they read nothing else of it)."""
    readers: list[Node] = []
    stack = [v]
    while stack:
        x = stack.pop()
        if x.name in low.outputs or x.name in low.index_names:
            raise NotAttention(f"{x.name} (from {v.name}) is a graph output or an index tensor")
        for u in low.users.get(x.name, []):
            if low.kind[u.name] == "virtual":
                stack.extend(u.outputs)
            elif u not in readers:
                readers.append(u)
    if len(readers) != 1:
        raise NotAttention(f"{v.name} is read by {len(readers)} nodes ({', '.join(r.name for r in readers)})")
    return readers[0]


def _derives_from(low, v: Value, src: Value) -> bool:
    """True when v is src or reached from it through virtual movement ops."""
    stack, seen = [v], set()
    while stack:
        x = stack.pop()
        if x.name == src.name:
            return True
        n = low.producer.get(x.name)
        if n is not None and low.kind[n.name] == "virtual" and n.name not in seen:
            seen.add(n.name)
            stack.extend(n.inputs)
    return False


def _scores(low, x: Value, sm: Node, guard: list[Node]) -> tuple[Node, list[Node]]:
    """The scores bmm feeding softmax input x and the pointwise / virtual nodes between them."""
    bmms: list[Node] = []
    stack, seen = [x], set()
    while stack:  # back from x to every bmm it depends on through pointwise and virtual nodes
        n = low.producer.get(stack.pop().name)
        if n is None or n.name in seen:
            continue
        seen.add(n.name)
        if _is(n, "bmm"):
            bmms.append(n)
        elif low.kind[n.name] in ("pointwise", "virtual"):
            stack.extend(n.inputs)
    if len(bmms) != 1:
        raise NotAttention(f"softmax input {x.name} comes from {len(bmms)} bmm through pointwise ops, not one")
    qk = bmms[0]
    if low.kind[qk.name] not in ("library", "gemm"):
        raise NotAttention(f"scores {qk.name} are not a plain bmm")
    chain: list[Node] = []
    stack = [qk.outputs[0]]
    while stack:  # forward: everything that reads the scores must lead to the softmax
        v = stack.pop()
        if v.name in low.outputs or v.name in low.index_names:
            raise NotAttention(f"scores {v.name} are a graph output or an index tensor")
        for u in low.users.get(v.name, []):
            if u is sm or u in chain or u in guard:
                continue
            if low.kind[u.name] not in ("pointwise", "virtual"):
                raise NotAttention(f"scores {v.name} are also read by {u.name} ({u.op})")
            chain.append(u)
            stack.extend(u.outputs)
    order = {n.name: k for k, n in enumerate(low.graph.nodes)}
    return qk, sorted(chain, key=lambda n: order[n.name])


@dataclass
class _Rows:
    """The index relations of a match: PV row (i0, i1) and key r -> softmax index j -> score index h."""

    domain: tuple[int, ...]
    r: Expr
    j: tuple[Expr, ...]  # softmax element read by PV row (i0, i1) at key r
    h: tuple[Expr, ...]  # scores element the softmax input at j reads


def _rows(low, m: AttentionMatch) -> _Rows:
    """Checks that the mappings keep rows together and returns the index relations."""
    pv_p, pv_v = m.output.inputs[0], bind(m.output.target, m.output.args, m.output.kwargs)["mat2"]
    b, rows, n = pv_p.shape
    if pv_v.shape[1] != n or m.softmax.outputs[0].shape[-1] != n:
        raise NotAttention(f"{m.output.name}: {n} keys in the probabilities, value {list(pv_v.shape)}, "
                           f"softmax {list(m.softmax.outputs[0].shape)}")
    i0, i1 = out_vars((b, rows))
    r = var("r", n)
    memo: dict = {}
    p = low.value_at(pv_p.name, (i0, i1, r), memo)
    if p.op != "load" or p.args[0] != m.probs.name:
        raise NotAttention(f"{m.output.name} reads the probabilities through a mapping of several pieces")
    j = p.args[1]
    if j[-1] is not r or any("r" in free_vars(e) for e in j[:-1]):
        raise NotAttention(f"a row of {m.output.name} reads probabilities across softmax rows ({j})")
    score = low.value_at(m.softmax.inputs[0].name, j, memo)
    reads = {s for s in scalars_under([score]) if s.op == "load" and s.args[0] == m.scores.outputs[0].name}
    if len(reads) != 1:
        raise NotAttention(f"the score chain reads {m.scores.outputs[0].name} at {len(reads)} indices")
    h = next(iter(reads)).args[1]
    if h[2] is not r or any("r" in free_vars(e) for e in h[:2]):
        raise NotAttention(f"a softmax row reads scores across rows of {m.scores.name} ({h})")
    return _Rows((b, rows), r, j, h)


def _scalar_vars(root: Scalar) -> set[str]:
    """The index variables a scalar expression reads (in its loads, index ramps and piece choices)."""
    out: set[str] = set()
    for s in scalars_under([root]):
        if s.op == "load":
            for e in s.args[1]:
                out |= free_vars(e)
        elif s.op in ("iota", "pick"):
            out |= free_vars(s.args[0])
    return out


def _replace(s: Scalar, old: Scalar, new: Scalar, memo: dict) -> Scalar:
    """s with every occurrence of `old` replaced by `new`."""
    if s is old:
        return new
    hit = memo.get(id(s))
    if hit is not None:
        return hit
    args = tuple(_replace(a, old, new, memo) if isinstance(a, Scalar) else a for a in s.args)
    out = s if all(a is b for a, b in zip(args, s.args)) else Scalar.make(s.op, args, s.dtype)
    memo[id(s)] = out
    return out


def is_cheap(n: Node) -> bool:
    """A pointwise op worth recomputing at every K/V read of an attention kernel (a scale or a cast)."""
    big = [v for v in n.inputs if v.numel > 1]
    return getattr(n.target, "_opname", None) in CHEAP_KV_OPS and len(big) <= 1


# ---------------------------------------------------------------------------
# the kernel
def attention_kernel(low, m: AttentionMatch) -> AttentionKernel:
    """The kernel IR of match m on a decided lowering (inlined producers are read inline)."""
    rows = _rows(low, m)
    qk, pv = bind(m.scores.target, m.scores.args, m.scores.kwargs), bind(m.output.target, m.output.args, m.output.kwargs)
    d_ext, e_ext = qk["self"].shape[2], pv["mat2"].shape[2]
    i0, i1 = out_vars(rows.domain)
    d, e, r = var("d", d_ext), var("e", e_ext), rows.r
    memo: dict = {}
    scores = m.scores.outputs[0]
    raw = K.load(scores.name, rows.h, scores.dtype)
    dot = K.cast(K.acc("score", torch.float32), scores.dtype)  # float16: rounded as eager's bmm result
    score = _replace(low.value_at(m.softmax.inputs[0].name, rows.j, memo), raw, dot, {})
    score = K.cast(score, torch.float32)
    h0, h1 = rows.h[0], rows.h[1]
    q = K.cast(low.value_at(qk["self"].name, (h0, h1, d), memo), torch.float32)
    k = K.cast(low.value_at(qk["mat2"].name, (h0, d, r), memo), torch.float32)
    v = K.cast(low.value_at(pv["mat2"].name, (i0, r, e), memo), torch.float32)
    out = pv_out = m.output.outputs[0]
    store = Store(Buffer(out.name, pv_out.shape, out.dtype), (i0, i1, e), K.acc("out", torch.float32))
    kern = AttentionKernel(f"k_attn_{_ident(m.output.name)}", "attention", rows.domain, pv["self"].shape[2], [],
                           [store], source_nodes=[x.name for x in m.nodes], q=q, k=k, score=score, v=v,
                           head_dim=d_ext, value_dim=e_ext, zero_empty_rows=bool(m.guard))
    return low._finish(kern)


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


# ---------------------------------------------------------------------------
# C++
def emit_attention(k: AttentionKernel, em) -> list[str]:
    """The body of an attention kernel (after the buffer pointers), using the C++ emitter `em`.

    Prefill (``k.tiled``): the flash form of ``vtc.codegen.flash``.  Else per
    task a block of rows; per key block: the scores of every (key, row) (rows
    innermost, so the rows of a GQA group read each K row while it is in L1),
    then per row the online-softmax update, then the PV update of every (key,
    row).
    """
    from vtc.codegen.cpp import PARALLEL_MIN_WORK, _decompose, ctype

    rows, n, dd, ee = math.prod(k.domain), k.r_extent, k.head_dim, k.value_dim
    if k.tiled:
        # the score chain's terms that read a buffer but not the key (the mask's cache_position[query]):
        # computed once per tile into a lane array (flash.emit_tiled), not gathered again for every key
        em.forget()
        lane = em.invariant_terms([k.score], {"r"}, loads_only=True) if flash.LANE_TERMS else []
        fill = []
        for j, x in enumerate(lane):
            em.forget()
            fill += [*em.hoist([x], "      "), f"      lq{j}[q] = {em.scalar(x)};"]
        decls = [f"alignas(64) {ctype(x.dtype)} lq{j}[{flash.QUERY_TILE}];" for j, x in enumerate(lane)]
        # its float loads along the key with unit stride (a relative-position bias, a window mask): staged per
        # key block into key x query tiles by transposes (flash.KEY_ROWS), each lane's row base computed here
        em.forget()
        rows = flash.key_row_loads(k.score, em) if flash.KEY_ROWS else []
        types = []  # of the row bases: 32-bit where the buffer allows (a gather of 16 lanes, not 8)
        around: tuple[list[str], list[str]] = ([], [])  # a strided buffer transposed once per call
        ptrs, strides = [], []
        served = math.prod(k.domain) * k.r_extent  # floats that a row load reads per call
        for j, (x, base, c) in enumerate(rows):
            size = math.prod(em.shapes[x.args[0]])
            types.append("int" if size < 1 << 31 else "int64_t")
            decls.append(f"alignas(64) {types[-1]} lk{j}[{flash.QUERY_TILE}];")
            ptr = em.ptr[x.args[0]]
            if flash.KEY_ROWS_T and c > 1 and isinstance(size, int) and isinstance(served, int) and 2 * size <= served:
                pre, post = flash.transposed_rows(ptr, c, size, f"kx{j}_")
                around = (around[0] + pre, post + around[1])
                fill.append(f"      lk{j}[q] = (({base}) % {c}) * {-(-size // c)} + ({base}) / {c};")
                ptr, c = f"kx{j}_", 1
            else:
                fill.append(f"      lk{j}[q] = {base};")
            ptrs.append(ptr)
            strides.append(c)
        lanes = (decls, fill)

        def forget(per_lane: bool) -> None:
            em.forget()
            if per_lane:
                em.temps.update({id(x): f"lq{j}[q]" for j, x in enumerate(lane)})
                em.temps.update({id(x): f"kt{j}[t][q]" for j, (x, _, _) in enumerate(rows)})

        q_pieces = []
        for lo, hi in flash.head_dim_pieces(k.q, k.head_dim):
            em.forget()
            q = K.substitute(k.q, {"d": add(var("d", hi - lo), lo)}, {}) if (lo, hi) != (0, k.head_dim) else k.q
            q_pieces.append((lo, hi, em.hoist([q], "          ", within_temps=False), em.scalar(q)))
        parts = [(k.k, "            "), (k.score, "          "), (k.v, "            ")]
        texts = []
        for root, indent in parts:
            forget(root is k.score)
            texts += [em.hoist([root], indent, within_temps=False), em.scalar(root)]
        mask = flash.additive_mask(k.score)
        if mask is not None:
            forget(True)
            mask = (em.hoist([mask], "      ", within_temps=False), em.scalar(mask))
        term, bounded = flash.bounded_term(k.score), None
        if term is not None:  # the score's term x at the dot product's bound b_ (flash.bounded_block_check)
            em.forget()
            em.temps.update({id(x): "b_" for x in scalars_under([term]) if x.op == "acc"})
            bounded = (em.hoist([term], "      ", within_temps=False), em.scalar(term))
        em.forget()
        key_rows = list(zip(ptrs, strides, types))
        return flash.emit_tiled(k, em, q_pieces, *texts, mask=mask, lanes=lanes, key_rows=key_rows, around=around,
                                bounded=bounded)
    shared = k.shared_rows
    # the key block does not shrink with a short row (its loops stop at the last key): the same kernel text,
    # sizes aside, for every key count, so that it can take them as arguments (vtc.runtime.generic)
    rb, kb = shared or min(ROW_BLOCK, rows), KEY_BLOCK
    # the GQA group's rows: micro-kernels of vtc.codegen.flash
    kb = flash.decode_key_block(k) if shared else kb
    dp = -(-dd // flash.LANES) * flash.LANES if shared else dd  # head dim padded to whole vectors
    ep = -(-ee // flash.LANES) * flash.LANES if shared else ee  # value dim padded to whole vectors
    # blocks, as a ceiling division in C, so that the sizes stay polynomial literals (vtc.runtime.generic
    # makes them kernel arguments)
    nblk = f"(({rows} + {rb - 1}) / {rb})"
    names = [f"i{x}" for x in range(len(k.domain))]
    out = k.stores[0]
    work = rows * n * (dd + ee)

    def body(root: Scalar, indent: str) -> tuple[list[str], str]:
        em.forget()
        return em.hoist([root], indent), em.scalar(root)

    def row(indent: str) -> list[str]:
        return [f"{indent}const int64_t o = o_lo + rr;", *_decompose(names, k.domain, "o", indent)]

    pre_q, q = body(k.q, "        ")
    pre_k, kx = body(k.k, "            ")
    pre_s, sx = body(k.score, "          ")
    pre_v, vx = body(k.v, "            ")
    mask = flash.additive_mask(k.score)
    pre_m, mx_expr = body(mask, "") if mask is not None else ([], "")
    em.forget()
    store = (f"{em.ptr[out.buffer.name]}[{em.linear(out.buffer.name, out.index)}]")
    inv = ("mx_ == -INFINITY ? 0.0f : 1.0f / sm_" if k.zero_empty_rows else "1.0f / sm_")
    lines = [
        # flash-decoding: fewer row blocks than twice the threads split their keys (each split >= SPLIT_KEYS,
        # whole key blocks); the splits' partial results are merged after the loop
        f"  const int64_t nsplit = {work} < {PARALLEL_MIN_WORK} ? 1 : std::max<int64_t>(1, std::min<int64_t>("
        f"(2 * nthreads + {nblk} - 1) / {nblk}, {n} / {SPLIT_KEYS}));",
        f"  const int64_t span = (({n} + nsplit - 1) / nsplit + {kb - 1}) / {kb} * {kb};",
        f"  float* part_ = nsplit > 1 ? (float*)std::malloc(sizeof(float) * {nblk} * nsplit * {rb} * {ep + 2}) : nullptr;",
        f"  #pragma omp parallel for num_threads(nthreads) schedule(static) if({work} >= {PARALLEL_MIN_WORK})",
        f"  for (int64_t task = 0; task < {nblk} * nsplit; ++task) {{",
        "    const int64_t blk = task / nsplit, r_lo = task % nsplit * span;",
        f"    const int64_t r_hi = std::min<int64_t>({n}, r_lo + span);",
        f"    const int64_t o_lo = blk * {rb}, nr = std::min<int64_t>({rb}, {rows} - o_lo);",
        f"    alignas(64) float qv[{rb}][{dp}] = {{}};",
        f"    alignas(64) float ov[{rb}][{ep}];",
        f"    alignas(64) float sc[{rb}][{kb}];",
        f"    float mx[{rb}], sm[{rb}];",
        # an additive mask hiding whole key blocks from every row: those are skipped (flash.hidden_block_check)
        *(["    for (bool skip_ok = allow_skip_;; skip_ok = false) {  // again without skipping: a row saw only "
           "hidden keys", "    bool skipped = false;"] if mask else []),
        "    for (int64_t rr = 0; rr < nr; ++rr) {", *row("      "),
        "      #pragma omp simd", f"      for (int64_t d = 0; d < {dd}; ++d) {{", *pre_q, f"        qv[rr][d] = {q};", "      }",
        f"      for (int64_t e = 0; e < {ep}; ++e) ov[rr][e] = 0.0f;",
        "      mx[rr] = -INFINITY; sm[rr] = 0.0f;",
        "    }",
        f"    for (int64_t r0 = r_lo; r0 < r_hi; r0 += {kb}) {{",
        f"      const int64_t r1 = std::min<int64_t>(r0 + {kb}, r_hi);",
        *decode_copy.block_lines(k, em, "      "),  # before a hidden block is skipped: every row is copied
        *(flash.hidden_block_check(pre_m, mx_expr, ["for (int64_t rr = 0; rr < nr && !seen; ++rr) {", *row("")],
                                   ["for (int64_t r = r0; r < r1; ++r) {"], "      ") if mask else []),
        *(flash.shared_scores(k, em, row, rb, pre_k, kx, pre_s, sx) if shared else [
            # scores of every (key, row) of the block
            "      for (int64_t r = r0; r < r1; ++r) {",
            "        for (int64_t rr = 0; rr < nr; ++rr) {", *row("          "),
            "          float acc_score = 0.0f;",
            "          #pragma omp simd reduction(+:acc_score)",
            f"          for (int64_t d = 0; d < {dd}; ++d) {{", *pre_k, f"            acc_score += qv[rr][d] * {kx};",
            "          }",
            *pre_s, f"          sc[rr][r - r0] = {sx};",
            "        }",
            "      }"]),
        # per row: block max (with a NaN flag, vectorisable), rescale, probabilities
        *(flash.shared_softmax(ep) if shared else [
        "      for (int64_t rr = 0; rr < nr; ++rr) {",
        "        float* __restrict srow = sc[rr];",
        "        float bmax = -INFINITY; bool bnan = false;",
        "        #pragma omp simd reduction(max:bmax) reduction(||:bnan)",
        "        for (int64_t t = 0; t < r1 - r0; ++t) { const float s_ = srow[t]; bmax = s_ > bmax ? s_ : bmax; "
        "bnan = bnan || (s_ != s_); }",
        "        const float mnew = bnan ? NAN : vtc_max(mx[rr], bmax);",
        "        if (mnew == -INFINITY) {  // every score so far is -inf: nothing to add yet",
        "          for (int64_t t = 0; t < r1 - r0; ++t) srow[t] = 0.0f;",
        "          continue;",
        "        }",
        "        const float corr = vtc_exp(mx[rr] - mnew);",
        "        mx[rr] = mnew;",
        "        float psum = 0.0f;",
        "        #pragma omp simd reduction(+:psum)",
        "        for (int64_t t = 0; t < r1 - r0; ++t) { const float p_ = vtc_exp(srow[t] - mnew); srow[t] = p_; psum += p_; }",
        "        sm[rr] = sm[rr] * corr + psum;",
        "        if (corr != 1.0f) {",
        "          #pragma omp simd",
        f"          for (int64_t e = 0; e < {ee}; ++e) ov[rr][e] *= corr;",
        "        }",
        "      }"]),
        # PV of every (key, row) of the block
        *(flash.shared_pv(k, em, row, rb, pre_v, vx) if shared else [
            "      for (int64_t r = r0; r < r1; ++r) {",
            "        for (int64_t rr = 0; rr < nr; ++rr) {",
            "          const float p_ = sc[rr][r - r0];",
            "          if (p_ == 0.0f) continue;  // masked or underflowed key: its value row is not read",
            *row("          "),
            "          #pragma omp simd",
            f"          for (int64_t e = 0; e < {ee}; ++e) {{", *pre_v, f"            ov[rr][e] += p_ * {vx};",
            "          }",
            "        }",
            "      }"]),
        "    }",
        *(["    if (!skipped) break;",
           "    if (nsplit > 1) { __atomic_store_n(&skipped_any_, 1, __ATOMIC_RELAXED); break; }  // decided at the merge",
           f"    bool safe = true;  // every row's max above {flash.SAFE_MAX}: the skipped keys' probabilities are 0",
           f"    for (int64_t rr = 0; rr < nr; ++rr) safe = safe && !(mx[rr] <= {flash.SAFE_MAX});",
           "    if (safe) break;",
           "    }"] if mask else []),
        "    if (nsplit > 1) {  // this split's running max, sum and output rows, merged below",
        f"      float* pp = part_ + task * {rb} * {ep + 2};",
        "      for (int64_t rr = 0; rr < nr; ++rr) {",
        f"        pp[rr * {ep + 2}] = mx[rr]; pp[rr * {ep + 2} + 1] = sm[rr];",
        f"        for (int64_t e = 0; e < {ep}; ++e) pp[rr * {ep + 2} + 2 + e] = ov[rr][e];",
        "      }",
        "      continue;",
        "    }",
        "    for (int64_t rr = 0; rr < nr; ++rr) {", *row("      "),
        "      const float mx_ = mx[rr], sm_ = sm[rr];",
        f"      const float inv = {inv};",
        "      #pragma omp simd",
        f"      for (int64_t e = 0; e < {ee}; ++e) {store} = {k.stored('ov[rr][e] * inv')};",
        "    }",
        "  }",
        "  if (nsplit > 1) {",
        "    #pragma omp parallel for num_threads(nthreads) schedule(static)",
        f"    for (int64_t row_ = 0; row_ < {rows}; ++row_) {{",
        f"      const int64_t blk = row_ / {rb}, rr = row_ % {rb}, o_lo = blk * {rb};", *row("      "),
        f"      const float* pp = part_ + (blk * nsplit * {rb} + rr) * {ep + 2};",
        "      float mx_ = -INFINITY;",
        f"      for (int64_t sp = 0; sp < nsplit; ++sp) mx_ = vtc_max(mx_, pp[sp * {rb} * {ep + 2}]);",
        *([f"      if (skipped_any_ && mx_ <= {flash.SAFE_MAX}) __atomic_store_n(&redo_, 1, __ATOMIC_RELAXED);"]
          if mask else []),
        f"      alignas(64) float acc_[{ep}] = {{}};",
        "      float sm_ = 0.0f;",
        "      for (int64_t sp = 0; sp < nsplit; ++sp) {",
        f"        const float* ps = pp + sp * {rb} * {ep + 2};",
        "        const float w = ps[0] == -INFINITY ? 0.0f : vtc_exp(ps[0] - mx_);  // an empty split adds nothing",
        "        sm_ += w * ps[1];",
        "        #pragma omp simd",
        f"        for (int64_t e = 0; e < {ep}; ++e) acc_[e] += w * ps[2 + e];",
        "      }",
        f"      const float inv = {inv};",
        "      #pragma omp simd",
        f"      for (int64_t e = 0; e < {ee}; ++e) {store} = {k.stored('acc_[e] * inv')};",
        "    }",
        "    std::free(part_);",
        "  }",
    ]
    if not mask:
        return lines
    # a row of a split task that saw only hidden keys is found at the merge: then the kernel runs again
    # without skipping
    return ["  int skipped_any_ = 0, redo_ = 0;",
            "  for (int pass_ = 0; pass_ < 2; ++pass_) {",
            "  const bool allow_skip_ = pass_ == 0;",
            *lines,
            "  if (!redo_) break;",
            "  }"]

