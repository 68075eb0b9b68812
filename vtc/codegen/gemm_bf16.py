"""bf16 GEMM kernels: bf16 mm / bmm on CPUs with AVX512_BF16, operands read through strided mappings.

The float32 GEMM (``vtc.codegen.gemm``) packs operands through any mapping
into float panels.  This is its bf16 twin for the operands the bf16 path
takes: physical tensors and virtual ones that are one strided load per tile
(a transpose, a slice, the GQA head mapping h // group of ``repeat_kv``; the
batch index may enter any way).  Values are never converted on the way in:
the pack loops copy bf16 bits, two consecutive reduction elements side by
side as one 32-bit word (the layout ``vdpbf16ps`` multiplies), and the
micro-kernel (12 x 32 accumulators, ``_mm512_dpbf16_ps``: two products per
lane and instruction) accumulates in float32.  Results are rounded to bf16
(round to nearest even, as torch does) once per output element, after the
whole reduction.

Blocking: per N chunk a thread packs all of B's K rows for the chunk once
(chunk width chosen so that block stays about 2 MB), then per MC-row block
and KC slice packs A and runs the micro-kernel into a float32 block in L2;
in the last KC slice the micro-kernel adds the block's sums and rounds the
result into the output straight from its registers (no pass over the block:
q @ k^T of 16 heads x 256 x 256, K = 64, 0.352 -> 0.300 ms at 1 thread on
Zen 5).  Skinny GEMMs (M <= 16) against a
weight read along k (decode's x @ W^T) take dot products against the
weight rows in place instead (no B panel).

Epilogues: addmm (nn.Linear with bias) and a GEMM whose one reader is a
pointwise kernel at its own index (vtc.codegen.lower ``_epilogues``: bias,
gelu / silu / relu, a residual add, a scale, a cast to float32) store that
kernel's value instead of the plain result: the last KC slice leaves the
float32 sums in the block (the dot path: in a 16 x 64 block per chunk) and
one pass over it evaluates the epilogue with the general emitter (bf16 reads
widened, every bf16 op rounded as eager rounds it, the store rounded once).
addmm's bias is added to the float32 sums before the one rounding (eager's
addmm does the same); a pointwise op after an mm reads the product rounded
to bf16 first, as eager's does.

``support`` says whether the compiler targets AVX512_BF16 (``-march=native``
on a CPU that has it); ``why_not`` why a bf16 GEMM node cannot run here (then
torch runs it, the reason in the report); ``estimate_us`` is the cost model
``vtc.codegen.gemm.choose`` uses for bf16.  Its fixed rates assume torch's
bf16 GEMM runs on AMX tiles (oneDNN on a Sapphire Rapids-class Xeon), far
faster on large products than ``vdpbf16ps``: there under ``gemm="auto"`` only
operands torch would copy first and skinny products are generated.  On a CPU
without AMX (AMD EPYC Zen 5) torch's bf16 GEMM runs on AVX512_BF16 as this
kernel does, about as fast; how the two compare is measured once per machine
(``vtc.plan.cost.library_gemm_speed(dtype=torch.bfloat16)``, the same
measurement as float32's) and scales torch's rate, so there a copied operand
(GQA keys over a long cache) goes to this kernel even under large products.
"""
from __future__ import annotations

import functools
import os
import subprocess

import torch

from vtc.index.expr import _terms, free_vars
from vtc.index.mapping import linear_offset

