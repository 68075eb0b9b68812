"""Streaming (non-temporal) stores for kernels that write large outputs.

A plain store to a line that is not in cache first reads the line (write
allocate), so a kernel writing N bytes moves 2N across the memory bus for its
output, and the output evicts the kernel's inputs from the caches on the way.
A non-temporal store (``vmovntps``) writes whole 64-byte lines through the
write-combining buffers without reading them.  Measured on this project's
machine (1 thread, CPU time, one process, load ~6; ``relu`` / ``add`` over
contiguous float32, the same output buffer every call): 8 MB relu 1.46 ->
0.70 ms, 8 MB add 1.83 -> 1.01 ms, 64 MB add 14.8 -> 10.9 ms, 1 MB add 0.21
-> 0.13 ms.  The price: the output is not in cache afterwards, so a consumer
that would have found it there reads it from memory, and while the kernel's
inputs and output fit in the last-level cache a plain store hits a line that
is already there (the buffer written the call before) and costs no memory
traffic at all.  Hence a kernel streams only when its working set (the bytes
of every buffer it reads, plus the bytes it stores) is larger than the
machine's last-level cache (``cache_bytes``: read from sysfs, 32 MB here; an
L3 of this size holds a 2-thread 8 MB chain's inputs and output), and its
output is at least ``STREAM_MIN_BYTES``.  The transposed tiles
(``vtc.codegen.tiles``) do not stream in their block form (``tiles.STREAM``, measured slower); the
old whole-tile form streams from half the cache (``TILED_CACHE_SHARE``):
their transposed reads span many pages and keep more lines in flight.
Measured with 2 threads, wall time, one process, individual calls (p10 / p50
of 300 per variant, load ~3; docs/chains.md, the 2-thread follow-up): a contiguous
relu streaming vs plain 2.3x slower at 1 MB out, 1.9-2.1x slower from 2 to
8 MB out (working set 4-16 MB), 1.4x / 1.1x slower at 16 MB out (working set
32 MB = the L3), 0.96x / 0.79x at 24 MB out (48 MB); an add 1.5x slower at
1 MB out, 1.2-1.4x at 8 MB out (24 MB), 1.0-1.1x at 10 MB (30 MB), 0.92x at
16 MB (48 MB); transpose -> add with 8 MB out (24 MB) 0.461 -> 0.370 ms
(p50) faster streamed, 1 MB out 0.041 -> 0.043 slower.  The earlier rule
(every output of 1 MB or more, chosen at load 6-12 on this machine when other
processes kept the L3 full) made cat -> relu 8 MB 2x slower on a quiet one.

gcc ignores ``#pragma omp simd nontemporal``, so the streamed loop is written
out: the inner loop runs in blocks of 16 elements whose values the vectorised
body puts into a 64-byte aligned array per store (kept in a register by gcc),
which ``vtc_stream16`` writes with one streaming store; the elements before the
first 64-byte boundary of the first store and after the last full block take
the plain loop.  Where the stores of one loop are not at the same offset
within a line (so no block is aligned for all of them), the whole loop takes
the plain form at run time.  Each thread ends with a store fence
(``vtc_stream_fence``), so the lines are in memory before the parallel region
ends.

Where: pointwise kernels (the plain and the merged inner loop, ``cpp._pointwise_kernel``; the
transposed tiles, ``vtc.codegen.tiles``, with ``tiles.STREAM`` only: their output staged per tile and
written row by row by ``vtc_stream_row``, whole lines streamed, the partial lines at a row's ends plain) and the store pass of row kernels (``cpp._row_kernel``,
not softmax's, whose store pass reads back the exp it stored in the output).  Not the lane kernels of
``vtc.codegen.lanes`` (a permute in front of a softmax): streaming their 8 output rows per block was
slower (permute -> softmax 1 MB 0.24 -> 0.31 ms, 8 MB 3.6 -> 4.2 ms, 1 thread, CPU time, one process,
load 8-9).

Which stores qualify: float32, stored at ``base + var`` along the inner loop
variable (consecutive elements), unconditionally (no ``when``), into a buffer
the kernel does not also read.  Off while size-generic kernels are made
(``STREAM_STORES``, set by ``vtc.dynamic``): the threshold depends on the sizes,
and a template must be the same text at every probe size.
"""
from __future__ import annotations

