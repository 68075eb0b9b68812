"""Winograd F(2x2, 3x3) for small float32 3x3 "same" convolutions (C3k2's bottlenecks: 32 -> 32 on 40x40).

On Zen 5 the implicit GEMM of a 3x3 32 -> 32 convolution on 40x40 (vtc.codegen.conv_panels' conv_taps path)
runs at ~230-250 GFLOP/s, close to the FMA rate: only fewer multiplications make it faster.  F(2x2, 3x3)
computes each 2x2 block of output pixels from a 4x4 block of input with 16 products per (input, output
channel) pair instead of 36 (2.25x fewer): per image, cut into sub-bands of ``SB`` rows of 2x2 tiles,

1. the input rows of the sub-band (with the one-pixel halo and the zero padding) transposed into a
   pixel-major scratch ``xp[row][col][C]`` (16 x 16 register transposes, lanes outside the input masked);
2. the input transform ``V[xi][tile][C] = (B^T d B)[xi]`` per tile, vectorised over 16 channels;
3. 16 small GEMMs ``Mx[xi][tile][M] = V[xi] U[xi]`` (K = C; 12 tiles x 32 output channels per micro-kernel,
   the tiles padded to a multiple of 12, the padding's products never read);
4. the output transform ``Y = A^T Mx A`` (pixel-major), transposed into an NCHW block ``ct`` of the
   sub-band's output rows, on which the kernel's epilogue (batch norm, SiLU, a residual, pushes into a cat:
   every store of the kernel) runs as in vtc.codegen.conv_t.

The weight transform ``U[xi][c][o] = (G w[o, c] G^T)[xi]`` is made per call and thread (16 x C x M floats;
making it once per weight version instead measured no change at 32 x 32, docs/gemm.md).  F(4x4, 3x3) (4x fewer products) was dropped: on random inputs of the tests'
magnitudes its float32 error against a float64 convolution reached 1.55x the convolution tests' tolerance
(rtol = atol = 1e-4) where F(2x2, 3x3)'s stays at 0.14x of it (docs/gemm.md, session 17).

``why_not`` says where it runs (``FORM`` in the report's ``GemmChoice.path``): an AVX-512 target, one group,
a 3x3 kernel at stride 1, dilation 1, padding 1 (output as large as the input), input and output channels
multiples of 16 up to ``MAX_CHANNELS``, at least ``MIN_SIDE`` output rows and columns, a plain row-major
weight and an input that is one plain load (vtc.codegen.conv.Im2colPack.direct, as the conv_taps path needs).
"""
from __future__ import annotations

from vtc.codegen import conv_t

FORM = "winograd"  # GemmChoice.path of a convolution computed here
ENABLED = True  # False: never taken (a switch for side-by-side timing)
MAX_CHANNELS = 256  # input and output channels at most (measured 16..64: 0.62-0.90x of conv_taps; on Zen 4, 1 thread,
#   + ReLU: 128 -> 128 0.61-0.68x of conv_taps at 14x14 and 20x20, 256 -> 256 0.75-0.78x at 14x14 and 16x16; 512 -> 512
#   on 7x7 2.8x slower: U is 16 MB)
MIN_SIDE = 14  # output rows and columns at least (measured down to 16x16: 0.79x of conv_taps there; on Zen 4 14x14:
#   16 -> 16 0.86x, 32 -> 32 0.69x, 64 -> 64 0.64x, 128 -> 128 0.68x, 256 -> 256 0.75x; 7x7 1.05-1.37x slower; a map a few
#               pixels high would compute half its tiles' rows for nothing, and small maps have conv_bcast / conv_t)
TILE_ROWS = 12  # tiles per GEMM micro-kernel (x 2 vectors of output channels: 24 accumulators)
BAND_TILES = 64  # tiles per sub-band at most (V and Mx of 16 x 64 x 32 floats: 128 KB each, in L2; 1 thread, kernel
#   alone, 3x3 32 -> 32 40x40 + BN + SiLU, medians: 24 111.1 us, 40 110.1, 60 100.5, 64 101.0, 96 101.8, 128 103.4-104.2,
#   240 109.6; batch 16 64 vs 128: 1593 vs 1600 us)