BF16 = torch.bfloat16
BF16_OPS = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default")
# cost model (2 threads, microseconds from GB/s and GFLOPS as in vtc.codegen.gemm), from 1-thread CPU times
# (python -m bench.gemm_side_by_side --workloads 'gemm_bf16*' --threads 1 --clock cpu), doubled, on an Intel
# Xeon with AMX.  vdpbf16ps retires about one per two cycles there (a loop of independent ones: 0.62x the
# float32 FMA rate), so the panel kernel runs ~77 GFLOPS a thread (1024^3: 28 ms) against oneDNN's AMX ~860
# (2.5 ms); x @ W^T of a 4096 x 4096 bf16 weight, 1 / 4 / 16 rows: 1.87 / 1.91 / 7.2 ms on the dot path,
# torch 3.0 / 2.7 / 3.4 ms.  On an AMD EPYC Zen 5 (no AMX) vdpbf16ps retires two per cycle, as many as FMAs
# (540 GFLOPS a thread in a register-only loop, docs/gemm.md): the panel kernel runs ~460 GFLOPS (1024^3:
# 4.64 ms), torch's bf16 (oneDNN, AVX512_BF16) as fast (4.52 ms); x @ W^T, 1 / 4 / 16 rows: 0.76 / 1.17 /
# 2.61 ms on the dot path, torch 1.87 / 1.62 / 2.48 ms (python -m bench.gemm_bf16_side_by_side).  Only the
# ratio of the large rates differs enough to change a choice: library_gemm_speed(dtype=bf16) scales
# TORCH_GFLOPS by the measured one.
VTC_GFLOPS = 150.0  # the vdpbf16ps panel kernel
TORCH_GFLOPS = 1200.0  # oneDNN's AMX kernels (scaled by the measured torch_speed where the CPU has no AMX)
# (GB/s of B, GFLOPS) for M <= SKINNY_M: the dot path costs the larger of the two (reading the weight hides the
# arithmetic up to ~4 rows), torch's their sum.  The dot path's rates are Zen 5's (1 thread, CPU time, x @ W^T
# of a bf16 nn.Linear, docs/gemm.md session 16): 1 / 4 rows of a 4096 x 4096 weight 0.67 / 1.08 ms (~50-57 GB/s
# of W from memory), 8 / 12 / 16 rows of a 1024 x 4096 one 0.17 / 0.28 / 0.41 ms (~330-390 GFLOPS, W from L3);
# the Intel figures before them (39, 160) kept torch on 8-16 rows that the generated kernel ran 1.3-2x faster
SKINNY = {"dot": (57.0, 330.0), "torch": (23.0, 1000.0)}
SKINNY_M = 16


@functools.lru_cache(maxsize=None)
def support() -> str:
    """"" when generated kernels are built for a CPU with AVX512_BF16 (the compiler's target defines
    __AVX512BF16__), else why not."""
    if os.environ.get("VTC_GEMM_BF16", "1") == "0":
        return "VTC_GEMM_BF16=0 turns the bf16 GEMM off"
    from vtc.runtime import cbuild

    try:
        info = cbuild.compiler_info()
        proc = subprocess.run([*info.command, *info.flags, "-E", "-dM", "-x", "c++", os.devnull],
                              capture_output=True, text=True, timeout=60)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return f"the C++ compiler's target could not be read ({e})"
    if "__AVX512BF16__" not in proc.stdout:
        return (f"the compiler's target ({' '.join(info.flags)}) has no AVX512_BF16 "
                f"(this CPU or compiler lacks avx512_bf16)")
    return ""


def strided_operand(low, v, batched: bool) -> str:
    """"" when GEMM operand v is one strided load per batch tile (physical, or virtual with one piece whose
    offset is affine in the last two indices with constant strides), else why not."""
    if not low.plan.is_virtual(v.name):
        return ""
    m = low.plan.mappings[v.name]
    if len(m.pieces) != 1 or m.pieces[0].source is None or m.index_tensors:
        return f"%{v.name} is read through a mapping with several pieces or index tensors"
    piece = m.pieces[0]
    if low.plan.is_virtual(piece.source):
        return f"%{v.name} reads the virtual %{piece.source}"
    rank = len(v.shape)
    inner = {f"i{rank - 2}", f"i{rank - 1}"}
    _, terms = _terms(linear_offset(piece.index, m.sources[piece.source]))
    for atom, _c in terms.items():
        if atom.op == "var" and atom.args[0] in inner:
            continue
        if batched and free_vars(atom) <= {"i0"}:
            continue
        return f"%{v.name} is not a strided load in its last two dims (offset term {atom})"
    return ""


