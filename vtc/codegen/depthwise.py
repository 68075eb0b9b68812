"""Depthwise convolutions as vector code: one channel plane at a time, taps as masked vector loads.

A depthwise convolution (vtc.codegen.conv) is a pointwise op: its output
element is a short unrolled sum of taps, each a piece choice (``K.pick``)
between the input and the zero padding.  Emitted by the generic pointwise
loop, every tap of every element tests its padding predicate and the width
loop is as short as an output row (28, 14, 7 elements).  Here a pointwise
kernel whose value contains one depthwise sum at the kernel's own index is
emitted plane by plane instead (OpenMP over image x channel):

- **flat**: stride 1 and input rows as long as output rows (same padding,
  the input plane contiguous in its rows): the plane's output positions are
  walked 16 at a time across row ends; tap t of chunk c is one masked load
  at a constant offset, its mask (inside the input and the plane) computed
  once per call for every (c, t);
- **rows**: any stride or dilation: per output row, 16 columns at a time; a
  tap row outside the input is skipped, a tap column is a masked load
  (stride 1), the even lanes of two masked loads (stride 2, ``vtc_dw_even``)
  or a masked gather (stride > 2).

The same emitter runs a max pool (vtc.codegen.pool, ``combine="max"``): the
accumulator starts at -inf, a tap in the padding loads -inf, and a NaN lane of
any tap is kept (``_mm512_max_ps`` alone would drop it).

The sums go to a small per-thread buffer (a block of rows, in L1); then the
kernel's own stores (the batch norm, activation, residual fused after the
convolution) run over the block with the sum read from it, vectorised along
the width by the compiler.  The input plane is read through its mapping: a
piece choice on the channel alone (a cat, split or channel shuffle in front)
is decided once per plane; any other mapping (a pad in front, an inlined
producer, a strided width) keeps the generic pointwise loop, as do machines
without AVX-512 (the preprocessor picks).

A bf16 / fp16 plane (the convolution's taps cast to float32, vtc.codegen.conv)
is read with 16-bit masked loads widened to float (``vtc_dw_bf16`` /
``vtc_dw_f16``; stride 2: one 32-element load whose 32-bit words' low halves
are the even taps), summed in float32 and rounded once by the stores, as
eager's depthwise kernels do; stride > 2 and max pools in those dtypes keep
the generic loop (AVX512BW / VL needed too).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from vtc.codegen.kernel_ir import Kernel, Scalar, scalars_under
from vtc.index.expr import Expr, _terms, const, free_vars
from vtc.index.mapping import linear_offset, out_vars

PRELUDE = r"""
#if defined(__AVX512F__) && !defined(VTC_DEPTHWISE_PRELUDE)
#define VTC_DEPTHWISE_PRELUDE
#include <immintrin.h>
// lanes l of src[2 * l] where bit 2 * l of `wide` is set, else fill: 16 taps at stride 2 from two
// contiguous masked loads (their even lanes), no gather
static inline __m512 vtc_dw_even(__m512 fill, unsigned wide, const float* src) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512 x0 = _mm512_mask_loadu_ps(fill, (__mmask16)(wide & 0xFFFFu), src);
  const __m512 x1 = _mm512_mask_loadu_ps(fill, (__mmask16)(wide >> 16), src + 16);
  return _mm512_permutex2var_ps(x0, even, x1);
}
#if defined(__AVX512BW__) && defined(__AVX512VL__)
// bf16 / fp16 planes (the taps summed, or a max pool's maxed, in float32): 16 elements widened to float; where
// the mask is clear, the element whose bits are `fill` (0: 0.0; a max pool's -inf)
static inline __m512 vtc_dw_bf16(__mmask16 m, const uint16_t* src, short fill) {
  const __m256i h = _mm256_mask_loadu_epi16(_mm256_set1_epi16(fill), m, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 vtc_dw_f16(__mmask16 m, const uint16_t* src, short fill) {
  return _mm512_cvtph_ps(_mm256_mask_loadu_epi16(_mm256_set1_epi16(fill), m, src));
}
// the even elements src[2 * l] where bit 2 * l of `wide` is set (else `fill`'s): one 32-element load, each
// 32-bit word's low half
static inline __m512 vtc_dw_even_bf16(unsigned wide, const uint16_t* src, short fill) {
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_mask_loadu_epi16(_mm512_set1_epi16(fill), (__mmask32)wide, src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 vtc_dw_even_f16(unsigned wide, const uint16_t* src, short fill) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_mask_loadu_epi16(_mm512_set1_epi16(fill), (__mmask32)wide, src)));
}
#endif
#endif
"""
LOW = {torch.bfloat16: "bf16", torch.float16: "f16"}  # planes of these dtypes: loads widen (vtc_dw_bf16, ...)
LOW_NEG_INF = {torch.bfloat16: 0xFF80, torch.float16: 0xFC00}  # -inf's bits: a max pool's fill
NAN_BITS = True  # a max pool's NaN lanes from an unsigned max of the taps' bits (vector ops; False: a compare per
#   tap into a mask, whose OR gcc keeps in a general register: kernel alone, 1 thread, ShuffleNet's 3x3 / 2 pool of
#   24 x 112 x 112, 48.7 -> 40.3 us min, docs/gemm.md)
PREFETCH_ROWS = 2  # rows form: the input rows of the output row this many ahead prefetched (0: none); in a whole
#   model a plane's rows come from memory, not cache (ShuffleNetV2 in one call, 1 thread, load 8-10, median: the
#   stem pool 165 -> 80 us, the stride-2 depthwise convolutions 2-6 us each less)
FLAT_EPILOGUE = True  # False: a flat plane's stores run row by row too (a switch for side-by-side timing)
ALIGN_MIN_KW = 3  # flat form, float32 convolutions at least this wide (up to 16 taps across, no width dilation): a tap
#   row is two loads, its columns shifted out of them (valignd), the padding a masked FMA (0 for the old form)
FLAT_COLUMN_MASKS = True  # aligned flat form: each FMA masked by its tap column's lanes alone, a chunk's kw column
#   masks read once per chunk; a lane whose tap row is outside the input reads 0 from the zero-filled loads (the
#   plane is exactly h rows of w: a tap inside the columns is outside the rows iff it is outside the plane's memory).
#   False: the tap row's and column's masks ANDed per FMA (session 16), a scalar load, AND and kmov per FMA:
#   5x5 over 384 planes of 28x28 alone, 1 thread, 207 -> 150 us median (docs/gemm.md, session 17)
FLAT_ACCUMULATORS = 8  # aligned flat form, taps at least 5 wide: tap column b adds to accumulator b % min(kw, this)
#   (narrower: two), so a chunk's FMAs form kw short dependency chains, not two long ones (5x5 over 384 x 28x28 alone,
#   1 thread: 144 -> 129 us median with 5 chains; 7x7 over 232 x 14x14: 43 -> 34 us with 7; 3x3: 3 no better than 2)
BLOCK = 4096  # floats of the per-thread sum buffer (16 KiB: a block of output rows stays in L1)
IH, IW = "dw_ih", "dw_iw"  # C names of the input row and column in the plane scalar


@dataclass(frozen=True)
class DepthwiseSum:
    """What the vector emitter needs of one depthwise sum (built by conv._depthwise_conv2d)."""

    index: tuple[Expr, ...]  # the output index the sum was built at (batch, channel, row, column)
    plane: Scalar  # the input at (image, input channel, IH, IW): the plane read through its mapping
    taps: tuple[Scalar, ...]  # weight of tap (a, b) at index a * kw + b, for this output channel (none for max)
    bias: Scalar | None
    kernel: tuple[int, int]
    stride: tuple[int, int]
    pad: tuple[int, int]
    dil: tuple[int, int]
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    combine: str = "fma"  # "fma": sum of weight x tap (a convolution); "max": max of the taps (a max pool)


_SUMS: "weakref.WeakKeyDictionary[Scalar, DepthwiseSum]" = weakref.WeakKeyDictionary()


def remember(total: Scalar, info: DepthwiseSum) -> None:
    """Records that scalar `total` is the depthwise sum described by `info`."""
    _SUMS[total] = info


def source(k: Kernel, em, generic) -> list[str] | None:
    """The body of pointwise kernel k as plane-by-plane vector code, or None where it does not apply.

    `generic(k, em)` emits the pointwise loop (vtc.codegen.cpp), kept for machines without AVX-512.
    """
    if k.kind != "pointwise" or len(k.domain) != 4:
        return None
    found = [s for s in scalars_under([st.value for st in k.stores]) if s in _SUMS]
    if len(found) != 1:
        return None
    total = found[0]
    dw = _SUMS[total]
    idx = out_vars(k.domain)
    if dw.index != idx or any(st.index != idx or tuple(st.buffer.shape) != tuple(k.domain) for st in k.stores):
        return None
    if dw.out_hw != tuple(k.domain[2:]):
        return None
    from vtc.codegen.conv import piece_cases

    cases = piece_cases(dw.plane, {IH, IW})
    if cases is None:
        return None
    leaves = [_plane_pointer(em, leaf, dw.in_hw) for _, leaf in cases]
    if any(x is None for x in leaves):
        return None
    dtypes = {dt for _, _, dt in leaves}
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    # bf16 / fp16: stride 1 or 2 (no 16-bit gather)
    if dtype != torch.float32 and dw.stride[1] > 2:
        return None
    leaves = [(src, row) for src, row, _ in leaves]
    (oh, ow), w = dw.out_hw, dw.in_hw[1]
    flat = dw.stride == (1, 1) and all(row == w for _, row in leaves) and ow == w and oh * ow <= BLOCK
    em.forget()
    head = [f"  #pragma omp parallel for num_threads(nthreads) if({_work(k, dw)} >= {PARALLEL_MIN_WORK})",
            f"  for (int64_t pl = 0; pl < {k.domain[0] * k.domain[1]}; ++pl) {{",
            *_plane_head(k, dw, em, "    ")]
    body = (_flat if flat else _rows)(k, em, dw, total, cases, leaves, dtype)
    tables, body = body
    em.forget()
    generic_body = generic(k, em)
    guard = "defined(__AVX512F__)" + (" && defined(__AVX512BW__) && defined(__AVX512VL__)"
                                      if dtype != torch.float32 else "")
    return [f"#if {guard}", *tables, *head, *body, "  }", "#else", *generic_body, "#endif"]


PARALLEL_MIN_WORK = 1 << 15


def _work(k: Kernel, dw: DepthwiseSum) -> int:
    return k.domain[0] * k.domain[1] * k.domain[2] * k.domain[3] * dw.kernel[0] * dw.kernel[1]


def _plane_pointer(em, leaf: Scalar, hw: tuple[int, int]) -> tuple[str, int, torch.dtype] | None:
    """(C address of the plane's element (0, 0), row stride, dtype in memory) for a float32 load (or a bf16 /
    fp16 one cast to float32) with unit column stride (an index of extent 1 is the constant 0: its stride does
    not matter)."""
    if leaf.op == "cast" and leaf.dtype == torch.float32 and leaf.args[0].dtype in LOW:
        leaf = leaf.args[0]
    if leaf.op != "load" or leaf.dtype not in (torch.float32, *LOW):
        return None
    buf, idx = leaf.args
    lin = linear_offset(idx, em.shapes[buf])
    c, terms = _terms(lin)
    row, rest, unit = (hw[1] if hw[0] == 1 else 0), [], hw[1] == 1
    for atom, k in terms.items():
        if atom.op == "var" and atom.args[0] == IW:
            if k != 1:
                return None
            unit = True
        elif atom.op == "var" and atom.args[0] == IH:
            row = k
        elif free_vars(atom) & {IH, IW}:
            return None
        else:
            rest.append(em.index(atom) if k == 1 else f"{k}*{em.index(atom)}")
    if not unit:
        return None
    return f"{em.ptr[buf]} + ({' + '.join(rest + [str(c)])})", row, leaf.dtype


def _plane_head(k: Kernel, dw: DepthwiseSum, em, ind: str) -> list[str]:
    """Plane pl's batch and channel indices, its tap weights and bias."""
    kh, kw = dw.kernel
    lines = [f"{ind}const int64_t i0 = pl / {k.domain[1]}, i1 = pl % {k.domain[1]};"]
    if dw.combine == "max":  # the accumulator starts at -inf, a tap in the padding loads -inf
        return lines + [f"{ind}const __m512 bias = _mm512_set1_ps(-INFINITY), fill = bias;"]
    lines += [f"{ind}float wt[{kh * kw}];", *[f"{ind}wt[{t}] = {em.scalar(s)};" for t, s in enumerate(dw.taps)]]
    bias = em.scalar(dw.bias) if dw.bias is not None else "0.0f"
    return lines + [f"{ind}const __m512 bias = _mm512_set1_ps({bias}), fill = _mm512_setzero_ps();"]


def _low_fill(dw: DepthwiseSum, dtype: torch.dtype) -> str:
    """C bits of the bf16 / fp16 element a masked-off tap loads: 0.0 for a sum, -inf for a max."""
    return f"(short)0x{LOW_NEG_INF[dtype]:X}" if dw.combine == "max" else "0"


def _combine(dw: DepthwiseSum, t: int, load: str) -> str:
    """C adding tap t (its vector `load`) into acc; a max records NaN lanes (torch propagates NaN,
    _mm512_max_ps does not): with NAN_BITS in `nanb`, the unsigned max of the taps' bits without the sign (above
    0x7f800000, infinity's, only for a NaN), else in the mask `nan`."""
    if dw.combine == "max" and NAN_BITS:
        return (f"{{ const __m512 v = {load}; nanb = _mm512_max_epu32(nanb, _mm512_and_si512(_mm512_castps_si512(v), "
                f"_mm512_set1_epi32(0x7fffffff))); acc = _mm512_max_ps(acc, v); }}")
    if dw.combine == "max":
        return (f"{{ const __m512 v = {load}; nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); "
                f"acc = _mm512_max_ps(acc, v); }}")
    return f"acc = _mm512_fmadd_ps(_mm512_set1_ps(wt[{t}]), {load}, acc);"


def _finish(dw: DepthwiseSum) -> list[str]:
    """C starting (first item) and finishing (second) one vector of sums."""
    if dw.combine == "max" and NAN_BITS:
        return ["__m512 acc = bias; __m512i nanb = _mm512_setzero_si512();",
                "acc = _mm512_mask_mov_ps(acc, _mm512_cmpgt_epu32_mask(nanb, _mm512_set1_epi32(0x7f800000)), "
                "_mm512_set1_ps(NAN));"]
    if dw.combine == "max":
        return ["__m512 acc = bias; __mmask16 nan = 0;", "acc = _mm512_mask_mov_ps(acc, nan, _mm512_set1_ps(NAN));"]
    return ["__m512 acc = bias;", ""]


def _epilogue(k: Kernel, em, total: Scalar, lo: str, hi: str, ind: str) -> list[str]:
    """The kernel's stores for output rows [lo, hi), the sum read from tmp (rows from lo on)."""
    ow = k.domain[3]
    em.forget()
    em.temps[id(total)] = "dw_sum"
    half = _half_rows(k, em, total, "i3")
    inner = ind + "    "
    plane = em.hoist_invariant([st.value for st in k.stores], {"i2", "i3"}, ind)  # a batch norm's scale
    temps = em.hoist([st.value for st in k.stores], inner)
    at = f"tmp[(i2 - {lo}) * {ow} + i3]"
    stores = [f"{inner}{at} = {em.temps.get(id(st.value)) or em.unrounded(st.value)};" if half == "row" else
              f"{inner}{em.ptr[st.buffer.name]}[{em.linear(st.buffer.name, st.index)}] = "
              f"{em.stored(st.value, st.buffer.dtype)};" for st in k.stores]
    st = k.stores[0]
    em.forget()
    return [*([f"{ind}vtc_round_f16_n(tmp, ({hi} - {lo}) * {ow});"] if half else []), *plane,
            f"{ind}for (int64_t i2 = {lo}; i2 < {hi}; ++i2) {{",
            f"{ind}  #pragma omp simd",
            f"{ind}  for (int64_t i3 = 0; i3 < {ow}; ++i3) {{",
            f"{inner}const float dw_sum = {at};",
            *temps, *stores,
            f"{ind}  }}",
            *([f"{ind}  {{ const int64_t i3 = 0; vtc_to_f16_n(&{em.ptr[st.buffer.name]}[{em.linear(st.buffer.name, st.index)}], "
               f"tmp + (i2 - {lo}) * {ow}, {ow}); }}"] if half == "row" else []),
            f"{ind}}}"]


def _half_rows(k: Kernel, em, total: Scalar, along: str) -> str:
    """For a float16 result whose values read the sum `total` only rounded to float16 (the convolution's own result,
    as eager rounds it before a batch norm): those roundings read as ``dw_sum`` (the caller rounds tmp in place first,
    vecmath's ``vtc_round_f16_n``: vector conversions, where the loop's are calls) and "row" where one store, without
    a predicate, writes consecutive elements along `along` (its values go back into tmp, narrowed as rows:
    ``vtc_to_f16_n``), else "plane"; "" otherwise (or for a float32 result)."""
    values = [st.value for st in k.stores]
    if k.stores[0].buffer.dtype != torch.float16:
        return ""
    reads = [s for s in scalars_under(values, stop=lambda s: s is total) if any(a is total for a in s.args)]
    if not reads or any(s.op != "cast" or s.dtype != torch.float16 for s in reads) or any(v is total for v in values):
        return ""
    for s in reads:
        em.temps[id(s)] = "dw_sum"
    st = k.stores[0]
    if len(k.stores) > 1 or st.when is not None:
        return "plane"
    _, terms = _terms(linear_offset(st.index, st.buffer.shape))
    moving = [(atom, c) for atom, c in terms.items() if along in free_vars(atom)]
    return "row" if len(moving) == 1 and moving[0][0].op == "var" and moving[0][1] == 1 else "plane"


def _flat_epilogue(k: Kernel, em, total: Scalar, n: int, ind: str) -> list[str] | None:
    """The kernel's stores over the whole plane as one loop of n = oh * ow elements (the sums in tmp, a
    plane's outputs contiguous), or None where a stored value reads anything but the sum along the plane (a
    residual, a pad).  The row-by-row loop of a 7x7 plane runs 7-lane vectors whose loads of tmp wait for
    the 16-lane stores (half of the kernel's time, `perf`)."""
    values = [st.value for st in k.stores]
    if not FLAT_EPILOGUE:
        return None
    for s in scalars_under(values, stop=lambda s: s is total):
        for a in s.args:
            for e in (a if isinstance(a, tuple) else (a,)):
                if isinstance(e, Expr) and free_vars(e) & {"i2", "i3"}:
                    return None
    em.forget()
    em.temps[id(total)] = "dw_sum"
    half = _half_rows(k, em, total, "i3") and ("row" if len(k.stores) == 1 else "plane")  # (the plane is contiguous)
    inner = ind + "  "
    plane = em.hoist_invariant(values, {"i2", "i3"}, ind)  # a batch norm's scale
    temps = em.hoist(values, inner)
    i0, i1 = out_vars(k.domain)[:2]
    first = {st.buffer.name: f"{em.ptr[st.buffer.name]}[{em.linear(st.buffer.name, (i0, i1, const(0), const(0)))}"
             for st in k.stores}
    stores = [f"{inner}tmp[q] = {em.temps.get(id(st.value)) or em.unrounded(st.value)};" if half == "row" else
              f"{inner}{first[st.buffer.name]} + q] = {em.stored(st.value, st.buffer.dtype)};" for st in k.stores]
    em.forget()
    return [*([f"{ind}vtc_round_f16_n(tmp, {n});"] if half else []), *plane,
            f"{ind}#pragma omp simd",
            f"{ind}for (int64_t q = 0; q < {n}; ++q) {{",
            f"{inner}const float dw_sum = tmp[q];",
            *temps, *stores,
            f"{ind}}}",
            *([f"{ind}vtc_to_f16_n(&{first[k.stores[0].buffer.name]}], tmp, {n});"] if half == "row" else [])]


def _cases(em, cases, leaves, emit, ind: str, dtype: torch.dtype = torch.float32) -> list[str]:
    """if / else over the plane's piece choices, `emit(row_stride, indent)` in each with `src` its plane."""
    out: list[str] = []
    t = "uint16_t" if dtype in LOW else "float"
    for n, ((conds, _), (src, row)) in enumerate(zip(cases, leaves)):
        test = " && ".join(f"{em.index(p)}" for p in conds) or "true"
        out += [f"{ind}{'if' if n == 0 else '} else if'} ({test}) {{",
                f"{ind}  const {t}* __restrict src = {src};", *emit(row, ind + "  ")]
    return out + [f"{ind}}}"]


def _mask_table(name: str, n: int, body: list[str], ctype: str = "__mmask16") -> list[str]:
    """A function-local table of n masks filled once (thread-safe static initialisation) by `body`."""
    kind = ("Masks" if ctype == "__mmask16" else "Masks_" + ctype) + ("" if name == "masks" else "_" + name)
    return [f"  struct {kind} {{ {ctype} m[{n}]; }};",
            f"  static const {kind} {name} = [] {{",
            f"    {kind} tab{{}};",
            *["    " + x for x in body],
            "    return tab;",
            "  }();"]


def _flat(k: Kernel, em, dw: DepthwiseSum, total: Scalar, cases, leaves, dtype=torch.float32):
    """Stride 1, input rows as long as output rows: 16 output positions of the plane at a time."""
    (oh, ow), (h, w) = dw.out_hw, dw.in_hw
    kh, kw = dw.kernel
    (ph, pw), (dh, dd) = dw.pad, dw.dil
    if ALIGN_MIN_KW and dtype == torch.float32 and dw.combine == "fma" and dd == 1 and ALIGN_MIN_KW <= kw <= 16:
        return _flat_aligned(k, em, dw, total, cases, leaves)
    taps, n = kh * kw, oh * ow
    chunks = -(-n // 16)
    start, end = _finish(dw)
    offs = [(a * dh - ph) * w + (b * dd - pw) for a in range(kh) for b in range(kw)]
    tables = _mask_table("masks", chunks * taps, [
        f"for (int64_t c = 0; c < {chunks}; ++c)",
        f"  for (int64_t t = 0; t < {taps}; ++t) {{  // lanes of chunk c inside the plane whose tap t is inside the input",
        "    unsigned m = 0;",
        "    for (int l = 0; l < 16; ++l) {",
        f"      const int64_t p = c * 16 + l, y = p / {ow} + (t / {kw}) * {dh} - {ph}, x = p % {ow} + (t % {kw}) * {dd} - {pw};",
        f"      if (p < {n} && y >= 0 && y < {h} && x >= 0 && x < {w}) m |= 1u << l;",
        "    }",
        f"    tab.m[c * {taps} + t] = (__mmask16)m;",
        "  }"])

    def emit(row: int, ind: str) -> list[str]:
        return [f"{ind}for (int64_t c = 0; c < {chunks}; ++c) {{",
                f"{ind}  const __mmask16* mk = masks.m + c * {taps};",
                f"{ind}  const {'uint16_t' if dtype in LOW else 'float'}* __restrict s = src + c * 16;",
                f"{ind}  {start}",
                *[f"{ind}  " + _combine(dw, t, f"vtc_dw_{LOW[dtype]}(mk[{t}], s + ({offs[t]}), {_low_fill(dw, dtype)})"
                                        if dtype in LOW
                                        else f"_mm512_mask_loadu_ps(fill, mk[{t}], s + ({offs[t]}))")
                  for t in range(taps)],
                f"{ind}  {end}",
                f"{ind}  _mm512_store_ps(tmp + c * 16, acc);",
                f"{ind}}}"]

    body = [f"    alignas(64) float tmp[{chunks * 16}];",
            *_cases(em, cases, leaves, emit, "    ", dtype),
            *(_flat_epilogue(k, em, total, n, "    ") or _epilogue(k, em, total, "0", str(oh), "    "))]
    return tables, body


def _flat_aligned(k: Kernel, em, dw: DepthwiseSum, total: Scalar, cases, leaves):
    """The flat form of a wide float32 depthwise convolution (``ALIGN_MIN_KW``): per 16 output positions and
    tap row, two loads of the input (unmasked where both lie inside the plane's memory), tap column b their
    concatenation shifted by b (``valignd``), added by an FMA masked to the lanes whose tap is inside the
    input; two accumulators (even / odd columns).  The old form's one masked load per tap cost more than the
    FMAs (5x5 over 384 planes of 28x28, alone: 263 -> 190 us, docs/gemm.md)."""
    (oh, ow), (h, w) = dw.out_hw, dw.in_hw
    kh, kw = dw.kernel
    (ph, pw), dh = dw.pad, dw.dil[0]
    n, size = oh * ow, h * w
    chunks = -(-n // 16)
    offs = [(a * dh - ph) * w - pw for a in range(kh)]  # tap (a, 0)'s offset from the output position
    tables = _mask_table("rmask", chunks * kh, [
        f"for (int64_t p = 0; p < {n}; ++p)  // lanes inside the plane whose tap row a is inside the input",
        f"  for (int64_t a = 0; a < {kh}; ++a)",
        f"    if (p / {ow} + a * {dh} - {ph} >= 0 && p / {ow} + a * {dh} - {ph} < {h}) "
        f"tab.m[p / 16 * {kh} + a] |= (__mmask16)(1u << (p % 16));"])
    tables += _mask_table("cmask", chunks * kw, [
        f"for (int64_t p = 0; p < {n}; ++p)  // ... whose tap column b is inside the input",
        f"  for (int64_t b = 0; b < {kw}; ++b)",
        f"    if (p % {ow} + b - {pw} >= 0 && p % {ow} + b - {pw} < {w}) "
        f"tab.m[p / 16 * {kw} + b] |= (__mmask16)(1u << (p % 16));"])
    offs_c = "{" + ", ".join(str(o) for o in offs) + "}"
    tables += _mask_table("lmask", chunks * kh * 2, [
        f"const int64_t off[{kh}] = {offs_c};",
        f"for (int64_t c = 0; c < {chunks}; ++c)  // the lanes of tap row a's two loads inside the plane's memory",
        f"  for (int64_t a = 0; a < {kh}; ++a)",
        "    for (int64_t l = 0; l < 32; ++l) {",
        "      const int64_t q = c * 16 + off[a] + l;",
        f"      if (q >= 0 && q < {size}) tab.m[(c * {kh} + a) * 2 + l / 16] |= (__mmask16)(1u << (l % 16));",
        "    }"])

    nacc = max(2, min(FLAT_ACCUMULATORS, kw)) if kw >= 5 else 2  # FMA chains: tap column b adds to acc b % nacc

    def emit(row: int, ind: str) -> list[str]:
        i2, i3 = ind + "  ", ind + "    "
        out = [f"{ind}for (int64_t c = 0; c < {chunks}; ++c) {{",
               f"{i2}const float* __restrict s = src + c * 16;",
               f"{i2}__m512 acc = bias" + "".join(f", acc{j} = _mm512_setzero_ps()" for j in range(1, nacc)) + ";"]
        if FLAT_COLUMN_MASKS:
            out.append(f"{i2}const __mmask16 " + ", ".join(f"cm{b} = cmask.m[c * {kw} + {b}]" for b in range(kw)) + ";")
        for a in range(kh):
            out += [f"{i2}if (const __mmask16 ra = rmask.m[c * {kh} + {a}]) {{",
                    f"{i3}const __mmask16 l0 = lmask.m[(c * {kh} + {a}) * 2], l1 = lmask.m[(c * {kh} + {a}) * 2 + 1];",
                    f"{i3}__m512 v0, v1;",
                    f"{i3}if ((__mmask16)(l0 & l1) == (__mmask16)0xFFFF) {{ v0 = _mm512_loadu_ps(s + ({offs[a]})); "
                    f"v1 = _mm512_loadu_ps(s + ({offs[a] + 16})); }}",
                    f"{i3}else {{ v0 = _mm512_maskz_loadu_ps(l0, s + ({offs[a]})); "
                    f"v1 = _mm512_maskz_loadu_ps(l1, s + ({offs[a] + 16})); }}"]
            if FLAT_COLUMN_MASKS:
                out.append(f"{i3}(void)ra;  // only skips the tap row: its lanes outside the input read 0")
            for b in range(kw):
                v = "v0" if b == 0 else (f"_mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(v1), "
                                         f"_mm512_castps_si512(v0), {b}))")
                acc = f"acc{b % nacc}" if b % nacc else "acc"
                mask = f"cm{b}" if FLAT_COLUMN_MASKS else f"ra & cmask.m[c * {kw} + {b}]"
                out.append(f"{i3}{acc} = _mm512_mask3_fmadd_ps(_mm512_set1_ps(wt[{a * kw + b}]), {v}, {acc}, {mask});")
            out.append(f"{i2}}}")
        sums = ["acc"] + [f"acc{j}" for j in range(1, nacc)]
        while len(sums) > 1:  # a tree of adds
            sums = [f"_mm512_add_ps({x}, {y})" for x, y in zip(sums[::2], sums[1::2])] + (
                [sums[-1]] if len(sums) % 2 else [])
        return out + [f"{i2}_mm512_store_ps(tmp + c * 16, {sums[0]});", f"{ind}}}"]

    body = [f"    alignas(64) float tmp[{chunks * 16}];",
            *_cases(em, cases, leaves, emit, "    "),
            *(_flat_epilogue(k, em, total, n, "    ") or _epilogue(k, em, total, "0", str(oh), "    "))]
    return tables, body


def _rows(k: Kernel, em, dw: DepthwiseSum, total: Scalar, cases, leaves, dtype=torch.float32):
    """Any stride and dilation: per output row, 16 columns at a time (masked loads, or gathers at stride > 1)."""
    (oh, ow), (h, w) = dw.out_hw, dw.in_hw
    kh, kw = dw.kernel
    (sh, sw), (ph, pw), (dh, dd) = dw.stride, dw.pad, dw.dil
    chunks = -(-ow // 16)
    start, end = _finish(dw)
    rows = max(1, BLOCK // ow)
    tables = _mask_table("cols", chunks * kw, [
        f"for (int64_t c = 0; c < {chunks}; ++c)",
        f"  for (int64_t b = 0; b < {kw}; ++b) {{  // lanes of column chunk c whose tap column b is inside the input",
        "    unsigned m = 0;",
        "    for (int l = 0; l < 16; ++l) {",
        f"      const int64_t x = c * 16 + l, ix = x * {sw} + b * {dd} - {pw};",
        f"      if (x < {ow} && ix >= 0 && ix < {w}) m |= 1u << l;",
        "    }",
        f"    tab.m[c * {kw} + b] = (__mmask16)m;",
        "  }"])
    if sw == 2:  # the same masks spread to every other bit: which lanes of two contiguous loads to read
        tables += _mask_table("wide", chunks * kw, [
            f"for (int64_t i = 0; i < {chunks * kw}; ++i)",
            "  for (int l = 0; l < 16; ++l) tab.m[i] |= ((cols.m[i] >> l) & 1u) << (2 * l);"],
            ctype="unsigned")

    def load(b: int) -> str:
        off = f"c * {16 * sw} + ({b * dd - pw})"
        if dtype in LOW:  # stride 1 or 2 (source)
            fill = _low_fill(dw, dtype)
            return (f"vtc_dw_{LOW[dtype]}(mk[{b}], rp + {off}, {fill})" if sw == 1 else
                    f"vtc_dw_even_{LOW[dtype]}(wide.m[c * {kw} + {b}], rp + {off}, {fill})")
        if sw == 1:
            return f"_mm512_mask_loadu_ps(fill, mk[{b}], rp + {off})"
        if sw == 2:
            return f"vtc_dw_even(fill, wide.m[c * {kw} + {b}], rp + {off})"
        return f"_mm512_mask_i32gather_ps(fill, mk[{b}], lanes, rp + {off}, 4)"

    span = min(w, (ow - 1) * sw + (kw - 1) * dd + 1)  # input elements an output row reads along a row

    def emit(row: int, ind: str) -> list[str]:
        out = [f"{ind}for (int64_t y = r0; y < r1; ++y) {{"]
        if PREFETCH_ROWS:  # the tap rows that output row y + PREFETCH_ROWS reads first (the others: rows before)
            out += [f"{ind}  for (int64_t a = {max(0, kh - sh)}; a < {kh}; ++a)",
                    f"{ind}    if (const int64_t iy = (y + {PREFETCH_ROWS}) * {sh} + a * {dh} - {ph}; iy >= 0 && iy < {h})",
                    f"{ind}      for (int64_t q = 0; q < {span}; q += 16) __builtin_prefetch(src + iy * {row} + q);"]
        out += [f"{ind}  for (int64_t c = 0; c < {chunks}; ++c) {{",
               f"{ind}    const __mmask16* mk = cols.m + c * {kw};",
               f"{ind}    {start}"]
        for a in range(kh):
            out += [f"{ind}    if (const int64_t iy = y * {sh} + ({a * dh - ph}); iy >= 0 && iy < {h}) {{",
                    f"{ind}      const {'uint16_t' if dtype in LOW else 'float'}* rp = src + iy * {row};",
                    *[f"{ind}      " + _combine(dw, a * kw + b, load(b)) for b in range(kw)],
                    f"{ind}    }}"]
        return out + [f"{ind}    {end}",
                      f"{ind}    const int64_t left = {ow} - c * 16;",
                      f"{ind}    _mm512_mask_storeu_ps(tmp + (y - r0) * {ow} + c * 16, "
                      f"(__mmask16)(left >= 16 ? 0xFFFFu : (1u << left) - 1u), acc);",
                      f"{ind}  }}",
                      f"{ind}}}"]

    body = [f"    alignas(64) float tmp[{rows * ow + 16}];"]
    if sw > 2:
        body.append(f"    const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, "
                    f"11, 12, 13, 14, 15), _mm512_set1_epi32({sw}));")
    body += [f"    for (int64_t r0 = 0; r0 < {oh}; r0 += {rows}) {{",
             f"      const int64_t r1 = std::min<int64_t>({oh}, r0 + {rows});",
             *_cases(em, cases, leaves, emit, "      ", dtype),
             *_epilogue(k, em, total, "r0", "r1", "      "),
             "    }"]
    return tables, body
