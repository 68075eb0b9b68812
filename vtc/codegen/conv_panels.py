"""The implicit-GEMM convolution's loops: the im2col read in place where it is a shifted input plane.

vtc.codegen.gemm's loops (Goto's algorithm) pack the KC x NC block of B into
panels, then run every A micro-panel against them.  For a convolution B is the
im2col, and the pack writes 9x the input for a 3x3 one (at 40x40 with 32
channels, 1.8 MB per image through L2 for 30 MFLOP), a fifth of the kernel's
time; the epilogue (batch norm, SiLU) then re-reads the whole C block.  Here
(``generate``):

- **conv_taps** (a stride-1 "same" convolution over a plain input,
  ``Im2colPack.direct``; AVX-512): row (channel c, tap t) of B at output pixel
  q is the input plane of c at q + shift(t), zero where the tap is in the
  padding.  The micro-kernel (``vtc_ukr_taps``, 12 x 32 like vtc_ukr) loads it
  straight from the input with lane masks per tap (the pack's ``cv_masks``
  table, which also masks the columns past N), taps outer so that a tap's two
  masks stay in registers; per NR-column strip every A micro-panel runs against
  the same input lines (in L1).  No B pack.  The epilogue runs every
  ``EPI_COLS`` columns, over C just computed.
- **panels** (every other convolution, and conv_taps without AVX-512): B packed
  ``SUB`` columns at a time (``Im2colPack.lines``), every A micro-panel against
  them, then the epilogue over those columns.  (A 1x1 convolution read in
  place measured 15% slower than packed: its B rows, whole planes apart, fall
  into few of L1's sets.)

In both, a thread's work is (image, chunk of output pixels, block of output
channels), the chunks equal and a multiple of NR: at batch 1 on two threads a
40x40 map is two chunks of 800 pixels where the GEMM's 1024-column chunks give
1024 and 576.  The A pack, micro-kernel and epilogue are vtc.codegen.gemm's,
their names in scope (``n0``, ``nb``, ``ct``, ``bp``) redefined per block.
"""
from __future__ import annotations

from vtc.codegen.kernel_ir import Kernel

TAPS_PATH = "conv_taps"  # GemmChoice.path of a convolution whose B is read from its input in place
ENABLED = True  # False: convolutions run vtc.codegen.gemm's own loops (a switch for side-by-side timing)
PANEL_NC = 1024  # most columns of a thread's chunk (then cut into equal chunks, a multiple of NR)
SUB = 256  # columns of B packed at a time (a multiple of every NR) on the packing path
EPI_COLS = 128  # columns of C that the epilogue runs over at a time where B is read in place
KC_DIRECT = 512  # reduction block where B is read in place (A micro-panels of 12 x 512 floats stay in L1)
PREFETCH_STRIPS = 2  # where B is read in place: each input channel's leading lines this many NR-column strips
#                      ahead are prefetched (0: none)

