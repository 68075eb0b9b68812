"""Convolutions with a very short reduction over a large map, computed directly from the input.

A network's stem (ShuffleNetV2's 3x3 stride-2 convolution of 3 -> 24 channels
at 224x224: a reduction of K = 27 over 12544 output pixels) spends most of
the implicit GEMM's time (vtc.codegen.conv) packing its im2col: 27 rows of
12544 columns, cut into panel segments of 32 whose bounds are worked out
per segment, for only 27 FMAs per packed element and output channel.  Here
nothing is packed:

- a tile is **16 output pixels of one output row** (the vector) **x up to
  24 output channels** (the accumulators, ``MB``; M channels in ceil(M / 24)
  tiles as equal as can be), over the whole reduction;
- per reduction row r (input channel, tap) the tile's 16 input elements are
  **one masked load** at stride 1, the **even lanes of two masked loads** at
  stride 2 (as vtc.codegen.depthwise's ``vtc_dw_even``), the lanes whose
  tap falls in the padding zero, a tap row in the padding skipped; each
  feeds MB FMAs with the weight ``W[o, r]`` broadcast;
- the weight is read as **W^T per tile of channels** (``[K][tile]``, zero past
  the last channel) packed per call and thread (K x M floats);
- a unit of work is one output row of one image: its tiles go to a small
  per-thread block ``ct`` (channels x the row), then the kernel's stores (the
  batch norm, activation, ... fused after the convolution) run over it
  (vtc.codegen.conv_t's epilogue, per output channel).

Where it runs (``why_not``; ``FORM`` in the GemmChoice.path, picked by
vtc.codegen.conv.choose_conv): an AVX-512 target, one group, a reduction of
at most ``MAX_K``, at least ``MIN_CHANNELS`` output channels and
``MIN_PIXELS`` output pixels per image, a tap stride of 1 or 2 along the
width, and (checked by vtc.codegen.conv.conv_kernel, else the panel form
runs) an input that is one plain float32 load with unit stride along its
rows (a graph input, a physical value or a zero-copy view; no piece choice
in front) and a plain row-major weight.
"""
from __future__ import annotations

import torch

from vtc.codegen import conv_t

FORM = "conv_direct"  # GemmChoice.path of a convolution computed here
ENABLED = True  # False: never taken (a switch for side-by-side timing)
MAX_K = 32  # reduction (input channels x taps) at most this: a 3x3 over up to 3 channels
MIN_PIXELS = 1024  # output pixels per image at least (smaller maps: the panel, dot or broadcast forms)
MIN_CHANNELS = 8  # output channels at least
PREFETCH_ROWS = 2  # the input rows of the output row this many ahead prefetched (0: none): in the model the
#   input comes from memory, not cache (the stem's closure in ShuffleNetV2's call, 1 thread, load 8-10: median 488 ->
#   289 us; its output's lines prefetched for writing too measured no better, 277 us)
MB = 24  # output channels per tile (accumulators; 24 + the tap vector + a weight broadcast fit 32 registers)


def why_not(geo: dict, weight_ok: bool) -> str:
    """Why convolution `geo` (conv._geometry) is not computed directly ("" when it is)."""
    p, k = geo["oh"] * geo["ow"], geo["cg"] * geo["kh"] * geo["kw"]
    if not ENABLED:
        return "the direct form is off (conv_direct.ENABLED)"
    if not conv_t.has_avx512():
        return "the direct form is written for AVX-512"
    if geo["groups"] != 1:
        return f"{geo['groups']} groups: the direct form reads one weight"
    if k > MAX_K:
        return f"a reduction of {k} > {MAX_K}: the panel form amortises its pack"
    if geo["kh"] * geo["kw"] == 1:  # (read in place, ShuffleNet's 1x1 24 -> 58 at 56x56 measured 52.4 vs 51.0 us)
        return "a 1x1 convolution: its im2col is the input itself (the panel form)"
    if p < MIN_PIXELS:
        return f"{geo['oh']}x{geo['ow']} = {p} output pixels < {MIN_PIXELS}"
    if geo["og"] < MIN_CHANNELS:
        return f"{geo['og']} output channels < {MIN_CHANNELS}"
    if geo["stride"][1] not in (1, 2):
        return f"stride {geo['stride'][1]} along the width (1 or 2 are read by vector loads)"
    if not weight_ok:
        return "the weight is not one plain row-major load"
    return ""


