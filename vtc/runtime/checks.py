"""Range checks of index tensors before a kernel call, in one pass of C.

Every kernel that reads through a gather (index_select, embedding, a roll
that was not folded, ...) first checks that each index lies in range, so that
an out-of-range index raises ``IndexError`` instead of reading out of bounds
(``vtc.index.mapping.IndexCheck``).  Done with torch (``aminmax`` and two
conversions to Python ints), the check costs about 5 us per call whatever the
tensor's size: a quarter of an ``index_select -> sum`` over 1 MB.
``check_range`` runs the same test as one C loop (``vtc_first_out_of_range``,
built once through the kernel cache, ``vtc.runtime.cbuild``) on contiguous
int64 tensors and leaves everything else, and every failure, to
``IndexCheck.run``, which raises with the op and the bad value.

``call_checked`` runs a kernel's checks and then the kernel in one C call
(``vtc_call_checked``): the executor's call plan (``vtc.runtime.callplan``)
uses it for checks over a kernel's own int64 input buffers, which saves a
Python call and a ctypes call per check; a failing check returns its number
before the kernel runs, and ``IndexCheck.run`` raises as above.
``vtc_run_segment`` runs several kernels, each after its checks, in one C call
(``segment_runner``, ``vtc.runtime.segment``).
"""
from __future__ import annotations

import ctypes
import threading

import torch

from vtc.index.mapping import IndexCheck

_SOURCE = r"""
#include <cstdint>
extern "C" int64_t vtc_first_out_of_range(const int64_t* p, int64_t n, int64_t lo, int64_t hi) {
  int64_t bad = 0;
  #pragma omp simd reduction(|:bad)
  for (int64_t i = 0; i < n; ++i) bad |= (p[i] < lo) | (p[i] > hi);
  if (!bad) return -1;
  for (int64_t i = 0; i < n; ++i) if (p[i] < lo || p[i] > hi) return i;
  return -1;
}
typedef void (*vtc_kernel)(void* const*, int);
// checks: n rows of (buffer number in bufs, element count, lo, hi); returns the first failing row, or -1
// once every index is in range and the kernel has run
extern "C" int64_t vtc_call_checked(void* kernel, void* const* bufs, int nthreads, const int64_t* checks,
                                    int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const int64_t* row = checks + 4 * c;
    if (vtc_first_out_of_range((const int64_t*)bufs[row[0]], row[1], row[2], row[3]) >= 0) return c;
  }
  ((vtc_kernel)kernel)(bufs, nthreads);
  return -1;
}
// a segment: consecutive kernels in one call (vtc.runtime.segment).  table: n kernels, p pointers, r
// relocations; the p-pointer template (addresses the same in every call); r rows of (pointer, value, addend):
// pointer = vals[value] + addend; n rows of (kernel, first pointer, flag or'ed into nthreads, first check,
// check count); then the check rows as above, numbered in the kernel's own pointers.  The pointers are
// copied to this call's stack and patched there: the table is shared by calls in several threads.  Returns
// the first failing check's row (the kernels before it have run, it and those after have not), or -1.
extern "C" int64_t vtc_run_segment(const int64_t* table, const uint64_t* vals, int nthreads) {
  const int64_t n = table[0], p = table[1], r = table[2];
  const int64_t* relocs = table + 3 + p;
  const int64_t* kernels = relocs + 3 * r;
  const int64_t* checks = kernels + 5 * n;
  void** bufs = (void**)__builtin_alloca(p * sizeof(void*));
  __builtin_memcpy(bufs, table + 3, p * sizeof(void*));
  for (int64_t i = 0; i < r; ++i) {
    const int64_t* row = relocs + 3 * i;
    bufs[row[0]] = (void*)(uintptr_t)(vals[row[1]] + (uint64_t)row[2]);
  }
  for (int64_t k = 0; k < n; ++k) {
    const int64_t* row = kernels + 5 * k;
    void* const* b = bufs + row[1];
    for (int64_t c = row[3]; c < row[3] + row[4]; ++c) {
      const int64_t* check = checks + 4 * c;
      if (vtc_first_out_of_range((const int64_t*)b[check[0]], check[1], check[2], check[3]) >= 0) return c;
    }
    ((vtc_kernel)row[0])(b, nthreads | (int)row[2]);
  }
  return -1;
}
"""
_lock = threading.Lock()
_fns = None  # the loaded C functions (range check, checked call); False once building them failed


def _functions():
    global _fns
    if _fns is None:
        with _lock:
            if _fns is None:
                try:
                    from vtc.runtime import cbuild

                    lib = cbuild.build(_SOURCE, name="vtc_checks")
                    f, call = lib.vtc_first_out_of_range, lib.vtc_call_checked
                    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
                    f.restype = call.restype = ctypes.c_int64  # call: no argtypes, see checked_caller
                    segment = ctypes.cast(lib.vtc_run_segment, ctypes.c_void_p).value
                    _fns = (f, call, segment)
                except Exception:  # no compiler: the torch check below is always right, only slower
                    _fns = False
    return _fns


def _first_out_of_range():
    fns = _functions()
    return fns and fns[0]


def checked_caller():
    """``vtc_call_checked(kernel, bufs, nthreads, checks, n)`` (ctypes), or None without a compiler.

    It has no argtypes (a call converts its arguments in half the time): pass the kernel as a
    ``ctypes.c_void_p``, bufs and checks as ctypes arrays, nthreads as an int, n as a ``ctypes.c_int64``."""
    fns = _functions()
    return fns[1] if fns else None


def segment_runner():
    """``vtc_run_segment(table, vals, nthreads)`` (see ``vtc.runtime.segment``) as a ctypes function without
    argtypes (table and vals as bytes, nthreads an int) returning an int64, or None without a compiler."""
    fns = _functions()
    return ctypes.CFUNCTYPE(ctypes.c_int64)(fns[2]) if fns else None


def check_range(check: IndexCheck, t: torch.Tensor) -> None:
    """Raises IndexError (naming the op and the value) when an element of `t` is outside [check.lo, check.hi]."""
    f = _first_out_of_range() if t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu" else None
    if f and t.numel() and -(1 << 63) <= check.lo and check.hi < (1 << 63):
        if f(t.data_ptr(), t.numel(), check.lo, check.hi) < 0:
            return
    check.run(t)  # other dtypes, and every failure: torch's check raises with the value
