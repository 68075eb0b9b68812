"""Convolutions over small maps with a short reduction: output channels as the vector dimension.

The implicit GEMM of vtc.codegen.conv (``out[o, p] = sum_r W[o, r] * X[r, p]``)
has the output pixels as its vector dimension: on a 7x7 map the panel form
fills 49 of 64 columns (and pads the channels to its 12-row panels), the dot
form of vtc.codegen.conv_t pays a 16-lane fold per output that a short
reduction (ShuffleNetV2's 1x1 232 -> 232, 116 -> 116) does not amortise.  Here
the product is transposed, ``out^T[p, o] = sum_r X^T[p, r] W^T[r, o]``:

- the **output channels are the vectors**: 232 channels fill 240 lanes (15
  vectors), not 232 x 64/49 of a panel tile;
- the **pixels are broadcast rows**: a tile of ``ROWS`` pixels x ``VECS`` x 16
  channels keeps ROWS x VECS accumulators; per reduction step VECS loads of
  W^T and ROWS broadcasts of the im2col feed ROWS x VECS FMAs;
- **W^T packed once where the weight is a constant**: the call plan
  (vtc.runtime.callplan, vtc.runtime.packed.PackedConvWeight) packs it as
  ``packed_layout`` says ([vectors of 16 channels][K][16], zero past the last
  channel), packs it again when the weight's version counter moves (a
  parameter changed in place after vtc.compile is read by the next call), and
  passes it after the kernel's buffers with ``PACKED_FLAG`` set in the thread
  count.  Otherwise (a weight that is no constant, an inference tensor, the
  executor's step-by-step reference path ``run_step``, a size-generic kernel)
  the kernel packs **W^T per call, VECS x 16 channels at a time**
  (``vtc_cb_pack_w``: 16 x 16 register transposes) into a small per-thread
  buffer that all pixel tiles of those channels then read.  (A whole W^T per
  kernel packed per call, 222 KB for 232 -> 232, made each of ShuffleNet's
  stage-4 kernels' scratch miss L2 between calls: docs/gemm.md);
- the **im2col** is vtc.codegen.conv's ``Im2colPack`` (NR-pixel panels, packed
  by runs through the input's mapping: a channel shuffle, chunk or cat in front
  moves no data); a tile's pixel rows are pointers into them (a tile may
  straddle two panels);
- the tiles accumulate into a per-thread block ``ct^T`` (pixel-major), turned
  into the NCHW block ``ct`` by 16 x 16 register transposes; the epilogue (the
  kernel's stores: batch norm, activation, residual, pushes into a cat) is
  vtc.codegen.conv_t's, per output channel.

A thread's work is (image, block of output channels, a multiple of 16), the
blocks cut so that every thread gets work at batch 1.  ``why_not`` says where
a convolution runs this way (``FORM`` in its ``GemmChoice.path``, picked by
vtc.codegen.conv.choose_conv before the dot form): an AVX-512 target, one
group, at least 16 output channels, a plain row-major weight, and a small map:
up to ``MAX_PIXELS`` output pixels with a reduction shorter than conv_t's
``MIN_K``, up to conv_t's ``MAX_PIXELS`` with a longer one (``LONG_K``: there
it replaced the dot form, 20-30% faster).
"""
from __future__ import annotations

from vtc.codegen import conv_t

