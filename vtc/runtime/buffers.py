"""Recycled kernel output buffers: large buffers come back without fresh page faults.

A generated kernel writes its result into a new tensor.  For a large one
(``torch.empty`` of tens of MB) glibc maps fresh pages on every call (above its
mmap threshold, 32 MB at most, every allocation is a new mapping) and the
kernel then takes one page fault per 4 KB it writes: for a 64 MB gelu that is
more time than the arithmetic and the memory traffic together.  The framework's
own ops pay the same; an arena allocator (ONNX Runtime's) does not.  A library
GEMM (torch's mm / bmm / addmm / baddbmm) writes into a buffer of the pool too,
through ``out=`` (``vtc.runtime.callplan``).

``BufferPool`` keeps the storages of large buffers (at least ``MIN_BYTES``)
after the tensors made on them die, and hands a storage out again when nothing
outside the pool refers to it any more: no tensor, view, numpy array or
DLPack capsule made from it is alive (they all hold the storage, which
``torch._C._storage_Use_Count`` counts), and no caller holds the storage object itself
(``o.untyped_storage()``: the Python object the pool keeps, counted by its Python references).  So an intermediate freed during a
call is reused by a later kernel of the same call, and a graph output the
caller has dropped is reused by the next call; one the caller still holds is
never touched.  A storage handed out again is a ``detach()`` of a tensor the pool keeps on it (a new
tensor on the storage, not a view, in a fifth of the time of making one on the storage; in inference mode
one is made, an inference tensor as eager's).  Storages are matched by exact byte size; at most
``MAX_KEPT`` are kept (a new size replaces the oldest free one), so the pool
holds a bounded number of buffers however many sizes a graph sees.  A lock makes acquiring atomic, so several
threads may share one pool.  Where the use count is not available (another
torch), or with ``VTC_BUFFER_POOL=0`` in the environment, every buffer is a
plain ``torch.empty`` (the benchmark's memory probes set it: buffers the pool
keeps between calls would sit in the RSS before the measured call, as ONNX
Runtime's arena would, which the probes turn off too).
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable

import torch

# smaller buffers come from malloc's heap, already mapped after the first call.  Above 128 KB glibc maps
# them fresh or trims its heap once several are freed: a Llama prefill layer's 1-4 MB GEMM results and
# MLP products took their page faults on every call (the SwiGLU product over 256 x 3584 floats: 3.0 ms
# in the layer against 0.9 ms alone, 1 thread; docs/prefill.md)
MIN_BYTES = 256 << 10
MAX_KEPT = 16  # storages kept in all (outputs held by the caller across calls, intermediates of one call)

_use_count = getattr(torch._C, "_storage_Use_Count", None)
ENABLED = os.environ.get("VTC_BUFFER_POOL", "1") != "0"


class BufferPool:
    """Large contiguous buffers handed out again once nothing outside the pool refers to them."""

    def __init__(self) -> None:
        self._kept: list[torch.UntypedStorage] = []  # oldest first
        # per kept storage: a tensor over all of it (the shape and dtype it was last handed out with, made
        # outside inference mode) or None; a reused buffer is handed out as its detach() (0.3 us) instead of a
        # tensor made on the storage (``_on``, 1.4 us, 1 thread).  Never handed out itself: a caller's
        # in-place change of its output's metadata (``t_()``, ``resize_``, ``requires_grad_``) stays on the
        # caller's tensor
        self._views: list[torch.Tensor | None] = []
        self._lock = threading.Lock()

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` with unspecified contents (like torch.empty)."""
        nbytes = shape.numel() * dtype.itemsize
        if nbytes < MIN_BYTES or _use_count is None or not ENABLED:
            return torch.empty(*shape, dtype=dtype) if shape else torch.empty(shape, dtype=dtype)  # sizes unpacked:
            # torch's argument parser takes them in half the time of a torch.Size (~2 us less per output)
        return self._take(shape, dtype, nbytes)

    def allocator(self, shape: torch.Size, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
        """A function returning ``self.empty(shape, dtype)``: its size worked out once, and the storage it took
        last tried first (the usual case: one output per call, dropped before the next; 1.5 -> 0.7 us, 1
        thread), with the tests of ``_take`` inlined."""
        nbytes = shape.numel() * dtype.itemsize
        if nbytes < MIN_BYTES or _use_count is None or not ENABLED:
            return lambda: self.empty(shape, dtype)
        kept, views, lock, hint = self._kept, self._views, self._lock, [0]
        use_count, refs, inference = _use_count, sys.getrefcount, is_inference_mode_enabled

        def take() -> torch.Tensor:
            with lock:
                i = hint[0]
                if i < len(kept):
                    st, view = kept[i], views[i]  # st: as _free's parameter (refs: the list, st, the argument)
                    if (view is not None and st.nbytes() == nbytes and use_count(st._cdata) == 2
                            and refs(st) <= _FREE_REFS + _VIEW_REFS and view.shape == shape
                            and view.dtype is dtype and not inference()):
                        return view.detach()
                    del st, view
            return self._take(shape, dtype, nbytes, hint)
        return take

    def _take(self, shape: torch.Size, dtype: torch.dtype, nbytes: int, hint: list | None = None) -> torch.Tensor:
        """A kept storage of `nbytes` that nothing outside the pool refers to, as a tensor; else a new one.
        `hint[0]` is set to the storage's place in the list."""
        with self._lock:
            kept, views = self._kept, self._views
            for i in range(len(kept)):  # by index: a loop variable would be one more reference to the storage
                if kept[i].nbytes() == nbytes and _free(kept[i], views[i]):
                    if hint is not None:
                        hint[0] = i
                    view = views[i]
                    if is_inference_mode_enabled():  # a tensor made in inference mode, as torch.empty's
                        return _on(kept[i], shape, dtype)
                    if view is None or view.dtype is not dtype or view.shape != shape:
                        view = views[i] = _on(kept[i], shape, dtype)
                    return view.detach()  # shares the storage (a use the next _free sees), not a view: no _base
            out = torch.empty(shape, dtype=dtype)
            if len(kept) >= MAX_KEPT:  # full: make room by dropping the oldest free storage, if any
                i = next((i for i in range(len(kept)) if _free(kept[i], views[i])), None)
                if i is None:
                    return out
                del kept[i], views[i]
            kept.append(out.untyped_storage())
            views.append(None)
            if hint is not None:
                hint[0] = len(kept) - 1
            return out


# references to a kept storage's Python object when only the pool holds it, as _free sees them: the pool's
# list, _free's parameter and getrefcount's argument
_FREE_REFS = 3
is_inference_mode_enabled = torch.is_inference_mode_enabled


def _view_refs() -> int:
    """The Python references a storage's object gains from one more tensor on the storage: 1 where torch
    keeps the object alive from C++ while other C++ references to the storage exist (torch 2.13), else 0."""
    st = torch.empty(16).untyped_storage()
    before = sys.getrefcount(st)
    view = torch.empty(0).set_(st, 0, (16,))
    extra = sys.getrefcount(st) - before
    del view
    return extra


_VIEW_REFS = _view_refs()


def _free(st: torch.UntypedStorage, view: torch.Tensor | None) -> bool:
    """Nothing outside the pool refers to storage st: no tensor, view, numpy array or capsule (they hold the
    C++ storage: its use count, which the Python object the pool keeps and its kept tensor `view` hold once
    each) and no caller holding the storage itself (``o.untyped_storage()`` returns the Python object the
    pool keeps, so the use count does not see it; its Python references do)."""
    if view is None:
        return _use_count(st._cdata) == 1 and sys.getrefcount(st) <= _FREE_REFS
    return _use_count(st._cdata) == 2 and sys.getrefcount(st) <= _FREE_REFS + _VIEW_REFS


def _on(st: torch.UntypedStorage, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor over all of storage `st` (not a view: no _base).  ``set_`` without strides makes
    the contiguous ones (in C: 2.4 -> 1.5 us a buffer with them worked out in Python, 1 thread)."""
    return torch.empty(0, dtype=dtype).set_(st, 0, shape)
