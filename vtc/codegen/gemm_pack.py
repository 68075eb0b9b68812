"""Packing GEMM operands by runs: the parts of a cat, gathered rows, gathered columns.

``vtc.codegen.gemm`` packs A (``[batch, M, K]``) into MR-row panels, ``ap[p * MR + i] = A[m0 + i, k0 + p]``,
and B (``[batch, K, N]``) into NR-column panels.  A plain strided operand is packed from a base pointer and
two strides.  Other mappings were packed element by element through their scalar expression: a cat chose
its source with a test per element, a gathered row re-read its index for every element.  This module
packs them by *runs* instead (``pack_a``, ``pack_b``; gemm.py calls them first):

- A: a **row pointer** per packed row: the row's offset (an index tensor's entry for a gathered row, read
  once; a cat along M or along the batch decided once per row by its piece test; a padding row is a null
  pointer that packs the fill value), then a run along K from it, 16 x 16 blocks transposed in registers
  where the run has unit stride (``vtc_pack_a_ptrs``);
- A: **K segments**: a piece test on the reduction index alone (a cat along K: ``torch.cat([a, b], 1) @ w``)
  is decided at compile time, so the packing loop is split at the sources' boundaries and each segment has
  its own row pointers;
- A: **gathered columns** (``x[:, perm] @ w``): the column offsets of a K block are read from the index
  tensor once, each row gathered by them into an L1 buffer, then packed as runs (``vtc_pack_a_cols``);
- B: a cat or pad along K, N or the batch is cut at compile time into **boxes** of one source each, every
  box packed by runs (``vtc_pack_b_box``).

The index range checks of gathers stay where they are (``vtc.runtime.checks``, before the kernel runs:
an out-of-range index raises IndexError naming the op and the value).  Anything else (a piece test on
both the row and the reduction index, a pointwise producer computed in the pack) is left to gemm.py's
element-by-element loops: ``pack_a`` / ``pack_b`` return None.

``a_packing`` and ``b_packing`` answer the same question for the cost model (``vtc.codegen.gemm.choose``)
from the operand's mapping, before any kernel exists.
"""
from __future__ import annotations

import torch

from vtc.codegen import kernel_ir as K
from vtc.codegen.kernel_ir import scalars_under
from vtc.index.expr import Expr, _terms, evaluate, free_vars, lift, walk
from vtc.index.mapping import linear_offset

MAX_SEGMENTS = 16  # K segments (cat parts along K) split at compile time; more: element by element
MAX_ROW_CASES = 8  # piece choices per row (cat parts along M); more: element by element

