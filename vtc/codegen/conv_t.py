"""Convolutions over small maps as dot products: output channels x pixels tiles, the weight read in place.

The implicit GEMM of vtc.codegen.conv (``out[o, p] = sum_r W[o, r] * X[r, p]``)
runs Goto's loops with the output pixels as the vector dimension: A = W is
packed into 12-row panels on every call (a 16 x 16 register transpose of the
whole weight, per image) and the pixels fill 32-column tiles.  On a small map
with many channels both hurt: ShuffleNetV2's last 1x1 convolution (464 ->
1024 on 7x7) fills 49 of 64 columns, and packing its 1.9 MB weight (each
element used for 49 pixels only) takes ~15% of the kernel's time.

Here the reduction is the vector dimension instead.  Both operands are read
along r: a weight row ``W[o, :]`` is contiguous already (read in place, never
packed), and the im2col is packed once per image and K slice, transposed, as
``xt[p][r]`` (vtc.codegen.conv's ``Im2colPack`` fills its NR-pixel panels by
runs, through the input's mapping: a channel shuffle, cat or pad in front moves
no data; 16 x 16 register transposes turn them into rows, P x K floats, small
next to the weight on such maps).  A tile of ``ROWS`` output channels x ``COLS``
pixels keeps one vector accumulator per output, 16 products of the reduction
per FMA (``vtc_ct_tile``); at the end four channels' 16 sums fold into one
vector by a transpose-and-add tree, lane ``4 c + j`` = output (channel c,
pixel j), so a channel's 4 pixels are one 128-bit store into the result, which
is already in the output's layout (NCHW: pixels contiguous).  The weight rows
of a tile stay in L1 while the transposed im2col streams past them.

Threads take contiguous ranges of (image x group, block of output channels)
units; each unit accumulates into its own scratch block, then the epilogue
(the kernel's stores: a fused batch norm / activation / residual, pushes into a
cat through its mapping) runs over the block as in vtc.codegen.gemm: per
output channel its invariant terms once, then a vector loop over the pixels.

``why_not`` says whether a convolution runs this way (``FORM`` in its
``GemmChoice.path``, chosen by vtc.codegen.conv.choose_conv): an AVX-512
target, a small map (at most ``MAX_PIXELS`` output pixels: the panel form
wastes columns and repacks the weight per image), a reduction of at least
``MIN_K`` (each output's 16 lane sums are folded once per slice: a short one
does not pay for that), and a weight that is one plain row-major load (a
physical weight; conv_kernel checks the load).  Float32 only, like the panel
form.
"""
from __future__ import annotations

import torch

from vtc.codegen.kernel_ir import acc_rounded
from vtc.index.expr import _terms, free_vars, lift
from vtc.index.mapping import linear_offset

FORM = "conv_dot"  # GemmChoice.path of a convolution computed here
MAX_PIXELS = 256  # output pixels per image up to which the dot form is taken (14x14 = 196, 7x7 = 49)
MIN_CHANNELS = 8  # output channels per group at least (a tile has ROWS of them)
ROWS = 6  # output channels per tile
COLS = 4  # pixels per tile (ROWS x COLS accumulators; at most 4)
XT_BYTES = 512 << 10  # the transposed im2col of a reduction slice (P x KC floats) at most this, in L2; a
#   slice of at least MIN_KC: each slice adds a reduction per output (3x3 256 -> 256 on 7x7, K = 2304, 1 thread:
#   0.96 ms in one slice, 1.28 ms in five of 461; the panel form 1.09)
MIN_KC = 512
MIN_K = 256  # reduction length at least this: a tile's 16-lane sums are folded once per output and slice
#   (1x1 116 -> 116 on 14x14: 0.131 ms vs the panel form's 0.092; 232 -> 232 on 7x7: a tie)
BLOCK = 64  # output channels per unit of work (a thread's scratch block: BLOCK x P floats)


def has_avx512() -> bool:
    """True when the generated code targets AVX-512 (torch's CPU capability says what the CPU runs)."""
    return "AVX512" in torch.backends.cpu.get_cpu_capability()