RUNTIME = r"""
#ifndef VTC_CONV_DIRECT_RUNTIME
#define VTC_CONV_DIRECT_RUNTIME
#if defined(__AVX512F__)
// c[R x cols] (+)= a[kb x MR (R used)] * B over nci input channels of T taps each: B's row ci * T + t is the input
// plane x + ci * hw shifted by d[t], lanes masked by m0[t] (columns 0-15) and m1[t] (16-31): the zero padding
// and the columns past N, never loaded (vtc.codegen.conv_panels)
template <int R, int T>
static inline void vtc_ukr_taps(int64_t nci, const float* __restrict a, const float* x, int64_t hw, const int64_t* d,
                                const __mmask16* m0, const __mmask16* m1, float* __restrict c, int64_t ldc, bool add,
                                int64_t cols) {
  const __mmask16 k0 = (__mmask16)(cols >= 16 ? 0xFFFFu : (1u << cols) - 1u);
  const __mmask16 k1 = (__mmask16)(cols >= 32 ? 0xFFFFu : cols <= 16 ? 0u : (1u << (cols - 16)) - 1u);
  __m512 c0[R], c1[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm_prefetch((const char*)(c + r * ldc), _MM_HINT_T0);
    c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps();
  }
  for (int t = 0; t < T; ++t) {  // a tap's masks stay in registers over the channels (3-5% faster than
    //                                 the taps inner, their 2 T masks reloaded per channel)
    const __mmask16 k0t = m0[t], k1t = m1[t];
    const float* xt = x + d[t];
    const float* at = a + t * VTC_MR;
    #pragma GCC unroll 2
    for (int64_t ci = 0; ci < nci; ++ci) {
      const __m512 b0 = _mm512_maskz_loadu_ps(k0t, xt + ci * hw), b1 = _mm512_maskz_loadu_ps(k1t, xt + ci * hw + 16);
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 av = _mm512_set1_ps(at[ci * T * VTC_MR + r]);
        c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
        c1[r] = _mm512_fmadd_ps(av, b1, c1[r]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    if (add) { c0[r] = _mm512_add_ps(c0[r], _mm512_maskz_loadu_ps(k0, cr)); c1[r] = _mm512_add_ps(c1[r], _mm512_maskz_loadu_ps(k1, cr + 16)); }
    _mm512_mask_storeu_ps(cr, k0, c0[r]);
    _mm512_mask_storeu_ps(cr + 16, k1, c1[r]);
  }
}
// vtc_ukr_taps for `rows` <= VTC_MR rows as a sum of 12, 8, 4, 2 and 1-row kernels (as vtc_ukr_edge)
template <int T>
__attribute__((noinline)) static void vtc_ukr_taps_edge(int rows, int64_t cols, int64_t nci, const float* a,
                                                        const float* x, int64_t hw, const int64_t* d,
                                                        const __mmask16* m0, const __mmask16* m1, float* c,
                                                        int64_t ldc, bool add) {
  if (rows == VTC_MR) { vtc_ukr_taps<VTC_MR, T>(nci, a, x, hw, d, m0, m1, c, ldc, add, cols); return; }
  int r0 = 0;
  if (rows - r0 >= 8) { vtc_ukr_taps<8, T>(nci, a + r0, x, hw, d, m0, m1, c + r0 * ldc, ldc, add, cols); r0 += 8; }
  if (rows - r0 >= 4) { vtc_ukr_taps<4, T>(nci, a + r0, x, hw, d, m0, m1, c + r0 * ldc, ldc, add, cols); r0 += 4; }
  if (rows - r0 >= 2) { vtc_ukr_taps<2, T>(nci, a + r0, x, hw, d, m0, m1, c + r0 * ldc, ldc, add, cols); r0 += 2; }
  if (rows - r0 >= 1) vtc_ukr_taps<1, T>(nci, a + r0, x, hw, d, m0, m1, c + r0 * ldc, ldc, add, cols);
}
#endif
#endif
"""


