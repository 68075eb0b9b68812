"""A row kernel whose passes read their row through piece choices along r (a layer norm over a concat along
its reduced dim: Swin's patch merging, four strided slices of [H, W, C] joined along C) computes that row
once into a stack array before its passes, which read the array instead of choosing a piece per element in
each of them (three passes of a layer norm: the sum, the squared deviations and the store).

``ROW_STAGE`` (False: each pass evaluates the choice, as before; a switch for A/B): the largest scalar that
holds such a choice and that every pass reads, on a row of at most ``MAX_ROW`` elements, in a row kernel that
does not store a term of its own (``vtc.codegen.reuse``).
"""
from __future__ import annotations

from vtc.codegen import kernel_ir as K
from vtc.codegen.kernel_ir import Kernel, Scalar, scalars_under
from vtc.index.expr import free_vars, var

ROW_STAGE = True
MAX_ROW = 8192  # floats of the staged row (32 KB of stack)


def _size(s: Scalar) -> int:
    return sum(1 for _ in scalars_under([s]))


def staged_row(k: Kernel) -> Scalar | None:
    """The scalar of k's passes to compute once per row (see the module docstring), or None."""
    if not ROW_STAGE or not isinstance(k.r_extent, int) or not 0 < k.r_extent <= MAX_ROW:
        return None
    roots = [red.value for phase in k.phases for red in phase] + [s.value for s in k.stores if s.per_r]
    if len(roots) < 2:
        return None

    def choosing(s: Scalar) -> bool:  # holds a piece choice along r
        return any(x.op == "pick" and "r" in free_vars(x.args[0]) for x in scalars_under([s]))

    common = None
    for root in roots:
        ids = {id(x): x for x in scalars_under([root]) if x.dtype.is_floating_point}
        common = ids if common is None else {i: x for i, x in common.items() if i in ids}
    cands = [x for x in (common or {}).values() if x.op not in ("const", "acc", "iota") and choosing(x)]
    return max(cands, key=_size) if cands else None


def _bounds(x: Scalar, n: int) -> list[int]:
    """Where the piece choices along r of x change side: the c of each ``r < c`` (``c < r``: c + 1) in (0, n)."""
    out = set()
    for s in scalars_under([x]):
        if s.op != "pick" or free_vars(s.args[0]) != {"r"} or s.args[0].op != "lt":
            continue
        a, b = s.args[0].args
        if a.op == "var" and b.is_const:
            out.add(b.value)
        elif b.op == "var" and a.is_const:
            out.add(a.value + 1)
    return sorted(c for c in out if 0 < c < n)


def stage_lines(x: Scalar, em, r_extent: int, ctype: str) -> list[str]:
    """C lines of a row kernel's body that fill ``xs_[r]`` with x (before the passes): one loop per run of r
    over which every piece choice takes the same side (that side's loads only, vector code), and pin x to it
    in `em` (``_Emitter.pinned``: kept by ``forget``)."""
    cuts = [0, *_bounds(x, r_extent), r_extent]
    lines = [f"    alignas(64) {ctype} xs_[{r_extent}];  // the row, its piece choices made once (ROW_STAGE)"]
    for lo, hi in zip(cuts, cuts[1:]):
        part = K.substitute(x, {"r": var("r", hi - lo) + lo}, {}) if len(cuts) > 2 else x
        em.forget()
        body = em.hoist([part], "      ")
        lines += ["    #pragma omp simd", f"    for (int64_t r = 0; r < {hi - lo}; ++r) {{", *body,
                  f"      xs_[{lo} + r] = {em.scalar(part)};", "    }"]
    em.pinned[id(x)] = "xs_[r]"
    em.forget()
    return lines
