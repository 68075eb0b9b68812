"""Transposed reads in pointwise kernels: 16 x 16 float blocks moved through registers.

A pointwise kernel that reads an operand across its rows (a transpose or a
permute in front of it: stride 1 along the row dim ``i{n-2}`` and a large
stride along the contiguous dim ``i{n-1}``) would load one float from a new
cache line per element, scalar.  Instead the kernel walks tiles of 16 rows x
``tile_columns`` columns of its last two dims, and each tile block by block
(``BLOCKED``, ``_blocked``): each transposed operand's 16 x 16 block is
transposed in vector registers (``vtc_tile_transpose16``: 16 row loads of 16
contiguous floats, four butterfly stages of shuffles) into a 1 KB buffer, and
the block's 16 rows of 16 columns are computed from it right away (the buffer
stays in L1; the stores forward to the loads).  The last rows of the domain
(fewer than 16) and a tile's last columns read a block shifted back to end at
the domain's edge, so every element reads a transposed buffer.  In a band of 16
full rows, where the stores are +, -, *, / of float loads (``REGISTERS``,
``_register_block``), the 16 transposed vectors stay in registers and each row
is one vector expression and one 64-byte store: no buffer at all.

The tile is wide (256 columns, for one transposed operand) rather than square:
the other operands and the output are read and written in runs of 1 KB per
row.  Earlier the whole tile's blocks were transposed into a 16 x 256 buffer
first and the tile computed after (``BLOCKED = False`` keeps that form for
A/B): 256 transposed lines read back to back and then the 16 output rows; block
by block is 1.2x faster at 512 x 512 and up to 1.6x at 1448 x 1448 (1 thread,
docs/chains.md, "Transposed tiles block by block").  The block form writes plain stores: with
``STREAM`` a streamed output (``vtc.codegen.stream``) is staged per tile in L1 and written row by
row with ``vtc_stream_row``, which measured slower than plain stores at 8 and 64 MB (streaming each
block's 16 columns as it was computed was 2x slower still).

Only loads that every element of the tile makes are moved this way: a load
under a piece choice (a cat, a pad) may be out of range for the elements that
do not take that piece, so it stays where it is.

``vtc_tile_transpose8x16`` is the transpose of 16 rows of 8 floats (the block buffer of a lane row kernel
with 8 lanes, ``vtc.codegen.lanes``): 8 vector loads of two rows each, three of the butterfly stages and one
lane permute per vector, half the shuffles of a 16 x 16 transpose with 8 rows unused.
"""
from __future__ import annotations

import math

import torch

from vtc.codegen import stream
from vtc.codegen.kernel_ir import Kernel, Scalar
from vtc.index.expr import affine
from vtc.index.mapping import linear_offset

TILE = 16  # rows of a tile, and the edge of a register-transposed block: one cache line of floats
COLUMNS = 256  # columns of a tile with one transposed operand (1 KB runs of each row)
BLOCKED = True  # each 16 x 16 block transposed and consumed at once (False: the whole tile first; for A/B)
# the block form streams a large output (staged per tile, vtc_stream_row) only with STREAM: never streaming was
# faster at 8 and 64 MB with 2 threads on a quiet machine (transpose -> add 8 MB 0.215 vs 0.276 ms, 64 MB 5.92 vs
# 6.66 ms; docs/chains.md) and at 64 MB with 1 thread
STREAM = False
# a full block (16 rows, 16 columns) of a kernel whose stores are +, -, *, / of its loads kept in vector registers:
# the transposed vectors added to the other operands' row vectors and stored, no 1 KB buffer (False: the buffer)
REGISTERS = True
# a register block whose other operand's rows meet the output's rows modulo 4 KB (a row stride of 2 or 4 KB and the two
# buffers at nearly the same address modulo 4 KB: a 1024 x 1024 float transpose -> add, where every large allocation
# starts at the same offset in its page) makes all its loads before its stores: a load behind a store to the same
# address modulo 4 KB waits for it (1 thread: 1024 x 1024 0.41-0.51 -> 0.32-0.35 ms; docs/chains.md, session 19).  Only
# for rows a multiple of 2 KB apart and a working set within the last-level cache; "always": every block of every
# register-form kernel so (A/B, tests), False: never
LOADS_FIRST: bool | str = True
# a register block of a kernel whose working set is larger than PREFETCH_CACHE_SHARE of the last-level cache (its lines
# come from memory) prefetches the lines of the block PREFETCH_BLOCKS on (16 columns each) into L2 (prefetcht1): the
# transposed operands' 16 lines and the 16 rows' lines of the other operands and the output.  Without it a block's 48
# lines from 48 pages wait in the L1's few miss buffers, and no hardware prefetcher follows 16-32 rows at once
# (transpose -> add 2896 x 2896 and 4096 x 4096, harness, 1 thread: 16.4 -> 8.2 ms, 36.0 -> 18.6 ms; docs/chains.md,
# session 27).  0: never
PREFETCH_BLOCKS = 2
PREFETCH_CACHE_SHARE = 1.0
MIN_STRIDE = 16  # elements between neighbours along the inner dim from which a read counts as transposed

