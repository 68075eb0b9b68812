"""Consecutive generated kernels of a call plan run in one C call (a *segment*).

A kernel called on its own from the call plan (``vtc.runtime.callplan``) costs ~1-3 us of Python around
it: a closure call, its inputs taken from the slots, its outputs allocated, their addresses packed into a
pointer array, a ctypes call.  Most of that is the same in every call: a constant's address, an address in
the call's arena (``callplan._arena_layout``: base + a fixed offset), a size-generic kernel's sizes.  A
segment is a maximal run of consecutive kernel steps that need no Python between them; it is set up once as
a table (built here, run by ``vtc_run_segment`` in ``vtc.runtime.checks``):

- a template of every kernel's pointer array, one after the other, with the fixed addresses in place;
- relocations ``(pointer, value, addend)``: the pointers that change per call are one of the call's few
  values plus an addend: value 0 is the arena's base address (the addend: a buffer's offset), then the
  inputs the segment reads from outside (graph inputs, constants that need a per-call check, earlier
  steps' results), then the outputs allocated for the call (those that leave the arena), then packed
  conv_bcast weights (``PackedConvWeight.state``, taken before the C call);
- per kernel: its function, where its pointer array starts, the flag or'ed into its thread count
  (``conv_bcast.PACKED_FLAG``) and its int64 index range checks (``checks._split_checks`` rows).

A call of the segment allocates its outputs, packs the values into one bytes object and makes one ctypes
call; the C side copies the template onto its stack, patches it and runs each kernel after its checks.  The
table is never written after it is built, so calls in several threads share it.  A failing check returns
its row before its kernel runs, and ``IndexCheck.run`` raises the same IndexError (op and value) as the
kernel's own call would.

What ends a segment: a step that is not a generated kernel (a torch op, a view, a gather), a kernel that
computes derived index tensors or has a range check C cannot run (not over an int64 input buffer); a
kernel allocating a buffer (``buffers.MIN_BYTES`` or more, not in the arena) after such a buffer was freed
earlier in the segment (run on its own, the kernel would reuse that memory, through the pool or, with the
pool off, the allocator: allocating every output before the C call must not raise the peak); more than ``MAX_POINTERS`` pointers.  Segments are on where the
buffer pool is (``VTC_BUFFER_POOL=0`` turns both off: with the pool off they raised the peak memory of the
bench's units, docs/chains.md, the callcost section's follow-up); ``VTC_CALL_SEGMENTS=0`` / ``1`` in the
environment (or ``SEGMENTS`` set before a plan is built) decides alone.
"""
from __future__ import annotations

import os
import struct
from typing import Any, Callable

import torch

from vtc.codegen import conv_bcast
from vtc.runtime.buffers import ENABLED as POOL_ENABLED
from vtc.runtime.buffers import MIN_BYTES
from vtc.runtime.checks import segment_runner

# on with the buffer pool (whose reuse Segment.add accounts for: the pool holds as many buffers as without
# segments); with the pool off (VTC_BUFFER_POOL=0, the bench's memory probes) every buffer's lifetime is the
# peak's, and segments measured a higher one (efficientvit_b16 55 -> 73 MiB, c3k2_b1 1.7 -> 2.9 MiB, session 12)
SEGMENTS = os.environ.get("VTC_CALL_SEGMENTS", "1" if POOL_ENABLED else "0") == "1"
MAX_POINTERS = 4096  # a segment's pointer arrays (copied to the C stack: 32 KB)


