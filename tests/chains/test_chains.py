"""A property-based fuzzer for chains of movement ops.

Each example draws a small tensor (rank 1-4, sizes 1-6, one of ``DTYPES``, all
values distinct) and a chain of 6-10 ATen movement ops, each drawn valid for the
shape it receives (``OPS``: one generator per op, easy to extend; a step whose
output would be empty, 0-d or too big is dropped).  The chain runs in torch; in
parallel each op's pull mapping (``vtc.virtual.movement.pull``) is composed into
ONE mapping from the final output to the physical inputs, realised once with
``gather`` (derived index tensors computed first, as the executor does) and
compared exactly with torch.  On top of that the composed mapping must

- read only physical inputs (no intermediate name survives) and every input
  whose values reach the output;
- index every source, and load every index tensor, in bounds wherever its piece
  is the one selected (gather clamps, so this is checked separately);
- keep every sub-expression inside its claimed range wherever it is used;
- give the same values when composed right-to-left;
- be ``strided()`` with torch's offset and strides whenever torch's result is
  a view of the input, and be correct whenever ``strided()`` says it is a view.

Generators whose op has no pull (``has_pull``) are left out, so ops added to
``vtc.virtual.movement`` join the fuzzer as soon as they exist.  A failure
prints the chain as Python that rebuilds it.  Examples are derandomized: CI
sees the same chains every run.  For a longer hunt, run a test with more
examples and ``derandomize=False`` (and ``REQUIRE_STRIDED = False`` to look
past the known strided() misses, see tests/index/test_mapping.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from vtc.index.expr import evaluate, walk
from vtc.index.mapping import Mapping, compose, gather
from vtc.virtual.movement import Src, derive_index_tensors, has_pull, pull

aten = torch.ops.aten
MAX_NUMEL = 2048
MAX_RANK = 5
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
REQUIRE_STRIDED = True  # a view in torch must be strided(); off only to hunt other bugs past known misses
FILLS = (0.0, -0.5, -2.25, -7.75)  # pad values: never equal to a data value (data are positive integers)
DTYPES = (torch.float32, torch.int64, torch.float64, torch.int32)  # pads of integer tensors truncate the fill


# ---------------------------------------------------------------------------
# a chain: steps whose arguments refer to the current tensor (CUR) and to new physical inputs (Phys)
class _Cur:
    def __repr__(self) -> str:
        return "CUR"


CUR = _Cur()


@dataclass(frozen=True)
class Phys:
    name: str


@dataclass
class Step:
    target: Any
    args: tuple
    out_index: int | None = None  # which output continues the chain, for multi-output ops


class Chain:
    """A drawn chain: its physical inputs, its steps, and torch's value after each step."""

    def __init__(self) -> None:
        self.phys: dict[str, torch.Tensor] = {}  # physical inputs (data and index tensors)
        self.data: list[str] = []  # the data inputs among them
        self.steps: list[Step] = []
        self.values: list[torch.Tensor] = []  # values[k]: the tensor entering step k
        self.names: list[str] = []  # names[k]: its name ("x" for the input)
        self._next_value = 1
        self.dtype = torch.float32  # of every data input (cat and stack would promote mixed ones)

    def new_data(self, shape) -> Phys:
        name = f"d{len(self.phys)}"
        n = math.prod(shape)
        self.phys[name] = torch.arange(self._next_value, self._next_value + n, dtype=self.dtype).reshape(shape)
        self._next_value += n
        self.data.append(name)
        return Phys(name)

    def new_index(self, values, shape=None) -> Phys:
        name = f"idx{len(self.phys)}"
        t = torch.tensor(values, dtype=torch.int64)
        self.phys[name] = t.reshape(shape) if shape is not None else t
        return Phys(name)

    def __repr__(self) -> str:
        return "Chain:\n" + self.text()

    @property
    def cur(self) -> torch.Tensor:
        return self.values[-1]

    def text(self) -> str:
        """The chain as Python that rebuilds it (inputs first, one op per line, output shapes in comments)."""
        lines = []
        for name, t in self.phys.items():
            if name in self.data:
                lo = int(t.flatten()[0])
                lines.append(f"{name} = torch.arange({lo}, {lo + t.numel()}, dtype={t.dtype}).reshape({list(t.shape)})")
            else:
                lines.append(f"{name} = torch.tensor({t.tolist()})")
        for k, s in enumerate(self.steps):
            args = ", ".join(_fmt(a, self.names[k]) for a in s.args)
            pick = f"[{s.out_index}]" if s.out_index is not None else ""
            shape = list(self.values[k + 1].shape)
            lines.append(f"{self.names[k + 1]} = torch.ops.{s.target}({args}){pick}  # {shape}")
        return "\n".join(lines)


def _fmt(a, cur_name: str) -> str:
    if a is CUR:
        return cur_name
    if isinstance(a, Phys):
        return a.name
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_fmt(b, cur_name) for b in a) + "]"
    return repr(a)


def _subst(a, cur, phys: Callable[[str], Any]):
    if a is CUR:
        return cur
    if isinstance(a, Phys):
        return phys(a.name)
    if isinstance(a, list):
        return [_subst(b, cur, phys) for b in a]
    if isinstance(a, tuple):
        return tuple(_subst(b, cur, phys) for b in a)
    return a


