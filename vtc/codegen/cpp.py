"""C++ (OpenMP) code generator: one ``Kernel`` -> one ``extern "C"`` function.

Generated functions take ``(void* const* bufs, int nthreads)``: the kernel's
input buffers in ``kernel.inputs`` order, then its output buffers in store
order (each once), all contiguous; and the thread count (torch's, passed by
the executor, since OpenMP's setting is per calling thread).  Loop structure:

- pointwise: ``parallel for`` over the rows (all dims but the last), the row
  index split into i0, i1, ...; an ``omp simd`` loop over the last dim, or over
  the last few as one where every offset allows (an NCHW kernel walks whole
  H x W maps: ``_merged_inner_dims``), with what does not change along it (a
  batch norm's per-channel scale) computed once before it;
- row kernels (reductions, softmax, norms): ``parallel for`` over the kept
  dims; per reduction pass an inner loop over r (``simd reduction`` where the
  combine is associative), then the per-element and per-row stores.  Rows
  whose loads share cache lines (a permute in front) run one after another
  (``_row_order``); a reduction read with a stride whose neighbouring rows are adjacent in memory
  (softmax over a permuted dim) takes blocks of rows as vector lanes (``vtc.codegen.lanes``);
- a pointwise kernel reading an operand across its rows (a transpose) walks
  tiles of 16 rows x 256 columns, block by block: each 16 x 16 block of that
  operand is transposed in registers and consumed at once (``vtc.codegen.tiles``);
- a pointwise kernel reading a dim through a roll (``(i + s) mod n``) runs that
  dim as two ranges split at the wrap point, in one parallel region, so the
  later dims merge into long inner loops (``_wrap_split_kernel``);
- a pointwise kernel whose piece choices depend on the inner index alone (RoPE's rotate_half, a cat or pad
  along the last dim) runs each row's inner loop as one loop per range of it over which they are decided, so
  that no loop holds a branch (``_inner_piece_kernel``);
- index-tensor loads that do not change along the inner loop (a gather's row
  index) are read once before it (``_Emitter.hoist_index_loads``), so it vectorises.

Index expressions become integer C (plain ``/`` and ``%`` where the range
analysis proves the operand non-negative); a virtual tensor's piece choice
becomes a ternary whose untaken side is never loaded.  Common scalar
subexpressions outside such choices are emitted once per loop body.
"""
from __future__ import annotations

import math
from contextvars import ContextVar
from typing import Iterable

import torch

from vtc.codegen import depthwise
from vtc.codegen.kernel_ir import Buffer, Kernel, Scalar, decided_ranges, scalars_under, substitute
from vtc.codegen.ops import C_TYPES, LOW_PRECISION
from vtc.codegen.vecmath import LOW_PRECISION_PRELUDE, PRELUDE as VECMATH_PRELUDE
from vtc.codegen.tiles import PRELUDE as TILES_PRELUDE, tiled_transpose_kernel, transposed_loads
from vtc.codegen.prefetch import gathered_row_prefetch
from vtc.codegen.reuse import stored_term
from vtc.codegen.lanes import lane_row_kernel
from vtc.codegen.low_tiles import staged_loads
from vtc.codegen import low_vector, row_blocks, row_stage, stream
from vtc.index.expr import Expr, _terms
from vtc.index.mapping import linear_offset

# the head of a GEMM's parallel region (C lines): this thread's id `tid` in a team of `nth` of at most `nt`
OMP_TEAM = (
    "  #pragma omp parallel num_threads(nt) if(nt > 1)",
    "  {",
    "#if defined(_OPENMP)",
    "    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();",
    "#else",
    "    const int64_t tid = 0, nth = 1;",
    "#endif",
)

PARALLEL_MIN_WORK = 1 << 15  # elements (times r) below which a kernel runs on one thread

PRELUDE = r"""
#include <cstdint>
#include <cmath>
#include <algorithm>
#include <limits>
static inline int64_t vtc_floordiv(int64_t a, int64_t b) { int64_t q = a / b; return q - ((a % b != 0) & ((a < 0) != (b < 0))); }
static inline int64_t vtc_mod(int64_t a, int64_t b) { int64_t r = a % b; return r + ((r != 0) & ((r < 0) != (b < 0))) * b; }
template <class T> static inline T vtc_max(T a, T b) { return (a > b || a != a) ? a : b; }
template <class T> static inline T vtc_relu(T x) { return x < (T)0 ? (T)0 : x; }  // torch: -0.0 and NaN kept
template <class T> static inline T vtc_min(T a, T b) { return (a < b || a != a) ? a : b; }
// exp, log, erf, tanh, sigmoid, gelu, sin, cos: vtc/codegen/vecmath.py
""" + VECMATH_PRELUDE + r"""
template <class T> static inline T vtc_fmod_floor(T a, T b) { T r = std::fmod(a, b); return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
template <class T> static inline T vtc_sign(T x) { return (T)((x > 0) - (x < 0)); }
""" + TILES_PRELUDE

_UNARY_FMT = {
    "neg": "(-{x})", "exp": "vtc_exp({x})", "log": "vtc_log({x})", "tanh": "vtc_tanh({x})",
    "sigmoid": "vtc_sigmoid({x})", "relu": "vtc_relu({x})", "rsqrt": "(({t})1 / std::sqrt({x}))",
    "sqrt": "std::sqrt({x})", "abs": "std::abs({x})", "cos": "vtc_cos({x})", "sin": "vtc_sin({x})",
    "erf": "vtc_erf({x})", "reciprocal": "(({t})1 / {x})", "silu": "vtc_silu({x})",
    "floor": "std::floor({x})", "ceil": "std::ceil({x})", "expm1": "std::expm1({x})", "log1p": "std::log1p({x})",
    "exp2": "std::exp2({x})", "log2": "std::log2({x})", "sign": "vtc_sign({x})", "tan": "std::tan({x})",
    "atan": "std::atan({x})", "round": "std::nearbyint({x})", "trunc": "std::trunc({x})",
    "hardswish": "({x} * std::min(std::max({x} + ({t})3, ({t})0), ({t})6) / ({t})6)",
    "hardsigmoid": "(std::min(std::max({x} + ({t})3, ({t})0), ({t})6) / ({t})6)",
    "gelu": "vtc_gelu({x})", "gelu_tanh": "vtc_gelu_tanh({x})", "not": "(!{x})", "bitnot": "(~{x})",
}
_BINARY_OP = {"add": "+", "sub": "-", "mul": "*", "div": "/", "eq": "==", "ne": "!=", "lt": "<",
              "le": "<=", "gt": ">", "ge": ">=", "and": "&&", "or": "||", "xor": "!=",
              "bitand": "&", "bitor": "|", "bitxor": "^"}


_ASSOC = {"sum": "+", "prod": "*", "any": "||", "all": "&&"}
_INIT = {"sum": "0", "prod": "1", "any": "false", "all": "true"}


