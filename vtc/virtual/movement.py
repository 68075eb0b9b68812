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

Scatter-like pulls (``index_put``, ``index_copy``, ``scatter``) need the inverse
of an index tensor: "which update lands at this output position, if any".  Such
a pull loads from a *derived* index tensor whose name records its recipe
(``inverse(t1,t2)``, ``inverse_dim1(t3)``, see ``derived_name``); the executor
computes it from the real index tensors with ``derive_index_tensors`` before
reading through the mapping.  The inverse holds -1 where nothing is written and
the last writer where indices repeat; torch's own result is only defined for
unique indices, and so is ours.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

import torch

from vtc.index.expr import TRUE, Expr, and_, eq, ge, lift, load, lt, mod, select
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
    """out[i] = self[the same row-major position]."""
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
    """out[i] = self[j] with j[dims[k]] = i[k]."""
    rank = len(self.shape)
    dims = [_dim(d, rank) for d in dims]
    idx = [None] * rank
    for k, d in enumerate(dims):
        idx[d] = out_vars(out_shapes[0])[k]
    return _single(out_shapes[0], self, idx)


@pulls("swapaxes")
def _pull_swapaxes(self, axis0, axis1, out_shapes):
    """swapaxes is transpose."""
    return _pull_transpose(self, axis0, axis1, out_shapes)


@pulls("transpose")
def _pull_transpose(self, dim0, dim1, out_shapes):
    """The permute that swaps dim0 and dim1."""
    rank = len(self.shape)
    dims = list(range(rank))
    a, b = _dim(dim0, rank), _dim(dim1, rank)
    dims[a], dims[b] = dims[b], dims[a]
    return _pull_permute(self, dims, out_shapes)


@pulls("t")
def _pull_t(self, out_shapes):
    """out[i, j] = self[j, i] (a 0-d or 1-d self is unchanged)."""
    return _pull_permute(self, list(reversed(range(len(self.shape)))), out_shapes)


@pulls("expand", "expand_as")
def _pull_expand(self, out_shapes, **_):
    """out[..., i] = self[i] on the trailing dims, 0 where self has size 1 (broadcast)."""
    (shape,) = out_shapes
    iv = out_vars(shape)
    lead = len(shape) - len(self.shape)
    idx = [0 if s == 1 and shape[lead + k] != 1 else iv[lead + k] for k, s in enumerate(self.shape)]
    return _single(shape, self, idx)


@pulls("slice")
def _pull_slice(self, dim=0, start=None, end=None, step=1, out_shapes=()):
    """out[..., i, ...] = self[..., start + i*step, ...]."""
    d = _dim(dim, len(self.shape))
    size = self.shape[d]
    start = 0 if start is None else start
    start = max(0, min(size, start + size if start < 0 else start))
    iv = list(out_vars(out_shapes[0]))
    iv[d] = start + iv[d] * step
    return _single(out_shapes[0], self, iv)


@pulls("cat")
def _pull_cat(tensors, dim=0, out_shapes=()):
    """out[..., i, ...] = tensors[k][..., i - o_k, ...] for the input k whose range holds i."""
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
    """tensors[k][i] -> out0[..., i_dim + o_k, ...]."""
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
    """out[i] = self[i - before] inside the input, else `value` (negative pads crop)."""
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
    """out[..., i, ...] = self[..., index[i], ...]."""
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
    """out[..., j] = weight[indices[...], j]."""
    (shape,) = out_shapes
    iv = out_vars(shape)
    n = weight.shape[0]
    row = load(indices.name, iv[:-1], 0, n - 1)
    return _single(shape, weight, (row, iv[-1]), index_tensors={indices.name: tuple(indices.shape)},
                   checks=(index_check(indices.name, 0, n - 1, "embedding"),))


@pulls("clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_to_copy")
def _pull_identity(self, out_shapes, **_):
    """out[i] = self[i]."""
    return _single(out_shapes[0], self, out_vars(out_shapes[0]))



# ---------------------------------------------------------------------------
# more helpers
def _wrap(v: Expr, n: int) -> Expr:
    """v with a negative value counted from the end of a dimension of size n."""
    return select(lt(v, 0), v + n, v)


