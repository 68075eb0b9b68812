"""One pull (and, where it exists, one push) mapping per data-movement op.

``pull(target, args, kwargs, out_shapes)`` returns, for each output of a
movement op, the ``Mapping`` from the output index (variables ``i0, i1, ...``)
to the input it comes from.  ``push(...)`` returns, for each data input that a
producer could write straight into the op's outputs, the mapping from that
input's index to the output element it becomes (outputs are named ``out0``,
``out1``, ...).

Each definition below is registered under the ATen names it covers and takes
the ATen schema's argument names as keywords (``self``, ``dims``, ...), with
tensors given as anything that has ``.name`` and ``.shape`` (an IR ``Value`` or
a ``Src``).  Every definition is checked against torch on every index of small
shapes in ``tests/virtual``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from vtc.index.expr import TRUE, Expr, and_, ge, lift, load, lt
from vtc.index.mapping import Mapping, Piece, index_check, out_vars
from vtc.virtual.ops import base_name, packet_name


@dataclass(frozen=True)
class Src:
    """A named tensor operand of a movement op (an IR Value works as well)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


PULLS: dict[str, Callable[..., tuple[Mapping, ...]]] = {}
PUSHES: dict[str, Callable[..., dict[str, Mapping]]] = {}


def _register(table: dict, names: Sequence[str]):
    def deco(fn):
        for n in names:
            table[n] = fn
        return fn
    return deco


def pulls(*names: str):
    """Registers a pull definition under ATen packet names."""
    return _register(PULLS, names)


def pushes(*names: str):
    """Registers a push definition under ATen packet names."""
    return _register(PUSHES, names)