# ops that torch runs on a fresh contiguous copy of their input: the ones that write into a copy
# of it, because on an input whose elements overlap (an expand or unfold view) eager torch writes
# through the aliasing (select_scatter(x.unfold(0, 2, 1), src, 0, 0) also changes row 1); and
# as_strided, which reads the input's storage (offset included), not the logical tensor its pull reads
WRITERS = {"slice_scatter", "select_scatter", "index_put", "index_copy", "scatter", "as_strided"}


def run_torch(step: Step, cur: torch.Tensor, chain: Chain) -> tuple[torch.Tensor, tuple]:
    """(the tensor continuing the chain, all outputs) of a step in torch."""
    if step.target._opname in WRITERS:
        cur = cur.clone(memory_format=torch.contiguous_format)
    out = step.target(*_subst(step.args, cur, chain.phys.__getitem__))
    outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
    return outs[step.out_index or 0], outs


# ---------------------------------------------------------------------------
# op generators: each draws a step valid for the current tensor t
@dataclass(frozen=True)
class OpGen:
    name: str
    targets: tuple  # ATen overloads the generator may emit: all need a pull mapping
    ok: Callable[[torch.Tensor], bool]
    make: Callable[[Callable, torch.Tensor, Chain], Step]
    view: bool = False  # torch always returns a view (the mapping must then be strided)
    shapes: Any = None  # shapes it applies to, when random small shapes rarely do

    @property
    def available(self) -> bool:
        return all(has_pull(t) for t in self.targets)


def _dim(draw, r: int) -> int:
    """A dimension of a rank-r tensor, negative half the time."""
    d = draw(st.integers(0, r - 1))
    return d - r if draw(st.booleans()) else d


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _permute(draw, t, c):
    r = t.dim()
    dims = draw(st.permutations(range(r)))
    return Step(aten.permute.default, (CUR, [d - r if draw(st.booleans()) else d for d in dims]))


def _transpose(draw, t, c):
    target = draw(st.sampled_from([aten.transpose.int, aten.swapaxes.default]))
    return Step(target, (CUR, _dim(draw, t.dim()), _dim(draw, t.dim())))


def _t(draw, t, c):
    return Step(aten.t.default, (CUR,))


def _reshape_step(draw, t, shape, views_only=False):
    try:
        t.view(shape)
        viewable = True
    except RuntimeError:
        viewable = False
    if views_only:
        assert viewable
    if viewable and draw(st.booleans()):
        target = aten.view.default
    else:
        target = draw(st.sampled_from([aten.reshape.default, aten._unsafe_view.default])) if viewable \
            else aten.reshape.default
    shape = list(shape)
    if shape and draw(st.integers(0, 3)) == 0:  # let torch infer one size
        shape[draw(st.integers(0, len(shape) - 1))] = -1
    return Step(target, (CUR, shape))