RUNTIME = r"""
#ifndef VTC_GEMM_PACK_RUNTIME
#define VTC_GEMM_PACK_RUNTIME
// dst[p * ldp + i * ldi] = rows[i] ? rows[i][p * sk] : fill, for i < nrows, p < n: n columns of A from one
// pointer per row (vtc.codegen.gemm_pack); MR-row panels (ldp = VTC_MR, ldi = 1) from unit-stride runs are
// 16 x 16 blocks transposed in registers
static inline void vtc_pack_a_ptrs(const float* const* rows, int nrows, int64_t n, int64_t sk, float fill,
                                   float* __restrict dst, int64_t ldp, int64_t ldi) {
  int64_t p0 = 0;
#if defined(__AVX512F__)
  if (sk == 1 && ldp == VTC_MR && ldi == 1) {
    const __mmask16 keep = (__mmask16)((1u << VTC_MR) - 1u);
    const __m512 vf = _mm512_set1_ps(fill);
    for (; p0 + 16 <= n; p0 += 16) {
      __m512 r[16];
      #pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        r[i] = i >= nrows ? _mm512_setzero_ps() : rows[i] ? _mm512_loadu_ps(rows[i] + p0) : vf;
      vtc_transpose16_regs(r);
      #pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) _mm512_mask_storeu_ps(dst + (p0 + i) * VTC_MR, keep, r[i]);
    }
  }
#endif
  for (int i = 0; i < nrows; ++i) {
    const float* __restrict s = rows[i];
    float* __restrict d = dst + i * ldi;
    if (!s) { for (int64_t p = p0; p < n; ++p) d[p * ldp] = fill; continue; }
    if (sk == 1 && ldp == 1) { std::memcpy(d + p0, s + p0, (size_t)(n - p0) * sizeof(float)); continue; }
    for (int64_t p = p0; p < n; ++p) d[p * ldp] = s[p * sk];
  }
}

// dst[p * ldp + i * ldi] = rows[i] ? rows[i][cols[p]] : fill: gathered columns, their offsets read once per
// block; each row gathered whole into tmp (n floats per row: one row's reads stay in L1), then packed as runs
static inline void vtc_pack_a_cols(const float* const* rows, int nrows, const int32_t* __restrict cols, int64_t n,
                                   float fill, float* __restrict dst, int64_t ldp, int64_t ldi, float* __restrict tmp) {
  const float* runs[VTC_MR];
  for (int i = 0; i < nrows; ++i) {
    const float* __restrict s = rows[i];
    float* __restrict t = ldp == 1 ? dst + i * ldi : tmp + i * n;  // rows layout: straight into the row
    runs[i] = t;
    int64_t p = 0;
    if (!s) { for (; p < n; ++p) t[p] = fill; continue; }
#if defined(__AVX512F__)
    for (; p + 16 <= n; p += 16)
      _mm512_storeu_ps(t + p, _mm512_i32gather_ps(_mm512_loadu_si512((const void*)(cols + p)), s, 4));
#endif
    for (; p < n; ++p) t[p] = s[cols[p]];
  }
  if (ldp != 1) vtc_pack_a_ptrs(runs, nrows, n, 1, fill, dst, ldp, ldi);
}

// B[k0 + p, n0 + j] for p in [plo, phi), j in [jlo, jhi) into the NR-column panels of bp
// (bp[(j / NR) * NR * kb + p * NR + j % NR]) from src (B at (k0 + plo, n0 + jlo), then src[p * sk + j * sn]
// relative to it), or fill where src is null: one box of a B cut at compile time into single-source parts
// (vtc.codegen.gemm_pack.pack_b)
static inline void vtc_pack_b_box(const float* src, int64_t sk, int64_t sn, float fill, int64_t plo, int64_t phi,
                                  int64_t jlo, int64_t jhi, int64_t kb, float* __restrict bp) {
  for (int64_t j0 = jlo; j0 < jhi;) {
    const int64_t j1 = std::min<int64_t>(jhi, (j0 / VTC_NR + 1) * VTC_NR);
    float* __restrict d = bp + (j0 / VTC_NR) * VTC_NR * kb + plo * VTC_NR + j0 % VTC_NR;
    const float* __restrict s0 = src ? src + (j0 - jlo) * sn : nullptr;
    if (!s0) {
      for (int64_t p = 0; p < phi - plo; ++p)
        for (int64_t j = 0; j < j1 - j0; ++j) d[p * VTC_NR + j] = fill;
    } else if (sn == 1) {  // row-major: each k row of the panel a contiguous run
      for (int64_t p = 0; p < phi - plo; ++p) {
        const float* __restrict s = s0 + p * sk;
        for (int64_t j = 0; j < j1 - j0; ++j) d[p * VTC_NR + j] = s[j];
      }
    } else {  // a transposed weight: each column walked along k
      for (int64_t j = 0; j < j1 - j0; ++j) {
        const float* __restrict s = s0 + j * sn;
        for (int64_t p = 0; p < phi - plo; ++p) d[p * VTC_NR + j] = s[p * sk];
      }
    }
    j0 = j1;
  }
}
#endif
"""


class _Leaf:
    """One source of A's elements over a K segment: buffer[row part + column part], or a fill constant."""

    def __init__(self, buf: str | None, row: Expr | None, fill: float = 0.0) -> None:
        self.buf, self.row, self.fill = buf, row, fill