def why_not(low, n, a, b) -> str:
    """Why bf16 GEMM node n (operands a, b) cannot run as a generated kernel ("" when it can)."""
    if n.op not in BF16_OPS:
        return f"{n.op} in bf16: the bf16 GEMM runs mm, bmm, addmm and baddbmm only"
    why = support()
    if why:
        return "bf16: " + why
    for v in (a, b):
        why = strided_operand(low, v, len(v.shape) == 3)
        if why:
            return "bf16: " + why + " (the bf16 GEMM packs strided operands only)"
    return ""


def estimate_us(batch: int, m: int, n: int, k: int, *, copies: tuple[int, ...] = (),
                b_unit_stride: str = "n", torch_speed: float = 1.0) -> tuple[float, float]:
    """(generated kernel, torch) estimated microseconds for one bf16 call (see vtc.codegen.gemm.estimate_us).

    `torch_speed` scales TORCH_GFLOPS, the AMX rate (vtc.plan.cost.library_gemm_speed(dtype=bfloat16): ~0.13
    on a CPU without AMX, where torch's bf16 GEMM runs about as fast as the generated one); the skinny rates
    stay (torch's x @ W^T of a few rows runs at about the same speed with or without AMX)."""
    from vtc.codegen.gemm import CALL_US, COPY_GBPS

    flops = 2.0 * batch * m * n * k
    b_bytes = 2.0 * batch * k * n
    if m <= SKINNY_M:
        (vbw, vrate), (tbw, trate) = SKINNY["dot"], SKINNY["torch"]
        if b_unit_stride != "k":
            vbw, vrate = vbw / 2, VTC_GFLOPS / 2  # B packed into panels first
        vtc = max(b_bytes / (vbw * 1e3), flops / (vrate * 1e3))
        lib = b_bytes / (tbw * 1e3) + flops / (trate * 1e3)
    else:
        vtc = flops / (VTC_GFLOPS * 1e3)
        lib = flops / (TORCH_GFLOPS * torch_speed * 1e3)
    vtc += CALL_US
    lib += sum(CALL_US + 2 * c / (COPY_GBPS * 1e3) for c in copies) + CALL_US
    return vtc, lib


