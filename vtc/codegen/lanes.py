"""Row kernels vectorised across rows: reductions over a strided dim read through a permute.

A softmax (or sum, norm) over a dim that is not the innermost one of its
source — ``softmax(x.permute(2, 0, 1), -1)`` — reads each row with a stride
(8 floats in the micro-benchmark): the plain row loop then gathers one element
per cache line touched, and a vectorised reduction over ``r`` needs gather
instructions.  But neighbouring rows (along the kept dim whose step is 1)
read neighbouring elements: for one ``r``, the elements of 16 such rows are
16 contiguous floats.

``lane_row_kernel`` emits such a kernel with the *rows* as vector lanes: each
block of up to 16 rows keeps one accumulator per row in a small array, and
every reduction pass loops over ``r`` outside and over the lanes inside, so
each ``r`` is one contiguous vector load for all rows of the block.  The
per-element stores (softmax's output, contiguous along ``r``) then run row by
row, vectorised over ``r`` as before, reading the block's data from cache.
The compute stage is untouched: the same scalar expressions, evaluated with
the lane's row index and its accumulators.

Where a block holds all rows of the lane dim and they are fewer than 16 (8
channels) while each r steps exactly one block ahead, the elements of the
block for consecutive r are one contiguous run: each vector then takes
``r_unroll`` steps of r (lane j is row ``j % width`` at ``rr + j / width``), so
an 8-row block fills 16 lanes; the lanes of the steps are combined after the
loop, and the steps after the last whole vector run the plain loop.

A costly term that the sum pass and a per-element store share (softmax's
``exp(x - max)``, ``vtc.codegen.reuse``) is stored by the sum pass and read
back by the store pass, as in the plain row kernel; with a block of at most
``TERM_BUFFER`` elements it goes to a buffer of the block (in L1 or L2) rather than
to the output (permute -> softmax over (1024, 256, 8), the kernel alone at 1
thread: 3.5 ms; exp stored once 2.5 ms; and 2 steps of r per vector with the
block buffer 2.0 ms).  The buffer holds the block lane-interleaved (``term_buf[r * width + l]``), so the
store pass, which writes one row (lane) at a time along r, would read it with a stride of ``width`` floats
per element; instead it takes 16 r at a time, transposes the ``width`` x 16 tile in registers
(``transposed_store``: ``vtc_tile_transpose8x16`` for 8 lanes, else ``vtc_tile_transpose16``) and stores 16
contiguous floats per row; the steps of r after the last whole tile, blocks of fewer than 8 lanes and terms
kept in the output read lane by lane (micro_permute_softmax_1mb at 1 thread, CPU time: 0.115 -> 0.094 ms,
docs/chains.md).  ``TERM_BUFFER`` was 4096 until session 27: the 64 MB micro-benchmark's blocks (2048 r x 8 lanes)
then wrote the term to the output, 8 rows 8 MB apart, and read it back (1 thread: 29.6 -> 15.7 ms with the buffer).
Beyond the last-level cache the last pass also prefetches the next block's lines into L2 (``PREFETCH``: 15.7 ->
14.3 ms; docs/chains.md, helper `lanes`).

Used when every load that depends on both ``r`` and the lane dim steps 1
along the lane dim and more than 1 along ``r``, the loads are affine (no
gathered rows, no piece choices) and every reduction is a float sum, max or
min, or an int64 max or min (argmax's index pass: permute -> argmax, docs/reductions.md); anything else
returns None and the plain row kernel is emitted.
"""
from __future__ import annotations

import math

import torch

from vtc.codegen.kernel_ir import Kernel
from vtc.codegen.reuse import stored_term
from vtc.index.expr import affine
from vtc.index.mapping import linear_offset

