"""Depthwise 2-D convolution as a pointwise kernel: each output element is a short unrolled sum of taps.

A depthwise convolution (``groups == in_channels``) reads, per output element,
``kh * kw`` input elements of one channel: with the taps unrolled it is a
pointwise op like any other, so the kernel vectorises over the output row,
a batch norm or activation after it is computed in the same kernel, and its
input is read through whatever mapping produced it (a channel shuffle, split,
pad or cat in front of it moves no data).  A tap that falls in the zero
padding is a piece choice (``K.pick``) whose untaken side is never loaded.
Where the kernel holds one such sum at its own index, vtc.codegen.depthwise
emits it plane by plane in vector code instead of the generic loop.

Other 2-D convolutions are implicit GEMMs (``conv_kernel``): per image and
group, ``out[o, p] = sum_r W[o, r] * X[r, p]`` with ``r`` over (input channel,
tap) and ``p`` over output pixels, where ``X`` is a *virtual* im2col: the
generated GEMM (vtc.codegen.gemm) packs its panels straight from the input
through the im2col index arithmetic and the input's own mapping, so neither
the im2col matrix nor a channel shuffle / cat / split / pad in front exists in
memory.  The pack copies the im2col by runs of the input (``Im2colPack``); the loops around it are
vtc.codegen.conv_panels', where a stride-1 "same" convolution over a plain input reads the im2col from the
input in place instead (``Im2colPack.direct``; ``GemmChoice.path`` "conv_taps", else "panels").  On
a small map with a long reduction (ShuffleNetV2's last 1x1 convolution) the
same kernel runs as dot products along the reduction instead, the weight read
in place (vtc.codegen.conv_t; ``GemmChoice.path``).
``choose_conv`` picks it or torch's convolution (oneDNN), like
``vtc.codegen.gemm.choose`` does for matmuls, and records both estimates:
under gemm="auto" every convolution but the wide ones (``WIDE``) on maps of at
least ``WIDE_PIXELS`` output pixels is generated.  A float16 one (not depthwise) takes the same
forms as a float32 one but Winograd and the dot form (conv_bcast, conv_direct, conv_panels' loops): each reads its
float16 operands widened to float32 as it loads them (the im2col runs ``vtc_conv_run`` / ``vtc_conv_run2`` and the
direct form's tiles templated on the element type; a constant weight packed once into float32, or widened as it
is packed per call) and rounds each result once; under "auto" it is generated wherever torch's float16
convolution (``F16_TORCH_SLOWER``) is not estimated faster.
"""
from __future__ import annotations

import torch

from vtc.codegen import conv_bcast, conv_direct, conv_panels, conv_t, depthwise, kernel_ir as K, winograd
from vtc.codegen.gemm import (ACC, F16, GemmChoice, GemmOperands, _torch_f16_fast, _unwidened, estimate_us,
                              needs_copy)
from vtc.codegen.kernel_ir import Buffer, Kernel, Store, scalars_under
from vtc.codegen.ops import NotSupported, pointwise
from vtc.codegen.vecmath import LOW_PRECISION_PRELUDE
from vtc.index.expr import _terms, and_, const, free_vars, ge, lt, not_, var
from vtc.index.mapping import linear_offset, out_vars
from vtc.ir.graph import Node
from vtc.virtual.movement import bind

CONV_OP = "aten.convolution.default"
# gemm="auto" generates every convolution but the wide ones: output channels x reduction (input channels x
# taps) of a group at least this (256 x 512).  Measured side by side (1 thread, thread CPU time, load 8-12,
# conv + SiLU, vtc's epilogue fused): the generated convolution as fast or faster on the unit shapes (3x3
# 32->32 40x40: 0.57 vs 0.59 ms at batch 1, 8.0 vs 12.9 ms at batch 16; ShuffleNet 1x1 58->58 b16: 2.1 vs
# 3.9 ms; stride 2, dilation, groups, shuffle or cat in front: 0.38-0.92 vs 0.44-0.99 ms), torch's faster
# on wide ones (3x3 256->256 28x28: 7.7 vs 6.8 ms; 1x1 512->512 14x14 b4: 4.2 vs 3.6 ms)
WIDE = 256 * 512
# ... and only on maps of at least 28x28 output pixels: on small maps the generated one is faster even when wide
# (1 thread, CPU time, load 9, conv + BN + ReLU, python -m bench.conv_side_by_side: 1x1 464->1024 7x7 0.66 vs
# 0.87-0.90 ms, 14x14 2.25 vs 2.67; 1x1 512->512 7x7 b16 6.8 vs 9.1; 3x3 256->256 7x7 0.85 vs 1.18, 14x14 2.68
# vs 2.94)
WIDE_PIXELS = 28 * 28
PACK_COLS = 256  # im2col columns packed at a time (a multiple of every NR; 4-5% faster than the whole block
#   for 3x3 32->32 and 1x1 128->128 at 40x40, batch 16, 1 thread: bench/results/gemmspeed-2026-11-29.json)
RUN_PACK_NS = 0.05  # per im2col element packed by runs (vs MAPPED_PACK_NS element by element)

