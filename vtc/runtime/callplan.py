"""The per-call fast path of an executor: its steps as closures over numbered slots, set up once.

``Executor.run_step`` runs a step on a dict of tensors keyed by value name and
works out per call what the step needs: the framework op's arguments by a
pytree walk, a kernel's input list, its outputs' shapes, its pointer array,
its index range checks as a separate C call.  For a small graph that fixed
cost (8-15 us for a graph of one kernel, 1 thread, measured at load 7-9) is
as much as the kernels' own time (``bench/call_overhead.py``).  ``CallPlan``
does everything that does not depend on the inputs once, when the executor
first runs:

- every value gets a slot; a call fills a copy of a template list in which the
  constants, and the strided views of constants (a weight's transpose read by
  a library GEMM), are already set;
- a torch op's arguments are a tuple with the slots of its tensors to fill in
  (no pytree per call); a few library ops are called through their torch
  function, whose argument parser is faster than the op overload's
  (``torch.mm`` instead of ``aten.mm.default``: a few us less per call);
- a kernel's input and output slots, its outputs' allocators, its pointer
  array type, and which inputs need their dtype and shape checked (only those
  that a kernel or the constants did not make); its index range checks, where
  each is over an int64 input buffer, run in the same C call as the kernel
  (``vtc.runtime.checks.checked_caller``: a bad index stops the call before
  the kernel runs and raises the same IndexError as before), and the kernel
  is called through a ctypes prototype without argtypes (half the call cost),
  its pointer array packed into a bytes object (``pointer_array``) and its small
  outputs made without torch's ``dtype=`` keyword where they have the default
  dtype (``_allocator``): together ~1.3 us less per kernel (c3k2_b1, 9 kernels
  made empty: 80 -> 67 us per call, 1 thread, load 5);
- which slots each step frees (``Step.frees``).

A call allocates one list and nothing else of its own; the plan is never
changed after it is built, so several threads may run it at once (the buffer
pool is locked).  Steps this module has no fast form for (gathers, kernels
that compute derived index tensors) run through the executor's ``run_step``
on a dict of just the tensors they read.

``fast_call`` generates, per compiled model, the function ``vtc.Compiled`` calls for inputs of exactly the
captured dtypes and shapes: their test without a loop, then the plan, or, for a plan of one kernel, the kernel
itself (docs/call_cost.md: 5.4 -> 2.1 us a call of cat -> relu at 1 MB with an empty kernel, 1 thread).
"""
from __future__ import annotations

import ctypes
import operator
import struct
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import torch
import torch.utils._pytree as pytree

from vtc.codegen import conv_bcast
from vtc.codegen.gemm import SKINNY_M
from vtc.ir.graph import Value
from vtc.runtime.buffers import ENABLED as POOL_ENABLED
from vtc.runtime import packed
from vtc.runtime.buffers import MIN_BYTES, BufferPool
from vtc.runtime.checks import check_range, checked_caller
from vtc.runtime.executor import _own  # the executor imports this module only when it first runs
from vtc.runtime.reference import check_inputs
from vtc.runtime.segment import Segment

aten = torch.ops.aten
# framework ops whose torch function takes the same positional arguments and runs the same ATen op
TORCH_FUNCTIONS = {aten.mm.default: torch.mm, aten.bmm.default: torch.bmm, aten.addmm.default: torch.addmm,
                   aten.baddbmm.default: torch.baddbmm, aten.convolution.default: torch.convolution}

Slots = list  # one call's tensors, by slot number


