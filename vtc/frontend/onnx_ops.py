"""The ONNX op table: how each ONNX op becomes ATen calls of vtc's graph IR.

Each handler ``fn(cx, ins, at)`` receives the lowering context ``cx`` (see
``vtc.frontend.onnx._Lowering``), the node's inputs as operands (``None`` for an
absent optional input; a ``Value`` known at run time or a ``torch.Tensor``
constant) and its attributes ``at``; it returns the outputs in order.  It emits
ATen calls only through ``cx.call(target, *args)``, which folds the call when
every tensor argument is constant, so one handler serves both the graph and the
compile-time evaluation of shape subgraphs.

Movement ONNX ops become ATen movement ops (which the plan makes virtual):

    Transpose -> permute          Reshape/Flatten/Squeeze/Unsqueeze -> view
    Slice -> slice (index_select of the positions for negative steps)   Split -> split_with_sizes
    Concat -> cat   Expand -> expand   Tile -> repeat   Identity/Dropout -> alias
    Gather -> select / index_select (constant indices) or index.Tensor
    GatherElements -> gather   GatherND -> index.Tensor   ScatterND -> index_put
    ScatterElements -> scatter.src   Pad -> constant_pad_nd (constant mode) or
    index_select with constant indices (edge / reflect / wrap)
    DepthToSpace -> pixel_shuffle (CRD) or view/permute/view (DCR); SpaceToDepth -> view/permute/view
    Resize (nearest) -> index_select with constant indices along each resized dim (onnxruntime's
    float32 index rule; half_pixel_symmetric and tf_* modes fall back)

Compute ops map to the ATen ops ``torch.export`` produces (MatMul -> mm/bmm between
views and expands, Gemm -> addmm, Conv -> convolution, LayerNormalization ->
native_layer_norm, ...), so later stages see the same graphs from both frontends.

A handler that cannot express a case raises ``Unsupported(reason)``: the node
then runs through onnxruntime (``vtc.frontend.onnx_ort``) and is reported as a
fallback.  Ops absent from ``OPS`` (e.g. ``Det``, ``Hardmax``, ``OneHot``,
linear/cubic ``Resize``) do the same.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import onnx
import torch

from vtc.frontend.onnx_ort import torch_dtype

A = torch.ops.aten
OPS: dict[tuple[str, str], Callable] = {}
# The rewrites of exporter patterns into the graphs torch.export gives (a constant MatMul / Gemm B as a
# Linear's t(W), Transposes composed, a ScatterND through a Transpose as the index_put under it); False
# lowers each ONNX node on its own (the ablation of bench/onnx_side_by_side.py's vtc-onnx-plain).
REWRITE = True


class Unsupported(Exception):
    """A handler declines this node: it runs through onnxruntime instead."""


def op(*names: str, domain: str = ""):
    """Registers a handler for ONNX op types (in ``domain``)."""
    def deco(fn):
        for n in names:
            OPS[(domain, n)] = fn
        return fn
    return deco


class Attrs:
    """A node's attributes with typed getters."""

    def __init__(self, node: onnx.NodeProto) -> None:
        self.node = node
        self._a = {a.name: a for a in node.attribute}

    def __contains__(self, name: str) -> bool:
        return name in self._a

    def get(self, name: str, default: Any = None) -> Any:
        """The attribute's Python value (strings decoded, tensors/graphs as protos), or default."""
        a = self._a.get(name)
        if a is None:
            return default
        v = onnx.helper.get_attribute_value(a)
        return v.decode() if isinstance(v, bytes) else v

    def i(self, name: str, default: int = 0) -> int:
        """An int attribute."""
        return int(self.get(name, default))

    def f(self, name: str, default: float = 0.0) -> float:
        """A float attribute."""
        return float(self.get(name, default))

    def s(self, name: str, default: str = "") -> str:
        """A string attribute."""
        return str(self.get(name, default))

    def ints(self, name: str, default: Any = None) -> list[int] | None:
        """An ints attribute as a list, or default."""
        v = self.get(name, None)
        return default if v is None else [int(x) for x in v]


# ----------------------------------------------------------------------------- helpers

def _axis(cx, a: int, rank: int, what: str = "axis") -> int:
    if not -rank <= a < max(rank, 1):
        raise cx.error(f"{what} {a} is out of range for a tensor of rank {rank}")
    return a % max(rank, 1)


def _prod(xs) -> int:
    return int(math.prod(int(x) for x in xs))


def _shape(x) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _scalar(dtype: torch.dtype, v: float):
    """v as a Python scalar of dtype's kind (what ATen Scalar arguments take)."""
    if dtype == torch.bool:
        return bool(v)
    return float(v) if dtype.is_floating_point or dtype.is_complex else int(v)