def _split_offset(lin: Expr, rows: set[str]) -> tuple[Expr, Expr] | None:
    """(terms of the row variables `rows` alone, terms of the reduction index r alone) of offset lin; None
    when a term mixes them or reads another variable."""
    c, terms = _terms(lin)
    row, col = lift(c), lift(0)
    for atom, k in terms.items():
        fv = free_vars(atom)
        if fv <= rows:
            row = row + atom * k
        elif fv == {"r"}:
            col = col + atom * k
        else:
            return None
    return row, col


def _segments(s: K.Scalar, v: str, extent: int) -> list[tuple[int, int, K.Scalar]] | None:
    """[(lo, hi, s with every piece test on variable v alone decided for v in [lo, hi))] covering [0, extent);
    None for more than MAX_SEGMENTS, or a piece test on v that reads a tensor."""
    from vtc.codegen.conv import _choose

    tests = list(dict.fromkeys(x.args[0] for x in scalars_under([s]) if x.op == "pick"
                               and free_vars(x.args[0]) == {v}))
    if not tests:
        return [(0, extent, s)]
    if any(e.op == "load" for p in tests for e in walk(p)):
        return None
    held = [evaluate(p, {v: torch.arange(extent)}).bool().expand(extent) for p in tests]
    change = torch.zeros(extent, dtype=torch.bool)
    for h in held:
        change[1:] |= h[1:] != h[:-1]
    starts = [0, *torch.nonzero(change).flatten().tolist()]
    if len(starts) > MAX_SEGMENTS:
        return None
    out = []
    for lo, hi in zip(starts, [*starts[1:], extent]):
        leaf = s
        for p, h in zip(tests, held):
            leaf = _choose(leaf, p, bool(h[lo]))
        out.append((lo, hi, leaf))
    return out


def _row_cases(s: K.Scalar, rows: set[str], shapes: dict) -> list[tuple[list[Expr], _Leaf, Expr]] | None:
    """[(piece tests of the row, the leaf, its column part)] for one K segment, when every piece test reads
    only the row variables and every leaf is a float32 load of a buffer of `shapes` (offset: row part +
    column part) or a constant; else None."""
    from vtc.codegen.conv import piece_cases

    if any(x.op == "pick" and not free_vars(x.args[0]) <= rows for x in scalars_under([s])):
        return None
    cases = piece_cases(s, {"r"}, MAX_ROW_CASES)
    if cases is None:
        return None
    out = []
    for conds, leaf in cases:
        if leaf.op == "const":
            out.append((conds, _Leaf(None, None, float(leaf.args[0])), None))
            continue
        if leaf.op != "load" or leaf.dtype != torch.float32:
            return None
        buf, idx = leaf.args
        parts = _split_offset(linear_offset(idx, shapes[buf]), rows)
        if parts is None:
            return None
        out.append((conds, _Leaf(buf, parts[0]), parts[1]))
    return out


def _plan(s: K.Scalar, kk: int, rows: set[str], shapes: dict):
    """[(lo, hi, row cases, column part)] per K segment, or None when A does not pack by runs (see module)."""
    segs = _segments(s, "r", kk)
    if segs is None:
        return None
    out = []
    for lo, hi, leaf in segs:
        cases = _row_cases(leaf, rows, shapes)
        if cases is None:
            return None
        cols = {col for _, _, col in cases if col is not None}
        fills = {lf.fill for _, lf, _ in cases if lf.buf is None}
        if len(cols) > 1 or len(fills) > 1:
            return None  # sources with other column strides, or several fill values: element by element
        col = cols.pop() if cols else lift(0)
        if _affine_step(col) is None and not (-2**31 <= col.lo and col.hi < 2**31):
            return None  # gathered column offsets beyond int32 (the gather instructions' offsets)
        out.append((lo, hi, cases, col))
    return out