class CallPlan:
    """Runs an executor's steps on flat input tensors (one call: ``plan(inputs)``)."""

    def __init__(self, executor) -> None:
        # the executor holds this plan, which holds it weakly (for run_step): no reference cycle keeps a dropped
        # executor and the large buffers of its pool alive until the cycle collector runs
        self.executor = weakref.ref(executor)
        self.graph, self.pool, self.consts = executor.graph, executor.pool, executor.consts
        graph = executor.graph
        self.slot: dict[str, int] = {}
        for v in graph.values():
            self.slot.setdefault(v.name, len(self.slot))
        for s in executor.steps:  # names only a step knows (a kernel's derived index tensors)
            for name in [*s.reads, *s.writes]:
                self.slot.setdefault(name, len(self.slot))
        self.template: list[Any] = [None] * len(self.slot)
        for name, t in executor.consts.items():
            self.template[self.slot[name]] = t
        self.inputs = [self.slot[v.name] for v in graph.inputs]
        self.outputs = [self.slot[v.name] for v in graph.outputs]
        self.graph_outputs = {v.name for v in graph.outputs}
        self.input_types = [(torch.Size(v.shape), v.dtype) for v in graph.inputs]  # checked once per call
        # values with this (shape, dtype) in every call: the inputs (checked), constants and kernel outputs;
        # of those, the constants and kernel outputs are contiguous
        self.typed: dict[str, tuple[torch.Size, torch.dtype]] = dict(zip((v.name for v in graph.inputs),
                                                                         self.input_types))
        self.made: dict[str, tuple[torch.Size, torch.dtype]] = {
            n: (t.shape, t.dtype) for n, t in executor.consts.items() if t.is_contiguous()}
        self.fns: list[Callable[[Slots], None]] = []
        self.fn_steps: list = []  # the step each of fns runs (None: a closure dropping values; bench/step_profile.py)
        # what was set up (the tests assert it): range checks run in a kernel's C call / from Python, views of
        # constants made once, steps that go through Executor.run_step
        self.counts = {"checks_in_c": 0, "checks_in_python": 0, "constant_views": 0, "by_name": 0,
                       "packed_weights": 0, "packed_conv_weights": 0,
                       "segments": 0, "segment_kernels": 0}  # kernels run in one C call (vtc.runtime.segment)
        self.why_not_packed: dict[str, str] = {}  # planned "mkl_packed", but the weight tensor does not fit: why
        self.packed_copies: dict[int, int] = {}  # id -> bytes of each packed copy the plan holds (shared: once)
        self.over_budget = 0  # weights left unpacked: their copy would pass vtc.runtime.packed.BUDGET_BYTES
        self.gemm_choices = getattr(executor.lowering, "gemm_choices", None) or {}
        # kernel outputs that only kernels read: placed in a per-call arena at offsets fixed here (_arena_layout)
        self.arena_slot = len(self.template)  # a call's slots[arena_slot]: its arena's pointer lists, by kernel
        self.template.append(None)
        self.arena_offsets, self.arena_bytes = _arena_layout(executor) if ARENA else ({}, 0)
        self.arena_kernels: list[tuple[list, dict]] = []  # per arena kernel: (arena offset or None by pointer,
        #                                                      {pointer: address the same in every call})
        self._arenas: list[list] = []  # free arenas (one per call running at once), each [buffer, base, lists...]
        self.segment_arena = False  # a segment reads or writes the arena (vtc.runtime.segment)
        self.fixed_storages: list = []  # the storages of constants whose addresses a segment's table holds
        self.c_calls = 0  # calls into C per model call: kernels called on their own and segments
        # the packed weight copies this plan reads, by step name (OverBudget: refused), admitted best-first
        self._admitted = self._admit_packed(executor.steps)
        segment = Segment(self)
        for s in executor.steps:
            for name in s.writes:
                self.made.pop(name, None)
                self.typed.pop(name, None)
            if s.kind == "kernel" and not s.kernel._derived:  # derived index tensors: computed by run_step
                parts = self._kernel_parts(s.kernel)
                if not segment.add(s, parts):  # ends the segment before it, and where it must run on its own
                    self._flush(segment)
                    if not segment.add(s, parts):
                        self._add(self._kernel_closure(parts), s, s.frees)
                        self.c_calls += 1
                continue
            self._flush(segment)
            self._add(self._step(s), s, s.frees)
        self._flush(segment)
        del self._admitted  # the closures hold the copies they read
        self.own_outputs = _owning_outputs(executor, graph)
        self.const_copies = tuple(executor.const_copies)  # vtc.runtime.weights.ConstCopy: refreshed per call
        self._report_packing(executor)

    def _admit_packed(self, steps) -> dict[str, Any]:
        """The packed copies of the constant weights the steps would read, by step name (``OverBudget`` where the
        budget refused one), made in the order of the time each saves per byte (``packed.admit_best_first``);
        why a planned one cannot be packed in ``why_not_packed``.  Views of constants are made here first (the
        steps that made them later find them made): a library GEMM's B is one."""
        for s in steps:
            if s.kind in ("view", "alias"):
                self._constant_view(s)
        wishes = []
        for s in steps:
            if s.kind == "run":
                wishes.append(self._linear_wish(s.node))
            elif s.kind == "kernel" and not s.kernel._derived:
                wishes.append(self._conv_weight_wish(s.kernel))
        return packed.admit_best_first([w for w in wishes if w is not None])

    def _report_packing(self, executor) -> None:
        """The weights packed once, the values folded into constant copies (``vtc.ir.fold.fold_weight_chains``)
        and those left unpacked or unfolded for the budget, into the executor's ``packing`` (the report's), and a
        PackedBudgetWarning where the budget left some."""
        meta = executor.graph.meta
        for name, why in meta.get("weight_chains_not_folded", {}).items():
            if isinstance(why, packed.OverBudget):
                self._refused(name, why)
            else:
                self.why_not_packed[name] = f"the weight chain was not folded: {why}"
        folded = meta.get("const_copies", {})
        executor.packing.update(
            packed_weights=self.counts["packed_weights"], packed_conv_weights=self.counts["packed_conv_weights"],
            packed_bytes=sum(self.packed_copies.values()), unpacked_for_budget=self.over_budget,
            budget_bytes=packed.BUDGET_BYTES, folded_weight_chains=len(folded),
            folded_bytes=sum(c.value.nbytes for c in folded.values()), folded_nodes=meta.get("const_copy_nodes", 0))
        if self.over_budget:
            warnings.warn(f"vtc: {self.over_budget} weight(s) not packed once, which would pass the packed-weight "
                          f"budget of {packed.BUDGET_BYTES / (1 << 20):.1f} MB (VTC_PACKED_WEIGHTS_MB); their GEMMs "
                          "pack them per call (report.packing, the call plan's why_not_packed)", packed.PackedBudgetWarning,
                          stacklevel=2)

    def __call__(self, inputs: list[torch.Tensor], checked: bool = False) -> list[torch.Tensor]:
        """The graph's outputs for `inputs`; checked: their dtypes and shapes are known to be the graph's
        (``vtc.Compiled`` checked them), else they are checked here (kernels trust them)."""
        if not checked and (len(inputs) != len(self.input_types) or not all(
                isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape and t.is_cpu
                for t, (shape, dtype) in zip(inputs, self.input_types))):
            check_inputs(self.graph, list(inputs))  # raises, naming the input and what it should be
        for c in self.const_copies:
            c.refresh()
        slots = self.template.copy()
        for i, t in zip(self.inputs, inputs):
            slots[i] = t
        if self.arena_kernels or self.segment_arena:
            arena = self.acquire_arena()
            slots[self.arena_slot] = arena
            try:
                for fn in self.fns:
                    fn(slots)
            finally:
                self._arenas.append(arena)  # list.append / pop are atomic: threads take distinct arenas
        else:
            for fn in self.fns:
                fn(slots)
        outs = [slots[i] for i in self.outputs]
        if self.own_outputs is not None:
            self.own_outputs(outs, inputs)
        return outs

    def acquire_arena(self) -> list:
        """A free arena for one call (``[buffer, its aligned address, pointer list of each arena kernel...]``;
        give it back with
        ``self._arenas.append``): a new one where every arena is taken (calls in several threads at once)."""
        try:
            return self._arenas.pop()
        except IndexError:
            pass
        buf = torch.empty(self.arena_bytes + ARENA_ALIGN, dtype=torch.uint8)
        base = -(-buf.data_ptr() // ARENA_ALIGN) * ARENA_ALIGN
        lists = [[base + off if off is not None else fixed.get(p, 0) for p, off in enumerate(offsets)]
                 for offsets, fixed in self.arena_kernels]
        return [buf, base, *lists]

    def _add(self, fn: Callable[[Slots], None] | None, s, frees: tuple[str, ...]) -> None:
        """Appends closure fn (running step s, the first of a segment's; None: nothing to run), then one
        dropping the values named in `frees` but those in the arena (never tensors)."""
        if fn is not None:
            self.fns.append(fn)
            self.fn_steps.append(s)
        frees = tuple(self.slot[n] for n in frees if n not in self.arena_offsets)
        if frees:
            self.fns.append(_freer(frees))
            self.fn_steps.append(None)

    def _flush(self, segment: "Segment") -> None:
        """Ends the segment being gathered: one closure for its kernels (one on its own: ``_kernel_closure``)."""
        items = segment.take()
        if len(items) == 1:
            (s, parts), = items
            self._add(self._kernel_closure(parts), s, s.frees)
        elif items:
            self._add(segment.closure(items), items[0][0], ())  # the segment drops what its kernels free
        self.c_calls += bool(items)

    # -- one closure per step ---------------------------------------------------
    def _step(self, s) -> Callable[[Slots], None] | None:
        """The closure running step s (not a plain kernel), or None when the step was done here once (a view
        of constants)."""
        if s.kind == "kernel":
            return self._by_name(s)  # a kernel computing derived index tensors
        if s.kind == "run":
            return self._run(s)
        if s.kind in ("view", "alias"):
            return self._view(s)
        return self._by_name(s)

    def _by_name(self, s) -> Callable[[Slots], None]:
        """Step s through ``Executor.run_step`` on a dict of the tensors it reads."""
        executor, slot = self.executor, self.slot
        reads = [(n, slot[n]) for n in s.reads]
        writes = [(n, slot[n]) for n in s.writes]
        self.counts["by_name"] += 1

        def by_name(slots: Slots) -> None:
            env = {n: slots[i] for n, i in reads if slots[i] is not None}
            executor().run_step(s, env)  # alive: its caller holds it
            for n, i in writes:
                slots[i] = env[n]
        return by_name

    def _run(self, s) -> Callable[[Slots], None]:
        """A framework op: its arguments built from slots, its outputs put into theirs."""
        node = s.node
        build_args = _arguments(node.args, self.slot)
        build_kwargs = _arguments(tuple(node.kwargs.values()), self.slot)
        if build_args is None or build_kwargs is None:  # a tensor nested deeper than a list: Node.run's pytree
            return self._by_name(s)
        target = node.target if node.kwargs else TORCH_FUNCTIONS.get(node.target, node.target)
        names = tuple(node.kwargs)
        outs = [self.slot[v.name] for v in node.outputs]
        own = _own if node.kind == "movement" else None  # kept physical: really materialised, never an alias
        ins = [self.slot[v.name] for v in node.inputs]

        linear = self._packed(node)
        if linear is not None:
            a_slot, out_slot = self.slot[node.args[-2].name], outs[0]

            def run_packed(slots: Slots) -> None:  # x @ W^T on the weight packed once (vtc.runtime.packed)
                slots[out_slot] = linear(slots[a_slot])
            return run_packed
        pooled = _pooled_out(node, target, self.pool)
        if pooled is not None and not names:
            def run_into(slots: Slots) -> None:  # a library GEMM writing into a recycled buffer
                slots[outs[0]] = target(*build_args(slots), out=pooled())
            return run_into

        def run(slots: Slots) -> None:
            out = target(*build_args(slots), **dict(zip(names, build_kwargs(slots)))) if names else \
                target(*build_args(slots))
            if isinstance(out, torch.Tensor):
                out = (out,)
            if own is not None:
                out = [own(t, [slots[i] for i in ins]) for t in out]
            for i, t in zip(outs, out):
                slots[i] = t
        return run

    def _packed(self, node) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """x @ W^T on a constant W packed once where the lowering planned it (the report's GEMM entry says
        ``library="mkl_packed"``, ``vtc.runtime.packed``) and the budget admitted it, or None (the reason in
        ``why_not_packed``)."""
        linear = self._admitted.get(node.name)
        if isinstance(linear, packed.OverBudget):
            self._refused(node.name, linear)
            return None
        if linear is not None:
            self.counts["packed_weights"] += 1
            self.packed_copies[id(linear.entry)] = linear.entry.nbytes
        return linear

    def _linear_wish(self, node) -> "packed.Wish | None":
        """The packed copy library GEMM `node` would run on (``_packed``), or None (why in ``why_not_packed``)."""
        choice = self.gemm_choices.get(node.name)
        if choice is None or choice.library != "mkl_packed":
            return None
        args = [a if isinstance(a, Value) else None for a in node.args]
        if len(args) < 2 or args[-2] is None or args[-1] is None:
            return None
        const = self.template  # constants and views of constants (_admit_packed made them)
        b = const[self.slot[args[-1].name]]
        bias = const[self.slot[args[0].name]] if len(args) == 3 and args[0] is not None else None
        why = packed.why_not(node, tuple(args[-2].shape), b, bias)
        if why is not None:
            self.why_not_packed[node.name] = why
            return None
        rows, (k, n) = int(args[-2].shape[0]), b.shape
        return packed.Wish(node.name, b.nbytes, packed.saving_us("mkl", rows, n, k),
                           lambda: packed.packed_linear(rows, b, bias))

    def _constant_view(self, s) -> bool:
        """Whether view step s is one of a constant, made once into the template (here, where it is not yet)."""
        r = s.realization
        m, st = r.mapping, r.strided
        if m.checks or st.source not in self.consts or r.value in self.graph_outputs:
            return False
        out_slot = self.slot[r.value]
        if self.template[out_slot] is None:
            src = self.template[self.slot[st.source]].contiguous()
            offset = src.storage_offset() + st.offset
            self.template[out_slot] = src.as_strided(tuple(m.shape), tuple(st.strides), offset)
            self.counts["constant_views"] += 1
        return True

    def _view(self, s) -> Callable[[Slots], None] | None:
        """A zero-copy strided view; one of a constant is made once and kept in the template (``_constant_view``)."""
        if self._constant_view(s):
            return None  # the executor never frees constants; nor does a call free this view of one
        r = s.realization
        m, st = r.mapping, r.strided
        src_slot, out_slot = self.slot[st.source], self.slot[r.value]
        shape, strides, offset = tuple(m.shape), tuple(st.strides), st.offset
        checks = [(c, self.slot[c.tensor]) for c in m.checks]

        def view(slots: Slots) -> None:
            for c, i in checks:
                check_range(c, slots[i])
            src = slots[src_slot]
            if not src.is_contiguous():
                src = src.contiguous()
            slots[out_slot] = src.as_strided(shape, strides, src.storage_offset() + offset)
        return view

    def _kernel_parts(self, ck) -> "KernelParts":
        """What a call of generated kernel ck needs, worked out once (its outputs are then known to be made)."""
        name = ck.step.kernel.name
        types = [(torch.Size(b.shape), b.dtype) for b in ck.inputs]
        # inputs that neither a kernel nor the constants made: contiguity checked per call, and dtype and
        # shape but for the graph's inputs (checked by the call)
        checked = [(k, b.name, *types[k]) for k, b in enumerate(ck.inputs)
                   if self.made.get(b.name) != types[k] and self.typed.get(b.name) != types[k]]
        strided = [k for k, b in enumerate(ck.inputs)
                   if self.made.get(b.name) != types[k] and self.typed.get(b.name) == types[k]]
        # a conv_bcast kernel's W^T or a GEMM's B packed once, passed after the buffers (also to a kernel with
        # index range checks: a GEMM whose stores are pushed into a KV cache at run-time positions)
        weight = self._packed_conv_weight(ck)
        fused, other = _split_checks(ck) if checked_caller() is not None else ([], ck.step.checks)
        self.counts["checks_in_c"] += len(fused)
        self.counts["checks_in_python"] += len(other)
        if weight is not None:
            self.counts["packed_conv_weights"] += 1
        for b in ck.outputs:
            self.made[b.name] = self.typed[b.name] = (torch.Size(b.shape), b.dtype)
        return KernelParts(
            ck, name, [self.slot[b.name] for b in ck.inputs], [self.slot[b.name] for b in ck.outputs],
            [_allocator(torch.Size(b.shape), b.dtype, self.pool) for b in ck.outputs], checked, strided,
            tuple(t.data_ptr() for t in ck._sizes),  # a size-generic kernel's sizes (the tensor lives in ck)
            weight, fused, [(c, self.slot[c.tensor]) for c in other], ctypes.cast(ck.fn, ctypes.c_void_p).value)

    def _kernel_closure(self, parts: "KernelParts") -> Callable[[Slots], None]:
        """A generated kernel called on its own: inputs checked where needed, outputs allocated, one C call
        (with its range checks where it can run them)."""
        ck, name, ins, outs, allocs = parts.ck, parts.name, parts.ins, parts.outs, parts.allocs
        checked, strided, sizes, weight, fused = parts.checked, parts.strided, parts.sizes, parts.weight, parts.fused
        python_checks, address = parts.python_checks, parts.address
        pointers = pointer_array(ck._pointers._length_ + (weight is not None))
        call_checked = checked_caller() if fused else None
        get_threads = torch.get_num_threads
        fn = kernel_function(address)
        if fused:
            kernel_address, nchecks = ctypes.c_void_p(address), ctypes.c_int64(len(fused))
            table = (ctypes.c_int64 * (4 * len(fused)))(*[x for _, row in fused for x in row])
        take = _taker(ins)
        placed = self.arena_offsets
        if placed and any(b.name in placed for b in [*ck.inputs, *ck.outputs]):
            if ck.step.checks:  # pragma: no cover - _arena_layout places none of its buffers
                raise AssertionError(f"kernel {name}: buffers in the arena, but index checks")
            return self._arena_kernel(ck, fn, get_threads, pointers, sizes, weight, allocs, checked, strided)
        if weight is not None:
            flag = conv_bcast.PACKED_FLAG

            def kernel_packed(slots: Slots) -> None:  # the kernel's buffers, then its weight packed once
                for c, i in python_checks:
                    check_range(c, slots[i])
                tensors = take(slots)
                if strided or checked:
                    tensors = _contiguous_checked(name, tensors, strided, checked)
                made = [a() for a in allocs]
                st = weight()  # held while the kernel runs: another thread's re-pack never frees it under it
                ptrs = pointers(*[t.data_ptr() for t in tensors], *[t.data_ptr() for t in made], st[2])
                if not fused:
                    fn(ptrs, get_threads() | flag)
                elif call_checked(kernel_address, ptrs, get_threads() | flag, table, nchecks) >= 0:
                    _range_failed(name, fused, tensors)  # the kernel did not run
                for i, t in zip(outs, made):
                    slots[i] = t
            kernel_packed.parts = parts  # type: ignore[attr-defined]  # a plan of this one kernel: called directly
            return kernel_packed

        def kernel(slots: Slots) -> None:
            for c, i in python_checks:
                check_range(c, slots[i])
            tensors = take(slots)
            if strided or checked:
                tensors = _contiguous_checked(name, tensors, strided, checked)
            made = [a() for a in allocs]
            ptrs = pointers(*[t.data_ptr() for t in tensors], *[t.data_ptr() for t in made], *sizes)
            if not fused:
                fn(ptrs, get_threads())
            elif call_checked(kernel_address, ptrs, get_threads(), table, nchecks) >= 0:
                _range_failed(name, fused, tensors)  # the kernel did not run
            for i, t in zip(outs, made):
                slots[i] = t
        kernel.parts = parts  # type: ignore[attr-defined]  # a plan of this one kernel: fast_call calls it directly
        return kernel

    def _arena_kernel(self, ck, fn, get_threads, pointers, sizes, weight, allocs, checked,
                      strided) -> Callable[[Slots], None]:
        """A kernel some of whose buffers lie in the call's arena: their addresses are in the arena's pointer
        list for this kernel, made once per arena; the others (constants, graph inputs, kernel outputs that
        leave the arena) are filled in per call, an input that may be strided made contiguous first."""
        placed = self.arena_offsets
        order = [*ck.inputs, *ck.outputs]
        offsets = [placed.get(b.name) for b in order] + [None] * (len(sizes) + (weight is not None))
        k = len(self.arena_kernels) + 2  # the arena's list for this kernel: arena[k] (arena[0] is its buffer,
        #                                   arena[1] the buffer's aligned address)
        # addresses the same in every call and arena: a size-generic kernel's sizes
        self.arena_kernels.append((offsets, {len(order) + p: ptr for p, ptr in enumerate(sizes)}))
        nin = len(ck.inputs)
        given = [(p, self.slot[b.name]) for p, b in enumerate(ck.inputs) if b.name not in placed]
        made = [(nin + p, self.slot[b.name], a) for p, (b, a) in enumerate(zip(ck.outputs, allocs))
                if b.name not in placed]
        a_slot, flag, last = self.arena_slot, conv_bcast.PACKED_FLAG if weight is not None else 0, len(offsets) - 1

        name, take = ck.step.kernel.name, _taker([i for _, i in given])
        positions = [p for p, _ in given]
        if checked or strided:  # positions among all inputs -> among the given ones (none of them is placed)
            where = {p: q for q, p in enumerate(positions)}
            checked = [(where[p], *rest) for p, *rest in checked]
            strided = [where[p] for p in strided]

        def kernel(slots: Slots) -> None:
            ptrs = slots[a_slot][k].copy()
            tensors = take(slots)  # held until the kernel returns (a contiguous copy of a strided input)
            if checked or strided:
                tensors = _contiguous_checked(name, tensors, strided, checked)
            for p, t in zip(positions, tensors):
                ptrs[p] = t.data_ptr()
            for p, i, alloc in made:
                t = slots[i] = alloc()
                ptrs[p] = t.data_ptr()
            if flag:
                st = weight()  # held while the kernel runs: another thread's re-pack never frees it under it
                ptrs[last] = st[2]
            fn(pointers(*ptrs), get_threads() | flag)
        return kernel

    def _packed_conv_weight(self, ck) -> Callable[[], tuple] | None:
        """For a conv_bcast kernel or generated GEMM whose weight is a constant: the ``state`` of its weight packed
        once (``vtc.runtime.packed.PackedConvWeight``, the one copy the model's other call plans share) where the
        budget admitted it, else None (the kernel packs it per call or reads it in place; why in
        ``why_not_packed``)."""
        name = ck.step.kernel.name
        entry = self._admitted.get(name)
        if isinstance(entry, packed.OverBudget):
            self._refused(name, entry)
            return None
        if entry is None:
            return None
        self.packed_copies[id(entry)] = entry.nbytes
        return entry.state

    def _conv_weight_wish(self, ck) -> "packed.Wish | None":
        """The packed copy kernel ck would read (``_packed_conv_weight``), or None (why in ``why_not_packed``)."""
        gemm = getattr(ck.step.kernel, "gemm", None)
        if not packed.CONV_ENABLED or gemm is None or not hasattr(gemm, "packed_weight") or ck._sizes:
            return None
        spec = gemm.packed_weight
        wbuf = spec.buffer if spec is not None else None
        w = self.template[self.slot[wbuf]] if wbuf in self.slot else None  # set: a constant or a view of one
        why = packed.conv_weight_why_not(w if isinstance(w, torch.Tensor) else None, spec)
        name = ck.step.kernel.name
        if why is not None:
            self.why_not_packed[name] = why
            return None
        # up to SKINNY_M rows the copy replaces the dot path on W (vtc.codegen.gemm._skinny_spec); else a pack per call
        kind = "skinny" if gemm.pack_b is None and gemm.m <= SKINNY_M else "panels"
        return packed.Wish(name, spec.rows * spec.cols * packed.PACKED_ELEMENT_BYTES,
                           packed.saving_us(kind, gemm.m, spec.rows, spec.cols),
                           lambda: packed.shared_conv_weight(w, spec))

    def _refused(self, name: str, e: "packed.OverBudget") -> None:
        """Step `name`'s weight left unpacked for the budget (its GEMM packs it per call)."""
        self.why_not_packed[name] = str(e)
        self.over_budget += 1


def _contiguous_checked(name: str, tensors: tuple, strided: list, checked: list) -> list:
    """A kernel's input tensors, made contiguous where they are not (`strided`: positions whose dtype and shape
    are known; `checked`: (position, value, shape, dtype) checked first)."""
    tensors = list(tensors)
    for k in strided:
        if not tensors[k].is_contiguous():
            tensors[k] = tensors[k].contiguous()
    for k, n, shape, dtype, *reader in checked:  # reader: the kernel's name where they are several's inputs
        t = tensors[k]
        if t.dtype != dtype or t.shape != shape:
            raise RuntimeError(f"kernel {reader[0] if reader else name}: buffer {n} is {t.dtype} {list(t.shape)}, "
                               f"generated for {dtype} {list(shape)}")
        if not t.is_contiguous():
            tensors[k] = t.contiguous()
    return tensors


MISS = object()  # what a fast call returns for arguments it does not take: the caller takes its full path


def fast_call(plan: CallPlan, sig: tuple, post: Callable[[list, tuple], Any] | None,
              watch=None, guard: Callable[[tuple], None] | None = None) -> tuple[Callable, str]:
    """(fast, its source): ``fast(args)`` is the call's result for plain positional tensors `args` of exactly
    the dtypes and shapes of `sig` ((dtype, torch.Size) per input), on the CPU; MISS for anything else.

    The function is generated for the plan (``exec`` of the returned source), so that a call runs no loop and
    builds no list of its own: the inputs' type, dtype, shape and device tested one by one, then the plan run
    on them (``plan(args, checked=True)``).  Where the plan is a single generated kernel that reads only the
    inputs and constants and writes the outputs (``direct_kernel``), the kernel is called right there: the
    constant copies made current (``vtc.runtime.weights.ConstCopy``), each input made contiguous where it is
    not, the outputs allocated, one ctypes call.  `post(outs, args)` makes the result from the outputs' list; None:
    the result is the one output itself.  `watch` (a ``vtc.runtime.weights.ParameterWatch``, or None): MISS as well
    where a parameter of the model the plan holds was replaced since the capture, tested first (the caller captures
    the model again).  `guard(args)` (or None): a test that raises, run once the inputs are known to fit and before
    any kernel (where forward changes an input in place: ``vtc.frontend.torch_export.mutation_guard``)."""
    n = len(sig)
    names = [f"a{k}" for k in range(n)]
    env: dict[str, Any] = {"T": torch.Tensor, "MISS": MISS, "plan": plan, "post": post}
    lines = ["def fast(args):"]
    if watch is not None and len(watch):
        lines += ["    try:", f"        if {watch.condition(env, 'W')}:", "            return MISS",
                  "    except KeyError:  # a watched slot deleted", "        return MISS"]
    lines += [f"    if len(args) != {n}:", "        return MISS"]
    if n:
        lines.append(f"    {', '.join(names)}{',' if n == 1 else ''} = args")
    for k, (dtype, shape) in enumerate(sig):
        env[f"d{k}"], env[f"s{k}"] = dtype, shape
        a = names[k]
        lines += [f"    if type({a}) is not T or {a}.dtype is not d{k} or {a}.shape != s{k} or not {a}.is_cpu:",
                  "        return MISS"]
    if guard is not None:
        env["guard"] = guard
        lines.append("    guard(args)")
    direct = direct_kernel(plan)
    if direct is None:
        lines.append("    outs = plan(args, True)")
        result = "outs"
    else:
        parts, sources = direct
        packed_weight = parts.weight is not None
        for q, c in enumerate(plan.const_copies):  # as the plan's call: each constant copy current first
            env[f"copy{q}"] = c
            lines.append(f"    copy{q}.refresh()")
        env.update(fn=kernel_function(parts.address), pack=pointer_array(parts.ck._pointers._length_ + packed_weight),
                   threads=torch.get_num_threads, weight=parts.weight, flag=conv_bcast.PACKED_FLAG)
        ptrs = []
        for p, (kind, x) in enumerate(sources):
            if kind == "const":
                env[f"c{p}"] = x
                lines.append(f"    x{p} = c{p}")
            else:
                lines.append(f"    x{p} = {names[x]}")
                if p in parts.strided:
                    lines.append(f"    if not x{p}.is_contiguous():\n        x{p} = x{p}.contiguous()")
            ptrs.append(f"x{p}.data_ptr()")
        for q, alloc in enumerate(parts.allocs):
            env[f"alloc{q}"] = alloc
            lines.append(f"    o{q} = alloc{q}()")
            ptrs.append(f"o{q}.data_ptr()")
        ptrs += [str(int(x)) for x in parts.sizes]
        threads = "threads()"
        if packed_weight:  # as kernel_packed: the state held while the kernel runs (a re-pack never frees it)
            lines.append("    st = weight()")
            ptrs.append("st[2]")
            threads = "threads() | flag"
        if not parts.fused:
            lines.append(f"    fn(pack({', '.join(ptrs)}), {threads})")
        else:  # the kernel's index range checks, then the kernel, in one C call (as _kernel_closure's)
            fused = parts.fused
            env.update(call_checked=checked_caller(), kaddr=ctypes.c_void_p(parts.address),
                       nchecks=ctypes.c_int64(len(fused)),
                       table=(ctypes.c_int64 * (4 * len(fused)))(*[x for _, row in fused for x in row]),
                       failed=lambda tensors: _range_failed(parts.name, fused, tensors))
            lines += [f"    if call_checked(kaddr, pack({', '.join(ptrs)}), {threads}, table, nchecks) >= 0:",
                      f"        failed(({''.join(f'x{p}, ' for p in range(len(sources)))}))"]
        result = "o0" if post is None else "[o0]"
    if post is None:
        lines.append(f"    return {result}[0]" if direct is None else f"    return {result}")
    else:
        lines.append(f"    return post({result}, args)")
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<vtc fast call>", "exec"), env)  # noqa: S102 - our own text, from the plan's numbers
    return env["fast"], source


def _range_failed(name: str, fused: list, tensors: tuple) -> None:
    """Raises the IndexError of the first failing range check of a kernel (its C call found one)."""
    for check, row in fused:
        check.run(tensors[row[0]])  # raises the op's IndexError naming the value
    raise RuntimeError(f"kernel {name}: a C range check failed and torch's passed")  # cannot be: both test
    # lo <= i <= hi on the same int64s


def direct_kernel(plan: CallPlan) -> tuple["KernelParts", list[tuple[str, Any]]] | None:
    """(parts, where each input comes from: ("arg", input position) or ("const", tensor)) where the plan is one
    generated kernel called on its own (with its weight packed once or not), with no arena or range check but
    those its C call runs (``KernelParts.fused``), reading graph inputs and constants only and writing the graph's
    one output, which needs no copy; else None."""
    if len(plan.fns) != 1 or plan.own_outputs is not None or plan.arena_kernels \
            or plan.segment_arena:
        return None
    parts = getattr(plan.fns[0], "parts", None)
    if parts is None or parts.python_checks or parts.checked:
        return None
    if list(parts.outs) != list(plan.outputs) or len(parts.outs) != 1:  # one output: no kernel of several that
        return None  # is a whole plan was found, to test that form with
    position = {}
    for k, i in enumerate(plan.inputs):
        position.setdefault(i, k)
    sources: list[tuple[str, Any]] = []
    for i in parts.ins:
        if i in position:
            sources.append(("arg", position[i]))
        elif plan.template[i] is not None:
            sources.append(("const", plan.template[i]))
        else:
            return None
    return parts, sources


ARENA = POOL_ENABLED  # VTC_BUFFER_POOL=0 (the benchmark's memory probes) keeps nothing between calls: no arena
ARENA_ALIGN = 64  # bytes: each buffer of the arena starts on a cache line
# the largest value placed in the arena; a larger one comes from the buffer pool.  Up to 2 MB a value costs
# less in the arena: no pool allocation per call (~2 us, 1 thread) and no end of a segment where the pool
# would reuse a buffer freed in it (vtc.runtime.segment).  A larger one stays the pool's: llama3_prefill_b1
# ran 0.7% slower with its MB-sized intermediates in the arena (measured twice when the arena was made, the
# saving is per buffer; docs/chains.md)
ARENA_MAX_BYTES = 2 << 20


def _arena_layout(executor) -> tuple[dict[str, int], int]:
    """({value: byte offset}, arena bytes) for the kernel outputs that only generated kernels read.

    Such a value is never a tensor in the call: its writer and readers get its address in the arena, so the
    call allocates nothing for it (a ``torch.empty`` and the addresses read back cost ~2 us per kernel,
    ShuffleNetV2: ~55 kernels).  A value qualifies when its writer and every reader are kernel steps that run
    without index checks or derived index tensors, it is not a graph output, and it is smaller than
    ``ARENA_MAX_BYTES`` (a larger one comes from the buffer pool, as before).  Values live from the step
    that writes them to the last step that reads them; two values share bytes only when those spans do not
    meet (first fit, largest first)."""
    steps = executor.steps
    outputs = {v.name for v in executor.graph.outputs}
    plain: set[int] = set()
    for k, s in enumerate(steps):
        if s.kind == "kernel" and not s.kernel._derived and not s.kernel.step.checks:
            plain.add(k)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    bad: set[str] = set(outputs)
    for k, s in enumerate(steps):
        for name in s.reads:
            last[name] = k
            if k not in plain:
                bad.add(name)
        for name in s.writes:
            first.setdefault(name, k)
            last.setdefault(name, k)
            if k not in plain:
                bad.add(name)
    sizes = {}
    for k in sorted(plain):
        for b in steps[k].kernel.outputs:  # a large one stays the pool's (ARENA_MAX_BYTES)
            if b.name not in bad and b.name not in sizes and b.nbytes < ARENA_MAX_BYTES:
                sizes[b.name] = -(-max(b.nbytes, 1) // ARENA_ALIGN) * ARENA_ALIGN
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first step, last step)
    offsets: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], first[n])):
        lo, hi, size = first[name], last[name], sizes[name]
        busy = sorted((o, e) for o, e, f, l in placed if f <= hi and lo <= l)
        off = 0
        for o, e in busy:
            if off + size <= o:
                break
            off = max(off, e)
        offsets[name] = off
        placed.append((off, off + size, lo, hi))
    return offsets, max((e for _, e, _, _ in placed), default=0)


