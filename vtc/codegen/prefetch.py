"""Software prefetch of gathered rows in row kernels.

A row kernel that reads rows picked by an index tensor (``index_select``,
``embedding``, a gather in front of ``sum`` or ``softmax``) jumps to a new row
at a random place for every row it computes.  The hardware prefetcher only
starts after the first misses of each row, so a 1 KB row costs a few memory
latencies instead of its transfer time.  ``gathered_row_prefetch`` emits, at
the top of the row loop, prefetches of the rows that row ``o + AHEAD`` will
read (its index loads evaluated for that row), one per cache line: by the time
the loop gets there they are in cache.  Only loads that are contiguous along
``r`` (the row) and at most ``MAX_LINES`` lines long are prefetched; only loads
every element makes (not under a piece choice, whose untaken side may be out
of range) are considered, as in ``_Emitter.hoist_index_loads``.

Where the gathered tables are larger than a core's L2 (``l2_bytes``), their rows
come from L3 or memory: then the rows ``FAR_AHEAD`` on are prefetched into L2
(``prefetcht1``), and those ``AHEAD`` on into L1 (``prefetcht0``) as before.  A
prefetch into L1 holds one of the core's few L1 miss buffers until its line
arrives, so with lines from memory the core has only ~20 lines in flight (8.8
GB/s with 1 thread here); a prefetch into L2 waits in L2's larger miss queue.
index_select -> sum over a 64 MB table of 1 KB rows, vtc's kernel, 1 thread, CPU time: 7.8 -> 4.4 ms, with
2 threads as fast as reading the table contiguously (docs/chains.md, session 27).  A table within L2 (1 MB)
keeps the L1 form: there the L2 prefetch leaves every load an L2 hit, 10-20% slower.
"""
from __future__ import annotations

import math

from vtc.codegen import stream
from vtc.codegen.kernel_ir import Kernel, scalars_under
from vtc.index.expr import free_vars, subs, var, walk
from vtc.index.mapping import linear_offset

AHEAD = 4  # rows ahead (index_select -> sum over 256 floats: 30 -> 19 ms with 1 thread), into L1
FAR_AHEAD = 16  # rows ahead, into L2, for tables larger than L2 (8 to 32 rows measured alike at 64 MB)
FAR_AND_NEAR = True  # tables larger than L2: the rows AHEAD on also into L1 (64 MB, C harness: 5-15% faster)
L2_BYTES: int | None = None  # overrides the machine's L2 size (tests, benchmarks)
FALLBACK_L2_BYTES = 1 << 20  # where sysfs does not say
LINE = 64  # bytes
MAX_LINES = 64  # longest row prefetched (4 KB of floats)


def gathered_row_prefetch(k: Kernel, em, names: list[str], order: list[int], rows: int, indent: str) -> list[str]:
    """C lines prefetching, for row o + AHEAD of the row loop (into L1) and, for tables larger than L2, for row
    o + FAR_AHEAD (into L2), the gathered rows it reads (empty if none)."""
    from vtc.codegen.cpp import _decompose

    loads = _gathered_row_loads(k)
    if not loads:
        return []
    env = {n: var(f"p{n}", max(int(k.domain[d]), 1)) for d, n in enumerate(names)}
    tables = {buf for buf, _ in loads}
    far = sum(math.prod(b.shape) * b.dtype.itemsize for b in k.inputs if b.name in tables) > l2_bytes()
    # prefetcht1 / prefetcht0 (the default locality, 3).  The two forms differ in text, not only in literals, so a
    # size-generic template (vtc.runtime.generic) is never fitted across them: its literals may become run-time
    # expressions, and __builtin_prefetch's locality must be a constant
    forms = ([(FAR_AHEAD, ", 0, 2")] + ([(AHEAD, "")] if FAR_AND_NEAR else [])) if far else [(AHEAD, "")]
    lines = []
    for ahead, hint in forms:
        lines += [f"{indent}if (o + {ahead} < {rows}) {{",
                  *_decompose([f"p{names[d]}" for d in order], tuple(k.domain[d] for d in order), f"(o + {ahead})",
                              indent + "  ")]
        seen: set[str] = set()
        for buf, lin in loads:
            itemsize = next(b.dtype.itemsize for b in k.inputs if b.name == buf)
            n_lines = -(-k.r_extent * itemsize // LINE)
            start = em.index(subs(lin, {**env, "r": 0}))
            if start in seen or n_lines > MAX_LINES:
                continue
            seen.add(start)
            lines += [f"{indent}  {{ const char* p_ = (const char*)({em.ptr[buf]} + {start});",
                      f"{indent}    for (int q_ = 0; q_ < {n_lines}; ++q_) __builtin_prefetch(p_ + {LINE} * q_{hint}); }}"]
        if not seen:
            return []
        lines.append(f"{indent}}}")
    return lines


def l2_bytes() -> int:
    """A core's L2 size, against which the prefetch's level is chosen (``L2_BYTES`` if set)."""
    if L2_BYTES is not None:
        return L2_BYTES
    return stream.machine_cache_bytes(level=2) or FALLBACK_L2_BYTES


def _gathered_row_loads(k: Kernel) -> list[tuple[str, object]]:
    """(buffer, linear offset) of each load that every element makes, reads a row picked by an index load,
    and steps one element per r."""
    out = []
    roots = [r.value for phase in k.phases for r in phase] + [st.value for st in k.stores]
    for sc in scalars_under(roots, stop=lambda x: x.op == "pick"):
        if sc.op == "load":
            buf, idx = sc.args[0], sc.args[1]
            shape = next((b.shape for b in k.inputs if b.name == buf), None)
            if shape is not None:
                lin = linear_offset(idx, shape)
                if _row_contiguous(lin) and any(x.op == "load" for x in walk(lin)) and \
                        not any(x.op == "select" for x in walk(lin)):
                    out.append((buf, lin))
    return out


def _row_contiguous(lin) -> bool:
    """True when `lin` is c + r + (terms free of r): one element per step of r."""
    if lin.op != "sum":
        return False
    _, terms = lin.args
    with_r = [(t, c) for t, c in terms if "r" in free_vars(t)]
    return len(with_r) == 1 and with_r[0][0].op == "var" and with_r[0][0].args[0] == "r" and with_r[0][1] == 1