def weight_rows(s, shapes) -> tuple[str, object, int] | None:
    """(buffer, offset of the group's first row as an Expr of the batch index i0, row stride) when the
    weight scalar s of a conv kernel (``W[group * og + i1, r]``) is one load that walks r with unit stride
    and the output channel i1 with a constant stride (a float32 or float16 load); else None.  `shapes`: buffer name
    -> shape."""
    if s.op != "load" or s.dtype not in (torch.float32, torch.float16):
        return None
    buf, idx = s.args
    if buf not in shapes:
        return None
    c, terms = _terms(linear_offset(idx, tuple(shapes[buf])))
    base, lda, unit = lift(c), 0, False
    for atom, k in terms.items():
        if atom.op == "var" and atom.args[0] == "r":
            unit = k == 1
        elif atom.op == "var" and atom.args[0] == "i1":
            lda = k
        elif free_vars(atom) <= {"i0"}:
            base = base + atom * k
        else:
            return None
    return (buf, base, lda) if unit and lda > 0 else None


def why_not(geo: dict, weight_ok: bool) -> str:
    """Why convolution `geo` (conv._geometry) does not take the dot form ("" when it does)."""
    p = geo["oh"] * geo["ow"]
    if not has_avx512():
        return "the dot form is written for AVX-512"
    if p > MAX_PIXELS:
        return f"{geo['oh']}x{geo['ow']} = {p} output pixels > {MAX_PIXELS}: the panel form fills its columns"
    k = geo["cg"] * geo["kh"] * geo["kw"]
    if k < MIN_K:
        return f"a reduction of {k} < {MIN_K} (input channels x taps per group): the panel form"
    if geo["og"] < MIN_CHANNELS:
        return f"{geo['og']} output channels per group < {MIN_CHANNELS}"
    if not weight_ok:
        return "the weight is not one plain row-major load"
    return ""


# -- C++ ------------------------------------------------------------------------------------------
def runtime() -> str:
    """The C++ helpers of a dot-form kernel (tile sizes ROWS x COLS)."""
    return f"#define VTC_CT_ROWS {ROWS}\n#define VTC_CT_COLS {COLS}\n" + RUNTIME