def generate(k: Kernel) -> str:
    """The C++ source of convolution kernel k (k.gemm: a GemmOperands whose pack_b is the im2col pack,
    ``vtc.codegen.conv.Im2colPack.lines``)."""
    from vtc.codegen import conv_t, gemm, gemm_pack
    from vtc.codegen.cpp import OMP_TEAM, PRELUDE, _Emitter, buffer_pointers

    g = k.gemm
    em = _Emitter(k)
    out = k.stores[0].buffer
    lines = buffer_pointers(k, em)
    M, N, KK, B = g.m, g.n, g.k, g.batch
    bt = g.vars[0] or "bt"
    pack = g.pack_b.__self__  # the Im2colPack whose lines pack B
    direct = pack.taps  # (the input's load, taps, their offsets) where B is read in place (conv.conv_kernel)
    taps = direct[1] if direct else 1
    flops = 2 * B * M * N * KK
    narrow = gemm.narrowed(k)
    cbase, ldc = (f"{bt} * M * N", N) if g.out_layout is None else (em.index(g.out_layout[0]), g.out_layout[1])
    lines += [
        f"  const int64_t M = {M}, N = {N}, K = {KK}, BATCH = {B}, LDC = {ldc}, TAPS = {taps};",
        f"  const int nt = {flops}LL >= {gemm.PARALLEL_MIN_FLOPS}LL && nthreads > 1 ? nthreads : 1;",
        "  int64_t mc = VTC_MC;",
        # equal KC slices, whole input channels (TAPS rows of B) each where B is read in place
        f"  const int64_t kslices = (K + {KC_DIRECT if direct else 'VTC_KC'} - 1) / {KC_DIRECT if direct else 'VTC_KC'};",
        "  const int64_t kc = (K / TAPS + kslices - 1) / kslices * TAPS;",
        # equal N chunks (a multiple of NR), a multiple of the thread count where the batch and the M blocks
        # do not already give each thread the same number
        f"  int64_t tm = (M + mc - 1) / mc, tn = (N + {PANEL_NC} - 1) / {PANEL_NC};",
        "  if ((BATCH * tm * tn) % nt) tn = (tn + nt - 1) / nt * nt;",
        "  const int64_t nc = ((N + tn - 1) / tn + VTC_NR - 1) / VTC_NR * VTC_NR;",
        "  tn = (N + nc - 1) / nc;",
        "  mc = ((M + tm - 1) / tm + VTC_MR - 1) / VTC_MR * VTC_MR;  // equal M blocks",
        "  tm = (M + mc - 1) / mc;",
        "  const int64_t units = BATCH * tn * tm;",
    ]
    if direct:
        lines += pack._mask_table("  ")  # cv_masks: per 16 output pixels, the lanes each tap row / column reads
    lines += [
        *OMP_TEAM,
        "    float* __restrict ap = vtc_gemm_scratch(0, (mc + VTC_NR) * kc);",
        f"    float* __restrict bpanel = vtc_gemm_scratch(1, kc * {SUB});",
        # a float16 output (gemm.narrowed): the sums of a unit in float32 rows LDC apart, rounded once into the
        # output by the epilogue
        *(["    float* __restrict csum = vtc_gemm_scratch(3, mc * LDC);"] if narrow else []),
        "    const int64_t u1 = units * (tid + 1) / nth;",
        "    for (int64_t u = units * tid / nth; u < u1; ++u) {",
        "      const int64_t grp = u / tm, mi = u % tm;",
        f"      const int64_t {bt} = grp / tn;",
        "      const int64_t nchunk = (grp % tn) * nc, nbchunk = std::min<int64_t>(nc, N - nchunk);",
        "      const int64_t m0 = mi * mc, mb = std::min<int64_t>(mc, M - m0);",
        f"      float* __restrict cchunk = {'csum' if narrow else em.ptr[out.name] + ' + ' + cbase} + nchunk"
        f"{'' if narrow else ' + m0 * LDC'};",
        "      for (int64_t k0 = 0; k0 < K; k0 += kc) {",
        "        const int64_t kb = std::min<int64_t>(kc, K - k0);",
    ]
    ind = "        "
    lines += gemm._pack_a(em, g, ind)  # in scope: batch index, m0, mb, k0, kb, ap
    # a float16 result: vtc.codegen.conv_t's epilogue over the block (its rounding and narrowing by vector conversions)
    epi = (conv_t._epilogue(em, k, ind + "    ", ldc="LDC", first="n0", count="nb", cap=None if direct else SUB)
           if narrow else gemm._epilogue(em, k, ind + "    "))
    final = [f"{ind}  if (k0 + kb == K) {{  // these columns are final: their epilogue while they are in cache", *epi,
             f"{ind}  }}"] if epi else []
    if direct:  # the epilogue every EPI_COLS columns (per strip of NR, its per-channel terms cost more)
        group = [f"{ind}  if (k0 + kb == K && (jp + VTC_NR >= nbchunk || (jp + VTC_NR) % {EPI_COLS} == 0)) {{",
                 f"{ind}    const int64_t e0 = jp / {EPI_COLS} * {EPI_COLS}, e1 = jp + nb;",
                 f"{ind}    const int64_t n0 = nchunk + e0, nb = e1 - e0;",
                 f"{ind}    float* __restrict ct = cchunk + e0;",
                 *epi, f"{ind}  }}"] if epi else []
        lines += [f"{ind}#if defined(__AVX512F__)", *_direct_strips(direct, pack, em, ind), *group,
                  f"{ind}}}", f"{ind}#else"]
    lines += [f"{ind}for (int64_t jp = 0; jp < nbchunk; jp += {SUB}) {{  // {SUB} columns of B packed, then used",
              f"{ind}  const int64_t n0 = nchunk + jp, nb = std::min<int64_t>({SUB}, nbchunk - jp);",
              f"{ind}  float* __restrict bp = bpanel;",
              f"{ind}  float* __restrict ct = cchunk + jp;"]
    lines += g.pack_b(em, g, ind + "  ")  # in scope: batch index, k0, kb, n0, nb, bp
    lines += [f"{ind}  for (int64_t ir = 0; ir < mb; ir += VTC_MR)  // an A micro-panel in L1, the B panels in L2",
              f"{ind}    for (int64_t jr = 0; jr < nb; jr += VTC_NR)",
              f"{ind}      vtc_ukr_edge((int)std::min<int64_t>(VTC_MR, mb - ir), std::min<int64_t>(VTC_NR, nb - jr), kb,",
              f"{ind}                   ap + ir * kb, bp + jr * kb, VTC_NR, ct + ir * LDC + jr, LDC, k0 > 0);",
              *final, f"{ind}}}"]
    if direct:
        lines.append(f"{ind}#endif")
    lines += ["      }", "    }", "  }"]
    head = PRELUDE + gemm.RUNTIME + gemm_pack.RUNTIME + g.runtime + RUNTIME
    return head + f'\nextern "C" void {k.name}(void* const* bufs, int nthreads) {{\n' + "\n".join(lines) + "\n}\n"


