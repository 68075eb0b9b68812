"""Vectorisable float math for the generated kernels: exp, log, erf, tanh, sin, cos and what is built on them.

The C++ kernels evaluate these per element inside ``#pragma omp simd`` loops,
so each is branch-free arithmetic (selects, no calls, no tables) that the
compiler turns into vector code.  In a kernel over data in cache, this
arithmetic *is* the cost of a gelu or a softmax, so each function does as
little as its accuracy allows: one clamp pair and one select for the edge
cases of exp, one division for erf and tanh.  Their polynomials use fused
multiply-adds (``VTC_FMA``) where the target has them; the build turns off
contraction of the kernels' own ``a * b + c`` so that those match torch.

Error bounds (float32, against float64, measured by
``tests/codegen/test_vecmath.py`` on dense sweeps; torch's own vectorised
kernels are of the same order):

- ``vtc_exp``: Cephes' expf (range reduction by ln 2 in two parts, degree-6
  polynomial), relative error < 1 ulp (0.98 measured, torch's own 0.56) where
  the result is a normal float: down to x = -86.99 (1.7e-38); below it the
  result is 0 (torch: denormals), above ``ln(FLT_MAX)`` the product overflows
  to inf by itself; NaN propagates.  x is clamped on its bits by two integer
  mins and 2^n comes straight from the rounding constant's bits (session 17:
  1.5x less time per element than compares and blends, bench/vecmath_ab.py).
- ``vtc_sigmoid`` ``1 / (1 + e^-x)`` and ``vtc_silu`` ``x / (1 + e^-x)``
  (torch's forms): < 2.5 and < 3 ulp (2.21 and 2.69 measured, torch's 2.21
  and 2.25, tests/codegen/test_vecmath_accuracy.py).
- ``vtc_log``: Cephes' logf (x = m 2^e with m in [sqrt(1/2), sqrt(2)), degree-8 polynomial in m - 1,
  ln 2 in two parts), error < 1.2e-7 absolute and < 2 ulp (2.4e-7) relative where |log x| >= 1e-3 (near
  x = 1 the absolute bound holds); denormal inputs scaled by 2^23 first; log(0) = -inf, log(inf) = inf,
  NaN for negative inputs and NaN, as torch.
- ``vtc_erf``: ``x * P(x^2) / Q(x^2)`` with x clamped to [-4, 4] (erf(4) is
  1 in float), the result clamped to [-1, 1]; absolute and relative error
  < 6e-7.  P and Q (degrees 6 and 4 in x^2) are our own minimax fit,
  reproduced by ``scripts/fit_vecmath.py``.  It replaces Abramowitz-Stegun
  7.1.26 (a division *and* an exp per element): 2.2x less time in gelu.
- ``vtc_tanh``: ``x * P(x^2) / Q(x^2)`` with x clamped to [-9, 9] (tanh(9)
  is 1 in float), degrees 4 and 4, same fit; error < 5e-7 absolute and
  relative.  It replaces a polynomial for small |x| and an exp with a
  division for the rest, both evaluated for every element.
- ``vtc_gelu`` (float): ``0.5 x (1 + erf(x / sqrt 2))`` with the erf above:
  absolute error < 2e-6 (1.4e-6 measured), relative < 6e-7 for x > 0; for
  x < -5.6 the result is -0 (torch's from -6; the true value is below 1e-8);
  NaN for +-inf and NaN, as torch's gelu returns there.

- ``vtc_sin`` / ``vtc_cos`` (RoPE's tables): the quadrant n = round(x * 2/pi) and the remainder
  r = x - n pi/2 in double (pi/2 in two parts, FMA: exact for |x| < 2^51), then Cephes' sinf / cosf
  polynomials of r on [-pi/4, pi/4] in float; error < 2 ulp of the result's magnitude in [-1, 1]
  (absolute < 1.2e-7 measured, relative < 2.4e-7 where |result| >= 1e-3, on sweeps up to |x| = 1e6).
  From |x| = 2^51 (2.3e15) on, where a float is m * 2^k with an integer m < 2^24 and k >= 28, x is first
  replaced by m * (2^k mod 2 pi), the factor from a table of 77 doubles (``_TWO_POW_MOD_2PI``, made here
  with exact rational arithmetic and 125 digits of pi): the same sine, to ~1.2e-8 absolute.  NaN for inf
  and NaN.  The choice between x and the reduced huge x is a blend with a masked load of the factor (no
  branch: a loop of vtc_sin / vtc_cos is vector code; ``tests/codegen/test_rope_tables.py``).  Targets
  without FMA call the C library's sinf / cosf (not vectorised).

The double versions call the C library (exact to an ulp, and not vectorised;
no model here computes in double).
"""
from __future__ import annotations