PRELUDE = r"""
// dst[a * ld + b] = src[a + stride * b] for a, b < 16: 16 row loads, 4 butterfly stages of shuffles, 16 stores;
// vtc_tile_transpose16_regs: the same into 16 vectors r[a] (lane b), left in registers (VTC_TILE_REGS)
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define VTC_TILE_REGS 1
typedef float vtc_v16 __attribute__((vector_size(64)));
static inline __attribute__((always_inline)) void vtc_tile_transpose16_regs(vtc_v16* __restrict r, const float* __restrict src, int64_t stride) {
  for (int i = 0; i < 16; ++i) __builtin_memcpy(&r[i], src + stride * i, 64);
%s
}
// whether a load from p + k * sp (k = 1..15: a later row of a block) touches the 64 bytes at o modulo 4 KB: the load
// would wait for a store there (4 KB aliasing); the register block then makes its loads first (tiles.LOADS_FIRST)
static inline bool vtc_tile_rows_meet4k(const void* p, const void* o, int64_t sp) {
  bool meet = false;
  for (int64_t k = 1; k < 16; ++k)
    meet |= ((uint64_t)((const char*)p - (const char*)o + k * sp + 63) & 4095) < 127;
  return meet;
}
// the register form's other ops (tiles._register_block): a float broadcast, and a scalar function applied lane by
// lane (written through a local array, compiled to vector code in registers where the function vectorises)
static inline vtc_v16 vtc_tile_splat16(float c) { return (vtc_v16){c, c, c, c, c, c, c, c, c, c, c, c, c, c, c, c}; }
// a where: the lanes of a where the comparison's mask m (all ones / zeros per lane, as a vector comparison gives)
// is set, of b elsewhere (bitwise: no vector ?:, which older clang lacks)
typedef int32_t vtc_i16 __attribute__((vector_size(64)));
static inline vtc_v16 vtc_select16(vtc_i16 m, vtc_v16 a, vtc_v16 b) {
  vtc_i16 x, y; __builtin_memcpy(&x, &a, 64); __builtin_memcpy(&y, &b, 64);
  const vtc_i16 r = (x & m) | (y & ~m); vtc_v16 v; __builtin_memcpy(&v, &r, 64); return v;
}
template <class F> static inline __attribute__((always_inline)) vtc_v16 vtc_map16(vtc_v16 v, F f) {
  alignas(64) float a[16]; __builtin_memcpy(a, &v, 64);
  #pragma omp simd
  for (int l = 0; l < 16; ++l) a[l] = f(a[l]);
  __builtin_memcpy(&v, a, 64); return v;
}
template <class F> static inline __attribute__((always_inline)) vtc_v16 vtc_map16_2(vtc_v16 v, vtc_v16 w, F f) {
  alignas(64) float a[16], b[16]; __builtin_memcpy(a, &v, 64); __builtin_memcpy(b, &w, 64);
  #pragma omp simd
  for (int l = 0; l < 16; ++l) a[l] = f(a[l], b[l]);
  __builtin_memcpy(&v, a, 64); return v;
}
// dst[a * ld + b] = (float)src[a + stride * b] for bfloat16 src (the bits shifted up: exact), a, b < 16: 16 row loads
// of 16 bfloat16, each widened in a vector register, then the float transpose (vtc.codegen.low_tiles)
typedef uint16_t vtc_h16 __attribute__((vector_size(32)));
typedef uint32_t vtc_u16 __attribute__((vector_size(64)));
static inline void vtc_tile_transpose16_bf16(float* __restrict dst, int64_t ld, const uint16_t* __restrict src, int64_t stride) {
  vtc_v16 r[16];
  for (int i = 0; i < 16; ++i) { vtc_h16 h; __builtin_memcpy(&h, src + stride * i, 32);
    const vtc_u16 w = __builtin_convertvector(h, vtc_u16) << 16; __builtin_memcpy(&r[i], &w, 64); }
%s
  for (int i = 0; i < 16; ++i) __builtin_memcpy(dst + ld * i, &r[i], 64);
}
static inline void vtc_tile_transpose16(float* __restrict dst, int64_t ld, const float* __restrict src, int64_t stride) {
  vtc_v16 r[16];
  vtc_tile_transpose16_regs(r, src, stride);
  for (int i = 0; i < 16; ++i) __builtin_memcpy(dst + ld * i, &r[i], 64);
}
#else
static inline void vtc_tile_transpose16(float* __restrict dst, int64_t ld, const float* __restrict src, int64_t stride) {
  for (int b = 0; b < 16; ++b)
    for (int a = 0; a < 16; ++a) dst[a * ld + b] = src[a + stride * b];
}
static inline void vtc_tile_transpose16_bf16(float* __restrict dst, int64_t ld, const uint16_t* __restrict src, int64_t stride) {
  for (int b = 0; b < 16; ++b)
    for (int a = 0; a < 16; ++a) { const uint32_t w = (uint32_t)src[a + stride * b] << 16; __builtin_memcpy(dst + a * ld + b, &w, 4); }
}
#endif
"""


