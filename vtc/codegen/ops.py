"""The compute stage of each ATen op vtc generates code for, as scalar expressions.

``POINTWISE[name](ctx, args, out) -> Scalar`` gives one output element of a
pointwise op at the current index (``ctx.arg`` reads an operand there, through
broadcasting, virtual mappings and inlined producers).  ``ROW[name](ctx, args,
outs) -> RowSpec`` describes a reduction, softmax or normalisation as
accumulator passes over one reduced index ``r`` plus what to store.

An op missing here, or called with arguments a definition rejects
(``NotSupported``), runs through torch instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from vtc.codegen import kernel_ir as K
from vtc.codegen.kernel_ir import Scalar
from vtc.index import expr as E

# The C type a kernel computes a dtype's values in.  bfloat16 and float16 values are computed in float and
# rounded to their dtype after every op that produces one, as eager's kernels do (vtc.codegen.cpp: loads and
# stores convert, ``LOW_PRECISION`` holds their C storage type; docs/low_precision.md).
C_TYPES = {
    torch.float32: "float", torch.float64: "double", torch.int64: "int64_t", torch.int32: "int32_t",
    torch.int16: "int16_t", torch.int8: "int8_t", torch.uint8: "uint8_t", torch.bool: "bool",
    torch.bfloat16: "float", torch.float16: "float",
}
LOW_PRECISION = {torch.bfloat16: "uint16_t", torch.float16: "uint16_t"}  # dtype -> the C type of its elements


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's kernels accumulate / compute a dtype's reductions and norms in (its opmath type)."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def _opmath_arg(ctx, x, dtype: torch.dtype):
    """Operand x of an arithmetic op computing in `dtype`: a Python number next to bfloat16 / float16 values is a
    float32 constant, not rounded to the dtype (eager's kernels compute ``x * 0.1`` as ``float(x) * 0.1f``)."""
    if dtype in LOW_PRECISION and isinstance(x, (int, float)) and not isinstance(x, bool):
        return K.const(x, torch.float32)
    return ctx.arg(x, dtype)


class NotSupported(Exception):
    """This call is left to torch (with the reason as message)."""


@dataclass
class RowSpec:
    """A row kernel: which dims are reduced, accumulator passes, and the stores of each output."""

    dims: tuple[int, ...]  # reduced dims of the input
    phases: list[list[tuple[str, str, Callable[[Any], Scalar], torch.dtype]]]  # (acc name, combine, value(ctx), dtype)
    stores: list[tuple[int, Callable[[Any], Scalar], bool]]  # (output k, value(ctx), per_r)


POINTWISE: dict[str, Callable] = {}
ROW: dict[str, Callable] = {}


def pointwise(*names: str):
    """Registers a pointwise definition under ATen names ("packet" or "packet.overload")."""
    def deco(fn):
        for n in names:
            POINTWISE[n] = fn
        return fn
    return deco


def row(*names: str):
    """Registers a row (reduction / softmax / norm) definition under ATen names."""
    def deco(fn):
        for n in names:
            ROW[n] = fn
        return fn
    return deco


def lookup(table: dict, target: Any) -> Callable | None:
    """The definition for an ATen overload: exact "packet.overload" first, then "packet"."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    return table.get(f"{target._opname}.{target._overloadname}") or table.get(target._opname)


def result_type(*xs) -> torch.dtype:
    """torch's type promotion over tensors (IR Values) and Python scalars."""
    probes = [torch.empty([1] * len(x.shape), dtype=x.dtype) if hasattr(x, "shape") else x for x in xs]
    out = probes[0] if isinstance(probes[0], torch.Tensor) else torch.tensor(probes[0])
    for p in probes[1:]:
        out = torch.empty([1] * max(out.dim(), p.dim() if isinstance(p, torch.Tensor) else 0),
                          dtype=torch.result_type(out, p))
    return out.dtype


# ---------------------------------------------------------------------------
# pointwise: unary math
_UNARY = {
    "neg": "neg", "exp": "exp", "log": "log", "tanh": "tanh", "sigmoid": "sigmoid", "relu": "relu",
    "rsqrt": "rsqrt", "sqrt": "sqrt", "abs": "abs", "cos": "cos", "sin": "sin", "erf": "erf",
    "reciprocal": "reciprocal", "silu": "silu", "floor": "floor", "ceil": "ceil", "expm1": "expm1",
    "log1p": "log1p", "exp2": "exp2", "log2": "log2", "sign": "sign", "tan": "tan", "atan": "atan",
    "round": "round", "trunc": "trunc", "hardswish": "hardswish", "hardsigmoid": "hardsigmoid",
}


def _unary(fn: str):
    def lower(ctx, args, out):
        if not out.dtype.is_floating_point and fn not in ("neg", "abs", "relu", "sign"):
            raise NotSupported(f"{fn} on {out.dtype}")
        extra = {k: v for k, v in args.items() if k not in ("self", "decimals")}
        if extra:  # an overload with arguments this definition does not read: torch computes it
            raise NotSupported(f"{fn} with {sorted(extra)}")
        x = ctx.arg(args["self"], out.dtype)
        decimals = args.get("decimals", 0)
        if fn == "round" and decimals:  # torch: nearbyint(x * 10^d) / 10^d, or nearbyint(x / 10^-d) * 10^-d
            dt = compute_dtype(out.dtype)  # bfloat16 / float16: in float32, rounded once
            x, scale = K.cast(x, dt), K.const(float(10 ** abs(decimals)), dt)
            if decimals > 0:
                return K.cast(K.binary("div", K.unary("round", K.binary("mul", x, scale), dt), scale, dt), out.dtype)
            return K.cast(K.binary("mul", K.unary("round", K.binary("div", x, scale), dt), scale, dt), out.dtype)
        return K.unary(fn, x, out.dtype)
    return lower


for _name, _fn in _UNARY.items():
    POINTWISE[_name] = _unary(_fn)


@pointwise("gelu")
def _gelu(ctx, args, out):
    x = ctx.arg(args["self"], out.dtype)
    return K.unary("gelu_tanh" if args.get("approximate", "none") == "tanh" else "gelu", x, out.dtype)


@pointwise("logical_not", "bitwise_not")
def _not(ctx, args, out):
    x = ctx.arg(args["self"], torch.bool if out.dtype == torch.bool else out.dtype)
    return K.unary("not" if out.dtype == torch.bool else "bitnot", x, out.dtype)


@pointwise("leaky_relu")
def _leaky_relu(ctx, args, out):
    x = ctx.arg(args["self"], out.dtype)
    slope = _opmath_arg(ctx, args.get("negative_slope", 0.01), out.dtype)
    return K.where(K.binary("gt", x, K.const(0, out.dtype), torch.bool), x, K.binary("mul", x, slope, out.dtype))


@pointwise("clamp", "hardtanh")
def _clamp(ctx, args, out):
    x = ctx.arg(args["self"], out.dtype)
    lo = args.get("min", args.get("min_val"))
    hi = args.get("max", args.get("max_val"))
    if lo is not None:
        x = K.binary("max", x, ctx.arg(lo, out.dtype))
    if hi is not None:
        x = K.binary("min", x, ctx.arg(hi, out.dtype))
    return x


# ---------------------------------------------------------------------------
# pointwise: binary arithmetic and comparisons
def _binary(fn: str, alpha: bool = False):
    def lower(ctx, args, out):
        a = _opmath_arg(ctx, args["self"], out.dtype)
        b = _opmath_arg(ctx, args["other"], out.dtype)
        if alpha and args.get("alpha", 1) != 1:
            b = K.binary("mul", b, _opmath_arg(ctx, args["alpha"], out.dtype), out.dtype)
        return K.binary(fn, a, b, out.dtype)
    return lower


def _integer_divisor(args, out) -> None:
    """NotSupported for an integer division whose divisor may be 0 (anything but a number other than 0 and -1):
    torch raises ZeroDivisionError there, where C's integer division kills the process (SIGFPE; so does
    INT_MIN / -1)."""
    b = args["other"]
    if not out.dtype.is_floating_point and not (isinstance(b, (int, float)) and not isinstance(b, bool)
                                                and b not in (0, -1)):
        raise NotSupported("integer division by a tensor (torch raises ZeroDivisionError for a 0 divisor)")


def _division(fn: str):
    binary = _binary(fn)

    def lower(ctx, args, out):
        _integer_divisor(args, out)
        return binary(ctx, args, out)
    return lower


POINTWISE.update({
    "add": _binary("add", alpha=True), "sub": _binary("sub", alpha=True), "rsub": None,
    "mul": _binary("mul"), "maximum": _binary("max"), "minimum": _binary("min"),
    "fmod": _division("fmod"), "remainder": _division("remainder"), "atan2": _binary("atan2"),
})
del POINTWISE["rsub"]


@pointwise("div")
def _div(ctx, args, out):
    mode = args.get("rounding_mode")
    _integer_divisor(args, out)
    a, b = _opmath_arg(ctx, args["self"], out.dtype), _opmath_arg(ctx, args["other"], out.dtype)
    if mode is None:
        if not out.dtype.is_floating_point:
            raise NotSupported("true division into an integer dtype")
        return K.binary("div", a, b, out.dtype)
    return K.binary("div_floor" if mode == "floor" else "div_trunc", a, b, out.dtype)


@pointwise("pow")
def _pow(ctx, args, out):
    # as eager: float16's x ** 3 and x ** -2 in float32, rounded once; bfloat16's round x * x to bfloat16 first
    # (ATen's pow_tensor_scalar_optimized_kernel multiplies Vectorized<BFloat16>, float16 goes through float)
    a = ctx.arg(args["self"], torch.float32 if out.dtype == torch.float16 else out.dtype)
    e = args["exponent"]
    if isinstance(e, (int, float)):
        # the exponents torch computes without pow (ATen's pow_tensor_scalar_optimized_kernel), in its order:
        # also vectorised here, where std::pow is a scalar libm call (GPT-2's gelu: x ** 3, ~11 ns an element)
        if e == 2:
            return K.binary("mul", a, a)
        if e == 3 and out.dtype.is_floating_point:  # integer: NotSupported below (C's signed overflow)
            return K.binary("mul", K.binary("mul", a, a), a)
        if e == 1:
            return a
        if e == 0.5:
            return K.unary("sqrt", a)
        if e == -0.5 and out.dtype.is_floating_point:
            return K.unary("rsqrt", a)
        if e == -1:
            return K.unary("reciprocal", a)
        if e == -2 and out.dtype.is_floating_point:
            return K.unary("reciprocal", K.binary("mul", a, a))
    if not out.dtype.is_floating_point:
        raise NotSupported("integer pow")
    return K.binary("pow", a, ctx.arg(e, a.dtype), a.dtype)


def _compare(fn: str):
    def lower(ctx, args, out):
        common = result_type(args["self"], args["other"])
        return K.binary(fn, ctx.arg(args["self"], common), ctx.arg(args["other"], common), torch.bool)
    return lower


for _fn in ("eq", "ne", "lt", "le", "gt", "ge"):
    POINTWISE[_fn] = _compare(_fn)


def _logical(fn: str):
    def lower(ctx, args, out):
        if out.dtype == torch.bool:
            return K.binary(fn, ctx.arg(args["self"], torch.bool), ctx.arg(args["other"], torch.bool), torch.bool)
        if fn in ("and", "or", "xor") and not out.dtype.is_floating_point:
            return K.binary("bit" + fn, ctx.arg(args["self"], out.dtype), ctx.arg(args["other"], out.dtype))
        raise NotSupported(f"{fn} into {out.dtype}")
    return lower


for _name, _fn in (("logical_and", "and"), ("logical_or", "or"), ("logical_xor", "xor"),
                   ("bitwise_and", "and"), ("bitwise_or", "or"), ("bitwise_xor", "xor")):
    POINTWISE[_name] = _logical(_fn)


@pointwise("where")
def _where(ctx, args, out):
    if "condition" not in args:
        raise NotSupported("where with one argument (nonzero)")
    return K.where(ctx.arg(args["condition"], torch.bool), ctx.arg(args["self"], out.dtype),
                   ctx.arg(args["other"], out.dtype))


@pointwise("masked_fill")
def _masked_fill(ctx, args, out):
    return K.where(ctx.arg(args["mask"], torch.bool), ctx.arg(args["value"], out.dtype),
                   ctx.arg(args["self"], out.dtype))


@pointwise("_to_copy", "to", "type_as")
def _cast(ctx, args, out):
    return ctx.arg(args["self"], out.dtype)


@pointwise("copy")
def _copy(ctx, args, out):
    return ctx.arg(args["src"], out.dtype)


# ---------------------------------------------------------------------------
# pointwise: creation
@pointwise("full", "full_like", "scalar_tensor", "zeros", "zeros_like", "ones", "ones_like",
           "new_full", "new_zeros", "new_ones")
def _full(ctx, args, out):
    name = ctx.node.target._opname
    value = args.get("fill_value", args.get("s"))
    if value is None:
        value = 1 if "ones" in name else 0
    if isinstance(value, torch.Tensor) or hasattr(value, "shape"):
        raise NotSupported("fill value given as a tensor")
    return K.const(value, out.dtype)


@pointwise("arange")
def _arange(ctx, args, out):
    start, step = args.get("start", 0), args.get("step", 1)
    i = ctx.index[0]
    if isinstance(start, int) and isinstance(step, int):
        return K.cast(K.iota(i * step + start, torch.int64), out.dtype)
    v = K.binary("mul", K.cast(K.iota(i, torch.int64), torch.float64), K.const(step, torch.float64))
    return K.cast(K.binary("add", v, K.const(start, torch.float64)), out.dtype)


# ---------------------------------------------------------------------------
# row kernels: reductions, softmax, normalisation
def _dims(dims, rank: int) -> tuple[int, ...]:
    if rank == 0:
        return ()  # a 0-d tensor: dim 0 / -1 names its single element, nothing to reduce over
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted(d % rank for d in dims))