def _affine_step(col: Expr) -> int | None:
    """k when column part col is k * r (a unit or constant stride along K), else None."""
    c, terms = _terms(col)
    if c != 0 or len(terms) > 1:
        return None
    if not terms:
        return 0
    (atom, k), = terms.items()
    return k if atom.op == "var" and atom.args[0] == "r" else None


def pack_a(em, g, ind: str, rows_layout: bool = False) -> list[str] | None:
    """C lines packing the MB x KB block of A at (m0, k0) by runs (see the module docstring), into
    ``ap[(ii / MR) * MR * kb + pp * MR + ii % MR]`` (or ``ap[ii * kb + pp]`` with rows_layout: the
    dot-product path); None where A is a plain strided load (gemm.py's own packing) or does not pack by runs."""
    bv, mv, _ = g.vars
    rows = {v for v in (bv, mv) if v}
    plan = _plan(g.a, g.k, rows, em.shapes)
    if plan is None:
        return None
    gathered_cols = any(_affine_step(col) is None for _, _, _, col in plan)
    picks = len(plan) > 1 or any(len(cases) > 1 or cases[0][1].buf is None for _, _, cases, _ in plan)
    gathered_rows = any(lf.buf is not None and any(e.op == "load" for e in walk(lf.row))
                        for _, _, cases, _ in plan for _, lf, _ in cases)
    if not (gathered_cols or picks or gathered_rows):
        return None  # one plain strided source: gemm.py packs it with its strides
    ldp, ldi = ("1", "kb") if rows_layout else ("VTC_MR", "1")  # steps of a column and of a row in ap
    i1, i2, i3 = ind + "  ", ind + "    ", ind + "      "
    lines = [f"{ind}{{  // A packed by runs through its mapping (vtc.codegen.gemm_pack)"]
    if gathered_cols:
        lines += [f"{i1}float* __restrict gp_tmp = vtc_gemm_scratch(2, (VTC_MR + 1) * kb);  // gathered rows, then",
                  f"{i1}int32_t* __restrict gp_cols = (int32_t*)(gp_tmp + VTC_MR * kb);  // the column offsets"]
    for lo, hi, cases, col in plan:
        step = _affine_step(col)
        fill = next((lf.fill for _, lf, _ in cases if lf.buf is None), 0.0)
        if lo == 0 and hi == g.k:
            lines += [f"{i1}{{ const int64_t gp_lo = 0, gp_hi = kb;", f"{i2}{{"]
        else:  # the part of this K block in the segment
            lines += [f"{i1}{{ const int64_t gp_lo = std::max<int64_t>(k0, {lo}) - k0, "
                      f"gp_hi = std::min<int64_t>(k0 + kb, {hi}) - k0;",
                      f"{i2}if (gp_lo < gp_hi) {{"]
        if step is None:
            lines += [f"{i3}for (int64_t pp = gp_lo; pp < gp_hi; ++pp) {{ const int64_t r = k0 + pp; "
                      f"gp_cols[pp] = {em.index(col)}; }}"]
        lines += [f"{i3}for (int64_t ii0 = 0; ii0 < mb; ii0 += VTC_MR) {{",
                  f"{i3}  const int nr = (int)std::min<int64_t>(VTC_MR, mb - ii0);",
                  f"{i3}  const float* gp_rows[VTC_MR];",
                  f"{i3}  for (int i = 0; i < nr; ++i) {{"]
        if mv:
            lines.append(f"{i3}    const int64_t {mv} = m0 + ii0 + i;")
        first = "k0 + gp_lo" if step is not None else "0"
        ptrs = []
        for conds, lf, _ in cases:
            ptr = "nullptr" if lf.buf is None else \
                f"{em.ptr[lf.buf]} + {em.index(lf.row)} + ({first}) * {step}" if step is not None else \
                f"{em.ptr[lf.buf]} + {em.index(lf.row)}"
            ptrs.append((" && ".join(em.index(p) for p in conds), ptr))
        expr = ptrs[-1][1]
        for test, ptr in reversed(ptrs[:-1]):
            expr = f"({test}) ? (const float*)({ptr}) : (const float*)({expr})"
        lines += [f"{i3}    gp_rows[i] = {expr};", f"{i3}  }}"]
        dst = f"ap + ii0 * kb + gp_lo * {ldp}"
        if step is not None:
            lines.append(f"{i3}  vtc_pack_a_ptrs(gp_rows, nr, gp_hi - gp_lo, {step}, {_c_float(fill)}, {dst}, {ldp}, {ldi});")
        else:
            lines.append(f"{i3}  vtc_pack_a_cols(gp_rows, nr, gp_cols + gp_lo, gp_hi - gp_lo, {_c_float(fill)}, "
                         f"{dst}, {ldp}, {ldi}, gp_tmp);")
        lines += [f"{i3}}}", f"{i2}}}", f"{i1}}}"]
    return lines + [f"{ind}}}"]