PRELUDE_8X16 = r"""
// dst[l * ld + b] = src[b * 8 + l] for l < 8, b < 16 (16 rows of 8 floats, as in a lane row kernel's block
// buffer of 8 lanes): 8 loads of two rows each, 3 butterfly stages, one lane permute per vector, 8 stores
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
static inline void vtc_tile_transpose8x16(float* __restrict dst, int64_t ld, const float* __restrict src) {
  vtc_v16 r[8];
  for (int i = 0; i < 8; ++i) __builtin_memcpy(&r[i], src + 16 * i, 64);
%s
  for (int i = 0; i < 8; ++i) { const vtc_v16 a = __builtin_shufflevector(r[i], r[i], %s);
    __builtin_memcpy(dst + ld * i, &a, 64); }
}
#else
static inline void vtc_tile_transpose8x16(float* __restrict dst, int64_t ld, const float* __restrict src) {
  for (int l = 0; l < 8; ++l)
    for (int b = 0; b < 16; ++b) dst[l * ld + b] = src[b * 8 + l];
}
#endif
"""


def _butterfly(stages: tuple[int, ...] = (1, 2, 4, 8), vectors: int = 16) -> str:
    """The shuffle stages of a transpose: stage s swaps the off-diagonal s x s blocks of each 2s x 2s block
    (bit s of the vector's index with bit s of the lane's)."""
    lines = []
    for s in stages:
        lo = [j if not j & s else 16 + j - s for j in range(16)]
        hi = [j + s if not j & s else 16 + j for j in range(16)]
        lines.append(f"  for (int i = 0; i < {vectors}; ++i) if (!(i & {s})) {{ const vtc_v16 a = r[i], b = r[i + {s}];\n"
                     f"    r[i] = __builtin_shufflevector(a, b, {', '.join(map(str, lo))});\n"
                     f"    r[i + {s}] = __builtin_shufflevector(a, b, {', '.join(map(str, hi))}); }}")
    return "\n".join(lines)


def _transpose8x16() -> str:
    """vtc_tile_transpose8x16: vector i holds rows 2i, 2i + 1 (lane bits r0 l2 l1 l0, vector bits r3 r2 r1);
    the stages 1, 2, 4 swap vector bit k with lane bit k (vector bits l2 l1 l0, lane bits r0 r3 r2 r1), and
    the permute puts lane o = r3 r2 r1 r0 where it reads lane (r0 << 3) | (o >> 1)."""
    perm = [((o & 1) << 3) | (o >> 1) for o in range(16)]
    return PRELUDE_8X16 % (_butterfly((1, 2, 4), 8), ", ".join(map(str, perm)))