def reduced_index(extent: int) -> E.Expr:
    """The flat index ``r`` of a row kernel's reduced elements (row-major over its reduced dims), in [0, extent)."""
    return E.var("r", extent) if extent > 1 else E.const(0)


_COMBINE = {"sum": "sum", "mean": "sum", "amax": "max", "amin": "min", "prod": "prod", "any": "any", "all": "all"}


def _reduce(kind: str):
    def lower(ctx, args, outs):
        x = args["self"]
        dims = _dims(args.get("dim"), len(x.shape))
        out = outs[0]
        acc_dtype = out.dtype if kind not in ("any", "all") else torch.bool
        if out.dtype.is_floating_point and out.dtype != torch.float64:
            acc_dtype = torch.float32
        if kind in ("amax", "amin") and out.dtype == torch.bool:
            raise NotSupported("amax/amin of bool")
        n = math.prod(x.shape[d] for d in dims) if dims else 1

        def value(c):
            return c.arg(x, acc_dtype)

        def store(c):
            a = K.acc("a", acc_dtype)
            if kind == "mean":
                a = K.binary("div", a, K.const(n, acc_dtype))
            return K.cast(a, out.dtype)

        if kind == "mean" and not out.dtype.is_floating_point:
            raise NotSupported("integer mean")
        return RowSpec(dims, [[("a", _COMBINE[kind], value, acc_dtype)]], [(0, store, False)])
    return lower


