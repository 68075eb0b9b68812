"""2-D max pooling as a pointwise kernel: each output element is the max of its window's taps.

Like a depthwise convolution (vtc.codegen.conv), a max pool reads per output
element ``kh * kw`` input elements of one channel, so with the taps unrolled
it is a pointwise op: the kernel reads its input through whatever mapping
produced it, a pointwise consumer is computed in the same kernel, and a
producer (the ReLU before ShuffleNet's stem pool) is inlined.  A tap in the
implicit padding is a piece choice (``K.pick``) whose untaken side, minus
infinity, is never loaded.  Only the values are generated: a
``max_pool2d_with_indices`` whose indices are read runs through torch (the
lowering's probe refuses a pointwise op whose extra output is used).  NaN
propagates as in torch (``vtc_max`` keeps a NaN operand).
"""
from __future__ import annotations

from vtc.codegen import depthwise, kernel_ir as K
from vtc.codegen.ops import NotSupported, pointwise
from vtc.index.expr import and_, ge, lt, var
from vtc.index.mapping import out_vars

MAX_TAPS = 49  # windows up to 7x7 are unrolled
POOL_OPS = ("aten.max_pool2d_with_indices.default", "aten.max_pool2d.default")


def _pair(v, default) -> tuple[int, int]:
    if v is None or (not isinstance(v, int) and len(v) == 0):
        return default
    if isinstance(v, int):
        return v, v
    v = list(v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def pool_taps(n) -> int:
    """Taps per output element of max pool node n (the lowering keeps a producer read by several taps
    physical rather than recompute it per tap)."""
    from vtc.virtual.movement import bind

    kh, kw = _pair(bind(n.target, n.args, n.kwargs)["kernel_size"], None)
    return kh * kw


@pointwise("max_pool2d_with_indices", "max_pool2d")
def _max_pool2d(ctx, args, out):
    x = args["self"]
    if len(x.shape) not in (3, 4):
        raise NotSupported(f"max_pool2d on a {len(x.shape)}-D input (3-D or 4-D expected)")
    if not x.dtype.is_floating_point or x.dtype != out.dtype:
        raise NotSupported(f"max_pool2d of {x.dtype} into {out.dtype}: the generated pool is floating point only")
    kh, kw = _pair(args["kernel_size"], None)
    (sh, sw), (ph, pw), (dh, dw) = (_pair(args.get("stride"), (kh, kw)), _pair(args.get("padding"), (0, 0)),
                                    _pair(args.get("dilation"), (1, 1)))
    if kh * kw > MAX_TAPS:
        raise NotSupported(f"max_pool2d window {kh}x{kw} has more than {MAX_TAPS} taps")
    if not ctx.index:  # a probe: the read only checks that the operand is supported
        return ctx._read(x, ())
    *lead, oh, ow = ctx.index
    h, w = x.shape[-2:]
    total = None
    for a in range(kh):
        ih = oh * sh + (a * dh - ph)
        for b in range(kw):
            iw = ow * sw + (b * dw - pw)
            inside = and_(ge(ih, 0), lt(ih, h), ge(iw, 0), lt(iw, w))
            tap = K.pick(inside, ctx._read(x, (*lead, ih, iw)), K.const(float("-inf"), out.dtype))
            total = tap if total is None else K.binary("max", total, tap)
    if len(ctx.index) == 4 and tuple(ctx.index) == out_vars(out.shape):  # the plane-by-plane vector code may emit it
        plane = ctx._read(x, (*lead, var(depthwise.IH, h), var(depthwise.IW, w)))
        depthwise.remember(total, depthwise.DepthwiseSum(
            tuple(ctx.index), plane, (), None, (kh, kw), (sh, sw), (ph, pw), (dh, dw), (h, w), tuple(out.shape[2:]),
            combine="max"))
    return total