def bind(target: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The ATen call's arguments by schema name, defaults filled in."""
    schema = target._schema
    out: dict[str, Any] = {}
    positional = list(args)
    for a in schema.arguments:
        if positional and not a.kwarg_only:
            out[a.name] = positional.pop(0)
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    if positional:
        raise TypeError(f"{target}: {len(positional)} extra positional arguments {positional!r}")
    return out


def _name(target: Any) -> str:
    name = packet_name(target)
    if name is None:
        raise KeyError(f"{target} is not an ATen op")
    return base_name(name)


def has_pull(target: Any) -> bool:
    """True when a pull mapping is defined for this ATen op."""
    name = packet_name(target)
    return name is not None and base_name(name) in PULLS


def pull(target: Any, args: tuple, kwargs: dict, out_shapes: Sequence[Sequence[int]]) -> tuple[Mapping, ...]:
    """For each output of the call, the mapping from its index to its source element."""
    name = _name(target)
    if name not in PULLS:
        raise KeyError(f"no pull mapping for {target}; defined: {sorted(PULLS)}")
    out_shapes = [tuple(int(s) for s in shape) for shape in out_shapes]
    res = PULLS[name](out_shapes=out_shapes, **bind(target, args, kwargs))
    res = (res,) if isinstance(res, Mapping) else tuple(res)
    if [m.shape for m in res] != out_shapes:
        raise AssertionError(f"{target}: pull mappings have shapes {[m.shape for m in res]}, outputs {out_shapes}")
    return res


def push(target: Any, args: tuple, kwargs: dict, out_shapes: Sequence[Sequence[int]]) -> dict[str, Mapping]:
    """For each data input a producer may write through: input index -> output (out0, out1, ...) element."""
    name = _name(target)
    if name not in PUSHES:
        return {}
    out_shapes = [tuple(int(s) for s in shape) for shape in out_shapes]
    return PUSHES[name](out_shapes=out_shapes, **bind(target, args, kwargs))


# ---------------------------------------------------------------------------
# helpers
def _dim(d: int, rank: int) -> int:
    if not -max(rank, 1) <= d < max(rank, 1):
        raise IndexError(f"dimension {d} is out of range for a tensor of rank {rank}")
    return d % max(rank, 1)


def _single(out_shape: Sequence[int], src: Any, index: Sequence[Expr | int], when: Expr = TRUE,
            **extra) -> Mapping:
    return Mapping(tuple(out_shape), (Piece(src.name, tuple(lift(i) for i in index), when),),
                   {src.name: tuple(src.shape)}, **extra)


def linear_index(index: Sequence[Expr], shape: Sequence[int]) -> Expr:
    """The row-major linear offset of `index` in a tensor of `shape`."""
    lin: Expr = lift(0)
    for i, s in zip(index, shape):
        lin = lin * s + (i if s != 1 else 0)
    return lin


def delinearize(lin: Expr, shape: Sequence[int]) -> tuple[Expr, ...]:
    """The index of row-major offset `lin` in a tensor of `shape`."""
    out = []
    for s in reversed(shape):
        out.append(lin % s if s > 1 else lift(0))
        lin = lin // s if s > 1 else lin
    return tuple(reversed(out))


# ---------------------------------------------------------------------------
# views: the output is the input read in another order
@pulls("view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "reshape_as", "flatten",
       "unflatten", "squeeze", "unsqueeze")
def _pull_reshape(self, out_shapes, **_):
    (shape,) = out_shapes
    if _numel(shape) != _numel(self.shape):
        raise ValueError(f"cannot view a tensor of shape {tuple(self.shape)} as {shape}")
    return _single(shape, self, delinearize(linear_index(out_vars(shape), shape), self.shape))


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


@pulls("permute")
def _pull_permute(self, dims, out_shapes):
    rank = len(self.shape)
    dims = [_dim(d, rank) for d in dims]
    idx = [None] * rank
    for k, d in enumerate(dims):
        idx[d] = out_vars(out_shapes[0])[k]
    return _single(out_shapes[0], self, idx)


@pulls("transpose", "swapaxes")
def _pull_transpose(self, dim0, dim1, out_shapes):
    rank = len(self.shape)
    dims = list(range(rank))
    a, b = _dim(dim0, rank), _dim(dim1, rank)
    dims[a], dims[b] = dims[b], dims[a]
    return _pull_permute(self, dims, out_shapes)


@pulls("t")
def _pull_t(self, out_shapes):
    return _pull_permute(self, list(reversed(range(len(self.shape)))), out_shapes)


@pulls("expand", "expand_as")
def _pull_expand(self, out_shapes, **_):
    (shape,) = out_shapes
    iv = out_vars(shape)
    lead = len(shape) - len(self.shape)
    idx = [0 if s == 1 and shape[lead + k] != 1 else iv[lead + k] for k, s in enumerate(self.shape)]
    return _single(shape, self, idx)


@pulls("slice")
def _pull_slice(self, dim=0, start=None, end=None, step=1, out_shapes=()):
    d = _dim(dim, len(self.shape))
    size = self.shape[d]
    start = 0 if start is None else start
    start = max(0, min(size, start + size if start < 0 else start))
    iv = list(out_vars(out_shapes[0]))
    iv[d] = start + iv[d] * step
    return _single(out_shapes[0], self, iv)


@pulls("cat")
def _pull_cat(tensors, dim=0, out_shapes=()):
    (shape,) = out_shapes
    rank = len(shape)
    d = _dim(dim, rank)
    iv = out_vars(shape)
    pieces, sources, offset = [], {}, 0
    parts = [t for t in tensors if not (len(t.shape) == 1 and t.shape[0] == 0)]  # legacy empty inputs
    for k, t in enumerate(parts):
        idx = list(iv)
        idx[d] = iv[d] - offset
        offset += t.shape[d]
        last = k == len(parts) - 1
        pieces.append(Piece(t.name, tuple(idx), TRUE if last else lt(iv[d], offset)))
        sources[t.name] = tuple(t.shape)
    return Mapping(shape, tuple(pieces), sources)


@pushes("cat")
def _push_cat(tensors, dim=0, out_shapes=()):
    (shape,) = out_shapes
    d = _dim(dim, len(shape))
    out, offset = {}, 0
    for t in tensors:
        if len(t.shape) == 1 and t.shape[0] == 0:
            continue
        iv = list(out_vars(t.shape))
        iv[d] = iv[d] + offset
        offset += t.shape[d]
        out[t.name] = Mapping(tuple(t.shape), (Piece("out0", tuple(iv)),), {"out0": shape})
    return out


@pulls("constant_pad_nd")
def _pull_pad(self, pad, value=0, out_shapes=()):
    (shape,) = out_shapes
    iv = list(out_vars(shape))
    rank = len(shape)
    when = TRUE
    for k in range(len(pad) // 2):
        d = rank - 1 - k
        before = pad[2 * k]
        iv[d] = iv[d] - before
        when = and_(when, ge(iv[d], 0), lt(iv[d], self.shape[d]))
    dtype = getattr(self, "dtype", torch.float32)
    fill = bool(value) if dtype == torch.bool else (int(value) if not dtype.is_floating_point else float(value))
    return Mapping(shape, (Piece(self.name, tuple(iv), when), Piece(None, (), TRUE, fill)),
                   {self.name: tuple(self.shape)})


@pulls("index_select")
def _pull_index_select(self, dim, index, out_shapes):
    (shape,) = out_shapes
    d = _dim(dim, len(self.shape))
    iv = list(out_vars(shape))
    n = self.shape[d] if self.shape else 1
    lead = [iv[d]] if len(index.shape) == 1 else []
    iv[d] = load(index.name, lead, 0, n - 1)
    return _single(shape, self, iv, index_tensors={index.name: tuple(index.shape)},
                   checks=(index_check(index.name, 0, n - 1, "index_select"),))


@pulls("embedding")
def _pull_embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False, out_shapes=()):
    (shape,) = out_shapes
    iv = out_vars(shape)
    n = weight.shape[0]
    row = load(indices.name, iv[:-1], 0, n - 1)
    return _single(shape, weight, (row, iv[-1]), index_tensors={indices.name: tuple(indices.shape)},
                   checks=(index_check(indices.name, 0, n - 1, "embedding"),))


@pulls("clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_to_copy")
def _pull_identity(self, out_shapes, **_):
    return _single(out_shapes[0], self, out_vars(out_shapes[0]))