def _c_float(v: float) -> str:
    from vtc.codegen.cpp import literal

    return literal(v, torch.float32)


def pack_b(em, g, ind: str) -> list[str] | None:
    """C lines packing the KB x NB block of B at (k0, n0) into its NR-column panels (zero past nb) when B
    is a cat (or pad) along K, along N or along the batch of plain strided sources: the block is cut at
    the parts' boundaries (decided at compile time) and each box packed by runs (``vtc_pack_b_box``);
    None for anything else (gemm.py's packing)."""
    from vtc.codegen.conv import piece_cases

    bv, _, nv = g.vars
    boxes = []
    k_segments = _segments(g.b, "r", g.k)
    if k_segments is None:
        return None
    for klo, khi, ks in k_segments:
        n_segments = _segments(ks, nv, g.n) if nv else [(0, g.n, ks)]
        if n_segments is None:
            return None
        for nlo, nhi, leaf in n_segments:
            if any(x.op == "pick" and not free_vars(x.args[0]) <= {bv} for x in scalars_under([leaf])):
                return None
            cases = piece_cases(leaf, {"r", nv}, MAX_ROW_CASES)
            if cases is None:
                return None
            srcs = []
            for conds, x in cases:
                if x.op == "const":
                    srcs.append((conds, None, float(x.args[0]), 0, 0))
                    continue
                if x.op != "load" or x.dtype != torch.float32:
                    return None
                c, terms = _terms(linear_offset(x.args[1], em.shapes[x.args[0]]))
                base, sk, sn = lift(c), 0, 0
                for atom, k in terms.items():
                    if atom.op == "var" and atom.args[0] == "r":
                        sk = k
                    elif atom.op == "var" and atom.args[0] == nv:
                        sn = k
                    elif free_vars(atom) <= {bv}:
                        base = base + atom * k
                    else:
                        return None
                srcs.append((conds, x.args[0], base, sk, sn))
            steps = {(sk, sn) for _, buf, _, sk, sn in srcs if buf is not None}
            fills = {f for _, buf, f, _, _ in srcs if buf is None}
            if len(steps) > 1 or len(fills) > 1:
                return None
            boxes.append((klo, khi, nlo, nhi, srcs, steps.pop() if steps else (0, 0), fills.pop() if fills else 0.0))
    if len(boxes) == 1 and len(boxes[0][4]) == 1 and boxes[0][4][0][1] is not None:
        return None  # one plain strided source: gemm.py packs it with its strides
    i1, i2 = ind + "  ", ind + "    "
    lines = [f"{ind}{{  // B packed by runs, box by box (vtc.codegen.gemm_pack)"]
    for klo, khi, nlo, nhi, srcs, (sk, sn), fill in boxes:
        ptr = "nullptr"
        for conds, buf, base, _, _ in reversed(srcs):
            at = "(const float*)nullptr" if buf is None else \
                f"(const float*)({em.ptr[buf]} + ({em.index(base)} + (k0 + plo) * {sk} + (n0 + jlo) * {sn}))"
            ptr = at if ptr == "nullptr" else f"({' && '.join(em.index(p) for p in conds)}) ? {at} : {ptr}"
        lines += [f"{i1}{{ const int64_t plo = std::max<int64_t>(k0, {klo}) - k0, phi = std::min<int64_t>(k0 + kb, {khi}) - k0;",
                  f"{i1}  const int64_t jlo = std::max<int64_t>(n0, {nlo}) - n0, jhi = std::min<int64_t>(n0 + nb, {nhi}) - n0;",
                  f"{i1}  if (plo < phi && jlo < jhi) vtc_pack_b_box({ptr}, {sk}, {sn}, {_c_float(fill)}, plo, phi, jlo, jhi, kb, bp);",
                  f"{i1}}}"]
    return lines + [f"{i1}if (nb % VTC_NR) {{  // the last, narrower panel zero-padded",
                    f"{i2}float* __restrict dst = bp + (nb / VTC_NR) * VTC_NR * kb;",
                    f"{i2}for (int64_t pp = 0; pp < kb; ++pp)",
                    f"{i2}  for (int64_t jj = nb % VTC_NR; jj < VTC_NR; ++jj) dst[pp * VTC_NR + jj] = 0.0f;",
                    f"{i1}}}", f"{ind}}}"]