RUNTIME = r"""
#ifndef VTC_CONV_T_RUNTIME
#define VTC_CONV_T_RUNTIME
// xt[p * kb + q] = bp[(p / VTC_NR) * VTC_NR * kb + q * VTC_NR + p % VTC_NR] for p < np (a multiple of 16), q < kb:
// the im2col's NR-pixel panels as rows of the reduction
static inline void vtc_ct_rows(const float* __restrict bp, int64_t np, int64_t kb, float* __restrict xt) {
  for (int64_t p0 = 0; p0 < np; p0 += 16) {
    const float* __restrict src = bp + (p0 / VTC_NR) * VTC_NR * kb + p0 % VTC_NR;
    int64_t q0 = 0;
#if defined(__AVX512F__)
    for (; q0 + 16 <= kb; q0 += 16) vtc_transpose16(src + q0 * VTC_NR, VTC_NR, xt + p0 * kb + q0, kb);
#endif
    for (int64_t p = 0; p < 16; ++p)
      for (int64_t q = q0; q < kb; ++q) xt[(p0 + p) * kb + q] = src[q * VTC_NR + p];
  }
}
#if defined(__AVX512F__)
// c[r * ldc + j] = (add ? c : 0) + sum_q w[r * ldw + q] * x[j * kb + q] for r < R, j < J <= 4
template <int R, int J>
static inline void vtc_ct_tile(int64_t kb, const float* __restrict w, int64_t ldw, const float* __restrict x,
                               float* __restrict c, int64_t ldc, bool add) {
  const int64_t kf = kb / 16 * 16;
  const __mmask16 tail = (__mmask16)((1u << (kb - kf)) - 1u);
  __m512 s[R][J];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int j = 0; j < J; ++j) s[r][j] = _mm512_setzero_ps();
  for (int64_t q = 0; q < kf; q += 16) {
    __m512 xv[J];
    #pragma GCC unroll 4
    for (int j = 0; j < J; ++j) xv[j] = _mm512_loadu_ps(x + j * kb + q);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(w + r * ldw + q);
      #pragma GCC unroll 4
      for (int j = 0; j < J; ++j) s[r][j] = _mm512_fmadd_ps(wv, xv[j], s[r][j]);
    }
  }
  if (tail) {
    __m512 xv[J];
    #pragma GCC unroll 4
    for (int j = 0; j < J; ++j) xv[j] = _mm512_maskz_loadu_ps(tail, x + j * kb + kf);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(tail, w + r * ldw + kf);
      #pragma GCC unroll 4
      for (int j = 0; j < J; ++j) s[r][j] = _mm512_fmadd_ps(wv, xv[j], s[r][j]);
    }
  }
  const __mmask8 cols = (__mmask8)((1u << J) - 1u);
  #pragma GCC unroll 2
  for (int r0 = 0; r0 < R; r0 += 4) {  // four channels' sums in one vector: lane 4 c + j
    __m512 v[16];
    #pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) v[i] = r0 + i / 4 < R && i % 4 < J ? s[r0 + i / 4][i % 4] : _mm512_setzero_ps();
    const __m512 sum = vtc_reduce16(v);
    #pragma GCC unroll 4
    for (int r = 0; r < 4 && r0 + r < R; ++r) {
      float* cr = c + (r0 + r) * ldc;
      __m128 y = _mm512_extractf32x4_ps(sum, r);
      if (add) y = _mm_add_ps(y, _mm_maskz_loadu_ps(cols, cr));
      _mm_mask_storeu_ps(cr, cols, y);
    }
  }
}
template <int R>
static inline void vtc_ct_rowblock(int64_t np, int64_t kb, const float* w, int64_t ldw, const float* x, float* c,
                                   int64_t ldc, bool add) {
  int64_t j = 0;
  for (; j + VTC_CT_COLS <= np; j += VTC_CT_COLS) vtc_ct_tile<R, VTC_CT_COLS>(kb, w, ldw, x + j * kb, c + j, ldc, add);
  switch (np - j) {
    case 3: vtc_ct_tile<R, 3>(kb, w, ldw, x + j * kb, c + j, ldc, add); break;
    case 2: vtc_ct_tile<R, 2>(kb, w, ldw, x + j * kb, c + j, ldc, add); break;
    case 1: vtc_ct_tile<R, 1>(kb, w, ldw, x + j * kb, c + j, ldc, add); break;
  }
}
#endif
// c[r * ldc + j] = (add ? c : 0) + sum_q w[r * ldw + q] * x[j * kb + q] for r < mb, j < np: mb weight rows
// (read in place) against np rows of the transposed im2col, VTC_CT_ROWS weight rows at a time
__attribute__((noinline)) static void vtc_ct_block(int64_t mb, int64_t np, int64_t kb, const float* w, int64_t ldw,
                                                   const float* x, float* c, int64_t ldc, bool add) {
#if defined(__AVX512F__)
  int64_t r = 0;
  for (; r + VTC_CT_ROWS <= mb; r += VTC_CT_ROWS) vtc_ct_rowblock<VTC_CT_ROWS>(np, kb, w + r * ldw, ldw, x, c + r * ldc, ldc, add);
  if (mb - r >= 4) { vtc_ct_rowblock<4>(np, kb, w + r * ldw, ldw, x, c + r * ldc, ldc, add); r += 4; }
  if (mb - r >= 2) { vtc_ct_rowblock<2>(np, kb, w + r * ldw, ldw, x, c + r * ldc, ldc, add); r += 2; }
  if (mb - r >= 1) vtc_ct_rowblock<1>(np, kb, w + r * ldw, ldw, x, c + r * ldc, ldc, add);
#else
  for (int64_t r = 0; r < mb; ++r)
    for (int64_t j = 0; j < np; ++j) {
      float s = 0.0f;
      for (int64_t q = 0; q < kb; ++q) s += w[r * ldw + q] * x[j * kb + q];
      c[r * ldc + j] = (add ? c[r * ldc + j] : 0.0f) + s;
    }
#endif
}
#endif
"""


