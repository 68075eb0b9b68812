"""Library GEMMs on constant weights with the weight packed once: MKL's packed-B GEMM.

A library ``x @ W^T`` (``aten.mm(x, permute(W))``, ``aten.addmm(bias, x, permute(W))``: every
``nn.Linear`` that ``gemm="auto"`` leaves to torch) makes MKL pack the weight into its panel layout on
every call: for a 1024 x 3584 weight that is 14 MB read and written per call, 10-15% of the GEMM at 256
rows (1 thread CPU time, this machine: 256x1024x3584 18.3 -> 16.0 ms, 256x3584x1024 19.1 -> 16.8 ms,
128x1024x32000 102 -> 78 ms; ``docs/prefill.md``).  Where W is a constant of the compiled graph, the
call plan packs it once (``torch.ops.mkl._mkl_reorder_linear_weight``, as Inductor's freezing does) and
each call runs ``cblas_sgemm_compute`` on the packed panels (``torch.ops.mkl._mkl_linear``).

A weight changed in place after compiling (``load_state_dict``, an optimizer step: anything that bumps
the tensor's version counter, which its views share) is packed again at the next call, so the result
follows the weight as torch's own mm does.  The packed copy takes as much memory as the weight; the weight
itself stays (torch's op falls back to a
plain linear on it when the row count differs from the packed one, which a static graph never sees).
Executors of one model (a ``replan``, each input-size specialization of a dynamic model) share one packed
copy per weight and row count: ``_SHARED`` finds it while any executor still holds it.
Only float32 with static sizes and at least ``MIN_ROWS`` rows: decoding's skinny GEMMs (a few rows) are
not measured here and keep torch's mm.

All packed copies alive in the process together (MKL's panels, which take 1.4x the weight at 1024 x 4096 and more
at smaller ones, and the generated kernels' ``PackedConvWeight``) stay within ``BUDGET_BYTES``: a copy that would
pass it is not made and its GEMM / convolution runs as without one (torch's mm; the kernel packing W per call),
the reason in the call plan's ``why_not_packed`` (``OverBudget``).  A call plan makes its copies in the order of
the time each saves per byte (``admit_best_first``), so that a tight budget holds the ones worth most; call
plans are served in the order they are built.  A copy's bytes come back when no call plan holds it any more.
``VTC_PACKED_WEIGHTS_MB`` sets the budget in MB (0: no packed copies); the default is a quarter
of the machine's memory (or of the process's cgroup limit where lower): a model whose weights fit in memory keeps
fitting with its packed copies while its weights take up to about three quarters of it (docs/robustness.md).
"""
from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any, Callable, NamedTuple

import torch


