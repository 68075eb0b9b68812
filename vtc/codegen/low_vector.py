"""A float16 pointwise loop, and a float16 row kernel's store pass and sums, written as vector code: 16 elements a
step in AVX-512 registers.

gcc vectorises a float16 loop of scalar code only through the CPU conversions' ``simd`` clones
(vecmath.LOW_PRECISION_PRELUDE), out-of-line calls that it does not inline: each widening, rounding and narrowing
of 16 elements is a call, and every vector register lives across it in memory (float16 k-RoPE: 8 calls per 16
elements, ~2x its float32 twin; docs/low_precision.md, session 26).  Here the loop is emitted as vector code
instead: each scalar of the loop body once, as a ``__m512`` of 16 lanes (``vtc_v16_*`` in vecmath's prelude:
``vcvtph2ps`` loads, ``vcvtps2ph`` roundings and stores, masked for the last step), + - * / and negation as
vector operators, any other float op by its scalar C over the 16 lanes in an ``omp simd`` loop of its own.  The
same ops on the same float32 values, rounded where the scalar loop rounds: bit for bit its results, but for the
sign of a NaN (gcc may swap an add's operands: a row sum over +inf, -inf and NaN is -NaN in the scalar loop and
+NaN, as eager's, here; fuzz6, docs/robustness.md).

Only in kernels that read or write float16, where every load and store moves along the loop contiguously (or not
at all: a broadcast), every value is a float16 or float32 and no piece choice or ``where`` is left; else ``None``
and the caller keeps its scalar loop, which is also the portable form the source keeps for targets without
AVX-512 and F16C.  Not bfloat16: its scalar conversions are inline integer ops that gcc vectorises, and the same
ops written here measured no faster (docs/low_precision.md, session 26).
"""
from __future__ import annotations

import torch

from vtc.codegen.kernel_ir import Scalar
from vtc.index.expr import Expr, _terms, free_vars
from vtc.index.mapping import linear_offset

VECTOR_LOOPS = True  # False: the scalar loop only (A / B)
TARGET = "VTC_V16"  # defined by vecmath.LOW_PRECISION_PRELUDE where the target has the instructions
_WIDTH = 16
_FLOATS = {torch.float16: "f16", torch.float32: "f32"}
_VECTOR_OP = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


def _step(e: Expr, var: str) -> int | None:
    """1 where offset e moves by one element as `var` does, 0 where it does not move, None otherwise."""
    if var not in free_vars(e):
        return 0
    _, terms = _terms(e)
    moving = [(atom, k) for atom, k in terms.items() if var in free_vars(atom)]
    if len(moving) == 1 and moving[0][0].op == "var" and moving[0][1] == 1:
        return 1
    return None


class Unsupported(Exception):
    """A value or store that this vector code does not write."""


class _VectorBody:
    """The loop body's statements: each scalar once as a vector temp (``v<n>_``), built from the scalar
    emitter's text where a value does not change along the loop."""

    def __init__(self, em, var: str, uses: dict[int, int], unary_fmt: dict):
        self.em, self.var, self.uses = em, var, uses
        self.unary_fmt = unary_fmt
        self.lines: list[str] = []
        self.names: dict[tuple[int, bool], str] = {}
        self.count = 0

    def _new(self, text: str) -> str:
        name, self.count = f"v{self.count}_", self.count + 1
        self.lines.append(f"const __m512 {name} = {text};")
        return name

    def _rounds(self, s: Scalar) -> bool:
        return self.em.rounds(s)  # the scalar emitter's rule

    def value(self, s: Scalar, rounded: bool = True) -> str:
        """s as a vector (rounded to its dtype as the scalar loop rounds it; not `rounded`: a stored value,
        narrowed by its store, unless a temp holds it rounded)."""
        if s.dtype not in _FLOATS:
            raise Unsupported(s.dtype)
        return self._named(s, (rounded or self.uses.get(id(s), 0) > 1) and self._rounds(s))

    def _named(self, s: Scalar, rounded: bool) -> str:
        key = (id(s), rounded)
        if key not in self.names:
            if (t := self.em.temps.get(id(s))) is not None:  # computed before the loop
                self.names[key] = self._new(f"_mm512_set1_ps({t})")
            elif rounded:
                self.names[key] = self._new(f"vtc_v16_round_{_FLOATS[s.dtype]}({self._named(s, False)})")
            else:
                self.names[key] = self._unrounded(s)
        return self.names[key]

    def _unrounded(self, s: Scalar) -> str:
        op, a = s.op, s.args
        if op == "const":
            return self._new(f"_mm512_set1_ps({self.em.unrounded(s)})")
        if op == "acc":  # a reduction's result, in a row kernel's store pass
            return self._new(f"_mm512_set1_ps(acc_{a[0]})")
        if op == "load":
            step = _step(linear_offset(a[1], self.em.shapes[a[0]]), self.var)
            if step == 0:
                return self._new(f"_mm512_set1_ps({self.em.unrounded(s)})")
            if step is None:
                raise Unsupported("a load across the loop")
            return self._new(f"vtc_v16_load_{_FLOATS[s.dtype]}(vm_, {self.em.ptr[a[0]]} + {self.em.linear(a[0], a[1])})")
        if op == "cast" and a[0].dtype in _FLOATS:
            return self.value(a[0])
        if op == "unary" and a[0] == "neg":
            return self._new(f"-{self.value(a[1])}")
        if op == "unary" and a[1].dtype in _FLOATS:
            return self._lanes([self.value(a[1])], lambda x: self.unary_fmt[a[0]].format(x=x[0], t="float"))
        if op == "binary" and a[0] in _VECTOR_OP:
            return self._new(f"{self.value(a[1])} {_VECTOR_OP[a[0]]} {self.value(a[2])}")
        if op == "binary":
            return self._lanes([self.value(a[1]), self.value(a[2])],
                               lambda x: self.em.binary(a[0], x[0], x[1], a[1].dtype, s.dtype))
        raise Unsupported(op)

    def _lanes(self, operands: list[str], text) -> str:
        """The scalar op `text` of the operands' lanes, in an ``omp simd`` loop over the 16 lanes (its own
        vector code: vecmath's functions are scalar C that gcc vectorises and inlines)."""
        n, self.count = self.count, self.count + 1
        arrays = [f"l{n}_{j}_" for j in range(len(operands))]
        self.lines += [f"float {a}[16], r{n}_[16];" if j == 0 else f"float {a}[16];" for j, a in enumerate(arrays)]
        self.lines += [f"_mm512_storeu_ps({a}, {v});" for a, v in zip(arrays, operands)]
        self.lines += ["#pragma omp simd", f"for (int l_ = 0; l_ < 16; ++l_) r{n}_[l_] = {text([f'{a}[l_]' for a in arrays])};"]
        return self._new(f"_mm512_loadu_ps(r{n}_)")