# -- C++ ----------------------------------------------------------------------
RUNTIME = r"""
#ifndef VTC_GEMM_BF16_RUNTIME
#define VTC_GEMM_BF16_RUNTIME
#if !defined(__AVX512BF16__)
#error "the bf16 GEMM needs AVX512_BF16 (vtc.codegen.gemm_bf16.support checks the target before generating it)"
#endif
typedef uint16_t vtc_bf16;

// dst[q * ld + l] = (src[l * ls + 2q * ps], src[l * ls + (2q + 1) * ps]) as one 32-bit word (the even k in the
// low half), 0 past kb; for lines l < lines, 0 for lines <= l < ld (a panel's unused columns)
static inline void vtc_bf16_pack(const vtc_bf16* __restrict src, int64_t ls, int64_t ps, int64_t lines, int64_t kb,
                                 uint32_t* __restrict dst, int64_t ld) {
  const int64_t kq = (kb + 1) / 2;
  int64_t qdone = 0;
  if (ps == 1) {  // pairs are contiguous: a transpose of 32-bit words, 16 x 16 in registers
    qdone = kb / 32 * 16;
    for (int64_t l0 = 0; l0 < lines; l0 += 16) {
      const int nl = (int)std::min<int64_t>(16, lines - l0);
      const __mmask16 keep = (__mmask16)((1u << std::min<int64_t>(16, ld - l0)) - 1u);
      for (int64_t q0 = 0; q0 < qdone; q0 += 16) {
        __m512 r[16];
        #pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          r[i] = i < nl ? _mm512_loadu_ps((const float*)(src + (l0 + i) * ls + 2 * q0)) : _mm512_setzero_ps();
        vtc_transpose16_regs(r);
        #pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) _mm512_mask_storeu_ps((float*)(dst + (q0 + i) * ld + l0), keep, r[i]);
      }
    }
  } else if (ls == 1) {  // lines are contiguous: two k rows interleaved, 16 lines at a time
    qdone = kb / 2;
    for (int64_t q = 0; q < qdone; ++q) {
      const vtc_bf16* s0 = src + 2 * q * ps;
      const vtc_bf16* s1 = s0 + ps;
      for (int64_t l0 = 0; l0 < lines; l0 += 16) {
        const __mmask16 m = (__mmask16)((1u << std::min<int64_t>(16, lines - l0)) - 1u);
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, s0 + l0));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, s1 + l0));
        _mm512_mask_storeu_epi32(dst + q * ld + l0, m, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }
  for (int64_t q = qdone; q < kq; ++q)
    for (int64_t l = 0; l < lines; ++l) {
      const vtc_bf16* s = src + l * ls + 2 * q * ps;
      dst[q * ld + l] = (uint32_t)s[0] | (2 * q + 1 < kb ? (uint32_t)s[ps] << 16 : 0u);
    }
  if (lines < ld)
    for (int64_t q = 0; q < kq; ++q)
      for (int64_t l = lines; l < ld; ++l) dst[q * ld + l] = 0u;
}

// c[R x cols] = (add ? c : 0) + a[kq pairs x MR (R used)] . b[kq pairs x NR], float32 c; with out (the last KC
// slice) that sum goes rounded to bf16 into out[R x cols] (row stride ldo) instead of c
template <int R>
static inline void vtc_bf16_ukr(int64_t kq, const uint32_t* __restrict a, const uint32_t* __restrict b,
                                float* __restrict c, int64_t ldc, bool add, int64_t cols,
                                vtc_bf16* __restrict out, int64_t ldo) {
  const __mmask16 k0 = (__mmask16)(cols >= 16 ? 0xFFFFu : (1u << cols) - 1u);
  const __mmask16 k1 = (__mmask16)(cols >= 32 ? 0xFFFFu : cols <= 16 ? 0u : (1u << (cols - 16)) - 1u);
  __m512 c0[R], c1[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps(); }
  #pragma GCC unroll 2
  for (int64_t q = 0; q < kq; ++q) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + q * VTC_NR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + q * VTC_NR + 16);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[q * VTC_MR + r]);
      c0[r] = _mm512_dpbf16_ps(c0[r], av, b0);
      c1[r] = _mm512_dpbf16_ps(c1[r], av, b1);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    if (add) { c0[r] = _mm512_add_ps(c0[r], _mm512_maskz_loadu_ps(k0, cr)); c1[r] = _mm512_add_ps(c1[r], _mm512_maskz_loadu_ps(k1, cr + 16)); }
    if (out) {  // the last slice: rounded once, straight from the registers (no pass over the float32 block)
      _mm256_mask_storeu_epi16(out + r * ldo, k0, (__m256i)_mm512_cvtneps_pbh(c0[r]));
      _mm256_mask_storeu_epi16(out + r * ldo + 16, k1, (__m256i)_mm512_cvtneps_pbh(c1[r]));
    } else {
      _mm512_mask_storeu_ps(cr, k0, c0[r]);
      _mm512_mask_storeu_ps(cr + 16, k1, c1[r]);
    }
  }
}

__attribute__((noinline)) static void vtc_bf16_ukr_edge(int rows, int64_t cols, int64_t kq, const uint32_t* a,
                                                        const uint32_t* b, float* c, int64_t ldc, bool add,
                                                        vtc_bf16* out, int64_t ldo) {
  if (rows == VTC_MR) { vtc_bf16_ukr<VTC_MR>(kq, a, b, c, ldc, add, cols, out, ldo); return; }
  int r0 = 0;
#define VTC_BF16_ROWS(n) \
  if (rows - r0 >= n) { \
    vtc_bf16_ukr<n>(kq, a + r0, b, c + r0 * ldc, ldc, add, cols, out ? out + r0 * ldo : out, ldo); r0 += n; }
  VTC_BF16_ROWS(8) VTC_BF16_ROWS(4) VTC_BF16_ROWS(2) VTC_BF16_ROWS(1)
#undef VTC_BF16_ROWS
}

// out[r * ldo + j] = bf16(c[r * ldc + j]) for r < rows, j < cols (round to nearest even)
static inline void vtc_bf16_round(const float* __restrict c, int64_t ldc, int64_t rows, int64_t cols,
                                  vtc_bf16* __restrict out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 m = (__mmask16)((1u << std::min<int64_t>(16, cols - j)) - 1u);
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, c + r * ldc + j));
      _mm256_mask_storeu_epi16(out + r * ldo + j, m, (__m256i)v);
    }
}

// s[r][j] = sum_p a[r * lda + p] * w[j * ldw + p], p < kb: rows of A against weight rows, both read along k
template <int R, int J>
static inline void vtc_bf16_dot_rows(int64_t kb, const vtc_bf16* __restrict a, int64_t lda,
                                     const vtc_bf16* __restrict w, int64_t ldw, float* __restrict s, int64_t lds) {
  const int64_t kf = kb / 32 * 32;
  const __mmask32 tail = (__mmask32)((1ull << (kb - kf)) - 1ull);
  __m512 acc[R][J];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p <= kf; p += 32) {
    const __mmask32 m = p < kf ? (__mmask32)0xFFFFFFFFu : tail;
    if (!m) break;
    __m512bh x[R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) x[r] = (__m512bh)_mm512_maskz_loadu_epi16(m, a + r * lda + p);
    #pragma GCC unroll 4
    for (int j = 0; j < J; ++j) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + j * ldw + p);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x[r], wv);
    }
  }
  if constexpr (R == 4 && J == 4) {  // the 16 sums at once: a short K (attention scores) pays no 16 reductions
    const __m512 v = vtc_reduce16(&acc[0][0]);  // (vtc.codegen.gemm's runtime)
    #pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) _mm_storeu_ps(s + r * lds, _mm512_extractf32x4_ps(v, r));
  } else {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) s[r * lds + j] = _mm512_reduce_add_ps(acc[r][j]);
  }
}

template <int J>
static inline void vtc_bf16_dot_j(int64_t m, int64_t kb, const vtc_bf16* a, int64_t lda, const vtc_bf16* w,
                                  int64_t ldw, float* s, int64_t lds) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) vtc_bf16_dot_rows<4, J>(kb, a + i * lda, lda, w, ldw, s + i * lds, lds);
  if (m - i >= 2) { vtc_bf16_dot_rows<2, J>(kb, a + i * lda, lda, w, ldw, s + i * lds, lds); i += 2; }
  if (m - i >= 1) vtc_bf16_dot_rows<1, J>(kb, a + i * lda, lda, w, ldw, s + i * lds, lds);
}

// s[r * 64 + j] = sum_p a[r * lda + p] * w[j * ldw + p] (float32) for r < m <= 16, j < nj <= 64
static inline void vtc_bf16_dot_sums(int64_t m, int64_t nj, int64_t kb, const vtc_bf16* a, int64_t lda,
                                     const vtc_bf16* w, int64_t ldw, float* s) {
  int64_t j = 0;
  for (; j + 4 <= nj; j += 4) vtc_bf16_dot_j<4>(m, kb, a, lda, w + j * ldw, ldw, s + j, 64);
  switch (nj - j) {
    case 3: vtc_bf16_dot_j<3>(m, kb, a, lda, w + j * ldw, ldw, s + j, 64); break;
    case 2: vtc_bf16_dot_j<2>(m, kb, a, lda, w + j * ldw, ldw, s + j, 64); break;
    case 1: vtc_bf16_dot_j<1>(m, kb, a, lda, w + j * ldw, ldw, s + j, 64); break;
  }
}

// out[r * ldo + j] = bf16(sum_p a[r * lda + p] * w[j * ldw + p]) for r < m <= 16, j < n: decode's x @ W^T
__attribute__((noinline)) static void vtc_bf16_dot(int64_t m, int64_t n, int64_t kb, const vtc_bf16* a, int64_t lda,
                                                   const vtc_bf16* w, int64_t ldw, vtc_bf16* out, int64_t ldo) {
  alignas(64) float s[16 * 64];
  for (int64_t j0 = 0; j0 < n; j0 += 64) {
    const int64_t nj = std::min<int64_t>(64, n - j0);
    vtc_bf16_dot_sums(m, nj, kb, a, lda, w + j0 * ldw, ldw, s);
    vtc_bf16_round(s, 64, m, nj, out + j0, ldo);
  }
}
#endif
"""

