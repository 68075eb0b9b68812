"""Kernel IR: what one generated kernel loads, computes and stores.

A kernel iterates over a *domain* (the shape of what it stores) and, for
reductions and row kernels, over one reduced index ``r`` per output element.
Its three stages:

- **load**: ``Scalar("load", (buffer, index))`` leaves read a physical buffer at
  an index expression of the index algebra.  Virtual tensors appear only here:
  the index is a composed mapping, and a piece chosen by an index predicate is
  a ``Scalar("pick", (predicate, a, b))``; a padding fill is a constant.
- **compute**: a DAG of scalar ops (``unary``/``binary``/``fma``/``where``/
  ``cast``/``const``/``iota``), the same whether the inputs were physical or
  virtual.
- **store**: each output buffer is written at the domain index (contiguous); a
  pushed op's input is instead stored through the op's push mapping into the
  op's output (``vtc.codegen.push``; that buffer is then also among the
  kernel's inputs when an earlier kernel allocated it: written in place); a
  GEMM's store through a chain of movement ops holds only where its ``when``
  does (``vtc.codegen.gemm_push``).

Scalars are hash-consed (``Scalar.make``), so common subexpressions are shared
and the code generators can emit each once.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from vtc.index.expr import Expr, add, evaluate, free_vars, loads, subs, var
from vtc.ir.graph import _itemsize

# weak: a scalar that no kernel IR holds any more is forgotten (a strong table grew by ~85 scalars, their keys and
# the index expressions they hold, with every new length of a DynamicCache decode loop, for the process's life)
_TABLE: "weakref.WeakValueDictionary[tuple, Scalar]" = weakref.WeakValueDictionary()


class Scalar:
    """A hash-consed scalar expression node with a torch dtype."""

    __slots__ = ("op", "args", "dtype", "__weakref__")

    def __init__(self, op: str, args: tuple, dtype: torch.dtype) -> None:
        self.op, self.args, self.dtype = op, args, dtype

    @staticmethod
    def make(op: str, args: tuple, dtype: torch.dtype) -> "Scalar":
        """The unique node for (op, args, dtype)."""
        key = (op, args, dtype)
        hit = _TABLE.get(key)
        if hit is None:
            hit = _TABLE[key] = Scalar(op, args, dtype)
        return hit

    # hash-consed: identity is equality, object's own __hash__ / __eq__ (C slots, not Python methods)

    def __repr__(self) -> str:
        return f"Scalar({self.op}, {self.args!r}, {self.dtype})"


def clear_cache() -> None:
    """Forgets hash-consed scalars (between compilations, to bound memory)."""
    _TABLE.clear()


def const(value: float | int | bool, dtype: torch.dtype) -> Scalar:
    """A constant of `dtype` (a bfloat16 / float16 one: the value rounded to the dtype, as a tensor of it holds)."""
    if dtype == torch.bool:
        value = bool(value)
    elif not dtype.is_floating_point:
        value = int(value)
    elif dtype in (torch.bfloat16, torch.float16):
        value = torch.tensor(float(value), dtype=torch.float32).to(dtype).item()
    else:
        value = float(value)
    return Scalar.make("const", (value,), dtype)


def load(buffer: str, index: tuple[Expr, ...], dtype: torch.dtype) -> Scalar:
    """buffer[index] (a physical tensor read at an index expression)."""
    return Scalar.make("load", (buffer, index), dtype)


def iota(e: Expr, dtype: torch.dtype) -> Scalar:
    """The integer value of index expression `e`, as `dtype` (arange and friends)."""
    return Scalar.make("iota", (e,), dtype)


def cast(x: Scalar, dtype: torch.dtype) -> Scalar:
    """x converted to dtype (identity when it already is)."""
    if x.dtype == dtype:
        return x
    if x.op == "const":
        return const(x.args[0], dtype)
    return Scalar.make("cast", (x,), dtype)


def unary(fn: str, x: Scalar, dtype: torch.dtype | None = None) -> Scalar:
    """fn(x), fn one of the names the code generators know (exp, tanh, ...)."""
    return Scalar.make("unary", (fn, x), dtype or x.dtype)


def binary(fn: str, a: Scalar, b: Scalar, dtype: torch.dtype | None = None) -> Scalar:
    """fn(a, b), fn one of add, sub, mul, div, max, min, pow, lt, ..."""
    return Scalar.make("binary", (fn, a, b), dtype or a.dtype)


def fma(a: Scalar, b: Scalar, c: Scalar) -> Scalar:
    """a * b + c rounded once (a fused multiply-add), of float32 or float64 values.  Only where a lowering asks
    for it (eager's kernel fuses it): a ``binary`` mul and add round twice, as eager's separate ops do."""
    assert a.dtype == b.dtype == c.dtype and a.dtype in (torch.float32, torch.float64), (a, b, c)
    return Scalar.make("fma", (a, b, c), a.dtype)


def where(c: Scalar, a: Scalar, b: Scalar) -> Scalar:
    """a if c else b (c computed by the compute stage)."""
    return Scalar.make("where", (c, a, b), a.dtype)


def pick(p: Expr, a: Scalar, b: Scalar) -> Scalar:
    """a if index predicate p holds else b (only the chosen side is loaded)."""
    if p.is_const:
        return a if p.value else b
    return Scalar.make("pick", (p, a, b), a.dtype)


def substitute(s: Scalar, env: dict, memo: dict) -> Scalar:
    """s with index variables replaced by env's expressions (in loads, index ramps and piece choices); a piece
    choice that this decides is replaced by its side.  `memo` maps id(scalar) -> result within one rewrite."""
    hit = memo.get(id(s))
    if hit is not None:
        return hit
    if s.op == "load":
        out = load(s.args[0], tuple(subs(e, env) for e in s.args[1]), s.dtype)
    elif s.op == "iota":
        out = iota(subs(s.args[0], env), s.dtype)
    elif s.op == "pick":
        out = pick(subs(s.args[0], env), substitute(s.args[1], env, memo), substitute(s.args[2], env, memo))
    else:
        out = Scalar.make(s.op, tuple(substitute(a, env, memo) if isinstance(a, Scalar) else a for a in s.args),
                          s.dtype)
    memo[id(s)] = out
    return out


def acc(name: str, dtype: torch.dtype) -> Scalar:
    """The value of a row kernel's named accumulator (e.g. the row max of a softmax)."""
    return Scalar.make("acc", (name,), dtype)


def acc_rounded(values: list) -> list | None:
    """`values` with each rounding of the accumulator to float16 (``cast(acc, float16)``) read as a float16 acc (the
    kernel rounds the block in place first: the float16 GEMM's and convolution's epilogues, vtc.codegen.gemm and
    vtc.codegen.conv_t), or None where a value also reads the float32 acc itself."""
    memo: dict = {}

    def sub(s):
        hit = memo.get(id(s))
        if hit is not None:
            return hit
        if s.op == "cast" and s.dtype == torch.float16 and s.args[0].op == "acc":
            out = Scalar.make("acc", s.args[0].args, torch.float16)
        else:
            args = tuple(sub(a) if isinstance(a, Scalar) else a for a in s.args)
            out = s if all(a is b for a, b in zip(args, s.args)) else Scalar.make(s.op, args, s.dtype)
        memo[id(s)] = out
        return out

    out = [sub(v) for v in values]
    accs = [x for x in scalars_under(out) if x.op == "acc"]
    return out if accs and all(x.dtype == torch.float16 for x in accs) else None


@dataclass
class Buffer:
    """A physical tensor a kernel reads or writes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = _itemsize(self.dtype)
        for s in self.shape:
            n *= s
        return n


@dataclass
class Reduction:
    """One accumulator of a row kernel: acc = combine(acc, value) over r in [0, extent)."""

    name: str
    combine: str  # "sum" | "max" | "min" | "prod" | "any" | "all"
    value: Scalar  # over the domain index and r
    dtype: torch.dtype


@dataclass
class Store:
    """buffer[index] = value; a per_r store is done for every r of the row, else once per row."""

    buffer: Buffer
    index: tuple[Expr, ...]
    value: Scalar
    per_r: bool = False
    when: Expr | None = None  # only where this predicate holds (a GEMM's store through a push, vtc.codegen.gemm_push)


@dataclass
class Kernel:
    """One generated kernel: loops over `domain` (and r), computes, stores.

    Domain variables are ``i0, i1, ...``; a row kernel also has ``r`` in
    [0, r_extent).  `phases` are its reduction passes over r, in order; a pass
    may read the accumulators of earlier passes (``acc``), and so may the
    stores.  A pointwise kernel has no phases and r_extent 0.
    """

    name: str
    kind: str  # "pointwise" | "row" | "copy" (realises a virtual value) | "move" (runs a kept movement op)
    #          | "gemm" | "attention" (vtc.codegen.attention.AttentionKernel)
    domain: tuple[int, ...]
    r_extent: int
    phases: list[list[Reduction]]
    stores: list[Store]
    inputs: list[Buffer] = field(default_factory=list)
    source_nodes: list[str] = field(default_factory=list)  # graph nodes this kernel computes
    gemm: object = None  # a gemm kernel's operands (vtc.codegen.gemm.GemmOperands); its store reads acc("gemm")

    def roots(self) -> list[Scalar]:
        """The scalar expressions the kernel evaluates (a kind with more, e.g. attention, adds its own)."""
        out = [r.value for phase in self.phases for r in phase] + [s.value for s in self.stores]
        return out + [self.gemm.a, self.gemm.b] if self.gemm is not None else out


def scalars_under(roots, stop=None):
    """Every scalar node reachable from `roots`, each once; a node for which `stop(node)` is true is
    neither yielded nor walked below (e.g. a pick, whose loads only some elements make)."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        s = stack.pop()
        if id(s) in seen:
            continue
        seen.add(id(s))
        if stop is not None and stop(s):
            continue
        yield s
        stack.extend(a for a in s.args if isinstance(a, Scalar))


DECIDED_EXTENT = 1 << 16  # the longest range of an index that ``decided_ranges`` splits (it evaluates every point)


def decided_ranges(roots, name: str, extent: int, most: int) -> list[tuple[int, int]]:
    """Ranges [lo, hi) of index variable `name` (over [0, extent)), in order, over each of which every piece
    choice under `roots` whose predicate reads `name` alone is decided: ``substitute`` of `name` by ``name + lo``
    over [0, hi - lo) replaces each such choice by its side (RoPE's rotate_half, ``d < D / 2``: two ranges).  A
    loop per range runs without the choice's branch, which gcc vectorises where one loop with the choice's loads
    under a branch ran scalar.  The whole range where there is no such choice, more than `most` ranges, or an
    extent above ``DECIDED_EXTENT``."""
    preds = {s.args[0] for s in scalars_under(roots) if s.op == "pick" and free_vars(s.args[0]) == {name}
             and not loads(s.args[0])}
    if not preds or extent > DECIDED_EXTENT:
        return [(0, extent)]
    at = torch.arange(extent)
    values = torch.stack([evaluate(p, {name: at}).expand(extent) for p in preds])
    cuts = [0, *((values[:, 1:] != values[:, :-1]).any(0).nonzero().flatten() + 1).tolist(), extent]
    ranges = list(zip(cuts, cuts[1:]))
    if len(ranges) > most or not all(subs(p, {name: add(var(name, hi - lo), lo)}).is_const
                                     for p in preds for lo, hi in ranges):
        return [(0, extent)]
    return ranges