def _full(value, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _reverse(cx, x, dims):
    """x reversed along dims, as index_select with constant reversed indices (a movement op).

    Not aten.flip: its composed mapping is a strided view with a negative stride,
    which the executor hands to ``as_strided`` (rejects negative strides), so a
    flip read by a compute op crashes (shared-code problem, see the ONNX frontend
    report).  Switch to ``cx.call(A.flip.default, x, dims)`` once that is fixed.
    """
    for d in dims:
        n = int(x.shape[d])
        x = cx.call(A.index_select.default, x, d, torch.arange(n - 1, -1, -1, dtype=torch.int64))
    return x


def _producer(x):
    """The node of the graph being built that computes Value x (None for inputs, constants, tensors)."""
    return getattr(x, "producer", None) if not isinstance(x, torch.Tensor) else None


def _permute(cx, x, perm):
    """x permuted by perm, a permute of a permute composed into one (none at all when they cancel).

    Exporters wrap an update along a middle dim in a pair of Transposes (the dynamo exporter's
    KV-cache ``index_put`` on the sequence dim: Transpose -> ScatterND -> Transpose back); composing them
    lets ``_scatter_nd`` hand the planner the same ``index_put`` torch.export gives it."""
    perm = [int(p) for p in perm]
    src = _producer(x)
    if not REWRITE:
        return cx.call(A.permute.default, x, perm)
    if src is not None and src.target is A.permute.default and not src.kwargs:
        inner = [int(p) for p in src.args[1]]
        x, perm = src.args[0], [inner[p] for p in perm]
    if perm == list(range(len(perm))):
        return x  # (a graph output that is a graph input gets an alias, _Lowering.run)
    return cx.call(A.permute.default, x, perm)


def _weight_t(cx, w):
    """The permute node W -> W^T of a constant [N, K] weight W (not folded: a Linear's ``t(W)``).

    ``x @ W^T`` is the form torch.export gives a Linear and the one vtc's GEMM planning knows: decode's
    skinny GEMMs read W's rows in place (``weight_rows``), larger ones pack the constant W^T once.  A
    folded W^T (a constant [K, N] row-major B) would be packed on every call instead."""
    return cx.call(A.permute.default, cx.const_value(w), [1, 0])


def _constant_b(cx, b):
    """A constant 2-D MatMul / Gemm B [K, N] as permute(W) of a constant W = B^T [N, K] (see _weight_t).

    ONNX exporters store a Linear's weight transposed (MatMul with a [K, N] initializer) or as Gemm
    transB=1; both become the Linear's ``t(W)``.  One W per B tensor (a B shared by several MatMuls keeps
    one transposed copy)."""
    return _weight_t(cx, cx.weight_t(b))


def _view(cx, x, shape):
    return cx.call(A.view.default, x, [int(s) for s in shape])


def _opt(ins: list, k: int):
    return ins[k] if len(ins) > k else None


def _axes_of(cx, ins: list, at: Attrs, k: int = 1) -> list[int] | None:
    """Axes given as an attribute (older opsets) or as input k (newer ones); None when absent or empty."""
    if "axes" in at:
        return at.ints("axes")
    x = _opt(ins, k)
    if x is None:
        return None
    axes = cx.ints(x, "axes")
    return axes or None


# ----------------------------------------------------------------------------- shape-only ops (always folded)

@op("Shape")
def _shape_op(cx, ins, at):
    dims = list(_shape(ins[0]))
    r = len(dims)
    start, end = at.i("start", 0), at.get("end", r)
    start = min(max(start + r if start < 0 else start, 0), r)
    end = min(max(int(end) + r if int(end) < 0 else int(end), 0), r)
    return torch.tensor(dims[start:end], dtype=torch.int64)


@op("Size")
def _size(cx, ins, at):
    return torch.tensor(_prod(_shape(ins[0])), dtype=torch.int64)


@op("EyeLike")
def _eyelike(cx, ins, at):
    n, m = _shape(ins[0])
    dtype = torch_dtype(at.i("dtype"), cx.where) if "dtype" in at else ins[0].dtype
    k = at.i("k", 0)
    return torch.ones(n, m).triu(k).tril(k).to(dtype)


@op("Constant")
def _constant(cx, ins, at):
    from vtc.frontend.onnx import _tensor

    if "value" in at:
        return _tensor(at.get("value"))
    if "value_float" in at:
        return torch.tensor(at.f("value_float"), dtype=torch.float32)
    if "value_floats" in at:
        return torch.tensor([float(v) for v in at.get("value_floats")], dtype=torch.float32)
    if "value_int" in at:
        return torch.tensor(at.i("value_int"), dtype=torch.int64)
    if "value_ints" in at:
        return torch.tensor(at.ints("value_ints"), dtype=torch.int64)
    if "sparse_value" in at:
        return torch.from_numpy(onnx.numpy_helper.to_array(at.get("sparse_value")).copy())
    raise cx.error(f"Constant with attributes {sorted(at._a)} is not supported (strings are not tensors vtc has)")


@op("ConstantOfShape")
def _constant_of_shape(cx, ins, at):
    shape = cx.ints(ins[0], "input")
    if "value" in at:
        from vtc.frontend.onnx import _tensor

        v = _tensor(at.get("value")).reshape(())
        return torch.full(shape, v.item(), dtype=v.dtype)
    return torch.zeros(shape, dtype=torch.float32)


@op("Range")
def _range(cx, ins, at):
    start, limit, delta = (cx.const(x) for x in ins)
    if start is None or limit is None or delta is None:
        raise cx.error("Range with inputs known only at run time has a data-dependent output shape; "
                       "vtc compiles static shapes")
    dtype = start.dtype
    n = max(0, math.ceil((float(limit) - float(start)) / float(delta)))
    if dtype.is_floating_point:  # onnxruntime accumulates: value += delta
        np_dtype = start.numpy().dtype
        steps = np.full(n, delta.item(), dtype=np_dtype)
        if n:
            steps[0] = start.item()
        return torch.from_numpy(np.cumsum(steps, dtype=np_dtype))
    return torch.arange(int(start), int(start) + n * int(delta), int(delta), dtype=dtype)[:n]


# ----------------------------------------------------------------------------- movement ops

@op("Identity")
def _identity(cx, ins, at):
    if isinstance(ins[0], list):
        return [list(ins[0])]
    return cx.call(A.alias.default, ins[0])


@op("Dropout")
def _dropout(cx, ins, at):
    training = _opt(ins, 2)
    if training is not None:
        t = cx.const(training)
        if t is None or bool(t):
            raise Unsupported("Dropout in training mode is random")
    x = ins[0]
    if len(cx.node.output) > 1 and cx.node.output[1]:
        return [cx.call(A.alias.default, x), torch.ones(_shape(x), dtype=torch.bool)]
    return [cx.call(A.alias.default, x)]


@op("Transpose")
def _transpose(cx, ins, at):
    x = ins[0]
    perm = at.ints("perm") or list(reversed(range(len(x.shape))))
    if sorted(perm) != list(range(len(x.shape))):
        raise cx.error(f"perm {perm} is not a permutation of the {len(x.shape)} dims")
    if cx.const(x) is not None:
        return cx.call(A.permute.default, x, perm)
    return _permute(cx, x, perm)


@op("Reshape")
def _reshape(cx, ins, at):
    x = ins[0]
    shape = cx.ints(ins[1], "shape")
    dims = list(_shape(x))
    allowzero = at.i("allowzero", 0)
    out = [dims[k] if s == 0 and not allowzero else s for k, s in enumerate(shape)]
    if out.count(-1) > 1:
        raise cx.error(f"shape {shape} has more than one -1")
    if -1 in out:
        known = _prod(s for s in out if s != -1)
        if known == 0 or _prod(dims) % known:
            raise cx.error(f"cannot reshape a tensor of shape {dims} to {shape}")
        out[out.index(-1)] = _prod(dims) // known
    if _prod(out) != _prod(dims):
        raise cx.error(f"cannot reshape a tensor of shape {dims} ({_prod(dims)} elements) to {shape} -> {out}")
    return _view(cx, x, out)


@op("Flatten")
def _flatten(cx, ins, at):
    x = ins[0]
    dims = _shape(x)
    axis = at.i("axis", 1)
    if not -len(dims) <= axis <= len(dims):
        raise cx.error(f"axis {axis} is out of range for rank {len(dims)}")
    axis = axis + len(dims) if axis < 0 else axis
    return _view(cx, x, [_prod(dims[:axis]), _prod(dims[axis:])])


@op("Squeeze")
def _squeeze(cx, ins, at):
    x = ins[0]
    dims = _shape(x)
    axes = _axes_of(cx, ins, at)
    if axes is None:
        axes = [k for k, s in enumerate(dims) if s == 1]
    axes = {_axis(cx, a, len(dims), "axes value") for a in axes}
    for a in axes:
        if dims[a] != 1:
            raise cx.error(f"cannot squeeze dim {a} of size {dims[a]} (shape {list(dims)})")
    return _view(cx, x, [s for k, s in enumerate(dims) if k not in axes])


@op("Unsqueeze")
def _unsqueeze(cx, ins, at):
    x = ins[0]
    dims = list(_shape(x))
    axes = _axes_of(cx, ins, at)
    if axes is None:
        raise cx.error("Unsqueeze needs axes")
    rank = len(dims) + len(axes)
    axes = sorted(_axis(cx, a, rank, "axes value") for a in axes)
    if len(set(axes)) != len(axes):
        raise cx.error(f"axes {axes} repeat a dim")
    it = iter(dims)
    return _view(cx, x, [1 if k in axes else next(it) for k in range(rank)])


@op("Slice")
def _slice(cx, ins, at):
    x = ins[0]
    dims = _shape(x)
    if "starts" in at:  # opset < 10
        starts, ends = at.ints("starts"), at.ints("ends")
        axes = at.ints("axes") or list(range(len(starts)))
        steps = [1] * len(starts)
    else:
        starts, ends = cx.ints(ins[1], "starts"), cx.ints(ins[2], "ends")
        axes = cx.ints(ins[3], "axes") if _opt(ins, 3) is not None else list(range(len(starts)))
        steps = cx.ints(ins[4], "steps") if _opt(ins, 4) is not None else [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise cx.error(f"starts {starts}, ends {ends}, axes {axes}, steps {steps} differ in length")
    emitted = False
    for s, e, a, st in zip(starts, ends, axes, steps):
        d = _axis(cx, a, len(dims), "axes value")
        n = int(x.shape[d])
        if st == 0:
            raise cx.error(f"step 0 on axis {a}")
        if st > 0:
            s = min(max(s + n if s < 0 else s, 0), n)
            e = min(max(e + n if e < 0 else e, 0), n)
            count = max(0, -(-(e - s) // st))
            if count == n and st == 1 or (count == n == 1):
                continue
            lo = s if count else 0
            x = cx.call(A.slice.Tensor, x, d, lo, lo + (count - 1) * st + 1 if count else 0, st)
        else:  # negative step: the chosen positions, in order, as constant indices (see _reverse)
            s = min(max(s + n if s < 0 else s, 0), n - 1)
            e = min(max(e + n if e < 0 else e, -1), n - 1)
            count = max(0, -(-(s - e) // -st))
            x = cx.call(A.index_select.default, x, d, torch.arange(count, dtype=torch.int64) * st + s)
        emitted = True
    return x if emitted else cx.call(A.alias.default, x)


@op("Split")
def _split(cx, ins, at):
    x = ins[0]
    dims = _shape(x)
    axis = _axis(cx, at.i("axis", 0), len(dims))
    n = dims[axis]
    n_out = len(cx.node.output)
    sizes = None
    if "split" in at:
        sizes = at.ints("split")
    elif _opt(ins, 1) is not None:
        sizes = cx.ints(ins[1], "split") or None
    if sizes is None:
        num = at.i("num_outputs", n_out)
        if "num_outputs" in at:
            k = -(-n // num)
            sizes = [k] * (num - 1) + [n - k * (num - 1)]
        elif n % num:
            raise cx.error(f"cannot split {n} elements of axis {axis} into {num} equal parts")
        else:
            sizes = [n // num] * num
    if sum(sizes) != n or any(s < 0 for s in sizes):
        raise cx.error(f"split sizes {sizes} do not add up to {n} (axis {axis} of shape {list(dims)})")
    outs = cx.call(A.split_with_sizes.default, x, sizes, axis)
    return list(outs) if isinstance(outs, tuple) else [outs]


@op("Concat")
def _concat(cx, ins, at):
    parts = [x for x in ins if x is not None]
    axis = _axis(cx, at.i("axis"), len(parts[0].shape))
    return cx.call(A.cat.default, parts, axis)


@op("Expand")
def _expand(cx, ins, at):
    x = ins[0]
    shape = cx.ints(ins[1], "shape")
    try:
        out = torch.broadcast_shapes(_shape(x), tuple(shape))
    except RuntimeError:
        raise cx.error(f"cannot expand shape {list(x.shape)} to {shape}") from None
    return cx.call(A.expand.default, x, list(out))


@op("Tile")
def _tile(cx, ins, at):
    x = ins[0]
    repeats = cx.ints(ins[1], "repeats")
    if len(repeats) != len(x.shape):
        raise cx.error(f"repeats {repeats} has {len(repeats)} entries, the input rank is {len(x.shape)}")
    return cx.call(A.repeat.default, x, repeats)


def _normalized_indices(cx, idx: torch.Tensor, n: int, what: str) -> torch.Tensor:
    idx = idx.to(torch.int64)
    bad = (idx < -n) | (idx >= n)
    if bool(bad.any()):
        raise cx.error(f"{what} value {int(idx[bad][0])} is out of range for a dim of size {n}")
    return torch.where(idx < 0, idx + n, idx)


def _runtime_indices(cx, idx, n: int):
    """Runtime index tensor -> int64 with negative values wrapped (one pointwise op)."""
    if idx.dtype != torch.int64:
        idx = cx.call(A._to_copy.default, idx, dtype=torch.int64)
    return cx.call(A.remainder.Scalar, idx, n)


@op("Gather")
def _gather(cx, ins, at):
    x, idx = ins
    dims = _shape(x)
    axis = _axis(cx, at.i("axis", 0), len(dims))
    c = cx.const(idx)
    if c is not None:
        c = _normalized_indices(cx, c, dims[axis], "indices")
        if c.dim() == 0:
            return cx.call(A.select.int, x, axis, int(c))
        if c.dim() == 1:
            return cx.call(A.index_select.default, x, axis, c)
        idx = c
    return cx.call(A.index.Tensor, x, [None] * axis + [idx])


@op("GatherElements")
def _gather_elements(cx, ins, at):
    x, idx = ins
    axis = _axis(cx, at.i("axis", 0), len(x.shape))
    n = int(x.shape[axis])
    c = cx.const(idx)
    idx = _normalized_indices(cx, c, n, "indices") if c is not None else _runtime_indices(cx, idx, n)
    return cx.call(A.gather.default, x, axis, idx)


def _index_columns(cx, idx) -> list:
    """indices[..., j] for each j (the last dim of a GatherND/ScatterND index tensor)."""
    k = int(idx.shape[-1])
    c = cx.const(idx)
    if c is not None:
        c = c.to(torch.int64)
        return [c[..., j].contiguous() for j in range(k)]
    src = _producer(idx)
    if REWRITE and k == 1 and src is not None and src.target is A.view.default and src.args[0].shape == idx.shape[:-1]:
        return [src.args[0]]  # Unsqueeze(positions, -1): the positions themselves (torch.export's index_put)
    return [cx.call(A.select.int, idx, -1, j) for j in range(k)]


@op("GatherND")
def _gather_nd(cx, ins, at):
    x, idx = ins
    b = at.i("batch_dims", 0)
    dims, ishape = _shape(x), _shape(idx)
    k = ishape[-1]
    if k < 1 or b + k > len(dims):
        raise cx.error(f"indices of shape {list(ishape)} with batch_dims={b} do not fit data of shape {list(dims)}")
    rank = len(ishape) - 1
    batch = [torch.arange(dims[i]).view([1] * i + [dims[i]] + [1] * (rank - 1 - i)) for i in range(b)]
    cols = _index_columns(cx, idx)
    return cx.call(A.index.Tensor, x, batch + cols)


@op("ScatterND")
def _scatter_nd(cx, ins, at):
    data, idx, upd = ins
    red = at.s("reduction", "none")
    if red not in ("none", "add"):
        raise Unsupported(f"ScatterND reduction={red!r}")
    cols = _index_columns(cx, idx)
    k, src = len(cols), _producer(data)
    if REWRITE and src is not None and src.target is A.permute.default and not src.kwargs and cx.const(upd) is None:
        # ScatterND into permute(X, p) along its first k dims = permute(index_put(X, cols at dims p[:k]), p)
        # when those dims are consecutive in X: the exporter's Transpose -> ScatterND -> Transpose back of a
        # KV-cache update becomes torch.export's index_put(cache, [None, None, positions], new) (no permute
        # left once _permute composes the Transposes), which the planner pushes like torch's
        x, p = src.args[0], [int(d) for d in src.args[1]]
        p0 = p[0]
        if p[:k] == list(range(p0, p0 + k)):
            m = len(upd.shape) - (len(p) - k)  # the index tensors' broadcast dims, leading in upd
            have = [("b", i) for i in range(m)] + [("x", d) for d in p[k:]]
            want = ([("x", d) for d in range(p0)] + [("b", i) for i in range(m)]
                    + [("x", d) for d in range(p0 + k, len(p))])
            upd_x = _permute(cx, upd, [have.index(w) for w in want])
            y = cx.call(A.index_put.default, x, [None] * p0 + cols, upd_x, red == "add")
            return _permute(cx, y, p)
    return cx.call(A.index_put.default, data, cols, upd, red == "add")


@op("ScatterElements", "Scatter")
def _scatter_elements(cx, ins, at):
    data, idx, upd = ins
    axis = _axis(cx, at.i("axis", 0), len(data.shape))
    n = int(data.shape[axis])
    red = at.s("reduction", "none")
    pos = _positions_along(cx, idx, axis, data) if REWRITE and red == "none" and cx.const(upd) is None else None
    if pos is not None:
        # the TorchScript exporter's index_copy / cache[:, :, pos] = new: indices that are the positions
        # expanded over every other (whole) dim, i.e. torch.export's index_put(data, [None, None, pos], new),
        # which the planner pushes (the new rows stored in place) like the torch path's
        return cx.call(A.index_put.default, data, [None] * axis + [pos], upd, False)
    c = cx.const(idx)
    idx = _normalized_indices(cx, c, n, "indices") if c is not None else _runtime_indices(cx, idx, n)
    if red == "none":
        return cx.call(A.scatter.src, data, axis, idx, upd)
    reduce = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}.get(red)
    if reduce is None:
        raise Unsupported(f"ScatterElements reduction={red!r}")
    return cx.call(A.scatter_reduce.two, data, axis, idx, upd, reduce, include_self=True)


def _positions_along(cx, idx, axis: int, data):
    """The 1-D positions p when runtime ScatterElements indices are ``expand(p viewed along axis)`` over
    whole dims of data (so each index depends only on its position along axis); else None."""
    src = _producer(idx)
    if src is None or src.target is not A.expand.default or idx.dtype != torch.int64:
        return None
    p = src.args[0]
    shape, full = list(p.shape), list(idx.shape)
    if (len(shape) != len(full) or any(s != 1 for d, s in enumerate(shape) if d != axis)
            or any(full[d] != data.shape[d] for d in range(len(full)) if d != axis)):
        return None
    view = _producer(p)
    if view is not None and view.target is A.view.default and list(view.args[0].shape) == [shape[axis]]:
        return view.args[0]  # Unsqueeze of the 1-D positions: the positions themselves
    return _view(cx, p, [shape[axis]])


def _pad_index(mode: str, n: int, before: int, after: int) -> torch.Tensor:
    """Source positions of an edge/reflect/wrap padding of one dim (negative pads crop)."""
    p = np.arange(-before, n + after)
    if mode == "edge":
        q = np.clip(p, 0, n - 1)
    elif mode == "wrap":
        q = np.mod(p, n)
    else:  # reflect
        if n == 1:
            q = np.zeros_like(p)
        else:
            period = 2 * (n - 1)
            q = np.mod(p, period)
            q = np.where(q >= n, period - q, q)
    return torch.from_numpy(q.astype(np.int64))


@op("Pad")
def _pad(cx, ins, at):
    x = ins[0]
    dims = _shape(x)
    r = len(dims)
    mode = at.s("mode", "constant")
    if "pads" in at:  # opset < 11
        pads, value = at.ints("pads"), at.f("value", 0.0)
        axes = list(range(r))
    else:
        pads = cx.ints(ins[1], "pads")
        v = _opt(ins, 2)
        if v is not None and cx.const(v) is None:
            raise Unsupported("Pad with a constant_value known only at run time")
        value = cx.const(v).reshape(-1)[0].item() if v is not None and cx.const(v).numel() else 0
        axes = cx.ints(ins[3], "axes") if _opt(ins, 3) is not None else list(range(r))
    axes = [_axis(cx, a, r, "axes value") for a in axes]
    if len(pads) != 2 * len(axes):
        raise cx.error(f"pads {pads} should have 2 x {len(axes)} entries")
    before, after = [0] * r, [0] * r
    for k, a in enumerate(axes):
        before[a], after[a] = pads[k], pads[k + len(axes)]
    if mode == "constant":
        flat = []
        for d in reversed(range(r)):
            flat += [before[d], after[d]]
        return cx.call(A.constant_pad_nd.default, x, flat, _scalar(x.dtype, value))
    if mode not in ("edge", "reflect", "wrap"):
        raise cx.error(f"mode {mode!r} is not one of constant, edge, reflect, wrap")
    emitted = False
    for d in range(r):
        if before[d] or after[d]:
            n = dims[d]
            if mode == "reflect" and (before[d] >= n or after[d] >= n) and n > 1:
                raise Unsupported(f"reflect pad {before[d]}/{after[d]} wider than the dim ({n})")
            x = cx.call(A.index_select.default, x, d, _pad_index(mode, n, before[d], after[d]))
            emitted = True
    return x if emitted else cx.call(A.alias.default, x)


@op("DepthToSpace")
def _depth_to_space(cx, ins, at):
    x = ins[0]
    b, c, h, w = _shape(x)
    bs = at.i("blocksize")
    if c % (bs * bs):
        raise cx.error(f"channels {c} are not divisible by blocksize^2 = {bs * bs}")
    if at.s("mode", "DCR") == "CRD":
        return cx.call(A.pixel_shuffle.default, x, bs)
    t = _view(cx, x, [b, bs, bs, c // (bs * bs), h, w])
    t = cx.call(A.permute.default, t, [0, 3, 4, 1, 5, 2])
    return _view(cx, t, [b, c // (bs * bs), h * bs, w * bs])


@op("SpaceToDepth")
def _space_to_depth(cx, ins, at):
    x = ins[0]
    b, c, h, w = _shape(x)
    bs = at.i("blocksize")
    if h % bs or w % bs:
        raise cx.error(f"spatial dims {h}x{w} are not divisible by blocksize {bs}")
    t = _view(cx, x, [b, c, h // bs, bs, w // bs, bs])
    t = cx.call(A.permute.default, t, [0, 3, 5, 1, 2, 4])
    return _view(cx, t, [b, c * bs * bs, h // bs, w // bs])


def _nearest_index(n: int, m: int, scale: np.float32, ctm: str, mode: str) -> np.ndarray:
    """Input index of each of m output positions of a nearest resize of n, as onnxruntime computes it (float32)."""
    f = np.float32
    if scale == f(1):  # onnxruntime maps a dim of scale 1 one to one
        return np.arange(n, dtype=np.int64)
    xr = np.arange(m, dtype=f)
    half = f(0.5)
    if ctm == "half_pixel":
        xo = (xr + half) / scale - half
    elif ctm == "asymmetric":
        xo = xr / scale
    elif ctm == "pytorch_half_pixel":
        xo = (xr + half) / scale - half if m > 1 else np.zeros(m, dtype=f)
    elif ctm == "tf_half_pixel_for_nn":
        xo = (xr + half) / scale
    elif ctm == "align_corners":
        xo = np.zeros(m, dtype=f) if m == 1 else xr * f(n - 1) / f(m - 1)
    else:
        raise Unsupported(f"Resize coordinate_transformation_mode={ctm!r}")
    xo = xo.astype(f).astype(np.float64)  # float32 values; rounding them in float64 is exact
    away = np.sign(xo) * np.floor(np.abs(xo) + 0.5)  # std::round: halves away from zero
    if mode == "round_prefer_floor":
        idx = np.where(xo == np.trunc(xo) + 0.5, np.floor(xo), away)
    elif mode == "round_prefer_ceil":
        idx = away
    elif mode == "floor":
        idx = np.floor(xo)
    elif mode == "ceil":
        idx = np.ceil(xo)
    else:
        raise Unsupported(f"Resize nearest_mode={mode!r}")
    return np.clip(idx.astype(np.int64), 0, n - 1)


@op("Resize")
def _resize(cx, ins, at):
    x = ins[0]
    dims = _shape(x)
    r = len(dims)
    mode = at.s("mode", "nearest")
    if mode != "nearest":
        raise Unsupported(f"Resize mode={mode!r} interpolates (compute, not movement)")
    ctm = at.s("coordinate_transformation_mode", "half_pixel")
    if ctm in ("tf_crop_and_resize", "tf_half_pixel_for_nn", "half_pixel_symmetric"):
        # crop-and-resize fills with extrapolation_value; tf_half_pixel_for_nn left the spec at opset 13;
        # onnxruntime's half_pixel_symmetric rounds in ways vtc does not reproduce exactly
        raise Unsupported(f"Resize coordinate_transformation_mode={ctm!r}")
    nearest = at.s("nearest_mode", "round_prefer_floor")
    axes = [_axis(cx, a, r, "axes value") for a in (at.ints("axes") or range(r))]
    scales_in, sizes_in = _opt(ins, 2), _opt(ins, 3)
    scales = cx.floats(scales_in, "scales") if scales_in is not None else []
    sizes = cx.ints(sizes_in, "sizes") if sizes_in is not None else []
    f = np.float32
    n_in = [dims[a] for a in axes]
    if sizes:
        policy = at.s("keep_aspect_ratio_policy", "stretch")
        ratios = [f(s) / f(n) for s, n in zip(sizes, n_in)]
        if policy == "stretch":
            out, sc = list(sizes), ratios
        else:
            s = min(ratios) if policy == "not_larger" else max(ratios)
            sc = [s] * len(axes)
            out = [int(np.floor(f(s) * f(n) + f(0.5))) for n in n_in]
    elif scales:
        sc = [f(s) for s in scales]
        out = [int(f(s) * f(n)) for s, n in zip(sc, n_in)]
    else:
        raise cx.error("Resize needs scales or sizes")
    if len(out) != len(axes):
        raise cx.error(f"{len(out)} scales/sizes for {len(axes)} axes")
    if list(out) == n_in:  # onnxruntime copies the input when no dim changes size, whatever the scales
        return cx.call(A.alias.default, x)
    emitted = False
    for a, n, m, s in zip(axes, n_in, out, sc):
        idx = _nearest_index(n, m, f(s), ctm, nearest)
        if m == n and np.array_equal(idx, np.arange(n)):
            continue
        x = cx.call(A.index_select.default, x, a, torch.from_numpy(idx))
        emitted = True
    return x if emitted else cx.call(A.alias.default, x)


# ----------------------------------------------------------------------------- pointwise compute

_UNARY = {
    "Relu": A.relu.default, "Sigmoid": A.sigmoid.default, "Tanh": A.tanh.default, "Exp": A.exp.default,
    "Log": A.log.default, "Sqrt": A.sqrt.default, "Reciprocal": A.reciprocal.default, "Neg": A.neg.default,
    "Abs": A.abs.default, "Erf": A.erf.default, "Floor": A.floor.default, "Ceil": A.ceil.default,
    "Round": A.round.default, "Sin": A.sin.default, "Cos": A.cos.default, "Tan": A.tan.default,
    "Asin": A.asin.default, "Acos": A.acos.default, "Atan": A.atan.default, "Sinh": A.sinh.default,
    "Cosh": A.cosh.default, "Asinh": A.asinh.default, "Acosh": A.acosh.default, "Atanh": A.atanh.default,
    "Sign": A.sign.default, "Not": A.logical_not.default, "IsNaN": A.isnan.default, "Mish": A.mish.default,
    "BitwiseNot": A.bitwise_not.default, "HardSwish": A.hardswish.default,
}
_BINARY = {
    "Add": A.add.Tensor, "Sub": A.sub.Tensor, "Mul": A.mul.Tensor, "Equal": A.eq.Tensor, "Less": A.lt.Tensor,
    "LessOrEqual": A.le.Tensor, "Greater": A.gt.Tensor, "GreaterOrEqual": A.ge.Tensor,
    "And": A.logical_and.default, "Or": A.logical_or.default, "Xor": A.logical_xor.default,
    "BitwiseAnd": A.bitwise_and.Tensor, "BitwiseOr": A.bitwise_or.Tensor, "BitwiseXor": A.bitwise_xor.Tensor,
}


def _unary(target):
    return lambda cx, ins, at: cx.call(target, ins[0])


def _binary(target):
    return lambda cx, ins, at: cx.call(target, ins[0], ins[1])


for _name, _t in _UNARY.items():
    op(_name)(_unary(_t))
for _name, _t in _BINARY.items():
    op(_name)(_binary(_t))


@op("Div")
def _div(cx, ins, at):
    a, b = ins
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return cx.call(A.div.Tensor, a, b)
    return cx.call(A.div.Tensor_mode, a, b, rounding_mode="trunc")  # C integer division


@op("Pow")
def _pow(cx, ins, at):
    x, e = ins
    c = cx.const(e)
    if (REWRITE and c is not None and c.numel() == 1 and cx.const(x) is None and x.dtype.is_floating_point
            and len(c.shape) <= len(x.shape)):
        # a constant exponent as a Scalar, as torch.export gives ``x ** 2``: the kernels compute x * x
        # (and x**3, sqrt, rsqrt, 1/x) vectorised, where a tensor exponent is a scalar std::pow per element
        v = c.reshape(()).item()
        k = int(v) if float(v).is_integer() else float(v)
        return cx.call(A.pow.Tensor_Scalar, x, k)
    y = cx.call(A.pow.Tensor_Tensor, ins[0], ins[1])
    return y if y.dtype == ins[0].dtype else cx.call(A._to_copy.default, y, dtype=ins[0].dtype)


@op("Mod")
def _mod(cx, ins, at):
    return cx.call(A.fmod.Tensor if at.i("fmod", 0) else A.remainder.Tensor, ins[0], ins[1])


@op("BitShift")
def _bitshift(cx, ins, at):
    t = A.bitwise_left_shift.Tensor if at.s("direction") == "LEFT" else A.bitwise_right_shift.Tensor
    return cx.call(t, ins[0], ins[1])


@op("Sum", "Mean", "Max", "Min")
def _variadic(cx, ins, at):
    kind = cx.node.op_type
    target = {"Sum": A.add.Tensor, "Mean": A.add.Tensor, "Max": A.maximum.default, "Min": A.minimum.default}[kind]
    parts = [x for x in ins if x is not None]
    y = parts[0]
    for p in parts[1:]:
        y = cx.call(target, y, p)
    if kind == "Mean":
        y = cx.call(A.div.Tensor, y, _full(len(parts), y.dtype))
    elif len(parts) == 1:
        y = cx.call(A.alias.default, y)
    return y


@op("Where")
def _where(cx, ins, at):
    return cx.call(A.where.self, ins[0], ins[1], ins[2])


@op("Clip")
def _clip(cx, ins, at):
    x = ins[0]
    if "min" in at or "max" in at:  # opset < 11
        lo, hi = at.get("min"), at.get("max")
    else:
        lo_t, hi_t = _opt(ins, 1), _opt(ins, 2)
        if (lo_t is not None and cx.const(lo_t) is None) or (hi_t is not None and cx.const(hi_t) is None):
            return cx.call(A.clamp.Tensor, x, lo_t, hi_t)
        lo = None if lo_t is None else cx.const(lo_t).reshape(()).item()
        hi = None if hi_t is None else cx.const(hi_t).reshape(()).item()
    if lo is None and hi is None:
        return cx.call(A.alias.default, x)
    return cx.call(A.clamp.default, x, None if lo is None else _scalar(x.dtype, lo),
                   None if hi is None else _scalar(x.dtype, hi))


@op("Cast")
def _cast(cx, ins, at):
    dtype = torch_dtype(at.i("to"), f"{cx.where}: Cast to")
    x = ins[0]
    return x if x.dtype == dtype else cx.call(A._to_copy.default, x, dtype=dtype)


@op("CastLike")
def _cast_like(cx, ins, at):
    x, like = ins
    return x if x.dtype == like.dtype else cx.call(A._to_copy.default, x, dtype=like.dtype)


@op("LeakyRelu")
def _leaky_relu(cx, ins, at):
    return cx.call(A.leaky_relu.default, ins[0], at.f("alpha", 0.01))


@op("Elu")
def _elu(cx, ins, at):
    return cx.call(A.elu.default, ins[0], at.f("alpha", 1.0), 1.0, 1.0)


@op("Selu")
def _selu(cx, ins, at):
    return cx.call(A.elu.default, ins[0], at.f("alpha", 1.67326319217681884765625),
                   at.f("gamma", 1.05070102214813232421875), 1.0)


@op("Celu")
def _celu(cx, ins, at):
    return cx.call(A.celu.default, ins[0], at.f("alpha", 1.0))


@op("Gelu")
@op("Gelu", domain="com.microsoft")
def _gelu(cx, ins, at):
    return cx.call(A.gelu.default, ins[0], approximate=at.s("approximate", "none"))


@op("HardSigmoid")
def _hard_sigmoid(cx, ins, at):
    x = ins[0]
    y = cx.call(A.add.Scalar, cx.call(A.mul.Scalar, x, at.f("alpha", 0.2)), at.f("beta", 0.5))
    return cx.call(A.clamp.default, y, 0.0, 1.0)


@op("Softplus")
def _softplus(cx, ins, at):
    return cx.call(A.softplus.default, ins[0], 1, 20)


@op("Softsign")
def _softsign(cx, ins, at):
    x = ins[0]
    return cx.call(A.div.Tensor, x, cx.call(A.add.Scalar, cx.call(A.abs.default, x), 1))


@op("ThresholdedRelu")
def _thresholded_relu(cx, ins, at):
    x = ins[0]
    return cx.call(A.where.self, cx.call(A.gt.Scalar, x, at.f("alpha", 1.0)), x, _full(0, x.dtype))


@op("PRelu")
def _prelu(cx, ins, at):
    x, slope = ins
    return cx.call(A.where.self, cx.call(A.lt.Scalar, x, 0), cx.call(A.mul.Tensor, x, slope), x)


@op("IsInf")
def _isinf(cx, ins, at):
    x = ins[0]
    pos, neg = at.i("detect_positive", 1), at.i("detect_negative", 1)
    y = cx.call(A.isinf.default, x)
    if pos and neg:
        return y
    if not pos and not neg:
        return torch.zeros(_shape(x), dtype=torch.bool)
    side = cx.call(A.gt.Scalar if pos else A.lt.Scalar, x, 0)
    return cx.call(A.logical_and.default, y, side)


# ----------------------------------------------------------------------------- matmul, conv

def _matmul(cx, a, b):
    """torch.matmul in core ATen: mm / bmm between views and expands (the movement ops become virtual)."""
    sa, sb = list(_shape(a)), list(_shape(b))
    squeeze = []
    if len(sa) == 1:
        a, sa = _view(cx, a, [1, sa[0]]), [1, sa[0]]
        squeeze.append(-2)
    if len(sb) == 1:
        b, sb = _view(cx, b, [sb[0], 1]), [sb[0], 1]
        squeeze.append(-1)
    m, k, n = sa[-2], sa[-1], sb[-1]
    if sb[-2] != k:
        raise cx.error(f"matmul of shapes {sa} and {sb}: inner dims {k} and {sb[-2]} differ")
    if REWRITE and len(sb) == 2 and cx.const(b) is not None and cx.const(a) is None:
        b = _constant_b(cx, cx.const(b))
    if len(sa) == 2 and len(sb) == 2:
        y = cx.call(A.mm.default, a, b)
        batch = []
    elif len(sb) == 2:
        batch = sa[:-2]
        y = cx.call(A.mm.default, _view(cx, a, [_prod(batch) * m, k]), b)
        y = _view(cx, y, batch + [m, n])
    else:
        try:
            batch = list(torch.broadcast_shapes(tuple(sa[:-2]), tuple(sb[:-2])))
        except RuntimeError:
            raise cx.error(f"matmul batch dims of {sa} and {sb} do not broadcast") from None
        if sa[:-2] != batch:
            a = cx.call(A.expand.default, a, batch + [m, k])
        if sb[:-2] != batch:
            b = cx.call(A.expand.default, b, batch + [k, n])
        nb = _prod(batch)
        y = cx.call(A.bmm.default, _view(cx, a, [nb, m, k]), _view(cx, b, [nb, k, n]))
        y = _view(cx, y, batch + [m, n])
    if squeeze:
        full = batch + [m, n]
        keep = [s for k_, s in enumerate(full) if k_ - len(full) not in squeeze]
        y = _view(cx, y, keep)
    return y


@op("MatMul")
def _matmul_op(cx, ins, at):
    return _matmul(cx, ins[0], ins[1])


@op("Gemm")
def _gemm(cx, ins, at):
    a, b = ins[0], ins[1]
    c = _opt(ins, 2)
    alpha, beta = at.f("alpha", 1.0), at.f("beta", 1.0)
    if at.i("transA", 0):
        a = cx.call(A.permute.default, a, [1, 0])
    runtime = REWRITE and cx.const(a) is None
    if at.i("transB", 0):
        b = _weight_t(cx, b) if runtime and cx.const(b) is not None else cx.call(A.permute.default, b, [1, 0])
    elif runtime and cx.const(b) is not None:
        b = _constant_b(cx, b)
    if c is not None and beta != 0:
        return cx.call(A.addmm.default, c, a, b, beta=_scalar(a.dtype, beta), alpha=_scalar(a.dtype, alpha))
    y = cx.call(A.mm.default, a, b)
    return y if alpha == 1 else cx.call(A.mul.Tensor, y, _full(alpha, y.dtype))


def _same_pads(auto_pad: str, n_in: list[int], k: list[int], s: list[int], d: list[int]) -> list[int]:
    """ONNX pads [begins..., ends...] of auto_pad SAME_UPPER / SAME_LOWER."""
    begins, ends = [], []
    for n, kk, ss, dd in zip(n_in, k, s, d):
        total = max(0, (-(-n // ss) - 1) * ss + (kk - 1) * dd + 1 - n)
        small, big = total // 2, total - total // 2
        begins.append(small if auto_pad == "SAME_UPPER" else big)
        ends.append(big if auto_pad == "SAME_UPPER" else small)
    return begins + ends


def _conv_geometry(cx, at, x, k: list[int]):
    nd = len(k)
    s = at.ints("strides") or [1] * nd
    d = at.ints("dilations") or [1] * nd
    auto = at.s("auto_pad", "NOTSET")
    spatial = list(_shape(x)[2:])
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = _same_pads(auto, spatial, k, s, d)
    elif auto == "VALID":
        pads = [0] * (2 * nd)
    else:
        pads = at.ints("pads") or [0] * (2 * nd)
    return s, d, pads[:nd], pads[nd:]


def _explicit_pad(cx, x, begins: list[int], ends: list[int], value):
    """constant_pad_nd of the trailing spatial dims (negative values crop)."""
    flat = []
    for b, e in zip(reversed(begins), reversed(ends)):
        flat += [b, e]
    return cx.call(A.constant_pad_nd.default, x, flat, value)


@op("Conv")
def _conv(cx, ins, at):
    x, w = ins[0], ins[1]
    b = _opt(ins, 2)
    k = list(_shape(w)[2:])
    s, d, pb, pe = _conv_geometry(cx, at, x, k)
    if pb != pe:
        x = _explicit_pad(cx, x, pb, pe, _scalar(x.dtype, 0))
        pb = [0] * len(k)
    return cx.call(A.convolution.default, x, w, b, s, pb, d, False, [0] * len(k), at.i("group", 1))


@op("ConvTranspose")
def _conv_transpose(cx, ins, at):
    x, w = ins[0], ins[1]
    b = _opt(ins, 2)
    nd = len(w.shape) - 2
    if "output_shape" in at or at.s("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise Unsupported("ConvTranspose with output_shape or auto_pad SAME")
    s = at.ints("strides") or [1] * nd
    d = at.ints("dilations") or [1] * nd
    pads = at.ints("pads") or [0] * (2 * nd)
    op_ = at.ints("output_padding") or [0] * nd
    pb, pe = pads[:nd], pads[nd:]
    sym = pb == pe
    y = cx.call(A.convolution.default, x, w, b, s, pb if sym else [0] * nd, d, True, op_, at.i("group", 1))
    if not sym:
        y = _explicit_pad(cx, y, [-p for p in pb], [-p for p in pe], _scalar(y.dtype, 0))
    return y


@op("Einsum")
def _einsum(cx, ins, at):
    return cx.call(A.einsum.default, at.s("equation"), [x for x in ins if x is not None])


# ----------------------------------------------------------------------------- softmax, norms

def _softmax_like(target):
    def lower(cx, ins, at):
        x = ins[0]
        r = len(x.shape)
        if cx.opset >= 13:
            return cx.call(target, x, _axis(cx, at.i("axis", -1), r), False)
        axis = _axis(cx, at.i("axis", 1), r)  # older opsets: softmax of the 2-D flattening at axis
        dims = _shape(x)
        t = _view(cx, x, [_prod(dims[:axis]), _prod(dims[axis:])])
        return _view(cx, cx.call(target, t, 1, False), dims)
    return lower


op("Softmax")(_softmax_like(A._softmax.default))
op("LogSoftmax")(_softmax_like(A._log_softmax.default))


@op("LayerNormalization")
def _layer_norm(cx, ins, at):
    x, scale = ins[0], ins[1]
    bias = _opt(ins, 2)
    axis = _axis(cx, at.i("axis", -1), len(x.shape))
    norm = list(_shape(x)[axis:])
    if list(_shape(scale)) != norm:
        scale = cx.call(A.expand.default, scale, norm)
    if bias is not None and list(_shape(bias)) != norm:
        bias = cx.call(A.expand.default, bias, norm)
    return list(cx.call(A.native_layer_norm.default, x, norm, scale, bias, at.f("epsilon", 1e-5)))


def _rms_norm(cx, x, scale, axis: int, eps: float):
    """(y, inv_std) of RMSNorm over dims axis.. as torch.export gives a Llama RMSNorm (pow, mean, add, rsqrt,
    mul, mul: one row kernel), computed in float32 for a lower-precision x (stash_type 1) and cast back."""
    dtype = x.dtype
    if dtype != torch.float32:
        x = cx.call(A._to_copy.default, x, dtype=torch.float32)
    dims = list(range(axis, len(x.shape)))
    ms = cx.call(A.mean.dim, cx.call(A.pow.Tensor_Scalar, x, 2), dims, True)
    inv = cx.call(A.rsqrt.default, cx.call(A.add.Scalar, ms, eps))
    y = cx.call(A.mul.Tensor, x, inv)
    if scale.dtype != torch.float32:
        scale = cx.call(A._to_copy.default, scale, dtype=torch.float32)
    y = cx.call(A.mul.Tensor, y, scale)
    return (y if dtype == torch.float32 else cx.call(A._to_copy.default, y, dtype=dtype)), inv


@op("RMSNormalization")  # opset 23
@op("SimplifiedLayerNormalization")  # onnxruntime's contrib op (registered in the ONNX domain)
def _simplified_layer_norm(cx, ins, at):
    x, scale = ins[0], ins[1]
    if not x.dtype.is_floating_point or at.i("stash_type", 1) != 1:
        raise Unsupported(f"{cx.node.op_type} of {x.dtype} with stash_type {at.i('stash_type', 1)}")
    y, inv = _rms_norm(cx, x, scale, _axis(cx, at.i("axis", -1), len(x.shape)), at.f("epsilon", 1e-5))
    return [y, inv]


def _skip_sum(cx, ins):
    x, skip = ins[0], ins[1]
    bias = _opt(ins, 4 if cx.node.op_type == "SkipLayerNormalization" else 3)
    s = cx.call(A.add.Tensor, x, skip)
    return s if bias is None else cx.call(A.add.Tensor, s, bias)


def _no_stats(cx):
    """Skip*LayerNormalization's mean / inv_std_var outputs (training statistics) are left to onnxruntime."""
    outs = list(cx.node.output)
    if any(outs[k] for k in (1, 2) if k < len(outs)):
        raise Unsupported(f"{cx.node.op_type} with its mean / inv_std_var outputs")


@op("SkipSimplifiedLayerNormalization", domain="com.microsoft")
def _skip_simplified_layer_norm(cx, ins, at):
    """RMSNorm(input + skip (+ bias)) * gamma over the last dim; output 3 is the sum (the residual)."""
    _no_stats(cx)
    s = _skip_sum(cx, ins)
    y, _ = _rms_norm(cx, s, ins[2], len(s.shape) - 1, at.f("epsilon", 1e-5))
    return [y, None, None, s]


@op("SkipLayerNormalization", domain="com.microsoft")
def _skip_layer_norm(cx, ins, at):
    """LayerNorm(input + skip (+ bias)) with gamma (and beta) over the last dim; output 3 is the sum."""
    _no_stats(cx)
    s = _skip_sum(cx, ins)
    gamma, beta = ins[2], _opt(ins, 3)
    y = cx.call(A.native_layer_norm.default, s, [int(s.shape[-1])], gamma, beta, at.f("epsilon", 1e-12))[0]
    return [y, None, None, s]


@op("BatchNormalization")
def _batch_norm(cx, ins, at):
    if at.i("training_mode", 0):
        raise Unsupported("BatchNormalization in training mode")
    x, scale, bias, mean, var = ins[:5]
    outs = cx.call(A._native_batch_norm_legit_no_training.default, x, scale, bias, mean, var,
                   at.f("momentum", 0.9), at.f("epsilon", 1e-5))
    return [outs[0]]


@op("InstanceNormalization")
def _instance_norm(cx, ins, at):
    x, scale, bias = ins
    return cx.call(A.group_norm.default, x, int(x.shape[1]), scale, bias, at.f("epsilon", 1e-5), False)


@op("GroupNormalization")
def _group_norm(cx, ins, at):
    x, scale, bias = ins
    c, g = int(x.shape[1]), at.i("num_groups")
    if tuple(scale.shape) != (c,) or tuple(bias.shape) != (c,):
        raise Unsupported("GroupNormalization with per-group scale/bias (opset 18)")
    return cx.call(A.group_norm.default, x, g, scale, bias, at.f("epsilon", 1e-5), False)


# ----------------------------------------------------------------------------- reductions

def _reduce_axes(cx, ins, at, rank: int) -> list[int] | None:
    """The reduced axes (all when none given), or None for a no-op (noop_with_empty_axes)."""
    axes = _axes_of(cx, ins, at)
    if axes is None:
        return None if at.i("noop_with_empty_axes", 0) else list(range(rank))
    return sorted({_axis(cx, a, rank, "axes value") for a in axes})


def _reduce(kind: str):
    def lower(cx, ins, at):
        x = ins[0]
        axes = _reduce_axes(cx, ins, at, len(x.shape))
        if axes is None:
            return cx.call(A.alias.default, x)
        keep = bool(at.i("keepdims", 1))
        if kind in ("ReduceMean", "ReduceLogSumExp", "ReduceL2", "ReduceLogSum") and not x.dtype.is_floating_point:
            raise Unsupported(f"{kind} of integer dtype {x.dtype}")
        if kind == "ReduceMean":
            return cx.call(A.mean.dim, x, axes, keep)
        if kind == "ReduceMax":
            return cx.call(A.amax.default, x, axes, keep)
        if kind == "ReduceMin":
            return cx.call(A.amin.default, x, axes, keep)
        if kind == "ReduceLogSumExp":
            return cx.call(A.logsumexp.default, x, axes, keep)
        if kind == "ReduceProd":
            for a in sorted(axes, reverse=True):
                x = cx.call(A.prod.dim_int, x, a, keep, dtype=x.dtype)
            return x
        if kind in ("ReduceSumSquare", "ReduceL2"):
            x = cx.call(A.mul.Tensor, x, x)
        elif kind == "ReduceL1":
            x = cx.call(A.abs.default, x)
        y = cx.call(A.sum.dim_IntList, x, axes, keep, dtype=x.dtype)
        if kind == "ReduceL2":
            y = cx.call(A.sqrt.default, y)
        elif kind == "ReduceLogSum":
            y = cx.call(A.log.default, y)
        return y
    return lower


for _name in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"):
    op(_name)(_reduce(_name))


def _arg(target):
    def lower(cx, ins, at):
        x = ins[0]
        axis = _axis(cx, at.i("axis", 0), len(x.shape))
        keep = bool(at.i("keepdims", 1))
        if at.i("select_last_index", 0):
            n = int(x.shape[axis])
            idx = cx.call(target, _reverse(cx, x, [axis]), axis, keep)
            return cx.call(A.rsub.Scalar, idx, n - 1)
        return cx.call(target, x, axis, keep)
    return lower


op("ArgMax")(_arg(A.argmax.default))
op("ArgMin")(_arg(A.argmin.default))


@op("CumSum")
def _cumsum(cx, ins, at):
    x = ins[0]
    axis = _axis(cx, cx.ints(ins[1], "axis")[0], len(x.shape))
    n = int(x.shape[axis])
    rev = at.i("reverse", 0)
    if rev:
        x = _reverse(cx, x, [axis])
    y = cx.call(A.cumsum.default, x, axis, dtype=x.dtype)
    if at.i("exclusive", 0):
        y = cx.call(A.slice.Tensor, y, axis, 0, max(n - 1, 0), 1)
        pad = [0, 0] * (len(x.shape) - 1 - axis) + [1, 0]
        y = cx.call(A.constant_pad_nd.default, y, pad, _scalar(y.dtype, 0))
    if rev:
        y = _reverse(cx, y, [axis])
    return y


@op("TopK")
def _topk(cx, ins, at):
    x = ins[0]
    (k,) = cx.ints(ins[1], "K")
    axis = _axis(cx, at.i("axis", -1), len(x.shape))
    return list(cx.call(A.topk.default, x, k, axis, bool(at.i("largest", 1)), bool(at.i("sorted", 1))))


@op("Trilu")
def _trilu(cx, ins, at):
    x = ins[0]
    k = cx.ints(ins[1], "k")[0] if _opt(ins, 1) is not None else 0
    return cx.call(A.triu.default if at.i("upper", 1) else A.tril.default, x, k)


# ----------------------------------------------------------------------------- pooling

def _pool_out(n: int, k: int, s: int, d: int, pb: int, pe: int, ceil_mode: bool) -> int:
    """ONNX pooling output size (the last window must start inside the input or the left padding)."""
    size = (n + pb + pe - d * (k - 1) - 1) / s + 1
    if not ceil_mode:
        return int(math.floor(size))
    out = int(math.ceil(size))
    if (out - 1) * s >= n + pb:
        out -= 1
    return out


def _torch_pool_out(n: int, k: int, s: int, d: int, p: int, ceil_mode: bool) -> int:
    num = n + 2 * p - d * (k - 1) - 1
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


_MAXPOOL = {1: A.max_pool1d.default, 2: A.max_pool2d.default, 3: A.max_pool3d.default}
_AVGPOOL = {1: A.avg_pool1d.default, 2: A.avg_pool2d.default, 3: A.avg_pool3d.default}


def _pool_args(cx, at, x):
    k = at.ints("kernel_shape")
    nd = len(k)
    if nd not in (1, 2, 3) or len(x.shape) != nd + 2:
        raise Unsupported(f"{nd}-d pooling of a rank-{len(x.shape)} tensor")
    s, d, pb, pe = _conv_geometry(cx, at, x, k)
    ceil_mode = bool(at.i("ceil_mode", 0))
    spatial = list(_shape(x)[2:])
    out = [_pool_out(n, kk, ss, dd, b, e, ceil_mode) for n, kk, ss, dd, b, e in zip(spatial, k, s, d, pb, pe)]
    return k, s, d, pb, pe, ceil_mode, spatial, out


@op("MaxPool")
def _max_pool(cx, ins, at):
    x = ins[0]
    if len(cx.node.output) > 1 and cx.node.output[1]:
        raise Unsupported("MaxPool with an Indices output")
    k, s, d, pb, pe, ceil_mode, spatial, out = _pool_args(cx, at, x)
    nd = len(k)
    direct = pb == pe and all(p <= kk // 2 for p, kk in zip(pb, k)) and all(
        _torch_pool_out(n, kk, ss, dd, p, ceil_mode) == o for n, kk, ss, dd, p, o in zip(spatial, k, s, d, pb, out))
    if direct:
        return cx.call(_MAXPOOL[nd], x, k, s, pb, d, ceil_mode)
    need = [(o - 1) * ss + dd * (kk - 1) + 1 for o, ss, dd, kk in zip(out, s, d, k)]
    right = [nn - n - b for nn, n, b in zip(need, spatial, pb)]
    low = -math.inf if x.dtype.is_floating_point else torch.iinfo(x.dtype).min
    x = _explicit_pad(cx, x, pb, right, low)
    return cx.call(_MAXPOOL[nd], x, k, s, [0] * nd, d, False)


@op("AveragePool")
def _avg_pool(cx, ins, at):
    x = ins[0]
    k, s, d, pb, pe, ceil_mode, spatial, out = _pool_args(cx, at, x)
    nd = len(k)
    if any(dd != 1 for dd in d):
        raise Unsupported("AveragePool with dilations")
    include = bool(at.i("count_include_pad", 0))
    partial = any((o - 1) * ss + kk > n + b + e for o, ss, kk, n, b, e in zip(out, s, k, spatial, pb, pe))
    if partial:
        raise Unsupported("AveragePool whose last window passes the padded input (ceil_mode)")
    extra = () if nd == 1 else (None,)
    if pb == pe and all(p <= kk // 2 for p, kk in zip(pb, k)):
        return cx.call(_AVGPOOL[nd], x, k, s, pb, False, include, *extra)
    if not include:
        raise Unsupported("AveragePool with asymmetric pads that are not counted")
    x = _explicit_pad(cx, x, pb, pe, _scalar(x.dtype, 0))
    return cx.call(_AVGPOOL[nd], x, k, s, [0] * nd, False, True, *extra)


@op("GlobalAveragePool")
def _global_avg_pool(cx, ins, at):
    x = ins[0]
    return cx.call(A.mean.dim, x, list(range(2, len(x.shape))), True)


@op("GlobalMaxPool")
def _global_max_pool(cx, ins, at):
    x = ins[0]
    return cx.call(A.amax.default, x, list(range(2, len(x.shape))), True)


# ----------------------------------------------------------------------------- control flow, sequences

@op("If")
def _if(cx, ins, at):
    cond = cx.const(ins[0])
    if cond is None:
        raise cx.error("If with a condition known only at run time is control flow; vtc compiles one "
                       "static graph (export the model without data-dependent branches)")
    return cx.subgraph(at.get("then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"))


@op("SequenceConstruct")
def _sequence_construct(cx, ins, at):
    return [list(ins)]


@op("SequenceAt")
def _sequence_at(cx, ins, at):
    seq = ins[0]
    (k,) = cx.ints(ins[1], "position")
    return cx.call(A.alias.default, seq[k])


@op("SequenceLength")
def _sequence_length(cx, ins, at):
    return torch.tensor(len(ins[0]), dtype=torch.int64)


@op("ConcatFromSequence")
def _concat_from_sequence(cx, ins, at):
    seq = ins[0]
    if not seq:
        raise cx.error("ConcatFromSequence of an empty sequence")
    r = len(seq[0].shape)
    if at.i("new_axis", 0):
        axis = _axis(cx, at.i("axis"), r + 1)
        return cx.call(A.stack.default, seq, axis)
    return cx.call(A.cat.default, seq, _axis(cx, at.i("axis"), r))


@op("SplitToSequence")
def _split_to_sequence(cx, ins, at):
    x = ins[0]
    axis = _axis(cx, at.i("axis", 0), len(x.shape))
    n = int(x.shape[axis])
    split = _opt(ins, 1)
    if split is None:
        parts = list(cx.call(A.split_with_sizes.default, x, [1] * n, axis))
        if not at.i("keepdims", 1):
            shape = [s for k, s in enumerate(_shape(x)) if k != axis]
            parts = [_view(cx, p, shape) for p in parts]
        return [parts]
    sizes = cx.ints(split, "split")
    if len(sizes) == 1 and cx.const(split).dim() == 0:
        sizes = [sizes[0]] * (n // sizes[0]) + ([n % sizes[0]] if n % sizes[0] else [])
    out = cx.call(A.split_with_sizes.default, x, sizes, axis)
    return [list(out) if isinstance(out, tuple) else [out]]