PANEL_BYTES = 1 << 21  # a thread's packed B block (all of K for its N chunk): about L2


def _load_of(s):
    """The load under casts to bf16 of operand scalar s, or None."""
    while s.op == "cast" and s.dtype == BF16:
        s = s.args[0]
    return s if s.op == "load" and s.dtype == BF16 else None


def generate(k) -> str:
    """The C++ source of bf16 gemm kernel k (see the module docstring)."""
    from vtc.codegen.cpp import PRELUDE, _Emitter, buffer_pointers
    from vtc.codegen.vecmath import LOW_PRECISION_PRELUDE
    from vtc.codegen.gemm import PARALLEL_MIN_FLOPS, RUNTIME as F32_RUNTIME, _strided

    g = k.gemm
    em = _Emitter(k)
    bv, mv, nv = g.vars
    out = k.stores[0].buffer
    if len(k.stores) != 1 or out.dtype not in (BF16, torch.float32):
        raise ValueError(f"bf16 gemm kernel {k.name}: stores {[st.buffer.name for st in k.stores]} are not "
                         f"one bf16 or float32 result (pushed stores are float32 GEMMs' only)")
    epi = k.stores[0].value.op != "acc" or out.dtype != BF16  # else rounded straight from the sums
    ops = {}
    for role, s in (("A", g.a), ("B", g.b)):
        ld = _load_of(s)
        st = _strided(ld, g, em) if ld is not None else None
        if st is None or not st[3].is_const:
            raise ValueError(f"bf16 gemm kernel {k.name}: operand {role} is not a strided bf16 load "
                             f"(gemm_bf16.why_not should have sent it to torch)")
        ops[role] = st
    lines = buffer_pointers(k, em)
    abuf, aoff, aco, _ = ops["A"]
    bbuf, boff, bco, _ = ops["B"]
    sm, ska = aco.get(mv, 0), aco.get("r", 0)
    skb, sn = bco.get("r", 0), bco.get(nv, 0)
    M, N, KK, B = g.m, g.n, g.k, g.batch
    bt = bv or "bt"
    o = em.ptr[out.name]
    flops = 2 * B * M * N * KK
    lines += [f"  const int64_t M = {M}, N = {N}, K = {KK}, BATCH = {B};",
              f"  const int nt = {flops}LL >= {PARALLEL_MIN_FLOPS}LL && nthreads > 1 ? nthreads : 1;"]
    store = _epilogue(em, k, bt, "        ") if epi else None
    if M <= SKINNY_M and skb == 1:
        lines += _dot_body(em, bt, abuf, aoff, sm, ska, bbuf, boff, sn, o, store)
    else:
        lines += _panel_body(em, bt, abuf, aoff, sm, ska, bbuf, boff, skb, sn, o, store)
    head = PRELUDE + F32_RUNTIME + RUNTIME + (LOW_PRECISION_PRELUDE if epi else "")
    return head + f'\nextern "C" void {k.name}(void* const* bufs, int nthreads) {{\n' + "\n".join(lines) + "\n}\n"