def why_not(geo: dict, weight_ok: bool) -> str:
    """Why convolution `geo` (conv._geometry) does not run as Winograd F(2x2, 3x3) ("" when it does)."""
    if not ENABLED:
        return "Winograd is off (winograd.ENABLED)"
    if not conv_t.has_avx512():
        return "the Winograd form is written for AVX-512"
    if geo["groups"] != 1:
        return f"{geo['groups']} groups"
    if (geo["kh"], geo["kw"], geo["stride"], geo["dil"], geo["pad"]) != (3, 3, (1, 1), (1, 1), (1, 1)):
        return "not a 3x3 convolution at stride 1, dilation 1, padding 1"
    if (geo["oh"], geo["ow"]) != (geo["h"], geo["wd"]):
        return "the output is not as large as the input"
    for what, c in (("input", geo["cg"]), ("output", geo["og"])):
        if c % 16 or c > MAX_CHANNELS:
            return f"{c} {what} channels: not a multiple of 16 up to {MAX_CHANNELS}"
    if min(geo["oh"], geo["ow"]) < MIN_SIDE:
        return f"{geo['oh']}x{geo['ow']} output pixels: fewer than {MIN_SIDE} rows or columns"
    if not weight_ok:
        return "the weight is not one plain row-major load"
    return ""


