"""Depthwise 2-D convolution as a pointwise kernel: each output element is a short unrolled sum of taps.

A depthwise convolution (``groups == in_channels``) reads, per output element,
``kh * kw`` input elements of one channel: with the taps unrolled it is a
pointwise op like any other, so the kernel vectorises over the output row,
a batch norm or activation after it is computed in the same kernel, and its
input is read through whatever mapping produced it (a channel shuffle, split,
pad or cat in front of it moves no data).  A tap that falls in the zero
padding is a piece choice (``K.pick``) whose untaken side is never loaded.

Other 2-D convolutions are implicit GEMMs (``conv_kernel``): per image and
group, ``out[o, p] = sum_r W[o, r] * X[r, p]`` with ``r`` over (input channel,
tap) and ``p`` over output pixels, where ``X`` is a *virtual* im2col: the
generated GEMM (vtc.codegen.gemm) packs its panels straight from the input
through the im2col index arithmetic and the input's own mapping, so neither
the im2col matrix nor a channel shuffle / cat / split / pad in front exists in
memory.  ``choose_conv`` picks it or torch's convolution (oneDNN), like
``vtc.codegen.gemm.choose`` does for matmuls, and records both estimates.
"""
from __future__ import annotations

import torch

from vtc.codegen import kernel_ir as K
from vtc.codegen.gemm import ACC, GemmChoice, GemmOperands, estimate_us, needs_copy
from vtc.codegen.kernel_ir import Buffer, Kernel, Store
from vtc.codegen.ops import NotSupported, pointwise
from vtc.index.expr import and_, const, ge, lt, var
from vtc.ir.graph import Node
from vtc.virtual.movement import bind

CONV_OP = "aten.convolution.default"
# gemm="auto" generates 1x1 convolutions up to these input / output channels per group: there the
# generated GEMM measured faster than torch's convolution (ShuffleNet units: 0.7 vs 3.9 ms at 58 channels,
# batch 16, 2 threads); 3x3 implicit GEMMs (im2col packing element by element) and wide 1x1 ones did not
SMALL_K, SMALL_M = 64, 256

MAX_TAPS = 49  # kernels up to 7x7 are unrolled


@pointwise("convolution")
def _depthwise_conv2d(ctx, args, out):
    why = _unsupported(args, out)
    if why:
        raise NotSupported(why)
    geo = _geometry(args, out)
    x, w, bias, c, groups = geo["x"], geo["w"], geo["bias"], geo["c"], geo["groups"]
    kh, kw, h, wd = geo["kh"], geo["kw"], geo["h"], geo["wd"]
    (sh, sw), (ph, pw), (dh, dw) = geo["stride"], geo["pad"], geo["dil"]
    if groups != c or geo["cg"] != 1:
        raise NotSupported(f"convolution with groups={groups} over {c} channels is not depthwise")
    if kh * kw > MAX_TAPS:
        raise NotSupported(f"depthwise kernel {kh}x{kw} has more than {MAX_TAPS} taps")
    dt = torch.float32
    if not ctx.index:  # a probe: the reads only check that the operands are supported
        return K.binary("mul", ctx._read(x, ()), ctx._read(w, ()))
    b, oc, oh, ow = ctx.index
    mult = geo["og"]  # output channels per input channel
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


# -- convolution as an implicit GEMM -----------------------------------------
def is_depthwise(n: Node) -> bool:
    """True for a 2-D convolution with one input channel per group (the pointwise kernel above)."""
    args = bind(n.target, n.args, n.kwargs)
    x, w = args["input"], args["weight"]
    return len(x.shape) == 4 and args.get("groups", 1) == x.shape[1] and w.shape[1] == 1