for _kind in ("sum", "mean", "amax", "amin", "prod", "any", "all"):
    ROW[_kind] = _reduce(_kind)


@row("argmax", "argmin", "max.dim", "min.dim")
def _arg_extreme(ctx, args, outs):
    """argmax / argmin as two passes over the row: the extreme value m (a float max / min is NaN when an element
    is, as amax's), then the smallest r whose element equals m, or is NaN (m is then NaN too).  That is torch's
    answer: the first index of the max / min, NaN counting as both the largest and the smallest value; with
    dim=None the index into the flattened input, which is r over all dims.  ``max.dim`` / ``min.dim`` (values
    and indices) are the same passes, storing m too."""
    x, op = args["self"], ctx.node.target._opname
    if x.dtype == torch.bool and op in ("argmax", "argmin"):
        raise NotSupported(f"{op} of bool (torch raises)")
    dims = _dims(args.get("dim"), len(x.shape))
    n = math.prod(x.shape[d] for d in dims) if dims else 1
    if n == 0:
        raise NotSupported(f"{op} over an empty dim (torch raises)")
    dt = compute_dtype(x.dtype)  # bfloat16 / float16 widened to float: exact, so the same order as eager's
    at = K.iota(reduced_index(n), torch.int64)
    nowhere = K.const(n, torch.int64)

    def value(c):
        return c.arg(x, dt)

    def first(c):
        v = value(c)
        hit = K.binary("eq", v, K.acc("m", dt), torch.bool)
        if dt.is_floating_point:
            hit = K.binary("or", hit, K.binary("ne", v, v, torch.bool), torch.bool)
        return K.where(hit, at, nowhere)

    extreme = "max" if op in ("argmax", "max") else "min"
    index = lambda c: K.acc("i", torch.int64)  # noqa: E731
    stores = [(0, index, False)] if op in ("argmax", "argmin") else [(0, lambda c: K.acc("m", dt), False), (1, index, False)]
    return RowSpec(dims, [[("m", extreme, value, dt)], [("i", "min", first, torch.int64)]], stores)


