"""Depthwise 2-D convolution as a pointwise kernel: each output element is a short unrolled sum of taps.

A depthwise convolution (``groups == in_channels``) reads, per output element,
``kh * kw`` input elements of one channel: with the taps unrolled it is a
pointwise op like any other, so the kernel vectorises over the output row,
a batch norm or activation after it is computed in the same kernel, and its
input is read through whatever mapping produced it (a channel shuffle, split,
pad or cat in front of it moves no data).  A tap that falls in the zero
padding is a piece choice (``K.pick``) whose untaken side is never loaded.

Other convolutions (``groups < in_channels``) are not pointwise: they run as
GEMMs (torch, or the generated GEMM where available).
"""
from __future__ import annotations

import torch

from vtc.codegen import kernel_ir as K
from vtc.codegen.ops import NotSupported, pointwise
from vtc.index.expr import and_, const, ge, lt

MAX_TAPS = 49  # kernels up to 7x7 are unrolled


@pointwise("convolution")
def _depthwise_conv2d(ctx, args, out):
    x, w, bias = args["input"], args["weight"], args.get("bias")
    groups = args.get("groups", 1)
    if args.get("transposed", False):
        raise NotSupported("transposed convolution")
    if len(x.shape) != 4 or len(w.shape) != 4:
        raise NotSupported(f"convolution of rank {len(x.shape)}: only 2-D depthwise convolutions are pointwise")
    n_, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    if groups != c or cg != 1 or o % c:
        raise NotSupported(f"convolution with groups={groups} over {c} channels is not depthwise")
    if kh * kw > MAX_TAPS:
        raise NotSupported(f"depthwise kernel {kh}x{kw} has more than {MAX_TAPS} taps")
    if any(v is not None and v.dtype != torch.float32 for v in (x, w, bias)):
        raise NotSupported("depthwise convolution is generated for float32 only")
    (sh, sw), (ph, pw), (dh, dw) = (_pair(args.get(k, d)) for k, d in
                                    (("stride", 1), ("padding", 0), ("dilation", 1)))
    dt = torch.float32
    if not ctx.index:  # a probe: the reads only check that the operands are supported
        return K.binary("mul", ctx._read(x, ()), ctx._read(w, ()))
    b, oc, oh, ow = ctx.index
    mult = o // c
    ic = oc // mult if mult > 1 else oc
    total = ctx._read(bias, (oc,)) if bias is not None else K.const(0, dt)
    for a in range(kh):
        ih = oh * sh + (a * dh - ph)
        for bb in range(kw):
            iw = ow * sw + (bb * dw - pw)
            inside = and_(ge(ih, 0), lt(ih, h), ge(iw, 0), lt(iw, wd))
            tap = K.pick(inside, ctx._read(x, (b, ic, ih, iw)), K.const(0, dt))
            total = K.binary("add", total, K.binary("mul", ctx._read(w, (oc, const(0), const(a), const(bb))), tap))
    return total


def _pair(v) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    v = list(v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])