PRELUDE = PRELUDE % (_butterfly(), _butterfly()) + _transpose8x16()


def _unconditional_loads(k: Kernel) -> list[Scalar]:
    """The loads of k's stores that every element makes (not under a piece choice), each once."""
    seen: set[int] = set()
    out: list[Scalar] = []
    stack = [s.value for s in k.stores]
    while stack:
        s = stack.pop()
        if id(s) in seen:
            continue
        seen.add(id(s))
        if s.op == "load":
            out.append(s)
        elif s.op == "pick":
            continue  # only the chosen side is in range
        stack.extend(a for a in s.args if isinstance(a, Scalar))
    return out


def transposed_loads(k: Kernel, shapes: dict[str, tuple[int, ...]]) -> list[tuple[Scalar, int, dict[str, int], int]]:
    """(load, offset, coefficients, stride) of each float32 load of k read across its rows, tile-transposable."""
    if k.kind == "row" or len(k.domain) < 2 or min(k.domain[-2:]) < TILE:
        return []
    inner, row = f"i{len(k.domain) - 1}", f"i{len(k.domain) - 2}"
    out = []
    for s in _unconditional_loads(k):
        if s.dtype != torch.float32:
            continue
        form = affine(linear_offset(s.args[1], shapes[s.args[0]]))
        if form is None:
            continue
        c, coeffs = form
        if coeffs.get(row) == 1 and coeffs.get(inner, 0) >= MIN_STRIDE:
            out.append((s, c, coeffs, coeffs[inner]))
    return out