def _epilogue(em, k, bt: str, ind: str) -> list[str]:
    """C storing kernel k's value (a fused bias, activation, residual, scale, cast: the pointwise kernel that
    finishes the GEMM, vtc.codegen.lower) over a finished block of float32 sums: rows ii < mb, columns jj < nb of
    `sums` (row stride lds), the block's first element at (m0, n0) of batch `bt`; rounded once at the store."""
    from vtc.codegen.gemm import block_values

    st = k.stores[0]
    lines = block_values(em, st.value, k.gemm.vars, ind, "sums[ii * lds + jj]",
                         lambda: f"{em.ptr[st.buffer.name]}[{em.linear(st.buffer.name, st.index)}] = "
                                 f"{em.stored(st.value, st.buffer.dtype)}")
    em.forget()
    return lines + [f"{ind}}}"]


def _split(lines_m: str) -> list[str]:
    """C lines making the block counts tm x tn (x BATCH) a multiple of the thread count (as the float32 GEMM)."""
    return [
        "  if ((BATCH * tm * tn) % nt) {",
        f"    if ({lines_m}) {{",
        "      tm = (tm + nt - 1) / nt * nt; mc = ((M + tm - 1) / tm + VTC_MR - 1) / VTC_MR * VTC_MR; tm = (M + mc - 1) / mc;",
        "    } else {",
        "      tn = (tn + nt - 1) / nt * nt; nc = ((N + tn - 1) / tn + VTC_NR - 1) / VTC_NR * VTC_NR; tn = (N + nc - 1) / nc;",
        "    }",
        "  }"]