def band_rows(tw: int, th: int) -> int:
    """Tile rows per sub-band for tw tiles per row and th tile rows: the most that keep a band within
    BAND_TILES tiles, preferring (among at least half that many) the least padding to TILE_ROWS tiles."""
    def waste(s: int) -> float:  # the fraction of a band's tiles that pad it to whole micro-kernels
        return (-(s * tw) % TILE_ROWS) / (s * tw)

    top = max(1, min(th, BAND_TILES // tw))
    best = top
    for sb in range(top, max(1, top // 2) - 1, -1):
        if waste(sb) < waste(best) - 1e-9:
            best = sb
    return best


RUNTIME = r"""
#ifndef VTC_WINOGRAD_RUNTIME
#define VTC_WINOGRAD_RUNTIME
// 16 floats as one value: an AVX-512 vector, or a plain array where the target has none
#if defined(__AVX512F__)
typedef __m512 vtc_wv;
static inline vtc_wv vtc_wv_ld(const float* p) { return _mm512_loadu_ps(p); }
static inline void vtc_wv_st(float* p, vtc_wv v) { _mm512_storeu_ps(p, v); }
static inline vtc_wv vtc_wv_add(vtc_wv a, vtc_wv b) { return _mm512_add_ps(a, b); }
static inline vtc_wv vtc_wv_sub(vtc_wv a, vtc_wv b) { return _mm512_sub_ps(a, b); }
static inline vtc_wv vtc_wv_half(vtc_wv a) { return _mm512_mul_ps(a, _mm512_set1_ps(0.5f)); }
#else
struct vtc_wv { float f[16]; };
static inline vtc_wv vtc_wv_ld(const float* p) { vtc_wv v; for (int l = 0; l < 16; ++l) v.f[l] = p[l]; return v; }
static inline void vtc_wv_st(float* p, vtc_wv v) { for (int l = 0; l < 16; ++l) p[l] = v.f[l]; }
static inline vtc_wv vtc_wv_add(vtc_wv a, vtc_wv b) { for (int l = 0; l < 16; ++l) a.f[l] += b.f[l]; return a; }
static inline vtc_wv vtc_wv_sub(vtc_wv a, vtc_wv b) { for (int l = 0; l < 16; ++l) a.f[l] -= b.f[l]; return a; }
static inline vtc_wv vtc_wv_half(vtc_wv a) { for (int l = 0; l < 16; ++l) a.f[l] *= 0.5f; return a; }
#endif

// U[(xi * C + c) * M + o] = (G w[o, c] G^T)[xi], xi = 4 i + j, w[o, c] the 3x3 taps at w + o * ldw + c * 9
static void vtc_wg_weights(const float* __restrict w, int64_t ldw, int64_t C, int64_t M, float* __restrict U) {
  for (int64_t c = 0; c < C; ++c)
    for (int64_t o0 = 0; o0 < M; o0 += 16) {
      vtc_wv g[9], t[4][3];
#if defined(__AVX512F__)
      const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32((int)ldw));
      for (int q = 0; q < 9; ++q) g[q] = _mm512_i32gather_ps(idx, w + o0 * ldw + c * 9 + q, 4);
#else
      for (int q = 0; q < 9; ++q) for (int l = 0; l < 16; ++l) g[q].f[l] = w[(o0 + l) * ldw + c * 9 + q];
#endif
      for (int b = 0; b < 3; ++b) {  // G g: down the kernel's columns
        const vtc_wv s = vtc_wv_add(g[b], g[6 + b]);
        t[0][b] = g[b];
        t[1][b] = vtc_wv_half(vtc_wv_add(s, g[3 + b]));
        t[2][b] = vtc_wv_half(vtc_wv_sub(s, g[3 + b]));
        t[3][b] = g[6 + b];
      }
      for (int i = 0; i < 4; ++i) {  // (G g) G^T: along the rows
        const vtc_wv s = vtc_wv_add(t[i][0], t[i][2]);
        float* u = U + c * M + o0;
        vtc_wv_st(u + (4 * i + 0) * C * M, t[i][0]);
        vtc_wv_st(u + (4 * i + 1) * C * M, vtc_wv_half(vtc_wv_add(s, t[i][1])));
        vtc_wv_st(u + (4 * i + 2) * C * M, vtc_wv_half(vtc_wv_sub(s, t[i][1])));
        vtc_wv_st(u + (4 * i + 3) * C * M, t[i][2]);
      }
    }
}

// xp[(rr * XW + j) * C + c] = x[c, iy0 + rr, j - 1] for rr < rows, j < XW, 0 outside the input: the sub-band's
// input rows with their halo, pixel-major (x: channel planes hw apart, rows W apart).  16 pixels past each row
// may be written (into the next row, written after, or the scratch's slack).
static void vtc_wg_input(const float* x, int64_t hw, int64_t C, int64_t H, int64_t W, int64_t iy0, int64_t rows,
                         int64_t XW, float* __restrict xp) {
  for (int64_t rr = 0; rr < rows; ++rr) {
    const int64_t ih = iy0 + rr;
    const bool inside = ih >= 0 && ih < H;
    for (int64_t j0 = 0; j0 < XW; j0 += 16) {
      const int64_t iw0 = j0 - 1;
      float* dst = xp + (rr * XW + j0) * C;
#if defined(__AVX512F__)
      uint32_t bits = 0;
      if (inside)
        for (int l = 0; l < 16; ++l) bits |= (uint32_t)(iw0 + l >= 0 && iw0 + l < W) << l;
      const __mmask16 m = (__mmask16)bits;
      for (int64_t c0 = 0; c0 < C; c0 += 16) {
        __m512 r[16];
        if (m) {
          const float* src = x + c0 * hw + ih * W + iw0;
          for (int l = 0; l < 16; ++l) r[l] = _mm512_maskz_loadu_ps(m, src + l * hw);
          vtc_transpose16_regs(r);
        } else {
          for (int l = 0; l < 16; ++l) r[l] = _mm512_setzero_ps();
        }
        for (int p = 0; p < 16; ++p) _mm512_storeu_ps(dst + p * C + c0, r[p]);
      }
#else
      for (int64_t p = 0; p < 16; ++p)
        for (int64_t c = 0; c < C; ++c) {
          const int64_t iw = iw0 + p;
          dst[p * C + c] = inside && iw >= 0 && iw < W ? x[c * hw + ih * W + iw] : 0.0f;
        }
#endif
    }
  }
}

// V[(xi * ldv + t) * C + c] = (B^T d B)[xi] for tile t = ty * TW + tx (ty < nrows), d its 4 x 4 input pixels
static void vtc_wg_transform_in(const float* __restrict xp, int64_t XW, int64_t C, int64_t nrows, int64_t TW,
                                float* __restrict V, int64_t ldv) {
  for (int64_t ty = 0; ty < nrows; ++ty)
    for (int64_t tx = 0; tx < TW; ++tx)
      for (int64_t c0 = 0; c0 < C; c0 += 16) {
        const float* base = xp + (2 * ty * XW + 2 * tx) * C + c0;
        vtc_wv d[4][4], t[4][4];
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < 4; ++b) d[a][b] = vtc_wv_ld(base + (a * XW + b) * C);
        for (int b = 0; b < 4; ++b) {  // B^T d
          t[0][b] = vtc_wv_sub(d[0][b], d[2][b]);
          t[1][b] = vtc_wv_add(d[1][b], d[2][b]);
          t[2][b] = vtc_wv_sub(d[2][b], d[1][b]);
          t[3][b] = vtc_wv_sub(d[1][b], d[3][b]);
        }
        float* v = V + (ty * TW + tx) * C + c0;
        const int64_t s = ldv * C;
        for (int i = 0; i < 4; ++i) {  // (B^T d) B
          vtc_wv_st(v + (4 * i + 0) * s, vtc_wv_sub(t[i][0], t[i][2]));
          vtc_wv_st(v + (4 * i + 1) * s, vtc_wv_add(t[i][1], t[i][2]));
          vtc_wv_st(v + (4 * i + 2) * s, vtc_wv_sub(t[i][2], t[i][1]));
          vtc_wv_st(v + (4 * i + 3) * s, vtc_wv_sub(t[i][1], t[i][3]));
        }
      }
}

#if defined(__AVX512F__)
// m[r * M + 16 j + l] = sum_c v[r * C + c] u[c * M + 16 j + l] for r < R, j < OV
template <int R, int OV>
static inline void vtc_wg_ukr(int64_t C, int64_t M, const float* __restrict v, const float* __restrict u,
                              float* __restrict m) {
  __m512 acc[R][OV];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < OV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512 uu[OV];
    for (int j = 0; j < OV; ++j) uu[j] = _mm512_loadu_ps(u + c * M + 16 * j);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(v[r * C + c]);
      for (int j = 0; j < OV; ++j) acc[r][j] = _mm512_fmadd_ps(b, uu[j], acc[r][j]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < OV; ++j) _mm512_storeu_ps(m + r * M + 16 * j, acc[r][j]);
}
#endif

// Mx[(xi * ld + t) * M + o] = sum_c V[(xi * ld + t) * C + c] U[(xi * C + c) * M + o] for t < ntl rounded up to
// VTC_WG_ROWS (ld is at least that)
static void vtc_wg_gemm(const float* __restrict V, const float* __restrict U, int64_t C, int64_t M, int64_t ntl,
                        int64_t ld, float* __restrict Mx) {
  for (int xi = 0; xi < 16; ++xi) {
    const float* v = V + xi * ld * C;
    const float* u = U + xi * C * M;
    float* mx = Mx + xi * ld * M;
    for (int64_t t0 = 0; t0 < ntl; t0 += VTC_WG_ROWS) {
#if defined(__AVX512F__)
      int64_t o0 = 0;
      for (; o0 + 32 <= M; o0 += 32) vtc_wg_ukr<VTC_WG_ROWS, 2>(C, M, v + t0 * C, u + o0, mx + t0 * M + o0);
      if (o0 < M) vtc_wg_ukr<VTC_WG_ROWS, 1>(C, M, v + t0 * C, u + o0, mx + t0 * M + o0);
#else
      for (int64_t r = t0; r < t0 + VTC_WG_ROWS; ++r)
        for (int64_t o = 0; o < M; ++o) {
          float s = 0.0f;
          for (int64_t c = 0; c < C; ++c) s += v[r * C + c] * u[c * M + o];
          mx[r * M + o] = s;
        }
#endif
    }
  }
}

// Y[((2 ty + i) * YW + 2 tx + j) * M + o] = (A^T m A)[i][j] for the tiles of nrows rows, m their 16 products
static void vtc_wg_transform_out(const float* __restrict Mx, int64_t ld, int64_t M, int64_t nrows, int64_t TW,
                                 float* __restrict Y, int64_t YW) {
  for (int64_t ty = 0; ty < nrows; ++ty)
    for (int64_t tx = 0; tx < TW; ++tx)
      for (int64_t o0 = 0; o0 < M; o0 += 16) {
        const float* mp = Mx + (ty * TW + tx) * M + o0;
        vtc_wv m[4][4], s[2][4];
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < 4; ++b) m[a][b] = vtc_wv_ld(mp + (4 * a + b) * ld * M);
        for (int b = 0; b < 4; ++b) {  // A^T m
          const vtc_wv p = vtc_wv_add(m[1][b], m[2][b]), q = vtc_wv_sub(m[1][b], m[2][b]);
          s[0][b] = vtc_wv_add(m[0][b], p);
          s[1][b] = vtc_wv_sub(q, m[3][b]);
        }
        float* y = Y + (2 * ty * YW + 2 * tx) * M + o0;
        for (int i = 0; i < 2; ++i) {  // (A^T m) A
          const vtc_wv p = vtc_wv_add(s[i][1], s[i][2]), q = vtc_wv_sub(s[i][1], s[i][2]);
          vtc_wv_st(y + (i * YW) * M, vtc_wv_add(s[i][0], p));
          vtc_wv_st(y + (i * YW + 1) * M, vtc_wv_sub(q, s[i][3]));
        }
      }
}

// ct[o * ldt + yy * W + x] = Y[(yy * YW + x) * M + o] for yy < ny, x < W: the pixel-major rows as channel planes
// (Y is read up to 16 pixels past a row's W: into the next row or the scratch's slack)
static void vtc_wg_to_planes(const float* __restrict Y, int64_t YW, int64_t M, int64_t ny, int64_t W,
                             float* __restrict ct, int64_t ldt) {
  for (int64_t yy = 0; yy < ny; ++yy)
    for (int64_t x0 = 0; x0 < W; x0 += 16) {
#if defined(__AVX512F__)
      const __mmask16 keep = (__mmask16)(W - x0 >= 16 ? 0xFFFFu : (1u << (W - x0)) - 1u);
      for (int64_t o0 = 0; o0 < M; o0 += 16) {
        __m512 r[16];
        for (int p = 0; p < 16; ++p) r[p] = _mm512_loadu_ps(Y + (yy * YW + x0 + p) * M + o0);
        vtc_transpose16_regs(r);
        for (int l = 0; l < 16; ++l) _mm512_mask_storeu_ps(ct + (o0 + l) * ldt + yy * W + x0, keep, r[l]);
      }
#else
      for (int64_t x = x0; x < std::min<int64_t>(W, x0 + 16); ++x)
        for (int64_t o = 0; o < M; ++o) ct[o * ldt + yy * W + x] = Y[(yy * YW + x) * M + o];
#endif
    }
}
#endif
"""


def generate(k) -> str:
    """The C++ source of conv kernel k as Winograd F(2x2, 3x3) (k.gemm: vtc.codegen.gemm.GemmOperands whose
    pack_b is the convolution's Im2colPack with ``taps`` set (the input one plain load); k.stores: the epilogue
    at (i0 = image, i1 = output channel, i2 = output pixel)); the weight ``k.gemm.a`` is a plain row-major load
    at a constant offset (vtc.codegen.conv checks both)."""
    from vtc.codegen import gemm
    from vtc.codegen.cpp import OMP_TEAM, PRELUDE, _Emitter, buffer_pointers
    from vtc.index.expr import free_vars

    g = k.gemm
    em = _Emitter(k)
    lines = buffer_pointers(k, em)
    pack = g.pack_b.__self__
    rows = conv_t.weight_rows(g.a, em.shapes)
    if rows is None or free_vars(rows[1]) or pack.taps is None:  # pragma: no cover - conv.conv_kernel checks
        raise AssertionError(f"{k.name}: Winograd needs a plain row-major weight and a plain input")
    wbuf, wbase, lda = rows
    geo = pack.geo
    C, M, H, W, B = geo["cg"], geo["og"], geo["h"], geo["wd"], g.batch
    th, tw = -(-H // 2), -(-W // 2)
    sb = band_rows(tw, th)
    ld = -(-sb * tw // TILE_ROWS) * TILE_ROWS  # tiles of a sub-band, padded to whole micro-kernels
    run = pack._plain_run(em, pack.taps[0])  # the input at (channel r / 9, row cv_ih, column cv_iw)
    flops = 2 * B * M * H * W * C * 9
    lines += [
        f"  const int64_t C = {C}, M = {M}, H = {H}, W = {W}, BATCH = {B}, TH = {th}, TW = {tw}, SB = {sb};",
        f"  const int64_t LD = {ld}, XW = 2 * TW + 2, YW = 2 * TW, LDT = 2 * SB * W;",
        f"  const int nt = {flops}LL >= {gemm.PARALLEL_MIN_FLOPS}LL && nthreads > 1 ? nthreads : 1;",
        # one image per unit where the images share out evenly, else each image's tile rows cut per thread
        "  const int64_t split = BATCH % nt == 0 ? 1 : nt, units = BATCH * split;",
        f"  const float* __restrict wgt = {em.ptr[wbuf]} + {em.index(wbase)};",
        *OMP_TEAM,
        "    float* __restrict U = vtc_gemm_scratch(0, 16 * C * M);",
        "    float* __restrict xp = vtc_gemm_scratch(1, (2 * SB + 2) * XW * C + 16 * C);",
        "    float* __restrict V = vtc_gemm_scratch(2, 16 * LD * C);",
        "    float* __restrict Mx = vtc_gemm_scratch(3, 16 * LD * M);",
        "    float* __restrict Y = vtc_gemm_scratch(4, 2 * SB * YW * M + 16 * M);",
        "    float* __restrict ct = vtc_gemm_scratch(5, M * LDT);",
        f"    vtc_wg_weights(wgt, {lda}, C, M, U);",
        "    const int64_t u1 = units * (tid + 1) / nth;",
        "    for (int64_t u = units * tid / nth; u < u1; ++u) {",
        "      const int64_t i0 = u / split, part = u % split;",
        "      const float* xr;  // the image's input, channel 0, pixel (0, 0)",
        "      int64_t hw;  // from one input channel to the next",
        f"      {{ const int64_t cv_ih = 0, cv_iw = 0; int64_t r = 0; xr = {run}; r = 9; hw = ({run}) - xr; }}",
        "      for (int64_t s0 = TH * part / split, s1e = TH * (part + 1) / split; s0 < s1e; s0 += SB) {",
        "        const int64_t nrows = std::min<int64_t>(SB, s1e - s0), ntl = nrows * TW;",
        "        vtc_wg_input(xr, hw, C, H, W, 2 * s0 - 1, 2 * nrows + 2, XW, xp);",
        "        vtc_wg_transform_in(xp, XW, C, nrows, TW, V, LD);",
        "        vtc_wg_gemm(V, U, C, M, ntl, LD, Mx);",
        "        vtc_wg_transform_out(Mx, LD, M, nrows, TW, Y, YW);",
        "        const int64_t y0 = 2 * s0, ny = std::min<int64_t>(H, 2 * (s0 + nrows)) - y0;",
        "        vtc_wg_to_planes(Y, YW, M, ny, W, ct, LDT);",
        "        const int64_t m0 = 0, mb = M, q0 = y0 * W, nq = ny * W;",
    ]
    lines += conv_t._epilogue(em, k, "        ", ldc="LDT", first="q0", count="nq")
    lines += ["      }", "    }", "  }"]
    head = PRELUDE + gemm.RUNTIME + g.runtime + f"#define VTC_WG_ROWS {TILE_ROWS}\n" + RUNTIME
    return head + f'\nextern "C" void {k.name}(void* const* bufs, int nthreads) {{\n' + "\n".join(lines) + "\n}\n"
