"""Row kernels of float32 sums over short rows, a block of rows per vector step: a layer norm over 96-512 channels.

A layer norm over a row of 96 floats is 6 vector adds a pass; what costs is what lies between the passes: the
row's horizontal sum (a chain of dependent shuffles and adds) before the next pass may start, the mean's
subtraction and the 1 / sqrt before the store pass.  One row at a time (``cpp._row_kernel``), each pass waits on
the previous one's horizontal sum, and the core has little else to run meanwhile.  Here a block of ``ROWS`` rows
makes each pass together: every step of r adds 16 elements of each row of the block into that row's own vector of
partial sums (the rows are independent chains, interleaved in the code, which the core overlaps), and after the
pass the block's horizontal sums follow one another (``_mm512_reduce_add_ps``).  The terms a pass reads from the
earlier passes (the mean) are computed once per row before it, into an array of the block.  The store pass
interleaves the block's rows the same way (rows past the last one skipped); each step is 16 elements, the last one
masked.  The values are the kernel's own scalar expressions
written as vector code (``vtc.codegen.low_vector``'s ``_VectorBody``: loads that move one element along r, or not
at all, as vectors; + - * / as vector operators; other ops by their scalar C over the lanes).

Kernel alone, C++ variants of the layer norm over Swin-T's rows (1 thread, CPU time, load 8; docs/prefill.md,
session 27): one row at a time 64-71 us at [3136, 96] and 15.7-18.4 us at [196, 384]; a block of 4 rows 39-44 us
and 8.8-9.7 us; each row's pass on its own in turn inside the block (not interleaved) gains nothing (66-76 us):
the interleaving is what overlaps the rows.

**Off by default** (``BLOCKS``): the kernel alone, 1 thread (``bench/norm_kernel_ab.py``, load 11-15), with its input
in cache (a layer norm timed alone) [3136, 96] 83 -> 62 us, [196, 384] 19.0 -> 13.0, [784, 384] 73 -> 56; with its
input and output read from memory after a 48 MB sweep [784, 192] 77 -> 188 us, [784, 384] 125 -> 278 (2 and 8 rows a
block: the same), and neither prefetching the next block's rows nor taking the first pass row by row made up for it
(a hand-edited [784, 192] kernel: 168-186 and 100-105 us against the plain kernel's 71-84).  In Swin-T (1 thread, load
8) its 29 layer norm steps took 1.996 / 2.167 ms -> 1.803 / 2.137 (min / median), those reading a GEMM's output
slower, the others faster; the whole call the same.  Until the order of the memory reads is understood, the plain
row kernel stays the default.

Used for a row kernel (float32, not the rows-as-lanes kernels of ``vtc.codegen.lanes``) whose every reduction is a
float32 sum and whose values and per-r stores are vector code along r (anything else: ``None``, and the plain row
kernel), with no row staged once (``vtc.codegen.row_stage``), no term stored by a pass (softmax), no index-tensor
read, no streaming stores and rows of at most ``MAX_R`` elements (a block's rows stay in L1 between its passes).
The source keeps the plain row kernel after ``#else`` for targets without AVX-512 (``low_vector.TARGET``).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from vtc.codegen import low_vector
from vtc.codegen.kernel_ir import Kernel, scalars_under
from vtc.index.mapping import linear_offset

BLOCKS = False  # off: faster on rows in cache, slower on rows read from memory (module doc); True: A / B, tests
ROWS = 4  # rows of a block (hand variants at [3136, 96], alone: 4 rows 39-44 us, 2 rows 54, one at a time 60-71)
MAX_R = 512  # longest row: a block of 4 rows is 8 KB of L1 (alone, 1 thread: [49, 768] -5%, [49, 1536] +17%)


def _reads_index_tensor(k: Kernel) -> bool:
    """Whether a load's index reads a buffer (a gather: the plain kernel hoists and prefetches those)."""
    def has_load(e) -> bool:
        return e.op == "load" or any(has_load(x) for x in e.args if hasattr(x, "op")) or any(
            has_load(y) for x in e.args if isinstance(x, tuple) for y in x if hasattr(y, "op"))

    roots = [r.value for phase in k.phases for r in phase] + [st.value for st in k.stores]
    return any(s.op == "load" and any(has_load(e) for e in s.args[1]) for s in scalars_under(roots))


def applies(k: Kernel, staged: bool, stored: bool, streamed: bool) -> bool:
    """Whether `k` may run in blocks of rows (module doc); `staged` / `stored` / `streamed`: the plain kernel
    stages a row once, stores a pass's term, streams its stores."""
    return (BLOCKS and k.kind == "row" and not (staged or stored or streamed) and 1 <= k.r_extent <= MAX_R
            and all(r.combine == "sum" and r.dtype == torch.float32 for phase in k.phases for r in phase)
            and bool(k.phases) and not _reads_index_tensor(k))