def ctype(dtype: torch.dtype) -> str:
    """The C type a kernel computes a torch dtype's values in (bfloat16 / float16: float)."""
    return C_TYPES[dtype]


def storage_ctype(dtype: torch.dtype) -> str:
    """The C type of a torch dtype's elements in memory (bfloat16 / float16: uint16_t)."""
    return LOW_PRECISION.get(dtype) or C_TYPES[dtype]


# bfloat16 / float16 (vtc.codegen.vecmath.LOW_PRECISION_PRELUDE): a load widens to float, a store rounds, and so
# does every op whose result is of the dtype, but for those whose result is one of their operands (or exact)
_LOW = {torch.bfloat16: "bf16", torch.float16: "f16"}
_EXACT_LOW = {"neg", "abs", "relu", "sign", "max", "min", "floor", "ceil", "round", "trunc"}


def low_precision(k: Kernel) -> bool:
    """True when kernel k reads or writes a bfloat16 / float16 buffer: the float32 fast paths (lanes, tiles,
    streamed stores) are not taken, the general loops convert at loads and stores (depthwise planes widen
    16-bit taps themselves: vtc.codegen.depthwise)."""
    return any(b.dtype in _LOW for b in [*k.inputs, *_outputs(k)])


def literal(value, dtype: torch.dtype) -> str:
    """A C literal of `dtype`."""
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        v = float(value)
        suffix = "f" if dtype == torch.float32 or dtype in _LOW else ""
        if math.isnan(v):
            return f"(({ctype(dtype)})NAN)"
        if math.isinf(v):
            return f"(({ctype(dtype)}){'-' if v < 0 else ''}INFINITY)"
        return f"{v!r}{suffix}" if "e" in repr(v) or "." in repr(v) else f"{v!r}.0{suffix}"
    v = int(value)
    return f"(({ctype(dtype)}){v}LL)" if abs(v) >= 2**31 else f"(({ctype(dtype)}){v})" if dtype != torch.int64 else str(v)