def _memory_bytes() -> int:
    """The machine's memory, or the process's cgroup limit (v2, then v1) where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def budget_bytes(environ) -> int:
    """The bytes all packed copies alive may take together (the module's docstring): ``VTC_PACKED_WEIGHTS_MB``
    MB (0: none, as VTC_PACKED_WEIGHTS=0), else a quarter of the memory."""
    mb = environ.get("VTC_PACKED_WEIGHTS_MB")
    if mb is None:
        return _memory_bytes() // 4
    try:
        budget = float(mb)
    except ValueError:
        budget = -1.0
    if not budget >= 0:  # NaN too
        raise ValueError(f"VTC_PACKED_WEIGHTS_MB={mb!r}: a number of MB >= 0 (0: no packed weight copies)")
    return int(budget * (1 << 20))


BUDGET_BYTES = budget_bytes(os.environ)


MIN_ROWS = 32  # fewer rows: torch's mm (the packed path was measured at 128 and 256 rows)
ENABLED = (os.environ.get("VTC_PACKED_WEIGHTS", "1") != "0" and BUDGET_BYTES > 0 and torch.backends.mkl.is_available()
           and hasattr(torch.ops, "mkl") and hasattr(torch.ops.mkl, "_mkl_linear"))
OPS = ("aten.mm.default", "aten.addmm.default")
PACKED_ELEMENT_BYTES = 4  # every packed copy is float32: a float16 weight is widened as it is packed (twice its bytes)
# generated convolutions' weights packed once per version (PackedConvWeight; VTC_PACKED_WEIGHTS=0 turns both off)
CONV_ENABLED = os.environ.get("VTC_PACKED_WEIGHTS", "1") != "0" and BUDGET_BYTES > 0


class PackedBudgetWarning(UserWarning):
    """Weights left unpacked at a call plan's build because their packed copies would pass BUDGET_BYTES."""


class OverBudget(Exception):
    """A packed copy not made: the copies alive and it would pass BUDGET_BYTES (the message says by how much)."""


class _Held:
    """The bytes of the packed copies alive now; each copy gives its bytes back when it is freed."""

    def __init__(self) -> None:
        self.bytes, self.lock = 0, threading.RLock()  # reentrant: a copy freed by the GC in a thread holding it

    def admit(self, nbytes: int, what: str) -> None:
        """Raises OverBudget where `nbytes` more would pass BUDGET_BYTES."""
        with self.lock:
            if self.bytes + nbytes > BUDGET_BYTES:
                raise OverBudget(f"{what} {nbytes / (1 << 20):.1f} MB would pass the packed-weight budget: "
                                 f"{self.bytes / (1 << 20):.1f} MB held of {BUDGET_BYTES / (1 << 20):.1f} MB "
                                 "(VTC_PACKED_WEIGHTS_MB, vtc.runtime.packed.BUDGET_BYTES)")

    def add(self, entry: Any, nbytes: int) -> None:
        """Counts `entry`'s `nbytes` until it is freed."""
        with self.lock:
            self.bytes += nbytes
        weakref.finalize(entry, self._give_back, nbytes)

    def _give_back(self, nbytes: int) -> None:
        with self.lock:
            self.bytes -= nbytes


HELD = _Held()


def saving_us(kind: str, rows: int, n: int, k: int) -> float:
    """The cost model's estimate (``vtc.codegen.gemm``'s figures) of the microseconds a packed copy of an n x k
    weight saves per call of its GEMM of `rows` rows: "mkl" torch's per-element term for B (MKL packs W per call
    without the copy), "panels" the generated kernel's (a GEMM's B panels, a conv_bcast kernel's W^T packed per
    call), "skinny" the dot path on W in place against vtc_skinny_packed on the copy."""
    from vtc.codegen import gemm

    if kind == "skinny":
        return (gemm.estimate_us(1, rows, n, k, b_unit_stride="k")[0]
                - gemm.estimate_us(1, rows, n, k, path=gemm.SKINNY_PACKED_PATH)[0])
    return n * k * gemm.B_ELEM_NS["torch" if kind == "mkl" else "panels"] * 1e-3


class Wish(NamedTuple):
    """A packed copy a call plan would make: the step that reads it, its weight's bytes, the microseconds it saves
    per call (``saving_us``) and how it is made (``make()``: the copy, found or new; OverBudget where a new one
    would pass BUDGET_BYTES)."""

    name: str
    nbytes: int
    saving_us: float
    make: Callable[[], Any]


def admit_best_first(wishes: list[Wish]) -> dict[str, Any]:
    """Each wish's copy, or the OverBudget that refused it, by step name: made in the order of the time saved per
    byte, so that a budget too small for all of a call plan's copies holds those worth most per byte (first come,
    first served left a decode loop's 62.5 MB LM head unpacked at half the budget, +48% per step, with 43 MB of the
    budget unused).  Savings per MB within 0.1 us of each other are ties (the cost model rates every one-row GEMM's
    copy the same per byte): the larger copy first, the smaller ones filling what it leaves."""
    def order(w: Wish) -> tuple:
        return -round(w.saving_us / max(w.nbytes, 1) * (1 << 20), 1), -w.nbytes

    return admit_in_order(sorted(wishes, key=order))


def admit_in_order(wishes: list[Wish]) -> dict[str, Any]:
    """Each wish's copy, or the OverBudget that refused it, by step name, made in the order given."""
    made: dict[str, Any] = {}
    for w in wishes:
        try:
            made[w.name] = w.make()
        except OverBudget as e:
            made[w.name] = e
    return made


def planned(low, n, a, b) -> str:
    """"mkl_packed" where the call plan will run library GEMM node n (operands `a`, `b`) on its weight packed
    once, else "": B is the transpose of a whole constant W [N, K] (checked again on the tensor by
    ``why_not`` when the call plan is built), A float32, 2-D, static, with at least ``MIN_ROWS`` rows."""
    if not ENABLED or n.op not in OPS or n.kwargs:
        return ""
    consts = {v.name: v for v in low.graph.consts}
    r = low.plan.realized.get(b.name) if low.plan.is_virtual(b.name) else None
    st = r.strided if r is not None else None
    if st is None or st.source not in consts or b.dtype != torch.float32 or a.dtype != torch.float32:
        return ""  # B is not a view of a constant (a constant used as it is, [K, N], is not W^T either)
    k, n_ = b.shape
    unit_k, whole_rows = k == 1 or st.strides[0] == 1, n_ == 1 or st.strides[1] == k  # a size-1 dim: any stride
    if not (unit_k and whole_rows) or st.offset != 0 or tuple(consts[st.source].shape) != (n_, k):
        return ""  # not the whole of a contiguous W [N, K], transposed
    rows = a.shape[0]
    return "mkl_packed" if isinstance(rows, int) and len(a.shape) == 2 and rows >= MIN_ROWS else ""


def why_not(node, a_shape: tuple, b: torch.Tensor | None, bias: torch.Tensor | None) -> str | None:
    """Why the library GEMM `node` (A of static shape `a_shape`; B and the bias as the constants the plan
    holds, or None where they are not constants) cannot run on a packed weight, or None where it can."""
    if not ENABLED:
        return "MKL's packed GEMM is not available (or VTC_PACKED_WEIGHTS=0)"
    if node.op not in OPS or node.kwargs:
        return f"{node.op} with {sorted(node.kwargs)}: only mm and addmm (beta = alpha = 1)"
    if b is None:
        return "B is not a constant of the graph"
    if not all(isinstance(d, int) for d in a_shape) or len(a_shape) != 2 or a_shape[0] < MIN_ROWS:
        return f"A of shape {list(a_shape)}: static, 2-D, at least {MIN_ROWS} rows"
    if b.dtype != torch.float32 or b.dim() != 2 or not b.t().is_contiguous():
        return f"B {b.dtype} {list(b.shape)} strides {list(b.stride())}: a float32 W^T of a contiguous W"
    if b.is_inference():
        return "W is an inference tensor: it has no version counter to see an in-place change by"
    if node.op == "aten.addmm.default" and (
            bias is None or bias.dtype != torch.float32 or tuple(bias.shape) != (b.shape[1],)):
        return "addmm's bias is not a constant float32 vector of N"
    return None


class _Packed:
    """W packed for `a_rows` rows, re-packed when W's version counter moves; shared by the executors that use W."""

    def __init__(self, w: torch.Tensor, a_rows: int):
        self.w, self.a_rows, self.lock = w, a_rows, threading.Lock()
        self.version, self.panels = self._pack()
        self.nbytes = self.panels.nbytes  # a re-pack has the same size

    def _pack(self) -> tuple[int, torch.Tensor]:
        version = self.w._version  # read first: a change during the pack is seen by the next call
        return version, torch.ops.mkl._mkl_reorder_linear_weight(self.w, self.a_rows)

    def current(self) -> torch.Tensor:
        """The packed panels of W as it is now."""
        if self.w._version != self.version:  # the weight was changed in place (load_state_dict, an optimizer step)
            with self.lock:
                if self.w._version != self.version:
                    version, self.panels = self._pack()
                    self.version = version
        return self.panels


# (address, offset, shape, strides, rows) of a W -> its packed copy, while an executor holds it; an entry
# holds W, so W's memory (and address) cannot be reused by another tensor while the entry exists
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def _weight_key(w: torch.Tensor) -> tuple:
    """What identifies weight `w` in a table of packed copies (an entry holds w: no other tensor takes its address)."""
    return w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), w.stride()