def block_row_kernel(k: Kernel, em, order: list[int], decompose: Callable, store: Callable,
                     unary_fmt: dict, parallel_min_work: int) -> list[str] | None:
    """The row kernel's loop nest in blocks of ``ROWS`` rows (module doc), or None where a value or a store is not
    vector code along r.  `order`: the kept dims in the row loop's order; `decompose(names, sizes, flat, indent)`:
    lines naming the index variables of flat row `flat`; `store(em, st, indent)`: a scalar store's line;
    unary_fmt: the scalar emitter's op texts (its rounding rule: ``em.rounds``)."""
    rows, n, R = math.prod(k.domain), k.r_extent, ROWS
    names = [f"i{d}" for d in range(len(k.domain))]
    sizes = tuple(k.domain[d] for d in order)
    accs = [r for phase in k.phases for r in phase]

    def row(o: str, indent: str, done: list) -> list[str]:
        """Index variables of row `o` and the accumulators of the reductions in `done` (this row's)."""
        return (decompose([names[d] for d in order], sizes, o, indent) +
                [f"{indent}const float acc_{r.name} = acc_{r.name}_[k_];" for r in done])

    clamped = "o0_ + std::min<int64_t>(k_, nr_ - 1)"  # a block past the last row repeats it (nothing stored)

    def per_row_terms(roots: list, done: list) -> tuple[list[str], list[str]]:
        """(lines before a pass, lines at the top of its body for row k_): the terms of `roots` that do not
        change along r (the mean, 1 / sqrt(var + eps)), computed once per row of the block into arrays."""
        before = set(em.temps)
        hoisted = em.hoist_invariant(roots, {"r"}, "      ", reductions_done=True)
        dtypes = {id(x): x.dtype for x in scalars_under(roots)}
        temps = [(em.temps[i], _ctype(dtypes[i])) for i in em.temps if i not in before]
        if not temps:
            return [], []
        return ([*[f"    {t} {name}_[{R}];" for name, t in temps], f"    #pragma GCC unroll {R}",
                 f"    for (int64_t k_ = 0; k_ < {R}; ++k_) {{", f"      const int64_t o = {clamped};",
                 *row("o", "      ", done), *hoisted, *[f"      {name}_[k_] = {name};" for name, _ in temps], "    }"],
                [f"const {t} {name} = {name}_[k_];" for name, t in temps])

    def vector_pass(head: list[str], body: list[str], guard: str, o: str) -> list[str]:
        """The loop over r, 16 elements a step, each step made for every row of the block in turn."""
        inner = [f"const int64_t o = {o};", *row("o", "", done), *head, *body]
        if guard:
            inner = [f"if ({guard}) {{", *[f"  {line}" for line in inner], "}"]
        return [f"    for (int64_t r = 0; r < {n}; r += 16) {{", f"      const __mmask16 vm_ = vtc_v16_mask({n} - r);",
                f"      #pragma GCC unroll {R}", f"      for (int64_t k_ = 0; k_ < {R}; ++k_) {{",
                *[f"        {line}" for line in inner], "      }", "    }"]

    lines = [f"  #pragma omp parallel for num_threads(nthreads) if({rows * n} >= {parallel_min_work})",
             f"  for (int64_t ob_ = 0; ob_ < ({rows} + {R - 1}) / {R}; ++ob_) {{",  # (a size-generic template fits
             # the rows, a literal polynomial in the sizes; not a ceiling division folded into one literal)
             f"    const int64_t o0_ = ob_ * {R};", f"    const int64_t nr_ = std::min<int64_t>({R}, {rows} - o0_);",
             *[f"    float acc_{r.name}_[{R}];" for r in accs]]
    done: list = []
    try:
        for phase in k.phases:  # each pass: every row's partial sums in a vector of its own, then their sums
            em.forget()
            roots = [r.value for r in phase]
            pre, head = per_row_terms(roots, done)
            body = low_vector._VectorBody(em, "r", low_vector._uses(em, roots), unary_fmt)
            values = [body.value(v) for v in roots]
            lines += ["    {", *pre, *[f"    __m512 p_{r.name}_[{R}];" for r in phase], f"    #pragma GCC unroll {R}",
                      f"    for (int64_t k_ = 0; k_ < {R}; ++k_) {{",
                      *[f"      p_{r.name}_[k_] = _mm512_setzero_ps();" for r in phase], "    }"]
            lines += vector_pass(head, [*body.lines, *[f"p_{r.name}_[k_] = _mm512_mask_add_ps(p_{r.name}_[k_], vm_, "
                                                      f"p_{r.name}_[k_], {v});" for r, v in zip(phase, values)]],
                                 "", clamped)
            lines += [f"    #pragma GCC unroll {R}", f"    for (int64_t k_ = 0; k_ < {R}; ++k_) {{",
                      *[f"      acc_{r.name}_[k_] = _mm512_reduce_add_ps(p_{r.name}_[k_]);" for r in phase], "    }",
                      "    }"]  # the pass's names (its per-row terms t<n>_) end with it
            done += phase
        em.forget()
        per_r = [s for s in k.stores if s.per_r]
        if per_r:  # the store pass: the block's rows interleaved as in the sums
            roots = [s.value for s in per_r]
            pre, head = per_row_terms(roots, done)
            body = low_vector._VectorBody(em, "r", low_vector._uses(em, roots), unary_fmt)
            writes = []
            for st in per_r:
                name = st.buffer.name
                if st.buffer.dtype != torch.float32 or st.when is not None or \
                        low_vector._step(linear_offset(st.index, em.shapes[name]), "r") != 1:
                    return None
                writes.append(f"vtc_v16_store_f32(vm_, {em.ptr[name]} + {em.linear(name, st.index)}, "
                              f"{body.value(st.value)});")
            lines += ["    {", *pre, *vector_pass(head, [*body.lines, *writes], "k_ < nr_", "o0_ + k_"), "    }"]
        once = [s for s in k.stores if not s.per_r]
        if once:  # a row's own values (a layer norm's mean and rstd, where stored)
            em.forget()
            lines += [f"    for (int64_t k_ = 0; k_ < nr_; ++k_) {{", "      const int64_t o = o0_ + k_;",
                      *row("o", "      ", done), *em.hoist([s.value for s in once], "      "),
                      *[store(em, s, "      ") for s in once], "    }"]
    except low_vector.Unsupported:
        return None
    finally:
        em.forget()
    return lines + ["  }"]


def _ctype(dtype: torch.dtype) -> str:
    from vtc.codegen.cpp import ctype

    return ctype(dtype)