class Segment:
    """Gathers one segment's kernel steps (``add``) and makes the closure running them (``closure``)."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.runner = segment_runner() if SEGMENTS else None  # None without a compiler: every kernel alone
        self.items: list[tuple[Any, Any]] = []  # (step, callplan.KernelParts)
        self.pointers = 0
        self.freed_pooled = False  # a step of the segment drops a buffer of the pool
        self.nbytes: dict[str, int] = {}
        for v in plan.graph.values():
            if all(isinstance(d, int) for d in v.shape):
                self.nbytes[v.name] = v.nbytes
        for s in plan.executor().steps:
            if s.kind == "kernel":
                for b in s.kernel.outputs:
                    self.nbytes[b.name] = b.nbytes

    def _pooled(self, name: str) -> bool:
        """A buffer of its own per call (not the arena's), from the pool or, with the pool off, the allocator:
        freed within a run, it is memory the next allocation would take again."""
        return self.nbytes.get(name, 0) >= MIN_BYTES and name not in self.plan.arena_offsets

    def add(self, s, parts) -> bool:
        """Adds kernel step s to the segment; False where it cannot join it (the caller ends the segment and
        tries again: False for an empty segment means the kernel runs on its own)."""
        if self.runner is None or parts.python_checks:
            return False
        n = parts.ck._pointers._length_ + (parts.weight is not None)
        if self.items and (self.pointers + n > MAX_POINTERS or self.freed_pooled and any(
                self._pooled(b.name) for b in parts.ck.outputs)):
            return False
        self.items.append((s, parts))
        self.pointers += n
        self.freed_pooled = self.freed_pooled or any(self._pooled(name) for name in s.frees)
        return True

    def take(self) -> list[tuple[Any, Any]]:
        """The segment's steps and parts; the next segment starts empty."""
        items, self.items, self.pointers, self.freed_pooled = self.items, [], 0, False
        return items

    def closure(self, items: list[tuple[Any, Any]]) -> Callable[[list], None]:
        """The closure running the kernels of `items` (two or more) in one C call, then dropping what they
        free."""
        from vtc.runtime.callplan import _contiguous_checked, _taker

        plan = self.plan
        slot, placed, template = plan.slot, plan.arena_offsets, plan.template
        externals: dict[tuple, int] = {}  # (slot, how it is checked per call) -> its number among them
        allocs: list[Callable[[], torch.Tensor]] = []
        made_names: list[str] = []
        made_by: dict[str, int] = {}  # value -> its number among the outputs allocated per call
        weights: list[Callable[[], tuple]] = []
        pointers: list[int] = []  # the template
        relocs: list[tuple[int, tuple[str, int], int]] = []  # (pointer, (kind of value, number), addend)
        kernels: list[tuple[int, ...]] = []
        check_rows: list[tuple[int, ...]] = []
        failures: list[tuple] = []  # per check row: (check, where its tensor is, the kernel's name)
        arena = False
        for _, parts in items:
            ck, start = parts.ck, len(pointers)
            checked = {k: rest for k, *rest in parts.checked}
            strided = set(parts.strided)
            where = []  # per input: ("ext", n), ("made", n), ("fixed", tensor) or ("arena", 0)
            for p, b in enumerate(ck.inputs):
                const = template[slot[b.name]]
                if b.name in placed:
                    where.append(("arena", 0))
                    relocs.append((start + p, ("arena", 0), placed[b.name]))
                elif b.name in made_by:
                    where.append(("made", made_by[b.name]))
                    relocs.append((start + p, where[-1], 0))
                elif p not in checked and p not in strided and isinstance(const, torch.Tensor):
                    where.append(("fixed", const))  # a constant: its address is the same in every call
                    plan.fixed_storages.append(const.untyped_storage())  # held: never freed under the table
                    pointers.append(const.data_ptr())
                    continue
                else:
                    how = ("checked", *checked[p], parts.name) if p in checked else ("strided",) if p in strided \
                        else ()
                    where.append(("ext", externals.setdefault((slot[b.name], how), len(externals))))
                    relocs.append((start + p, where[-1], 0))
                pointers.append(0)
            for p, (b, alloc) in enumerate(zip(ck.outputs, parts.allocs), start=len(ck.inputs)):
                if b.name in placed:
                    relocs.append((start + p, ("arena", 0), placed[b.name]))
                else:
                    made_by[b.name] = len(allocs)
                    allocs.append(alloc)
                    made_names.append(b.name)
                    relocs.append((start + p, ("made", made_by[b.name]), 0))
                pointers.append(0)
            pointers.extend(parts.sizes)
            flag = 0
            if parts.weight is not None:
                relocs.append((len(pointers), ("weight", len(weights)), 0))
                pointers.append(0)
                weights.append(parts.weight)
                flag = conv_bcast.PACKED_FLAG
            arena = arena or any(b.name in placed for b in [*ck.inputs, *ck.outputs])
            kernels.append((parts.address, start, flag, len(check_rows), len(parts.fused)))
            for check, row in parts.fused:
                check_rows.append(row)
                failures.append((check, where[row[0]], parts.name))
        first = {"arena": 0, "ext": 1, "made": 1 + len(externals), "weight": 1 + len(externals) + len(allocs)}
        rows = [(p, first[kind] + n, add) for p, (kind, n), add in relocs]
        table = struct.pack(f"{3 + len(pointers) + 3 * len(rows) + 5 * len(kernels) + 4 * len(check_rows)}q",
                            len(kernels), len(pointers), len(rows), *pointers, *[x for r in rows for x in r],
                            *[x for k in kernels for x in k], *[x for r in check_rows for x in r])
        plan.segment_arena = plan.segment_arena or arena
        plan.counts["segments"] += 1
        plan.counts["segment_kernels"] += len(items)

        keys = list(externals)
        take = _taker([s for s, _ in keys])
        fix_strided = [n for n, (_, how) in enumerate(keys) if how == ("strided",)]
        fix_checked = [(n, *how[1:]) for n, (_, how) in enumerate(keys) if how[:1] == ("checked",)]
        fix = bool(fix_strided or fix_checked)
        frees = {n for s, _ in items for n in s.frees if n not in placed}
        store = [(slot[n], j) for j, n in enumerate(made_names) if made_by[n] == j and n not in frees]
        clear = [slot[n] for n in dict.fromkeys(n for s, _ in items for n in s.frees) if n in frees]
        a_slot = plan.arena_slot if arena else None
        pack = struct.Struct(f"{1 + len(keys) + len(allocs) + len(weights)}Q").pack
        runner, get_threads, name = self.runner, torch.get_num_threads, items[0][1].name

        def failed(row: int, tensors, made) -> None:
            check, (kind, n), kernel = failures[row]
            check.run(tensors[n] if kind == "ext" else made[n] if kind == "made" else n)  # raises the op's
            # IndexError naming the value
            raise RuntimeError(f"kernel {kernel}: a C range check failed and torch's passed")  # cannot be: both
            # test lo <= i <= hi on the same int64s

        def segment(slots: list) -> None:
            tensors = take(slots)  # held until the C call returns (a contiguous copy of a strided input)
            if fix:
                tensors = _contiguous_checked(name, tensors, fix_strided, fix_checked)
            made = [a() for a in allocs]
            states = [w() for w in weights]  # held while the kernels run: a re-pack never frees them under them
            values = pack(slots[a_slot][1] if a_slot is not None else 0, *[t.data_ptr() for t in tensors],
                          *[t.data_ptr() for t in made], *[st[2] for st in states])
            row = runner(table, values, get_threads())
            if row >= 0:
                failed(row, tensors, made)
            for i, j in store:
                slots[i] = made[j]
            for i in clear:
                slots[i] = None
        return segment