from fractions import Fraction

PI = Fraction("3.1415926535897932384626433832795028841971693993751058209749445923078164062862089986280348253421170679821480865132823066470938")


def _two_pow_mod_2pi(k: int) -> float:
    """2^k mod 2 pi as the nearest double (2^k is exact; pi to 125 digits leaves an error far below an ulp)."""
    q = Fraction(2) ** k / (2 * PI)
    return float((q - (q.numerator // q.denominator)) * 2 * PI)


# k = 28..104: a float of magnitude >= 2^51 is m * 2^k, m < 2^24 an integer (vtc_sincos_)
_TWO_POW_MOD_2PI = tuple(_two_pow_mod_2pi(k) for k in range(28, 105))

ERF_CLAMP = 4.0  # |x| beyond which erf(x) rounds to +-1 in float
TANH_CLAMP = 9.0  # |x| beyond which tanh(x) rounds to +-1 in float
# scripts/fit_vecmath.py, lowest power of x^2 first
ERF_P = (1.128379094e+00, 2.071218159e-01, 5.152444440e-02, 3.990424546e-03, 1.472828761e-04,
         -1.942303926e-06, 1.911109133e-08)
ERF_Q = (1.0, 5.168881794e-01, 1.179693397e-01, 1.495778050e-02, 1.021076250e-03)
TANH_P = (9.999999795e-01, 1.338101672e-01, 3.495576958e-03, 2.060887854e-05, 1.335435072e-08)
TANH_Q = (1.0, 4.671433233e-01, 2.587694117e-02, 3.285615638e-04, 7.776436593e-07)


def _horner(coefs: tuple[float, ...], var: str) -> str:
    """C text of sum(coefs[k] * var^k) by Horner's rule with VTC_FMA."""
    text = f"{coefs[-1]:.9e}f"
    for c in reversed(coefs[:-1]):
        text = f"VTC_FMA({text}, {var}, {c:.9e}f)"
    return text


PRELUDE = r"""
#if defined(__FMA__)
#define VTC_FMA(a, b, c) __builtin_fmaf(a, b, c)
#else
#define VTC_FMA(a, b, c) ((a) * (b) + (c))
#endif
// vtc_exp clamps x to [-87.5, 88.9] on its bits, as integers: an unsigned min takes every negative float beyond
// -87.5 (and -inf, a negative NaN) to -87.5 and leaves the positive ones, whose bits are below 0x80000000; a
// signed min then takes every positive float beyond 88.9 (and inf, a positive NaN) to 88.9 and leaves the
// negative ones.  Each is one vpminud / vpminsd, where gcc turns a float clamp into compares and blends (it keeps
// NaN semantics); NaN is restored by the select at the end (its compare mask is folded into the arithmetic).
static inline float vtc_exp(float x) {  // see vtc/codegen/vecmath.py for the error bounds
  uint32_t b = __builtin_bit_cast(uint32_t, x);
  b = b < 0xC2AF0000u ? b : 0xC2AF0000u;  // -87.5: e^x < FLT_MIN; n = -126 below, whose 2^(n + 126) factor is 0
  int32_t s = (int32_t)b;
  s = s < 0x42B1CCCD ? s : 0x42B1CCCD;    // 88.9: above ln(FLT_MAX) = 88.72 the final product overflows to inf
  const float xc = __builtin_bit_cast(float, s);
  // m = 1.5 2^23 + 126 + n, n = round(x / ln 2) in [-126, 128]: its bits are 0x4B400000 + 126 + n, which
  // shifted left by 23 leave (126 + n) << 23, the float 2^(n - 1) (0 for n = -126)
  const float m = VTC_FMA(xc, 1.44269504088896341f, 12583038.0f);
  const float fl = m - 12583038.0f;
  const float z = VTC_FMA(fl, 2.12194440e-4f, VTC_FMA(fl, -0.693359375f, xc));
  float y = 1.9875691500e-4f;
  y = VTC_FMA(y, z, 1.3981999507e-3f); y = VTC_FMA(y, z, 8.3334519073e-3f); y = VTC_FMA(y, z, 4.1665795894e-2f);
  y = VTC_FMA(y, z, 1.6666665459e-1f); y = VTC_FMA(y, z, 5.0000001201e-1f);
  y = VTC_FMA(y, z * z, z);  // e^z - 1
  const float h = __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, m) << 23);  // 2^(n - 1), or 0
  const float r = VTC_FMA(y, h, h) * 2.0f;  // e^z 2^(n - 1) rounded once, then exact, or 0, or inf
  return x != x ? x : r;
}
static inline double vtc_exp(double x) { return std::exp(x); }
static inline float vtc_log(float x) {  // see vtc/codegen/vecmath.py for the error bound
  const bool tiny = x < 1.17549435e-38f;  // a denormal (or 0, negative): scaled by 2^23 first
  const float xs = tiny ? x * 8388608.0f : x;
  const uint32_t bits = __builtin_bit_cast(uint32_t, xs);
  float e = (float)(int32_t)((bits >> 23) & 0xffu) - 126.0f;
  float m = __builtin_bit_cast(float, (bits & 0x007fffffu) | 0x3f000000u);  // xs = m 2^e, m in [0.5, 1)
  const bool low = m < 0.707106781186547524f;
  e = e - (low ? 1.0f : 0.0f) - (tiny ? 23.0f : 0.0f);
  m = (low ? m + m : m) - 1.0f;  // in [sqrt(1/2) - 1, sqrt(2) - 1)
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = VTC_FMA(y, m, -1.1514610310e-1f); y = VTC_FMA(y, m, 1.1676998740e-1f); y = VTC_FMA(y, m, -1.2420140846e-1f);
  y = VTC_FMA(y, m, 1.4249322787e-1f); y = VTC_FMA(y, m, -1.6668057665e-1f); y = VTC_FMA(y, m, 2.0000714765e-1f);
  y = VTC_FMA(y, m, -2.4999993993e-1f); y = VTC_FMA(y, m, 3.3333331174e-1f);
  y = y * m * z;
  y = VTC_FMA(e, -2.12194440e-4f, y);
  y = VTC_FMA(z, -0.5f, y);
  float r = VTC_FMA(e, 0.693359375f, m + y);
  r = x == __builtin_inff() ? x : r;
  r = x == 0.0f ? -__builtin_inff() : r;
  r = x < 0.0f ? __builtin_nanf("") : r;
  return x != x ? x : r;  // selects, not ||: no branch, so the loop stays vector code
}
static inline double vtc_log(double x) { return std::log(x); }
static inline float vtc_erf_abs(float a) {  // erf(a) for a = |x| >= 0; NaN -> 1 (callers restore NaN)
  a = a < %(erf_c)s ? a : %(erf_c)s;
  const float t = a * a;
  const float r = a * %(erf_p)s / %(erf_q)s;
  return r < 1.0f ? r : 1.0f;
}
static inline float vtc_erf(float x) {
  const float r = std::copysign(vtc_erf_abs(std::fabs(x)), x);
  return x != x ? x : r;
}
static inline double vtc_erf(double x) { return std::erf(x); }
static inline float vtc_tanh(float x) {
  float a = std::fabs(x);
  a = a > %(tanh_c)s ? %(tanh_c)s : a;  // written so that NaN passes (the compare is false): no select at the end
  const float t = a * a;
  const float r = a * %(tanh_p)s / %(tanh_q)s;
  return std::copysign(r > 1.0f ? 1.0f : r, x);
}
static inline double vtc_tanh(double x) { return std::tanh(x); }
template <class T> static inline T vtc_sigmoid(T x) { return T(1) / (T(1) + vtc_exp(-x)); }
// x / (1 + e^-x), torch's form: one rounding less than x * sigmoid(x) and one multiply less; silu(-inf) NaN
template <class T> static inline T vtc_silu(T x) { return x / (T(1) + vtc_exp(-x)); }
static inline float vtc_gelu(float x) {
  const float e = std::copysign(vtc_erf_abs(std::fabs(x) * 0.70710678118654752440f), x);
  const float r = 0.5f * x * (1.0f + e);
  const float d = x - x;  // NaN for +-inf and NaN, as torch returns there
  return d != d ? d : r;
}
static inline double vtc_gelu(double x) {
  const double r = 0.5 * x * (1.0 + std::erf(x * 0.70710678118654752440));
  const double d = x - x;
  return d != d ? d : r;
}
#if defined(__FMA__)
// 2^(k + 28) mod 2 pi, k = 0..76 (vecmath.py), zeros up to 128 entries: an index masked with 127 stays inside
static const double vtc_two_pow_mod_2pi[128] = {%(two_pow_mod_2pi)s};
// sin (odd = 0) or cos (odd = 1) of x: the quadrant n = round(x * 2/pi) and r = x - n * pi/2 in double
// (pi/2 in two parts, each product exact in the FMA), then Cephes' sinf / cosf polynomials of r in float
// on [-pi/4, pi/4], chosen and signed by n + odd.  |x| >= 2^51 = m * 2^k (2.3e15): x replaced by
// m * (2^k mod 2 pi), which has the same sine (see vecmath.py).
static inline float vtc_sincos_(float x, uint32_t odd) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x), e = (bits >> 23) & 0xffu;
  const bool big = e >= 127u + 51u && e < 255u;  // finite, |x| >= 2^51: m * 2^(e - 150), e - 150 >= 28
  const double mant = (double)((bits & 0x7fffffu) | 0x800000u);
  // no branch and no call, so that a loop over it is vector code (a masked gather of the factor): written as
  // big ? copysign(mant * factor, x) : x, gcc 12 made the table load and the copysign a branch (scalar loop);
  // the blend below is exact (y * 1 + x * 0 = y and y * 0 + x * 1 = x for finite y; inf and NaN x stay)
  const double y = mant * (big ? vtc_two_pow_mod_2pi[(int64_t)((e - 178u) & 127u)] : 0.0);  // finite, >= 0
  const double bd = (double)(int32_t)big, sx = (double)x;
  const double xd = (sx < 0.0 ? -y : y) * bd + sx * (1.0 - bd);
  const double m = __builtin_fma(xd, 0.63661977236758134308, 6755399441055744.0);  // 1.5 * 2^52 + n
  const double q = m - 6755399441055744.0;
  const uint32_t n = (uint32_t)__builtin_bit_cast(uint64_t, m) + odd;
  double rd = __builtin_fma(-q, 1.5707963267948966, xd);
  rd = __builtin_fma(-q, 6.123233995736766e-17, rd);
  const float r = (float)rd, z = r * r;
  const float s = VTC_FMA(VTC_FMA(VTC_FMA(-1.9515295891e-4f, z, 8.3321608736e-3f), z, -1.6666654611e-1f),
                          z * r, r);
  const float c = VTC_FMA(VTC_FMA(VTC_FMA(2.443315711809948e-5f, z, -1.388731625493765e-3f), z,
                                  4.166664568298827e-2f), z * z, VTC_FMA(-0.5f, z, 1.0f));
  float v = (n & 1u) ? c : s;
  v = (n & 2u) ? -v : v;
  v = e < 255u ? v : NAN;  // inf, NaN
  return x == 0.0f && !odd ? x : v;  // sin(-0) = -0
}
static inline float vtc_sin(float x) { return vtc_sincos_(x, 0u); }
static inline float vtc_cos(float x) { return vtc_sincos_(x, 1u); }
#else
static inline float vtc_sin(float x) { return std::sin(x); }  // no FMA: the C library (not vectorised)
static inline float vtc_cos(float x) { return std::cos(x); }
#endif
static inline double vtc_sin(double x) { return std::sin(x); }
static inline double vtc_cos(double x) { return std::cos(x); }
template <class T> static inline T vtc_gelu_tanh(T x) {
  return T(0.5) * x * (T(1) + vtc_tanh(T(0.79788456080286535588) * (x + T(0.044715) * x * x * x))); }
""" % dict(erf_c=f"{ERF_CLAMP}f", erf_p=_horner(ERF_P, "t"), erf_q=_horner(ERF_Q, "t"),
           tanh_c=f"{TANH_CLAMP}f", tanh_p=_horner(TANH_P, "t"), tanh_q=_horner(TANH_Q, "t"),
           two_pow_mod_2pi=", ".join(f"{v!r}" for v in _TWO_POW_MOD_2PI + (0.0,) * (128 - len(_TWO_POW_MOD_2PI))))


# bfloat16 / float16 values in memory (uint16_t) <-> float, the type kernels compute them in (docs/low_precision.md).
# A load widens; a store, and every op whose result is of the dtype, rounds to nearest even (``vtc_round_*``), as
# torch's conversions do (c10::BFloat16 / c10::Half): NaN stays a NaN (bf16: 0x7fc0, torch's), overflow gives inf.
# All branch-free integer / float arithmetic, so a loop of them vectorises.  float16 is torch's portable bit
# conversion (c10/util/Half.h, fp16_ieee_from_fp32_value / fp16_ieee_to_fp32_value), not the compiler's _Float16:
# gcc 12 converts _Float16 with scalar F16C instructions only ("unsupported data-type"), which keeps the whole
# loop from vectorising, where the bit conversion vectorises (docs/low_precision.md).  With gcc on an AVX-512 CPU
# the float16 conversions are the CPU's instead, as vector functions a loop calls (equal to the bit conversions on
# every value: checked exhaustively, docs/low_precision.md "conv16"): 1.1-2.7x faster per element in the loops
# measured there, where the bit conversion took ~30 integer ops a vector.
LOW_PRECISION_PRELUDE = r"""
#ifndef VTC_LOW_PRECISION_PRELUDE
#define VTC_LOW_PRECISION_PRELUDE
#include <cstring>
static inline float vtc_bits_f32(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
static inline uint32_t vtc_f32_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
static inline float vtc_from_bf16(uint16_t h) { return vtc_bits_f32((uint32_t)h << 16); }
static inline uint16_t vtc_to_bf16(float x) {
  const uint32_t u = vtc_f32_bits(x);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return x != x ? (uint16_t)0x7fc0 : (uint16_t)r;
}
static inline float vtc_round_bf16(float x) {
  const uint32_t u = vtc_f32_bits(x);
  const float r = vtc_bits_f32((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
  return x != x ? x : r;
}
#if defined(__F16C__) && defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
// The CPU's conversions (F16C / AVX-512: vcvtps2ph, round to nearest even, and vcvtph2ps), equal to the bit
// conversions below for every float32 and every float16 (a NaN's payload aside: both give a NaN of its sign).  gcc
// does not vectorise an intrinsic inside a loop of scalar code, but does vectorise a call to a function declared
// ``simd``: per vector ISA and lane count it calls the clone _ZGV<isa>N<lanes>v_<name>, defined here with the
// vector instructions (the ISAs b, c, d, e and lane counts gcc's own clones of these signatures take: 128-bit
// integers under AVX), so a loop converting 16 floats costs one call of two instructions, not ~30 integer ops.
#include <immintrin.h>
extern "C" {
__attribute__((visibility("hidden"))) float vtc_f16_widen_1(int h) { return _cvtsh_ss((unsigned short)h); }
__attribute__((visibility("hidden"))) int vtc_f16_narrow_1(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
__attribute__((visibility("hidden"))) float vtc_f16_round_1(float f) { return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)); }
#define VTC_F16_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VTC_F16_CLONES(isa, n, vf, vi, widen, narrow)                                                                  \
  __attribute__((visibility("hidden"))) vf _ZGV##isa##N##n##v_vtc_f16_round_1(vf x) { return widen(narrow(x)); }      \
  __attribute__((visibility("hidden"))) vf _ZGV##isa##N##n##v_vtc_f16_widen_1(vi h) { return widen(VTC_F16_PACK##n(h)); }
#define VTC_F16_PACK4(h) _mm_packus_epi32(h, h)
#define VTC_F16_PACK8(h) _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
#define VTC_F16_PACK16(h) _mm512_cvtepi32_epi16(h)
static inline __m128i vtc_f16_n4(__m128 x) { return _mm_cvtps_ph(x, VTC_F16_NEAREST); }
static inline __m128i vtc_f16_n8(__m256 x) { return _mm256_cvtps_ph(x, VTC_F16_NEAREST); }
static inline __m256i vtc_f16_n16(__m512 x) { return _mm512_cvtps_ph(x, VTC_F16_NEAREST); }
VTC_F16_CLONES(b, 4, __m128, __m128i, _mm_cvtph_ps, vtc_f16_n4)
VTC_F16_CLONES(c, 8, __m256, __m256i, _mm256_cvtph_ps, vtc_f16_n8)
VTC_F16_CLONES(d, 8, __m256, __m256i, _mm256_cvtph_ps, vtc_f16_n8)
VTC_F16_CLONES(e, 16, __m512, __m512i, _mm512_cvtph_ps, vtc_f16_n16)
// narrowing returns an int per lane: 4 lanes under SSE2 and AVX (128-bit integers), 8 under AVX2, 16 under AVX-512
__attribute__((visibility("hidden"))) __m128i _ZGVbN4v_vtc_f16_narrow_1(__m128 x) { return _mm_cvtepu16_epi32(vtc_f16_n4(x)); }
__attribute__((visibility("hidden"))) __m128i _ZGVcN4v_vtc_f16_narrow_1(__m128 x) { return _mm_cvtepu16_epi32(vtc_f16_n4(x)); }
__attribute__((visibility("hidden"))) __m256i _ZGVdN8v_vtc_f16_narrow_1(__m256 x) { return _mm256_cvtepu16_epi32(vtc_f16_n8(x)); }
__attribute__((visibility("hidden"))) __m512i _ZGVeN16v_vtc_f16_narrow_1(__m512 x) { return _mm512_cvtepu16_epi32(vtc_f16_n16(x)); }
__attribute__((simd("notinbranch"), const, nothrow, visibility("hidden"))) float vtc_from_f16(int h) __asm__("vtc_f16_widen_1");
__attribute__((simd("notinbranch"), const, nothrow, visibility("hidden"))) int vtc_to_f16(float f) __asm__("vtc_f16_narrow_1");
__attribute__((simd("notinbranch"), const, nothrow, visibility("hidden"))) float vtc_round_f16(float f) __asm__("vtc_f16_round_1");
}
#else
static inline float vtc_from_f16(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = vtc_bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = vtc_bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  return vtc_bits_f32(sign | (two_w < (1u << 27) ? vtc_f32_bits(denormalized) : vtc_f32_bits(normalized)));
}
static inline uint16_t vtc_to_f16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = vtc_f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = vtc_bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = vtc_f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
static inline float vtc_round_f16(float x) { return vtc_from_f16(vtc_to_f16(x)); }
#endif
// p[j] = vtc_round_f16(p[j]) and dst[j] = vtc_to_f16(src[j]) for j < n, by vector conversions where the CPU has them
// (a float16 result's row computed in float32 first: vtc.codegen.conv_t._epilogue, vtc.codegen.depthwise)
#if defined(__F16C__) && defined(__AVX512F__)
#include <immintrin.h>
#endif
static inline void vtc_round_f16_n(float* __restrict p, int64_t n) {
#if defined(__F16C__) && defined(__AVX512F__)
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = (__mmask16)(n - j >= 16 ? 0xFFFFu : (1u << (n - j)) - 1u);
    const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, p + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm512_mask_storeu_ps(p + j, m, _mm512_cvtph_ps(h));
  }
#else
  for (int64_t j = 0; j < n; ++j) p[j] = vtc_round_f16(p[j]);
#endif
}
static inline void vtc_to_f16_n(uint16_t* __restrict dst, const float* __restrict src, int64_t n) {
#if defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = (__mmask16)(n - j >= 16 ? 0xFFFFu : (1u << (n - j)) - 1u);
    _mm256_mask_storeu_epi16(dst + j, m, _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, src + j),
                                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#else
  for (int64_t j = 0; j < n; ++j) dst[j] = vtc_to_f16(src[j]);
#endif
}
// 16 lanes of a float16 / float32 pointwise loop as one vector (vtc.codegen.low_vector): masked loads
// that widen, roundings and narrowing masked stores, each the same conversion as the scalar ones above on every lane
#if defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VTC_V16 1
#define VTC_V16_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline __mmask16 vtc_v16_mask(int64_t n) { return (__mmask16)(n >= 16 ? 0xFFFFu : (1u << n) - 1u); }
static inline __m512 vtc_v16_load_f32(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 vtc_v16_load_f16(__mmask16 m, const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
static inline __m512 vtc_v16_round_f16(__m512 x) { return _mm512_cvtph_ps(_mm512_cvtps_ph(x, VTC_V16_NEAREST)); }
static inline void vtc_v16_store_f32(__mmask16 m, float* p, __m512 x) { _mm512_mask_storeu_ps(p, m, x); }
static inline void vtc_v16_store_f16(__mmask16 m, uint16_t* p, __m512 x) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(x, VTC_V16_NEAREST)); }
#endif
// vtc_to_f16_n by streaming stores where dst is 32-byte aligned (a large float16 result that is not read back
// soon: its lines are not read for ownership; vtc.codegen.gemm ``_narrowed_rows``), fenced before it returns
static inline void vtc_to_f16_n_stream(uint16_t* __restrict dst, const float* __restrict src, int64_t n) {
#if defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const int64_t head = std::min<int64_t>(n, (int64_t)((32 - ((uintptr_t)dst & 31)) & 31) / 2);
  if (((uintptr_t)dst & 1) == 0 && n - head >= 16) {
    vtc_to_f16_n(dst, src, head);
    int64_t j = head;
    for (; j + 16 <= n; j += 16)
      _mm256_stream_si256((__m256i*)(dst + j), _mm512_cvtps_ph(_mm512_loadu_ps(src + j),
                                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    vtc_to_f16_n(dst + j, src + j, n - j);
    _mm_sfence();
    return;
  }
#endif
  vtc_to_f16_n(dst, src, n);
}
#endif
"""
