"""Mappings: where each element of a (virtual) tensor comes from.

A ``Mapping`` describes a tensor of ``shape`` over the output index variables
``i0, i1, ...`` (``out_vars(shape)``).  It is an ordered list of ``Piece``s; the
element at an index comes from the first piece whose predicate ``when`` holds:
either ``source[index...]`` (a named physical tensor) or the constant ``fill``
(padding).  The last piece's predicate is always true, so a mapping is total.

- A *pull* mapping (output index -> input index) is what a movement op defines
  (``vtc.virtual.movement``); composing the pulls of a chain gives one mapping
  from the chain's output to its physical sources (``compose``).
- A *push* mapping has the same form over a producer's index space, with the
  destinations as "sources": where each produced element is written.
- ``strided`` recognises a mapping that is a plain strided view
  (offset + strides into one source): any library kernel can take it for free.
- ``gather`` realises a mapping on concrete tensors: the oracle used by tests
  and by the reference executor.

Index tensors (gather, embedding, scatter) enter as ``load`` expressions;
``checks`` lists the range each one must satisfy, verified before use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping as TMapping

import torch

from vtc.index.expr import (TRUE, Expr, affine, and_, evaluate, lift, loads,
                            subs, to_str, var)


def out_vars(shape: Iterable[int]) -> tuple[Expr, ...]:
    """The index variables i0, i1, ... of a tensor of this shape (the constant 0 for a size-1 dim)."""
    return tuple(var(f"i{k}", max(int(s), 1)) for k, s in enumerate(shape))


def contiguous_strides(shape: Iterable[int]) -> tuple[int, ...]:
    """Row-major element strides of a shape."""
    shape = tuple(shape)
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


LINEAR_MEMO = 2048  # linear_offset's answers kept per generation (two generations: at most twice this many)
_linear: list[dict] = [{}, {}]  # [current, previous]: (index, shape) -> offset


def rotate_linear_offsets() -> None:
    """Starts a new generation of ``linear_offset``'s answers: those not asked for since the last rotation are
    dropped.  ``vtc.dynamic`` rotates once per size, so a decode loop keeps the answers of its last size (~75
    for the 4-layer Llama), not one more set per length."""
    _linear[1], _linear[0] = _linear[0], {}


def linear_offset(idx: Iterable[Expr], shape: Iterable[int]) -> Expr:
    """The offset of index `idx` into a row-major (contiguous) tensor of `shape`.

    A pure function of hash-consed expressions (identity is equality) and ints, so its answers are kept: a
    lowering asks for the same offsets many times, and a new length of a decode step for mostly the same ones
    as the last length (~330 calls per length for the 4-layer Llama, ~28 us each; all but ~11 asked for at an
    earlier length).  Only keys of exact types (``Expr`` indices, ``int`` sizes) are kept, so that 1, True and
    1.0 never share an answer.  Bounded: when the current generation holds ``LINEAR_MEMO`` answers, or at
    ``rotate_linear_offsets``, it becomes the previous one (the older is dropped); an answer found in the
    previous generation moves to the current one."""
    idx, shape = tuple(idx), tuple(shape)
    if not (all(type(i) is Expr for i in idx) and all(type(s) is int for s in shape)):
        return _linear_offset(idx, shape)
    key = (idx, shape)
    cur = _linear[0]
    hit = cur.get(key)
    if hit is not None:
        return hit
    hit = _linear[1].get(key)
    if hit is None:
        hit = _linear_offset(idx, shape)
    if len(cur) >= LINEAR_MEMO:
        rotate_linear_offsets()
        cur = _linear[0]
    cur[key] = hit
    return hit


def _linear_offset(idx: tuple, shape: tuple) -> Expr:
    lin = lift(0)
    for i, st in zip(idx, contiguous_strides(shape)):
        lin = lin + i * st
    return lin


@dataclass(frozen=True)
class IndexCheck:
    """An index tensor whose every element must lie in [lo, hi] (else IndexError naming op)."""

    tensor: str
    lo: int
    hi: int
    op: str

    def run(self, t: torch.Tensor) -> None:
        if t.numel() == 0:
            return
        if t.dtype != torch.bool and not t.is_floating_point():  # one pass; the elementwise test names the value
            lo, hi = torch.aminmax(t)
            if int(lo) >= self.lo and int(hi) <= self.hi:
                return
        bad = (t < self.lo) | (t > self.hi)
        if bool(bad.any()):
            v = int(t[bad].flatten()[0])
            raise IndexError(
                f"{self.op}: index {v} is out of range [{self.lo}, {self.hi}] (index tensor {self.tensor!r})")


@dataclass(frozen=True)
class Piece:
    """Elements where `when` holds come from source[index] (or are `fill` when source is None)."""

    source: str | None
    index: tuple[Expr, ...]
    when: Expr = TRUE
    fill: float | int | bool | None = None

    def __str__(self) -> str:
        what = f"{self.source}[{', '.join(to_str(i) for i in self.index)}]" if self.source else f"fill {self.fill!r}"
        return what if self.when is TRUE else f"{what} if {to_str(self.when)}"


@dataclass(frozen=True)
class Mapping:
    """A total map from every index of `shape` to a source element or a constant."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    sources: TMapping[str, tuple[int, ...]]  # physical source name -> shape
    index_tensors: TMapping[str, tuple[int, ...]] = field(default_factory=dict)
    checks: tuple[IndexCheck, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        pieces = _prune(self.pieces)
        if not pieces or pieces[-1].when is not TRUE:
            raise ValueError(f"mapping of shape {self.shape} is not total: pieces {[str(p) for p in pieces]}")
        for p in pieces:
            if p.source is not None:
                if p.source not in self.sources:
                    raise ValueError(f"piece reads {p.source!r}, not among the sources {sorted(self.sources)}")
                if len(p.index) != len(self.sources[p.source]):
                    raise ValueError(f"piece indexes {p.source!r} of shape {self.sources[p.source]} "
                                     f"with {len(p.index)} indices")
        object.__setattr__(self, "pieces", pieces)

    @property
    def vars(self) -> tuple[Expr, ...]:
        return out_vars(self.shape)

    def __str__(self) -> str:
        head = f"({', '.join(f'i{k}' for k in range(len(self.shape)))}) in {list(self.shape)} -> "
        if len(self.pieces) == 1:
            return head + str(self.pieces[0])
        return head + "\n  " + "\n  ".join(str(p) for p in self.pieces)

    def used_sources(self) -> list[str]:
        """Sources that some piece reads, in piece order."""
        return list(dict.fromkeys(p.source for p in self.pieces if p.source is not None))

    def strided(self) -> "Strided | None":
        """The (source, offset, strides) view this mapping is, when it is a plain strided view."""
        if len(self.pieces) != 1 or self.pieces[0].source is None:
            return None
        p = self.pieces[0]
        if any(loads(i) for i in p.index):
            return None
        st = contiguous_strides(self.sources[p.source])
        lin = lift(0)
        for i, s in zip(p.index, st):
            lin = lin + i * s
        form = affine(lin)
        if form is None:
            return None
        offset, coeffs = form
        names = [f"i{k}" for k in range(len(self.shape))]
        strides = tuple(coeffs.pop(n, 0) for n in names)
        if coeffs:  # pragma: no cover - the index only uses output variables
            return None
        strides = tuple(0 if sz == 1 else s for s, sz in zip(strides, self.shape))
        if any(s < 0 for s in strides) or offset < 0:  # flip: not expressible as a torch view
            return None
        return Strided(p.source, offset, strides)


@dataclass(frozen=True)
class Strided:
    """A plain strided view: element i of the output is source.flat[offset + sum(i_k * strides_k)]."""

    source: str
    offset: int
    strides: tuple[int, ...]


def _prune(pieces: Iterable[Piece]) -> tuple[Piece, ...]:
    """Drops pieces that never apply and everything after one that always applies."""
    out = []
    for p in pieces:
        if p.when.is_const and p.when.value == 0:
            continue
        out.append(p)
        if p.when is TRUE:
            break
    return tuple(out)


def identity(name: str, shape: Iterable[int]) -> Mapping:
    """The mapping of a physical tensor onto itself."""
    shape = tuple(shape)
    return Mapping(shape, (Piece(name, out_vars(shape)),), {name: shape})


def compose(outer: Mapping, inner: TMapping[str, Mapping]) -> Mapping:
    """outer with each source named in `inner` replaced by that source's own mapping."""
    pieces: list[Piece] = []
    sources: dict[str, tuple[int, ...]] = {}
    index_tensors = dict(outer.index_tensors)
    checks = list(outer.checks)
    for p in outer.pieces:
        m = inner.get(p.source) if p.source is not None else None
        if m is None:
            pieces.append(p)
            if p.source is not None:
                sources[p.source] = outer.sources[p.source]
            continue
        if tuple(m.shape) != tuple(outer.sources[p.source]):
            raise ValueError(f"cannot compose: {p.source!r} has shape {outer.sources[p.source]} in the outer "
                             f"mapping but its mapping produces {m.shape}")
        env = {f"i{k}": e for k, e in enumerate(p.index)}
        for q in m.pieces:
            when = and_(p.when, subs(q.when, env))
            pieces.append(Piece(q.source, tuple(subs(i, env) for i in q.index), when, q.fill))
            if q.source is not None:
                sources[q.source] = m.sources[q.source]
        index_tensors.update(m.index_tensors)
        checks.extend(c for c in m.checks if c not in checks)
    pieces_t = _prune(pieces)
    used = {q.source for q in pieces_t}
    sources = {k: v for k, v in sources.items() if k in used}
    return Mapping(outer.shape, pieces_t, sources, index_tensors, tuple(checks))


def gather(m: Mapping, tensors: TMapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor a mapping describes, computed from concrete sources and index tensors.

    `dtype` is the result's; by default that of the first source read (a mapping
    that only fills needs it given, else the fill's Python type decides).
    """
    for c in m.checks:
        c.run(tensors[c.tensor])
    for name, shape in list(m.sources.items()) + list(m.index_tensors.items()):
        if name not in tensors:
            raise KeyError(f"mapping needs tensor {name!r}; got {sorted(tensors)}")
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, mapping expects {shape}")
    dtype = dtype or next((tensors[p.source].dtype for p in m.pieces if p.source), None)
    if dtype is None:
        dtype = torch.tensor(m.pieces[-1].fill).dtype
    if 0 in m.shape:
        return torch.empty(m.shape, dtype=dtype)
    n = len(m.shape)
    env = {f"i{k}": torch.arange(s).reshape([s if j == k else 1 for j in range(n)])
           for k, s in enumerate(m.shape)}
    out = torch.empty(m.shape, dtype=dtype)
    idx_tensors = {k: tensors[k] for k in m.index_tensors}
    for p in reversed(m.pieces):
        if p.source is None:
            val = torch.full(m.shape, p.fill, dtype=dtype)
        else:
            src = tensors[p.source]
            flat = src.contiguous().reshape(-1)
            lin = torch.zeros((), dtype=torch.int64)
            for i, s, st in zip(p.index, src.shape, contiguous_strides(src.shape)):
                lin = lin + evaluate(i, env, idx_tensors).clamp(0, max(s - 1, 0)) * st
            lin = lin.expand(m.shape) if lin.dim() or n else lin
            val = flat[lin] if flat.numel() else torch.empty(m.shape, dtype=dtype)
        if p.when is TRUE:
            out = val.to(dtype).expand(m.shape).clone()
        else:
            out = torch.where(evaluate(p.when, env, idx_tensors).bool().expand(m.shape), val.to(dtype), out)
    return out


def index_check(tensor: str, lo: int, hi: int, op: str) -> IndexCheck:
    """A range check for an index tensor (see IndexCheck)."""
    return IndexCheck(tensor, int(lo), int(hi), op)

