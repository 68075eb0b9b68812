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
"""
_lock = threading.Lock()
_fn = None  # the loaded C function; False once building it failed (torch does the checks then)


def _first_out_of_range():
    global _fn
    if _fn is None:
        with _lock:
            if _fn is None:
                try:
                    from vtc.runtime import cbuild

                    f = cbuild.build(_SOURCE, name="vtc_checks").vtc_first_out_of_range
                    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
                    f.restype = ctypes.c_int64
                    _fn = f
                except Exception:  # no compiler: the torch check below is always right, only slower
                    _fn = False
    return _fn


def check_range(check: IndexCheck, t: torch.Tensor) -> None:
    """Raises IndexError (naming the op and the value) when an element of `t` is outside [check.lo, check.hi]."""
    f = _first_out_of_range() if t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu" else None
    if f and t.numel() and -(1 << 63) <= check.lo and check.hi < (1 << 63):
        if f(t.data_ptr(), t.numel(), check.lo, check.hi) < 0:
            return
    check.run(t)  # other dtypes, and every failure: torch's check raises with the value