def tile_columns(n_loads: int) -> int:
    """Columns of a tile when `n_loads` operands are transposed: a multiple of TILE, their buffers 16 KB at most."""
    return max(4 * TILE, COLUMNS // max(n_loads, 1) // TILE * TILE)


def tiled_transpose_kernel(k: Kernel, em, loads, par: str, decompose, store) -> list[str]:
    """The loop nest of a pointwise kernel whose `loads` go through 16 x 16 register transposes.

    Tiles of TILE rows x tile_columns(len(loads)) columns; in a tile of TILE full rows, the blocks of
    16 full columns read the transposed buffers, the columns after the last full block the loads."""
    shape = k.domain
    names = [f"i{d}" for d in range(len(shape))]
    a, b = shape[-2], shape[-1]
    cols = tile_columns(len(loads))
    # tile counts as ceiling divisions in C: the sizes stay polynomial literals (vtc.runtime.generic)
    ta, tb = f"(({a} + {TILE - 1}) / {TILE})", f"(({b} + {cols - 1}) / {cols})"
    outer = math.prod(shape[:-2])
    row, inner = names[-2], names[-1]
    lines = [par, f"  for (int64_t t = 0; t < {outer} * {ta} * {tb}; ++t) {{",
             f"    const int64_t o = t / ({ta} * {tb}), ta0 = (t / {tb}) % {ta} * {TILE}, tb0 = t % {tb} * {cols};"]
    lines += decompose(names[:-2], shape[:-2], "o", "    ")
    # tb1: the tile's end column; tbf: the end of its full blocks of 16 columns
    lines.append(f"    const int64_t tb1 = std::min<int64_t>(tb0 + {cols}, {b}), tbf = tb0 + (tb1 - tb0) / {TILE} * {TILE};")

    def body(start: str, end: str, indent: str) -> list[str]:
        out = [f"{indent}#pragma omp simd", f"{indent}for (int64_t {inner} = {start}; {inner} < {end}; ++{inner}) {{"]
        out += em.hoist([s.value for s in k.stores], indent + "  ")
        out += [store(em, s, indent + "  ") for s in k.stores]
        return out + [f"{indent}}}"]

    # a large output: non-temporal stores (the block form only with STREAM: plain stores were faster, see STREAM)
    streamed = (STREAM or not BLOCKED) and stream.applies(k, em.shapes, k.stores, inner, stream.TILED_CACHE_SHARE)

    def origin(c: int, coeffs: dict[str, int], r0: str = "ta0", c0: str = "q") -> str:
        """The offset of the block whose first row is r0 and first column c0 (C expressions)."""
        return " + ".join([str(c)] + [f"{v}*{r0 if n == row else c0 if n == inner else n}" for n, v in coeffs.items()])

    if BLOCKED:
        lines += _blocked(k, em, loads, a, b, cols, row, inner, streamed, origin, body)
        em.forget()
        return stream.fenced(lines) if streamed else lines
    lines.append(f"    if (ta0 + {TILE} <= {a}) {{")
    em.forget()
    for j, (s, c, coeffs, stride) in enumerate(loads):
        lines += [f"      alignas(64) float tr{j}[{TILE * cols}];",
                  f"      for (int64_t q = tb0; q < tbf; q += {TILE})",
                  f"        vtc_tile_transpose16(tr{j} + (q - tb0), {cols}, {em.ptr[s.args[0]]} + ({origin(c, coeffs)}), {stride});"]
        em.temps[id(s)] = f"tr{j}[({row} - ta0) * {cols} + ({inner} - tb0)]"
    lines.append(f"      for (int64_t {row} = ta0; {row} < ta0 + {TILE}; ++{row}) {{")
    lines += (stream.streamed_loop(em, k.stores, inner, "tb0", "tbf", "        ", body) if streamed
              else body("tb0", "tbf", "        "))
    em.forget()
    lines += body("tbf", "tb1", "        ")
    lines += ["      }", "    } else {",
              f"      for (int64_t {row} = ta0; {row} < std::min<int64_t>(ta0 + {TILE}, {a}); ++{row}) {{"]
    em.forget()
    lines += body("tb0", "tb1", "        ")
    lines += ["      }", "    }", "  }"]
    em.forget()
    return stream.fenced(lines) if streamed else lines


def _blocked(k: Kernel, em, loads, a, b, cols: int, row: str, inner: str, streamed: bool, origin, body) -> list[str]:
    """The body of a tile block by block (``BLOCKED``): per block of 16 columns, each transposed operand's
    16 x 16 block goes through registers into a 1 KB buffer (kept in L1, read right back) and the block's rows
    are computed from it.  The last tile's rows (fewer than 16 when 16 does not divide the rows) and a tile's
    last columns (fewer than 16) read a block shifted back to end at the domain's edge (rows a - 16..a, columns
    tb1 - 16..tb1: inside the domain, which is at least 16 x 16), so every element reads a transposed buffer.
    Streamed (a large output): the full blocks' results are staged in L1 (16 x cols floats per store) and each
    row of the tile is written with whole-line streaming stores (``vtc_stream_row``; streaming each block's
    16 columns as they come was 2x slower, docs/chains.md); the last columns are stored plainly."""
    T = TILE
    lines = [f"    const int64_t ra = std::min<int64_t>(ta0, {a} - {T}), re = std::min<int64_t>(ta0 + {T}, {a});"]
    staged = [f"ob{j}" for j in range(len(k.stores))] if streamed else []
    lines += [f"    alignas(64) float {ob}[{T * cols}];" for ob in staged]

    def block(c0: str, lo: str, hi: str, staged_here: bool) -> list[str]:
        out = []
        for j, (s, c, coeffs, stride) in enumerate(loads):
            out += [f"      alignas(64) float tr{j}[{T * T}];",
                    f"      vtc_tile_transpose16(tr{j}, {T}, {em.ptr[s.args[0]]} + ({origin(c, coeffs, 'ra', c0)}), {stride});"]
            em.temps[id(s)] = f"tr{j}[({row} - ra) * {T} + ({inner} - {c0})]"
        out.append(f"      for (int64_t {row} = ta0; {row} < re; ++{row}) {{")
        if staged_here:
            i3 = "          "
            out += ["        #pragma omp simd", f"        for (int64_t {inner} = {lo}; {inner} < {hi}; ++{inner}) {{"]
            out += em.hoist([st.value for st in k.stores], i3)
            out += [f"{i3}{ob}[({row} - ta0) * {cols} + ({inner} - tb0)] = {em.scalar(st.value)};"
                    for ob, st in zip(staged, k.stores)]
            out.append("        }")
        else:
            out += body(lo, hi, "        ")
        em.forget()
        return out + ["      }"]

    flag, registers = ([], []) if streamed else _register_block(k, em, loads, a, b, row, inner, origin)
    lines += flag
    lines.append(f"    for (int64_t q = tb0; q < tbf; q += {T}) {{")
    lines += registers
    lines += block("q", "q", f"q + {T}", streamed)
    lines += ["    }", "    if (tbf < tb1) {", f"      const int64_t qa = tb1 - {T};"]
    lines += block("qa", "tbf", "tb1", False)
    lines.append("    }")
    if staged:
        lines.append(f"    for (int64_t {row} = ta0; {row} < re; ++{row}) {{")
        for ob, st in zip(staged, k.stores):  # the address of column 0 of the row: the offset is base + inner
            lines.append(f"      {{ const int64_t {inner} = 0; vtc_stream_row({em.ptr[st.buffer.name]} + "
                         f"{em.linear(st.buffer.name, st.index)} + tb0, {ob} + ({row} - ta0) * {cols}, tbf - tb0); }}")
        lines.append("    }")
    return lines + ["  }"]


_VECTOR_OPS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}  # binary ops that C's vector extensions take as operators
_COMPARISONS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}  # a where's condition
# float binary ops without a vector operator: applied lane by lane (vtc_map16_2) with the scalar form's C
_MAPPED_BINARY = {"max", "min", "pow", "atan2", "fmod", "remainder", "div_floor", "div_trunc"}
_NOT_FLOAT_UNARY = {"not", "bitnot"}