def generate(k) -> str:
    """The C++ source of conv kernel k in the dot form (k.gemm: vtc.codegen.gemm.GemmOperands whose pack_b
    is the convolution's Im2colPack; k.stores: the epilogue, at (i0 = image x group, i1 = output channel of
    the group, i2 = output pixel))."""
    from vtc.codegen import gemm
    from vtc.codegen.cpp import OMP_TEAM, PRELUDE, _Emitter, buffer_pointers

    g = k.gemm
    em = _Emitter(k)
    lines = buffer_pointers(k, em)
    rows = weight_rows(g.a, em.shapes)
    if rows is None:  # pragma: no cover - conv.choose_conv takes the dot form only for such a weight
        raise AssertionError(f"{k.name}: the dot form needs a plain row-major weight")
    wbuf, wbase, lda = rows
    M, P, KK, B = g.m, g.n, g.k, g.batch
    flops = 2 * B * M * P * KK
    np16 = -(-P // 16) * 16
    slices = -(-KK // max(MIN_KC, XT_BYTES // (4 * np16)))
    kc = -(-KK // slices)
    lines += [
        f"  const int64_t M = {M}, P = {P}, K = {KK}, BATCH = {B}, KCT = {kc}, NP16 = {np16};",
        f"  const int nt = {flops}LL >= {gemm.PARALLEL_MIN_FLOPS}LL && nthreads > 1 ? nthreads : 1;",
        # blocks of output channels: at most BLOCK, a multiple of the thread count in all where that needs more
        f"  int64_t parts = (M + {BLOCK} - 1) / {BLOCK};",
        "  if ((BATCH * parts) % nt) parts = std::min<int64_t>(M, (parts + nt - 1) / nt * nt);",
        "  const int64_t mcb = (M + parts - 1) / parts;",
        "  parts = (M + mcb - 1) / mcb;",
        "  const int64_t units = BATCH * parts;",
        *OMP_TEAM,
        "    float* __restrict bp = vtc_gemm_scratch(3, KCT * ((P + VTC_NR - 1) / VTC_NR * VTC_NR + 16));",
        "    float* __restrict xt = vtc_gemm_scratch(4, KCT * NP16);",
        "    float* __restrict ct = vtc_gemm_scratch(5, mcb * P);",
        "    int64_t have = -1;  // the image x group and slice whose transposed im2col is in xt (one slice: kept)",
        "    const int64_t u1 = units * (tid + 1) / nth;",
        "    for (int64_t u = units * tid / nth; u < u1; ++u) {",
        "      const int64_t i0 = u / parts, m0 = (u % parts) * mcb, mb = std::min<int64_t>(mcb, M - m0);",
        f"      const float* __restrict wrow = {em.ptr[wbuf]} + {em.index(wbase)} + m0 * {lda};",
        "      for (int64_t k0 = 0; k0 < K; k0 += KCT) {",
        "        const int64_t kb = std::min<int64_t>(KCT, K - k0);",
        "        if (have != i0 * K + k0) {",
        "          const int64_t n0 = 0, nb = P;",
    ]
    ind = "          "
    lines += g.pack_b(em, g, ind)  # in scope: i0, k0, kb, n0, nb, bp
    lines += [f"{ind}vtc_ct_rows(bp, NP16, kb, xt);",
              f"{ind}have = K <= KCT ? i0 * K + k0 : -1;",
              "        }",
              f"        vtc_ct_block(mb, P, kb, wrow + k0, {lda}, xt, ct, P, k0 > 0);",
              "      }"]
    lines += _epilogue(em, k, "      ")
    lines += ["    }", "  }"]
    head = PRELUDE + gemm.RUNTIME + g.runtime + runtime()
    return head + f'\nextern "C" void {k.name}(void* const* bufs, int nthreads) {{\n' + "\n".join(lines) + "\n}\n"


def _epilogue(em, k, ind: str, ldc: str = "P", first: str = "", count: str = "P", cap: int | None = None) -> list[str]:
    """Every store of kernel k over the finished block ct[mb x count] (rows `ldc` floats apart): its value of acc
    at (i0, m0 + ii, first + jj), where its predicate holds; per output channel the terms that do not change
    along the pixels once.  (`first`, C for the block's first pixel: "" for pixel 0.)

    A float16 result: where every value reads acc rounded to float16 (the convolution's own result, as eager rounds
    it before a batch norm or activation), each row of ct is rounded in place first (vecmath's ``vtc_round_f16_n``,
    vector conversions) and the values read it as it is; and one store whose elements are consecutive along the
    pixels, without a predicate, computes its row in float32 (up to `cap` elements, a bound on `count`) and narrows
    it as a row (``vtc_to_f16_n``): two float16 conversions per element fewer in the loop, where vecmath's vector
    ones are calls."""
    from vtc.codegen.cpp import ctype
    from vtc.codegen.gemm import ACC

    em.forget()
    values = [st.value for st in k.stores]
    half = any(st.buffer.dtype == torch.float16 for st in k.stores)
    rounded = acc_rounded(values) if half else None
    values = rounded or values
    row = half and isinstance(cap, int) and cap <= MAX_ROW and len(k.stores) == 1 and _along_pixels(em, k.stores[0])
    inner = ind + "    "
    lines = [f"{ind}for (int64_t ii = 0; ii < mb; ++ii) {{", f"{ind}  const int64_t i1 = m0 + ii;"]
    if rounded:
        lines += [f"{ind}  vtc_round_f16_n(ct + ii * {ldc}, {count});"]
    lines += em.hoist_invariant(values, {"i2"}, ind + "  ")
    temps = em.hoist(values, inner)
    body = []
    for st, v in zip(k.stores, values):
        if row:
            body.append(f"{inner}vtc_row[jj] = {em.temps.get(id(v)) or em.unrounded(v)};")  # (as em.stored)
            continue
        value = (em.stored(v, st.buffer.dtype) if st.buffer.dtype == torch.float16  # rounded once
                 else f"({ctype(st.buffer.dtype)})({em.scalar(v)})")
        store = f"{em.ptr[st.buffer.name]}[{em.linear(st.buffer.name, st.index)}] = {value};"
        body.append(f"{inner}{store}" if st.when is None else f"{inner}if ({em.index(st.when)}) {store}")
    if row:
        st = k.stores[0]
        lines += [f"{ind}  alignas(64) float vtc_row[{cap}];"]
    lines += [f"{ind}  #pragma omp simd",
              f"{ind}  for (int64_t jj = 0; jj < {count}; ++jj) {{",
              f"{inner}const int64_t i2 = {first + ' + ' if first else ''}jj;",
              f"{inner}const float acc_{ACC} = ct[ii * {ldc} + jj];",
              *temps, *body,
              f"{ind}  }}"]
    if row:
        lines += [f"{ind}  {{ const int64_t i2 = {first or '0'}; "
                  f"vtc_to_f16_n(&{em.ptr[st.buffer.name]}[{em.linear(st.buffer.name, st.index)}], vtc_row, {count}); }}"]
    return lines + [f"{ind}}}"]


MAX_ROW = 4096  # elements of a float16 epilogue's float32 row at most (on the stack)


def _along_pixels(em, st) -> bool:
    """True where float16 store `st` has no predicate and its elements are consecutive along the pixel index i2."""
    if st.buffer.dtype != torch.float16 or st.when is not None:
        return False
    _, terms = _terms(linear_offset(st.index, st.buffer.shape))
    along = [(atom, c) for atom, c in terms.items() if "i2" in free_vars(atom)]
    return len(along) == 1 and along[0][0].op == "var" and along[0][1] == 1