# torch's float16 convolutions on a CPU without float16 instructions (``_torch_f16_fast``): 11-23x its float32 ones
# (torch 2.13, Zen 4, 2 threads: 3x3 64 -> 64 on 56x56 70.7 vs 3.08 ms, 1x1 116 -> 116 on 28x28 4.92 vs 0.42 ms)
F16_TORCH_SLOWER = 10.0
PREFETCH_NEXT = True  # a 1x1's pack prefetches each input row's next block of columns into L2
MAX_TAPS = 49  # kernels up to 7x7 are unrolled


@pointwise("convolution")
def _depthwise_conv2d(ctx, args, out):
    # bf16 / fp16: taps summed in float32, rounded once at the end (eager's depthwise kernels accumulate so)
    low = out.dtype in (torch.bfloat16, torch.float16)
    why = _unsupported(args, out, out.dtype if low else torch.float32)
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
    total = K.cast(ctx._read(bias, (oc,)), dt) if bias is not None else K.const(0, dt)
    weights = []
    for a in range(kh):
        ih = oh * sh + (a * dh - ph)
        for bb in range(kw):
            iw = ow * sw + (bb * dw - pw)
            inside = and_(ge(ih, 0), lt(ih, h), ge(iw, 0), lt(iw, wd))
            tap = K.pick(inside, K.cast(ctx._read(x, (b, ic, ih, iw)), dt), K.const(0, dt))
            weights.append(K.cast(ctx._read(w, (oc, const(0), const(a), const(bb))), dt))
            total = K.binary("add", total, K.binary("mul", weights[-1], tap))
    if tuple(ctx.index) == out_vars(out.shape):  # at its own index: the plane-by-plane vector code may emit it
        plane = K.cast(ctx._read(x, (b, ic, var(depthwise.IH, h), var(depthwise.IW, wd))), dt)
        depthwise.remember(total, depthwise.DepthwiseSum(
            tuple(ctx.index), plane, tuple(weights), K.cast(ctx._read(bias, (oc,)), dt) if bias is not None else None,
            (kh, kw), (sh, sw), (ph, pw), (dh, dw), (h, wd), (geo["oh"], geo["ow"])))
    return K.cast(total, out.dtype)


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


def _unsupported(args: dict, out, dtype: torch.dtype = torch.float32) -> str:
    """Why neither generated convolution runs this call ("" when they can); operands and result all of `dtype`
    (float32 or float16; a depthwise one also all bf16)."""
    x, w, bias = args["input"], args["weight"], args.get("bias")
    if args.get("transposed", False):
        return "transposed convolution"
    if len(x.shape) != 4 or len(w.shape) != 4:
        return f"{len(x.shape) - 2}-D convolution: the generated convolutions are 2-D only"
    bad = [v for v in (x, w, bias, out) if v is not None and v.dtype != dtype]
    if bad:
        return (f"dtype {bad[0].dtype} of %{bad[0].name}: the generated convolutions are float32 or float16 only"
                + (f" (a depthwise one also all {dtype})" if dtype != torch.float32 else ""))
    if any(s == 0 for v in (x, w, out) for s in v.shape):
        return "an empty operand"
    return ""