def _direct_strips(direct: tuple, pack, em, ind: str) -> list[str]:
    """The loop over NR-column strips of a chunk where the micro-kernel reads B from the input (AVX-512):
    per strip the lane masks of each tap, then every A micro-panel against it; leaves the strip's block
    open (n0, nb, ct in scope) for its epilogue."""
    load, taps, shifts = direct
    run = pack._plain_run(em, load)  # the address of B's row r at output pixel (cv_ih, cv_iw)
    kh, kw = pack.geo["kh"], pack.geo["kw"]
    lines = [f"{ind}const float* xr;  // B's row k0 at output pixel 0: input channel k0 / TAPS, tap 0",
             f"{ind}int64_t hw;  // from one input channel to the next",
             f"{ind}{{ const int64_t cv_ih = 0, cv_iw = 0; int64_t r = k0; xr = {run}; r = k0 + TAPS; hw = ({run}) - xr; }}",
             f"{ind}static const int64_t cv_shift[TAPS] = {{{', '.join(str(x) for x in shifts)}}};",
             f"{ind}for (int64_t jp = 0; jp < nbchunk; jp += VTC_NR) {{  // B's columns read in place, by NR",
             f"{ind}  const int64_t n0 = nchunk + jp, nb = std::min<int64_t>(VTC_NR, nbchunk - jp);",
             f"{ind}  float* __restrict ct = cchunk + jp;",
             f"{ind}  __mmask16 cv_m0[TAPS], cv_m1[TAPS];  // n0 is a multiple of 16: chunks and strips are of NR",
             f"{ind}  for (int64_t t = 0; t < TAPS; ++t) {{",
             f"{ind}    const int64_t hq = n0 / 16, a = t / {kw}, b = t % {kw};  // lanes past N: in no row",
             f"{ind}    cv_m0[t] = cv_masks.rows[hq * {kh} + a] & cv_masks.cols[hq * {kw} + b];",
             f"{ind}    cv_m1[t] = cv_masks.rows[(hq + 1) * {kh} + a] & cv_masks.cols[(hq + 1) * {kw} + b];",
             f"{ind}  }}"]
    if PREFETCH_STRIPS:  # the last tap's two lines of each channel PREFETCH_STRIPS strips ahead: the lines
        #                   the strips after this one read first (the earlier taps read them again later)
        lines += [f"{ind}  for (int64_t ci = 0; ci < kb / TAPS; ++ci) {{",
                  f"{ind}    const char* pf = (const char*)(xr + ci * hw + n0 + cv_shift[TAPS - 1] + "
                  f"{PREFETCH_STRIPS} * VTC_NR);",
                  f"{ind}    _mm_prefetch(pf, _MM_HINT_T0); _mm_prefetch(pf + 64, _MM_HINT_T0);",
                  f"{ind}    if (VTC_NR > 16) _mm_prefetch(pf + 127, _MM_HINT_T0);",
                  f"{ind}  }}"]
    lines += [f"{ind}  for (int64_t ir = 0; ir < mb; ir += VTC_MR)  // the strip's input in L1, A from L1 / L2",
              f"{ind}    vtc_ukr_taps_edge<TAPS>((int)std::min<int64_t>(VTC_MR, mb - ir), nb, kb / TAPS, ap + ir * kb,",
              f"{ind}                            xr + n0, hw, cv_shift, cv_m0, cv_m1, ct + ir * LDC, LDC, k0 > 0);"]
    return lines