# torch.max(x) / torch.min(x) of at most this many elements is generated: a row kernel runs its one row on one thread,
# where torch's reduction splits more than its grain size (32768 elements, at::internal::GRAIN_SIZE) over the threads
EXTREME_MAX_ELEMENTS = 32768


@row("max.default", "min.default")
def _extreme(ctx, args, outs):
    """``torch.max(x)`` / ``torch.min(x)`` without a dim: the extreme of every element, a 0-d result, with amax's /
    amin's accumulator (NaN when an element is, as torch's).  Bool inputs stay torch's (amax of bool is not
    generated); an empty input too (torch raises), and one of more than ``EXTREME_MAX_ELEMENTS``.  (``aminmax``
    needs no definition: the core-ATen table decomposes it into amin and amax.)"""
    x, op = args["self"], ctx.node.target._opname
    if x.dtype == torch.bool:
        raise NotSupported(f"{op} of bool")
    n = math.prod(x.shape)
    if n == 0:
        raise NotSupported(f"{op} of an empty tensor (torch raises)")
    if n > EXTREME_MAX_ELEMENTS:
        raise NotSupported(f"{op} of {n} elements: one row runs on one thread, torch's reduction splits it over them")
    dt = compute_dtype(x.dtype)  # bfloat16 / float16 widened to float: exact, so the same extreme as eager's
    out = outs[0]
    return RowSpec(_dims(None, len(x.shape)), [[("m", op, lambda c: c.arg(x, dt), dt)]],
                   [(0, lambda c: K.cast(K.acc("m", dt), out.dtype), False)])