def choose_conv(low, n: Node, mode: str) -> GemmChoice:
    """The generated implicit GEMM or torch's convolution for conv node n under gemm=`mode`."""
    args = bind(n.target, n.args, n.kwargs)
    half = n.outputs[0].dtype == F16  # float16: the panels on widened operands, the result rounded once (narrowed)
    why = _unsupported(args, n.outputs[0], F16 if half else torch.float32)
    geo = _geometry(args, n.outputs[0]) if not why else None
    x = args["input"]
    copy = needs_copy(low, x)
    if geo is None:
        shape = (0, 0, 0, 0)
        vtc_us = torch_us = 0.0
    else:
        batch, m, p, k = geo["n"] * geo["groups"], geo["og"], geo["oh"] * geo["ow"], geo["cg"] * geo["kh"] * geo["kw"]
        shape = (batch, m, p, k)
        vtc_us, torch_us = estimate_us(batch, m, p, k, copies=(x.nbytes,) if copy else ())
        vtc_us += batch * k * p * -(-m // 128) * RUN_PACK_NS * 1e-3  # B packed once per 128 rows of A
        if half and not _torch_f16_fast():
            torch_us *= F16_TORCH_SLOWER

    # a 3x3 "same" one over 16..64 channels on a map of 16x16 or more: Winograd F(2x2, 3x3) (vtc.codegen.winograd)
    wino = geo is not None and not half and not winograd.why_not(geo, not low.plan.is_virtual(geo["w"].name))
    # a small map, one group: the output channels as vectors (vtc.codegen.conv_bcast; measured faster than the
    # dot form wherever both apply, docs/gemm.md)
    bcast = geo is not None and not wino and \
        not conv_bcast.why_not(geo, not low.plan.is_virtual(geo["w"].name))
    # ... else (groups) with a long reduction: dot products, the weight read in place (vtc.codegen.conv_t)
    dot = geo is not None and not half and not wino and not bcast and \
        not conv_t.why_not(geo, not low.plan.is_virtual(geo["w"].name))
    # ... else a very short reduction over a large map (a stem): straight from the input, no im2col packed
    # (vtc.codegen.conv_direct)
    direct = geo is not None and not dot and not bcast and not wino and \
        not conv_direct.why_not(geo, not low.plan.is_virtual(geo["w"].name))
    form = winograd.FORM if wino else conv_t.FORM if dot else conv_bcast.FORM if bcast else \
        conv_direct.FORM if direct else "panels"

    def pick(choice: str, reason: str) -> GemmChoice:
        return GemmChoice(n.name, n.op, shape, choice, reason, round(vtc_us, 2), round(torch_us, 2),
                          x.nbytes if copy else 0, path=form if choice == "vtc" else "")

    if why:
        return pick("torch", why)
    if mode == "vtc":
        return pick("vtc", "gemm='vtc' forces the generated implicit GEMM")
    if mode == "torch":
        return pick("torch", "gemm='torch' forces torch's convolution")
    moved = f"%{x.name} is not a strided view: torch would copy {x.nbytes} bytes first; " if copy else ""
    if half and torch_us - vtc_us >= 0:
        return pick("vtc", moved + "a float16 convolution: torch's has no fast path on this CPU (estimated "
                                   f"{F16_TORCH_SLOWER:g}x its float32 one), the implicit GEMM widens its operands")
    wide = geo["og"] * shape[3] >= WIDE
    if wide and p < WIDE_PIXELS:
        return pick("vtc", moved + f"a wide {geo['kh']}x{geo['kw']} convolution of {shape[3]} -> {geo['og']} on a "
                                   f"small map ({geo['oh']}x{geo['ow']} output pixels): the implicit GEMM "
                                   f"(epilogue fused) measured faster than torch's there")
    if not wide:
        return pick("vtc", moved + f"a {geo['kh']}x{geo['kw']} convolution of {shape[3]} -> {geo['og']} (channels x "
                                   f"taps per group) is not wide: the implicit GEMM (im2col packed by runs, "
                                   f"epilogue fused) measured as fast as torch's or faster")
    if copy and vtc_us <= torch_us:
        return pick("vtc", moved + "the implicit GEMM packs it through its mapping (estimated cheaper)")
    if copy:
        return pick("torch", f"%{x.name} is not a strided view, but copying {x.nbytes} bytes and running torch's "
                             f"convolution of a wide {shape[3]} -> {geo['og']} is estimated cheaper")
    return pick("torch", f"a wide convolution ({shape[3]} -> {geo['og']} channels x taps per group) on a physical "
                         f"input or a zero-copy strided view: torch's convolution (measured faster there)")


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
    pack = Im2colPack(geo, low, image, group * cg + ci, memo)
    half = out.dtype == F16  # every form below reads float16 operands widened and rounds each result once
    kern.gemm = GemmOperands(sa, sb, batch, m, p, k, ("i0", "i1", "i2"), pack_b=pack.lines,
                             runtime=(LOW_PRECISION_PRELUDE if half else "") + RUN_RUNTIME)
    choice = low.gemm_choices.get(n.name)
    weight = _unwidened(sa)  # the weight's own load (float16: widened by each form as it reads it)
    if choice is not None and choice.path == conv_t.FORM:  # dot products over a small map, where the weight allows
        if conv_t.weight_rows(weight, {v: low.values[v].shape for v in (w.name,) if v in low.values}) is not None:
            kern.gemm.generate = conv_t.generate
            return kern
        choice.path = "panels"
    if choice is not None and choice.path == winograd.FORM:  # F(2x2, 3x3), where the weight and input allow
        shapes = {v.name: v.shape for v in low.values.values()}
        rows = conv_t.weight_rows(weight, shapes)
        pack.taps = pack.direct(shapes)
        if rows is not None and not free_vars(rows[1]) and pack.taps is not None:
            kern.gemm.generate = winograd.generate
            return kern
        choice.path = "panels"
    if choice is not None and choice.path == conv_bcast.FORM:  # output channels as vectors, where the weight allows
        # (also a stride-1 "same" 3x3 whose im2col conv_panels could read in place: on Zen 4, 1 thread, 7x7 maps,
        # 0.71-0.87x of conv_taps' time at 16..512 channels, 0.62-0.67x at 8 -> 300 and 24 -> 96 on 6x6; a tie on 8x8)
        rows = conv_t.weight_rows(weight, {v: low.values[v].shape for v in (w.name,) if v in low.values})
        if rows is not None and not free_vars(rows[1]):
            kern.gemm.generate = conv_bcast.generate
            return kern
        choice.path = "panels"
    if choice is not None and choice.path == conv_direct.FORM:  # from the input, where it is one plain load
        shapes = {v.name: v.shape for v in low.values.values()}
        if conv_t.weight_rows(weight, shapes) is not None and conv_direct.plain_input(pack, shapes) is not None:
            kern.gemm.generate, kern.gemm.direct_pack = conv_direct.generate, pack
            return kern
        choice.path = "panels"
    if conv_panels.ENABLED:  # vtc.codegen.conv_panels' loops: B read in place or packed by blocks of columns
        kern.gemm.generate = conv_panels.generate
        pack.taps = pack.direct({v.name: v.shape for v in low.values.values()})
        if choice is not None and pack.taps is not None:
            choice.path = conv_panels.TAPS_PATH
    return kern


# -- the im2col pack, by runs -------------------------------------------------
# The runs read float32 or float16 (a float16 convolution: vtc.codegen.vecmath.LOW_PRECISION_PRELUDE in front), each
# element widened to float32 as it is loaded: one template per copy over the input's element type T
RUN_RUNTIME = r"""
#ifndef VTC_CONV_RUNTIME
#define VTC_CONV_RUNTIME
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VTC_CONV_VECTOR 1
// the 16 elements of src whose bit is set in m (else 0), as floats
static inline __m512 vtc_conv_load(__mmask16 m, const float* src) { return _mm512_maskz_loadu_ps(m, src); }
static inline __m512 vtc_conv_load(__mmask16 m, const uint16_t* src) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src));
}
// src[2 * l] for the 16 lanes l whose bit 2 * l is set in `wide` (else 0), as floats: the even lanes of two loads
// (float32) or the low halves of one load's 32-bit words (float16)
static inline __m512 vtc_conv_even(unsigned wide, const float* src) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return _mm512_permutex2var_ps(_mm512_maskz_loadu_ps((__mmask16)(wide & 0xFFFFu), src), even,
                                _mm512_maskz_loadu_ps((__mmask16)(wide >> 16), src + 16));
}
static inline __m512 vtc_conv_even(unsigned wide, const uint16_t* src) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_maskz_loadu_epi16((__mmask32)wide, src)));
}
#endif
template <typename T>
static inline float vtc_conv_elem(T x) {
  if constexpr (sizeof(T) == 4) return x; else return vtc_from_f16(x);
}
// dst[j] = (lo <= j < hi) ? src[j] : 0 for j < len: one run of an im2col row; src is read only in [lo, hi)
template <typename T>
static inline void vtc_conv_run(float* __restrict dst, const T* __restrict src, int64_t len, int64_t lo, int64_t hi) {
#if defined(VTC_CONV_VECTOR)
  for (int64_t j = 0; j < len; j += 16) {
    const int64_t n = std::min<int64_t>(16, len - j);
    const int64_t a = std::max<int64_t>(lo - j, 0), b = std::min<int64_t>(hi - j, n);
    const __mmask16 valid = a < b ? (__mmask16)(((1u << b) - 1u) & ~((1u << a) - 1u)) : (__mmask16)0;
    _mm512_mask_storeu_ps(dst + j, (__mmask16)((1u << n) - 1u), vtc_conv_load(valid, src + j));
  }
#else
  for (int64_t j = 0; j < len; ++j) dst[j] = (j >= lo && j < hi) ? vtc_conv_elem(src[j]) : 0.0f;
#endif
}
// dst[j] = (lo <= j < hi) ? src[2 * j] : 0 for j < len: a run at stride 2
template <typename T>
static inline void vtc_conv_run2(float* __restrict dst, const T* __restrict src, int64_t len, int64_t lo,
                                 int64_t hi) {
#if defined(VTC_CONV_VECTOR) && defined(__BMI2__)
  for (int64_t j = 0; j < len; j += 16) {
    const int64_t n = std::min<int64_t>(16, len - j);
    const int64_t a = std::max<int64_t>(lo - j, 0), b = std::min<int64_t>(hi - j, n);
    const unsigned valid = a < b ? ((1u << b) - 1u) & ~((1u << a) - 1u) : 0u;
    const unsigned wide = _pdep_u32(valid, 0x55555555u);  // input lane 2l for output lane l
    _mm512_mask_storeu_ps(dst + j, (__mmask16)((1u << n) - 1u), vtc_conv_even(wide, src + 2 * j));
  }
#else
  for (int64_t j = 0; j < len; ++j) dst[j] = (j >= lo && j < hi) ? vtc_conv_elem(src[2 * j]) : 0.0f;
#endif
}
static inline int64_t vtc_ceil_div(int64_t a, int64_t b) { return a > 0 ? (a + b - 1) / b : -((-a) / b); }
#endif
"""
MAX_CASES = 16  # piece choices unswitched out of the run loops (a cat of up to 16 inputs)


class Im2colPack:
    """Emits the pack of a convolution's B panels (the virtual im2col) by contiguous runs.

    Row r of B is (input channel, tap); for a fixed r, the output pixels of a panel row read the input
    along an output row: a run of input elements at stride `stride_w`, zero where the tap falls in the
    padding.  Per panel row the pack walks its output-row segments, works out once per segment which
    part is inside the input, and copies that part; where the input at (channel, row) is a plain
    load with unit stride along the width, the copy is one masked vector load and store per 16
    elements (``vtc_conv_run``; at stride 2 the even lanes of two loads, ``vtc_conv_run2``), otherwise
    an element loop over the input's scalar expression (an inlined producer, a pad in front).  At stride
    1 with output rows as long as the input's (same padding), output pixel q of tap (a, b) reads input
    pixel q + const, so a panel row is filled 16 pixels per masked load across row ends, the masks per
    16 pixels and tap row / column built once per kernel (``shifted``).  A 1x1 convolution without
    stride or padding reads the input's pixels in order: one run per panel row.  Piece choices that
    depend on the channel alone (a cat or split in front) are decided once per row r, outside the run
    loops (``_cases``).
    """

    def __init__(self, geo: dict, low, image, channel, memo: dict) -> None:
        self.geo = geo
        (sh, sw), (ph, pw) = geo["stride"], geo["pad"]
        self.flat = geo["kh"] == geo["kw"] == 1 and (sh, sw, ph, pw) == (1, 1, 0, 0)
        x = geo["x"]
        if self.flat:
            q = var("cv_q", geo["oh"] * geo["ow"])
            idx = (image, channel, q // geo["ow"], q % geo["ow"])
            self.inner = {"cv_q"}
        else:
            idx = (image, channel, var("cv_ih", geo["h"]), var("cv_iw", geo["wd"]))
            self.inner = {"cv_ih", "cv_iw"}
        # the input at an index inside it: the padding is decided per run, not per element
        self.value = K.cast(low.value_at(x.name, idx, memo), torch.float32)
        # stride 1 and output rows as long as input rows: output pixel q of tap (a, b) reads input pixel
        # q + (a * dil - pad) * width + (b * dil - pad), 16 pixels at a time across row ends (masked)
        self.shifted = not self.flat and (sh, sw) == (1, 1) and geo["ow"] == geo["wd"]
        self.taps = None  # ``direct``'s answer where vtc.codegen.conv_panels reads B in place

    def _mask_table(self, ind: str) -> list[str]:
        """Per 16 output pixels, which lanes' tap row a / tap column b lies inside the input (built once)."""
        geo = self.geo
        kh, kw, oh, ow, h, w = geo["kh"], geo["kw"], geo["oh"], geo["ow"], geo["h"], geo["wd"]
        (dh, dw), (ph, pw) = geo["dil"], geo["pad"]
        n, halves = oh * ow, -(-oh * ow // 16) + 2
        return [f"{ind}#if defined(__AVX512F__)",
                f"{ind}struct CvMasks {{ __mmask16 rows[{halves * kh}], cols[{halves * kw}]; }};",
                f"{ind}static const CvMasks cv_masks = [] {{",
                f"{ind}  CvMasks t{{}};",
                f"{ind}  for (int64_t q = 0; q < {n}; ++q) {{",
                f"{ind}    const int64_t y = q / {ow}, x = q % {ow};",
                f"{ind}    for (int64_t a = 0; a < {kh}; ++a)",
                f"{ind}      if (y + a * {dh} - {ph} >= 0 && y + a * {dh} - {ph} < {h}) t.rows[q / 16 * {kh} + a] |= 1u << (q % 16);",
                f"{ind}    for (int64_t b = 0; b < {kw}; ++b)",
                f"{ind}      if (x + b * {dw} - {pw} >= 0 && x + b * {dw} - {pw} < {w}) t.cols[q / 16 * {kw} + b] |= 1u << (q % 16);",
                f"{ind}  }}",
                f"{ind}  return t;",
                f"{ind}}}();",
                f"{ind}#endif"]

    def lines(self, em, g, ind: str) -> list[str]:
        """bp[(jj / NR) * NR * kb + pp * NR + jj % NR] = B[batch, k0 + pp, n0 + jj], zero past nb."""
        geo = self.geo
        out = self._mask_table(ind) if self.shifted else []
        # PACK_COLS columns at a time: a panel row goes to PACK_COLS / NR panels, not to all of the block's
        # (each store to another panel is a line taken from L2; a few streams stay in L1)
        out += [f"{ind}for (int64_t jb = 0; jb < nb; jb += {PACK_COLS}) {{",
                f"{ind}  const int64_t je = std::min<int64_t>(nb, jb + {PACK_COLS});"]
        ind, outer = ind + "  ", ind
        out += [f"{ind}for (int64_t pp = 0; pp < kb; ++pp) {{", f"{ind}  const int64_t r = k0 + pp;"]
        if not self.flat:
            kh, kw, ow = geo["kh"], geo["kw"], geo["ow"]
            (sw, dh, dw), (ph, pw) = (geo["stride"][1], *geo["dil"]), geo["pad"]
            out += [f"{ind}  const int64_t cv_dh = ((r / {kw}) % {kh}) * {dh} - {ph}, cv_dw = (r % {kw}) * {dw} - {pw};",
                    f"{ind}  const int64_t cv_olo = std::max<int64_t>(0, vtc_ceil_div(-cv_dw, {sw}));",
                    f"{ind}  const int64_t cv_ohi = std::min<int64_t>({ow}, vtc_ceil_div({geo['wd']} - cv_dw, {sw}));"]
        out += self._cases(em, self.value, ind + "  ")
        return out + [f"{ind}}}", f"{outer}}}"]

    def _cases(self, em, s: K.Scalar, ind: str) -> list[str]:
        """An if / else per piece choice of s whose predicate is the same along a run, then the runs."""
        cases = piece_cases(s, self.inner) or [([], s)]
        if len(cases) == 1:
            return self._runs(em, cases[0][1], ind)
        out: list[str] = []
        for n, (conds, leaf) in enumerate(cases):
            test = " && ".join(em.index(p) for p in conds)
            out += [f"{ind}{'if' if n == 0 else '} else if'} ({test}) {{", *self._runs(em, leaf, ind + "  ")]
        return out + [f"{ind}}}"]

    def _runs(self, em, s: K.Scalar, ind: str) -> list[str]:
        geo = self.geo
        run = self._plain_run(em, s)
        em.forget()
        i2, i3 = ind + "  ", ind + "    "
        # what does not change along the runs (a batch norm's scale and shift of an inlined producer, per
        # input channel) computed once per panel row, not per element
        out = [] if run else em.hoist_invariant([s], self.inner, ind)
        out += [f"{ind}for (int64_t jr = jb; jr < je; jr += VTC_NR) {{",
               f"{i2}float* __restrict dst = bp + jr * kb + pp * VTC_NR;",
               f"{i2}const int64_t len = std::min<int64_t>(nb - jr, VTC_NR);"]
        if self.flat:
            # the same input row's lines of the next block of columns, into L2 while this block is used (of the
            # load an inlined producer reads, where it has one with unit stride along the pixels)
            src = run or next((a for a in (self._plain_run(em, q) for q in _loads(s)) if a), "")
            ahead = ([f"{ind}{{ const int64_t cv_q = n0 + je; const char* pf = (const char*)({src});",
                      f"{ind}  for (int64_t l = 0; l < (je - jb) * 4; l += 64) __builtin_prefetch(pf + l, 0, 2); }}"]
                     if PREFETCH_NEXT and src else [])
            if run:
                return ahead + out + [f"{i2}const int64_t cv_q = n0 + jr;",
                                      f"{i2}vtc_conv_run(dst, {run}, VTC_NR, 0, len);", f"{ind}}}"]
            temps = em.hoist([s], i3)
            return ahead + out + [f"{i2}for (int64_t jj = 0; jj < len; ++jj) {{", f"{i3}const int64_t cv_q = n0 + jr + jj;",
                          *temps, f"{i3}dst[jj] = {em.scalar(s)};", f"{i2}}}",
                          f"{i2}for (int64_t jj = len; jj < VTC_NR; ++jj) dst[jj] = 0.0f;", f"{ind}}}"]
        ow, sh, sw, h = geo["ow"], geo["stride"][0], geo["stride"][1], geo["h"]
        i4, i5 = i3 + "  ", i3 + "    "
        shifted = []
        if run and self.shifted and self._row_stride(em, _unwidened(s)) == geo["wd"]:
            kh, kw = geo["kh"], geo["kw"]
            shifted = [f"{ind}#if defined(VTC_CONV_VECTOR)",
                       f"{ind}if (n0 % 16 == 0) {{  // panels of whole 16-pixel groups (the tiles' columns are)",
                       f"{ind}  const int64_t cv_ih = cv_dh, cv_iw = cv_dw, cv_a = (r / {kw}) % {kh}, cv_b = r % {kw};",
                       f"{ind}  const auto* __restrict src = {run};",
                       f"{ind}  for (int64_t jr = jb; jr < je; jr += VTC_NR) {{",
                       f"{ind}    float* __restrict dst = bp + jr * kb + pp * VTC_NR;",
                       f"{ind}    const int64_t q = n0 + jr;",
                       f"{ind}    for (int64_t hh = 0; hh < VTC_NR / 16; ++hh) {{",
                       f"{ind}      const int64_t hq = q / 16 + hh;",
                       f"{ind}      const __mmask16 m = cv_masks.rows[hq * {kh} + cv_a] & cv_masks.cols[hq * {kw} + cv_b];",
                       f"{ind}      _mm512_storeu_ps(dst + 16 * hh, vtc_conv_load(m, src + q + 16 * hh));",
                       f"{ind}    }}",
                       f"{ind}  }}",
                       f"{ind}}} else",
                       f"{ind}#endif"]
        out += [f"{i2}int64_t oh = (n0 + jr) / {ow}, ow = (n0 + jr) % {ow}, j = 0;",
                f"{i2}while (j < len) {{  // one output-row segment: a run of the input row cv_ih",
                f"{i3}const int64_t seg = std::min<int64_t>({ow} - ow, len - j), cv_ih = oh * {sh} + cv_dh;",
                f"{i3}const bool row = cv_ih >= 0 && cv_ih < {h};",
                f"{i3}const int64_t lo = row ? std::min<int64_t>(std::max<int64_t>(cv_olo - ow, 0), seg) : 0;",
                f"{i3}const int64_t hi = row ? std::max<int64_t>(std::min<int64_t>(cv_ohi - ow, seg), lo) : lo;"]
        if run:
            copy = "vtc_conv_run" if sw == 1 else "vtc_conv_run2"
            out += [f"{i3}{{ const int64_t cv_iw = ow * {sw} + cv_dw; {copy}(dst + j, {run}, seg, lo, hi); }}"]
        else:
            temps = em.hoist([s], i5)
            out += [f"{i3}for (int64_t jj = 0; jj < lo; ++jj) dst[j + jj] = 0.0f;",
                    f"{i3}for (int64_t jj = lo; jj < hi; ++jj) {{",
                    f"{i4}const int64_t cv_iw = (ow + jj) * {sw} + cv_dw;",
                    *[t.replace(i5, i4, 1) for t in temps],
                    f"{i4}dst[j + jj] = {em.scalar(s)};",
                    f"{i3}}}",
                    f"{i3}for (int64_t jj = hi; jj < seg; ++jj) dst[j + jj] = 0.0f;"]
        out += [f"{i3}j += seg; ++oh; ow = 0;", f"{i2}}}", f"{i2}for (; j < VTC_NR; ++j) dst[j] = 0.0f;", f"{ind}}}"]
        return shifted + out

    def direct(self, shapes: dict) -> tuple[K.Scalar, int, list[int]] | None:
        """Where the micro-kernel can read B straight from the input (vtc.codegen.conv_panels, path
        ``TAPS_PATH``): (the input's load, whose address ``_plain_run`` gives; the taps T per input channel;
        per tap, the offset of its input pixel from the output pixel's).  That needs a stride-1 convolution
        with output rows as long as the input's (``shifted``: a 3x3 "same" one), over an input that is one
        plain float32 load (no cat or split in front: one piece case) with unit stride along the width, rows
        one row length apart and the input channel (r // T) as its only term in r, so that row r of B is
        the plane of channel r // T shifted by its tap's offset.  None otherwise (the pack by runs copies B
        into panels).  `shapes`: {buffer: shape} of the loaded buffers."""
        geo = self.geo
        # (a 1x1 convolution read in place measured 15% slower than packed: its B rows, one input plane apart,
        # fall into few of L1's sets; a 3x3's taps read neighbouring lines of each plane)
        if not self.shifted or geo["stride"][1] != 1:
            return None
        cases = piece_cases(self.value, self.inner)
        if cases is None or len(cases) != 1 or cases[0][0]:
            return None
        s = cases[0][1]
        if s.op != "load" or s.dtype != torch.float32 or s.args[0] not in shapes:
            return None
        taps = geo["kh"] * geo["kw"]
        _, terms = _terms(linear_offset(s.args[1], shapes[s.args[0]]))
        seen = set()
        for atom, k in terms.items():
            names = free_vars(atom)
            if atom.op == "var" and atom.args[0] in ("cv_ih", "cv_iw"):
                seen.add((atom.args[0], k))
            elif names & {"cv_ih", "cv_iw"}:
                return None
            elif "r" in names and not (atom.op == "floordiv" and atom.args[0].op == "var"
                                       and atom.args[0].args[0] == "r" and atom.args[1] == taps):
                return None
        if seen - {("cv_ih", geo["wd"])} != {("cv_iw", 1)} or (geo["h"] > 1 and ("cv_ih", geo["wd"]) not in seen):
            return None
        (dh, dw), (ph, pw), w = geo["dil"], geo["pad"], geo["wd"]
        shifts = [(a * dh - ph) * w + (b * dw - pw) for a in range(geo["kh"]) for b in range(geo["kw"])]
        return s, taps, shifts

    def _row_stride(self, em, s: K.Scalar) -> int | None:
        """The coefficient of the input row in load s's offset."""
        _, terms = _terms(linear_offset(s.args[1], em.shapes[s.args[0]]))
        return next((k for atom, k in terms.items() if atom.op == "var" and atom.args[0] == "cv_ih"), None)

    def _plain_run(self, em, s: K.Scalar) -> str:
        """C for the address of s at the run's start when s is a load with unit stride along the input row
        and the convolution's stride along the width is 1 or 2 (vtc_conv_run / vtc_conv_run2), else ""."""
        along = "cv_q" if self.flat else "cv_iw"
        s = _unwidened(s)  # a float16 input: the runs widen it as they read it
        stride = 1 if self.flat else self.geo["stride"][1]
        if s.op != "load" or s.dtype not in (torch.float32, F16) or stride not in (1, 2):
            return ""
        buf, idx = s.args
        lin = linear_offset(idx, em.shapes[buf])
        _, terms = _terms(lin)
        for atom, k in terms.items():
            if along in free_vars(atom) and not (atom.op == "var" and k == 1):
                return ""
        if not any(atom.op == "var" and atom.args[0] == along for atom in terms):
            return ""
        return f"{em.ptr[buf]} + {em.index(lin)}"


def _loads(s: K.Scalar) -> list[K.Scalar]:
    """The loads in scalar s (not through index tensors), outermost first."""
    out, todo = [], [s]
    while todo:
        q = todo.pop(0)
        if q.op == "load":
            out.append(q)
        else:
            todo.extend(a for a in q.args if isinstance(a, K.Scalar))
    return out


def piece_cases(s: K.Scalar, inner: set[str], limit: int = MAX_CASES) -> list[tuple[list, K.Scalar]] | None:
    """[(predicates, s with those piece choices decided)] over the piece choices of s whose predicate
    involves none of the variables `inner` (a cat or split on the channel, decided once per row or
    plane); the cases are exclusive and cover every index.  None beyond `limit` cases."""
    p = next((x.args[0] for x in scalars_under([s]) if x.op == "pick" and not free_vars(x.args[0]) & inner), None)
    if p is None:
        return [([], s)]
    out = []
    for taken, cond in ((True, p), (False, not_(p))):
        sub = piece_cases(_choose(s, p, taken), inner, limit)
        if sub is None:
            return None
        out += [([cond, *conds], leaf) for conds, leaf in sub]
    return out if len(out) <= limit else None


def _choose(s: K.Scalar, p, taken: bool, memo: dict | None = None) -> K.Scalar:
    """s with every piece choice on predicate p replaced by its side for p == taken."""
    memo = {} if memo is None else memo
    hit = memo.get(id(s))
    if hit is not None:
        return hit
    if s.op == "pick" and s.args[0] is p:
        out = _choose(s.args[1] if taken else s.args[2], p, taken, memo)
    else:
        args = tuple(_choose(a, p, taken, memo) if isinstance(a, K.Scalar) else a for a in s.args)
        out = s if all(a is b for a, b in zip(args, s.args)) else K.Scalar.make(s.op, args, s.dtype)
    memo[id(s)] = out
    return out