def plain_input(pack, shapes: dict):
    """The input's load of Im2colPack `pack` where the direct form can read it (one piece, a float32 or float16 load
    (widened as the tiles read it) whose offset has unit stride along the input row, the row and no other term in
    cv_iw), else None."""
    from vtc.codegen.conv import piece_cases
    from vtc.codegen.gemm import _unwidened
    from vtc.index.expr import _terms, free_vars
    from vtc.index.mapping import linear_offset

    if pack.flat:
        return None
    cases = piece_cases(pack.value, pack.inner)
    if cases is None or len(cases) != 1 or cases[0][0]:
        return None
    s = _unwidened(cases[0][1])
    if s.op != "load" or s.dtype not in (torch.float32, torch.float16) or s.args[0] not in shapes:
        return None
    _, terms = _terms(linear_offset(s.args[1], shapes[s.args[0]]))
    unit = False
    for atom, c in terms.items():
        names = free_vars(atom)
        if atom.op == "var" and atom.args[0] == "cv_iw":
            unit = c == 1
            if not unit:
                return None
        elif "cv_iw" in names:
            return None
    return s if unit else None


RUNTIME = r"""
#ifndef VTC_CONV_DIRECT_RUNTIME
#define VTC_CONV_DIRECT_RUNTIME
#if defined(VTC_CONV_VECTOR) && defined(__BMI2__)
// ct[o * ldc + l] = sum_r wt[r * MB + o] * x_r[l], o < MB, l < 16: x_r lane l is the input at column
// (ow0 + l) * SW + cw[r] of the row at rp[r] (nullptr: a tap row in the padding, skipped), zero outside
// output columns [olo[r], ohi[r]) and past n; a float16 input widened as it is loaded (vtc_conv_load / _even)
template <int MB, int SW, typename T>
static inline void vtc_cd_tile(const T* const* rp, const int64_t* cw, const int64_t* olo, const int64_t* ohi,
                               int64_t K, int64_t ow0, int64_t n, const float* __restrict wt,
                               float* __restrict ct, int64_t ldc) {
  __m512 acc[MB];
  #pragma GCC unroll 32
  for (int o = 0; o < MB; ++o) acc[o] = _mm512_setzero_ps();
  for (int64_t r = 0; r < K; ++r) {
    if (rp[r] == nullptr) continue;
    const int64_t a = std::max<int64_t>(olo[r] - ow0, 0), b = std::min<int64_t>(ohi[r] - ow0, n);
    if (a >= b) continue;
    const unsigned valid = ((1u << b) - 1u) & ~((1u << a) - 1u);
    const T* src = rp[r] + ow0 * SW + cw[r];
    const __m512 x = SW == 1 ? vtc_conv_load((__mmask16)valid, src)
                             : vtc_conv_even(_pdep_u32(valid, 0x55555555u), src);  // input lane 2l for output lane l
    const float* __restrict w = wt + r * MB;
    #pragma GCC unroll 32
    for (int o = 0; o < MB; ++o) acc[o] = _mm512_fmadd_ps(x, _mm512_set1_ps(w[o]), acc[o]);
  }
  #pragma GCC unroll 32
  for (int o = 0; o < MB; ++o) _mm512_storeu_ps(ct + o * ldc, acc[o]);
}
#endif
#endif
"""