class _Emitter:
    """Turns index and scalar expressions into C text for one kernel."""

    def __init__(self, k: Kernel):
        self.k = k
        self.ptr = {b.name: f"b{n}" for n, b in enumerate(k.inputs)}
        for b in _outputs(k):
            self.ptr.setdefault(b.name, f"b{len(self.ptr)}")
        self.shapes = {b.name: b.shape for b in [*k.inputs, *_outputs(k)]}
        self.temps: dict[int, str] = {}
        self.pinned: dict[int, str] = {}  # temps that forget() keeps (a row staged once: vtc.codegen.row_stage)
        self.index_temps: dict[Expr, str] = {}  # index-tensor loads read once per row (see hoist_index_loads)

    # -- index expressions ----------------------------------------------------
    def index(self, e: Expr) -> str:
        if e in self.index_temps:
            return self.index_temps[e]
        op, a = e.op, e.args
        if op == "const":
            return str(a[0]) if abs(a[0]) < 2**31 else f"{a[0]}LL"
        if op == "var":
            return a[0]
        if op == "sum":
            c, ts = a
            parts = [self.index(t) if k == 1 else f"{k}*{self.index(t)}" for t, k in ts]
            if c:
                parts.append(str(c) if abs(c) < 2**31 else f"{c}LL")
            return "(" + " + ".join(parts) + ")"
        if op == "mul":
            return f"({self.index(a[0])} * {self.index(a[1])})"
        if op in ("floordiv", "mod"):
            x = self.index(a[0])
            if a[0].lo >= 0:
                return f"({x} {'/' if op == 'floordiv' else '%'} {a[1]})"
            return f"vtc_{op}({x}, {a[1]})"
        if op in ("min", "max"):
            return f"std::{op}<int64_t>({self.index(a[0])}, {self.index(a[1])})"
        if op == "select":
            return f"({self.index(a[0])} ? {self.index(a[1])} : {self.index(a[2])})"
        if op in ("lt", "eq"):
            return f"({self.index(a[0])} {'<' if op == 'lt' else '=='} {self.index(a[1])})"
        if op in ("and", "or"):
            return f"({self.index(a[0])} {'&&' if op == 'and' else '||'} {self.index(a[1])})"
        if op == "not":
            return f"(!{self.index(a[0])})"
        if op == "load":
            name, idx = a[0], a[1]
            return f"((int64_t){self.ptr[name]}[{self.linear(name, idx)}])"
        raise AssertionError(op)

    def linear(self, buf: str, idx: Iterable[Expr]) -> str:
        """The contiguous offset of idx in buffer `buf`."""
        return self.index(linear_offset(idx, self.shapes[buf]))

    # -- scalar expressions ---------------------------------------------------
    def scalar(self, s: Scalar) -> str:
        t = self.temps.get(id(s))
        if t is not None:
            return t
        c = self.unrounded(s)
        return f"vtc_round_{_LOW[s.dtype]}({c})" if self.rounds(s) else c

    @staticmethod
    def rounds(s: Scalar) -> bool:
        """Whether s's result is rounded to its dtype (bfloat16 / float16: eager rounds every op's result to its
        dtype but those that are exact); the rule ``vtc.codegen.low_vector`` follows too."""
        return s.dtype in _LOW and s.op in ("cast", "iota", "unary", "binary") and not (
            s.op in ("unary", "binary") and s.args[0] in _EXACT_LOW)

    def stored(self, s: Scalar, dtype: torch.dtype) -> str:
        """s as the element of a buffer of `dtype` (bfloat16 / float16: rounded and narrowed once)."""
        if dtype in _LOW:
            return f"vtc_to_{_LOW[dtype]}({self.temps.get(id(s)) or self.unrounded(s)})"
        return self.scalar(s)

    def unrounded(self, s: Scalar) -> str:
        """s in C, a bfloat16 / float16 op's result not yet rounded to its dtype (``scalar`` rounds it)."""
        op, a, dt = s.op, s.args, s.dtype
        if op == "const":
            return literal(a[0], dt)
        if op == "load":
            if dt in _LOW:
                return f"vtc_from_{_LOW[dt]}({self.ptr[a[0]]}[{self.linear(a[0], a[1])}])"
            return f"{self.ptr[a[0]]}[{self.linear(a[0], a[1])}]"
        if op == "iota":
            return f"(({ctype(dt)}){self.index(a[0])})"
        if op == "acc":
            return f"acc_{a[0]}"
        if op == "cast":
            x = self.scalar(a[0])
            return f"({x} != 0)" if dt == torch.bool else f"(({ctype(dt)}){x})"
        if op == "unary":
            return _narrow(_UNARY_FMT[a[0]].format(x=self.scalar(a[1]), t=ctype(dt)), dt)
        if op == "binary":
            return _narrow(self.binary(a[0], self.scalar(a[1]), self.scalar(a[2]), a[1].dtype, dt), dt)
        if op == "fma":
            return f"std::fma({self.scalar(a[0])}, {self.scalar(a[1])}, {self.scalar(a[2])})"
        if op == "where":
            return f"({self.scalar(a[0])} ? {self.scalar(a[1])} : {self.scalar(a[2])})"
        if op == "pick":
            return f"({self.index(a[0])} ? {self.scalar(a[1])} : {self.scalar(a[2])})"
        raise AssertionError(op)

    def binary(self, fn: str, x: str, y: str, in_dt: torch.dtype, dt: torch.dtype) -> str:
        if fn in _BINARY_OP:
            return f"({x} {_BINARY_OP[fn]} {y})"
        floating = in_dt.is_floating_point
        if fn == "max":
            return f"vtc_max<{ctype(dt)}>({x}, {y})"
        if fn == "min":
            return f"vtc_min<{ctype(dt)}>({x}, {y})"
        if fn == "pow":
            return f"std::pow({x}, {y})"
        if fn == "atan2":
            return f"std::atan2({x}, {y})"
        if fn == "fmod":
            return f"std::fmod({x}, {y})" if floating else f"({x} % {y})"
        if fn == "remainder":
            return f"vtc_fmod_floor({x}, {y})" if floating else f"(({ctype(dt)})vtc_mod({x}, {y}))"
        if fn == "div_floor":
            return f"std::floor({x} / {y})" if floating else f"(({ctype(dt)})vtc_floordiv({x}, {y}))"
        if fn == "div_trunc":
            return f"std::trunc({x} / {y})" if floating else f"({x} / {y})"
        raise AssertionError(fn)

    def hoist(self, roots: list[Scalar], indent: str, within_temps: bool = True) -> list[str]:
        """Temps for scalars used more than once outside piece choices (each emitted once); not
        `within_temps`: the operands of a scalar that already has a temp are not counted (it is not
        recomputed, so they are not read)."""
        uses: dict[int, int] = {}
        order: list[Scalar] = []

        def visit(s: Scalar) -> None:
            uses[id(s)] = uses.get(id(s), 0) + 1
            if uses[id(s)] > 1 or (not within_temps and id(s) in self.temps):
                return
            if s.op != "pick":  # only the chosen side of a piece choice may be evaluated
                for x in s.args:
                    if isinstance(x, Scalar):
                        visit(x)
            order.append(s)

        for r in roots:
            visit(r)
        lines = []
        for s in order:
            if uses[id(s)] > 1 and s.op not in ("const", "acc", "iota") and id(s) not in self.temps:
                name = f"t{len(self.temps)}"
                lines.append(f"{indent}const {ctype(s.dtype)} {name} = {self.scalar(s)};")
                self.temps[id(s)] = name
        return lines

    def hoist_invariant(self, roots: list[Scalar], varying: set[str], indent: str,
                        reductions_done: bool = False) -> list[str]:
        """Temps, emitted before a loop, for the largest subexpressions of `roots` that do not change in it
        (``invariant_terms``).  E.g. a batch norm's per-channel scale ``w / sqrt(var + eps)`` in the epilogue
        of a convolution, computed once per output channel instead of once per element."""
        lines: list[str] = []
        for x in self.invariant_terms(roots, varying, reductions_done):
            name = f"t{len(self.temps)}"
            lines.append(f"{indent}const {ctype(x.dtype)} {name} = {self.scalar(x)};")
            self.temps[id(x)] = name
        return lines

    def invariant_terms(self, roots: list[Scalar], varying: set[str], reductions_done: bool = False,
                        loads_only: bool = False) -> list[Scalar]:
        """The largest subexpressions of `roots` that do not change in a loop, each once, in the order
        of a walk from the roots: none of the index variables in `varying` in them, no accumulator, no
        scalar that already has a temp (a per-element value such as a depthwise sum).  Never below a piece
        choice (its untaken side may read out of range; a choice that does not vary is taken whole, still
        evaluating one side); constants stay literals.  `reductions_done`: the loop comes after every
        reduction of the row (a row kernel's store pass), so the accumulators are final values, not varying
        (a layer norm's ``1 / sqrt(var + eps)`` is computed once per row, not per element).  `loads_only`:
        only terms that read a buffer (an index arithmetic term is as cheap where it is)."""
        from vtc.index.expr import free_vars

        found: dict[int, bool] = {}  # id -> varies in the loop
        pinned = set(self.temps)

        def varies(x: Scalar) -> bool:
            if id(x) not in found:
                if id(x) in pinned or (x.op == "acc" and not reductions_done):
                    out = True
                elif x.op == "load":
                    out = any(free_vars(e) & varying for e in x.args[1])
                elif x.op in ("iota", "pick"):
                    out = bool(free_vars(x.args[0]) & varying)
                else:
                    out = False
                found[id(x)] = any([out, *(varies(a) for a in x.args if isinstance(a, Scalar))])
            return found[id(x)]

        terms: list[Scalar] = []
        taken: set[int] = set()

        def visit(x: Scalar) -> None:
            if x.op == "const" or id(x) in pinned or id(x) in taken:
                return
            if not varies(x):
                if not loads_only or any(y.op == "load" for y in scalars_under([x])):
                    terms.append(x)
                    taken.add(id(x))
            elif x.op != "pick":
                for a in x.args:
                    if isinstance(a, Scalar):
                        visit(a)

        for r in roots:
            visit(r)
        return terms

    def forget(self) -> None:
        self.temps.clear()
        self.temps.update(self.pinned)

    def hoist_index_loads(self, k: Kernel, loop_var: str, indent: str) -> list[str]:
        """Temps for the index-tensor loads (a gather's row index) that do not change along `loop_var`.

        Read once before the loop over `loop_var` instead of in it: gcc does not vectorise a loop
        that reloads the index in every iteration.  Only loads every element makes are hoisted (not
        under a piece choice or an index ``select``, whose untaken side may be out of range).
        """
        from vtc.index.expr import free_vars

        lines: list[str] = []

        def visit_index(e: Expr) -> None:
            if e.op == "select" or e in self.index_temps:
                return
            if e.op == "load":
                if loop_var not in free_vars(e):
                    name = f"ix{len(self.index_temps)}"
                    lines.append(f"{indent}const int64_t {name} = {self.index(e)};")
                    self.index_temps[e] = name
                    return
            for x in e.args:
                if isinstance(x, Expr):
                    visit_index(x)
                elif isinstance(x, tuple):
                    for y in x:
                        if isinstance(y, Expr):
                            visit_index(y)

        roots = [r.value for phase in k.phases for r in phase] + [st.value for st in k.stores]
        for sc in scalars_under(roots, stop=lambda x: x.op == "pick"):
            if sc.op == "load":
                for e in sc.args[1]:
                    visit_index(e)
        return lines


_NARROW = (torch.bool, torch.uint8, torch.int8, torch.int16)


def _narrow(c: str, dtype: torch.dtype) -> str:
    """C promotes narrow integers to int: convert back so intermediate results wrap as torch's do."""
    return f"(({ctype(dtype)}){c})" if dtype in _NARROW else c