def _applies(em) -> bool:
    return VECTOR_LOOPS and torch.float16 in {b.dtype for b in [*em.k.inputs, *(st.buffer for st in em.k.stores)]}


def _uses(em, roots: list[Scalar]) -> dict[int, int]:
    """How often each scalar under `roots` is read (those used more than once are the scalar loop's temps,
    rounded to their dtype: ``_Emitter.hoist``)."""
    uses: dict[int, int] = {}

    def count(s: Scalar) -> None:
        uses[id(s)] = uses.get(id(s), 0) + 1
        if uses[id(s)] == 1 and id(s) not in em.temps:
            for x in s.args:
                if isinstance(x, Scalar):
                    count(x)

    for r in roots:
        count(r)
    return uses


def vector_loop(em, stores, var: str, lo: str, hi: str, indent: str, low: dict,
                unary_fmt: dict, f32: bool = False) -> list[str] | None:
    """The loop over var in [lo, hi) making `stores` as vector code (module doc), its lines at `indent`; None
    where it does not apply.  `em`: the kernel's scalar emitter (its temps: values computed before the loop);
    low / unary_fmt: the scalar emitter's 16-bit dtypes and op texts (vtc.codegen.cpp; its rounding rule is
    ``em.rounds``); `f32`: also in a kernel without float16 (a block of float32 rows, ``vtc.codegen.row_blocks``)."""
    if not (f32 or _applies(em)):
        return None
    body = _VectorBody(em, var, _uses(em, [st.value for st in stores]), unary_fmt)
    writes = []
    try:
        for st in stores:
            dt, name = st.buffer.dtype, st.buffer.name
            if dt not in _FLOATS or getattr(st, "when", None) is not None or \
                    _step(linear_offset(st.index, em.shapes[name]), var) != 1:
                return None
            v = body.value(st.value, rounded=dt not in low)  # as the scalar emitter's ``stored``
            writes.append(f"vtc_v16_store_{_FLOATS[dt]}(vm_, {em.ptr[name]} + {em.linear(name, st.index)}, {v});")
    except Unsupported:
        return None
    inner = indent + "  "
    return [f"{indent}for (int64_t {var} = {lo}; {var} < {hi}; {var} += {_WIDTH}) {{",
            f"{inner}const __mmask16 vm_ = vtc_v16_mask({hi} - {var});",
            *[inner + line for line in body.lines + writes], f"{indent}}}"]


def vector_sums(em, value: Scalar, var: str, base: str, lanes: int, part: str,
                unary_fmt: dict) -> list[str] | None:
    """Lines adding `value` at var = base + j into the partial sum ``part[j]``, j < lanes (a row kernel's sum,
    ``cpp._lane_sum_loop``), 16 lanes a vector: the same adds, lane by lane, as its scalar loop; None where
    the vector form does not apply."""
    if not _applies(em) or lanes % _WIDTH:
        return None
    lines, uses = [], _uses(em, [value])
    for j in range(0, lanes, _WIDTH):
        body = _VectorBody(em, var, uses, unary_fmt)
        try:
            v = body.value(value)
        except Unsupported:
            return None
        lines += ["{", f"  const int64_t {var} = {base} + {j};", "  const __mmask16 vm_ = (__mmask16)0xFFFFu;",
                  *[f"  {line}" for line in body.lines],
                  f"  _mm512_store_ps({part} + {j}, _mm512_load_ps({part} + {j}) + {v});", "}"]
    return lines