def _split_checks(ck) -> tuple[list, list]:
    """A kernel's range checks split into those its C call runs, as (check, (input position, element count,
    lo, hi)): over an int64 input buffer with bounds in int64; and the others (run from Python first)."""
    position = {b.name: k for k, b in enumerate(ck.inputs)}
    fused, other = [], []
    for c in ck.step.checks:
        k = position.get(c.tensor)
        if (k is not None and ck.inputs[k].dtype == torch.int64
                and -(1 << 63) <= c.lo and c.hi < (1 << 63)):
            fused.append((c, (k, torch.Size(ck.inputs[k].shape).numel(), c.lo, c.hi)))
        else:
            other.append(c)
    return fused, other


OUT_FUNCTIONS = (torch.mm, torch.bmm, torch.addmm, torch.baddbmm)  # library GEMMs that take out=


def _pooled_out(node, target, pool: BufferPool) -> Callable[[], torch.Tensor] | None:
    """The allocator of a library GEMM's output where it comes from the buffer pool (a float output of at
    least ``MIN_BYTES``, written through ``out=``), else None (torch allocates it)."""
    if target not in OUT_FUNCTIONS or len(node.outputs) != 1 or not POOL_ENABLED:
        return None
    v = node.outputs[0]
    if not all(isinstance(d, int) for d in v.shape):  # symbolic sizes: torch allocates
        return None
    shape = torch.Size(v.shape)
    if not v.dtype.is_floating_point or shape.numel() * v.dtype.itemsize < MIN_BYTES:
        return None
    return pool.allocator(shape, v.dtype)


