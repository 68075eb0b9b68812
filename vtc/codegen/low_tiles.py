"""bfloat16 / float16 operands read across the rows of a tiled pointwise kernel (a transpose), staged per tile.

A pointwise kernel that reads an operand with a large stride along its inner loop walks tiles of 32 x 32
(``vtc.codegen.cpp``); float32 operands are transposed in registers there (``vtc.codegen.tiles``).  A 16-bit
element read with a stride has no vector gather (AVX-512 gathers 32 and 64 bits), so gcc leaves such a loop
scalar, and a scalar loop's selects (relu, the NaN case of a rounding) become branches that random data
mispredicts: ``relu(x.transpose(1, 2) + y) * 2`` in bf16, 16 x 512 x 256, ran 17 ms against eager's 2.7.

Here each such load is read once per tile in a loop over the tile's *rows* (where the operand is contiguous:
16-bit vector loads, widened to float), into a float tile of 32 x 33 on the stack, which the kernel's inner
loop then reads contiguously.  A full tile of a bfloat16 operand contiguous along the tile's rows is filled by
``vtc_tile_transpose16_bf16`` instead (``REGISTERS``; ``vtc.codegen.tiles``' prelude): four 16 x 16 blocks,
each 16 row loads of 16 bfloat16 widened in vector registers (the bits shifted up: exact), the float
register transpose, 16 row stores; the staging loop wrote the tile column by column.  1.7-2x faster on
``relu(x.transpose(1, 2) + y) * 2`` in bfloat16 (``bench/low_tiles_ab.py``, docs/chains.md "Session 15").  Only loads every element makes (not under a piece choice, whose untaken side
may be out of range) and whose offset is affine in the two tile indices.
"""
from __future__ import annotations

import torch

from vtc.codegen.kernel_ir import Kernel, scalars_under
from vtc.codegen.ops import LOW_PRECISION
from vtc.index.expr import affine
from vtc.index.mapping import linear_offset

REGISTERS = True  # a full tile's bfloat16 operand widened and transposed in registers, 16 x 16 at a time (False: the loop)


def staged_loads(k: Kernel, em, names: list[str], sizes: tuple[int, int], tile: int, indent: str) -> list[str]:
    """C lines (inside the tile loop, ``ta`` and ``tb`` the tile's coordinates) filling a float tile per strided
    bfloat16 / float16 load of k; the loads then read as the tile's elements (``em.temps``, set here: call
    after the emitter forgot its temps)."""
    outer, inner = names[-2], names[-1]
    a, b = sizes
    width = tile + 1  # a row of the tile, padded
    lines: list[str] = []
    roots = [st.value for st in k.stores]
    for s in scalars_under(roots, stop=lambda x: x.op == "pick"):
        if s.op != "load" or s.dtype not in LOW_PRECISION or id(s) in em.temps:
            continue
        form = affine(linear_offset(s.args[1], em.shapes[s.args[0]]))
        if form is None or abs(form[1].get(inner, 0)) < 16 or form[1].get(outer, 0) == 0:
            continue
        name = f"stage{sum(1 for t in em.temps.values() if t.startswith('stage'))}"
        at = f"({outer} - ta * {tile}) * {width} + ({inner} - tb * {tile})"
        lines.append(f"{indent}alignas(64) float {name}[{tile * width}];")
        c, coeffs = form
        if REGISTERS and s.dtype == torch.bfloat16 and coeffs.get(outer) == 1 and tile % 16 == 0:
            # a full tile: (tile / 16)^2 blocks of 16 x 16 widened and transposed in registers (16 row loads each)
            def origin(r: str, q: str) -> str:
                return " + ".join([str(c)] + [f"{v}*({r if n == outer else q if n == inner else n})" for n, v in coeffs.items()])
            lines += [f"{indent}if (ta * {tile} + {tile} <= {a} && tb * {tile} + {tile} <= {b}) {{",
                      f"{indent}  for (int r_ = 0; r_ < {tile}; r_ += 16)",
                      f"{indent}    for (int q_ = 0; q_ < {tile}; q_ += 16)",
                      f"{indent}      vtc_tile_transpose16_bf16({name} + r_ * {width} + q_, {width}, {em.ptr[s.args[0]]} + "
                      f"({origin(f'ta * {tile} + r_', f'tb * {tile} + q_')}), {coeffs[inner]});",
                      f"{indent}}} else"]
        lines += [f"{indent}for (int64_t {inner} = tb * {tile}; {inner} < std::min<int64_t>(tb * {tile} + {tile}, {b}); "
                  f"++{inner}) {{",
                  f"{indent}  #pragma omp simd",
                  f"{indent}  for (int64_t {outer} = ta * {tile}; {outer} < std::min<int64_t>(ta * {tile} + {tile}, {a}); "
                  f"++{outer}) {name}[{at}] = {em.unrounded(s)};",
                  f"{indent}}}"]
        em.temps[id(s)] = f"{name}[{at}]"
    return lines