import functools
import math
import os
from contextvars import ContextVar
from typing import Callable

import torch

from vtc.codegen.kernel_ir import Kernel, Store
from vtc.index.expr import affine
from vtc.index.mapping import linear_offset

STREAM_MIN_BYTES = 1 << 20  # a kernel's stored bytes from which its stores may stream
FALLBACK_CACHE_BYTES = 8 << 20  # the last-level cache assumed where sysfs does not say (stream from 8 MB)
TILED_CACHE_SHARE = 0.5  # the transposed tiles stream from this share of the last-level cache (see above)
CACHE_BYTES: int | None = None  # overrides the machine's last-level cache size (tests, benchmarks)
LANES = 16  # floats per streaming store: one 64-byte line
STREAM_STORES: ContextVar[bool] = ContextVar("vtc_stream_stores", default=True)

PRELUDE = r"""
#ifndef VTC_STREAM_PRELUDE  // kernels are built several to a source (vtc.runtime.executor.libraries)
#define VTC_STREAM_PRELUDE
#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif
// dst[0:16] = src[0:16] with non-temporal stores (dst and src 64-byte aligned): vtc/codegen/stream.py
static inline void vtc_stream16(float* __restrict dst, const float* __restrict src) {
#if defined(__AVX512F__)
  _mm512_stream_ps(dst, _mm512_load_ps(src));
#elif defined(__AVX__)
  _mm256_stream_ps(dst, _mm256_load_ps(src)); _mm256_stream_ps(dst + 8, _mm256_load_ps(src + 8));
#elif defined(__SSE2__)
  for (int l = 0; l < 16; l += 4) _mm_stream_ps(dst + l, _mm_load_ps(src + l));
#else
  for (int l = 0; l < 16; ++l) dst[l] = src[l];
#endif
}
// dst[0:n] = src[0:n], the whole 64-byte lines of dst with non-temporal stores, the others plain (src any
// alignment): the rows of a transposed tile's staged output (vtc/codegen/tiles.py)
static inline void vtc_stream_row(float* __restrict dst, const float* __restrict src, int64_t n) {
  int64_t i = 0;
  const int64_t h = std::min<int64_t>(n, (int64_t)((64 - ((uintptr_t)dst & 63)) & 63) / 4);
  for (; i < h; ++i) dst[i] = src[i];
  for (; i + 16 <= n; i += 16) {
#if defined(__AVX512F__)
    _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#elif defined(__AVX__)
    _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i)); _mm256_stream_ps(dst + i + 8, _mm256_loadu_ps(src + i + 8));
#elif defined(__SSE2__)
    for (int l = 0; l < 16; l += 4) _mm_stream_ps(dst + i + l, _mm_loadu_ps(src + i + l));
#else
    for (int l = 0; l < 16; ++l) dst[i + l] = src[i + l];
#endif
  }
  for (; i < n; ++i) dst[i] = src[i];
}
static inline void vtc_stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}
#endif
"""


def stored_bytes(k: Kernel) -> int:
    """Bytes of the buffers kernel k stores into, each once."""
    seen = {st.buffer.name: st.buffer for st in k.stores}
    return sum(math.prod(b.shape) * b.dtype.itemsize for b in seen.values())