def _allocator(shape: torch.Size, dtype: torch.dtype, pool: BufferPool) -> Callable[[], torch.Tensor]:
    """A function returning a new contiguous tensor of `shape` and `dtype`: from the pool when it is large.

    A small one is a ``torch.empty``, its sizes unpacked (torch parses them faster than a Size); of the
    default dtype, without the ``dtype=`` keyword, whose parsing is a third of the call (1.7 -> 1.1 us, 1
    thread), and the result's dtype checked: if the default dtype has changed since (it is global, another
    thread may set it), the tensor is made again with the keyword."""
    if shape.numel() * dtype.itemsize >= MIN_BYTES and POOL_ENABLED:
        return pool.allocator(shape, dtype)
    sizes = tuple(int(d) for d in shape)
    empty = torch.empty
    if not sizes:
        return lambda: empty(shape, dtype=dtype)
    if dtype != torch.get_default_dtype():
        return lambda: empty(*sizes, dtype=dtype)

    def default_dtype() -> torch.Tensor:
        t = empty(*sizes)
        return t if t.dtype is dtype else empty(*sizes, dtype=dtype)
    return default_dtype


class KernelParts(NamedTuple):
    """What a call of one generated kernel needs (``CallPlan._kernel_parts``); positions are in its pointer
    array: its inputs, its outputs, then a size-generic kernel's sizes, then a packed weight."""
    ck: Any  # the executor's CompiledKernel
    name: str
    ins: list[int]  # the inputs' slots
    outs: list[int]  # the outputs' slots
    allocs: list[Callable[[], torch.Tensor]]  # the outputs' allocators
    checked: list[tuple]  # (input position, value, shape, dtype): dtype, shape and contiguity checked per call
    strided: list[int]  # input positions made contiguous per call where they are not
    sizes: tuple[int, ...]  # addresses after the buffers (a size-generic kernel's sizes)
    weight: Callable[[], tuple] | None  # a conv_bcast kernel's packed weight state (its address: [2])
    fused: list[tuple]  # (check, (input position, count, lo, hi)): range checks run in C before the kernel
    python_checks: list[tuple]  # (check, slot): range checks run from Python
    address: int  # the kernel function's