# -- the cost model's view: how A will be packed, from its mapping ---------------------------------------
def a_packing(low, a) -> str:
    """How the generated GEMM packs virtual operand A (a Value of shape [.., M, K]), decided from its
    mapping before any kernel exists (the same tests as ``pack_a``): "runs" (gathered rows, a cat's
    parts: as fast as a strided operand), "columns" (gathered columns: one gather per element, the
    offsets read once per block) or "elements" (each element through its scalar expression)."""
    from vtc.codegen.ops import POINTWISE, lookup
    from vtc.index.expr import subs, var

    m = low.plan.mappings[a.name]
    rank, kk = len(a.shape), a.shape[-1]
    kvar = f"i{rank - 1}"
    rows = {f"i{d}" for d in range(rank - 1)}
    env = {kvar: var("r", max(kk, 1))}
    tests = [p.when for p in m.pieces[:-1]]
    if len(m.pieces) > MAX_SEGMENTS * MAX_ROW_CASES or \
            any(not (free_vars(t) <= rows or free_vars(t) == {kvar}) for t in tests):
        return "elements"
    cols = set()
    for p in m.pieces:
        if p.source is None:
            continue
        producer = low.producer.get(p.source)
        if producer is not None and lookup(POINTWISE, producer.target) is not None:
            return "elements"  # computed in the pack loop, element by element
        parts = _split_offset(subs(linear_offset(p.index, m.sources[p.source]), env), rows)
        if parts is None:
            return "elements"
        cols.add(_affine_step(parts[1]) is not None)
    return "columns" if False in cols else "runs"


def b_packing(low, b) -> str:
    """How the generated GEMM packs virtual operand B ([.., K, N]), from its mapping (the tests of
    ``pack_b``): "runs" (a cat or pad along K, N or the batch of strided sources: box by box) or
    "elements"."""
    from vtc.codegen.ops import POINTWISE, lookup

    m = low.plan.mappings[b.name]
    rank = len(b.shape)
    kvar, nvar = f"i{rank - 2}", f"i{rank - 1}"
    batch = {f"i{d}" for d in range(rank - 2)}
    if any(not (free_vars(p.when) <= batch or free_vars(p.when) in ({kvar}, {nvar})) for p in m.pieces[:-1]):
        return "elements"
    for p in m.pieces:
        if p.source is None:
            continue
        producer = low.producer.get(p.source)
        if producer is not None and lookup(POINTWISE, producer.target) is not None:
            return "elements"
        _, terms = _terms(linear_offset(p.index, m.sources[p.source]))
        if any(not (free_vars(atom) <= batch or atom.op == "var" and atom.args[0] in (kvar, nvar))
               for atom in terms):
            return "elements"
    return "runs"