@row("var")
def _var(ctx, args, outs):
    x, out = args["self"], outs[0]
    if not out.dtype.is_floating_point:
        raise NotSupported("var of integers")
    dims = _dims(args.get("dim"), len(x.shape))
    n = math.prod(x.shape[d] for d in dims) if dims else 1
    correction = args.get("correction")  # var.correction; var.dim / var.default say unbiased= instead
    correction = (1 if args.get("unbiased", True) else 0) if correction is None else correction
    dt = compute_dtype(out.dtype)  # bfloat16 / float16 in float32, rounded once at the store (as eager)

    def mean(c):
        return K.binary("div", K.acc("s", dt), K.const(n, dt))

    def dev2(c):
        d = K.binary("sub", c.arg(x, dt), mean(c))
        return K.binary("mul", d, d)

    def store(c):
        return K.binary("div", K.acc("q", dt), K.const(max(n - correction, 0), dt))

    return RowSpec(dims, [[("s", "sum", lambda c: c.arg(x, dt), dt)], [("q", "sum", dev2, dt)]], [(0, store, False)])


@row("_softmax", "softmax", "_log_softmax", "log_softmax")
def _softmax(ctx, args, outs):
    x, out = args["self"], outs[0]
    if not out.dtype.is_floating_point:
        raise NotSupported(f"softmax in {out.dtype}")
    dt = compute_dtype(out.dtype)  # bfloat16 / float16 in float32, rounded once at the store (as eager)
    log = "log" in ctx.node.target._opname
    dims = _dims(args["dim"], len(x.shape))

    def shifted(c):
        return K.binary("sub", c.arg(x, dt), K.acc("m", dt))

    def store(c):
        if log:
            return K.binary("sub", shifted(c), K.unary("log", K.acc("s", dt)))
        # times 1/s (once per row), as torch's softmax does: a division per element costs several multiplies
        return K.binary("mul", K.unary("exp", shifted(c)), K.unary("reciprocal", K.acc("s", dt)))

    return RowSpec(dims, [[("m", "max", lambda c: c.arg(x, dt), dt)],
                          [("s", "sum", lambda c: K.unary("exp", shifted(c)), dt)]], [(0, store, True)])