LANES = 16  # rows per block: one 64-byte line of floats per r
TERM_BUFFER = 32768  # elements of a block's stored softmax term kept in a block buffer (128 KB of floats: in L2)
TILE = 16  # r per transposed tile of the store pass (vtc_tile_transpose16)
TRANSPOSED_STORE = True  # False: the store pass reads the block buffer lane by lane (a stride-`width` read), for A/B
TRANSPOSE_8X16 = True  # blocks of 8 lanes: the 8 x 16 transpose (half the shuffles); False: the 16 x 16 one, for A/B
# a kernel of two or more reduction passes whose working set is larger than the last-level cache
# (``stream.cache_bytes``) and whose pass reads one 64-byte line per load per step of r: its last pass first
# prefetches, per step, the same line of the next block into L2 (``prefetcht1``), so that the next block's first pass
# reads L2 instead of memory (the first pass's memory reads overlap the last pass's compute).  False: never (A/B)
PREFETCH = True
_COMBINE = {"sum": "{a} + {v}", "max": "({v} > {a} ? {v} : {a})", "min": "({v} < {a} ? {v} : {a})"}
_INIT = {"sum": "0", "max": "-INFINITY", "min": "INFINITY"}


def _laned(red) -> bool:
    """Whether reduction `red` runs in lanes: a float32 sum, max or min, or an int64 max or min (argmax's index
    pass, ``vtc.codegen.ops._arg_extreme``: the smallest r holding the row's max)."""
    return red.combine in _COMBINE and (red.dtype == torch.float32 or (red.dtype == torch.int64 and red.combine != "sum"))


def _init(red) -> str:
    """The C initial value of a lane's accumulator of reduction `red`."""
    if red.dtype.is_floating_point:
        return _INIT[red.combine]
    return f"std::numeric_limits<int64_t>::{'lowest' if red.combine == 'max' else 'max'}()"


def _nan_flag(red) -> bool:
    """Whether reduction `red` keeps a NaN flag per lane (a float max / min: NaN if any element is)."""
    return red.combine != "sum" and red.dtype.is_floating_point