def _split_shape(draw, t):
    """One dimension split into two factors."""
    shape = list(t.shape)
    d = draw(st.integers(0, len(shape) - 1))
    a = draw(st.sampled_from(_divisors(shape[d])))
    return shape[:d] + [a, shape[d] // a] + shape[d + 1:]


def _merge_shape(draw, t):
    """Adjacent dimensions merged into one."""
    shape = list(t.shape)
    i = draw(st.integers(0, len(shape) - 1))
    j = draw(st.integers(i, min(len(shape) - 1, i + 2)))
    return shape[:i] + [math.prod(shape[i:j + 1])] + shape[j + 1:]


def _any_shape(draw, t):
    """A random factorisation of numel into 1-4 dims (size-1 dims included)."""
    k = draw(st.integers(1, 4))
    dims = [1] * k
    for p in _primes(t.numel()):
        dims[draw(st.integers(0, k - 1))] *= p
    return dims


def _reshape(draw, t, c):
    how = draw(st.sampled_from([_split_shape, _merge_shape, _any_shape]))
    return _reshape_step(draw, t, how(draw, t))


def _view_reshape(draw, t, c):
    """A reshape torch can do as a view (split, merge of mergeable dims, or any viewable shape)."""
    for _ in range(4):
        how = draw(st.sampled_from([_split_shape, _merge_shape, _any_shape]))
        shape = how(draw, t)
        try:
            t.view(shape)
            return _reshape_step(draw, t, shape, views_only=True)
        except RuntimeError:
            continue
    return _reshape_step(draw, t, _split_shape(draw, t), views_only=True)


def _flatten(draw, t, c):
    r = t.dim()
    a = draw(st.integers(0, r - 1))
    b = draw(st.integers(a, r - 1))
    return Step(aten.flatten.using_ints, (CUR, a, b))


def _unflatten(draw, t, c):
    d = _dim(draw, t.dim())
    s = t.shape[d]
    a = draw(st.sampled_from(_divisors(s)))
    sizes = [a, s // a]
    if draw(st.booleans()):
        sizes[draw(st.integers(0, 1))] = -1
    return Step(aten.unflatten.int, (CUR, d, sizes))


def _unsqueeze(draw, t, c):
    r = t.dim()
    return Step(aten.unsqueeze.default, (CUR, draw(st.integers(-r - 1, r))))


def _squeeze(draw, t, c):
    r = t.dim()
    ones = [d for d in range(r) if t.shape[d] == 1]
    how = draw(st.sampled_from(["dim", "dims", "all"]))
    if how == "all" and len(ones) < r:  # squeezing every dim of an all-ones tensor would give a 0-d tensor
        return Step(aten.squeeze.default, (CUR,))
    if how == "dims" and len(ones) < r:
        dims = draw(st.lists(st.integers(0, r - 1), min_size=1, max_size=r, unique=True))
        if all(t.shape[d] == 1 for d in dims) and len(dims) == r:
            dims = dims[:-1] or [0]
        return Step(aten.squeeze.dims, (CUR, dims))
    d = draw(st.sampled_from(ones)) if ones and draw(st.booleans()) else _dim(draw, r)  # may be a no-op
    if r == 1:
        d = d if t.shape[0] != 1 else 0
    return Step(aten.squeeze.dim, (CUR, d))


def _slice(draw, t, c):
    r = t.dim()
    d = _dim(draw, r)
    s = t.shape[d]
    step = draw(st.integers(1, 3))
    start = draw(st.one_of(st.integers(-s, s - 1), st.none()))
    end = draw(st.one_of(st.integers(-s, s + 2), st.just(2 ** 63 - 1), st.none()))
    if len(range(s)[slice(start, end, step)]) == 0:
        end = None
    if len(range(s)[slice(start, end, step)]) == 0:
        start = None
    return Step(aten.slice.Tensor, (CUR, d, start, end, step))


def _expand(draw, t, c):
    shape = list(t.shape)
    new = [draw(st.integers(1, 4)) if s == 1 else (-1 if draw(st.integers(0, 3)) == 0 else s) for s in shape]
    lead = draw(st.lists(st.integers(1, 3), max_size=max(0, MAX_RANK - len(shape))))
    if math.prod(lead) * math.prod(max(n, s) for n, s in zip(new, shape)) > MAX_NUMEL:
        lead, new = [], shape
    return Step(aten.expand.default, (CUR, lead + new))


def _grows_ok(t):
    return t.numel() * 3 <= MAX_NUMEL


def _cat(draw, t, c):
    r = t.dim()
    d = _dim(draw, r)
    how = draw(st.sampled_from(["self", "after", "before", "three"]))
    if how == "self":
        return Step(aten.cat.default, ([CUR, CUR], d))
    shape = list(t.shape)
    shape[d] = draw(st.integers(1, 3))
    other = c.new_data(shape)
    parts = {"after": [CUR, other], "before": [other, CUR], "three": [CUR, other, CUR]}[how]
    return Step(aten.cat.default, (parts, d))


def _pad(draw, t, c):
    r = t.dim()
    pads = []
    for k in range(draw(st.integers(1, r))):
        s = t.shape[r - 1 - k]
        before = draw(st.integers(-1, 2))
        after = draw(st.integers(-1, 2))
        if s + before + after < 1:
            before = after = 1
        pads += [before, after]
    return Step(aten.constant_pad_nd.default, (CUR, pads, draw(st.sampled_from(FILLS))))


def _index_select(draw, t, c):
    r = t.dim()
    d = _dim(draw, r)
    s = t.shape[d]
    if draw(st.integers(0, 4)) == 0:
        idx = c.new_index(draw(st.integers(0, s - 1)))
    else:
        idx = c.new_index(draw(st.lists(st.integers(0, s - 1), min_size=1, max_size=5)))
    return Step(aten.index_select.default, (CUR, d, idx))


def _clone(draw, t, c):
    return Step(draw(st.sampled_from([aten.clone.default, aten.alias.default])), (CUR,))


# --- ops that may not have a pull yet: they join when movement.py defines them
def _flip(draw, t, c):
    return Step(aten.flip.default, (CUR, draw(st.lists(st.integers(0, t.dim() - 1), max_size=t.dim(),
                                                       unique=True))))


def _roll(draw, t, c):
    r = t.dim()
    if draw(st.integers(0, 3)) == 0:
        return Step(aten.roll.default, (CUR, [draw(st.integers(-8, 8))], []))
    dims = draw(st.lists(st.integers(0, r - 1), min_size=1, max_size=r, unique=True))
    return Step(aten.roll.default, (CUR, [draw(st.integers(-8, 8)) for _ in dims], dims))


def _repeat(draw, t, c):
    r = t.dim()
    reps = [draw(st.integers(1, 3)) for _ in range(r + draw(st.integers(0, 1)))]
    if math.prod(reps) * t.numel() > MAX_NUMEL:
        reps = [1] * r
    return Step(aten.repeat.default, (CUR, reps))


def _select(draw, t, c):
    d = _dim(draw, t.dim())
    s = t.shape[d]
    return Step(aten.select.int, (CUR, d, draw(st.integers(-s, s - 1))))


def _narrow(draw, t, c):
    d = _dim(draw, t.dim())
    s = t.shape[d]
    start = draw(st.integers(-s, s - 1))
    length = draw(st.integers(1, s - (start % s)))
    return Step(aten.narrow.default, (CUR, d, start, length))


def _split_with_sizes(draw, t, c):
    d = _dim(draw, t.dim())
    s = t.shape[d]
    cuts = sorted(draw(st.lists(st.integers(1, s - 1), max_size=3, unique=True))) if s > 1 else []
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [s])]
    return Step(aten.split_with_sizes.default, (CUR, sizes, d), draw(st.integers(0, len(sizes) - 1)))


