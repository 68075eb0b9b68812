"""Flash-attention C++ for the attention kernel: prefill tiles (queries as vector lanes) and GQA decode.

``vtc.codegen.attention`` finds bmm -> score chain -> softmax -> bmm and
builds an ``AttentionKernel``; where many queries of one head read the same K
and V rows (prefill: K and V do not depend on the query), ``emit_tiled`` emits
this form.  A task is a tile of ``QUERY_TILE`` queries of one head, or of the
heads of a GQA group together (``head_group``: they read the same K and V rows,
so a short chunk or the few queries of speculative decoding fill the lanes and
each K / V row is read once for the group) (64: four
AVX-512 registers of float, one query per lane; a tile of at most 16 or 32
queries, a short prefill chunk or the last tile, runs on one or two vectors of
lanes, chosen at run time); OpenMP hands out the tasks dynamically, the longest
first (a causal tile near the end sees the most keys).  Per task Qᵀ is packed
once (``qt[d][query]``), then per block of ``KB`` keys:

- K and V rows of the block are read in place where their mapping is a strided
  view with consecutive elements along the head / value dim (``in_place``: the
  GQA head mapping and a KV cache included), else packed through the mapping
  (``kp[key][d]``, ``vp[key][e]``); a row's partial last vector is read by a
  masked load (``row_vector``);
- scores Sᵀ[key][query] = Σ_d K[key][d] · Qᵀ[d][query] by a register-blocked
  micro-kernel (``KG`` keys x the query vectors of accumulators, K broadcast
  from L1): a small GEMM, no horizontal sums;
- the score chain (scale, soft-cap, mask: a causal predicate is index
  arithmetic) per element, vectorised over the queries; its terms that read a
  buffer but not the key (a mask's ``cache_position[query]``) are read once
  per task into lane arrays (``lq<j>[q]``), not gathered for every key;
- the online softmax per query *lane*: the block max and the sum of
  probabilities are vertical vector operations over the keys, with the
  vectorised ``vtc_exp`` of ``vtc.codegen.vecmath``;
- O[query][e] = O * correction + Σ_key P · V by a second micro-kernel
  (``QG`` queries x the value dim in accumulators, P broadcast); where a mask
  may hide part of the block, over the keys from the first to the last with
  P != 0 for one of the step's queries (kept by the softmax: ``plo``, ``phi``).

Key blocks that a predicate mask hides from every query of the tile are not
visited (``key_range``: a causal mask ``key > query + c`` bounds the keys from
above, a sliding window ``key <= query - w`` from below), so causal attention
does half the work.  An additive mask (``additive_mask``: transformers'
``finfo.min`` masks, a mask input, a mask built from ``cache_position``) is
unknown at compile time: a key block whose mask values hide it from every query
of the tile (all <= -2^127) is skipped at run time, exactly
(``hidden_block_check``; a tile with a row that saw only hidden keys, whose
softmax torch makes uniform over them, runs again without skipping).  A value row holding inf or NaN is detected per key block
(0 * v summed); that block then adds only the keys whose probability is not 0,
so a masked garbage row does not turn the output into NaN (as the row-by-row
form does).

GQA decode (``shared_scores``, ``shared_softmax``, ``shared_pv``): the query
heads of one KV group are the rows of one task, so each K and V element is
read once for all of them, in place where the cache is a strided view.  With
keys as the lanes, a score needs a sum over the head dim: per key the products
are summed over the head dim's vectors into one vector, and ``vtc_sum16`` turns
16 such vectors into 16 scores by a tree of two-source permutes.  The block
softmax and PV (``qg`` rows x the value dim in registers, P broadcast) follow;
``emit_attention`` splits the keys across tasks when there are few groups.  Any
head and value dim: rows are padded to whole vectors (q with zeros, a K or V
row read in place by a masked last load, a packed row zero-filled).

The dot products use FMA intrinsics (``vtc_fma16``): the build turns off
contraction of ``a * b + c`` so that elementwise kernels match torch bit for
bit, which would cost these micro-kernels a multiply and an add each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vtc.codegen.kernel_ir import Scalar, decided_ranges, scalars_under
from vtc.index.expr import add, affine, mul, subs, var
from vtc.index.mapping import linear_offset

LANES = 16  # floats per AVX-512 register (the vector-extension type below; AVX2 splits it in two)
KEY_BLOCK = 64  # keys per online-softmax step of the prefill
DECODE_KEY_BLOCK = 128  # keys per online-softmax step of a GQA group (a block of V, 32 KB at 64 floats, stays in L1)
ACCUMULATORS = 16  # vector accumulators per micro-kernel (of the 32 AVX-512 registers)
MAX_DIM = 256  # head / value dims up to which the packed blocks stay small enough for the stack
# queries per prefill task: four vectors of lanes (each K and V row read for 64 queries; 32 took ~1.4x the
# time of attn_causal).  One tile for every query count, so that the kernel text does not change with the
# prompt length (vtc.runtime.generic: a new length reuses the kernel); a tile with at most 16 or 32 queries
# (a short chunk, the last tile) runs on one or two vectors of lanes, chosen at run time (a score
# micro-kernel for each).
QUERY_TILE = 4 * LANES
PV_KEY_RANGE = True  # the PV micro-kernel of a query group visits only the keys from its first to its last p != 0
LANE_TERMS = True  # the score chain's per-query loads (cache_position[i1]) read once per tile into lane arrays
# the score chain's float loads at base(query) + key (a relative-position bias, a window or padding mask) staged
# per key block by 16 x 16 register transposes of their rows into key x query tiles (``kt<j>[t][q]``), read as
# vectors by the chain, instead of one gathered element per lane and key in a loop gcc leaves scalar (its
# per-lane ``i0 % heads``); a load with a key stride above 1 (a [N, N, heads] bias read through a permute) is
# gathered over the lanes from a row base computed once per tile (docs/prefill.md: Swin-T)
KEY_ROWS = True
# a key row load with a key stride c > 1 (Swin's [N * N, heads] relative-position bias read through its permute):
# the buffer (static, at most half as many floats as the loads it serves) is transposed once per call into
# [c][N / c] rows, so that each lane's row is contiguous along the key and staged by register transposes (as
# c = 1) instead of gathered element by element in every tile (docs/prefill.md: session 16)
KEY_ROWS_T = True
# the vectors that the micro-kernels reuse across FMAs (Qᵀ's in the score step, V's in the PV step) are pinned
# to registers (``VTC_IN_REG``): gcc 12 folded each use into its FMA as a memory operand, 16 loads of 64 bytes
# per 16 FMAs in the PV step, more than the two a cycle that Zen 5's load ports take (docs/prefill.md, session
# 18: llama3_prefill_b1's kernel 1.21 -> 0.82 ms at 1 thread); False: the code before, for A / B runs
PIN_OPERANDS = True
# Qᵀ's rows computed per range of the head dim over which q's piece choices on d alone are decided (RoPE's
# rotate_half, d < D / 2, inlined into the attention kernel): loops without a branch, which gcc vectorises (one
# loop with the choice's two loads under a branch ran scalar; in float16 each widening and rounding a call)
Q_PIECES = True
MAX_Q_PIECES = 4


def decode_key_block(k) -> int:
    """Keys per online-softmax step of a GQA-decode task: ``DECODE_KEY_BLOCK``, fewer (whole vectors) for a
    head / value dim above ``MAX_DIM``, so that a packed block stays as small on the stack."""
    dim = max(k.head_dim, k.value_dim)
    return DECODE_KEY_BLOCK if dim <= MAX_DIM else max(LANES, DECODE_KEY_BLOCK * MAX_DIM // dim // LANES * LANES)


def _sum16_masks() -> str:
    """C declarations of the permute indices of ``vtc_sum16``'s four levels (a{1..4}, b{1..4}).

    A level takes two vectors u, w holding groups of P partial sums each (P = 16, 8, 4, 2) and keeps
    groups of P / 2: ``a`` picks the first half of every group of u, then of w (indices 16.. are w's
    lanes), ``b`` the second halves; a + b is the next level, still in the order of the sums.
    """
    lines = []
    for level, p in enumerate((16, 8, 4, 2), 1):
        a, b = [], []
        for src in (0, LANES):
            for g in range(LANES // p):
                a += [src + g * p + i for i in range(p // 2)]
                b += [src + g * p + p // 2 + i for i in range(p // 2)]
        lines += [f"  const __m512i a{level} = _mm512_setr_epi32({', '.join(map(str, a))});",
                  f"  const __m512i b{level} = _mm512_setr_epi32({', '.join(map(str, b))});"]
    return "\n".join(lines)


PRELUDE = r"""
#ifndef VTC_FLASH_PRELUDE  // kernels are built several to a source
#define VTC_FLASH_PRELUDE
#include <cstdlib>
#include <immintrin.h>
typedef float vtc_v16 __attribute__((vector_size(64)));
// c + a * b rounded once: the build turns off contraction of a * b + c, and these dot products want the FMA
static inline vtc_v16 vtc_fma16(vtc_v16 a, vtc_v16 b, vtc_v16 c) {
#if defined(__AVX512F__)
  return (vtc_v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX__) && defined(__FMA__)
  __m256 a0, a1, b0, b1, c0, c1;
  __builtin_memcpy(&a0, &a, 32); __builtin_memcpy(&a1, (const char*)&a + 32, 32);
  __builtin_memcpy(&b0, &b, 32); __builtin_memcpy(&b1, (const char*)&b + 32, 32);
  __builtin_memcpy(&c0, &c, 32); __builtin_memcpy(&c1, (const char*)&c + 32, 32);
  c0 = _mm256_fmadd_ps(a0, b0, c0); c1 = _mm256_fmadd_ps(a1, b1, c1);
  vtc_v16 r; __builtin_memcpy(&r, &c0, 32); __builtin_memcpy((char*)&r + 32, &c1, 32);
  return r;
#else
  return a * b + c;
#endif
}
static inline vtc_v16 vtc_load16(const float* p) { vtc_v16 r; __builtin_memcpy(&r, p, 64); return r; }
// v stays in a register where it is used: an empty asm that claims to change it, so that the compiler can neither
// fold a later use into an instruction as a memory operand nor load it again (PIN_OPERANDS)
#if defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
#define VTC_IN_REG(v) __asm__("" : "+v"(v))
#else
#define VTC_IN_REG(v) ((void)0)
#endif
// p[0..n) in lanes 0..n-1 and zeros above (n < 16): nothing past p[n - 1] is read (the tail of a row)
static inline vtc_v16 vtc_load16_n(const float* p, int n) {
#if defined(__AVX512F__)
  return (vtc_v16)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
#else
  vtc_v16 r = {};
  __builtin_memcpy(&r, p, 4 * n);
  return r;
#endif
}
#if defined(__AVX512F__)
// a float16 row (in_place with f16): 16 elements widened, or p[0..n) and zeros above
static inline vtc_v16 vtc_load16(const uint16_t* p) {
  return (vtc_v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
static inline vtc_v16 vtc_load16_n(const uint16_t* p, int n) {
  return (vtc_v16)_mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p));
}
#endif
static inline vtc_v16 vtc_splat16(float x) {  // x in every lane (a broadcast load where x is in memory)
#if defined(__AVX512F__)
  return (vtc_v16)_mm512_set1_ps(x);
#else
  vtc_v16 r;
  for (int i = 0; i < 16; ++i) r[i] = x;
  return r;
#endif
}
// dst[j * ds + i] = src[i * ss + j] for i, j < 16: a 16 x 16 block transposed in registers (unpack, then
// shuffles of pairs, then of 128-bit quarters), 16 loads and 16 stores where one float at a time would be 256;
// the sequence of gemm.py's vtc_transpose16, which is defined only in the GEMM runtime and only for AVX-512
static inline void vtc_flash_transpose16(const float* src, int64_t ss, float* dst, int64_t ds) {
#if defined(__AVX512F__)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ss);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ds, r[i]);
#else
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) dst[j * ds + i] = src[i * ss + j];
#endif
}
// lane t of the result = the sum of x[t]'s lanes (16 horizontal sums as a tree of two-source permutes)
static inline vtc_v16 vtc_sum16(const vtc_v16* x) {
#if defined(__AVX512F__)
%(sum16_masks)s
  __m512 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 u = (__m512)x[2 * i], w = (__m512)x[2 * i + 1];
    l1[i] = _mm512_add_ps(_mm512_permutex2var_ps(u, a1, w), _mm512_permutex2var_ps(u, b1, w));
  }
  for (int i = 0; i < 4; ++i)
    l2[i] = _mm512_add_ps(_mm512_permutex2var_ps(l1[2 * i], a2, l1[2 * i + 1]),
                          _mm512_permutex2var_ps(l1[2 * i], b2, l1[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    l3[i] = _mm512_add_ps(_mm512_permutex2var_ps(l2[2 * i], a3, l2[2 * i + 1]),
                          _mm512_permutex2var_ps(l2[2 * i], b3, l2[2 * i + 1]));
  return (vtc_v16)_mm512_add_ps(_mm512_permutex2var_ps(l3[0], a4, l3[1]), _mm512_permutex2var_ps(l3[0], b4, l3[1]));
#else
  vtc_v16 r;
  for (int t = 0; t < 16; ++t) {
    float s = 0.0f;
    for (int l = 0; l < 16; ++l) s += x[t][l];
    r[t] = s;
  }
  return r;
#endif
}
#endif
""" % dict(sum16_masks=_sum16_masks())


@dataclass
class Rows:
    """A K or V operand read in place: row ``r`` (a key) starts at ``base + r * stride`` elements from ``ptr``
    and its elements (head / value dim) are consecutive."""

    ptr: str  # the C pointer of the buffer
    base: str  # C offset of key r0's row (the enclosing code defines r0 and the row variables)
    stride: int
    ctype: str = "float"  # of the elements: float, or uint16_t for float16 (widened by vtc_load16's overloads)

    def element(self, x: str) -> str:
        """C element x of a row as a float."""
        return f"vtc_from_f16({x})" if self.ctype == "uint16_t" else x


def row_vector(ptr: str, v: int, dim: int) -> str:
    """C expression of vector `v` (floats 16v .. 16v + 15) of a row of `dim` floats at `ptr`: a plain load,
    or for the row's last, partial vector a masked one (zeros above the row's end, nothing past it read)."""
    rest = dim - LANES * v
    return f"vtc_load16({ptr} + {LANES * v})" if rest >= LANES else f"vtc_load16_n({ptr} + {LANES * v}, {rest})"


def in_place(s: Scalar, em, col: str, col_extent: int, n: int, f16: bool = False) -> Rows | None:
    """How to read operand `s` (over key ``r`` and `col`) in place, or None where it must be packed:
    a float32 load (or with `f16`, on AVX-512, a float16 load widened: the decode forms, which read a row as
    vectors) whose offset steps by 1 along `col` and by a constant along ``r`` (a strided view of a physical
    tensor, the GQA head mapping included)."""
    from vtc.codegen.conv_t import has_avx512

    widened = (f16 and s.op == "cast" and s.dtype == torch.float32 and s.args[0].op == "load"
               and s.args[0].dtype == torch.float16 and has_avx512())
    s = s.args[0] if widened else s
    if s.op != "load" or s.dtype != (torch.float16 if widened else torch.float32) or s.args[0] not in em.ptr:
        return None
    off = linear_offset(s.args[1], em.shapes[s.args[0]])
    r, c = var("r", n), var(col, col_extent)
    step_c = add(subs(off, {col: add(c, 1)}), mul(off, -1))
    step_r = add(subs(off, {"r": add(r, 1)}), mul(off, -1))
    if not (step_c.is_const and step_c.value == 1 and step_r.is_const):
        return None
    return Rows(em.ptr[s.args[0]], em.index(subs(off, {col: 0, "r": var("r0", n)})), step_r.value,
                "uint16_t" if widened else "float")


def key_range(score: Scalar) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Affine bounds on the keys a predicate mask leaves visible, from the score chain.

    The score is walked down through ``where(cond, -inf, x)`` (and casts); each compare of
    ``iota`` index values in ``cond`` (or an ``or`` of them) that is affine in the key ``r`` with
    coefficient +-1 and in the query ``i1`` gives a bound.  Returns (lower bounds, upper bounds) as
    (constant, coefficient of i1) pairs: visible keys satisfy r >= c + a*i1 for every lower bound and
    r < c + a*i1 for every upper one.  Other masks give no bounds (every key is visited).
    """
    lows: list[tuple[int, int]] = []
    highs: list[tuple[int, int]] = []
    s = score
    while True:
        if s.op == "cast":
            s = s.args[0]
        elif s.op == "where" and _is_minus_inf(s.args[1]):
            _bounds(s.args[0], lows, highs)
            s = s.args[2]
        elif s.op == "where" and _is_minus_inf(s.args[2]) and s.args[0].op == "unary" \
                and s.args[0].args[0] == "logical_not":
            _bounds(s.args[0].args[1], lows, highs)
            s = s.args[1]
        else:
            return lows, highs


# A mask value at or below HIDDEN (-2^127: torch.finfo(float32).min and -inf are) hides its key; a row whose
# running max is above SAFE_MAX (-2^126) gives such a key a probability of exactly 0 (see hidden_block_check).
HIDDEN = "-1.70141183e38f"
SAFE_MAX = "-8.50705917e37f"


def head_dim_pieces(q: Scalar, dd: int) -> list[tuple[int, int]]:
    """Ranges [lo, hi) of the head dim d, in order, over each of which every piece choice of q that depends
    on d alone is decided (``Q_PIECES``, ``kernel_ir.decided_ranges``); the whole range where there is none,
    or more than MAX_Q_PIECES."""
    return decided_ranges([q], "d", dd, MAX_Q_PIECES) if Q_PIECES else [(0, dd)]


def additive_mask(score: Scalar) -> Scalar | None:
    """The mask term m of a score chain ``x + m`` whose m does not read the dot product (an additive mask,
    such as transformers' ``finfo.min`` masks, a graph input or built from indices), or None; walked
    down through casts and ``where(cond, -inf, ...)`` as ``key_range``."""
    s = score
    while s.op == "cast" or (s.op == "where" and _is_minus_inf(s.args[1])):
        s = s.args[0] if s.op == "cast" else s.args[2]
    if s.op != "binary" or s.args[0] != "add":
        return None
    free = [x for x in s.args[1:] if not any(y.op == "acc" for y in scalars_under([x]))]
    return free[0] if len(free) == 1 else None


def hidden_block_check(pre_m: list[str], mx: str, outer: list[str], inner: list[str], ind: str) -> list[str]:
    """C lines that skip a key block (``continue``, setting ``skipped``) when ``skip_ok`` and the additive
    mask (``pre_m``, expression ``mx``) hides every key of the block from every row of the task.

    Exact: a hidden key's score is c + m <= c - 2^127 (c: the score before the mask), so where the row's
    max M ends above SAFE_MAX and c < 2^126 - 104, exp(c + m - M) is 0 in float32 (in torch too).  A task
    with a row whose max ends at or below SAFE_MAX (every key it visited hidden; a row whose every key
    is hidden gets torch's uniform softmax over them) is computed again without skipping.  `outer` opens
    the loop over one operand (with ``!seen`` in its condition) and `inner` the ``omp simd`` loop over
    the other, each with the index variables the mask reads; a NaN mask value counts as seen.
    """
    return [
        f"{ind}if (skip_ok) {{  // hidden from every row by the additive mask: adds exactly 0",
        f"{ind}  int seen = 0;  // an int, not a bool: the reduction below stays in vector lanes",
        f"{ind}  {outer[0]}", *[f"{ind}    {x}" for x in outer[1:]],
        f"{ind}    #pragma omp simd reduction(|:seen)",
        f"{ind}    {inner[0]}", *[f"{ind}      {x}" for x in inner[1:]],
        *[f"{ind}      {x.strip()}" for x in pre_m],
        f"{ind}      seen |= !({mx} <= {HIDDEN});  // | not ||: no branch, so the loop is vector code",
        f"{ind}    }}",
        f"{ind}  }}",
        f"{ind}  if (!seen) {{ skipped = true; continue; }}",
        f"{ind}}}"]


# Where a row's running max mu exceeds a key's score by EXP_ZERO_GAP or more, the kernel's exp(score - mu) is 0:
# vtc_exp returns 0 below -87.5 (its clamp), expf with denormals below -103.98.
EXP_ZERO_GAP = 128.0
# x + m <= mu - MASK_MARGIN leaves the score, x + m rounded to float16 (half an ulp: at most 16), EXP_ZERO_GAP below mu
MASK_MARGIN = 256.0
BOUNDED_SKIP = True  # float16 masks: skip a key block whose scores lie EXP_ZERO_GAP below each row's max
_MONOTONE = ("add", "sub", "mul", "div")


def bounded_term(score: Scalar) -> Scalar | None:
    """The term x of a score chain ``x + m`` where ``bounded_block_check`` applies, else None: an additive
    float16 mask m (its finfo.min, -65504, is above HIDDEN) added in float16 or float32, only casts to float32
    above the add (the score is x + m rounded once), and x made of the dot product (read once), constants,
    floating casts and add / sub / mul of a term without it or a division of it (in floating point): monotone
    in the dot product and the same for every key, so that its values at -B and B bound it for every dot
    product in [-B, B]."""
    s = score
    while s.op == "cast" and s.dtype == torch.float32:
        s = s.args[0]
    mask = additive_mask(score)
    if (not BOUNDED_SKIP or mask is None or mask.dtype != torch.float16 or s.op != "binary" or s.args[0] != "add"
            or mask not in s.args[1:] or s.dtype not in (torch.float16, torch.float32)):
        return None
    x = s.args[2] if s.args[1] is mask else s.args[1]
    if any(y.op not in ("acc", "const") and not (y.dtype.is_floating_point and (
            y.op == "cast" or (y.op == "binary" and y.args[0] in _MONOTONE))) for y in scalars_under([x])):
        return None
    y = x
    while y.op != "acc":  # one path to the dot product; a division only of it
        side = [z for z in (y.args[:1] if y.op == "cast" else y.args[1:]) if _reads_acc(z)]
        if len(side) != 1 or (y.op == "binary" and y.args[0] == "div" and side[0] is not y.args[1]):
            return None
        y = side[0]
    return x


def _reads_acc(x: Scalar) -> bool:
    return any(y.op == "acc" for y in scalars_under([x]))


def key_block_bounds(pre_k: list[str], kx: str, dd: int, n: int, groups: int, g: int) -> tuple[list[str], list[str]]:
    """C lines before and after a tiled kernel's loop over the tiles that hold in ``kbm_[group * nb + block]``
    the largest sum_d |k_d| of the key block's keys (NaN kept), for ``bounded_block_check``."""
    nb = -(-n // KEY_BLOCK)
    return [
        f"  float* kbm_ = (float*)std::malloc(sizeof(float) * {groups * nb});  // per key block: max_key sum_d |k_d|",
        f"  for (int64_t grp = 0; grp < {groups}; ++grp) {{",
        f"    const int64_t i0 = grp * {g}, i1 = 0;  // K rows do not depend on the query",
        f"    for (int64_t r = 0; r < {n}; ++r) {{",
        "      float kl1_ = 0.0f;",
        "      #pragma omp simd reduction(+:kl1_)",
        f"      for (int64_t d = 0; d < {dd}; ++d) {{", *[f"    {x}" for x in pre_k],
        f"        kl1_ += std::fabs({kx});",
        "      }",
        f"      float& m_ = kbm_[grp * {nb} + r / {KEY_BLOCK}];",
        f"      m_ = r % {KEY_BLOCK} == 0 || kl1_ > m_ || kl1_ != kl1_ ? kl1_ : m_;",
        "    }",
        "  }"], ["  std::free(kbm_);"]


def bounded_block_check(term: tuple[list[str], str], pre_m: list[str], m: str, nb: int, g: int, ind: str) -> list[str]:
    """C lines that skip a key block (``continue``) whose every key's probability the kernel computes as
    exactly 0 for every query of the tile (``bounded_term``: a float16 mask).

    |dot product| <= max_d |q_d| * sum_d |k_d| <= B (``mq[q]`` times the block's ``kbm_``, each rounded up by a
    factor 1.001, enough for head dims up to ~6700, plus 1e-30 for underflow); `term` (lines, expression of
    the chain's term x with the dot product ``b_``) at -B and B bounds x by xm.  Where the running max mx and
    xm are finite and every mask value (`pre_m`, `m`) of the block is at most mx - xm - MASK_MARGIN (float
    rounding of that: < 0.01), each score, x + m rounded once, lies EXP_ZERO_GAP or more below mx: the block
    max leaves mx as it is, the correction is exp(0) = 1 and each probability exp(score - mx) is 0, so
    skipping the block changes nothing, bit for bit.  A NaN on the way fails the compares (the block is
    computed).  Keys are checked in order, stopping at the first one that may count."""
    return [
        f"{ind}{{  // every score of the block >= {EXP_ZERO_GAP} below its row's max: probabilities exactly 0",
        f"{ind}  const float kb_ = kbm_[(i0 / {g}) * {nb} + r0 / {KEY_BLOCK}] * 1.001f;",
        f"{ind}  alignas(64) float th_[{QUERY_TILE}];  // per query: the largest mask value that hides a key",
        f"{ind}  #pragma omp simd",
        f"{ind}  for (int64_t q = 0; q < nr; ++q) {{",
        f"{ind}    const float bq_ = mq[q] * kb_ + 1e-30f;",
        f"{ind}    float hi_, lo_;",
        f"{ind}    {{", f"{ind}      const float b_ = bq_;", *[f"{ind}  {x}" for x in term[0]],
        f"{ind}      hi_ = {term[1]};", f"{ind}    }}",
        f"{ind}    {{", f"{ind}      const float b_ = -bq_;", *[f"{ind}  {x}" for x in term[0]],
        f"{ind}      lo_ = {term[1]};", f"{ind}    }}",
        f"{ind}    const float xm_ = hi_ > lo_ ? hi_ : lo_;",
        f"{ind}    const bool finite_ = hi_ > -INFINITY && hi_ < INFINITY && lo_ > -INFINITY && lo_ < INFINITY",
        f"{ind}                         && mx[q] > -INFINITY && mx[q] < INFINITY;",
        f"{ind}    th_[q] = finite_ ? mx[q] - xm_ - {MASK_MARGIN}f : NAN;  // NaN: hides nothing",
        f"{ind}  }}",
        f"{ind}  int seen = 0;",
        f"{ind}  for (int64_t t = 0; t < nk && !seen; ++t) {{",
        f"{ind}    const int64_t r = r0 + t;",
        f"{ind}    #pragma omp simd reduction(|:seen)",
        f"{ind}    for (int64_t q = 0; q < nr; ++q) {{",
        f"{ind}      const int64_t i0 = li0[q], i1 = li1[q];", *[f"{ind}  {x.strip()}" for x in pre_m],
        f"{ind}      seen |= !({m} <= th_[q]);",
        f"{ind}    }}",
        f"{ind}  }}",
        f"{ind}  if (!seen) continue;",
        f"{ind}}}"]


def _is_minus_inf(s: Scalar) -> bool:
    return s.op == "const" and s.args[0] == float("-inf")


def _affine_of(s: Scalar) -> tuple[int, dict[str, int]] | None:
    """An integer scalar made of index values (``iota``), integer constants, +, - and * by a constant as
    (constant, {index variable: coefficient}), or None."""
    if s.dtype.is_floating_point or s.dtype == torch.bool:
        return None
    if s.op == "iota":
        return affine(s.args[0])
    if s.op == "const":
        return int(s.args[0]), {}
    if s.op == "cast":
        return _affine_of(s.args[0])
    if s.op != "binary" or s.args[0] not in ("add", "sub", "mul"):
        return None
    fa, fb = _affine_of(s.args[1]), _affine_of(s.args[2])
    if fa is None or fb is None:
        return None
    if s.args[0] == "mul":
        if fa[1] and fb[1]:
            return None
        (k, _), (c, terms) = (fa, fb) if not fa[1] else (fb, fa)
        return c * k, {v: x * k for v, x in terms.items()}
    sign = 1 if s.args[0] == "add" else -1
    terms = dict(fa[1])
    for v, x in fb[1].items():
        terms[v] = terms.get(v, 0) + sign * x
    return fa[0] + sign * fb[0], terms


def _bounds(cond: Scalar, lows: list, highs: list) -> None:
    """Adds the key bounds that a true `cond` (masked) implies the visible keys satisfy."""
    if cond.op == "binary" and cond.args[0] in ("logical_or", "bitwise_or", "or"):
        _bounds(cond.args[1], lows, highs)
        _bounds(cond.args[2], lows, highs)
        return
    if cond.op != "binary" or cond.args[0] not in ("gt", "ge", "lt", "le"):
        return
    op, a, b = cond.args
    fa, fb = _affine_of(a), _affine_of(b)
    if fa is None or fb is None:
        return
    if op in ("lt", "le"):  # a < b  <=>  b > a
        fa, fb, op = fb, fa, {"lt": "gt", "le": "ge"}[op]
    # masked iff d > 0 (gt) or d >= 0 (ge), d = fa - fb = cr*r + ci*i1 + c0
    c0 = fa[0] - fb[0]
    coef = dict(fa[1])
    for v, c in fb[1].items():
        coef[v] = coef.get(v, 0) - c
    coef = {v: c for v, c in coef.items() if c}
    if set(coef) - {"r", "i1"} or coef.get("r") not in (1, -1):
        return
    cr, ci = coef["r"], coef.get("i1", 0)
    strict = op == "gt"
    if cr == 1:  # masked iff r > -(ci*i1 + c0) [>=]: visible r < -(ci*i1 + c0) + 1 [+0]
        highs.append((-c0 + (1 if strict else 0), -ci))
    else:  # masked iff r < ci*i1 + c0 [<=]: visible r >= ci*i1 + c0 [+1]
        lows.append((c0 + (0 if strict else 1), ci))


def key_row_loads(score: Scalar, em) -> list[tuple[Scalar, str, int]]:
    """The float32 loads of a score chain whose offset is b(i0, i1) + c * r (c > 0), each once, with the C
    text of b (the lane's row base) and c; no load under a piece choice (its untaken side may read out of
    range).  ``emit_tiled`` stages them per key block as ``kt<j>[t][q]`` (``KEY_ROWS``)."""
    out, seen = [], set()
    for s in scalars_under([score], stop=lambda x: x.op == "pick"):
        if s.op != "load" or s.dtype != torch.float32 or s.args[0] in seen:
            continue
        off = linear_offset(s.args[1], em.shapes[s.args[0]])
        base = subs(off, {"r": 0})
        step = affine(add(off, mul(base, -1)))
        if step is not None and step[0] == 0 and set(step[1]) == {"r"} and step[1]["r"] > 0:
            seen.add(s.args[0])
            out.append((s, em.index(base), step[1]["r"]))
    return out


def transposed_rows(p: str, c: int, n: int, name: str) -> tuple[list[str], list[str]]:
    """C lines before and after a tiled kernel's loop that hold in `name` buffer `p` (n floats) transposed as
    a [c][m] matrix, m = ceil(n / c): name[(o % c) * m + o / c] = p[o], so that p[b + c * r] (b >= 0, within
    p) is name[(b % c) * m + b / c + r], a row along r.  16 x 16 blocks by register transposes, the rest one
    float at a time."""
    m = -(-n // c)
    return [
        f"  float* {name} = (float*)std::aligned_alloc(64, sizeof(float) * {(c * m + 15) // 16 * 16});",
        f"  for (int64_t a0 = 0; a0 < {m}; a0 += {LANES}) {{  // {name}[j][a] = {p}[a * {c} + j]",
        f"    for (int64_t j0 = 0; j0 < {c}; j0 += {LANES}) {{",
        f"      if (a0 + {LANES} <= {n // c} && j0 + {LANES} <= {c}) {{",
        f"        vtc_flash_transpose16({p} + a0 * {c} + j0, {c}, {name} + j0 * {m} + a0, {m});",
        "        continue;",
        "      }",
        f"      for (int64_t a = a0; a < std::min<int64_t>(a0 + {LANES}, {m}); ++a)",
        f"        for (int64_t j = j0; j < std::min<int64_t>(j0 + {LANES}, {c}); ++j)",
        f"          {name}[j * {m} + a] = a * {c} + j < {n} ? {p}[a * {c} + j] : 0.0f;",
        "    }",
        "  }"], [f"  std::free({name});"]


def _stage_key_rows(rows: list[tuple[str, int, str]], ind: str) -> list[str]:
    """C lines filling ``kt<j>[t][q]`` = p[lk<j>[q] + c * (r0 + t)] for each (p, c, type of lk) of `rows`, the
    block's keys t < nk and the task's lanes q < nr: with c = 1 16 rows of 16 keys read as vectors (a masked
    load for the block's last keys) and transposed in registers, else gathered over the lanes."""
    lines = []
    for j, (p, c, it) in enumerate(rows):
        if c != 1:
            lines += [f"{ind}for (int64_t t = 0; t < nk; ++t) {{  // the score chain's key rows (KEY_ROWS), gathered",
                      f"{ind}  const {it} o_ = ({it})({c} * (r0 + t));",
                      f"{ind}  #pragma omp simd",
                      f"{ind}  for (int64_t q = 0; q < nr; ++q) kt{j}[t][q] = {p}[lk{j}[q] + o_];",
                      f"{ind}}}"]
            continue
        lines += [f"{ind}for (int64_t q0 = 0; q0 < nr; q0 += {LANES}) {{  // the score chain's key rows (KEY_ROWS)",
                  f"{ind}  for (int64_t t0 = 0; t0 < nk; t0 += {LANES}) {{",
                  f"{ind}    const int nt_ = (int)std::min<int64_t>({LANES}, nk - t0);",
                  f"{ind}    alignas(64) float kr_[{LANES}][{LANES}];",
                  f"{ind}    for (int64_t j = 0; j < {LANES}; ++j) {{",
                  f"{ind}      const float* p_ = q0 + j < nr ? {p} + lk{j}[q0 + j] + r0 + t0 : nullptr;",
                  f"{ind}      *(vtc_v{LANES}*)&kr_[j][0] = !p_ ? vtc_v{LANES}{{}} : nt_ == {LANES} ? vtc_load16(p_) "
                  f": vtc_load16_n(p_, nt_);",
                  f"{ind}    }}",
                  f"{ind}    vtc_flash_transpose16(&kr_[0][0], {LANES}, &kt{j}[t0][q0], {QUERY_TILE});",
                  f"{ind}  }}",
                  f"{ind}}}"]
    return lines


def emit_tiled(k, em, q_pieces, pre_k, kx, pre_s, sx, pre_v, vx, mask=None, lanes=([], []),
               key_rows: list[tuple[str, int, str]] = (), around=([], []), bounded=None) -> list[str]:
    """The body of a tiled attention kernel (see the module docstring); the scalars come as
    (hoisted lines, C expression) of k, score, v and the additive mask (or None) from ``emit_attention``, q
    as (lo, hi, hoisted lines, C expression) per range of the head dim (``head_dim_pieces``: d counts from lo);
    `lanes`: (declarations, lines that set lane q's entries) of the per-query terms that the score and mask
    expressions read as ``lq<j>[q]``, filled once per task; `key_rows`: (pointer, key stride, C type of the
    row bases) of the loads that they read as ``kt<j>[t][q]`` (``key_row_loads``; lane q's row base in
    ``lk<j>[q]``, among `lanes`); `around`: C lines before and after the loop over the tiles (``transposed_rows``);
    `bounded`: (hoisted lines, C expression) of ``bounded_term``'s x with the dot product ``b_`` (a float16
    mask: ``bounded_block_check``), or None."""
    from vtc.codegen.cpp import PARALLEL_MIN_WORK

    heads, per_head = k.domain
    n, dd, ee = k.r_extent, k.head_dim, k.value_dim
    qt_n = QUERY_TILE
    kb = KEY_BLOCK
    ep = -(-ee // LANES) * LANES  # value dim padded to whole vectors
    ev = ep // LANES
    ddp = -(-dd // LANES) * LANES  # head dim padded to whole vectors (the rows of Qᵀ transposed 16 at a time)
    qg = 1 << (ACCUMULATORS // ev).bit_length() - 1  # queries per PV micro-kernel step (divides the tile)
    out = k.stores[0]
    v16 = f"vtc_v{LANES}"
    g = k.head_group  # query heads whose queries share the tiles (a GQA group: the same K and V rows)
    group_rows = g * per_head
    chunks = f"(({group_rows} + {qt_n - 1}) / {qt_n})"
    work = heads * per_head * n * (dd + ee)
    lows, highs = key_range(k.score)
    # the PV step visits only the keys with a p != 0 where a mask may hide part of the block (an additive
    # mask: any block; a predicate's bounds: a block that crosses one for a query of the tile); else the
    # bookkeeping costs more than it saves (attn_causal at 1024 tokens: 7.4 -> 8.1 ms with it everywhere)
    trim = PV_KEY_RANGE and bool(mask or lows or highs)
    bound_k = key_block_bounds(pre_k, kx, dd, n, heads // g, g) if bounded else None
    # K and V rows read in place where they are strided views (else packed per key block through the mapping)
    krows = in_place(k.k, em, "d", dd, n)
    vrows = in_place(k.v, em, "e", ee, n)
    vdim = ee if vrows else ep  # floats of a value row that may be read (a packed row is zero-padded)

    def krow(t: int) -> str:  # key t0 + t of the block (a real row past the last key: its scores are unused)
        return f"(kb_ + std::min<int64_t>(t0 + {t}, nk - 1) * {krows.stride})" if krows else f"kp[t0 + {t}]"

    def vrow(t: str) -> str:
        return f"(vb_ + ({t}) * {vrows.stride})" if vrows else f"vp[{t}]"

    def bound(c: int, a: int, at: str) -> str:
        return f"({c} + {a} * ({at}))" if a else f"{c}"

    first, last = "i1_first", "i1_last"
    # visible keys of the tile: the union over its queries of each query's range
    hi = ", ".join([f"std::max<int64_t>({bound(c, a, first)}, {bound(c, a, last)})" for c, a in highs])
    lo = ", ".join([f"std::min<int64_t>({bound(c, a, first)}, {bound(c, a, last)})" for c, a in lows])
    r_end = f"std::min<int64_t>({{(int64_t){n}, {hi}}})" if highs else f"{n}"
    r_beg = f"std::max<int64_t>({{(int64_t)0, {lo}}}) / {kb} * {kb}" if lows else "0"


    # a block is visible to every query of the tile where it ends below each upper bound and starts above
    # each lower bound at the tile's first and last query (the bounds are affine in the query)
    cross = [f"r0 + nk > std::min<int64_t>({bound(c, a, first)}, {bound(c, a, last)})" for c, a in highs] + \
            [f"r0 < std::max<int64_t>({bound(c, a, first)}, {bound(c, a, last)})" for c, a in lows]
    trim_cond = "true" if mask else " || ".join(cross) or "false"

    def pin(v: str) -> str:  # a reused operand kept in its register (PIN_OPERANDS)
        return f" VTC_IN_REG({v});" if PIN_OPERANDS else ""

    def score_kernel(nqv: int) -> list[str]:  # scores of the block on nqv vectors of query lanes
        kg = ACCUMULATORS // nqv  # keys per step
        acc = [f"a{t}_{v}" for t in range(kg) for v in range(nqv)]
        return [
            f"        for (int64_t t0 = 0; t0 < nk; t0 += {kg}) {{",
            f"          {v16} " + ", ".join(f"{a} = {{}}" for a in acc) + ";",
            *[f"          const float* kr{t} = {krow(t)};" for t in range(kg)],
            f"          for (int64_t d = 0; d < {dd}; ++d) {{",
            *[f"            {v16} q{v} = *(const {v16}*)&qt[d][{LANES * v}];{pin(f'q{v}')}" for v in range(nqv)],
            *[f"            const float k{t} = kr{t}[d];" for t in range(kg)],
            "            " + " ".join(f"a{t}_{v} = vtc_fma16(q{v}, vtc_splat16(k{t}), a{t}_{v});"
                                    for t in range(kg) for v in range(nqv)),
            "          }",
            *[f"          *({v16}*)&st[t0 + {t}][{LANES * v}] = a{t}_{v};" for t in range(kg) for v in range(nqv)],
            "        }"]

    kg = ACCUMULATORS  # keys per step of the one-vector micro-kernel (a multiple of the others' steps)
    lines = [
        *around[0],
        *(bound_k[0] if bounded else []),
        f"  #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if({work} >= {PARALLEL_MIN_WORK})",
        f"  for (int64_t blk = 0; blk < {heads // g} * {chunks}; ++blk) {{",
        f"    const int64_t i0 = blk / {chunks} * {g};  // the group's first head",
        f"    const int64_t m_lo = ({chunks} - 1 - blk % {chunks}) * {qt_n};  // the longest tiles first",
        f"    const int64_t nr = std::min<int64_t>({qt_n}, {group_rows} - m_lo);",
        f"    alignas(64) int64_t li0[{qt_n}], li1[{qt_n}];  // lane q: query li1[q] of head li0[q]",
        f"    for (int64_t q = 0; q < nr; ++q) {{ li0[q] = i0 + (m_lo + q) / {per_head}; li1[q] = (m_lo + q) % {per_head}; }}",
        *[f"    {x}" for x in lanes[0]],
        *([f"    for (int64_t q = 0; q < nr; ++q) {{  // the score chain's per-query terms",
           "      const int64_t i0 = li0[q], i1 = li1[q];", *lanes[1], "    }"] if lanes[0] else []),
        f"    const bool one_head = m_lo / {per_head} == (m_lo + nr - 1) / {per_head};",
        f"    const int64_t i1_first = one_head ? li1[0] : 0, i1_last = one_head ? li1[nr - 1] : {per_head - 1};",
        f"    alignas(64) float qt[{ddp}][{qt_n}];",
        *(["    const float* kb_;"] if krows else [f"    alignas(64) float kp[{kb}][{dd}];"]),
        *(["    const float* vb_;"] if vrows else [f"    alignas(64) float vp[{kb}][{ep}];"]),
        f"    alignas(64) float st[{kb}][{qt_n}];",
        *[f"    alignas(64) float kt{j}[{kb}][{qt_n}];" for j in range(len(key_rows))],
        f"    alignas(64) float ov[{qt_n}][{ep}];",
        f"    alignas(64) float mx[{qt_n}], sm[{qt_n}], mu[{qt_n}], cr[{qt_n}], bm[{qt_n}], ps[{qt_n}];",
        f"    alignas(64) int bn[{qt_n}];",
        *([f"    alignas(64) int plo[{qt_n}], phi[{qt_n}];  // per query: the block's keys from plo to phi - 1 have p != 0"]
          if trim else []),
        f"    const int64_t qn = nr <= {LANES} ? {LANES} : nr <= {2 * LANES} ? {2 * LANES} : {qt_n};  // lanes in use",
        "    {  // pack Qᵀ: qt[d][q] = Q of lane q (lanes < qn), zeros past the last query: rows of 16 queries",
        "       // computed along d, then transposed 16 x 16 in registers (not stored a float at a time)",
        f"      alignas(64) float qr[{LANES}][{ddp}];",
        f"      for (int64_t q0 = 0; q0 < qn; q0 += {LANES}) {{",
        f"        for (int64_t j = 0; j < {LANES}; ++j) {{",
        "          const int64_t q = q0 + j;",
        "          if (q < nr) {",
        "            const int64_t i0 = li0[q], i1 = li1[q];",
        *[x for lo, hi, pre_q, qx in q_pieces for x in [
            "            #pragma omp simd",
            f"            for (int64_t d = 0; d < {hi - lo}; ++d) {{", *["    " + x for x in pre_q],
            f"              qr[j][d + {lo}] = {qx};" if lo else f"              qr[j][d] = {qx};", "            }"]],
        *([f"            for (int64_t d = {dd}; d < {ddp}; ++d) qr[j][d] = 0.0f;"] if ddp != dd else []),
        f"          }} else for (int64_t d = 0; d < {ddp}; ++d) qr[j][d] = 0.0f;",
        "        }",
        f"        for (int64_t d0 = 0; d0 < {ddp}; d0 += {LANES}) vtc_flash_transpose16(&qr[0][d0], {ddp}, &qt[d0][q0], {qt_n});",
        "      }",
        "    }",
        *([f"    alignas(64) float mq[{qt_n}];  // per query: max_d |q_d| (NaN kept), for bounded_block_check",
           "    for (int64_t q = 0; q < qn; ++q) mq[q] = 0.0f;",
           f"    for (int64_t d = 0; d < {dd}; ++d) {{",
           "      #pragma omp simd",
           "      for (int64_t q = 0; q < qn; ++q) {",
           "        const float a_ = std::fabs(qt[d][q]);",
           "        mq[q] = a_ > mq[q] || a_ != a_ ? a_ : mq[q];",
           "      }",
           "    }",
           "    for (int64_t q = 0; q < qn; ++q) mq[q] *= 1.001f;"] if bounded else []),
        *(["    for (bool skip_ok = true;; skip_ok = false) {  // again without skipping: a row saw only hidden keys",
           "    bool skipped = false;"] if mask else []),
        f"    for (int64_t q = 0; q < {qt_n}; ++q) {{",
        "      mx[q] = -INFINITY; sm[q] = 0.0f;",
        f"      for (int64_t e = 0; e < {ep}; ++e) ov[q][e] = 0.0f;",
        "    }",
        f"    const int64_t r_end = {r_end};",
        f"    for (int64_t r0 = {r_beg}; r0 < r_end; r0 += {kb}) {{",
        f"      const int64_t nk = std::min<int64_t>({kb}, {n} - r0);",
        f"      const int64_t nkp = (nk + {kg - 1}) / {kg} * {kg};",
        *([f"      const bool trim_ = {trim_cond};  // a mask may hide part of the block"] if trim else []),
        *(_stage_key_rows(list(key_rows), "      ") if key_rows else []),
        *(hidden_block_check(mask[0], mask[1], ["for (int64_t t = 0; t < nk && !seen; ++t) {", "const int64_t r = r0 + t;"],
                             ["for (int64_t q = 0; q < nr; ++q) {", "const int64_t i0 = li0[q], i1 = li1[q];"], "      ")
          if mask else []),
        *(bounded_block_check(bounded, *mask, -(-n // kb), g, "      ") if bounded else []),
        "      bool v_bad = false;  // a value row of the block holds inf or NaN",
        "      {",
        "        const int64_t i1 = 0;  // K and V rows do not depend on the query",
        *([f"        kb_ = {krows.ptr} + ({krows.base});"] if krows else []),
        *([f"        vb_ = {vrows.ptr} + ({vrows.base});"] if vrows else []),
        "        for (int64_t t = 0; t < nk; ++t) {",
        "          const int64_t r = r0 + t;",
        *([] if krows else [
            "          #pragma omp simd",
            f"          for (int64_t d = 0; d < {dd}; ++d) {{", *["  " + x for x in pre_k], f"            kp[t][d] = {kx};",
            "          }"]),
        *([] if vrows else _pack_value_row(pre_v, vx, ee, ep)),
        "        }",
        *_value_check(vrow, vdim, "        "),
        *([] if krows else [
            f"        for (int64_t t = nk; t < nkp; ++t) for (int64_t d = 0; d < {dd}; ++d) kp[t][d] = 0.0f;"]),
        "      }",
        # scores: keys x the query vectors in use per step
        f"      if (qn == {LANES}) {{",
        *score_kernel(1),
        f"      }} else if (qn == {2 * LANES}) {{",
        *score_kernel(2),
        "      } else {",
        *score_kernel(4),
        "      }",
        # the score chain per (key, query), vectorised over the queries
        "      for (int64_t t = 0; t < nk; ++t) {",
        "        const int64_t r = r0 + t;",
        "        #pragma omp simd",
        "        for (int64_t q = 0; q < nr; ++q) {",
        "          const int64_t i0 = li0[q], i1 = li1[q];",
        "          const float acc_score = st[t][q];", *["  " + x for x in pre_s], f"          st[t][q] = {sx};",
        "        }",
        "        for (int64_t q = nr; q < qn; ++q) st[t][q] = -INFINITY;",
        "      }",
        # online softmax, one query per lane
        *_softmax(trim),
        # PV: qg queries x the value dim per step
        "      if (!v_bad) {",
        f"        for (int64_t q0 = 0; q0 < nr; q0 += {qg}) {{",
        *[f"          {v16} o{j}_{v} = *(const {v16}*)&ov[q0 + {j}][{LANES * v}] * cr[q0 + {j}];"
          for j in range(qg) for v in range(ev)],
        *([f"          int64_t t_lo = plo[q0], t_hi = phi[q0];  // the keys with a p != 0 for a query of the step",
           *[f"          t_lo = std::min<int64_t>(t_lo, plo[q0 + {j}]); t_hi = std::max<int64_t>(t_hi, phi[q0 + {j}]);"
             for j in range(1, qg)],
           "          for (int64_t t = t_lo; t < t_hi; ++t) {"] if trim else
          ["          for (int64_t t = 0; t < nk; ++t) {"]),
        "            const float* vr = " + vrow("t") + ";",
        *[f"            {v16} w{v} = {row_vector('vr', v, vdim)};{pin(f'w{v}')}" for v in range(ev)],
        *[f"            const float p{j} = st[t][q0 + {j}];" for j in range(qg)],
        "            " + " ".join(f"o{j}_{v} = vtc_fma16(vtc_splat16(p{j}), w{v}, o{j}_{v});"
                                for j in range(qg) for v in range(ev)),
        "          }",
        *[f"          *({v16}*)&ov[q0 + {j}][{LANES * v}] = o{j}_{v};" for j in range(qg) for v in range(ev)],
        "        }",
        "      } else {  // only keys with a probability: a masked inf / NaN value row stays out",
        "        for (int64_t q = 0; q < nr; ++q) {",
        "          #pragma omp simd",
        f"          for (int64_t e = 0; e < {ep}; ++e) ov[q][e] *= cr[q];",
        "          for (int64_t t = 0; t < nk; ++t) {",
        "            const float p_ = st[t][q];",
        "            if (p_ == 0.0f) continue;",
        "            const float* vr = " + vrow("t") + ";",
        "            #pragma omp simd",
        f"            for (int64_t e = 0; e < {vdim}; ++e) ov[q][e] += p_ * vr[e];",
        "          }",
        "        }",
        "      }",
        "    }",
        *([f"    bool safe = true;  // every row's max above {SAFE_MAX}: the skipped keys' probabilities are 0",
           f"    for (int64_t q = 0; q < nr; ++q) safe = safe && !(mx[q] <= {SAFE_MAX});",
           "    if (!skipped || safe) break;",
           "    }"] if mask else []),
        "    for (int64_t q = 0; q < nr; ++q) {",
        "      const int64_t i0 = li0[q], i1 = li1[q];",
        "      const float inv = mx[q] == -INFINITY ? 0.0f : 1.0f / sm[q];" if k.zero_empty_rows else
        "      const float inv = 1.0f / sm[q];",
        "      #pragma omp simd",
        f"      for (int64_t e = 0; e < {ee}; ++e) "
        f"{em.ptr[out.buffer.name]}[{em.linear(out.buffer.name, out.index)}] = {k.stored('ov[q][e] * inv')};",
        "    }",
        "  }",
        *(bound_k[1] if bounded else []),
        *around[1],
    ]
    # queries beyond nr in a PV step read rows of ov / st that exist (qt_n is a multiple of qg)
    assert qt_n % qg == 0 and KEY_BLOCK % kg == 0, (qt_n, qg, kg)
    return lines


def _softmax(trim: bool) -> list[str]:
    """The online-softmax step of the tile's key block: loops over the keys, each over the query lanes
    (vectorised); `trim`: where ``trim_`` holds at run time (a block that a mask may hide in part), per
    lane the first and one past the last key with p != 0 (``plo``, ``phi``; else 0 and nk)."""
    def exp_loop(track: bool) -> list[str]:
        return [
            "      for (int64_t t = 0; t < nk; ++t) {",
            "        #pragma omp simd",
            "        for (int64_t q = 0; q < qn; ++q) {",
            "          const float p_ = vtc_exp(st[t][q] - mu[q]); st[t][q] = p_; ps[q] += p_;",
            *(["          const bool nz_ = p_ != 0.0f;  // NaN too",
               "          const int lo_ = nz_ ? (int)t : (int)nk, hi_ = nz_ ? (int)t + 1 : 0;  // stores not under a branch",
               "          plo[q] = lo_ < plo[q] ? lo_ : plo[q]; phi[q] = hi_ > phi[q] ? hi_ : phi[q];"]
              if track else []),
            "        }",
            "      }"]

    return [
        "      #pragma omp simd",
        "      for (int64_t q = 0; q < qn; ++q) { bm[q] = -INFINITY; bn[q] = 0; ps[q] = 0.0f;"
        + (" plo[q] = trim_ ? (int)nk : 0; phi[q] = trim_ ? 0 : (int)nk;" if trim else "") + " }",
        "      for (int64_t t = 0; t < nk; ++t) {",
        "        #pragma omp simd",
        "        for (int64_t q = 0; q < qn; ++q) {",
        "          const float s_ = st[t][q]; bm[q] = s_ > bm[q] ? s_ : bm[q]; bn[q] |= s_ != s_;",
        "        }",
        "      }",
        "      #pragma omp simd",
        "      for (int64_t q = 0; q < qn; ++q) {",
        "        const float mnew = bn[q] ? NAN : vtc_max(mx[q], bm[q]);",
        "        cr[q] = mnew == -INFINITY ? 1.0f : vtc_exp(mx[q] - mnew);  // rescales what came before",
        "        mu[q] = mnew == -INFINITY ? 0.0f : mnew;  // every score so far -inf: probabilities 0",
        "        mx[q] = mnew;",
        "      }",
        *(["      if (trim_) {", *exp_loop(True), "      } else {", *exp_loop(False), "      }"] if trim else
          exp_loop(False)),
        "      #pragma omp simd",
        "      for (int64_t q = 0; q < qn; ++q) sm[q] = sm[q] * cr[q] + ps[q];",
    ]


# ---------------------------------------------------------------------------
# decode: the query heads of a GQA group (rows that read the same K and V) in one task
def shared_scores(k, em, row, g: int, pre_k, kx, pre_s, sx) -> list[str]:
    """Scores of a key block for the g rows of a task that share K (the query heads of a GQA group).

    K rows are read in place where K is a strided view with consecutive head-dim elements (``in_place``),
    else the block is packed through its mapping (``kp[key][d]``).  Per row and 16 keys: per key the
    products with q summed over the head dim's vectors into one vector of partial sums, and
    ``vtc_sum16`` turns the 16 vectors into the 16 scores (no horizontal sum per key).  Then the score
    chain per (row, key), vectorised over the keys; entries past the last key are -inf.  A head dim that
    is not a multiple of LANES: ``qv`` is zero-padded to whole vectors, the last vector of a K row read
    in place is a masked load and a packed row is zero-padded (``sc``, ``qv``, ``r0``, ``r1`` and ``nr``
    come from the caller).
    """
    dd, n = k.head_dim, k.r_extent
    dv = -(-dd // LANES)
    v16, dp = f"vtc_v{LANES}", dv * LANES
    rows = in_place(k.k, em, "d", dd, n, f16=True)
    lines = [f"      const int64_t nk = r1 - r0, nkp = (nk + {LANES - 1}) / {LANES} * {LANES};"]
    if rows is not None:
        lines += [f"      const {rows.ctype}* kb_;",
                  "      {", "        const int64_t rr = 0;", *row("        "),
                  f"        kb_ = {rows.ptr} + ({rows.base});", "      }"]
        key_row = f"kb_ + std::min<int64_t>(c0 + t, nk - 1) * {rows.stride}"  # past the last key: a real row

        def load(v: int) -> str:
            return row_vector("kr", v, dd)
    else:
        lines += [
            f"      alignas(64) float kp[{decode_key_block(k)}][{dp}];",
            "      {",
            "        const int64_t rr = 0;", *row("        "),
            "        for (int64_t t = 0; t < nk; ++t) {",
            "          const int64_t r = r0 + t;",
            "          #pragma omp simd",
            f"          for (int64_t d = 0; d < {dd}; ++d) {{", *["  " + x for x in pre_k], f"            kp[t][d] = {kx};",
            "          }",
            *([f"          for (int64_t d = {dd}; d < {dp}; ++d) kp[t][d] = 0.0f;"] if dp != dd else []),
            "        }",
            f"        for (int64_t t = nk; t < nkp; ++t) for (int64_t d = 0; d < {dp}; ++d) kp[t][d] = 0.0f;",
            "      }"]
        key_row = "kp[c0 + t]"

        def load(v: int) -> str:
            return f"*(const {v16}*)(kr + {LANES * v})"
    return lines + [
        "      for (int64_t rr = 0; rr < nr; ++rr) {",
        *[f"        const {v16} q{v} = *(const {v16}*)&qv[rr][{LANES * v}];" for v in range(dv)],
        f"        for (int64_t c0 = 0; c0 < nkp; c0 += {LANES}) {{",
        f"          {v16} part[{LANES}];",
        f"          for (int t = 0; t < {LANES}; ++t) {{",
        f"            const {rows.ctype if rows else 'float'}* kr = {key_row};",
        f"            {v16} a = q0 * {load(0)};",
        *[f"            a = vtc_fma16(q{v}, {load(v)}, a);" for v in range(1, dv)],
        "            part[t] = a;",
        "          }",
        f"          *({v16}*)&sc[rr][c0] = vtc_sum16(part);",
        "        }",
        "      }",
        "      for (int64_t rr = 0; rr < nr; ++rr) {", *row("        "),
        "        #pragma omp simd",
        "        for (int64_t t = 0; t < nk; ++t) {",
        "          const int64_t r = r0 + t;",
        "          const float acc_score = sc[rr][t];", *["  " + x for x in pre_s], f"          sc[rr][t] = {sx};",
        "        }",
        "        for (int64_t t = nk; t < nkp; ++t) sc[rr][t] = -INFINITY;",
        "      }",
    ]


def shared_pv(k, em, row, g: int, pre_v, vx) -> list[str]:
    """PV of a key block for the g rows of a task that share V: V rows read in place (a strided view;
    the last vector of a row a masked load) or packed through the mapping, then ``qg`` rows x the value dim
    of accumulators in vector registers per step, P broadcast.  A block whose V holds inf or NaN adds
    only keys with a probability (as the prefill)."""
    ee, n = k.value_dim, k.r_extent
    v16 = f"vtc_v{LANES}"
    ep = -(-ee // LANES) * LANES
    ev = ep // LANES
    qg = max(x for x in range(1, g + 1) if g % x == 0 and x * ev <= ACCUMULATORS) if ev <= ACCUMULATORS else 1
    rows = in_place(k.v, em, "e", ee, n, f16=True)
    vdim = ee if rows else ep  # elements of a value row that may be read (a packed row is zero-padded)
    vt = rows.ctype if rows else "float"
    lines = ["      {", "      const int64_t nk = r1 - r0;"]
    if rows is not None:
        lines += [f"      const {vt}* vb_;",
                  "      {", "        const int64_t rr = 0;", *row("        "),
                  f"        vb_ = {rows.ptr} + ({rows.base});", "      }"]

        def vrow(t: str) -> str:
            return f"(vb_ + ({t}) * {rows.stride})"
    else:
        lines += [
            f"      alignas(64) float vp[{decode_key_block(k)}][{ep}];",
            "      {",
            "        const int64_t rr = 0;", *row("        "),
            "        for (int64_t t = 0; t < nk; ++t) {",
            "          const int64_t r = r0 + t;",
            *_pack_value_row(pre_v, vx, ee, ep),
            "        }",
            "      }"]

        def vrow(t: str) -> str:
            return f"vp[{t}]"
    return lines + [
        *_value_check(vrow, vdim, "      ", declare=True),
        "      if (!v_bad) {",
        f"        for (int64_t q0 = 0; q0 < nr; q0 += {qg}) {{",
        *[f"          {v16} o{j}_{v} = *(const {v16}*)&ov[q0 + {j}][{LANES * v}];" for j in range(qg) for v in range(ev)],
        "          for (int64_t t = 0; t < nk; ++t) {",
        f"            const {vt}* vr = {vrow('t')};",
        *[f"            {v16} w{v} = {row_vector('vr', v, vdim)};{' VTC_IN_REG(w%d);' % v if PIN_OPERANDS and qg > 1 else ''}"
          for v in range(ev)],
        *[f"            const float p{j} = sc[q0 + {j}][t];" for j in range(qg)],
        "            " + " ".join(f"o{j}_{v} = vtc_fma16(vtc_splat16(p{j}), w{v}, o{j}_{v});"
                                for j in range(qg) for v in range(ev)),
        "          }",
        *[f"          *({v16}*)&ov[q0 + {j}][{LANES * v}] = o{j}_{v};" for j in range(qg) for v in range(ev)],
        "        }",
        "      } else {  // only keys with a probability: a masked inf / NaN value row stays out",
        "        for (int64_t q = 0; q < nr; ++q) {",
        "          for (int64_t t = 0; t < nk; ++t) {",
        "            const float p_ = sc[q][t];",
        "            if (p_ == 0.0f) continue;",
        f"            const {vt}* vr = {vrow('t')};",
        "            #pragma omp simd",
        f"            for (int64_t e = 0; e < {vdim}; ++e) ov[q][e] += p_ * {rows.element('vr[e]') if rows else 'vr[e]'};",
        "          }",
        "        }",
        "      }",
        "      }",
    ]


def _pack_value_row(pre_v: list[str], vx: str, ee: int, ep: int) -> list[str]:
    """C lines (inside the loop over the block's keys t, key r) packing value row r through its mapping
    into ``vp[t]``, zero-padded from the value dim ``ee`` to whole vectors ``ep``."""
    return [
        "          #pragma omp simd",
        f"          for (int64_t e = 0; e < {ee}; ++e) {{", *["  " + x for x in pre_v], f"            vp[t][e] = {vx};",
        "          }",
        *([f"          for (int64_t e = {ee}; e < {ep}; ++e) vp[t][e] = 0.0f;"] if ep != ee else [])]


def _value_check(vrow, vdim: int, ind: str, declare: bool = False) -> list[str]:
    """C lines setting ``v_bad`` when one of the block's ``nk`` value rows (``vrow(t)``, ``vdim`` floats each)
    holds inf or NaN (0 * v is 0 but for those); ``declare``: ``v_bad`` is declared here too."""
    return [
        f"{ind}vtc_v{LANES} chk = {{}};  // 0 * v is 0 but for inf and NaN",
        f"{ind}for (int64_t t = 0; t < nk; ++t) {{",
        *[f"{ind}  chk += {row_vector(vrow('t'), v, vdim)} * 0.0f;" for v in range(-(-vdim // LANES))],
        f"{ind}}}",
        *([f"{ind}bool v_bad = false;"] if declare else []),
        f"{ind}for (int i = 0; i < {LANES}; ++i) v_bad = v_bad || chk[i] != 0.0f;"]


def shared_softmax(ep: int) -> list[str]:
    """The online-softmax step of a key block for each row of the task, on whole vectors of ``sc``
    (its entries past the block's last key are -inf): block max and NaN flag, rescale of what came
    before, probabilities and their sum."""
    v16 = f"vtc_v{LANES}"
    return [
        f"      typedef int vtc_i{LANES} __attribute__((vector_size({4 * LANES})));",
        "      for (int64_t rr = 0; rr < nr; ++rr) {",
        "        float* __restrict srow = sc[rr];",
        f"        {v16} bm = vtc_splat16(-INFINITY);",
        f"        vtc_i{LANES} bad = {{}};",
        f"        for (int64_t c0 = 0; c0 < nkp; c0 += {LANES}) {{",
        f"          const {v16} s_ = *(const {v16}*)&srow[c0];",
        "          bm = s_ > bm ? s_ : bm; bad |= s_ != s_;",
        "        }",
        "        float bmax = -INFINITY; bool bnan = false;",
        f"        for (int i = 0; i < {LANES}; ++i) {{ bmax = bm[i] > bmax ? bm[i] : bmax; bnan = bnan || bad[i]; }}",
        "        const float mnew = bnan ? NAN : vtc_max(mx[rr], bmax);",
        "        if (mnew == -INFINITY) {  // every score so far is -inf: nothing to add yet",
        "          for (int64_t t = 0; t < nkp; ++t) srow[t] = 0.0f;",
        "          continue;",
        "        }",
        "        const float corr = vtc_exp(mx[rr] - mnew);",
        "        mx[rr] = mnew;",
        "        #pragma omp simd",
        "        for (int64_t t = 0; t < nkp; ++t) srow[t] = vtc_exp(srow[t] - mnew);",
        f"        {v16} pacc = {{}};",
        f"        for (int64_t c0 = 0; c0 < nkp; c0 += {LANES}) pacc += *(const {v16}*)&srow[c0];",
        "        float psum = 0.0f;",
        f"        for (int i = 0; i < {LANES}; ++i) psum += pacc[i];",
        "        sm[rr] = sm[rr] * corr + psum;",
        "        if (corr != 1.0f) {",
        "          #pragma omp simd",
        f"          for (int64_t e = 0; e < {ep}; ++e) ov[rr][e] *= corr;",
        "        }",
        "      }",
    ]