FORM = "conv_bcast"  # GemmChoice.path of a convolution computed here
ENABLED = True  # False: never taken (a switch for side-by-side timing; BCAST=0 in bench.conv_side_by_side)
MAX_PIXELS = 196  # output pixels per image up to which this form is taken with a short reduction (7x7 = 49 fills 49
#   of the panel form's 64 columns; 1 thread, kernel alone, load 4-6: 1x1 232 -> 232 on 7x7 0.057 vs 0.066 ms; on 14x14
#   (196 pixels in 224 columns) on Zen 5 116 -> 116 lost, 0.059 vs 0.057, 232 -> 232 gained ~5%; on Zen 4, 1 thread
#   CPU time, + ReLU, load 5-6, ms: 1x1 on 14x14 64 -> 64 0.023 vs 0.024, 96 0.044 / 0.047, 116 0.066 / 0.066,
#   128 0.072 / 0.079, 160 0.110 / 0.127, 232 0.219 / 0.278, 232 -> 464 0.462 / 0.528, 232 b16 3.87 / 4.30; 3x3
#   stride 2 28x28 -> 14x14 16 -> 32 0.034 / 0.046, 24 -> 48 0.060 / 0.068; 1x1 64 -> 64 on 16x16 lost, 0.030 / 0.028)
SMALL_PIXELS = 64  # up to this many output pixels any short reduction takes this form; on more (up to MAX_PIXELS) only
#   with a reduction of at least MID_K, and not a stride-1 "same" 3x3, which keeps conv_panels' taps (Zen 4, as
#   above: 24 -> 24 on 14x14 0.033 vs 0.027 ms, 20 -> 40 on 12x12 0.030 vs 0.028; on 6x6 and 7x7 this form is faster,
#   vtc/codegen/conv.py)
MID_K = 96  # (shorter ones tie or lose: 1x1 on 12x12 16 -> 16 0.006 vs 0.005 ms, 32 -> 16 and 48 -> 16 0.007 / 0.007,
#   16 -> 32 b16 0.048 / 0.048, on 14x14 64 -> 64 0.023 / 0.024)
LONG_K = True  # also a reduction of at least conv_t.MIN_K on maps of up to conv_t.MAX_PIXELS output pixels, where
#   the dot form ran before (1 thread CPU time, kernel + call alone, min us, load 4-5, dot / this form, W^T packed once:
#   1x1 464 -> 1024 on 7x7 254 / 198, same at batch 16 4297 / 3315, 1x1 512 -> 512 on 7x7 b16 2248 / 1783, 3x3 s2
#   256 -> 512 to 7x7 1199 / 823, 1x1 464 -> 1024 on 14x14 898 / 755, 3x3 s2 128 -> 256 to 14x14 939 / 742; a
#   stride-1 "same" 3x3 here too since session 20: on Zen 4 256 -> 256 on 7x7 0.60 ms vs conv_panels' taps 0.81)
MIN_CHANNELS = 16  # output channels at least (one vector)
ROWS = 7  # pixels per tile (at most 8) (7x7 and 14x14 maps are whole tiles; 8 left a 1-pixel tile on 7x7, ~5% of it)
VECS = 3  # vectors of 16 output channels per tile (at most 4) (ROWS x VECS = 21 accumulators)
BLOCK_VECS = 6  # vectors of output channels per unit of work at most (its ct block: P x 96 floats)
KC = 512  # reduction slice (the im2col slice, KC x P floats, stays in L2)
PACKED_FLAG = 1 << 30  # set in a call's nthreads: the pointer after the buffers is W^T packed once (packed_layout)