def _bcast(index: Sequence[Expr], shape: Sequence[int], to: Sequence[int]) -> list[Expr]:
    """The index into a tensor of shape `to` that broadcasts (right-aligned) to `shape`, read at `index`."""
    lead = len(shape) - len(to)
    return [lift(0) if s == 1 else index[lead + k] for k, s in enumerate(to)]


def _tensor_arg(t: Any, **index_and_checks) -> dict:
    return {"index_tensors": {t.name: tuple(t.shape)}, **index_and_checks}


def _is_tensor(x: Any) -> bool:
    return hasattr(x, "name") and hasattr(x, "shape")


# ---------------------------------------------------------------------------
# derived index tensors (inverses of scatter indices)
def _inverse(inputs: list[torch.Tensor], shape: tuple[int, ...], dim: int | None) -> torch.Tensor:
    """inv[a[j] % n0, b[j] % n1, ...] = position of j in the broadcast of the index tensors a, b, ...; else -1."""
    idx = torch.broadcast_tensors(*[t.to(torch.int64) for t in inputs])
    lin = torch.zeros(idx[0].shape, dtype=torch.int64, device=idx[0].device)
    for i, n in zip(idx, shape):
        lin = lin * n + i % n
    pos = torch.arange(lin.numel(), device=lin.device)
    inv = torch.full((_numel(shape),), -1, dtype=torch.int64, device=lin.device)
    return inv.scatter_reduce(0, lin.reshape(-1), pos, "amax").reshape(shape)


def _inverse_dim(inputs: list[torch.Tensor], shape: tuple[int, ...], dim: int | None) -> torch.Tensor:
    """inv[j with j_dim := a[j]] = j_dim for the one index tensor a (as scatter along dim writes); else -1."""
    (a,) = inputs
    a = a.to(torch.int64)
    pos = torch.arange(a.shape[dim], device=a.device).reshape([-1 if k == dim else 1 for k in range(a.dim())])
    inv = torch.full(shape, -1, dtype=torch.int64, device=a.device)
    return inv.scatter_reduce(dim, a, pos.expand(a.shape).contiguous(), "amax")


# kind -> how to compute it from (its input index tensors, its shape, its dim); where
# indices repeat, the last writer (largest position) wins.
DERIVED: dict[str, Callable[[list[torch.Tensor], tuple[int, ...], int | None], torch.Tensor]] = {
    "inverse": _inverse,
    "inverse_dim": _inverse_dim,
}
_DERIVED_NAME = re.compile(r"([a-z_]+?)(\d*)\(([^()]*)\)")  # kind, dim, comma-separated inputs


def derived_name(inputs: Sequence[str], dim: int | None = None) -> str:
    """The name of the inverse of index tensors `inputs` (``inverse(a,b)``), or along dim (``inverse_dim1(a)``)."""
    return f"inverse({','.join(inputs)})" if dim is None else f"inverse_dim{dim}({','.join(inputs)})"


def _parse_derived(name: str) -> tuple[str, int | None, list[str]] | None:
    match = _DERIVED_NAME.fullmatch(name)
    if match is None or match.group(1) not in DERIVED:
        return None
    return match.group(1), int(match.group(2)) if match.group(2) else None, match.group(3).split(",")


def has_derived_index_tensors(m: Mapping, among: Collection[str] | None = None) -> bool:
    """True when `m` loads an index tensor derived from real ones (one of `among`, where given; else
    derive_index_tensors returns {})."""
    return any(_parse_derived(n) is not None and (among is None or n in among) for n in m.index_tensors)