def lane_dim(k: Kernel, shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The kept dim to vectorise across, or None when k is not a strided row kernel of the supported kind."""
    from vtc.codegen.lower import scalars_of

    if k.kind != "row" or k.r_extent < 2 or not k.domain or not k.phases:
        return None
    if not all(_laned(red) for phase in k.phases for red in phase):
        return None
    forms = []
    for s in scalars_of(k):
        if s.op == "pick":
            return None
        if s.op == "load":
            form = affine(linear_offset(s.args[1], shapes[s.args[0]]))
            if form is None:
                return None  # gathered rows (an index load) or other non-affine reads
            forms.append(form[1])
    candidates = None
    for coeffs in forms:
        step_r = abs(coeffs.get("r", 0))
        if step_r == 0:
            continue
        unit = {d for d, size in enumerate(k.domain) if size >= 4 and coeffs.get(f"i{d}") == 1}
        if step_r > 1:
            candidates = unit if candidates is None else candidates & unit
    if not candidates:
        return None
    d = max(candidates)
    for coeffs in forms:  # a load contiguous along r that also moves with the lane dim would become strided
        if abs(coeffs.get("r", 0)) == 1 and coeffs.get(f"i{d}", 0) != 0:
            return None
    return d


def lane_row_kernel(k: Kernel, em, parallel_min_work: int, decompose, store) -> list[str] | None:
    """The body of row kernel k with blocks of rows along its lane dim as vector lanes (None: not applicable)."""
    from vtc.codegen.cpp import ctype

    d = lane_dim(k, em.shapes)
    if d is None:
        return None
    names = [f"i{j}" for j in range(len(k.domain))]
    size = k.domain[d]
    others = [j for j in range(len(k.domain)) if j != d]
    outer = math.prod(k.domain[j] for j in others)
    width = min(LANES, size)  # lanes per block; fewer rows than LANES: all of them, a constant trip count
    nb = f"(({size} + {width - 1}) / {width})"  # in C: the size stays a polynomial literal (vtc.runtime.generic)
    lines = [f"  #pragma omp parallel for num_threads(nthreads) "
             f"if({math.prod(k.domain) * k.r_extent} >= {parallel_min_work})",
             f"  for (int64_t ob = 0; ob < {outer} * {nb}; ++ob) {{",
             f"    const int64_t o = ob / {nb}, l0 = ob % {nb} * {width};"]
    if size % width:
        lines.append(f"    const int64_t ln = std::min<int64_t>({width}, {size} - l0);")
    else:
        lines.append(f"    constexpr int64_t ln = {width};")
    lines += decompose([names[j] for j in others], tuple(k.domain[j] for j in others), "o", "    ")
    lane = f"const int64_t {names[d]} = l0 + l;"
    unroll = r_unroll(k, em.shapes, d, width)
    ahead = next_block_prefetch(k, em, d, width, unroll)
    if ahead:  # the next block's indices (this block's for the last one: the prefetch then reads its own lines)
        lines += [f"    const int64_t obn_ = ob + 1 < {outer} * {nb} ? ob + 1 : ob;  // the next block (lanes.PREFETCH)",
                  f"    const int64_t on_ = obn_ / {nb}, l0n_ = obn_ % {nb} * {width};"]
        lines += decompose([f"n{names[j]}_" for j in others], tuple(k.domain[j] for j in others), "on_", "    ")
    done: list = []  # reductions of earlier phases, read by later ones and by the stores
    stored = stored_term(k)  # softmax: exp(x - max) stored by the sum pass, scaled by the store pass
    if stored and k.r_extent * width <= TERM_BUFFER:  # in a block buffer (L1 or L2), else in the output itself
        # a constant size: an array size must not vary with the sizes of a size-generic kernel (vtc.runtime.generic)
        # LANES floats of slack: a transposed tile of fewer than LANES lanes reads up to one row past its end
        lines.append(f"    alignas(64) {ctype(stored.reduction.value.dtype)} term_buf[{TERM_BUFFER + LANES}];")
        stored_at, stored_at_j = f"term_buf[r * {width} + l]", f"term_buf[rr * {width} + j]"  # same element
    else:
        stored_at = stored and f"{em.ptr[stored.store.buffer.name]}[{em.linear(stored.store.buffer.name, stored.store.index)}]"
        stored_at_j = stored_at  # through the row and r of lane j
    for phase in k.phases:
        for red in phase:
            t = ctype(red.dtype)
            lines.append(f"    {t} accv_{red.name}[{width * unroll}];")
            lines.append(f"    for (int l = 0; l < {width * unroll}; ++l) accv_{red.name}[l] = ({t}){_init(red)};")
            if _nan_flag(red):
                lines.append(f"    int nanv_{red.name}[{width * unroll}] = {{0}};")
        tail = "0"  # the first r of the plain loop (in C: r_extent stays a polynomial literal, vtc.runtime.generic)
        if unroll > 1:  # `unroll` steps of r per vector: lane j is row l0 + j % width at r = rr + j / width
            for red in done:
                lines.append(f"    {ctype(red.dtype)} acce_{red.name}[{width * unroll}];")
                lines.append(f"    for (int j = 0; j < {width * unroll}; ++j) acce_{red.name}[j] = accv_{red.name}[j % {width}];")
            tail = f"({k.r_extent} / {unroll} * {unroll})"
            lines += [f"    for (int64_t rr = 0; rr < {tail}; rr += {unroll}) {{",
                      *[f"      __builtin_prefetch({x.replace('@r', 'rr')}, 0, 2);" for x in ahead if phase is k.phases[-1]],
                      "      #pragma omp simd",
                      f"      for (int64_t j = 0; j < {width * unroll}; ++j) {{",
                      f"        const int64_t {names[d]} = l0 + j % {width}, r = rr + j / {width};",
                      *[f"        const {ctype(r.dtype)} acc_{r.name} = acce_{r.name}[j];" for r in done]]
            em.forget()
            for ld, offset in _unrolled_loads(phase, em.shapes, names[d], width):  # contiguous along j
                em.temps[id(ld)] = f"{em.ptr[ld.args[0]]}[{offset}]"
            lines += _accumulate(phase, em, "j", stored, stored_at_j)
            lines += ["      }", "    }"]
        # the plain loop: every r, or the steps after the last whole vector (none when unroll divides r_extent)
        lines += [f"    for (int64_t r = {tail}; r < {k.r_extent}; ++r) {{",
                  *[f"      __builtin_prefetch({x.replace('@r', 'r')}, 0, 2);" for x in ahead if phase is k.phases[-1] and unroll == 1],
                  "      #pragma omp simd",
                  "      for (int64_t l = 0; l < ln; ++l) {",
                  f"        {lane}", *_earlier(done, "        ")]
        em.forget()
        lines += _accumulate(phase, em, "l", stored, stored_at)
        lines += ["      }", "    }"]
        for red in phase:
            for q in range(1, unroll):  # the lanes of the other steps of r into lanes 0 .. width - 1
                a, b = f"accv_{red.name}[l]", f"accv_{red.name}[l + {q * width}]"
                lines.append(f"    for (int l = 0; l < {width}; ++l) {a} = {_COMBINE[red.combine].format(a=a, v=b)};")
                if _nan_flag(red):
                    lines.append(f"    for (int l = 0; l < {width}; ++l) nanv_{red.name}[l] |= nanv_{red.name}[l + {q * width}];")
            if _nan_flag(red):
                lines.append(f"    for (int l = 0; l < {width}; ++l) if (nanv_{red.name}[l]) "
                             f"accv_{red.name}[l] = ({ctype(red.dtype)})NAN;")
        done += phase
    per_r = [s for s in k.stores if s.per_r]
    once = [s for s in k.stores if not s.per_r]
    r0 = "0"  # the first r of the per-lane store loop
    if per_r and transposed_store(k, stored, stored_at, width):
        # 16 r at a time: the block's term for 16 r, lane-interleaved in term_buf, transposed in registers
        r0 = f"({k.r_extent} / {TILE} * {TILE})"
        lines += [f"    for (int64_t rb = 0; rb < {r0}; rb += {TILE}) {{",
                  f"      alignas(64) float tile_[{TILE * TILE}];",
                  f"      vtc_tile_transpose8x16(tile_, {TILE}, term_buf + rb * 8);" if width == 8 and TRANSPOSE_8X16 else
                  f"      vtc_tile_transpose16(tile_, {TILE}, term_buf + rb * {width}, {width});",
                  "      for (int64_t l = 0; l < ln; ++l) {", f"        {lane}", *_earlier(done, "        ")]
        em.forget()
        lines += ["        #pragma omp simd", f"        for (int64_t b = 0; b < {TILE}; ++b) {{",
                  "          const int64_t r = rb + b;",
                  f"          const float term_ = tile_[l * {TILE} + b];"]
        em.temps[id(stored.reduction.value)] = "term_"
        lines += em.hoist([s.value for s in per_r], "          ")
        lines += [store(em, s, "          ") for s in per_r]
        lines += ["        }", "      }", "    }"]
    lines += ["    for (int64_t l = 0; l < ln; ++l) {", f"      {lane}", *_earlier(done, "      ")]
    if per_r:
        em.forget()
        lines += ["      #pragma omp simd", f"      for (int64_t r = {r0}; r < {k.r_extent}; ++r) {{"]
        if stored:  # the term the sum pass stored, read back instead of computed again
            lines.append(f"        const {ctype(stored.reduction.value.dtype)} term_ = {stored_at};")
            em.temps[id(stored.reduction.value)] = "term_"
        lines += em.hoist([s.value for s in per_r], "        ")
        lines += [store(em, s, "        ") for s in per_r]
        lines.append("      }")
    em.forget()
    lines += em.hoist([s.value for s in once], "      ")
    lines += [store(em, s, "      ") for s in once]
    lines += ["    }", "  }"]
    em.forget()
    return lines


def next_block_prefetch(k: Kernel, em, d: int, width: int, unroll: int) -> list[str]:
    """C addresses (``@r`` for the step's r) of the lines the next block's first pass reads at each step of r, one
    per load of the first pass that moves along r, when ``PREFETCH`` applies: two or more passes, a working set
    larger than the last-level cache, and a step that reads one whole line per load (``width * unroll`` lanes of
    floats, each load stepping one float per lane); else []."""
    from vtc.codegen import stream
    from vtc.codegen.kernel_ir import scalars_under

    if not PREFETCH or len(k.phases) < 2 or width * unroll != LANES or \
            stream.working_set_bytes(k) <= stream.cache_bytes():
        return []
    out = []
    for s in scalars_under([red.value for red in k.phases[0]], stop=lambda x: x.op == "pick"):
        if s.op != "load" or s.dtype != torch.float32:
            continue
        c, coeffs = affine(linear_offset(s.args[1], em.shapes[s.args[0]]))
        if coeffs.get("r", 0) == 0:
            continue
        if coeffs.get(f"i{d}") != 1:
            return []
        terms = [str(c), "l0n_", f"{coeffs['r']}*@r"]
        for n, v in coeffs.items():
            j = int(n[1:]) if n[0] == "i" and n[1:].isdigit() else None
            if n != "r" and j != d and v and (j is None or k.domain[j] > 1):
                terms.append(f"{v}*n{n}_" if j is not None else f"{v}*{n}")
        x = f"{em.ptr[s.args[0]]} + {' + '.join(terms)}"
        if x not in out:
            out.append(x)
    return out


def transposed_store(k: Kernel, stored, stored_at, width: int) -> bool:
    """Whether the store pass reads the block buffer 16 r at a time through a register transpose
    (``vtc_tile_transpose16``) instead of one lane at a time with a stride of `width` floats: the stored
    term is a float in the block buffer, a block has at least 8 lanes (a transposed 16 x 16 tile then uses
    at least half its rows) and r has at least one whole tile."""
    return (TRANSPOSED_STORE and bool(stored) and stored_at.startswith("term_buf[")
            and stored.reduction.value.dtype == torch.float32 and 8 <= width <= TILE and k.r_extent >= TILE)


def r_unroll(k: Kernel, shapes: dict[str, tuple[int, ...]], d: int, width: int) -> int:
    """Steps of r per vector (LANES // width) when one block holds all rows of lane dim d and every load
    along r steps `width` per r and 1 per row: the block's elements for consecutive r are then one
    contiguous run, so ``unroll`` steps of r fill a whole vector; else 1."""
    from vtc.codegen.lower import scalars_of

    unroll = LANES // width
    if unroll < 2 or k.domain[d] != width or k.r_extent < unroll:
        return 1
    for s in scalars_of(k):
        if s.op == "load":
            coeffs = affine(linear_offset(s.args[1], shapes[s.args[0]]))[1]
            if coeffs.get("r", 0) != 0 and (coeffs["r"] != width or coeffs.get(f"i{d}") != 1):
                return 1
    return unroll


def _unrolled_loads(phase, shapes, lane: str, width: int) -> list[tuple[object, str]]:
    """(load, C offset) of each load of `phase` along r, at lane j of step rr: c + (l0 + j) + width * rr + ..."""
    from vtc.codegen.kernel_ir import scalars_under

    out = []
    for s in scalars_under([red.value for red in phase], stop=lambda x: x.op == "pick"):
        if s.op != "load":
            continue
        c, coeffs = affine(linear_offset(s.args[1], shapes[s.args[0]]))
        if coeffs.get("r", 0) == 0:
            continue
        names = {lane: "(l0 + j)", "r": "rr"}
        out.append((s, " + ".join([str(c)] + [f"{v}*{names.get(n, n)}" for n, v in coeffs.items()])))
    return out


def _accumulate(phase, em, lane: str, stored, stored_at: str | None) -> list[str]:
    """The loop body of one reduction pass: each reduction's term into its accumulator of lane `lane`."""
    from vtc.codegen.cpp import ctype

    lines = em.hoist([red.value for red in phase], "        ")
    for red in phase:
        v, a = em.scalar(red.value), f"accv_{red.name}[{lane}]"
        if stored and red is stored.reduction:
            lines += [f"        {{ const {ctype(red.value.dtype)} term_ = {v}; {stored_at} = term_;",
                      f"          {a} = {_COMBINE['sum'].format(a=a, v='term_')}; }}"]
        elif red.combine == "sum":
            lines.append(f"        {a} = {_COMBINE['sum'].format(a=a, v=v)};")
        elif not _nan_flag(red):
            lines.append(f"        {{ const {ctype(red.dtype)} v_ = {v}; {a} = {_COMBINE[red.combine].format(a=a, v='v_')}; }}")
        else:
            lines += [f"        {{ const {ctype(red.dtype)} v_ = {v}; {a} = {_COMBINE[red.combine].format(a=a, v='v_')};",
                      f"          nanv_{red.name}[{lane}] |= (v_ != v_); }}"]
    return lines


def _earlier(reds, indent: str) -> list[str]:
    """The lane's values of finished reductions, under the names the scalar emitter uses (acc_<name>)."""
    from vtc.codegen.cpp import ctype

    return [f"{indent}const {ctype(r.dtype)} acc_{r.name} = accv_{r.name}[l];" for r in reds]
