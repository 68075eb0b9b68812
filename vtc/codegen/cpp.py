"""C++ (OpenMP) code generator: one ``Kernel`` -> one ``extern "C"`` function.

Generated functions take ``void* const* bufs``: the kernel's input buffers in
``kernel.inputs`` order, then its output buffers in store order (each once),
all contiguous.  Loop structure:

- pointwise: ``parallel for`` over the rows (all dims but the last), the row
  index split into i0, i1, ...; an ``omp simd`` loop over the last dim;
- row kernels (reductions, softmax, norms): ``parallel for`` over the kept
  dims; per reduction pass an inner loop over r (``simd reduction`` where the
  combine is associative), then the per-element and per-row stores.

Index expressions become integer C (plain ``/`` and ``%`` where the range
analysis proves the operand non-negative); a virtual tensor's piece choice
becomes a ternary whose untaken side is never loaded.  Common scalar
subexpressions outside such choices are emitted once per loop body.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from vtc.codegen.kernel_ir import Buffer, Kernel, Scalar
from vtc.codegen.ops import C_TYPES
from vtc.index.expr import Expr
from vtc.index.mapping import contiguous_strides

PARALLEL_MIN_WORK = 1 << 15  # elements (times r) below which a kernel runs on one thread

PRELUDE = r"""
#include <cstdint>
#include <cmath>
#include <algorithm>
#include <limits>
static inline int64_t vtc_floordiv(int64_t a, int64_t b) { int64_t q = a / b; return q - ((a % b != 0) & ((a < 0) != (b < 0))); }
static inline int64_t vtc_mod(int64_t a, int64_t b) { int64_t r = a % b; return r + ((r != 0) & ((r < 0) != (b < 0))) * b; }
template <class T> static inline T vtc_max(T a, T b) { return (a > b || a != a) ? a : b; }
template <class T> static inline T vtc_min(T a, T b) { return (a < b || a != a) ? a : b; }
template <class T> static inline T vtc_sigmoid(T x) { return T(1) / (T(1) + std::exp(-x)); }
template <class T> static inline T vtc_gelu(T x) { return T(0.5) * x * (T(1) + std::erf(x * T(0.70710678118654752440))); }
template <class T> static inline T vtc_gelu_tanh(T x) {
  return T(0.5) * x * (T(1) + std::tanh(T(0.79788456080286535588) * (x + T(0.044715) * x * x * x))); }