def derive_index_tensors(m: Mapping, tensors: dict[str, torch.Tensor],
                         wanted: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """The derived index tensors that `m` loads and `tensors` lacks (of those, only the `wanted` ones where given),
    computed from the real ones.

    Runs the mapping's range checks first, so a bad index raises the op's IndexError; where `wanted` is given
    (a kernel: the tensors it loads, whose own checks it runs), only the checks of the real index tensors the
    wanted ones are computed from: a mapping may hold real index tensors computed by a later kernel (two
    ``index_copy_`` into one cache, at ``pos`` and at ``pos + 1``: the kernel of ``pos + 1`` loads ``pos`` as
    a plain operand, before ``pos + 1`` exists).
    """
    todo = {n: (tuple(s), _parse_derived(n)) for n, s in m.index_tensors.items()
            if n not in tensors and (wanted is None or n in wanted)}
    todo = {n: (s, r) for n, (s, r) in todo.items() if r is not None}
    if todo:
        sources = {a for _, (_, _, inputs) in todo.values() for a in inputs}
        for c in m.checks:
            if wanted is None or c.tensor in sources:
                c.run(tensors[c.tensor])
    return {n: DERIVED[kind]([tensors[a] for a in inputs], shape, dim)
            for n, (shape, (kind, dim, inputs)) in todo.items()}


# ---------------------------------------------------------------------------
# selecting, splitting, stacking
@pulls("select")
def _pull_select(self, dim, index, out_shapes):
    """out[..., i, ...] = self[..., index, i, ...]: dim `dim` is fixed at `index`."""
    d = _dim(dim, len(self.shape))
    n = self.shape[d]
    if not -n <= index < n:
        raise IndexError(f"select: index {index} is out of range for dimension {dim} of size {n}")
    iv = list(out_vars(out_shapes[0]))
    iv.insert(d, index % n)
    return _single(out_shapes[0], self, iv)


@pulls("narrow")
def _pull_narrow(self, dim, start, length, out_shapes):
    """out = self[..., start:start+length, ...]; a tensor start (narrow.Tensor) is loaded, and must be >= 0."""
    d = _dim(dim, len(self.shape))
    n = self.shape[d]
    iv = list(out_vars(out_shapes[0]))
    if not _is_tensor(start):
        iv[d] = iv[d] + (start + n if start < 0 else start)
        return _single(out_shapes[0], self, iv)
    iv[d] = iv[d] + load(start.name, [0] * len(start.shape), 0, n - length)
    check = index_check(start.name, 0, n - length, "narrow")
    return _single(out_shapes[0], self, iv, **_tensor_arg(start, checks=(check,)))


@pulls("split", "split_with_sizes", "chunk")
def _pull_split(self, dim=0, out_shapes=(), **_):
    """Output k is self[..., o_k:o_k+size_k, ...], the sizes read off the outputs."""
    d = _dim(dim, len(self.shape))
    maps, offset = [], 0
    for shape in out_shapes:
        iv = list(out_vars(shape))
        iv[d] = iv[d] + offset
        offset += shape[d]
        maps.append(_single(shape, self, iv))
    return tuple(maps)


@pulls("unbind")
def _pull_unbind(self, dim=0, out_shapes=()):
    """Output k is self.select(dim, k)."""
    d = _dim(dim, len(self.shape))
    return tuple(_single(shape, self, [*out_vars(shape)[:d], k, *out_vars(shape)[d:]])
                 for k, shape in enumerate(out_shapes))


@pulls("stack")
def _pull_stack(tensors, dim=0, out_shapes=()):
    """out[..., k, ...] = tensors[k][...]."""
    (shape,) = out_shapes
    d = _dim(dim, len(shape))
    iv = out_vars(shape)
    rest = iv[:d] + iv[d + 1:]
    pieces = tuple(Piece(t.name, rest, TRUE if k == len(tensors) - 1 else lt(iv[d], k + 1))
                   for k, t in enumerate(tensors))
    return Mapping(shape, pieces, {t.name: tuple(t.shape) for t in tensors})


# ---------------------------------------------------------------------------
# repeating
@pulls("repeat", "tile")
def _pull_repeat(self, out_shapes, **_):
    """out[..., i] = self[i % self.shape] on the trailing dims (extra leading dims are new)."""
    (shape,) = out_shapes
    iv = out_vars(shape)
    lead = len(shape) - len(self.shape)
    return _single(shape, self, [iv[lead + k] % max(s, 1) for k, s in enumerate(self.shape)])


@pulls("repeat_interleave")
def _pull_repeat_interleave(self, repeats, dim=None, output_size=None, out_shapes=()):
    """out[..., i, ...] = self[..., i // repeats, ...] (on the flattened self when dim is None)."""
    if _is_tensor(repeats):
        raise NotImplementedError("repeat_interleave with a repeats tensor: the output shape depends on its values")
    (shape,) = out_shapes
    iv = list(out_vars(shape))
    r = max(int(repeats), 1)
    if dim is None:
        return _single(shape, self, delinearize(iv[0] // r, self.shape))
    d = _dim(dim, len(self.shape))
    iv[d] = iv[d] // r
    return _single(shape, self, iv)


# ---------------------------------------------------------------------------
# reordering
@pulls("movedim")
def _pull_movedim(self, source, destination, out_shapes):
    """The permute that moves dims `source` to positions `destination`, the others keeping their order."""
    rank = len(self.shape)
    src = [_dim(s, rank) for s in (source if isinstance(source, (list, tuple)) else [source])]
    dst = [_dim(s, rank) for s in (destination if isinstance(destination, (list, tuple)) else [destination])]
    order: list[int | None] = [None] * rank
    for s, t in zip(src, dst):
        order[t] = s
    rest = iter(k for k in range(rank) if k not in src)
    return _pull_permute(self, [o if o is not None else next(rest) for o in order], out_shapes)


@pulls("flip")
def _pull_flip(self, dims, out_shapes):
    """out[i] = self[i] with i_d -> n_d - 1 - i_d on the flipped dims."""
    iv = list(out_vars(out_shapes[0]))
    for d in {_dim(d, len(self.shape)) for d in dims}:
        iv[d] = self.shape[d] - 1 - iv[d]
    return _single(out_shapes[0], self, iv)


@pulls("roll")
def _pull_roll(self, shifts, dims=(), out_shapes=()):
    """out[i] = self[(i_d - shift) mod n_d]; with no dims, the roll is of the flattened tensor."""
    (shape,) = out_shapes
    iv = list(out_vars(shape))
    if not dims:
        (shift,) = shifts
        n = max(_numel(shape), 1)
        return _single(shape, self, delinearize((linear_index(iv, shape) - shift) % n, shape))
    for shift, d in zip(shifts, dims):
        d = _dim(d, len(shape))
        iv[d] = (iv[d] - shift) % max(shape[d], 1)
    return _single(shape, self, iv)


@pulls("pixel_shuffle")
def _pull_pixel_shuffle(self, upscale_factor, out_shapes):
    """(*, C*r*r, H, W) -> (*, C, H*r, W*r): out[c, h, w] = self[c*r*r + (h%r)*r + w%r, h//r, w//r]."""
    (shape,) = out_shapes
    r = upscale_factor
    *lead, c, h, w = out_vars(shape)
    return _single(shape, self, [*lead, c * (r * r) + (h % r) * r + w % r, h // r, w // r])


@pulls("pixel_unshuffle")
def _pull_pixel_unshuffle(self, downscale_factor, out_shapes):
    """(*, C, H*r, W*r) -> (*, C*r*r, H, W): out[c, h, w] = self[c//(r*r), h*r + (c//r)%r, w*r + c%r]."""
    (shape,) = out_shapes
    r = downscale_factor
    *lead, c, h, w = out_vars(shape)
    return _single(shape, self, [*lead, c // (r * r), h * r + (c // r) % r, w * r + c % r])


# ---------------------------------------------------------------------------
# strided windows
@pulls("diagonal")
def _pull_diagonal(self, offset=0, dim1=0, dim2=1, out_shapes=()):
    """out[..., k] = self[..., k + max(-offset, 0) at dim1, ..., k + max(offset, 0) at dim2, ...]."""
    (shape,) = out_shapes
    rank = len(self.shape)
    d1, d2 = _dim(dim1, rank), _dim(dim2, rank)
    iv = out_vars(shape)
    rest = iter(iv[:-1])
    idx = [None if k in (d1, d2) else next(rest) for k in range(rank)]
    idx[d1] = iv[-1] + max(-offset, 0)
    idx[d2] = iv[-1] + max(offset, 0)
    return _single(shape, self, idx)


@pulls("as_strided")
def _pull_as_strided(self, size, stride, storage_offset=None, out_shapes=()):
    """out[i] = self.flat[storage_offset + sum(i_k * stride_k)].

    Reads self as its contiguous flat storage: exact only for a contiguous input
    with storage offset 0, which every tensor in a vtc graph is (the executor
    materialises movement inputs contiguously).
    """
    (shape,) = out_shapes
    lin = lift(storage_offset or 0)
    for i, s in zip(out_vars(shape), stride):
        lin = lin + i * s
    return _single(shape, self, delinearize(lin, self.shape))


@pulls("unfold")
def _pull_unfold(self, dimension, size, step, out_shapes):
    """out[..., k, ..., j] = self[..., k*step + j, ...]: windows of `size` every `step` along `dimension`."""
    (shape,) = out_shapes
    iv = list(out_vars(shape))
    if not self.shape:
        return _single(shape, self, ())
    d = _dim(dimension, len(self.shape))
    j = iv.pop()
    iv[d] = iv[d] * step + j
    return _single(shape, self, iv)


# ---------------------------------------------------------------------------
# gathers: index tensors loaded at run time
@pulls("gather")
def _pull_gather(self, dim, index, sparse_grad=False, out_shapes=()):
    """out[i] = self[i with i_dim := index[i]]."""
    (shape,) = out_shapes
    iv = list(out_vars(shape))
    if not self.shape:
        return _single(shape, self, (), **_tensor_arg(index, checks=(index_check(index.name, 0, 0, "gather"),)))
    d = _dim(dim, len(self.shape))
    n = self.shape[d]
    iv[d] = load(index.name, out_vars(shape), 0, n - 1)
    return _single(shape, self, iv, **_tensor_arg(index, checks=(index_check(index.name, 0, n - 1, "gather"),)))


@pulls("take")
def _pull_take(self, index, out_shapes):
    """out[i] = self.flatten()[index[i]] (negative values count from the end)."""
    (shape,) = out_shapes
    n = _numel(self.shape)
    v = _wrap(load(index.name, out_vars(shape), -n, n - 1), n)
    return _single(shape, self, delinearize(v, self.shape),
                   **_tensor_arg(index, checks=(index_check(index.name, -n, n - 1, "take"),)))


@dataclass(frozen=True)
class _Advanced:
    """self[indices] under ATen's advanced indexing (integer index tensors, None = the whole dim)."""

    shape: tuple[int, ...]          # shape of the indexed tensor
    tensors: tuple[Any, ...]        # the index tensors, in dim order
    dims: tuple[int, ...]           # the dims they index
    bshape: tuple[int, ...]         # their broadcast shape
    pos: int                        # where the broadcast dims go in the result
    rest: tuple[int, ...]           # the dims taken whole

    @classmethod
    def of(cls, shape: Sequence[int], indices: Sequence[Any], op: str) -> "_Advanced":
        entries = list(indices) + [None] * (len(shape) - len(indices))
        for t in entries:
            if t is not None and getattr(t, "dtype", torch.int64) in (torch.bool, torch.uint8):
                raise NotImplementedError(f"{op}: boolean mask indices are not supported "
                                          f"(the result shape depends on the mask's values)")
        dims = tuple(k for k, t in enumerate(entries) if t is not None)
        tensors = tuple(entries[k] for k in dims)
        bshape = tuple(torch.broadcast_shapes(*[tuple(t.shape) for t in tensors])) if tensors else ()
        adjacent = dims == tuple(range(dims[0], dims[-1] + 1)) if dims else True
        pos = dims[0] if dims and adjacent else 0
        rest = tuple(k for k in range(len(shape)) if k not in dims)
        return cls(tuple(shape), tensors, dims, bshape, pos, rest)

    @property
    def result_shape(self) -> tuple[int, ...]:
        whole = [self.shape[k] for k in self.rest]
        return (*whole[:self.pos], *self.bshape, *whole[self.pos:])

    def source_index(self, r: Sequence[Expr]) -> list[Expr]:
        """The index of self read at result index r (index tensor values wrapped if negative)."""
        nb = len(self.bshape)
        bvars = r[self.pos:self.pos + nb]
        whole = [*r[:self.pos], *r[self.pos + nb:]]
        idx: list[Expr] = [lift(0)] * len(self.shape)
        for k, v in zip(self.rest, whole):
            idx[k] = v
        for k, t in zip(self.dims, self.tensors):
            n = self.shape[k]
            idx[k] = _wrap(load(t.name, _bcast(bvars, self.bshape, t.shape), -n, n - 1), n)
        return idx

    def extras(self, op: str, derived: dict | None = None) -> dict:
        """index_tensors and checks of a mapping that reads these index tensors."""
        return {"index_tensors": {**{t.name: tuple(t.shape) for t in self.tensors}, **(derived or {})},
                "checks": tuple(dict.fromkeys(index_check(t.name, -self.shape[k], self.shape[k] - 1, op)
                                              for k, t in zip(self.dims, self.tensors)))}


@pulls("index")
def _pull_index(self, indices, out_shapes):
    """out[r] = self[indices...][r] under ATen advanced indexing (integer indices; negative ones wrap)."""
    (shape,) = out_shapes
    adv = _Advanced.of(self.shape, indices, "index")
    return _single(shape, self, adv.source_index(out_vars(shape)), **adv.extras("index"))


# ---------------------------------------------------------------------------
# scatters: self, except where an update lands (through a derived inverse index)
def _inverse_load(name: str, index: Sequence[Expr], n: int) -> tuple[Expr, Expr]:
    """(written, position): whether an update lands here, and which one, read from a derived inverse.

    The position is declared to lie in [0, n-1]: true wherever `written` holds,
    which is the only place a piece reads it, and it lets the simplifier drop
    the wrap-around of a -1 (``inv % n`` becomes ``inv``).
    """
    return ge(load(name, index, -1, n - 1), 0), load(name, index, 0, max(n - 1, 0))


def _overwrite(shape, self, src, src_index, when, **extra) -> Mapping:
    """out = src[src_index] where `when` holds, else self[out index]."""
    iv = out_vars(shape)
    pieces = (Piece(src.name, tuple(lift(i) for i in src_index), when), Piece(self.name, iv))
    return Mapping(tuple(shape), pieces, {src.name: tuple(src.shape), self.name: tuple(self.shape)}, **extra)


@pulls("index_put")
def _pull_index_put(self, indices, values, accumulate=False, out_shapes=()):
    """out = self, except out[indices...] = values (broadcast to the indexed shape); unique indices."""
    if accumulate:
        raise NotImplementedError("index_put with accumulate=True adds values: it is not a movement op")
    (shape,) = out_shapes
    adv = _Advanced.of(self.shape, indices, "index_put")
    iv = out_vars(shape)
    if not adv.dims:  # no index tensors: values overwrite everything
        return _single(shape, values, _bcast(iv, shape, values.shape))
    name = derived_name([t.name for t in adv.tensors])
    written, inv = _inverse_load(name, [iv[k] for k in adv.dims], _numel(adv.bshape))
    whole = [iv[k] for k in adv.rest]
    r = [*whole[:adv.pos], *delinearize(inv, adv.bshape), *whole[adv.pos:]]
    vidx = _bcast(r, adv.result_shape, values.shape)
    return _overwrite(shape, self, values, vidx, written,
                      **adv.extras("index_put", {name: tuple(self.shape[k] for k in adv.dims)}))


@pulls("index_copy")
def _pull_index_copy(self, dim, index, source, out_shapes):
    """out = self, except out[..., index[k], ...] = source[..., k, ...]; unique indices."""
    (shape,) = out_shapes
    d = _dim(dim, len(self.shape))
    n = self.shape[d]
    iv = list(out_vars(shape))
    name = derived_name([index.name])
    written, inv = _inverse_load(name, [iv[d]], _numel(index.shape))
    src = list(iv)
    src[d] = inv
    return _overwrite(shape, self, source, src, written, index_tensors={index.name: tuple(index.shape), name: (n,)},
                      checks=(index_check(index.name, 0, n - 1, "index_copy"),))


@pulls("scatter")
def _pull_scatter(self, dim, index, src=None, value=None, reduce=None, out_shapes=()):
    """out = self, except out[i with i_dim := index[i]] = src[i] (or `value`); unique indices, no reduce."""
    if reduce is not None:
        raise NotImplementedError(f"scatter with reduce={reduce!r} combines values: it is not a movement op")
    (shape,) = out_shapes
    d = _dim(dim, len(self.shape))
    n = self.shape[d]
    iv = list(out_vars(shape))
    name = derived_name([index.name], d)
    written, inv = _inverse_load(name, iv, index.shape[d])
    extra = dict(index_tensors={index.name: tuple(index.shape), name: tuple(self.shape)},
                 checks=(index_check(index.name, 0, n - 1, "scatter"),))
    if src is None or not _is_tensor(src):
        fill = value if src is None else src
        return Mapping(shape, (Piece(None, (), written, fill), Piece(self.name, tuple(iv))),
                       {self.name: tuple(self.shape)}, **extra)
    idx = list(iv)
    idx[d] = inv
    return _overwrite(shape, self, src, idx, written, **extra)


@pulls("slice_scatter")
def _pull_slice_scatter(self, src, dim=0, start=None, end=None, step=1, out_shapes=()):
    """out = self, except out[..., start::step, ...] (src's extent of it) = src."""
    (shape,) = out_shapes
    d = _dim(dim, len(self.shape))
    n = self.shape[d]
    start = 0 if start is None else start
    start = max(0, min(n, start + n if start < 0 else start))
    iv = list(out_vars(shape))
    rel = iv[d] - start
    when = and_(ge(rel, 0), lt(rel, (src.shape[d] - 1) * step + 1), eq(mod(rel, step), 0) if step > 1 else TRUE)
    idx = list(iv)
    idx[d] = rel // step
    return _overwrite(shape, self, src, idx, when)


@pulls("select_scatter")
def _pull_select_scatter(self, src, dim, index, out_shapes):
    """out = self, except out[..., index, ...] = src."""
    (shape,) = out_shapes
    d = _dim(dim, len(self.shape))
    iv = list(out_vars(shape))
    return _overwrite(shape, self, src, iv[:d] + iv[d + 1:], eq(iv[d], index % self.shape[d]))


# ---------------------------------------------------------------------------
# pushes: input index -> the output element it becomes (outputs out0, out1, ...)
def _push_to(src: Any, index: Sequence[Expr], out_shape: Sequence[int], out: str = "out0", **extra) -> Mapping:
    return Mapping(tuple(src.shape), (Piece(out, tuple(lift(i) for i in index)),), {out: tuple(out_shape)}, **extra)


@pushes("stack")
def _push_stack(tensors, dim=0, out_shapes=()):
    """tensors[k][i] -> out0[..., k, ...]."""
    (shape,) = out_shapes
    d = _dim(dim, len(shape))
    return {t.name: _push_to(t, [*out_vars(t.shape)[:d], k, *out_vars(t.shape)[d:]], shape)
            for k, t in enumerate(tensors)}


@pushes("split", "split_with_sizes", "chunk")
def _push_split(self, dim=0, out_shapes=(), **_):
    """self[i] -> out_k[i_dim - o_k] for the output k whose slice holds i_dim."""
    d = _dim(dim, len(self.shape))
    iv = out_vars(self.shape)
    pieces, sources, offset = [], {}, 0
    for k, shape in enumerate(out_shapes):
        if shape[d] == 0:
            continue
        idx = list(iv)
        idx[d] = iv[d] - offset
        offset += shape[d]
        pieces.append(Piece(f"out{k}", tuple(idx), lt(iv[d], offset)))
        sources[f"out{k}"] = tuple(shape)
    if not pieces:  # self has no elements
        return {}
    pieces[-1] = Piece(pieces[-1].source, pieces[-1].index)
    return {self.name: Mapping(tuple(self.shape), tuple(pieces), sources)}


@pushes("unbind")
def _push_unbind(self, dim=0, out_shapes=()):
    """self[i] -> out_{i_dim}[i without dim]."""
    d = _dim(dim, len(self.shape))
    iv = out_vars(self.shape)
    rest = iv[:d] + iv[d + 1:]
    k_last = len(out_shapes) - 1
    pieces = tuple(Piece(f"out{k}", rest, TRUE if k == k_last else lt(iv[d], k + 1)) for k in range(len(out_shapes)))
    return {self.name: Mapping(tuple(self.shape), pieces, {f"out{k}": tuple(s) for k, s in enumerate(out_shapes)})}


@pushes("slice_scatter")
def _push_slice_scatter(self, src, dim=0, start=None, end=None, step=1, out_shapes=()):
    """src[i] -> out0[..., start + i_dim*step, ...]."""
    d = _dim(dim, len(self.shape))
    n = self.shape[d]
    start = 0 if start is None else start
    start = max(0, min(n, start + n if start < 0 else start))
    idx = list(out_vars(src.shape))
    idx[d] = start + idx[d] * step
    return {src.name: _push_to(src, idx, out_shapes[0])}


@pushes("select_scatter")
def _push_select_scatter(self, src, dim, index, out_shapes):
    """src[i] -> out0[..., index, ...]."""
    d = _dim(dim, len(self.shape))
    iv = out_vars(src.shape)
    return {src.name: _push_to(src, [*iv[:d], index % self.shape[d], *iv[d:]], out_shapes[0])}


@pushes("index_copy")
def _push_index_copy(self, dim, index, source, out_shapes):
    """source[i] -> out0[i with i_dim := index[i_dim]] (unique indices)."""
    d = _dim(dim, len(self.shape))
    n = self.shape[d]
    idx = list(out_vars(source.shape))
    idx[d] = load(index.name, [idx[d]] if index.shape else [], 0, n - 1)
    return {source.name: _push_to(source, idx, out_shapes[0],
                                  **_tensor_arg(index, checks=(index_check(index.name, 0, n - 1, "index_copy"),)))}


@pushes("index_put")
def _push_index_put(self, indices, values, accumulate=False, out_shapes=()):
    """values[r] -> out0[self index of r under the indices] (unique indices; values not broadcast)."""
    adv = _Advanced.of(self.shape, indices, "index_put")
    if accumulate or tuple(values.shape) != adv.result_shape:
        return {}
    return {values.name: _push_to(values, adv.source_index(out_vars(values.shape)), out_shapes[0],
                                  **adv.extras("index_put"))}


@pushes("scatter")
def _push_scatter(self, dim, index, src=None, value=None, reduce=None, out_shapes=()):
    """src[i] -> out0[i with i_dim := index[i]] (unique indices; src of index's shape)."""
    if reduce is not None or not _is_tensor(src) or tuple(src.shape) != tuple(index.shape):
        return {}
    d = _dim(dim, len(self.shape))
    n = self.shape[d]
    idx = list(out_vars(src.shape))
    idx[d] = load(index.name, out_vars(src.shape), 0, n - 1)
    return {src.name: _push_to(src, idx, out_shapes[0],
                               **_tensor_arg(index, checks=(index_check(index.name, 0, n - 1, "scatter"),)))}


@pushes("permute")
def _push_permute(self, dims, out_shapes):
    """self[i] -> out0[i_dims[0], i_dims[1], ...]."""
    iv = out_vars(self.shape)
    return {self.name: _push_to(self, [iv[_dim(d, len(self.shape))] for d in dims], out_shapes[0])}


@pushes("swapaxes")
def _push_swapaxes(self, axis0, axis1, out_shapes):
    """swapaxes is transpose."""
    return _push_transpose(self, axis0, axis1, out_shapes)


@pushes("transpose")
def _push_transpose(self, dim0, dim1, out_shapes):
    """self[i] -> out0[i with dims dim0 and dim1 swapped]."""
    dims = list(range(len(self.shape)))
    a, b = _dim(dim0, len(self.shape)), _dim(dim1, len(self.shape))
    dims[a], dims[b] = dims[b], dims[a]
    return _push_permute(self, dims, out_shapes)


@pushes("t")
def _push_t(self, out_shapes):
    """self[i, j] -> out0[j, i]."""
    return _push_permute(self, list(reversed(range(len(self.shape)))), out_shapes)


@pushes("view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "reshape_as", "flatten",
        "unflatten", "squeeze", "unsqueeze", "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_to_copy")
def _push_reshape(self, out_shapes, **_):
    """self[i] -> out0[the same row-major position]."""
    (shape,) = out_shapes
    return {self.name: _push_to(self, delinearize(linear_index(out_vars(self.shape), self.shape), shape), shape)}