def kernel_function(address: int) -> Callable[..., None]:
    """The kernel at `address` as a ctypes function without argtypes (arguments: an array, which may be a bytes
    object, and an int): ctypes calls it in half the time of a function with argtypes."""
    return ctypes.CFUNCTYPE(None)(address)


def pointer_array(n: int) -> Callable[..., bytes]:
    """A function packing n buffer addresses into a kernel's pointer array (``void* const* bufs``).

    The array is a bytes object: ctypes passes a bytes argument as a pointer to its data, and packing n
    ints with a ``struct.Struct`` and passing the bytes takes half the time of building a ctypes array of
    n ``c_void_p`` (0.9 -> 0.4 us with the call, 4 pointers, 1 thread).  The kernel only reads it."""
    return struct.Struct(f"{n}P").pack


def _arguments(args: tuple, slot: dict[str, int]) -> Callable[[Slots], tuple] | None:
    """A function building a framework op's argument tuple from slots; None when a tensor is nested deeper
    than one list (the forms ATen ops take: a tensor, or a list of tensors, None and numbers)."""
    parts = []
    for a in args:
        if isinstance(a, Value):
            parts.append(("slot", slot[a.name]))
        elif not any(isinstance(x, Value) for x in pytree.tree_leaves(a)):
            parts.append(("const", a))
        elif isinstance(a, (list, tuple)) and all(isinstance(x, Value) or not isinstance(x, (list, tuple, dict))
                                                  for x in a):
            parts.append(("list", (type(a), [(isinstance(x, Value), slot[x.name] if isinstance(x, Value) else x)
                                             for x in a])))
        else:
            return None
    if all(kind == "slot" for kind, _ in parts):
        index = [i for _, i in parts]
        return lambda slots: tuple([slots[i] for i in index])
    if all(kind == "const" for kind, _ in parts):
        const = tuple(a for _, a in parts)
        return lambda slots: const

    def build(slots: Slots) -> tuple:
        out = []
        for kind, x in parts:
            if kind == "slot":
                out.append(slots[x])
            elif kind == "const":
                out.append(x)
            else:
                container, items = x
                out.append(container([slots[i] if is_slot else i for is_slot, i in items]))
        return tuple(out)
    return build