def _dot_body(em, bt, abuf, aoff, sm, ska, bbuf, boff, sn, o, store=None) -> list[str]:
    """Skinny: each thread takes N chunks of 64 columns; A's rows read in place when unit stride along k,
    else packed once per chunk.  `store`: the epilogue over a chunk's float32 sums (else rounded as they are)."""
    from vtc.codegen.cpp import OMP_TEAM

    a_in_place = ska == 1
    return [
        "  int64_t mc = M, nc = 64, tm = 1, tn = (N + nc - 1) / nc;",
        *_split("false"),
        "  const int64_t units = BATCH * tn;",
        *OMP_TEAM,
        "    vtc_bf16* __restrict ap = (vtc_bf16*)vtc_gemm_scratch(0, (M * K + 1) / 2);",
        "    int64_t packed = -1;  // the batch whose A rows are in ap",
        "    for (int64_t u = units * tid / nth; u < units * (tid + 1) / nth; ++u) {",
        f"      const int64_t {bt} = u / tn;",
        "      const int64_t n0 = (u % tn) * nc, nb = std::min<int64_t>(nc, N - n0);",
        f"      const vtc_bf16* __restrict asrc = {em.ptr[abuf]} + {aoff};",
        *(["      const vtc_bf16* __restrict arows = asrc;", f"      const int64_t lda = {sm};"] if a_in_place else [
            f"      if ({bt} != packed) {{  // A's rows packed once per batch",
            "        for (int64_t i = 0; i < M; ++i)",
            f"          for (int64_t p = 0; p < K; ++p) ap[i * K + p] = asrc[i * {sm} + p * {ska}];",
            f"        packed = {bt};",
            "      }",
            "      const vtc_bf16* __restrict arows = ap;",
            "      const int64_t lda = K;"]),
        *([f"      vtc_bf16_dot(M, nb, K, arows, lda, {em.ptr[bbuf]} + {boff} + n0 * {sn}, {sn}, "
           f"{o} + {bt} * M * N + n0, N);"] if store is None else [
            "      {",
            "        alignas(64) float sums[16 * 64];",
            "        const int64_t m0 = 0, lds = 64, mb = M;",
            f"        vtc_bf16_dot_sums(M, nb, K, arows, lda, {em.ptr[bbuf]} + {boff} + n0 * {sn}, {sn}, sums);",
            *store,
            "      }"]),
        "    }",
        "  }"]