def packed_layout(w, offset: int, lda: int, m: int, k: int):
    """W^T of the weight rows ``W[o, q] = w.flatten()[offset + o * lda + q]`` (o < m, q < k), as the kernel reads
    it when the caller packs it: ``[ceil(m / 16), k, 16]`` float32 (a float16 weight widened), vector j's 16
    channels (zero past m) of row q at ``(j * k + q) * 16``."""
    import torch

    rows = w.as_strided((m, k), (lda, 1), w.storage_offset() + offset)
    nv = -(-m // 16)
    out = torch.zeros(nv * 16, k, dtype=torch.float32)
    out[:m] = rows
    return out.view(nv, 16, k).transpose(1, 2).contiguous()


def _constant(e) -> int | None:
    """The int value of offset expression e (an int or a constant Expr), or None."""
    if isinstance(e, int):
        return e
    return int(e.value) if getattr(e, "is_const", False) else None


def why_not(geo: dict, weight_ok: bool) -> str:
    """Why convolution `geo` (conv._geometry) does not run with the channels as vectors ("" when it does)."""
    p, k = geo["oh"] * geo["ow"], geo["cg"] * geo["kh"] * geo["kw"]
    if not ENABLED:
        return "the broadcast form is off (conv_bcast.ENABLED)"
    if not conv_t.has_avx512():
        return "the broadcast form is written for AVX-512"
    if geo["groups"] != 1:
        return f"{geo['groups']} groups: the broadcast form packs one weight"
    if k >= conv_t.MIN_K and not LONG_K:
        return f"a reduction of {k} >= {conv_t.MIN_K}: the dot form (conv_bcast.LONG_K is off)"
    if k < conv_t.MIN_K and p > MAX_PIXELS:
        return f"{geo['oh']}x{geo['ow']} = {p} output pixels > {MAX_PIXELS} with a short reduction ({k}): the " \
               f"panel form fills its columns"
    same = geo["stride"] == (1, 1) and (geo["kh"], geo["kw"]) != (1, 1) and geo["ow"] == geo["wd"]
    if k < conv_t.MIN_K and p > SMALL_PIXELS and same:
        return f"a stride-1 {geo['kh']}x{geo['kw']} \"same\" convolution on {geo['oh']}x{geo['ow']} = {p} output " \
               f"pixels > {SMALL_PIXELS} with a short reduction ({k}): conv_panels reads its im2col in place"
    if k < MID_K and p > SMALL_PIXELS:
        return f"a reduction of {k} < {MID_K} on {geo['oh']}x{geo['ow']} = {p} output pixels > {SMALL_PIXELS}: the " \
               f"panel form as fast"
    if p > conv_t.MAX_PIXELS:
        return f"{geo['oh']}x{geo['ow']} = {p} output pixels > {conv_t.MAX_PIXELS}: the panel form fills its columns"
    if geo["og"] < MIN_CHANNELS:
        return f"{geo['og']} output channels < {MIN_CHANNELS}"
    if not weight_ok:
        return "the weight is not one plain row-major load"
    return ""


RUNTIME = r"""
#ifndef VTC_CONV_BCAST_RUNTIME
#define VTC_CONV_BCAST_RUNTIME
// wt[q * ldt + i] = w[i * ldw + q] for q < k, i < rows (<= 16); 0 for rows <= i < 16: 16 output channels of the
// weight as a piece of W^T (a float16 weight widened)
template <typename T>
static inline void vtc_cb_pack_w(const T* __restrict w, int64_t ldw, int64_t rows, int64_t k,
                                 float* __restrict wt, int64_t ldt) {
#if defined(VTC_CONV_VECTOR)
  for (int64_t q0 = 0; q0 < k; q0 += 16) {
    const int64_t cols = k - q0 < 16 ? k - q0 : 16;
    const __mmask16 keep = (__mmask16)(cols >= 16 ? 0xFFFFu : (1u << cols) - 1u);
    __m512 r[16];
    #pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) r[i] = i < rows ? vtc_conv_load(keep, w + i * ldw + q0) : _mm512_setzero_ps();
    vtc_transpose16_regs(r);
    for (int i = 0; i < cols; ++i) _mm512_storeu_ps(wt + (q0 + i) * ldt, r[i]);
  }
#else
  for (int64_t q = 0; q < k; ++q)
    for (int64_t i = 0; i < 16; ++i) wt[q * ldt + i] = i < rows ? vtc_conv_elem(w[i * ldw + q]) : 0.0f;
#endif
}
#if defined(__AVX512F__)
// c[j * ldc + 16 v + l] (+)= sum_q X[q, p0 + j] * wt[v * vs + q * ldw + l] for j < R, v < V: R pixels of the
// im2col slice x (VTC_NR-pixel panels of kp rows; the R pixels may straddle two panels), broadcast, against V
// vectors of output channels of W^T
template <int R, int V>
static inline void vtc_cb_tile(int64_t kb, const float* __restrict x, int64_t kp, int64_t p0,
                               const float* __restrict wt, int64_t vs, int64_t ldw, float* __restrict c, int64_t ldc,
                               bool add) {
  const float* xr[R];
  #pragma GCC unroll 8
  for (int j = 0; j < R; ++j) xr[j] = x + ((p0 + j) / VTC_NR) * VTC_NR * kp + (p0 + j) % VTC_NR;
  __m512 s[R][V];
  #pragma GCC unroll 8
  for (int j = 0; j < R; ++j)
    #pragma GCC unroll 4
    for (int v = 0; v < V; ++v) s[j][v] = _mm512_setzero_ps();
  #pragma GCC unroll 2
  for (int64_t q = 0; q < kb; ++q) {
    __m512 wv[V];
    #pragma GCC unroll 4
    for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_ps(wt + v * vs + q * ldw);
    #pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      const __m512 b = _mm512_set1_ps(xr[j][q * VTC_NR]);
      #pragma GCC unroll 4
      for (int v = 0; v < V; ++v) s[j][v] = _mm512_fmadd_ps(b, wv[v], s[j][v]);
    }
  }
  #pragma GCC unroll 8
  for (int j = 0; j < R; ++j)
    #pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      float* cj = c + j * ldc + 16 * v;
      _mm512_storeu_ps(cj, add ? _mm512_add_ps(s[j][v], _mm512_loadu_ps(cj)) : s[j][v]);
    }
}
template <int V>
static inline void vtc_cb_cols(int64_t np, int64_t kb, const float* x, int64_t kp, const float* wt, int64_t vs,
                               int64_t ldw, float* c, int64_t ldc, bool add) {
  int64_t j = 0;
  for (; j + VTC_CB_ROWS <= np; j += VTC_CB_ROWS)
    vtc_cb_tile<VTC_CB_ROWS, V>(kb, x, kp, j, wt, vs, ldw, c + j * ldc, ldc, add);
  switch (np - j) {  // the last pixels (fewer than VTC_CB_ROWS <= 8)
    case 7: vtc_cb_tile<7, V>(kb, x, kp, j, wt, vs, ldw, c + j * ldc, ldc, add); break;
    case 6: vtc_cb_tile<6, V>(kb, x, kp, j, wt, vs, ldw, c + j * ldc, ldc, add); break;
    case 5: vtc_cb_tile<5, V>(kb, x, kp, j, wt, vs, ldw, c + j * ldc, ldc, add); break;
    case 4: vtc_cb_tile<4, V>(kb, x, kp, j, wt, vs, ldw, c + j * ldc, ldc, add); break;
    case 3: vtc_cb_tile<3, V>(kb, x, kp, j, wt, vs, ldw, c + j * ldc, ldc, add); break;
    case 2: vtc_cb_tile<2, V>(kb, x, kp, j, wt, vs, ldw, c + j * ldc, ldc, add); break;
    case 1: vtc_cb_tile<1, V>(kb, x, kp, j, wt, vs, ldw, c + j * ldc, ldc, add); break;
  }
}
#endif
// c[j * ldc + 16 v + l] (+)= sum_q X[q, j] * wt[v * vs + q * ldw + l] for j < np, v < nv: the im2col slice x
// (kb rows in VTC_NR-pixel panels, kp their row count) against nv vectors of W^T (vector v at wt + v * vs, its
// rows ldw apart), VTC_CB_VECS vectors at a time
__attribute__((noinline)) static void vtc_cb_block(int64_t nv, int64_t np, int64_t kb, const float* x, int64_t kp,
                                                   const float* wt, int64_t vs, int64_t ldw, float* c, int64_t ldc,
                                                   bool add) {
#if defined(__AVX512F__)
  int64_t v = 0;
  for (; v + VTC_CB_VECS <= nv; v += VTC_CB_VECS)
    vtc_cb_cols<VTC_CB_VECS>(np, kb, x, kp, wt + v * vs, vs, ldw, c + 16 * v, ldc, add);
  if (nv - v == 3) vtc_cb_cols<3>(np, kb, x, kp, wt + v * vs, vs, ldw, c + 16 * v, ldc, add);  // the last vectors
  if (nv - v == 2) vtc_cb_cols<2>(np, kb, x, kp, wt + v * vs, vs, ldw, c + 16 * v, ldc, add);
  if (nv - v == 1) vtc_cb_cols<1>(np, kb, x, kp, wt + v * vs, vs, ldw, c + 16 * v, ldc, add);
#else
  for (int64_t j = 0; j < np; ++j)
    for (int64_t o = 0; o < nv * 16; ++o) {
      float s = 0.0f;
      for (int64_t q = 0; q < kb; ++q)
        s += x[(j / VTC_NR) * VTC_NR * kp + q * VTC_NR + j % VTC_NR] * wt[(o / 16) * vs + q * ldw + o % 16];
      c[j * ldc + o] = (add ? c[j * ldc + o] : 0.0f) + s;
    }
#endif
}
// ct[o * ldt + j] = c[j * ldc + o] for o < nv * 16, j < np16 (a multiple of 16): the pixel-major block in NCHW
static inline void vtc_cb_transpose(const float* __restrict c, int64_t ldc, int64_t nv, int64_t np16,
                                    float* __restrict ct, int64_t ldt) {
  for (int64_t j0 = 0; j0 < np16; j0 += 16)
    for (int64_t o0 = 0; o0 < nv * 16; o0 += 16) {
#if defined(__AVX512F__)
      vtc_transpose16(c + j0 * ldc + o0, ldc, ct + o0 * ldt + j0, ldt);
#else
      for (int64_t j = 0; j < 16; ++j)
        for (int64_t o = 0; o < 16; ++o) ct[(o0 + o) * ldt + j0 + j] = c[(j0 + j) * ldc + o0 + o];
#endif
    }
}
#endif
"""


def runtime() -> str:
    """The C++ helpers of a broadcast-form kernel (tile sizes ROWS x VECS)."""
    return f"#define VTC_CB_ROWS {ROWS}\n#define VTC_CB_VECS {VECS}\n" + RUNTIME


def generate(k) -> str:
    """The C++ source of conv kernel k with the output channels as vectors (k.gemm: vtc.codegen.gemm.GemmOperands
    whose pack_b is the convolution's Im2colPack; k.stores: the epilogue at (i0 = image, i1 = output channel,
    i2 = output pixel)); the weight is ``k.gemm.a``, a plain row-major load at a constant offset
    (vtc.codegen.conv checks it)."""
    from vtc.codegen import gemm
    from vtc.codegen.cpp import OMP_TEAM, PRELUDE, _Emitter, buffer_order, buffer_pointers, storage_ctype
    from vtc.index.expr import free_vars
    from vtc.runtime.packed import WeightSpec

    g = k.gemm
    em = _Emitter(k)
    lines = buffer_pointers(k, em)
    weight = gemm._unwidened(g.a)  # the weight's load (float16: widened as W^T is packed)
    rows = conv_t.weight_rows(weight, em.shapes)
    if rows is None or free_vars(rows[1]):  # pragma: no cover - conv.conv_kernel checks the weight first
        raise AssertionError(f"{k.name}: the broadcast form needs a plain row-major weight at a constant offset")
    wbuf, wbase, lda = rows
    M, P, KK, B = g.m, g.n, g.k, g.batch
    offset = _constant(wbase)
    # what a caller may pack once (vtc.runtime.packed.PackedConvWeight) and pass after the buffers with
    # PACKED_FLAG set in nthreads; a size-generic kernel (sizes at bufs[nbufs]) is never called so
    g.packed_weight = WeightSpec(wbuf, offset, int(lda), int(M), int(KK)) if offset is not None else None
    nbufs = len(buffer_order(k))
    lines += [f"  const float* __restrict wtp = (nthreads & {PACKED_FLAG}) ? (const float*)bufs[{nbufs}] : nullptr;",
              f"  nthreads &= ~{PACKED_FLAG};"]
    flops = 2 * B * M * P * KK
    kc = -(-KK // -(-KK // KC))
    lines += [
        f"  const int64_t M = {M}, P = {P}, K = {KK}, BATCH = {B}, KCB = {kc};",
        "  const int64_t NV = (M + 15) / 16, NP16 = (P + 15) / 16 * 16;",
        "  const int64_t PANELS = (P + VTC_NR - 1) / VTC_NR * VTC_NR;",
        f"  const int nt = {flops}LL >= {gemm.PARALLEL_MIN_FLOPS}LL && nthreads > 1 ? nthreads : 1;",
        # blocks of output channels, whole vectors: at most BLOCK_VECS, a multiple of the thread count in all
        # where that needs more (one image on two threads: two blocks)
        f"  int64_t parts = (NV + {BLOCK_VECS} - 1) / {BLOCK_VECS};",
        "  if ((BATCH * parts) % nt) parts = std::min<int64_t>(NV, (parts + nt - 1) / nt * nt);",
        "  int64_t vb = (NV + parts - 1) / parts;",
        # whole tiles of VTC_CB_VECS vectors where that keeps the number of blocks (a 2-vector tail per block
        # of 5 costs 232 -> 232 on 7x7 ~10%) and gives no thread more vectors (one image of 116 channels on 2
        # threads: blocks of 6 and 2 vectors instead of 4 and 4, 14x14 ~8% slower at 2 threads)
        "  const int64_t vt = (vb + VTC_CB_VECS - 1) / VTC_CB_VECS * VTC_CB_VECS;",
        "  auto busiest = [&](int64_t b) {  // the most vectors one thread computes with blocks of b vectors",
        "    const int64_t p = (NV + b - 1) / b, u = BATCH * p;",
        "    int64_t most = 0;",
        "    for (int t = 0; t < nt; ++t) {",
        "      int64_t s = 0;",
        "      for (int64_t x = u * t / nt; x < u * (t + 1) / nt; ++x) s += std::min<int64_t>(b, NV - (x % p) * b);",
        "      most = std::max(most, s);",
        "    }",
        "    return most;",
        "  };",
        "  if ((NV + vt - 1) / vt == parts && busiest(vt) <= busiest(vb)) vb = vt;",
        "  parts = (NV + vb - 1) / vb;",
        "  const int64_t units = BATCH * parts;",
        f"  const {storage_ctype(weight.dtype)}* __restrict w = {em.ptr[wbuf]} + {em.index(wbase)};",
        *OMP_TEAM,
        "    float* __restrict wt = vtc_gemm_scratch(3, KCB * VTC_CB_VECS * 16);  // the W^T piece of a tile column",
        "    float* __restrict bp = vtc_gemm_scratch(4, KCB * (PANELS + 16) + vb * 16 * NP16);",
        "    float* __restrict ct = bp + KCB * (PANELS + 16);  // the NCHW block: vb * 16 rows of NP16",
        "    float* __restrict cp = vtc_gemm_scratch(5, NP16 * vb * 16);  // the pixel-major block",
        "    int64_t have = -1;  // the image and slice whose im2col is in bp (one slice: kept)",
        "    const int64_t u1 = units * (tid + 1) / nth;",
        "    for (int64_t u = units * tid / nth; u < u1; ++u) {",
        "      const int64_t i0 = u / parts, v0 = (u % parts) * vb, nv = std::min<int64_t>(vb, NV - v0);",
        "      const int64_t m0 = v0 * 16, mb = std::min<int64_t>(nv * 16, M - m0);",
        "      for (int64_t k0 = 0; k0 < K; k0 += KCB) {",
        "        const int64_t kb = std::min<int64_t>(KCB, K - k0);",
        "        if (have != i0 * K + k0) {",
        "          const int64_t n0 = 0, nb = P;",
    ]
    ind = "          "
    lines += g.pack_b(em, g, ind)  # in scope: i0, k0, kb, n0, nb, bp
    lines += [f"{ind}have = K <= KCB ? i0 * K + k0 : -1;",
              "        }",
              "        if (wtp != nullptr) {  // W^T packed once by the call plan: vector j at wtp + j * K * 16",
              "          vtc_cb_block(nv, P, kb, bp, kb, wtp + v0 * K * 16 + k0 * 16, K * 16, 16, cp, nv * 16,",
              "                       k0 > 0);",
              "        } else {",
              "        for (int64_t v = 0; v < nv; v += VTC_CB_VECS) {  // W^T of VTC_CB_VECS vectors of channels, then its tiles",
              "          const int64_t vv = std::min<int64_t>(VTC_CB_VECS, nv - v);",
              "          for (int64_t i = 0; i < vv; ++i)",
              f"            vtc_cb_pack_w(w + (m0 + 16 * (v + i)) * {lda} + k0, {lda}, "
              "std::min<int64_t>(16, M - m0 - 16 * (v + i)), kb, wt + 16 * i, vv * 16);",
              "          vtc_cb_block(vv, P, kb, bp, kb, wt, 16, vv * 16, cp + 16 * v, nv * 16, k0 > 0);",
              "        }",
              "        }",
              "      }",
              "      vtc_cb_transpose(cp, nv * 16, nv, NP16, ct, NP16);"]
    lines += conv_t._epilogue(em, k, "      ", ldc="NP16", cap=P)
    lines += ["    }", "  }"]
    head = PRELUDE + gemm.RUNTIME + g.runtime + runtime()
    return head + f'\nextern "C" void {k.name}(void* const* bufs, int nthreads) {{\n' + "\n".join(lines) + "\n}\n"
