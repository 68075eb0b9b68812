"""Skinny GEMMs with a long reduction as dot products, both operands packed into rows through their mappings.

A product with few rows and few columns but a long reduction (M <= SKINNY_M, N <= DOT_MAX_N, K >= DOT_MIN_K)
is a grid of dot products: EfficientViT's linear attention computes ``k^T v`` per head as 16 x 17 dot
products over the 784 pixels of the map, both operands read through a cat, a permute, a slice and a pad
(the ones column), ``k`` through an inlined ReLU.  The packed panels (vtc.codegen.gemm) spend their time
there transposing: B into 32-column panels of which 17 are used, A into 12-row panels, element by
element through the mapping, for 16 FMAs per reduction step.  Where B has unit stride along the
reduction (every element it loads lies next to the one of the following reduction index: a transposed
operand, as here), this path packs B transposed (``bt[j * kb + p] = B[k0 + p, n0 + j]``) and A as rows
(``ap[i * kb + p]``), both loops walking the unit stride innermost (the pack of a ReLU or a pad vectorises),
then runs the dot-product micro-kernels of the "dot" path (``vtc_dot_cols``: 4 x 4 accumulators, 8 loads
per 16 FMAs, the 16 sums reduced at once).  ``GemmChoice.path`` says "packed_dot".  AVX-512 only; other
CPUs run the packed panels.
"""
from __future__ import annotations

import torch

from vtc.codegen.kernel_ir import scalars_under
from vtc.index.expr import _terms, free_vars
from vtc.index.mapping import linear_offset

PATH = "packed_dot"
DOT_MAX_N = 64  # columns of C (dot products per row) up to which the path is taken
DOT_MIN_K = 64  # the reduction from which it is taken (a dot product pays a 16-lane reduction)


def applies(g, shapes: dict) -> bool:
    """True where gemm operands g run as packed dot products: float32, B not packed by the convolution's
    im2col, M <= SKINNY_M, N <= DOT_MAX_N, K >= DOT_MIN_K, and every buffer element B's scalar loads has unit
    stride along the reduction (B transposed, through any mapping: a cat, a slice, a pad's constant)."""
    from vtc.codegen.gemm import SKINNY_M

    if g.pack_b is not None or g.dtype != torch.float32:
        return False
    if not (g.m <= SKINNY_M and g.n <= DOT_MAX_N and g.k >= DOT_MIN_K):
        return False
    loads = [s for s in scalars_under([g.b]) if s.op == "load"]
    return bool(loads) and all(unit_stride_along(s, "r", shapes) for s in loads)


def unit_stride_along(load, v: str, shapes: dict) -> bool:
    """True when the load's offset moves by exactly 1 with index variable `v` (which appears in no other term)."""
    buf, idx = load.args
    if buf not in shapes:
        return False
    _, terms = _terms(linear_offset(idx, shapes[buf]))
    with_v = [(atom, c) for atom, c in terms.items() if v in free_vars(atom)]
    return len(with_v) == 1 and with_v[0][0].op == "var" and with_v[0][1] == 1


def path_lines(em, g, ind: str, block: list[str], pack_a, prefetch: int) -> list[str]:
    """The packed-dot loops of a KC slice (ending it with ``continue``) where ``applies`` holds, else nothing:
    B^T packed into bp as nb rows of kb (zero-free: the micro-kernels take any n), then per M block A packed
    as rows (`pack_a(em, g, ind, rows=True)`) and ``vtc_dot_cols`` over the block, prefetching ``prefetch``
    floats ahead along B's rows (``gemm.DOT_PF``)."""
    if not applies(g, em.shapes):
        return []
    nv = g.vars[2]
    em.forget()
    inner = ind + "    "
    temps = em.hoist([g.b], inner)
    pack_b = [f"{ind}for (int64_t jj = 0; jj < nb; ++jj) {{  // B^T as rows, the unit stride innermost",
              *([f"{ind}  const int64_t {nv} = n0 + jj;"] if nv else []),
              f"{ind}  float* __restrict dst = bp + jj * kb;",
              f"{ind}  for (int64_t pp = 0; pp < kb; ++pp) {{",
              f"{inner}const int64_t r = k0 + pp;",
              *temps,
              f"{inner}dst[pp] = {em.scalar(g.b)};",
              f"{ind}  }}",
              f"{ind}}}"]
    return [f"{ind}#if defined(__AVX512F__)",
            *pack_b,
            *[ind + x for x in block],
            *pack_a(em, g, ind + "  ", rows=True),
            f"{ind}  vtc_dot_cols<{prefetch}>(mb, nb, kb, ap, bp, kb, ct, LDC, k0 > 0);",
            f"{ind}}}",
            f"{ind}continue;",
            f"{ind}#endif"]