def generate(k) -> str:
    """The C++ source of conv kernel k computed directly (k.gemm: vtc.codegen.gemm.GemmOperands whose pack_b is
    the convolution's Im2colPack, with ``direct_geo``, the conv._geometry; k.stores: the epilogue at (i0 =
    image, i1 = output channel, i2 = output pixel)); the weight is ``k.gemm.a``, a plain row-major load and the
    input one plain load (vtc.codegen.conv.conv_kernel checks both)."""
    from vtc.codegen import gemm
    from vtc.codegen.cpp import OMP_TEAM, PRELUDE, _Emitter, buffer_pointers, storage_ctype

    g = k.gemm
    pack, geo = g.direct_pack, g.direct_pack.geo
    em = _Emitter(k)
    lines = buffer_pointers(k, em)
    rows = conv_t.weight_rows(gemm._unwidened(g.a), em.shapes)
    s = plain_input(pack, em.shapes)
    if rows is None or s is None:  # pragma: no cover - conv.conv_kernel checks both first
        raise AssertionError(f"{k.name}: the direct form needs a plain row-major weight and a plain input")
    wbuf, wbase, lda = rows
    M, P, KK, B = g.m, g.n, g.k, g.batch
    kh, kw, oh, ow, h, wd = geo["kh"], geo["kw"], geo["oh"], geo["ow"], geo["h"], geo["wd"]
    (sh, sw), (ph, pw), (dh, dw) = geo["stride"], geo["pad"], geo["dil"]
    nblk = -(-M // MB)
    mbt = -(-M // nblk)  # channels per tile: the blocks as equal as can be (30 = 2 x 15, not 24 + 24 with 18 zero)
    ldc = -(-ow // 16) * 16
    flops = 2 * B * M * P * KK
    # the input row of reduction row r: Im2colPack's value at (cv_ih, cv_iw = 0) (cv_iw then steps by one)
    run = pack._plain_run(em, s)
    span = min(wd, (ow - 1) * sw + (kw - 1) * dw + 1)  # input elements an output row reads along a row
    lines += [
        f"  const int64_t M = {M}, K = {KK}, BATCH = {B}, OH = {oh}, OW = {ow}, LDC = {ldc}, NBLK = {nblk};",
        f"  const int nt = {flops}LL >= {gemm.PARALLEL_MIN_FLOPS}LL && nthreads > 1 ? nthreads : 1;",
        "  const int64_t units = BATCH * OH;",
        f"  const {storage_ctype(gemm._unwidened(g.a).dtype)}* __restrict wsrc = {em.ptr[wbuf]} + {em.index(wbase)};",
        *OMP_TEAM,
        f"    float* __restrict wt = vtc_gemm_scratch(3, NBLK * K * {mbt});  // W^T per block of {mbt} channels",
        f"    float* __restrict ct = vtc_gemm_scratch(4, NBLK * {mbt} * LDC);  // one output row, all channels",
        f"    for (int64_t blk = 0; blk < NBLK; ++blk)",
        "      for (int64_t r = 0; r < K; ++r)",
        f"        for (int64_t o = 0; o < {mbt}; ++o) {{",
        f"          const int64_t c = blk * {mbt} + o;",
        f"          wt[(blk * K + r) * {mbt} + o] = c < M ? vtc_conv_elem(wsrc[c * {lda} + r]) : 0.0f;",
        "        }",
        f"    const {storage_ctype(s.dtype)}* rp[K];",
        "    int64_t cw[K], olo[K], ohi[K];",
        "    for (int64_t r = 0; r < K; ++r) {",
        f"      cw[r] = (r % {kw}) * {dw} - {pw};",
        f"      olo[r] = std::max<int64_t>(0, vtc_ceil_div(-cw[r], {sw}));",
        f"      ohi[r] = std::min<int64_t>(OW, vtc_ceil_div({wd} - cw[r], {sw}));",
        "    }",
        "    const int64_t u1 = units * (tid + 1) / nth;",
        "    for (int64_t u = units * tid / nth; u < u1; ++u) {",
        "      const int64_t i0 = u / OH, y = u % OH;",
        "      for (int64_t r = 0; r < K; ++r) {",
        f"        const int64_t cv_ih = y * {sh} + ((r / {kw}) % {kh}) * {dh} - {ph}, cv_iw = 0;",
        f"        rp[r] = cv_ih >= 0 && cv_ih < {h} ? {run} : nullptr;",
        "      }",
        *([f"      if (y + {PREFETCH_ROWS} < OH)  // the input rows of a later output row, into cache ahead",
           "        for (int64_t r = 0; r < K; r += " + str(kw) + ") {",
           f"          const int64_t cv_ih = (y + {PREFETCH_ROWS}) * {sh} + ((r / {kw}) % {kh}) * {dh} - {ph}, cv_iw = 0;",
           f"          if (cv_ih >= 0 && cv_ih < {h})",
           f"            for (int64_t q = 0; q < {span}; q += 16) __builtin_prefetch({run} + q);",
           "        }"] if PREFETCH_ROWS else []),
        "      for (int64_t ow0 = 0; ow0 < OW; ow0 += 16) {",
        "        const int64_t n = std::min<int64_t>(16, OW - ow0);",
        "        for (int64_t blk = 0; blk < NBLK; ++blk)",
        f"          vtc_cd_tile<{mbt}, {sw}>(rp, cw, olo, ohi, K, ow0, n, wt + blk * K * {mbt}, "
        f"ct + blk * {mbt} * LDC + ow0, LDC);",
        "      }",
        "      const int64_t m0 = 0, mb = M, n0 = y * OW;",
    ]
    lines += conv_t._epilogue(em, k, "      ", ldc="LDC", first="n0", count="OW", cap=ow)
    lines += ["    }", "  }"]
    head = PRELUDE + gemm.RUNTIME + g.runtime + RUNTIME
    return head + f'\nextern "C" void {k.name}(void* const* bufs, int nthreads) {{\n' + "\n".join(lines) + "\n}\n"