@functools.cache
def machine_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache", level: int | None = None) -> int | None:
    """Size in bytes of the highest-level data or unified cache of cpu0 (the last-level cache), or of the one at
    `level`, from sysfs; None where it is not readable (another OS, a container without sysfs)."""
    best = None
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return None
    for e in entries:
        if not e.startswith("index"):
            continue
        try:
            with open(os.path.join(root, e, "level")) as f:
                at = int(f.read())
            with open(os.path.join(root, e, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(root, e, "size")) as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        if kind not in ("Data", "Unified") or level is not None and at != level:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        try:
            nbytes = int(size.rstrip("KMGkmg")) * scale
        except ValueError:
            continue
        if best is None or at > best[0]:
            best = (at, nbytes)
    return best[1] if best else None


def cache_bytes() -> int:
    """The last-level cache size the streaming decision is made against (``CACHE_BYTES`` if set)."""
    if CACHE_BYTES is not None:
        return CACHE_BYTES
    return machine_cache_bytes() or FALLBACK_CACHE_BYTES


def working_set_bytes(k: Kernel) -> int:
    """Bytes of every buffer kernel k reads (its inputs, whole, each once: values and index tensors) plus
    the bytes it stores."""
    seen = {b.name: b for b in k.inputs}
    return stored_bytes(k) + sum(math.prod(b.shape) * b.dtype.itemsize for b in seen.values())


def applies(k: Kernel, shapes: dict[str, tuple[int, ...]], stores: list[Store], var: str,
            cache_share: float = 1.0) -> bool:
    """Whether `stores`, made in a loop over `var`, may stream: see the module docstring.  `cache_share`:
    the share of the last-level cache the kernel's working set must exceed (``TILED_CACHE_SHARE`` for the
    transposed tiles)."""
    if not STREAM_STORES.get() or not stores or stored_bytes(k) < STREAM_MIN_BYTES:
        return False
    if working_set_bytes(k) <= cache_share * cache_bytes():
        return False
    from vtc.codegen.lower import scalars_of

    read = {s.args[0] for s in scalars_of(k) if s.op == "load"}
    for st in stores:
        if st.buffer.dtype != torch.float32 or st.when is not None or st.buffer.name in read:
            return False
        form = affine(linear_offset(st.index, shapes[st.buffer.name]))
        if form is None or form[1].get(var) != 1:
            return False
    return True


def streamed_loop(em, stores: list[Store], var: str, start: str, end: str, indent: str,
                  plain: Callable[[str, str, str], list[str]]) -> list[str]:
    """The loop over `var` from `start` to `end` (C expressions) making `stores` with streaming stores.

    `plain(lo, hi, indent)`: the lines of the kernel's own loop over [lo, hi) (for the unaligned head, the
    tail, and rows whose stores are not equally aligned).  `em`: the kernel's ``cpp._Emitter``."""
    i2 = indent + "  "
    lines = [f"{indent}{{  // streaming stores (vtc.codegen.stream)",
             f"{i2}const int64_t lo_ = {start}, hi_ = {end};"]
    for j, st in enumerate(stores):  # the address of element var = 0: the offset is base + var
        lines.append(f"{i2}float* sp{j}_; {{ const int64_t {var} = 0; sp{j}_ = "
                     f"{em.ptr[st.buffer.name]} + {em.linear(st.buffer.name, st.index)}; }}")
    lines.append(f"{i2}int64_t ha_ = std::min<int64_t>(hi_, lo_ + (int64_t)((64 - ((uintptr_t)(sp0_ + lo_) & 63)) & 63) / 4);")
    for j in range(1, len(stores)):
        lines.append(f"{i2}if ((((uintptr_t)(sp{j}_ + lo_)) ^ ((uintptr_t)(sp0_ + lo_))) & 63) ha_ = hi_;")
    lines.append(f"{i2}const int64_t ta_ = ha_ + (hi_ - ha_) / {LANES} * {LANES};")
    saved = dict(em.temps)
    lines += plain("lo_", "ha_", i2)
    em.temps = dict(saved)
    lines += [f"{i2}for (int64_t vb_ = ha_; vb_ < ta_; vb_ += {LANES}) {{",
              *[f"{i2}  alignas(64) float sv{j}_[{LANES}];" for j in range(len(stores))],
              f"{i2}  #pragma omp simd", f"{i2}  for (int64_t {var} = vb_; {var} < vb_ + {LANES}; ++{var}) {{"]
    lines += em.hoist([st.value for st in stores], i2 + "    ")
    lines += [f"{i2}    sv{j}_[{var} - vb_] = {em.scalar(st.value)};" for j, st in enumerate(stores)]
    lines += [f"{i2}  }}", *[f"{i2}  vtc_stream16(sp{j}_ + vb_, sv{j}_);" for j in range(len(stores))], f"{i2}}}"]
    em.temps = dict(saved)
    lines += plain("ta_", "hi_", i2)
    em.temps = dict(saved)
    return lines + [f"{indent}}}"]


def fenced(lines: list[str]) -> list[str]:
    """A kernel body whose first line is its ``omp parallel for`` pragma, with a store fence at the end of
    each thread's share: ``omp parallel`` { ``omp for`` loop; fence }."""
    head = lines[0]
    assert "#pragma omp parallel for" in head, head
    return [head.replace("parallel for", "parallel"), "  {", head.replace("parallel for", "for").split(" num_threads")[0],
            *lines[1:], "  vtc_stream_fence();", "  }"]
