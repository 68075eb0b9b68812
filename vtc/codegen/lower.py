"""Lowering a planned graph to generated kernels and framework calls.

Every value ends up in one of these states:

- **physical**: inputs, parameters, outputs of library nodes (GEMM, conv,
  fallbacks, anything without a code-generator definition), outputs of kernels;
- **virtual**: a movement op's output (from the plan), read through its
  composed mapping by every kernel that needs it;
- **inline**: a pointwise value computed inside the one kernel that reads it
  (producer-consumer fusion), never stored.

A value is read by *readers*: kernels, library nodes, the graph's outputs.  A
pointwise value is inlined when exactly one kernel reads it (through any chain
of virtual tensors and other inlined values), or when it loads nothing (a
constant or an index ramp, free to recompute).  A virtual value that a library
node or the graph output needs is *realised*: as a zero-copy strided view when
its mapping is one (``plan.realized[..].strided``), else by a copy kernel that
reads through the mapping (and inlines its single-use producers).

Attention (bmm -> pointwise on the scores -> softmax -> bmm, see
``vtc.codegen.attention``) is one kernel of kind ``"attention"``: its nodes get
that kind, its score chain is inlined, and its Q, K and V are read through
their mappings (a producer of K or V is inlined only when it is a scale or a
cast, since the kernel reads K and V once per query row).

A movement op the plan keeps physical (all of them with ``plan="none"``) runs
as its own copy kernel ("move") through its pull mapping when it has one and
its inputs are physical; otherwise through torch, with the reason in
``why_torch``.

``lower(graph, plan)`` returns the steps in graph order; every decision that
keeps something physical is visible in the kernels' ``source_nodes`` and in the
report.
"""
from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import torch

from vtc.codegen import kernel_ir as K
from vtc.codegen.attention import attention_kernel, find_attention, is_cheap
from vtc.codegen.conv import CONV_OP, choose_conv, conv_kernel, is_depthwise
from vtc.codegen.gemm import GEMM_OPS, SKINNY_M, GemmChoice, _operands, choose, gemm_kernel
from vtc.codegen.gemm_inline import a_passes, behind_virtual_movement
from vtc.codegen.kernel_ir import Buffer, Kernel, Reduction, Scalar, Store, scalars_under
from vtc.codegen.push import READER, Pusher
from vtc.codegen.ops import C_TYPES, LOW_PRECISION, POINTWISE, ROW, NotSupported, lookup, reduced_index
from vtc.codegen.pool import POOL_OPS, pool_taps
from vtc.codegen.vecmath import LOW_PRECISION_PRELUDE
from vtc.index.expr import Expr, clamp, const, replace_loads, subs, walk
from vtc.index.mapping import IndexCheck, Mapping, Piece, out_vars
from vtc.ir.graph import Graph, Node, Value
from vtc.plan.virtualize import Plan, Realization, chain_of
from vtc.virtual.movement import bind, delinearize, linear_index

OUTPUT, INDEX = "<output>", "<index>"
KV = "#kv"  # reader suffix: an attention kernel reading K or V (once per query row, so producers stay physical)


@dataclass
class KernelStep:
    """A generated kernel with the range checks and derived index tensors it needs first."""

    kernel: Kernel
    checks: list[IndexCheck] = field(default_factory=list)
    derived: list[Mapping] = field(default_factory=list)  # mappings whose derived index tensors to compute