def _split(draw, t, c):
    d = _dim(draw, t.dim())
    s = t.shape[d]
    size = draw(st.integers(1, s))
    return Step(aten.split.Tensor, (CUR, size, d), draw(st.integers(0, -(-s // size) - 1)))


def _chunk(draw, t, c):
    d = _dim(draw, t.dim())
    s = t.shape[d]
    n = draw(st.integers(1, s))
    count = len(torch.empty(t.shape).chunk(n, d))
    return Step(aten.chunk.default, (CUR, n, d), draw(st.integers(0, count - 1)))


def _unbind(draw, t, c):
    d = _dim(draw, t.dim())
    return Step(aten.unbind.int, (CUR, d), draw(st.integers(0, t.shape[d] - 1)))


def _stack(draw, t, c):
    r = t.dim()
    d = draw(st.integers(-r - 1, r))
    other = CUR if draw(st.booleans()) else c.new_data(tuple(t.shape))
    parts = [CUR, other] if draw(st.booleans()) else [other, CUR]
    return Step(aten.stack.default, (parts, d))


def _gather(draw, t, c):
    r = t.dim()
    d = _dim(draw, r)
    shape = [draw(st.integers(1, 4)) if k == d % r else draw(st.integers(1, t.shape[k])) for k in range(r)]
    vals = draw(st.lists(st.integers(0, t.shape[d] - 1), min_size=math.prod(shape), max_size=math.prod(shape)))
    return Step(aten.gather.default, (CUR, d, c.new_index(vals, shape)))


def _take(draw, t, c):
    n = draw(st.integers(1, 6))
    vals = draw(st.lists(st.integers(-t.numel(), t.numel() - 1), min_size=n, max_size=n))
    return Step(aten.take.default, (CUR, c.new_index(vals)))


def _pixel_shuffle(draw, t, c):
    r = draw(st.sampled_from([k for k in (2, 3) if t.shape[-3] % (k * k) == 0]))
    return Step(aten.pixel_shuffle.default, (CUR, r))


def _pixel_unshuffle(draw, t, c):
    r = draw(st.sampled_from([k for k in (2, 3) if t.shape[-1] % k == 0 and t.shape[-2] % k == 0]))
    return Step(aten.pixel_unshuffle.default, (CUR, r))


_lead = st.lists(st.integers(1, 2), max_size=2)
PIXEL_SHUFFLE_SHAPES = st.tuples(_lead, st.sampled_from([4, 8, 9]), st.integers(1, 3), st.integers(1, 3)).map(
    lambda t: [*t[0], *t[1:]])
PIXEL_UNSHUFFLE_SHAPES = st.tuples(_lead, st.integers(1, 3), st.sampled_from([2, 4, 6, 3]),
                                   st.sampled_from([2, 4, 6, 3])).map(lambda t: [*t[0], *t[1:]])

def _diagonal(draw, t, c):
    r = t.dim()
    d1, d2 = draw(st.permutations(range(r)))[:2]
    s1, s2 = t.shape[d1], t.shape[d2]
    offset = draw(st.integers(-(s1 - 1), s2 - 1))
    return Step(aten.diagonal.default, (CUR, offset, d1 - r if draw(st.booleans()) else d1, d2))


def _unfold(draw, t, c):
    d = _dim(draw, t.dim())
    s = t.shape[d]
    return Step(aten.unfold.default, (CUR, d, draw(st.integers(1, s)), draw(st.integers(1, 3))))


def _movedim(draw, t, c):
    r = t.dim()
    return Step(aten.movedim.int, (CUR, _dim(draw, r), _dim(draw, r)))


def _repeat_interleave(draw, t, c):
    reps = draw(st.integers(1, 3))
    d = _dim(draw, t.dim()) if draw(st.integers(0, 3)) else None
    return Step(aten.repeat_interleave.self_int, (CUR, reps, d))


def _slice_scatter(draw, t, c):
    s_step = _slice(draw, t, c)
    _, d, start, end, step = s_step.args
    src = c.new_data(tuple(aten.slice.Tensor(t, d, start, end, step).shape))
    return Step(aten.slice_scatter.default, (CUR, src, d, start, end, step))


def _select_scatter(draw, t, c):
    d = _dim(draw, t.dim())
    s = t.shape[d]
    i = draw(st.integers(-s, s - 1))
    src = c.new_data(tuple(aten.select.int(t, d, i).shape))
    return Step(aten.select_scatter.default, (CUR, src, d, i))


def _identity_like(draw, t, c):
    target = draw(st.sampled_from([aten.contiguous.default, aten.detach.default, aten._to_copy.default,
                                   aten.lift_fresh_copy.default]))
    return Step(target, (CUR,))


def _expand_as(draw, t, c):
    sizes = _expand(draw, t, c).args[1]  # -1 keeps a size
    lead = len(sizes) - t.dim()
    shape = [t.shape[k - lead] if n == -1 else n for k, n in enumerate(sizes)]
    return Step(aten.expand_as.default, (CUR, c.new_data(shape)))  # the other tensor only gives the shape


def _view_as(draw, t, c):
    shape = draw(st.sampled_from([_split_shape, _merge_shape, _any_shape]))(draw, t)
    try:
        t.view(shape)
        target = draw(st.sampled_from([aten.view_as.default, aten.reshape_as.default]))
    except RuntimeError:
        target = aten.reshape_as.default
    return Step(target, (CUR, c.new_data(shape)))


def _index_tensors(draw, t, c, unique: bool):
    """ATen advanced-indexing indices for t: index tensors on some dims (None elsewhere), broadcastable.

    With unique, every indexed position is distinct (as index_put needs) and nothing broadcasts."""
    r = t.dim()
    dims = sorted(draw(st.lists(st.integers(0, r - 1), min_size=1, max_size=min(r, 3), unique=True)))
    if unique:
        space = math.prod(t.shape[d] for d in dims)
        k = draw(st.integers(1, min(4, space)))
        flat = draw(st.permutations(range(space)))[:k]
        cols = []
        for d in reversed(dims):
            cols.append([f % t.shape[d] for f in flat])
            flat = [f // t.shape[d] for f in flat]
        cols = cols[::-1]
        bshape = [k]
        vals = [[v - t.shape[d] if draw(st.booleans()) else v for v in col] for d, col in zip(dims, cols)]
        shapes_ = [bshape] * len(dims)
    else:
        bshape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
        shapes_ = [[b if draw(st.integers(0, 2)) else 1 for b in bshape] for _ in dims]
        vals = [draw(st.lists(st.integers(-t.shape[d], t.shape[d] - 1), min_size=math.prod(sh),
                              max_size=math.prod(sh))) for d, sh in zip(dims, shapes_)]
    indices = [None] * (dims[-1] + 1)
    for d, v, sh in zip(dims, vals, shapes_):
        indices[d] = c.new_index(v, sh)
    return indices


def _index(draw, t, c):
    return Step(aten.index.Tensor, (CUR, _index_tensors(draw, t, c, unique=False)))


def _index_put(draw, t, c):
    indices = _index_tensors(draw, t, c, unique=True)
    shape = list(aten.index.Tensor(t, _subst(indices, t, c.phys.__getitem__)).shape)
    if draw(st.booleans()):  # values broadcast from a suffix of the indexed shape
        shape = shape[draw(st.integers(0, len(shape))):]
    return Step(aten.index_put.default, (CUR, indices, c.new_data(shape), False))


def _index_copy(draw, t, c):
    d = _dim(draw, t.dim())
    n = t.shape[d]
    picks = draw(st.permutations(range(n)))[:draw(st.integers(1, n))]
    shape = list(t.shape)
    shape[d] = len(picks)
    return Step(aten.index_copy.default, (CUR, d, c.new_index(picks), c.new_data(shape)))


def _scatter(draw, t, c):
    r = t.dim()
    d = draw(st.integers(0, r - 1))
    n = t.shape[d]
    shape = [draw(st.integers(1, t.shape[k])) if k != d else draw(st.integers(1, n)) for k in range(r)]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    # distinct positions along d for every other coordinate: no two updates land on one element
    perm = torch.rand([*shape[:d], n, *shape[d + 1:]], generator=gen).argsort(dim=d).narrow(d, 0, shape[d])
    idx = c.new_index(perm.tolist(), shape)
    if draw(st.integers(0, 3)) == 0:
        return Step(aten.scatter.value, (CUR, d if draw(st.booleans()) else d - r, idx, draw(st.sampled_from(FILLS))))
    src_shape = [k + draw(st.integers(0, 1)) for k in shape]
    return Step(aten.scatter.src, (CUR, d, idx, c.new_data(src_shape)))


def _embedding(draw, t, c):
    n = t.shape[0]
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    vals = draw(st.lists(st.integers(0, n - 1), min_size=math.prod(shape), max_size=math.prod(shape)))
    return Step(aten.embedding.default, (CUR, c.new_index(vals, shape)))


def _tile(draw, t, c):
    reps = [draw(st.integers(1, 2)) for _ in range(draw(st.integers(1, t.dim() + 1)))]
    if math.prod(reps) * t.numel() > MAX_NUMEL:
        reps = [1]
    return Step(aten.tile.default, (CUR, reps))


def _as_strided(draw, t, c):
    n = t.numel()
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    strides = [draw(st.integers(0, 4)) for _ in shape]
    span = sum((s - 1) * st_ for s, st_ in zip(shape, strides))
    if span >= n:
        shape, strides, span = [1], [1], 0
    return Step(aten.as_strided.default, (CUR, shape, strides, draw(st.integers(0, n - 1 - span))))


def _rank(lo, hi=MAX_RANK):
    return lambda t: lo <= t.dim() <= hi


OPS: list[OpGen] = [
    OpGen("permute", (aten.permute.default,), _rank(1), _permute, view=True),
    OpGen("transpose", (aten.transpose.int, aten.swapaxes.default), _rank(1), _transpose, view=True),
    OpGen("t", (aten.t.default,), _rank(1, 2), _t, view=True),
    OpGen("reshape", (aten.view.default, aten.reshape.default, aten._unsafe_view.default), _rank(1), _reshape),
    OpGen("view", (aten.view.default, aten.reshape.default, aten._unsafe_view.default), _rank(1),
          _view_reshape, view=True),
    OpGen("flatten", (aten.flatten.using_ints,), _rank(1), _flatten),
    OpGen("unflatten", (aten.unflatten.int,), _rank(1, MAX_RANK - 1), _unflatten, view=True),
    OpGen("unsqueeze", (aten.unsqueeze.default,), _rank(1, MAX_RANK - 1), _unsqueeze, view=True),
    OpGen("squeeze", (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default),
          lambda t: t.dim() >= 1 and any(s != 1 for s in t.shape), _squeeze, view=True),
    OpGen("slice", (aten.slice.Tensor,), _rank(1), _slice, view=True),
    OpGen("expand", (aten.expand.default,), _rank(1), _expand, view=True),
    OpGen("cat", (aten.cat.default,), lambda t: t.dim() >= 1 and _grows_ok(t), _cat),
    OpGen("constant_pad_nd", (aten.constant_pad_nd.default,), lambda t: t.dim() >= 1 and _grows_ok(t), _pad),
    OpGen("index_select", (aten.index_select.default,), _rank(1), _index_select),
    OpGen("clone", (aten.clone.default, aten.alias.default), _rank(1), _clone),
    # joining as movement.py grows
    OpGen("flip", (aten.flip.default,), _rank(1), _flip),
    OpGen("roll", (aten.roll.default,), _rank(1), _roll),
    OpGen("repeat", (aten.repeat.default,), lambda t: 1 <= t.dim() < MAX_RANK and _grows_ok(t), _repeat),
    OpGen("select", (aten.select.int,), _rank(2), _select, view=True),
    OpGen("narrow", (aten.narrow.default,), _rank(1), _narrow, view=True),
    OpGen("split_with_sizes", (aten.split_with_sizes.default,), _rank(1), _split_with_sizes, view=True),
    OpGen("split", (aten.split.Tensor,), _rank(1), _split, view=True),
    OpGen("chunk", (aten.chunk.default,), _rank(1), _chunk, view=True),
    OpGen("unbind", (aten.unbind.int,), _rank(2), _unbind, view=True),
    OpGen("stack", (aten.stack.default,), lambda t: 1 <= t.dim() < MAX_RANK and _grows_ok(t), _stack),
    OpGen("gather", (aten.gather.default,), _rank(1), _gather),
    OpGen("take", (aten.take.default,), _rank(1), _take),
    OpGen("pixel_shuffle", (aten.pixel_shuffle.default,),
          lambda t: t.dim() >= 3 and (t.shape[-3] % 4 == 0 or t.shape[-3] % 9 == 0), _pixel_shuffle,
          shapes=PIXEL_SHUFFLE_SHAPES),
    OpGen("pixel_unshuffle", (aten.pixel_unshuffle.default,),
          lambda t: t.dim() >= 3 and any(t.shape[-1] % k == 0 and t.shape[-2] % k == 0 for k in (2, 3)),
          _pixel_unshuffle, shapes=PIXEL_UNSHUFFLE_SHAPES),
    OpGen("diagonal", (aten.diagonal.default,), _rank(2), _diagonal, view=True),
    OpGen("unfold", (aten.unfold.default,), _rank(1, MAX_RANK - 1), _unfold, view=True),
    OpGen("movedim", (aten.movedim.int,), _rank(1), _movedim, view=True),
    OpGen("repeat_interleave", (aten.repeat_interleave.self_int,), lambda t: t.dim() >= 1 and _grows_ok(t),
          _repeat_interleave),
    OpGen("slice_scatter", (aten.slice_scatter.default,), _rank(1), _slice_scatter),
    OpGen("select_scatter", (aten.select_scatter.default,), _rank(2), _select_scatter),
    OpGen("identity_like", (aten.contiguous.default, aten.detach.default, aten._to_copy.default,
                            aten.lift_fresh_copy.default), _rank(1), _identity_like),
    OpGen("expand_as", (aten.expand_as.default,), _rank(1), _expand_as, view=True),
    OpGen("view_as", (aten.view_as.default, aten.reshape_as.default), _rank(1), _view_as),
    OpGen("index", (aten.index.Tensor,), _rank(1), _index),
    OpGen("index_put", (aten.index_put.default,), _rank(1), _index_put),
    OpGen("index_copy", (aten.index_copy.default,), _rank(1), _index_copy),
    OpGen("scatter", (aten.scatter.src, aten.scatter.value), _rank(1), _scatter),
    OpGen("embedding", (aten.embedding.default,), _rank(2, 2), _embedding),
    OpGen("tile", (aten.tile.default,), lambda t: 1 <= t.dim() < MAX_RANK and _grows_ok(t), _tile),
    OpGen("as_strided", (aten.as_strided.default,), _rank(1), _as_strided),
]
AVAILABLE = [g for g in OPS if g.available]
VIEW_OPS = [g for g in AVAILABLE if g.view]
BY_NAME = {g.name: g for g in OPS}


# ---------------------------------------------------------------------------
# drawing chains
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4)


@st.composite
def chains(draw, gens, min_len=6, max_len=10, shape=None):
    c = Chain()
    shape = draw(shapes) if shape is None else shape
    c.dtype = draw(st.sampled_from(DTYPES))
    c.phys["x"] = torch.arange(1, math.prod(shape) + 1, dtype=c.dtype).reshape(shape)
    c._next_value = math.prod(shape) + 1
    c.data.append("x")
    c.values.append(c.phys["x"])
    c.names.append("x")
    n = draw(st.integers(min_len, max_len))
    rotate = draw(st.integers(0, len(gens) - 1))  # spreads the ops hypothesis tries first
    for _ in range(n):
        ok = [g for g in gens if g.ok(c.cur)]
        if not ok:
            break
        g = ok[(draw(st.integers(0, len(ok) - 1)) + rotate) % len(ok)]
        step = g.make(draw, c.cur, c)
        out, _ = run_torch(step, c.cur, c)
        if out.numel() == 0 or out.numel() > MAX_NUMEL or out.dim() == 0 or out.dim() > MAX_RANK:
            # keep chains non-empty, small and of rank >= 1: drop the step (and any inputs it made)
            for a in _flat(step.args):
                if isinstance(a, Phys):
                    del c.phys[a.name]
                    if a.name in c.data:
                        c.data.remove(a.name)
            continue
        c.steps.append(step)
        c.values.append(out)
        c.names.append(f"v{len(c.steps)}")
    return c


def _flat(a):
    if isinstance(a, (list, tuple)):
        for b in a:
            yield from _flat(b)
    else:
        yield a


# ---------------------------------------------------------------------------
# the oracle
def step_mapping(c: Chain, k: int) -> Mapping:
    """The pull mapping of step k: from values[k+1] to values[k] (named names[k]) and physical inputs."""
    step = c.steps[k]
    cur = Src(c.names[k], tuple(c.values[k].shape), c.values[k].dtype)

    def phys(name):
        t = c.phys[name]
        return Src(name, tuple(t.shape), t.dtype)

    _, outs = run_torch(step, c.values[k], c)
    maps = pull(step.target, _subst(step.args, cur, phys), {}, [tuple(o.shape) for o in outs])
    return maps[step.out_index or 0]


def compose_chain(c: Chain) -> tuple[Mapping, Mapping]:
    """The chain's mappings composed left to right and right to left."""
    maps = [step_mapping(c, k) for k in range(len(c.steps))]
    left = maps[0]
    for k in range(1, len(maps)):
        left = compose(maps[k], {c.names[k]: left})
    right = maps[-1]
    for k in range(len(maps) - 2, -1, -1):
        right = compose(right, {c.names[k + 1]: maps[k]})
    return left, right


def _grid(shape):
    n = len(shape)
    return {f"i{k}": torch.arange(s).reshape([s if j == k else 1 for j in range(n)]) for k, s in enumerate(shape)}


def check_mapping(m: Mapping, c: Chain, want: torch.Tensor, what: str) -> None:
    def msg():  # only built when an assertion fails
        return f"{what} mapping of the chain\n{c.text()}\nis\n{m}"

    assert m.shape == tuple(want.shape), f"{msg()}\nhas shape {m.shape}, torch gives {tuple(want.shape)}"
    assert set(m.sources) <= set(c.data), f"{msg()}\nreads {sorted(m.sources)}; physical inputs are {c.data}"
    reached = {n for n in c.data if torch.isin(want, c.phys[n]).any()}
    assert reached <= set(m.sources), f"{msg()}\ndoes not read {sorted(reached - set(m.sources))}"
    tensors = {**c.phys, **derive_index_tensors(m, c.phys)}  # inverses of scatter indices, as the executor
    assert set(m.index_tensors) <= set(tensors) - set(c.data), f"{msg()}\nindex tensors {sorted(m.index_tensors)}"
    got = gather(m, tensors, dtype=want.dtype if not m.used_sources() else None)  # fill-only: caller's dtype
    assert got.dtype == want.dtype, f"{msg()}\ngives {got.dtype}, torch {want.dtype}"
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].tolist()
        raise AssertionError(f"{msg()}\ndiffers from torch at {bad}: got {got[tuple(bad)].item()}, "
                             f"want {want[tuple(bad)].item()}")
    # gather clamps indices and loads, so check they are in bounds where their piece is selected; and
    # every range claim where it is used: a piece's index where it is selected, its predicate where no
    # earlier piece took the element (a scatter's inverse load is only in range where it was written)
    env = _grid(m.shape)
    idx_t = {n: tensors[n] for n in m.index_tensors}

    def values(e, where):
        return torch.broadcast_to(evaluate(e, env, idx_t), m.shape)[where]

    def in_range(e, where, lo, hi, what):
        v = values(e, where)
        assert v.numel() == 0 or (lo <= int(v.min()) and int(v.max()) <= hi), \
            f"{msg()}\n{what} {e} takes [{int(v.min())}, {int(v.max())}] outside [{lo}, {hi}]"

    taken = torch.zeros(m.shape, dtype=torch.bool)
    for p in m.pieces:
        free = ~taken
        sel = torch.broadcast_to(evaluate(p.when, env, idx_t).bool(), m.shape) & free
        taken |= sel
        for s in walk(p.when):
            in_range(s, free, s.lo, s.hi, "predicate part")
        if p.source is None:
            continue
        for d, (i, size) in enumerate(zip(p.index, m.sources[p.source])):
            in_range(i, sel, 0, size - 1, f"index {d} of {p.source}")
            for s in walk(i):
                in_range(s, sel, s.lo, s.hi, "index part")
                if s.op == "load":
                    for k, (j, n) in enumerate(zip(s.args[1], m.index_tensors[s.args[0]])):
                        in_range(j, sel, 0, n - 1, f"load index {k} of {s.args[0]}")
    assert bool(taken.all())


def check_strided(m: Mapping, c: Chain, want: torch.Tensor) -> None:
    x = c.phys["x"]
    s = m.strided()
    def msg():
        return f"chain\n{c.text()}\nmaps as\n{m}\nstrided() = {s}"

    is_view = want.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    if is_view and REQUIRE_STRIDED:
        assert s is not None, \
            f"{msg()}\nbut torch gives a view: offset {want.storage_offset()}, strides {want.stride()}"
        assert s.source == "x", msg()
        assert s.offset == want.storage_offset(), f"{msg()}\ntorch offset {want.storage_offset()}"
        assert all(a == b for a, b, n in zip(s.strides, want.stride(), want.shape) if n > 1), \
            f"{msg()}\ntorch strides {want.stride()}"
    if s is not None:
        src = c.phys[s.source]
        lin = torch.tensor(s.offset)
        for k, (n, st_) in enumerate(zip(m.shape, s.strides)):
            lin = lin + torch.arange(n).reshape([n if j == k else 1 for j in range(len(m.shape))]) * st_
        assert torch.equal(src.flatten()[lin.expand(m.shape)], want), f"{msg()}\nreads the wrong elements"
        if all(st_ >= 0 for st_ in s.strides):
            assert torch.equal(torch.as_strided(src.flatten(), m.shape, s.strides, s.offset), want), msg()


def check_chain(c: Chain) -> None:
    note(c.text())
    want = c.values[-1]
    if not c.steps:
        return
    left, right = compose_chain(c)
    check_mapping(left, c, want, "left-to-right")
    check_mapping(right, c, want, "right-to-left")
    check_strided(left, c, want)


# ---------------------------------------------------------------------------
# the tests
def test_core_ops_are_fuzzed():
    """The ops movement.py defined when this fuzzer was written must stay in it."""
    core = {"permute", "transpose", "t", "reshape", "view", "flatten", "unflatten", "unsqueeze", "squeeze",
            "slice", "expand", "cat", "constant_pad_nd", "index_select", "clone"}
    assert core <= {g.name for g in AVAILABLE}, f"no pull for {sorted(core - {g.name for g in AVAILABLE})}"


@settings(max_examples=250, **SETTINGS)
@given(chains(AVAILABLE))
def test_random_movement_chains(c):
    check_chain(c)


@settings(max_examples=120, **SETTINGS)
@given(chains(VIEW_OPS))
def test_random_view_chains_are_strided(c):
    """Chains of view ops only: torch returns a view, so the composed mapping must be strided()."""
    if not c.steps:
        return
    want = c.values[-1]
    x = c.phys["x"]
    assert want.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), c.text()
    check_chain(c)  # check_strided: strided() is not None and matches torch's view


@pytest.mark.parametrize("op", [g.name for g in AVAILABLE])
def test_each_op_in_short_chains(op):
    """Each op alone, then after a permute / slice, on random shapes: pins a failure to one op."""
    g = BY_NAME[op]
    pre = [BY_NAME["permute"], BY_NAME["slice"], BY_NAME["expand"]]

    @settings(max_examples=20, **SETTINGS)
    @given(shapes if g.shapes is None else g.shapes, st.data())
    def run(shape, data):
        x = torch.empty(shape)
        if not g.ok(x):
            return
        c = data.draw(chains([g], min_len=1, max_len=1, shape=shape))
        check_chain(c)
        c2 = data.draw(chains(pre, min_len=1, max_len=2, shape=shape))
        if c2.steps and g.ok(c2.cur):
            c2 = _extend(data.draw, c2, g)
            check_chain(c2)

    run()


def _extend(draw, c: Chain, g: OpGen) -> Chain:
    step = g.make(draw, c.cur, c)
    out, _ = run_torch(step, c.cur, c)
    if 0 < out.numel() <= MAX_NUMEL and 1 <= out.dim() <= MAX_RANK:
        c.steps.append(step)
        c.values.append(out)
        c.names.append(f"v{len(c.steps)}")
    return c