def _taker(slots: list[int]) -> Callable[[Slots], tuple]:
    """A function returning the tuple of a call's tensors in `slots` (operator.itemgetter's C loop)."""
    if len(slots) > 1:
        return operator.itemgetter(*slots)
    if slots:
        (i,) = slots
        return lambda call: (call[i],)
    return lambda call: ()


def _owning_outputs(executor, graph) -> Callable[[list, list], None] | None:
    """What makes every output of a call own its memory, contiguous, as torch's results of the graph's ops
    do (``x.clone()``, ``.contiguous()``, ``cat([x])``); None when every output is a kernel's new buffer.

    An output may share memory with an input, a constant (a weight) or another output where it is a graph
    input or constant itself, a view step (a removed movement op), a framework op's result, or the same
    value twice.  Those are checked per call and copied where they do: a caller who changes one of them in
    place must not change its input, the model's weight, another output or the next call's result."""
    made_by = {name: s.kind for s in executor.steps for name in s.writes}
    names = [v.name for v in graph.outputs]
    # the new value of an input changed in place is written back into it, and returned as that input
    # (vtc.frontend.torch_export.write_back), never as a buffer of its own
    written_back = {names[j] for _, j in graph.meta.get("input_mutations", ())}
    risky = [k for k, n in enumerate(names) if n not in written_back
             and (made_by.get(n) in (None, "view", "run") or n in names[:k])]
    if not risky:
        return None
    consts = {t.untyped_storage().data_ptr() for t in executor.consts.values()}
    views = {k for k in risky if made_by.get(names[k]) == "view"}
    safe = [k for k in range(len(names)) if k not in risky]

    def own(outs: list, inputs: list) -> None:
        taken = {t.untyped_storage().data_ptr() for t in inputs}  # and the constants' (not copied per call)
        taken.update(outs[k].untyped_storage().data_ptr() for k in safe)
        for k in risky:
            t = outs[k]
            ptr = t.untyped_storage().data_ptr()
            if ptr in taken or ptr in consts or (k in views and not t.is_contiguous()):
                t = outs[k] = t.clone(memory_format=torch.contiguous_format)
                ptr = t.untyped_storage().data_ptr()
            taken.add(ptr)
    return own


def _freer(frees: tuple[int, ...]) -> Callable[[Slots], None]:
    """A closure dropping the call's references to the values whose last reader has run."""
    if len(frees) == 1:
        (i,) = frees

        def free(slots: Slots) -> None:
            slots[i] = None
        return free

    def free_all(slots: Slots) -> None:
        for i in frees:
            slots[i] = None
    return free_all