def _panel_body(em, bt, abuf, aoff, sm, ska, bbuf, boff, skb, sn, o, store=None) -> list[str]:
    """Packed panels: per N chunk all of B's K once, per MC block and KC slice A, a float32 block rounded at
    the end (by the micro-kernel; with `store`, an epilogue, by that pass over the block)."""
    from vtc.codegen.cpp import OMP_TEAM

    return [
        "  const int64_t KQ = (K + 1) / 2;  // k pairs",
        f"  int64_t mc = VTC_MC, nc = std::max<int64_t>(VTC_NR, std::min<int64_t>(1024, {PANEL_BYTES} / (4 * KQ) / VTC_NR * VTC_NR));",
        "  int64_t kq = 128;  // pairs per KC slice: an A micro-panel (MR x 2kq) in L1",
        "  kq = (KQ + (KQ + kq - 1) / kq - 1) / ((KQ + kq - 1) / kq);  // equal slices",
        "  int64_t tm = (M + mc - 1) / mc, tn = (N + nc - 1) / nc;",
        *_split("M >= N && M >= 2 * nt * VTC_MR"),
        "  const int64_t units = BATCH * tn * tm;",
        *OMP_TEAM,
        "    uint32_t* __restrict ap = (uint32_t*)vtc_gemm_scratch(0, mc * kq);",
        "    uint32_t* __restrict bp = (uint32_t*)vtc_gemm_scratch(1, KQ * ((nc + VTC_NR - 1) / VTC_NR * VTC_NR));",
        "    float* __restrict acc = vtc_gemm_scratch(2, mc * nc);",
        "    int64_t packed = -1;  // the N chunk (batch x chunk) whose B is in bp",
        "    for (int64_t u = units * tid / nth; u < units * (tid + 1) / nth; ++u) {",
        "      const int64_t grp = u / tm, mi = u % tm;",
        f"      const int64_t {bt} = grp / tn;",
        "      const int64_t n0 = (grp % tn) * nc, nb = std::min<int64_t>(nc, N - n0);",
        "      if (grp != packed) {",
        f"        const vtc_bf16* __restrict bsrc = {em.ptr[bbuf]} + {boff} + n0 * {sn};",
        "        for (int64_t jr = 0; jr < nb; jr += VTC_NR)",
        f"          vtc_bf16_pack(bsrc + jr * {sn}, {sn}, {skb}, std::min<int64_t>(VTC_NR, nb - jr), K, bp + jr * KQ, VTC_NR);",
        "        packed = grp;",
        "      }",
        "      const int64_t m0 = mi * mc, mb = std::min<int64_t>(mc, M - m0);",
        f"      const vtc_bf16* __restrict asrc = {em.ptr[abuf]} + {aoff} + m0 * {sm};",
        *([f"      vtc_bf16* __restrict cout = {o} + {bt} * M * N + m0 * N + n0;"] if store is None else []),
        "      for (int64_t q0 = 0; q0 < KQ; q0 += kq) {",
        "        const int64_t qb = std::min<int64_t>(kq, KQ - q0), kb = std::min<int64_t>(2 * qb, K - 2 * q0);",
        *(["        const bool last = q0 + qb >= KQ;  // the micro-kernel rounds the sums into the output"]
          if store is None else []),
        "        for (int64_t ir = 0; ir < mb; ir += VTC_MR)",
        f"          vtc_bf16_pack(asrc + ir * {sm} + 2 * q0 * {ska}, {sm}, {ska}, std::min<int64_t>(VTC_MR, mb - ir), kb, "
        "ap + ir * qb, VTC_MR);",
        "        for (int64_t ir = 0; ir < mb; ir += VTC_MR)  // an A micro-panel stays in L1, B panels stream from L2",
        "          for (int64_t jr = 0; jr < nb; jr += VTC_NR)",
        "            vtc_bf16_ukr_edge((int)std::min<int64_t>(VTC_MR, mb - ir), std::min<int64_t>(VTC_NR, nb - jr), qb,",
        "                              ap + ir * qb, bp + jr * KQ + q0 * VTC_NR, acc + ir * nc + jr, nc, q0 > 0,",
        "                              " + ("last ? cout + ir * N + jr : nullptr, N);" if store is None else "nullptr, 0);"),
        "      }",
        *([] if store is None else ["      {", "        const float* __restrict sums = acc;",
                                    "        const int64_t lds = nc;", *store, "      }"]),
        "    }",
        "  }"]