def _register_block(k: Kernel, em, loads, a: int, b: int, row: str, inner: str, origin) -> tuple[list[str], list[str]]:
    """A full block of a tile (16 full rows: ``re - ta0 == 16``) with the transposed vectors in registers
    (``REGISTERS``): per row, the transposed operands' vector ``v{j}[r_]``, the other operands' 16 floats of
    the row as a vector (or one float, broadcast, where they do not move along the row), the store's value
    in vector arithmetic, one 64-byte store; then ``continue`` (the buffer form below is for the last rows).
    The rows loop has a constant trip count, unrolled, so the 16 vectors stay in registers (harness
    ``bench/tiles_variants.cpp``: 5-10% faster than through the 1 KB buffer, 1 thread).  Only where every
    store is a float32 row-contiguous store of a float32 expression of float32 loads and constants: +, -, *, /
    as vector operators, a ``where`` whose condition compares two such expressions as a vector select, a
    negation as a vector negation, any other float unary op (relu, abs, exp, sigmoid, ...) and max, min, pow, ...
    lane by lane through ``vtc_map16`` / ``vtc_map16_2`` with the scalar form's C (gcc compiles those loops to
    the same vector code in registers); no lines otherwise, and where the compiler has no vector types
    (``VTC_TILE_REGS``).  Each value used twice is computed once per row (``e{n}``).

    Returns (the tile's lines before its blocks, the block's lines).  With ``LOADS_FIRST``, one store, an operand
    with the store's row stride, that stride a multiple of 2 KB and a working set within the last-level cache, the
    first compute ``first_``: whether a later row of such an operand meets the output's row modulo 4 KB
    (``vtc_tile_rows_meet4k``; the same for every block of the tile, as both move one float per column); the block
    then has a second form for it, all 16 rows' values before the 16 stores.  A working set beyond
    ``PREFETCH_CACHE_SHARE`` of the last-level cache: each block first prefetches the lines of the block
    ``PREFETCH_BLOCKS`` on into L2."""
    if not REGISTERS:
        return [], []
    from vtc.codegen.cpp import _UNARY_FMT  # (cpp imports this module)
    transposed = {id(s): j for j, (s, *_) in enumerate(loads)}
    rows: dict[int, Scalar] = {}  # loads contiguous along the row, read as vectors
    seen: set[int] = set()
    uses: dict[int, int] = {}

    def coefficient(buf: str, idx, along: str = inner) -> int | None:
        form = affine(linear_offset(idx, em.shapes[buf]))
        return None if form is None else form[1].get(along, 0)

    def fits(x: Scalar, condition: bool = False) -> bool:
        uses[id(x)] = uses.get(id(x), 0) + 1
        if id(x) in seen:
            return True
        seen.add(id(x))
        if condition:  # a where's condition: a comparison of two float32 expressions
            return (x.op == "binary" and x.args[0] in _COMPARISONS and all(y.dtype == torch.float32 for y in x.args[1:])
                    and all(fits(y) for y in x.args[1:]))
        if x.dtype != torch.float32:
            return False
        if x.op == "const":
            return True
        if x.op == "load":
            if id(x) in transposed:
                return True
            c = coefficient(x.args[0], x.args[1])
            if c == 1:
                rows[id(x)] = x
            return c == 0 or (c == 1 and coefficient(x.args[0], x.args[1], row) is not None)
        if x.op == "binary":
            return (x.args[0] in _VECTOR_OPS or x.args[0] in _MAPPED_BINARY) and all(
                y.dtype == torch.float32 and fits(y) for y in x.args[1:])
        if x.op == "unary":
            return x.args[0] not in _NOT_FLOAT_UNARY and x.args[1].dtype == torch.float32 and fits(x.args[1])
        if x.op == "where":
            return fits(x.args[0], True) and fits(x.args[1]) and fits(x.args[2])
        return False

    if not all(st.buffer.dtype == torch.float32 and st.when is None and coefficient(st.buffer.name, st.index) == 1
               and coefficient(st.buffer.name, st.index, row) is not None and fits(st.value) for st in k.stores):
        return [], []
    T = TILE
    out = ["#if defined(VTC_TILE_REGS)", f"      if (re - ta0 == {T}) {{"]
    for j, (s, c, coeffs, stride) in enumerate(loads):
        out += [f"        vtc_v16 v{j}[{T}];",
                f"        vtc_tile_transpose16_regs(v{j}, {em.ptr[s.args[0]]} + ({origin(c, coeffs, 'ta0', 'q')}), {stride});"]
    # each row-contiguous operand and output from the block's first row: a base pointer and its row stride (one
    # register each, the rows at constant displacements; row by row, gcc kept 32 row pointers on the stack)
    bases = [(f"p{n}", x.args[0], x.args[1]) for n, x in enumerate(rows.values())]
    bases += [(f"o{n}", st.buffer.name, st.index) for n, st in enumerate(k.stores)]
    out.append(f"        const int64_t {row} = ta0, {inner} = q;  // the block's first row and column")
    for name, buf, idx in bases:
        qual = "" if name[0] == "o" else "const "
        out.append(f"        {qual}float* {name} = {em.ptr[buf]} + {em.linear(buf, idx)};")
    if PREFETCH_BLOCKS and stream.working_set_bytes(k) > PREFETCH_CACHE_SHARE * stream.cache_bytes():
        ahead = PREFETCH_BLOCKS * T  # columns
        out += [f"        if (q + {ahead + T} <= {b}) {{  // the block {PREFETCH_BLOCKS} on, into L2 (tiles.PREFETCH_BLOCKS)",
                f"          #pragma GCC unroll {T}", f"          for (int r_ = 0; r_ < {T}; ++r_) {{"]
        out += [f"            __builtin_prefetch({em.ptr[s.args[0]]} + ({origin(c, coeffs, 'ta0', f'(q + {ahead})')}) + r_ * {stride}, 0, 2);"
                for s, c, coeffs, stride in loads]
        out += [f"            __builtin_prefetch({name} + r_ * {coefficient(buf, idx, row)} + {ahead}, {int(name[0] == 'o')}, 2);"
                for name, buf, idx in bases]
        out += ["          }", "        }"]
    out += [f"        #pragma GCC unroll {T}", f"        for (int r_ = 0; r_ < {T}; ++r_) {{",
            f"          const int64_t {row} = ta0 + r_;  // for the loads that do not move along the row"]
    names: dict[int, str] = {id(s): f"v{j}[r_]" for j, (s, *_) in enumerate(loads)}
    for (name, buf, idx), x in zip(bases, rows.values()):
        out.append(f"          vtc_v16 l{name[1:]}; __builtin_memcpy(&l{name[1:]}, {name} + r_ * {coefficient(buf, idx, row)}, 64);")
        names[id(x)] = f"l{name[1:]}"
    body: list[str] = []

    def vec(x: Scalar) -> str:
        """x as a vector expression of the row (a comparison: a vector mask); a value used twice gets a temp."""
        if id(x) in names:
            return names[id(x)]
        op, args = x.op, x.args
        if op in ("const", "load"):  # a constant, or a float of the row (not moving along it): broadcast
            return f"vtc_tile_splat16({em.scalar(x)})"
        if op == "binary" and args[0] in _VECTOR_OPS:
            c = f"({vec(args[1])} {_VECTOR_OPS[args[0]]} {vec(args[2])})"
        elif op == "binary" and args[0] in _COMPARISONS:
            c = f"({vec(args[1])} {_COMPARISONS[args[0]]} {vec(args[2])})"
        elif op == "binary":
            f = em.binary(args[0], "p_", "q_", torch.float32, torch.float32)
            c = f"vtc_map16_2({vec(args[1])}, {vec(args[2])}, [](float p_, float q_) {{ return {f}; }})"
        elif op == "unary" and args[0] == "neg":
            c = f"(-{vec(args[1])})"
        elif op == "unary":
            f = _UNARY_FMT[args[0]].format(x="z_", t="float")
            c = f"vtc_map16({vec(args[1])}, [](float z_) {{ return {f}; }})"
        else:  # where: a vector select on the comparison's mask
            c = f"vtc_select16({vec(args[0])}, {vec(args[1])}, {vec(args[2])})"
        if uses.get(id(x), 0) > 1:
            names[id(x)] = f"e{len(body)}"
            body.append(f"          const auto e{len(body)} = {c};")
            return names[id(x)]
        return c

    values = [vec(st.value) for st in k.stores]
    out += body
    for n, v in enumerate(values):
        out.append(f"          const vtc_v16 s{n} = {v};")
    st = k.stores[0]
    stride = coefficient(st.buffer.name, st.index, row)
    meeting = [(buf, idx) for _, buf, idx in bases[:len(rows)] if coefficient(buf, idx, row) == stride]
    flag = []
    # rows 2 or 4 KB apart (a power of two of 512 floats or more) meet every other row or every row when the two
    # buffers do; other strides meet at one row distance at most, and at 1448 floats (8 MB) the kernel with the
    # second form was up to 26% slower in half the runs; loading first from memory was 7% slower (64 MB)
    worth = (4 * stride) % 2048 == 0 and stream.working_set_bytes(k) <= stream.cache_bytes()
    if LOADS_FIRST and len(k.stores) == 1 and meeting and (worth or LOADS_FIRST == "always"):
        # the tile's flag, then where it is set the same row loop computing all 16 rows' values and the 16 stores
        # after them; else each row's store right after its loads
        out_at = f"{em.ptr[st.buffer.name]} + {em.linear(st.buffer.name, st.index)}"
        meets = "true" if LOADS_FIRST == "always" else " || ".join(
            f"vtc_tile_rows_meet4k({em.ptr[buf]} + {em.linear(buf, idx)}, {out_at}, {4 * stride})"
            for buf, idx in meeting)
        flag = ["#if defined(VTC_TILE_REGS)",
                "    bool first_;  // the register blocks' loads before their stores (tiles.LOADS_FIRST)",
                f"    {{ const int64_t {row} = ta0, {inner} = tb0; first_ = {meets}; }}", "#endif"]
        head = out.index(f"        #pragma GCC unroll {T}")
        loop = out[head:]
        out[head:] = ["        if (first_) {", f"          vtc_v16 s0_[{T}];",
                      *[f"  {line}" for line in loop], "            s0_[r_] = s0;", "          }",
                      f"          #pragma GCC unroll {T}",
                      f"          for (int r_ = 0; r_ < {T}; ++r_) __builtin_memcpy(o0 + r_ * {stride}, &s0_[r_], 64);",
                      "          continue;", "        }", *loop]
    out += [f"          __builtin_memcpy(o{n} + r_ * {coefficient(st.buffer.name, st.index, row)}, &s{n}, 64);"
            for n, st in enumerate(k.stores)]
    em.forget()
    return flag, out + ["        }", "        continue;", "      }", "#endif"]