template <class T> static inline T vtc_fmod_floor(T a, T b) { T r = std::fmod(a, b); return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
template <class T> static inline T vtc_sign(T x) { return (T)((x > 0) - (x < 0)); }
"""

_UNARY_FMT = {
    "neg": "(-{x})", "exp": "std::exp({x})", "log": "std::log({x})", "tanh": "std::tanh({x})",
    "sigmoid": "vtc_sigmoid({x})", "relu": "vtc_max({x}, ({t})0)", "rsqrt": "(({t})1 / std::sqrt({x}))",
    "sqrt": "std::sqrt({x})", "abs": "std::abs({x})", "cos": "std::cos({x})", "sin": "std::sin({x})",
    "erf": "std::erf({x})", "reciprocal": "(({t})1 / {x})", "silu": "({x} * vtc_sigmoid({x}))",
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
    """The C type of a torch dtype."""
    return C_TYPES[dtype]


def literal(value, dtype: torch.dtype) -> str:
    """A C literal of `dtype`."""
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        v = float(value)
        suffix = "f" if dtype == torch.float32 else ""
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

    # -- index expressions ----------------------------------------------------
    def index(self, e: Expr) -> str:
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
        from vtc.index.expr import lift

        lin = lift(0)
        for i, s in zip(idx, contiguous_strides(self.shapes[buf])):
            lin = lin + i * s
        return self.index(lin)

    # -- scalar expressions ---------------------------------------------------
    def scalar(self, s: Scalar) -> str:
        t = self.temps.get(id(s))
        if t is not None:
            return t
        op, a, dt = s.op, s.args, s.dtype
        if op == "const":
            return literal(a[0], dt)
        if op == "load":
            return f"{self.ptr[a[0]]}[{self.linear(a[0], a[1])}]"
        if op == "iota":
            return f"(({ctype(dt)}){self.index(a[0])})"
        if op == "acc":
            return f"acc_{a[0]}"
        if op == "cast":
            x = self.scalar(a[0])
            return f"({x} != 0)" if dt == torch.bool else f"(({ctype(dt)}){x})"
        if op == "unary":
            return _UNARY_FMT[a[0]].format(x=self.scalar(a[1]), t=ctype(dt))
        if op == "binary":
            return self.binary(a[0], self.scalar(a[1]), self.scalar(a[2]), a[1].dtype, dt)
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

    def hoist(self, roots: list[Scalar], indent: str) -> list[str]:
        """Temps for scalars used more than once outside piece choices (each emitted once)."""
        uses: dict[int, int] = {}
        order: list[Scalar] = []

        def visit(s: Scalar) -> None:
            uses[id(s)] = uses.get(id(s), 0) + 1
            if uses[id(s)] > 1:
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

    def forget(self) -> None:
        self.temps.clear()


def _outputs(k: Kernel) -> list[Buffer]:
    out: dict[str, Buffer] = {}
    for st in k.stores:
        out.setdefault(st.buffer.name, st.buffer)
    return list(out.values())


def buffer_order(k: Kernel) -> list[Buffer]:
    """The buffers in the order the generated function expects their pointers."""
    names = {b.name for b in k.inputs}
    return [*k.inputs, *[b for b in _outputs(k) if b.name not in names]]


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
    """The C++ source of kernel k (with the prelude), exporting `extern "C" void <k.name>(void* const*)`."""
    em = _Emitter(k)
    body: list[str] = []
    for b in buffer_order(k):
        qual = "" if b.name in {x.buffer.name for x in k.stores} else "const "
        body.append(f"  {qual}{ctype(b.dtype)}* __restrict {em.ptr[b.name]} = "
                    f"({qual}{ctype(b.dtype)}*)bufs[{list(em.ptr).index(b.name)}];")
    body += _row_kernel(k, em) if k.kind == "row" else _pointwise_kernel(k, em)
    return PRELUDE + f'\nextern "C" void {k.name}(void* const* bufs) {{\n' + "\n".join(body) + "\n}\n"


def _store(em: _Emitter, st, indent: str) -> str:
    return f"{indent}{em.ptr[st.buffer.name]}[{em.linear(st.buffer.name, st.index)}] = {em.scalar(st.value)};"


def _pointwise_kernel(k: Kernel, em: _Emitter) -> list[str]:
    shape = k.domain
    n = math.prod(shape)
    if not shape:
        return em.hoist([s.value for s in k.stores], "  ") + [_store(em, s, "  ") for s in k.stores]
    rows, last = n // shape[-1] if shape[-1] else 0, shape[-1]
    names = [f"i{d}" for d in range(len(shape))]
    lines = [f"  #pragma omp parallel for if({n} >= {PARALLEL_MIN_WORK})",
             f"  for (int64_t o = 0; o < {rows}; ++o) {{"]
    lines += _decompose(names[:-1], shape[:-1], "o", "    ")
    lines += ["    #pragma omp simd", f"    for (int64_t {names[-1]} = 0; {names[-1]} < {last}; ++{names[-1]}) {{"]
    em.forget()
    lines += em.hoist([s.value for s in k.stores], "      ")
    lines += [_store(em, s, "      ") for s in k.stores]
    lines += ["    }", "  }"]
    return lines


def _row_kernel(k: Kernel, em: _Emitter) -> list[str]:
    rows = math.prod(k.domain)
    names = [f"i{d}" for d in range(len(k.domain))]
    lines = [f"  #pragma omp parallel for if({rows * max(k.r_extent, 1)} >= {PARALLEL_MIN_WORK})",
             f"  for (int64_t o = 0; o < {rows}; ++o) {{"]
    lines += _decompose(names, k.domain, "o", "    ")
    rloop = f"for (int64_t r = 0; r < {k.r_extent}; ++r) {{"
    for phase in k.phases:
        for red in phase:
            t = ctype(red.dtype)
            init = _INIT.get(red.combine) or ("-INFINITY" if red.combine == "max" else "INFINITY")
            if red.combine in ("max", "min") and not red.dtype.is_floating_point:
                lim = "min" if red.combine == "max" else "max"
                init = f"std::numeric_limits<{t}>::{'lowest' if lim == 'min' else 'max'}()"
            lines.append(f"    {t} acc_{red.name} = ({t}){init};")
        for red in phase:
            pragma = f"    #pragma omp simd reduction({_ASSOC[red.combine]}:acc_{red.name})" \
                if red.combine in _ASSOC else None
            if pragma:
                lines.append(pragma)
            lines.append(f"    {rloop}")
            em.forget()
            lines += em.hoist([red.value], "      ")
            v = em.scalar(red.value)
            if red.combine in _ASSOC:
                lines.append(f"      acc_{red.name} = acc_{red.name} {_ASSOC[red.combine]} {v};")
            else:
                lines.append(f"      acc_{red.name} = vtc_{red.combine}<{ctype(red.dtype)}>(acc_{red.name}, {v});")
            lines.append("    }")
    per_r = [s for s in k.stores if s.per_r]
    if per_r:
        lines += ["    #pragma omp simd", f"    {rloop}"]
        em.forget()
        lines += em.hoist([s.value for s in per_r], "      ")
        lines += [_store(em, s, "      ") for s in per_r]
        lines.append("    }")
    once = [s for s in k.stores if not s.per_r]
    em.forget()
    lines += em.hoist([s.value for s in once], "    ")
    lines += [_store(em, s, "    ") for s in once]
    lines.append("  }")
    return lines