def _outputs(k: Kernel) -> list[Buffer]:
    out: dict[str, Buffer] = {}
    for st in k.stores:
        out.setdefault(st.buffer.name, st.buffer)
    return list(out.values())


def buffer_order(k: Kernel) -> list[Buffer]:
    """The buffers in the order the generated function expects their pointers."""
    names = {b.name for b in k.inputs}
    return [*k.inputs, *[b for b in _outputs(k) if b.name not in names]]


def buffer_pointers(k: Kernel, em, ctype_of=None) -> list[str]:
    """The kernel body's first lines: one ``__restrict`` pointer per buffer, taken from ``bufs`` in
    ``buffer_order``, const where the kernel does not store into it; `ctype_of` (default ``ctype``) gives
    the C element type of a buffer's dtype."""
    ctype_of = ctype_of or storage_ctype
    stored = {st.buffer.name for st in k.stores}
    lines = []
    for b in buffer_order(k):
        qual = "" if b.name in stored else "const "
        t = ctype_of(b.dtype)
        lines.append(f"  {qual}{t}* __restrict {em.ptr[b.name]} = ({qual}{t}*)bufs[{list(em.ptr).index(b.name)}];")
    return lines


def _decompose(names: list[str], sizes: tuple[int, ...], flat: str, indent: str) -> list[str]:
    lines, stride = [], 1
    strides = []
    for s in reversed(sizes):
        strides.append(stride)
        stride *= s
    strides.reverse()
    for n, s, st in zip(names, sizes, strides):
        if s == 1:
            continue
        e = flat if st == 1 else f"({flat} / {st})"
        e = e if st * s == stride else f"({e} % {s})"
        lines.append(f"{indent}const int64_t {n} = {e};")
    return lines


def generate(k: Kernel) -> str:
    """The C++ source of kernel k (with the prelude), exporting `extern "C" void <k.name>(void* const*, int)`."""
    if k.kind == "gemm":
        from vtc.codegen.gemm import generate as generate_gemm

        return generate_gemm(k)
    em = _Emitter(k)
    body = buffer_pointers(k, em)
    head = PRELUDE
    if k.kind == "attention":
        from vtc.codegen.attention import emit_attention
        from vtc.codegen.flash import PRELUDE as FLASH_PRELUDE
        body += emit_attention(k, em)
        head += FLASH_PRELUDE
    elif k.kind == "pointwise" and (dw := depthwise.source(k, em, _pointwise_kernel)):
        body += dw  # a depthwise convolution plane by plane (vtc.codegen.depthwise)
        head += depthwise.PRELUDE
    else:
        body += _row_kernel(k, em) if k.kind == "row" else _pointwise_kernel(k, em)
    head += stream.PRELUDE if any("vtc_stream16(" in line or "vtc_stream_row(" in line for line in body) else ""  # large outputs
    vector = low_precision(k) or any(line == f"#if defined({low_vector.TARGET})" for line in body)  # row_blocks
    head += LOW_PRECISION_PRELUDE if vector else ""
    return head + f'\nextern "C" void {k.name}(void* const* bufs, int nthreads) {{\n' + "\n".join(body) + "\n}\n"


def _store(em: _Emitter, st, indent: str) -> str:
    return f"{indent}{em.ptr[st.buffer.name]}[{em.linear(st.buffer.name, st.index)}] = {em.stored(st.value, st.buffer.dtype)};"


TILE = 32  # edge of the square tiles of a pointwise kernel that reads across its inner dim


def _strided_inner_read(k: Kernel, em: _Emitter) -> bool:
    """True when some load walks memory with a large stride along the innermost dim (a transpose)."""
    from vtc.codegen.lower import scalars_of
    from vtc.index.expr import affine

    inner, outer = f"i{len(k.domain) - 1}", f"i{len(k.domain) - 2}"
    for s in scalars_of(k):
        if s.op != "load":
            continue
        form = affine(linear_offset(s.args[1], em.shapes[s.args[0]]))
        if form is not None and abs(form[1].get(inner, 1)) >= 16 and form[1].get(outer, 0) != 0:
            return True
    return False


INNER_MERGE_BELOW = 1024  # a pointwise kernel's inner loop takes in the dim before it while shorter than this
# Off while size-generic kernels are made (vtc.dynamic): which dims merge depends on the sizes, and a template
# must be the same text at every probe size (vtc.runtime.generic).
MERGE_INNER_DIMS: ContextVar[bool] = ContextVar("vtc_merge_inner_dims", default=True)