def _one_per_key(table: weakref.WeakValueDictionary, key: tuple, make: Callable[[], Any], w_bytes: int) -> Any:
    """The entry of `table` at `key` while a caller holds it, else a new one from `make()` (a copy of a weight of
    `w_bytes`, its own size ``.nbytes``); OverBudget where the new copy would pass BUDGET_BYTES (checked before
    packing on the weight's own bytes, then on the copy's, which a layout's padding makes larger)."""
    with _SHARED_LOCK:
        entry = table.get(key)
        if entry is None:
            HELD.admit(w_bytes, "the weight's packed copy of at least")
            entry = make()
            HELD.admit(entry.nbytes, "the weight's packed copy of")
            HELD.add(entry, entry.nbytes)
            table[key] = entry
        return entry


def _shared(w: torch.Tensor, a_rows: int) -> _Packed:
    return _one_per_key(_SHARED, (*_weight_key(w), a_rows), lambda: _Packed(w, a_rows), w.nbytes)


def packed_linear(a_rows: int, b: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function computing ``a @ b (+ bias)`` for `a` of `a_rows` rows with b = W^T packed once (or found
    packed by another executor of the same weight); OverBudget where a new copy would pass BUDGET_BYTES."""
    w = b.t()
    entry, linear = _shared(w, a_rows), torch.ops.mkl._mkl_linear

    def run(a: torch.Tensor) -> torch.Tensor:
        return linear(a, entry.current(), w, bias, a_rows)
    run.entry = entry  # type: ignore[attr-defined]  # the packed copy (the call plan counts its bytes)
    return run


class WeightSpec(NamedTuple):
    """A generated kernel's constant weight that a call plan may pack once (``shared_conv_weight``), its GEMM
    operands' ``packed_weight``: `rows` rows of `cols` elements, `row_stride` apart from element `offset` of the
    kernel's buffer `buffer`, packed by `layout` (None: a convolution's W^T in vectors of 16 output channels,
    vtc.codegen.conv_bcast.packed_layout; a generated GEMM's B: vtc.codegen.gemm.packed_panels)."""

    buffer: str
    offset: int
    row_stride: int
    rows: int
    cols: int
    layout: Callable[..., torch.Tensor] | None = None


class PackedConvWeight:
    """A generated convolution's constant weight packed once as the kernel reads it (vtc.codegen.conv_bcast: W^T
    in vectors of 16 output channels), packed again when the weight's version counter moves.  A generated
    GEMM's constant B (vtc.codegen.gemm: W^T or W in the micro-kernel's KC x 32 panels) takes the same way, its
    spec naming the layout (``gemm.packed_panels``).

    The broadcast form otherwise packs W^T on every call (~13% of a 1x1 232 -> 232 on 7x7).  The call plan
    passes ``state()[2]`` after the kernel's buffers with ``conv_bcast.PACKED_FLAG`` set in its thread count;
    a weight changed in place after compiling (``load_state_dict``, an optimizer step, ``w.mul_(2)``) bumps
    its version and is packed again before the next call's kernel reads it.  ``state()`` returns one tuple
    (version, packed tensor, its address): a caller holds it while the kernel runs, so a concurrent re-pack
    (another thread's call) never frees the buffer under it."""

    def __init__(self, w: torch.Tensor, offset: int, lda: int, m: int, k: int,
                 layout: Callable[..., torch.Tensor] | None = None) -> None:
        from vtc.codegen.conv_bcast import packed_layout

        self.w, self.spec, self.lock = w, (offset, lda, m, k), threading.Lock()
        self.layout = layout or packed_layout  # a generated GEMM's B: its spec names vtc.codegen.gemm.packed_panels
        self._state = self._pack()
        self.nbytes = self._state[1].nbytes  # a re-pack has the same size

    def _pack(self) -> tuple[int, torch.Tensor, int]:
        version = self.w._version  # read first: a change during the pack is seen by the next call
        with torch.no_grad():
            p = self.layout(self.w, *self.spec)
        return version, p, p.data_ptr()

    def state(self) -> tuple[int, torch.Tensor, int]:
        """(version, packed W^T, its address) of the weight as it is now."""
        st = self._state
        if st[0] != self.w._version:
            with self.lock:
                st = self._state
                if st[0] != self.w._version:
                    st = self._state = self._pack()
        return st


# (address, offset, shape, strides, dtype, spec, layout) of a weight -> its PackedConvWeight while a call plan holds
# it: the executors of one model (a dynamic model's example-size and size-generic specializations, a replan) share
# one packed copy per weight and layout (a transformers decode loop held two copies of every packed weight before)
_SHARED_CONV: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_conv_weight(w: torch.Tensor, spec: WeightSpec) -> PackedConvWeight:
    """The PackedConvWeight of `w` with this spec: the one another call plan holds, else a new one (OverBudget
    where that would pass BUDGET_BYTES)."""
    offset, lda, m, k, layout = spec.offset, spec.row_stride, spec.rows, spec.cols, spec.layout
    lay = (layout.func, tuple(sorted(layout.keywords.items()))) if isinstance(layout, functools.partial) else layout
    return _one_per_key(_SHARED_CONV, (*_weight_key(w), w.dtype, offset, lda, m, k, lay),
                        lambda: PackedConvWeight(w, offset, lda, m, k, layout), m * k * PACKED_ELEMENT_BYTES)




def conv_weight_why_not(w: torch.Tensor | None, spec: WeightSpec | None) -> str | None:
    """Why a conv_bcast kernel's weight `w` (a constant of the plan, or None) cannot be packed once (None: it can)."""
    if spec is None:
        return "the weight's offset is not a constant"
    if w is None:
        return "the weight is not a constant of the graph"
    if w.dtype not in (torch.float32, torch.float16) or not w.is_contiguous():  # (float16: widened as it is packed)
        return f"the weight is {w.dtype}, strides {list(w.stride())}: a contiguous float32 or float16 constant"
    if w.is_inference():
        return "the weight is an inference tensor: it has no version counter to see an in-place change by"
    offset, lda, m, k = spec.offset, spec.row_stride, spec.rows, spec.cols
    if lda < 0:  # a flipped weight (W.flip(0)): the layouts read rows through as_strided, which takes no such stride
        return f"the weight rows are a negative stride ({lda}) apart"
    if offset < 0 or offset + (m - 1) * lda + k > w.numel():
        return "the weight rows lie outside the constant"
    return None