# A layer norm's mean is first + sum(x - first) / n, first the row's first element: on rows of 100 + 0.1 N(0, 1) the
# plain sum of x lost ~2x torch's float32 accuracy (max error 1.7e-4 vs float64, torch 7.4e-5), the shifted one
# gains it back and more (4.5e-5; tests/codegen/test_row_blocks.py).  False: the plain sum (A / B).
SHIFTED_MEAN = True


@row("native_layer_norm")
def _layer_norm(ctx, args, outs):
    x = args["input"]
    if not outs[0].dtype.is_floating_point:
        raise NotSupported(f"layer_norm in {outs[0].dtype}")
    dt = compute_dtype(outs[0].dtype)  # bfloat16 / float16 in float32, rounded once at the stores (as eager)
    k = len(args["normalized_shape"])
    rank = len(x.shape)
    dims = tuple(range(rank - k, rank))
    n = math.prod(x.shape[d] for d in dims)
    w, b, eps = args.get("weight"), args.get("bias"), float(args["eps"])
    shifted = SHIFTED_MEAN and x.dtype not in LOW_PRECISION  # float16 / bfloat16 rows: their vector sums as before

    def first(c):  # the row's first element: the mean's sum adds x - first, small next to a large mean
        return K.substitute(c.arg(x, dt), {"r": 0}, {}) if shifted else K.const(0, dt)

    def mean(c):
        return K.binary("add", first(c), K.binary("div", K.acc("s", dt), K.const(n, dt)))

    def dev(c):
        return K.binary("sub", c.arg(x, dt), mean(c))

    def rstd(c):
        var = K.binary("div", K.acc("q", dt), K.const(n, dt))
        return K.unary("rsqrt", K.binary("add", var, K.const(eps, dt)))

    def normed(c):
        y = K.binary("mul", dev(c), rstd(c))
        if w is not None:
            y = K.binary("mul", y, c.arg(w, dt))
        if b is not None:
            y = K.binary("add", y, c.arg(b, dt))
        return y

    return RowSpec(dims, [[("s", "sum", lambda c: K.binary("sub", c.arg(x, dt), first(c)), dt)],
                          [("q", "sum", lambda c: K.binary("mul", dev(c), dev(c)), dt)]],
                   [(0, normed, True), (1, lambda c: K.cast(mean(c), outs[1].dtype), False),
                    (2, lambda c: K.cast(rstd(c), outs[2].dtype), False)])


@pointwise("_native_batch_norm_legit_no_training", "native_batch_norm")
def _batch_norm(ctx, args, out):
    """Inference batch norm: (x - mean[c]) * rsqrt(var[c] + eps) * w[c] + b[c], c = dim 1.  In bfloat16 / float16
    as eager's kernel: x * alpha[c] + beta[c] in float32 (alpha = rsqrt(var + eps) * w, beta = b - mean * alpha),
    its multiply-add fused, rounded to the dtype once (docs/low_precision.md)."""
    if args.get("training", False):
        raise NotSupported("batch norm in training mode")
    dt = compute_dtype(out.dtype)
    if dt not in (torch.float32, torch.float64):
        raise NotSupported(f"batch norm in {out.dtype}")
    x = ctx.arg(args["input"], dt)
    mean = ctx.channel(args["running_mean"], 1, dt)
    scale = K.unary("rsqrt", K.binary("add", ctx.channel(args["running_var"], 1, dt), K.const(args["eps"], dt)))
    if args.get("weight") is not None:
        scale = K.binary("mul", scale, ctx.channel(args["weight"], 1, dt))
    bias = ctx.channel(args["bias"], 1, dt) if args.get("bias") is not None else None
    if dt != out.dtype:
        shift = K.binary("mul", mean, scale)
        shift = K.binary("sub", bias, shift) if bias is not None else K.unary("neg", shift)
        return K.cast(K.fma(x, scale, shift), out.dtype)  # eager's multiply-add is fused
    y = K.binary("mul", K.binary("sub", x, mean), scale)
    return K.binary("add", y, bias) if bias is not None else y


from vtc.codegen import conv  # noqa: E402,F401  (registers "convolution": depthwise convolutions as pointwise)
from vtc.codegen import pool  # noqa: E402,F401  (registers max_pool2d: windows as pointwise)