def _merged_inner_dims(k: Kernel, em: _Emitter) -> int:
    """How many trailing domain dims the inner loop of pointwise kernel k walks as one (at least 1).

    An NCHW kernel over 28 x 28 maps would run 28-element inner loops (a short vector loop and the row's
    index arithmetic per 28 elements).  Dims i_j, ..., i_last merge when every buffer offset of the kernel
    (loads and stores) is ``c * (i_j * stride_j + ... + i_last)`` plus terms without them, with stride_j the
    product of the later dims' sizes, and no other expression (a piece choice, an index load, an iota)
    mentions them: then i_last running over the merged extent with the others 0 is the same offsets.
    While the inner loop is shorter than ``INNER_MERGE_BELOW``, and leaving 8 rows for the threads.
    """
    from vtc.codegen.lower import scalars_of
    from vtc.index.expr import free_vars

    if not MERGE_INNER_DIMS.get():
        return 1
    shape = k.domain
    offsets, others = [], []
    for s in scalars_of(k):
        if s.op == "load":
            offsets.append(linear_offset(s.args[1], em.shapes[s.args[0]]))
        else:
            others += [a for a in s.args if isinstance(a, Expr)]
    for st in k.stores:
        offsets.append(linear_offset(st.index, em.shapes[st.buffer.name]))
        if st.when is not None:
            others.append(st.when)
    used_elsewhere = set().union(*(free_vars(e) for e in others))

    def coefficients(e: Expr, merged: list[str]) -> dict[str, int] | None:
        c, terms = _terms(e)
        out = {}
        for atom, coeff in terms.items():
            if atom.op == "var" and atom.args[0] in merged:
                out[atom.args[0]] = coeff
            elif free_vars(atom) & set(merged):
                return None
        return out

    n, m = math.prod(shape), 1
    while m < len(shape) and math.prod(shape[-m:]) < INNER_MERGE_BELOW:
        merged = [f"i{d}" for d in range(len(shape) - m - 1, len(shape))]
        inner = math.prod(shape[-m - 1:])
        if used_elsewhere & set(merged) or (n >= PARALLEL_MIN_WORK and n // inner < 8):
            break
        fits = True
        for e in offsets:
            co = coefficients(e, merged)
            if co is None:
                fits = False
                break
            unit = co.get(merged[-1], 0)
            if any(co.get(v, 0) != unit * math.prod(shape[d + 1:])
                   for v, d in zip(merged[:-1], range(len(shape) - m - 1, len(shape) - 1))):
                fits = False
                break
        if not fits:
            break
        m += 1
    return m


WRAP_SPLIT = True  # split a pointwise kernel's dim at a roll's wrap point (False: one loop nest; for A/B)
# The two pieces of a split run row by row in one loop over the rows they share (each row's long run, then its
# short run) where both walk the same rows and neither streams; False: two loops one after the other (for A/B).
WRAP_ROWS = True
WRAP_ROWS_MARK = "    { // the wrap's two pieces of this row: the first"
# A pointwise kernel's inner loop runs as one loop per range of its index over which every piece choice on that
# index alone is decided (``kernel_ir.decided_ranges``; RoPE's rotate_half, ``d < D / 2``, two ranges), the
# ranges of a row one after another: loops without the choice's branch, which gcc vectorises (one loop with the
# choice's loads under a branch ran scalar in float16, each widening and rounding a call; docs/low_precision.md,
# session 25); False: one loop with the choice, for A / B.  Only where the pieces run row by row (not streamed, no
# piece reading across rows through tiles) and not in size-generic kernels (MERGE_INNER_DIMS off: whether a piece
# takes the tiles depends on its size, so the text would change with the sizes, as the wrap split's merges would).
INNER_PIECES = True
MAX_INNER_PIECES = 4
# A kernel computing in float32 or wider splits only where every range is at least this long: gcc vectorises its
# one loop with the choice (masked loads), and a shorter range ran as lanes of those vectors where its own loop
# runs scalar (cat of 3 + 5 float32 columns: 10.7 -> 14.4 us split; in float16, 218 -> 136 us)
MIN_INNER_PIECE = 16
INNER_PIECES_MARK = "    { // the row's ranges of the inner index, each choice on it decided: the first"


def _wraps(k: Kernel) -> dict[int, int]:
    """{d: s} for the dims d that some load of pointwise kernel k reads as ``(i_d + s) mod domain[d]`` (a roll),
    one shift per dim (a dim read with two shifts is left out)."""
    from vtc.codegen.lower import scalars_of
    from vtc.index.expr import walk

    roots = [e for st in k.stores for e in st.index]
    for sc in scalars_of(k):
        for a in sc.args:
            roots += [a] if isinstance(a, Expr) else [x for x in a if isinstance(x, Expr)] if isinstance(a, tuple) else []
    found: dict[int, set[int]] = {}
    for e in {x for r in roots for x in walk(r) if x.op == "mod"}:
        c, terms = _terms(e.args[0])
        if len(terms) == 1:
            ((atom, coeff),) = terms.items()
            if atom.op == "var" and coeff == 1 and atom.args[0][1:].isdigit():
                d = int(atom.args[0][1:])
                if d < len(k.domain) and k.domain[d] == e.args[1] and c % e.args[1]:
                    found.setdefault(d, set()).add(c % e.args[1])
    return {d: next(iter(v)) for d, v in found.items() if len(v) == 1}


def _dim_pieces(k: Kernel, d: int, ranges: list[tuple[int, int]]) -> list[Kernel]:
    """k over dim d split into `ranges` [lo, hi), each a kernel over its part of the dim whose variable i_d
    counts from 0 (a piece choice that this decides replaced by its side, ``kernel_ir.substitute``)."""
    import dataclasses

    from vtc.index.expr import subs, var

    name, out = f"i{d}", []
    for lo, hi in ranges:
        size = hi - lo
        env = {name: var(name, size) + lo}
        memo: dict = {}
        stores = [dataclasses.replace(st, index=tuple(subs(e, env) for e in st.index), value=substitute(st.value, env, memo),
                                      when=None if st.when is None else subs(st.when, env)) for st in k.stores]
        out.append(dataclasses.replace(k, domain=k.domain[:d] + (size,) + k.domain[d + 1:], stores=stores))
    return out


def _wrap_split_kernel(k: Kernel, em: _Emitter) -> list[str] | None:
    """A pointwise kernel whose innermost rolled dim d (``_wraps``) splits at the wrap point into two loop
    nests in one parallel region, where that lets the inner loop run over whole rows of the later dims (roll
    -> add over [H, W, C] rolled along W: runs of (W - s) * C floats instead of C, ``_merged_inner_dims``) or
    read contiguously (a roll along the last dim).  None where it does not apply."""
    if not WRAP_SPLIT or not MERGE_INNER_DIMS.get() or k.kind != "pointwise" or len(k.domain) < 1:
        return None
    wraps = _wraps(k)
    if not wraps:
        return None
    d = max(wraps)
    cut = k.domain[d] - wraps[d]  # (i_d + s) mod n: i_d in [0, n - s) reads i_d + s, in [n - s, n) i_d + s - n
    pieces = _dim_pieces(k, d, [(0, cut), (cut, k.domain[d])])
    if d != len(k.domain) - 1 and _merged_inner_dims(pieces[0], em) <= len(k.domain) - 1 - d:
        return None  # the later dims would not merge across d: nothing gained
    if any(transposed_loads(p, em.shapes) or (len(p.domain) >= 2 and min(p.domain[-2:]) > TILE
                                              and _strided_inner_read(p, em)) for p in pieces):
        return None
    n = math.prod(k.domain)
    nests = [_pointwise_kernel(p, em, split=False) for p in pieces]
    if WRAP_ROWS and (rows := _piece_rows(nests, n, WRAP_ROWS_MARK)):
        return rows
    body, fenced = [], False
    for j, lines in enumerate(nests):
        if lines and "#pragma omp parallel for" in lines[0]:
            lines = [lines[0].replace("parallel for", "for").split(" num_threads")[0], *lines[1:]]
        else:  # stream.fenced: omp parallel { omp for loop; fence }
            assert "#pragma omp parallel num_threads" in lines[0] and lines[-2].strip() == "vtc_stream_fence();", lines
            lines, fenced = lines[2:-2], True
        if j == 0:
            lines[0] += " nowait"  # the second piece's rows are other elements: no wait between the two
        body += lines
    return ([f"  #pragma omp parallel num_threads(nthreads) if({n} >= {PARALLEL_MIN_WORK})", "  {", *body]
            + (["  vtc_stream_fence();"] if fenced else []) + ["  }"])


def _piece_rows(nests: list[list[str]], n: int, mark: str) -> list[str] | None:
    """The pieces of a split dim (their loop nests from ``_pointwise_kernel``) as one parallel loop over the
    rows they share, each row running the first piece's inner loop, then the next's (each in a block of its
    own, the first opened by `mark`: their index names repeat).  A row's ends are still in cache for its
    short run, where a wrap split's two loops one after the other came back to every row
    (``bench/roll_split_variants.cpp``); n: the whole kernel's size (whether it runs in parallel).  None where
    the pieces walk different rows or stream."""
    if any(not ls[0].startswith("  #pragma omp parallel for ") or ls[1] != nests[0][1] or ls[-1] != "  }"
           or not ls[1].startswith("  for (int64_t o = 0; o < ") for ls in nests):
        return None
    lines = [f"  #pragma omp parallel for num_threads(nthreads) if({n} >= {PARALLEL_MIN_WORK})", nests[0][1], mark,
             *nests[0][2:-1]]
    for ls in nests[1:]:
        lines += ["    }", "    {", *ls[2:-1]]
    return lines + ["    }", "  }"]


def _inner_piece_kernel(k: Kernel, em: _Emitter) -> list[str] | None:
    """Pointwise kernel k with its inner loop split into the ranges of its index over which every piece choice
    on that index alone is decided (``INNER_PIECES``), the ranges of each row one after another; None where
    there is one range, a range below ``MIN_INNER_PIECE`` in float32, or the pieces do not run row by row."""
    if not INNER_PIECES or not MERGE_INNER_DIMS.get():
        return None
    d = len(k.domain) - 1
    ranges = decided_ranges(k.roots(), f"i{d}", k.domain[d], MAX_INNER_PIECES)
    if len(ranges) < 2 or (not low_precision(k) and min(hi - lo for lo, hi in ranges) < MIN_INNER_PIECE):
        return None
    return _piece_rows([_pointwise_kernel(p, em, split=False) for p in _dim_pieces(k, d, ranges)],
                       math.prod(k.domain), INNER_PIECES_MARK)


def _pointwise_kernel(k: Kernel, em: _Emitter, split: bool = True) -> list[str]:
    em.index_temps.clear()  # an earlier nest's (a split's piece, or a split tried and not taken): out of scope
    shape = k.domain
    n = math.prod(shape)
    if not shape:
        return em.hoist([s.value for s in k.stores], "  ") + [_store(em, s, "  ") for s in k.stores]
    names = [f"i{d}" for d in range(len(shape))]
    par = f"  #pragma omp parallel for num_threads(nthreads) if({n} >= {PARALLEL_MIN_WORK})"
    loads = transposed_loads(k, em.shapes) if not low_precision(k) else []
    if split and not loads and (pieces := _wrap_split_kernel(k, em)):  # a roll: two loop nests, longer rows
        return pieces
    if split and not loads and (pieces := _inner_piece_kernel(k, em)):  # a piece choice on the inner index
        return pieces
    if loads:  # reads across rows through 16 x 16 register transposes (vtc.codegen.tiles)
        return tiled_transpose_kernel(k, em, loads, par, _decompose, _store)
    if len(shape) >= 2 and min(shape[-2:]) > TILE and _strided_inner_read(k, em):
        a, b = shape[-2], shape[-1]
        ta, tb = f"(({a} + {TILE - 1}) / {TILE})", f"(({b} + {TILE - 1}) / {TILE})"  # in C: polynomial literals
        outer = n // (a * b)
        lines = [par, f"  for (int64_t t = 0; t < {outer} * {ta} * {tb}; ++t) {{",
                 f"    const int64_t o = t / ({ta} * {tb}), ta = (t / {tb}) % {ta}, tb = t % {tb};"]
        lines += _decompose(names[:-2], shape[:-2], "o", "    ")
        em.forget()
        if low_precision(k):  # 16-bit loads across rows: staged per tile (no 16-bit gather; vtc.codegen.low_tiles)
            lines += staged_loads(k, em, names, (a, b), TILE, "    ")
        lines += [f"    for (int64_t {names[-2]} = ta * {TILE}; {names[-2]} < std::min<int64_t>(ta * {TILE} + {TILE}, {a}); "
                  f"++{names[-2]}) {{",
                  "      #pragma omp simd",
                  f"      for (int64_t {names[-1]} = tb * {TILE}; {names[-1]} < std::min<int64_t>(tb * {TILE} + {TILE}, {b}); "
                  f"++{names[-1]}) {{"]
        close, indent = ["      }", "    }", "  }"], "        "
    else:
        m = _merged_inner_dims(k, em)
        last = math.prod(shape[-m:])
        rows = n // last if last else 0
        lines = [par, f"  for (int64_t o = 0; o < {rows}; ++o) {{"]
        lines += _decompose(names[:-m], shape[:-m], "o", "    ")
        lines += [f"    const int64_t {v} = 0;" for v, size in zip(names[-m:-1], shape[-m:-1]) if size > 1]
        lines += em.hoist_index_loads(k, names[-1], "    ")
        em.forget()
        lines += em.hoist_invariant([s.value for s in k.stores], {names[-1]}, "    ")  # e.g. a per-channel scale
        if not low_precision(k) and stream.applies(k, em.shapes, k.stores, names[-1]):  # a large output: non-temporal stores
            plain = lambda lo, hi, ind: _store_loop(em, k.stores, names[-1], lo, hi, ind)
            return stream.fenced(lines + stream.streamed_loop(em, k.stores, names[-1], "0", str(last), "    ", plain)
                                 + ["  }"])
        vector = low_precision(k) and low_vector.vector_loop(em, k.stores, names[-1], "0", str(last), "    ", _LOW,
                                                             _UNARY_FMT)
        if vector:  # 16-bit conversions as vector code where the target has them, the scalar loop elsewhere
            lines += [f"#if defined({low_vector.TARGET})", *vector, "#else"]
        lines += ["    #pragma omp simd", f"    for (int64_t {names[-1]} = 0; {names[-1]} < {last}; ++{names[-1]}) {{"]
        close, indent = ["    }", *(["#endif"] if vector else []), "  }"], "      "
    lines += em.hoist([s.value for s in k.stores], indent)
    lines += [_store(em, s, indent) for s in k.stores]
    return lines + close


def _store_loop(em: _Emitter, stores, var: str, lo: str, hi: str, indent: str) -> list[str]:
    """``omp simd`` loop over var in [lo, hi) making `stores` (their shared scalars as temps)."""
    lines = [f"{indent}#pragma omp simd", f"{indent}for (int64_t {var} = {lo}; {var} < {hi}; ++{var}) {{"]
    lines += em.hoist([s.value for s in stores], indent + "  ")
    return lines + [_store(em, s, indent + "  ") for s in stores] + [f"{indent}}}"]


def _reduction_loop(red, em: _Emitter, rloop: str, r_extent: int, store_term: str | None = None) -> list[str]:
    """The loop over r accumulating one reduction; max/min keep a NaN flag so they may vectorise; a sum over
    adds into a vector of partial sums (``_lane_sum_loop``).

    `store_term`: an element of an output that the term is also written to (``vtc.codegen.reuse``)."""
    acc, t = f"acc_{red.name}", ctype(red.dtype)
    em.forget()
    lanes = _lanes_bytes(r_extent) // red.dtype.itemsize
    vector = (red.combine == "sum" and store_term is None and t == "float" and low_precision(em.k)
              and low_vector.vector_sums(em, red.value, "r", "rb_", lanes, f"{acc}_part", _UNARY_FMT))
    body = em.hoist([red.value], "      ")
    v = em.scalar(red.value)
    if store_term is not None:
        body.append(f"      const {ctype(red.value.dtype)} term_ = {v};")
        body.append(f"      {store_term} = term_;")
        v = "term_"
    if red.combine == "sum":
        return _lane_sum_loop(acc, body, v, r_extent, lanes, vector or None)
    if red.combine in ("max", "min") and red.dtype.is_floating_point and r_extent >= LONG_ROW:
        return _lane_extreme_loop(red, acc, body, v, r_extent, lanes)
    if red.combine in _ASSOC:
        op = _ASSOC[red.combine]
        return [f"    #pragma omp simd reduction({op}:{acc})", f"    {rloop}", *body,
                f"      {acc} = {acc} {op} {v};", "    }"]
    cmp = ">" if red.combine == "max" else "<"
    if not red.dtype.is_floating_point:
        return [f"    #pragma omp simd reduction({red.combine}:{acc})", f"    {rloop}", *body,
                f"      {{ const {t} v_ = {v}; {acc} = v_ {cmp} {acc} ? v_ : {acc}; }}", "    }"]
    # the NaN flag is an int combined with |: a bool flag with || keeps gcc from vectorising the loop
    return [f"    int {acc}_nan = 0;",
            f"    #pragma omp simd reduction({red.combine}:{acc}) reduction(|:{acc}_nan)", f"    {rloop}", *body,
            f"      {{ const {t} v_ = {v}; {acc} = v_ {cmp} {acc} ? v_ : {acc}; {acc}_nan = {acc}_nan | (v_ != v_); }}",
            "    }", f"    if ({acc}_nan) {acc} = ({t})NAN;"]


_SUM_LANES_BYTES = 64  # a sum's partial sums: one 64-byte vector (16 floats)
SUM_TAIL_APART = True  # False: a row sum's tail is added into the partial sums (a switch for side-by-side timing)
# From this row length on, a sum / max / min keeps two vectors of partials (32 floats): two independent
# chains of vector adds (maxes), where one chain's latency bounds a long row read from cache (kernel alone,
# 1 MB, 1 thread: sum over 4096 0.025 -> 0.016 ms, amax over 4096 0.028 -> 0.017 ms, over 1024 0.021 ->
# 0.017 ms; amax over 256 the same; over 64-96 gcc's own `omp simd reduction(max:)` stays the fastest)
LONG_ROW = 512


def _lanes_bytes(r_extent: int) -> int:
    """Bytes of partial results a reduction over r_extent keeps: one vector, two from ``LONG_ROW`` on."""
    return 2 * _SUM_LANES_BYTES if r_extent >= LONG_ROW else _SUM_LANES_BYTES


def _lane_extreme_loop(red, acc: str, body: list[str], v: str, r_extent: int, lanes: int) -> list[str]:
    """A float max / min over a long row as `lanes` partial results with a NaN flag each (like
    ``_lane_sum_loop``), folded by halves, then combined into `acc` (NaN if any element was NaN)."""
    t, cmp = ctype(red.dtype), (">" if red.combine == "max" else "<")
    part, nan, full = f"{acc}_part", f"{acc}_npart", f"({r_extent} - {r_extent} % {lanes})"
    take = lambda at, x: f"{part}[{at}] = {x} {cmp} {part}[{at}] ? {x} : {part}[{at}];"  # noqa: E731
    inner = [f"  {line}" for line in body]
    lines = [f"    alignas(64) {t} {part}[{lanes}];", f"    alignas(64) int {nan}[{lanes}] = {{}};",
             f"    for (int l = 0; l < {lanes}; ++l) {part}[l] = {acc};",
             f"    for (int64_t rb_ = 0; rb_ + {lanes} <= {r_extent}; rb_ += {lanes}) {{",
             "      #pragma omp simd", f"      for (int64_t r = rb_; r < rb_ + {lanes}; ++r) {{", *inner,
             f"        {{ const {t} v_ = {v}; {take('r - rb_', 'v_')} {nan}[r - rb_] |= (v_ != v_); }}",
             "      }", "    }",
             f"    for (int64_t r = {full}; r < {r_extent}; ++r) {{", *body,
             f"      {{ const {t} v_ = {v}; {take(f'r - {full}', 'v_')} {nan}[r - {full}] |= (v_ != v_); }}", "    }"]
    width = lanes // 2
    while width >= 1:
        lines += ["    #pragma omp simd", f"    for (int64_t l = 0; l < {width}; ++l) {{ {take('l', f'{part}[l + {width}]')} "
                  f"{nan}[l] |= {nan}[l + {width}]; }}"]
        width //= 2
    return lines + [f"    {acc} = {part}[0] {cmp} {acc} ? {part}[0] : {acc};",
                    f"    if ({nan}[0]) {acc} = ({t})NAN;"]


def _lane_sum_loop(acc: str, body: list[str], v: str, r_extent: int, lanes: int,
                   vector: list[str] | None = None) -> list[str]:
    """A sum over r as `lanes` partial sums, one per r modulo `lanes` (a vector register the loop adds to),
    folded by halves at the end (log2(lanes) vector adds), then added to `acc`; `vector`: a block's adds as
    float16 vector code (``low_vector.vector_sums``) where the target has it.

    The loop ``#pragma omp simd reduction(+:acc)`` emits sums its lanes one after another after the loop:
    gcc's omp simd epilogue is 15 dependent scalar adds for 16 floats, ~60 cycles per reduction, as much as
    the loop itself on a row of 96 (a layer norm over 96 channels: 3 of the 4 reductions' cost).

    The tail (r_extent % lanes elements) is summed into its own scalar, added after the fold: added into the
    partial sums, its scalar store into the vector gcc keeps them in (on the stack for the fold) defeated
    store-to-load forwarding of the fold's wider load, ~50 cycles per row (a mean over 7x7 = 49 of 1024 rows,
    kernel alone, 1 thread: 13.5 -> 6.5 us, docs/gemm.md)."""
    part, tail, full = f"{acc}_part", f"{acc}_tail", f"({r_extent} - {r_extent} % {lanes})"
    inner = [f"  {line}" for line in body]
    # the same text whatever the row length but for the literal r_extent (size-generic kernels fit it as a
    # polynomial of the sizes, vtc.runtime.generic): the tail loop is there even when it runs no time
    lines = [f"    alignas(64) decltype({acc}) {part}[{lanes}] = {{}};",
             f"    for (int64_t rb_ = 0; rb_ + {lanes} <= {r_extent}; rb_ += {lanes}) {{",
             *([f"#if defined({low_vector.TARGET})", *[f"      {line}" for line in vector], "#else"] if vector else []),
             "      #pragma omp simd", f"      for (int64_t r = rb_; r < rb_ + {lanes}; ++r) {{", *inner,
             f"        {part}[r - rb_] = {part}[r - rb_] + {v};", "      }", *(["#endif"] if vector else []), "    }",
             *([f"    decltype({acc}) {tail} = 0;"] if SUM_TAIL_APART else []),
             f"    for (int64_t r = {full}; r < {r_extent}; ++r) {{", *body,
             f"      {tail} = {tail} + {v};" if SUM_TAIL_APART else f"      {part}[r - {full}] = {part}[r - {full}] + {v};",
             "    }"]
    width = lanes // 2
    while width >= 2:
        lines += ["    #pragma omp simd", f"    for (int64_t l = 0; l < {width}; ++l) {part}[l] = {part}[l] + {part}[l + {width}];"]
        width //= 2
    if not SUM_TAIL_APART:
        return lines + [f"    {acc} = {acc} + ({part}[0] + {part}[1]);"]
    return lines + [f"    {acc} = {acc} + (({part}[0] + {part}[1]) + {tail});"]


def _row_order(k: Kernel, em: _Emitter) -> list[int]:
    """The order of the kept dims in a row kernel's row loop, the last one varying fastest.

    The domain order, except when the loads step through memory less along another dim than
    along the last one (a permute in front of a softmax: neighbouring rows share cache lines):
    that dim then varies fastest, so the rows that share a cache line run one after another and
    the line is fetched once for all of them.
    """
    from vtc.codegen.lower import scalars_of
    from vtc.index.expr import affine

    dims = [d for d, s in enumerate(k.domain) if s > 1]
    order = list(range(len(k.domain)))
    if len(dims) < 2:
        return order
    step: dict[int, int] = {}
    for s in scalars_of(k):
        if s.op != "load":
            continue
        form = affine(linear_offset(s.args[1], em.shapes[s.args[0]]))
        for d in dims:
            c = abs(form[1].get(f"i{d}", 0)) if form is not None else 0
            if c:
                step[d] = min(step.get(d, c), c)
    if not step:
        return order
    best = min(step, key=lambda d: (step[d], -d))
    if best != dims[-1] and step[best] < step.get(dims[-1], 1 << 62):
        order.remove(best)
        order.append(best)
    return order


def _row_kernel(k: Kernel, em: _Emitter) -> list[str]:
    lanes = lane_row_kernel(k, em, PARALLEL_MIN_WORK, _decompose, _store) if not low_precision(k) else None
    if lanes is not None:  # rows read with a stride, neighbouring rows adjacent: rows as vector lanes
        return lanes
    blocks = None
    if not low_precision(k) and row_blocks.applies(
            k, row_stage.staged_row(k) is not None, stored_term(k) is not None,
            stream.applies(k, em.shapes, [s for s in k.stores if s.per_r], "r")):
        blocks = row_blocks.block_row_kernel(k, em, _row_order(k, em), _decompose, _store, _UNARY_FMT,
                                             PARALLEL_MIN_WORK)
    plain = _plain_row_kernel(k, em)
    if blocks is None:
        return plain
    # short float32 sums (a layer norm): a block of rows per vector step where the target has AVX-512
    return [f"#if defined({low_vector.TARGET})", *blocks, "#else", *plain, "#endif"]


def _plain_row_kernel(k: Kernel, em: _Emitter) -> list[str]:
    """The row kernel one row at a time: each pass a loop over r, the sums into a vector of partial sums."""
    rows = math.prod(k.domain)
    names = [f"i{d}" for d in range(len(k.domain))]
    lines = [f"  #pragma omp parallel for num_threads(nthreads) if({rows * max(k.r_extent, 1)} >= {PARALLEL_MIN_WORK})",
             f"  for (int64_t o = 0; o < {rows}; ++o) {{"]
    order = _row_order(k, em)
    lines += _decompose([names[d] for d in order], tuple(k.domain[d] for d in order), "o", "    ")
    lines += em.hoist_index_loads(k, "r", "    ")
    lines += gathered_row_prefetch(k, em, names, order, rows, "    ")  # rows picked by an index tensor
    rloop = f"for (int64_t r = 0; r < {k.r_extent}; ++r) {{"
    stored = stored_term(k) if not low_precision(k) else None  # softmax: exp(x - max) stored by the sum pass,
    # scaled by the store pass
    if stored:
        stored_at = f"{em.ptr[stored.store.buffer.name]}[{em.linear(stored.store.buffer.name, stored.store.index)}]"
    staged = None if stored or low_precision(k) else row_stage.staged_row(k)
    if staged is not None:  # a row read through piece choices (a concat along r): computed once per row
        lines += row_stage.stage_lines(staged, em, k.r_extent, ctype(staged.dtype))
    for phase in k.phases:
        for red in phase:
            t = ctype(red.dtype)
            init = _INIT.get(red.combine) or ("-INFINITY" if red.combine == "max" else "INFINITY")
            if red.combine in ("max", "min") and not red.dtype.is_floating_point:
                lim = "min" if red.combine == "max" else "max"
                init = f"std::numeric_limits<{t}>::{'lowest' if lim == 'min' else 'max'}()"
            lines.append(f"    {t} acc_{red.name} = ({t}){init};")
        for red in phase:
            lines += _reduction_loop(red, em, rloop, k.r_extent,
                                     stored_at if stored and red is stored.reduction else None)
    per_r = [s for s in k.stores if s.per_r]
    streamed = not stored and not low_precision(k) and stream.applies(k, em.shapes, per_r, "r")  # a large output: non-temporal stores
    if per_r:
        em.forget()
        if stored:  # the term the sum pass stored, read back (in the loop below) instead of computed again
            em.temps[id(stored.reduction.value)] = "term_"
        lines += em.hoist_invariant([s.value for s in per_r], {"r"}, "    ", reductions_done=True)  # per row
        row_temps = {i: t for i, t in em.temps.items() if t != "term_"}  # declared in the row's scope
    if streamed:
        lines += stream.streamed_loop(em, per_r, "r", "0", str(k.r_extent), "    ",
                                      lambda lo, hi, ind: _store_loop(em, per_r, "r", lo, hi, ind))
    elif per_r:
        vector = low_precision(k) and low_vector.vector_loop(em, per_r, "r", "0", str(k.r_extent), "    ", _LOW,
                                                             _UNARY_FMT)
        if vector:  # 16-bit conversions as vector code where the target has them, the scalar loop elsewhere
            lines += [f"#if defined({low_vector.TARGET})", *vector, "#else"]
        lines += ["    #pragma omp simd", f"    {rloop}"]
        if stored:
            lines.append(f"      const {ctype(stored.reduction.value.dtype)} term_ = {stored_at};")
        lines += em.hoist([s.value for s in per_r], "      ")
        lines += [_store(em, s, "      ") for s in per_r]
        lines += ["    }", *(["#endif"] if vector else [])]
    once = [s for s in k.stores if not s.per_r]
    em.forget()
    if per_r:  # the per-row temps are in scope (and a new temp must not take one of their names)
        em.temps.update(row_temps)
    lines += em.hoist([s.value for s in once], "    ")
    lines += [_store(em, s, "    ") for s in once]
    lines.append("  }")
    em.pinned.clear()
    return stream.fenced(lines) if streamed else lines