def broadcast_index(idx: tuple[Expr, ...], out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> tuple[Expr, ...]:
    """The index into an operand of `in_shape` broadcast against `out_shape` (right-aligned)."""
    lead = len(out_shape) - len(in_shape)
    if lead < 0:
        raise NotSupported(f"operand of shape {in_shape} is larger than the output {out_shape}")
    return tuple(const(0) if s == 1 else idx[lead + k] for k, s in enumerate(in_shape))


class Lowering:
    """Decides physical / virtual / inline for every value and builds the kernels."""

    def __init__(self, graph: Graph, plan: Plan, gemm: str = "auto") -> None:
        self.graph, self.plan, self.gemm_mode = graph, plan, gemm
        self.values: dict[str, Value] = {v.name: v for v in graph.values()}
        self.producer: dict[str, Node] = {o.name: n for n in graph.nodes for o in n.outputs}
        self._nodes: dict[str, Node] = {n.name: n for n in graph.nodes}
        self.users = graph.users()
        self.outputs = {v.name for v in graph.outputs}
        self.why_torch: dict[str, str] = {}  # node -> why a known op still runs through torch
        self.defects: dict[str, str] = {}  # node -> the error its definition raised (it runs through torch)
        self.gemm_choices: dict[str, GemmChoice] = {}  # GEMM node -> generated kernel or torch, with both costs
        self.kind = {n.name: self._classify(n) for n in graph.nodes}
        self.folded = self._foldable_index_tensors()
        self.index_names = {t for m in plan.mappings.values() for t in m.index_tensors} - self.folded
        self.inline: set[str] = set()
        self.push = Pusher(self)  # ops removed on the write side: who stores each input into their output
        # bmm -> softmax -> bmm fused into one kernel (kind "attention"), keyed by the PV bmm; why not, per softmax
        self.attention, self.why_not_attention = find_attention(self) if gemm != "torch" else ({}, {})
        self._kv_reads = {rv for m in self.attention.values() for rv in m.kv_operands()}
        self._attention_member = {x.name: m.output.name for m in self.attention.values() for x in m.members}
        self.realize: dict[str, str] = {}  # virtual value -> "view" | "copy"
        self.move_mappings: dict[str, Mapping] = {}  # output of a kept movement op run by a kernel -> its pull
        self._readers: dict[str, frozenset[str]] = {}
        self._decide()
        self.epilogue: dict[str, Node] = self._epilogues()  # pointwise kernel node -> the GEMM it finishes
        # pointwise kernel node -> (the reduction it finishes, the row kernel computing both, built once)
        self.row_epilogue: dict[str, tuple[Node, Kernel]] = self._row_epilogues()

    # -- classification -------------------------------------------------------
    def _classify(self, n: Node) -> str:
        if n.kind == "movement":
            return "kept" if n.name in self.plan.kept else "pushed" if n.name in self.plan.pushed else "virtual"
        if n.op in GEMM_OPS:
            choice = self.gemm_choices[n.name] = choose(self, n, self.gemm_mode)
            return "gemm" if choice.choice == "vtc" else "library"
        if n.op == CONV_OP and not is_depthwise(n):  # depthwise ones are pointwise (vtc.codegen.conv)
            choice = self.gemm_choices[n.name] = choose_conv(self, n, self.gemm_mode)
            return "gemm" if choice.choice == "vtc" else "library"
        for kind, table in (("pointwise", POINTWISE), ("row", ROW)):
            fn = lookup(table, n.target)
            if fn is None:
                continue
            bad = [v for v in [*n.inputs, *n.outputs] if v.dtype not in C_TYPES]
            if bad:
                self._torch(n, f"dtype {bad[0].dtype} of %{bad[0].name} has no generated code")
                return "library"
            try:
                self._probe(n, kind)
            except NotSupported as e:
                self._torch(n, str(e))
                return "library"
            except Exception as e:  # noqa: BLE001 - a defect of the definition: torch computes the op, reported
                self._torch(n, f"vtc's definition of {n.op} failed on this call ({type(e).__name__}: {e})")
                self.defects[n.name] = self.why_torch[n.name]  # in report.fallback_ops, so vtc.compile warns
                return "library"
            return kind
        return "library"

    def _torch(self, n: Node, why: str) -> None:
        self.why_torch[n.name] = why

    def _probe(self, n: Node, kind: str) -> None:
        """Runs n's definition against placeholder loads, to find out whether it is supported.

        Under a ``PROBED`` memo (``vtc.dynamic``: one symbolic graph at many sizes), a node whose signature is the
        one of a node probed before gets that node's answer (supported, or its NotSupported message)."""
        if kind == "pointwise":
            extra = [o for o in n.outputs[1:] if self.users.get(o.name) or o.name in self.outputs]
            if extra:
                raise NotSupported(f"pointwise op whose extra output {extra[0].name} is used")
        memo = PROBED.get()
        key = memo.key(n, kind) if memo is not None else None
        if key is not None:
            hit = memo.get(key)
            if hit is not None:
                if hit is not _SUPPORTED:
                    raise NotSupported(hit)
                return
            try:
                self._run_probe(n, kind)
            except NotSupported as e:
                memo.put(key, str(e))
                raise
            memo.put(key, _SUPPORTED)
            return
        self._run_probe(n, kind)

    def _run_probe(self, n: Node, kind: str) -> None:
        ctx = _ProbeCtx(n)
        args = bind(n.target, n.args, n.kwargs)
        if kind == "pointwise":
            ctx.index = out_vars(n.outputs[0].shape)
            lookup(POINTWISE, n.target)(ctx, args, n.outputs[0])
        else:
            spec = lookup(ROW, n.target)(ctx, args, n.outputs)
            for phase in spec.phases:
                for _, _, value, _ in phase:
                    value(ctx)
            for _, value, _ in spec.stores:
                value(ctx)

    # -- who reads what -------------------------------------------------------
    def readers(self, name: str) -> frozenset[str]:
        """Who reads `name`: kernels and library nodes, through virtual and inlined values.

        A virtual value that something other than a kernel reads directly (a
        library node, the graph output, a mapping's index) shows up as the
        reader ``realize:<name>``: the view or copy that makes it physical.
        """
        hit = self._readers.get(name)
        if hit is not None:
            return hit
        direct = self._direct_readers(name)
        out: set[str] = set()
        for n in self.users.get(name, []):
            k = self.kind[n.name]
            if k == "virtual":
                for o in n.outputs:
                    out |= self.readers(o.name)
            elif k == "pointwise" and n.outputs[0].name in self.inline:
                out |= self.readers(n.outputs[0].name)
        if self.plan.is_virtual(name):
            out |= {r for r in direct if self._is_kernel(r)}
            if any(not self._is_kernel(r) for r in direct):
                out.add(f"realize:{name}")
        else:
            out |= direct
        self._readers[name] = frozenset(out)
        return self._readers[name]

    def _direct_readers(self, name: str) -> set[str]:
        """Readers of `name` itself: non-virtual, non-inlined nodes, the output, mapping indices."""
        out = {self._reader_name(n, name) for n in self.users.get(name, [])
               if self.kind[n.name] not in ("virtual",)
               and not (self.kind[n.name] == "pointwise" and n.outputs[0].name in self.inline)}
        if name in self.outputs:
            out.add(OUTPUT)
        if name in self.index_names:
            out.add(INDEX)
        return out

    def _reader_name(self, n: Node, value: str) -> str:
        """n's name as a reader of `value`; every node of an attention kernel reads as the kernel (its PV bmm)."""
        if self.kind[n.name] == "pushed":
            return self.push.reader_name(n, value)
        kernel = self._attention_member.get(n.name)
        if kernel is None:
            return n.name
        return kernel + KV if (n.name, value) in self._kv_reads else kernel

    def _is_kernel(self, reader: str) -> bool:
        if reader.startswith(READER):
            return self.push.reads_as_kernel(reader)
        if reader.startswith("realize:"):
            return self.realize.get(reader[len("realize:"):]) == "copy"
        return self.kind.get(reader.removesuffix(KV)) in ("pointwise", "row", "gemm", "attention")

    def _decide(self) -> None:
        """Reverse graph order: each value's readers are decided before the value itself."""
        for n in reversed(self.graph.nodes):
            k = self.kind[n.name]
            if k == "virtual":
                for o in n.outputs:
                    if any(not self._is_kernel(r) for r in self._direct_readers(o.name)):
                        r = self.plan.realized.get(o.name)
                        self.realize[o.name] = "view" if r is not None and r.strided is not None else "copy"
            elif k == "pointwise":
                o = n.outputs[0].name
                readers = self.readers(o)
                self._readers.pop(o, None)
                if OUTPUT in readers or INDEX in readers:
                    continue
                kernels = [r for r in readers if self._is_kernel(r)]
                if len(kernels) != len(readers):
                    continue  # a library node or a view reads it: it must be physical
                if not n.inputs:
                    self.inline.add(o)  # it reads nothing: free to recompute
                elif (len(kernels) == 1 and (not kernels[0].endswith(KV) or is_cheap(n)) and not self._tapped(o)
                      and not (n.op == CONV_OP and self._packs(kernels[0])) and not self._recomputed(n, kernels[0])
                      and not (self.kind.get(kernels[0]) == "gemm" and _low_precision(n)
                               and not self._widened_into_f32_gemm(n, kernels[0]))):
                    self.inline.add(o)  # one kernel reads it (an attention kernel's K/V only if cheap; a
                    # depthwise convolution not into a GEMM's pack loop, which evaluates it element by element)

    def _widened_into_f32_gemm(self, n: Node, reader: str) -> bool:
        """True when pointwise node n is a cast of one bfloat16 / float16 tensor to float32 (``x.float()``) that is
        the A operand (through virtual movement ops) of the float32 GEMM `reader` with at most SKINNY_M rows
        (decode): its A pack reads the 16-bit elements and widens them (``vtc_from_bf16``), so the float32 copy is
        never stored.  Not B: a weight's cast read in B's pack loses the fast B paths (1 x 768 -> 3072: 0.24 ->
        1.6 ms); not more rows: A's float32 paths (read in place, ...) were faster than the widening pack
        (128 x 768 -> 3072: 2.43-2.54 -> 2.73-2.75 ms; docs/gemm.md, "3-D Linear epilogues")."""
        g = self._nodes.get(reader)
        if not (g is not None and g.op in GEMM_OPS and g.outputs[0].dtype == torch.float32
                and getattr(n.target, "_opname", None) in ("_to_copy", "to", "convert_element_type")
                and len(n.inputs) == 1 and n.inputs[0].dtype in LOW_PRECISION
                and n.outputs[0].dtype == torch.float32):
            return False
        a, _ = _operands(g, bind(g.target, g.args, g.kwargs))
        x = behind_virtual_movement(self, a)
        return x is not None and x.name == n.outputs[0].name and a.shape[-2] <= SKINNY_M

    def _recomputed(self, n: Node, reader: str) -> bool:
        """True when GEMM `reader` would compute pointwise node n's value more than once in its A pack (once per
        column block: ``gemm_inline.a_passes``) and n is more than a scale or a cast: stored once, then packed."""
        g = self._nodes.get(reader)
        return (g is not None and g.op in GEMM_OPS and self.kind[g.name] == "gemm" and not is_cheap(n)
                and a_passes(self, g, n.outputs[0].name) > 1)

    def _packs(self, reader: str) -> bool:
        """True when `reader` is a GEMM or attention kernel (its operands are read in pack loops)."""
        return self.kind.get(reader.removesuffix(KV)) in ("gemm", "attention")

    def _tapped(self, name: str) -> bool:
        """True when a convolution with more than one tap reads `name`: inlined, its producer would be
        recomputed once per tap, so it stays physical."""
        for u in self.users.get(name, []):
            if u.op == CONV_OP and self.kind[u.name] in ("pointwise", "gemm"):
                w = u.inputs[1]
                if len(w.shape) == 4 and w.shape[2] * w.shape[3] > 1:
                    return True
            if u.op in POOL_OPS and self.kind[u.name] == "pointwise" and pool_taps(u) > 1:
                return True
        return False

    def _epilogues(self) -> dict[str, Node]:
        """Pointwise kernels computed in the epilogue of the GEMM they read (bias, BN, activation, residual).

        A GEMM's output whose one reader is a float32 pointwise kernel of the same shape that reads it
        only at its own output index (through inlined pointwise ops; not a depthwise convolution's
        shifted taps) is never stored: the GEMM kernel stores that kernel's value of its accumulator.

        The reader may also have another shape of as many elements, reading the GEMM's output through a
        view that keeps the row-major order (a Linear on [batch, tokens, d]: view -> addmm -> view ->
        gelu): its element at the GEMM's (row, col) is the one at the same row-major offset
        (``_reader_index``), and it is fused when its reads of the GEMM's output, composed through the view's
        mapping, land on that (row, col) again.  Its other operands (a bias [d], a residual, per-token terms)
        are read at that index too.
        """
        out: dict[str, Node] = {}
        for g in self.graph.nodes:
            if self.kind[g.name] != "gemm":
                continue
            o = g.outputs[0]
            node = self._only_pointwise_kernel_reading(o.name)
            # a bf16 GEMM (vtc.codegen.gemm_bf16) or a float16 one (vtc.codegen.gemm ``narrowed``) takes an epilogue
            # of its dtype or float32 reading any dtype
            low = (o.dtype in LOW_PRECISION and node is not None
                   and node.outputs[0].dtype in (o.dtype, torch.float32))
            if (node is None or (node.outputs[0].dtype != torch.float32 and not low)
                    or math.prod(node.outputs[0].shape) != math.prod(o.shape)):
                continue
            if self._reads_only_at_its_index(o.name, node) and (low or not self._reads_low_precision(node)):
                out[node.name] = g
        return out

    def _only_pointwise_kernel_reading(self, name: str) -> Node | None:
        """The pointwise kernel (not inlined) that is the one reader of value `name`, when `name` is
        not a graph output or an index tensor; else None."""
        if name in self.outputs or name in self.index_names:
            return None
        readers = self.readers(name)
        if len(readers) != 1:
            return None
        r = next(iter(readers))
        if self.kind.get(r) != "pointwise":
            return None
        node = self._nodes[r]
        return None if node.outputs[0].name in self.inline else node

    def _row_epilogues(self) -> dict[str, tuple[Node, Kernel]]:
        """Pointwise kernels computed in the last pass of the reduction they read (rms_norm: x * rsqrt(mean(x²) + eps) * w).

        A row kernel with one reduced output (sum, mean, amax, var, ...) whose one reader is a pointwise
        kernel over the row kernel's whole input shape, reading the reduction only at its own row (through
        inlined pointwise ops), stores that kernel's value for every element of the row instead: the row is
        read again while it is still in cache, and the reduced tensor is never stored.
        """
        out: dict[str, tuple[Node, Kernel]] = {}
        for n in self.graph.nodes:
            if self.kind[n.name] != "row" or len(n.outputs) != 1:
                continue
            node = self._only_pointwise_kernel_reading(n.outputs[0].name)
            if (node is None or node.name in self.epilogue or node.name in out
                    or node.outputs[0].shape != n.inputs[0].shape):
                continue
            try:
                out[node.name] = (n, self.row_kernel(n, then=node))
            except NotSupported:
                continue
        return out

    def _reads_low_precision(self, node: Node) -> bool:
        """True when pointwise `node` (with the producers inlined into it) reads a bfloat16 / float16 value: a GEMM
        epilogue is float32 code only (the general kernels convert at their loads, vtc.codegen.cpp)."""
        probe = self._pointwise(node, out_vars(node.outputs[0].shape), {})
        return _low_precision(node) or any(s.dtype in LOW_PRECISION for s in scalars_under([probe]))

    def _reads_only_at_its_index(self, name: str, node: Node) -> bool:
        """True when pointwise `node` reads value `name` only at node's own output index (no shifted
        taps, no movement in between), so that the reads can come from a GEMM's accumulator."""
        idx = out_vars(self.values[name].shape)
        probe = K.acc("epilogue_probe", self.values[name].dtype)
        value = self._pointwise(node, _reader_index(idx, self.values[name].shape, node.outputs[0].shape),
                                {(name, idx): probe})
        return not any(s.op == "load" and s.args[0] == name for s in scalars_under([value]))

    def gemm_kernel(self, n: Node) -> Kernel:
        """The generated GEMM of matmul or convolution node n (without its epilogue).  A float32 GEMM whose pack
        reads a bfloat16 / float16 tensor through an inlined cast (``_widened_into_f32_gemm``) gets the C
        conversions (vecmath.LOW_PRECISION_PRELUDE, guarded against a second definition) with its helpers."""
        k = conv_kernel(self, n) if n.op == CONV_OP else gemm_kernel(self, n)
        g = k.gemm
        if g.dtype == torch.float32 and any(s.op == "load" and s.dtype in LOW_PRECISION
                                            for s in scalars_under([g.a, g.b])):
            g.runtime += LOW_PRECISION_PRELUDE
        return k

    def with_epilogue(self, k: Kernel, node: Node) -> Kernel:
        """GEMM kernel k storing pointwise node's output, its reads of the GEMM result taken from the accumulator."""
        st = k.stores[0]
        # a bf16 GEMM's result as eager has it: rounded to bf16 before the pointwise ops read it
        acc = K.cast(st.value, st.buffer.dtype) if st.buffer.dtype in LOW_PRECISION else st.value
        memo = {(st.buffer.name, st.index): acc}
        o = node.outputs[0]
        idx = _reader_index(st.index, st.buffer.shape, o.shape)  # node's element at the GEMM's (row, col)
        value = self._pointwise(node, idx, memo)
        k.stores = [Store(Buffer(o.name, o.shape, o.dtype), idx, K.cast(value, o.dtype))]
        k.source_nodes = [*k.source_nodes, node.name]
        return k

    # -- scalar expressions ---------------------------------------------------
    def is_physical(self, name: str) -> bool:
        """True when `name` lives in memory (read with a load)."""
        return name not in self.inline and not self.plan.is_virtual(name)

    def value_at(self, name: str, idx: tuple[Expr, ...], memo: dict) -> Scalar:
        """The element of value `name` at index `idx`, as a scalar expression."""
        key = (name, idx)
        hit = memo.get(key)
        if hit is not None:
            return hit
        v = self.values[name]
        if self.plan.is_virtual(name):
            out = self._through_mapping(self.plan.mappings[name], idx, v.dtype, memo)
        elif name in self.inline:
            out = self._pointwise(self.producer[name], idx, memo)
        else:
            out = K.load(name, idx, v.dtype)
        memo[key] = out
        return out

    def _through_mapping(self, m: Mapping, idx: tuple[Expr, ...], dtype, memo) -> Scalar:
        env = {f"i{k}": e for k, e in enumerate(idx)}
        out: Scalar | None = None
        for p in reversed(m.pieces):
            if p.source is None:
                val = K.const(p.fill, dtype)
            else:
                val = K.cast(self.value_at(p.source, tuple(self._fold(subs(e, env)) for e in p.index), memo), dtype)
            out = val if out is None else K.pick(self._fold(subs(p.when, env)), val, out)
        return out

    def torch_realization(self, name: str) -> Realization:
        """How torch realises virtual value `name` (``vtc.index.mapping.gather``): its plan realization, with
        the folded index tensors (which no kernel computes) replaced by the index arithmetic they fold to."""
        r = self.plan.realized[name]
        m = r.mapping
        if not self.folded & set(m.index_tensors):
            return r
        pieces = tuple(Piece(p.source, tuple(self._fold(e) for e in p.index), self._fold(p.when), p.fill)
                       for p in m.pieces)
        loaded = dict.fromkeys(x.args[0] for p in pieces for e in (*p.index, p.when) for x in walk(e) if x.op == "load")
        m = Mapping(m.shape, pieces, m.sources, {t: self._index_tensor(t)[0] for t in loaded},
                    tuple(c for c in m.checks if c.tensor not in self.folded))
        return replace(r, mapping=m)

    # -- index tensors computed from indices alone (roll's arange -> add -> fmod) ------
    def _fold(self, e: Expr) -> Expr:
        """e with loads from folded index tensors replaced by the index arithmetic that computes them."""
        if not self.folded:
            return e
        return replace_loads(e, lambda t, idx: self._folded_at(t, idx) if t in self.folded else None)

    def _folded_at(self, t: str, idx: tuple[Expr, ...]) -> Expr | None:
        """Folded index tensor t at idx as index arithmetic.  Where idx's range reaches past t (a roll's index
        read under a pad or a convolution's padding, used only where a pick selects the inside), it is clamped
        into t first: the same values wherever they are used, and an fmod folds only on a non-negative range.
        No step computes a folded tensor, so a load of it left in a kernel reads a buffer no step fills."""
        e = self.index_expr(t, idx)
        if e is None:
            shape = self._index_tensor(t)[0]
            e = self.index_expr(t, tuple(clamp(i, 0, n - 1) if i.lo < 0 or i.hi > n - 1 else i
                                         for i, n in zip(idx, shape)))
        return e

    def index_expr(self, name: str, idx: tuple[Expr, ...]) -> Expr | None:
        """Value `name` at idx as an index expression, when it is integer arithmetic on indices only."""
        v = self.values[name]
        if v.dtype not in (torch.int64, torch.int32) or v.kind != "node":
            return None
        if self.plan.is_virtual(name):
            m = self.plan.mappings[name]
            if len(m.pieces) != 1 or m.pieces[0].source is None:
                return None
            env = {f"i{k}": e for k, e in enumerate(idx)}
            return self.index_expr(m.pieces[0].source, tuple(subs(e, env) for e in m.pieces[0].index))
        n = self.producer[name]
        if self.kind.get(n.name, "pointwise") != "pointwise" or n.kind != "compute":
            return None
        args = bind(n.target, n.args, n.kwargs)

        def operand(x) -> Expr | None:
            if isinstance(x, bool) or not isinstance(x, (int, Value)):
                return None
            return const(x) if isinstance(x, int) else self.index_expr(x.name, broadcast_index(idx, v.shape, x.shape))

        op = n.target._opname
        if op == "arange" and isinstance(args.get("start", 0), int) and isinstance(args.get("step", 1), int):
            return idx[0] * args.get("step", 1) + args.get("start", 0)
        if op in ("add", "sub") and args.get("alpha", 1) == 1:
            a, b = operand(args["self"]), operand(args["other"])
            return None if a is None or b is None else (a + b if op == "add" else a - b)
        if op == "mul":
            a, b = operand(args["self"]), operand(args["other"])
            if a is not None and b is not None and (a.is_const or b.is_const):
                return a * b
            return None
        if op in ("remainder", "fmod") and isinstance(args["other"], int) and args["other"] > 0:
            a = operand(args["self"])
            if a is not None and (op == "remainder" or a.lo >= 0):
                return a % args["other"]
        if op == "_to_copy":
            return operand(args["self"])
        return None

    def _foldable_index_tensors(self) -> set[str]:
        """Index tensors that index arithmetic computes, whose range checks hold statically."""
        out = set()
        derived = [t for m in self.plan.mappings.values() for t in m.index_tensors if t not in self.values]
        for m in self.plan.mappings.values():
            for t in m.index_tensors:
                if t in out or t not in self.values or any(t in d for d in derived):
                    continue
                e = self.index_expr(t, out_vars(self.values[t].shape))
                checks = [c for mm in self.plan.mappings.values() for c in mm.checks if c.tensor == t]
                if e is not None and all(c.lo <= e.lo and e.hi <= c.hi for c in checks):
                    out.add(t)
        return out

    def _pointwise(self, n: Node, idx: tuple[Expr, ...], memo) -> Scalar:
        ctx = _Ctx(self, n, idx, n.outputs[0].shape, memo)
        return K.cast(lookup(POINTWISE, n.target)(ctx, bind(n.target, n.args, n.kwargs), n.outputs[0]),
                      n.outputs[0].dtype)

    # -- kernels --------------------------------------------------------------
    def pointwise_kernel(self, name: str, kind: str, sources: list[str]) -> Kernel:
        """A kernel storing every element of value `name` (computed, or read through its mapping)."""
        v = self.values[name]
        idx = out_vars(v.shape)
        memo: dict = {}
        if self.plan.is_virtual(name):
            value = self._through_mapping(self.plan.mappings[name], idx, v.dtype, memo)
        else:
            value = self._pointwise(self.producer[name], idx, memo)
        buf = Buffer(name, v.shape, v.dtype)
        return self._finish(Kernel(f"k_{_ident(name)}", kind, v.shape, 0, [], [Store(buf, idx, value)],
                                   source_nodes=sources))

    def row_kernel(self, n: Node, then: Node | None = None) -> Kernel:
        """A reduction / softmax / normalisation kernel for node n.

        With `then` (a pointwise node over n's input shape reading n's one reduced output at its own
        row), the kernel stores `then`'s output for every element of the row instead of n's output.
        """
        args = bind(n.target, n.args, n.kwargs)
        spec = lookup(ROW, n.target)(_ProbeCtx(n), args, n.outputs)
        x = next(v for v in n.inputs)
        dims = spec.dims
        keep = [d for d in range(len(x.shape)) if d not in dims]
        domain = tuple(x.shape[d] for d in keep)
        dvars = out_vars(domain)
        r_extent = 1
        for d in dims:
            r_extent *= x.shape[d]
        r = reduced_index(r_extent)
        rparts = delinearize(r, [x.shape[d] for d in dims])
        full = [None] * len(x.shape)
        for d, e in zip(keep, dvars):
            full[d] = e
        for d, e in zip(dims, rparts):
            full[d] = e
        full_t = tuple(full)
        memo: dict = {}
        ctx = _Ctx(self, n, full_t, x.shape, memo)
        phases = [[Reduction(name, comb, value(ctx), dt) for name, comb, value, dt in phase] for phase in spec.phases]
        stores = []
        for k, value, per_r in spec.stores:
            o = n.outputs[k]
            if k and not self.users.get(o.name) and o.name not in self.outputs:
                continue  # an extra output nothing reads (layer_norm's mean and rstd): not stored
            if per_r:
                index = full_t
            elif len(o.shape) == len(domain):
                index = dvars
            elif len(o.shape) == len(x.shape):
                index = tuple(const(0) if d in dims else full[d] for d in range(len(x.shape)))
            else:
                raise NotSupported(f"{n.op}: output {o.name} of shape {o.shape} for input {x.shape}")
            stores.append(Store(Buffer(o.name, o.shape, o.dtype), index, K.cast(value(ctx), o.dtype), per_r))
        sources = [n.name]
        if then is not None:
            stores = [self._row_epilogue_store(stores, then, full_t, memo)]
            sources.append(then.name)
        return self._finish(Kernel(f"k_{_ident(n.name)}", "row", domain, r_extent, phases, stores,
                                   source_nodes=sources))

    def _row_epilogue_store(self, stores: list[Store], then: Node, full: tuple[Expr, ...], memo: dict) -> Store:
        """The per-element store of pointwise node `then`, its reads of the row kernel's reduced output
        (the one store in `stores`) taken from the store's value."""
        (st,) = stores
        if st.per_r:
            raise NotSupported("the row kernel's output is per element")
        memo[(st.buffer.name, st.index)] = st.value
        value = self._pointwise(then, full, memo)
        if any(s.op == "load" and s.args[0] == st.buffer.name for s in scalars_under([value])):
            raise NotSupported(f"{then.name} reads {st.buffer.name} outside its own row")
        o = then.outputs[0]
        return Store(Buffer(o.name, o.shape, o.dtype), full, K.cast(value, o.dtype), True)

    def _finish(self, k: Kernel) -> Kernel:
        """Fills the kernel's input buffers from the loads it makes."""
        names: dict[str, Buffer] = {}
        exprs: list[Expr] = []
        for s in scalars_of(k):
            if s.op == "load":
                name, idx = s.args
                names.setdefault(name, Buffer(name, self.values[name].shape, self.values[name].dtype))
                exprs.extend(idx)
            elif s.op in ("iota", "pick"):
                exprs.append(s.args[0])
        for st in k.stores:
            exprs.extend(st.index)
        for e in exprs:
            for x in walk(e):
                if x.op == "load" and x.args[0] not in names:
                    t = x.args[0]
                    shape, dtype = self._index_tensor(t)
                    names[t] = Buffer(t, shape, dtype)
        k.inputs = list(names.values())
        return k

    def _index_tensor(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if name in self.values:
            v = self.values[name]
            return v.shape, v.dtype
        for m in [*self.plan.mappings.values(), *self.move_mappings.values()]:
            if name in m.index_tensors:
                return tuple(m.index_tensors[name]), torch.int64
        raise KeyError(f"unknown index tensor {name!r}")

    def move_kernels(self, n: Node) -> list[KernelStep] | None:
        """Copy kernels running kept movement node n (one per used output, through its own pull mapping).

        An input that is virtual (or inlined) is read through its own mapping (``value_at``), as a pointwise
        kernel reads it: Swin's relative-position bias, gathered from its table, viewed [N, N, heads] and
        permuted to [heads, N, N], is one kernel that gathers into the permuted layout, and a window partition's
        clone reads through the views and permute before it.

        None, with the reason in ``why_torch``, when n runs through torch instead: it has no pull
        mapping, a dtype has no generated code, or it is a scatter (``cost.CLONE_FIRST``: a KV-cache index_put)
        with a virtual input, which torch runs on the realised input (measured faster than a kernel deriving
        the scatter's inverse through the input's mapping: tests/plan/test_cost.py).
        """
        from vtc.plan.cost import CLONE_FIRST
        from vtc.plan.virtualize import pull_of

        bad = [v for v in [*n.inputs, *n.outputs] if v.dtype not in C_TYPES]
        if bad:
            self._torch(n, f"dtype {bad[0].dtype} of %{bad[0].name} has no generated code")
            return None
        if n.op in CLONE_FIRST and not all(self.is_physical(v.name) for v in n.inputs):
            self._torch(n, "kept scatter with a virtual input: realised and run through torch")
            return None
        maps = pull_of(n)
        if isinstance(maps, str):
            self._torch(n, maps)
            return None
        virtual_index = [t for m in maps for t in m.index_tensors if t in self.values and not self.is_physical(t)]
        if virtual_index:  # its range check names a tensor no step fills: torch runs n on the realised index
            self._torch(n, f"kept movement op indexed by the virtual %{virtual_index[0]}: realised and run through torch")
            return None
        out = []
        for o, m in zip(n.outputs, maps):
            if not self.users.get(o.name) and o.name not in self.outputs:
                continue
            self.move_mappings[o.name] = m
            idx = out_vars(o.shape)
            try:
                value = self._through_mapping(m, idx, o.dtype, {})
            except NotSupported as e:
                self._torch(n, str(e))
                return None
            k = self._finish(Kernel(f"k_{_ident(o.name)}", "move", o.shape, 0, [],
                                    [Store(Buffer(o.name, o.shape, o.dtype), idx, value)], source_nodes=[n.name]))
            inner = self.mappings_read(k)  # a virtual input's mappings: their index tensors' checks, derived
            loaded = {b.name for b in k.inputs}
            checks = [c for c in m.checks if c.tensor not in self.folded] + [
                c for mm in inner for c in mm.checks
                if c.tensor not in self.folded and (c.tensor in loaded or c.tensor not in self.values)]
            derived = [m] if m.index_tensors else []
            out.append(KernelStep(k, list(dict.fromkeys(checks)), derived + [mm for mm in inner if mm is not m]))
        return out

    def mappings_read(self, k: Kernel) -> list[Mapping]:
        """The virtual mappings whose index tensors kernel k loads (for checks and derived tensors)."""
        used = {b.name for b in k.inputs}
        return [m for m in self.plan.mappings.values() if set(m.index_tensors) & used]


class _Ctx:
    """What an op definition sees: the current index and operand reads."""

    def __init__(self, low: Lowering, node: Node, index: tuple[Expr, ...], shape: tuple[int, ...], memo: dict):
        self.low, self.node, self.index, self.shape, self.memo = low, node, index, shape, memo

    def _read(self, x: Value, idx: tuple[Expr, ...]) -> Scalar:
        return self.low.value_at(x.name, idx, self.memo)

    def _operand_index(self, x: Value) -> tuple[Expr, ...]:
        return broadcast_index(self.index, self.shape, x.shape)

    def arg(self, x, dtype: torch.dtype) -> Scalar:
        """Operand x (a Value or a Python number) at the current index, as dtype."""
        if isinstance(x, Value):
            return K.cast(self._read(x, self._operand_index(x)), dtype)
        if isinstance(x, (bool, int, float)):
            return K.const(x, dtype)
        raise NotSupported(f"operand {x!r} of type {type(x).__name__}")

    def channel(self, x, dim: int, dtype: torch.dtype) -> Scalar:
        """1-D operand x read at the current index of dimension `dim` (per-channel parameters)."""
        if not isinstance(x, Value) or len(x.shape) != 1:
            raise NotSupported(f"per-channel operand {x!r} is not a 1-D tensor")
        return K.cast(self._read(x, (self.index[dim],) if self.index else ()), dtype)


_SUPPORTED = object()


# answers of _probe by node signature, kept between lowerings (a vtc.dynamic.ProbeMemo: key, get, put)
PROBED: ContextVar = ContextVar("vtc_probed", default=None)


class _ProbeCtx(_Ctx):
    """A context whose reads are placeholders: used to test whether a definition supports a call."""

    def __init__(self, node: Node):
        self.node, self.index, self.shape = node, (), ()

    def _read(self, x: Value, idx: tuple[Expr, ...]) -> Scalar:
        if x.dtype not in C_TYPES:
            raise NotSupported(f"operand dtype {x.dtype}")
        return K.load(x.name, (), x.dtype)

    def _operand_index(self, x: Value) -> tuple[Expr, ...]:
        return ()


def _low_precision(n: Node) -> bool:
    """True when node n reads or makes a bfloat16 / float16 value: a GEMM kernel does not inline it (its pack loops
    read float32, the bf16 GEMM physical or strided bf16 operands only).  An attention kernel does: it reads such
    operands (a bf16 mask, K cast to float32) through the general emitter, which converts."""
    return any(v.dtype in LOW_PRECISION for v in [*n.inputs, *n.outputs])


def _reader_index(idx: tuple[Expr, ...], shape: tuple[int, ...], reader: tuple[int, ...]) -> tuple[Expr, ...]:
    """The index, in a tensor of shape `reader`, of the element at the same row-major offset as `idx` in one of
    `shape` (the same numel): a GEMM epilogue's element of its reader through a view (``_epilogues``)."""
    if tuple(reader) == tuple(shape):
        return idx
    return delinearize(linear_index(idx, shape), reader)


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def scalars_of(k: Kernel):
    """Every scalar node of kernel k, each once."""
    return scalars_under(k.roots())


def lower(graph: Graph, plan: Plan, gemm: str = "auto") -> tuple[Lowering, list]:
    """The steps that run `graph` under `plan`: ("kernel", KernelStep) | ("run", Node) | ("view", name) |
    ("gather", Realization) (a virtual value in a dtype without generated code, realised through torch).

    `gemm` is the compile option choosing GEMM kernels (vtc.codegen.gemm.choose).
    """
    low = Lowering(graph, plan, gemm)
    epilogued = {g.name for g in low.epilogue.values()}
    row_epilogued = {r.name for r, _ in low.row_epilogue.values()}
    steps: list = []
    done: set[str] = set()

    def realise(name: str) -> None:
        if name in done or not plan.is_virtual(name):
            return
        done.add(name)
        if low.realize.get(name) == "view":
            steps.append(("view", name))
        elif low.values[name].dtype not in C_TYPES:  # no copy kernel in this dtype: torch gathers it
            low._torch(low.producer[name], f"dtype {low.values[name].dtype} of %{name} has no generated code: "
                                           "realised by a torch gather")
            steps.append(("gather", low.torch_realization(name)))
        else:
            chain = [c.name for c in chain_of(graph, plan, name)]
            steps.append(("kernel", _step(low, low.pointwise_kernel(name, "copy", chain))))

    for n in graph.nodes:
        k = low.kind[n.name]
        if k == "virtual":
            for o in n.outputs:
                if o.name in low.index_names:
                    realise(o.name)
            continue
        if k == "pointwise" and n.name in low.epilogue:
            fused = low.with_epilogue(low.gemm_kernel(low.epilogue[n.name]), n)
            steps.append(("kernel", _step(low, low._finish(fused))))
            continue
        if k == "pointwise" and n.name in low.row_epilogue:
            steps.append(("kernel", _step(low, low.row_epilogue[n.name][1])))
            continue
        if k == "pointwise":
            if n.outputs[0].name not in low.inline:
                steps.append(("kernel", _step(low, low.pointwise_kernel(n.outputs[0].name, "pointwise", [n.name]))))
            continue
        if k == "row":
            if n.name not in row_epilogued:  # else built with the pointwise kernel that finishes it
                steps.append(("kernel", _step(low, low.row_kernel(n))))
            continue
        if k == "gemm":
            if n.name not in epilogued:  # else built with its epilogue, at the pointwise kernel that finishes it
                steps.append(("kernel", _step(low, low._finish(low.gemm_kernel(n)))))
            continue
        if k == "attention":  # the whole pattern is one kernel, at the place of its PV bmm
            if n.name in low.attention:
                steps.append(("kernel", _step(low, attention_kernel(low, low.attention[n.name]))))
            continue
        if k == "pushed":  # its inputs are stored into its output (vtc.codegen.push)
            low.push.emit(n, steps)
            continue
        if k == "kept" and (moves := low.move_kernels(n)) is not None:  # a kept movement op: copy kernels
            steps.extend(("kernel", m) for m in moves)
            continue
        for v in n.inputs:  # library and kept nodes read physical tensors
            if plan.is_virtual(v.name):
                realise(v.name)
            elif v.name in low.inline:  # pragma: no cover - _decide never inlines what a library node reads
                raise AssertionError(f"{v.name} is inlined but {n.name} needs it in memory")
        steps.append(("run", n))
    for v in graph.outputs:
        realise(v.name)
    return low, low.push.finish(steps)


def _step(low: Lowering, k: Kernel) -> KernelStep:
    """k with the range checks of the index tensors it loads.  A mapping that k reads through may hold more
    index tensors than k loads (bilinear interpolation's four corners: another kernel reads the others, and
    may run later); their checks belong to the kernels that load them."""
    maps = low.mappings_read(k)
    loaded = {b.name for b in k.inputs}
    checks = list(dict.fromkeys(c for m in maps for c in m.checks
                                if c.tensor not in low.folded and (c.tensor in loaded or c.tensor not in low.values)))
    return KernelStep(k, checks, maps)