def _geometry(args: dict, out) -> dict:
    """Operands, sizes, stride / padding / dilation of a 2-D convolution call (bound args, its output)."""
    x, w = args["input"], args["weight"]
    g = args.get("groups", 1)
    (sh, sw), (ph, pw), (dh, dw) = (_pair(args.get(k, d)) for k, d in
                                    (("stride", 1), ("padding", 0), ("dilation", 1)))
    nb, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    return dict(x=x, w=w, bias=args.get("bias"), out=out, groups=g, stride=(sh, sw), pad=(ph, pw), dil=(dh, dw),
                n=nb, c=c, h=h, wd=wd, cg=cg, kh=kh, kw=kw, og=o // g, oh=out.shape[2], ow=out.shape[3])


def _unsupported(args: dict, out) -> str:
    """Why neither generated convolution runs this call ("" when they can)."""
    x, w, bias = args["input"], args["weight"], args.get("bias")
    if args.get("transposed", False):
        return "transposed convolution"
    if len(x.shape) != 4 or len(w.shape) != 4:
        return f"{len(x.shape) - 2}-D convolution: the generated convolutions are 2-D only"
    bad = [v for v in (x, w, bias, out) if v is not None and v.dtype != torch.float32]
    if bad:
        return f"dtype {bad[0].dtype} of %{bad[0].name}: the generated convolutions are float32 only"
    if any(s == 0 for v in (x, w, out) for s in v.shape):
        return "an empty operand"
    return ""


def choose_conv(low, n: Node, mode: str) -> GemmChoice:
    """The generated implicit GEMM or torch's convolution for conv node n under gemm=`mode`."""
    args = bind(n.target, n.args, n.kwargs)
    why = _unsupported(args, n.outputs[0])
    geo = _geometry(args, n.outputs[0]) if not why else None
    x = args["input"]
    copy = needs_copy(low, x)
    if geo is None:
        shape = (0, 0, 0, 0)
        vtc_us = torch_us = 0.0
    else:
        batch, m, p, k = geo["n"] * geo["groups"], geo["og"], geo["oh"] * geo["ow"], geo["cg"] * geo["kh"] * geo["kw"]
        shape = (batch, m, p, k)
        im2col = geo["kh"] * geo["kw"] > 1 or geo["stride"] != (1, 1) or geo["pad"] != (0, 0)
        mapped = batch * k * p * -(-m // 128) if (im2col or copy) else 0
        vtc_us, torch_us = estimate_us(batch, m, p, k, copies=(x.nbytes,) if copy else (), mapped_elems=mapped)

    def pick(choice: str, reason: str) -> GemmChoice:
        return GemmChoice(n.name, n.op, shape, choice, reason, round(vtc_us, 2), round(torch_us, 2),
                          x.nbytes if copy else 0)

    if why:
        return pick("torch", why)
    if mode == "vtc":
        return pick("vtc", "gemm='vtc' forces the generated implicit GEMM")
    if mode == "torch":
        return pick("torch", "gemm='torch' forces torch's convolution")
    small_1x1 = (geo["kh"] * geo["kw"] == 1 and geo["stride"] == (1, 1) and geo["pad"] == (0, 0)
                 and geo["cg"] <= SMALL_K and geo["og"] <= SMALL_M)
    if small_1x1:
        why = f"%{x.name} is not a strided view: torch would copy {x.nbytes} bytes first; " if copy else ""
        return pick("vtc", why + f"a 1x1 convolution of {geo['cg']} -> {geo['og']} channels is a small plain GEMM "
                                 f"(measured faster than torch's convolution here), its epilogue fused")
    if copy:
        return pick("torch", f"%{x.name} is not a strided view: copy + torch's convolution (the implicit GEMM's "
                             f"im2col packing is slower than the copy at present; gemm='vtc' forces it)")
    return pick("torch", "the input is physical or a zero-copy strided view: torch's convolution")


def conv_kernel(low, n: Node) -> Kernel:
    """The implicit-GEMM kernel of conv node n: batch = image x group, M = output channels of a group,
    N = output pixels, K = input channels of a group x taps; B is the virtual im2col of the input."""
    geo = _geometry(bind(n.target, n.args, n.kwargs), n.outputs[0])
    x, w, bias, out = geo["x"], geo["w"], geo["bias"], geo["out"]
    g, og, cg, kh, kw = geo["groups"], geo["og"], geo["cg"], geo["kh"], geo["kw"]
    (sh, sw), (ph, pw), (dh, dw) = geo["stride"], geo["pad"], geo["dil"]
    batch, m, p, k = geo["n"] * g, og, geo["oh"] * geo["ow"], cg * kh * kw
    bi, mi, ni, rv = var("i0", batch), var("i1", m), var("i2", p), var("r", k)
    image, group = bi // g, bi % g
    ci, tap = rv // (kh * kw), rv % (kh * kw)
    ta, tb = tap // kw, tap % kw
    oh, ow = ni // geo["ow"], ni % geo["ow"]
    ih, iw = oh * sh + ta * dh - ph, ow * sw + tb * dw - pw
    memo: dict = {}
    sa = K.cast(low.value_at(w.name, (group * og + mi, ci, ta, tb), memo), torch.float32)
    inside = and_(ge(ih, 0), lt(ih, geo["h"]), ge(iw, 0), lt(iw, geo["wd"]))
    sb = K.pick(inside, K.cast(low.value_at(x.name, (image, group * cg + ci, ih, iw), memo), torch.float32),
                K.const(0, torch.float32))
    value = K.acc(ACC, torch.float32)
    if bias is not None:
        value = K.binary("add", value, K.cast(low.value_at(bias.name, (group * og + mi,), memo), torch.float32))
    name = "k_" + "".join(c if c.isalnum() else "_" for c in n.name)
    # out[image, group * og + m, oh, ow] is out viewed as [batch, m, p], contiguous: the GEMM's own layout
    kern = Kernel(name, "gemm", tuple(out.shape), k, [],
                  [Store(Buffer(out.name, out.shape, out.dtype), (image, group * og + mi, oh, ow), value)],
                  source_nodes=[n.name])
    kern.gemm = GemmOperands(sa, sb, batch, m, p, k, ("i0", "i1", "i2"))
    return kern
