"""The model's tensors that a compiled model holds, watched for being replaced after compiling.

A capture turns the module's parameters, buffers and tensor attributes into constants of the graph: tensors
sharing the parameters' storage (``detach()``).  Everything built from them holds that storage, or a copy of
it: the executor's constants, the views of them the call plan makes once, MKL's packed weights
(``vtc.runtime.packed``), a generated convolution's or GEMM's packed panels, the addresses in a segment's
table (``vtc.runtime.segment``), constants folded at compile time (``vtc.ir.fold``).  A change *in place*
(``load_state_dict``, ``p.mul_`` under ``no_grad``, an optimizer step) writes into that storage and moves the
version counter, which the packed copies watch.  A parameter *replaced* by another tensor leaves all of them
on the old storage:

- ``p.data = t`` and ``module.to(...)`` / ``.half()`` / ``.double()`` (``set_data``, or
  ``torch.utils.swap_tensors`` under torch's swap flag): the same Python object, on new memory;
- ``load_state_dict(..., assign=True)``, ``module.weight = nn.Parameter(t)``: another object in the module's
  slot.

``ParameterWatch`` keeps, per captured tensor the graph reads, every module slot that holds it (a tied
weight: each slot), the object found there when it was built and the address the graph's constant has; a
call tests, for each, ``slot[key] is obj and obj.data_ptr() == address`` (``condition``: inlined into the
generated fast call, ~57 ns per tensor, 1 thread; ``changed``: the same test as one generated function).
When one fails, ``vtc.Compiled`` captures the model again (its kernels come from the cache on disk).  The
watch holds the captured tensors, so their memory is never freed and its address cannot be given to a new
tensor while the watch exists: an address that has not moved is the captured storage.

Not seen (README; docs/robustness.md, session 15):

- a write through ``p.data`` (``p.data.mul_(2)``, ``p.data.copy_(t)``) moves the version counter of the
  temporary ``p.data``, not ``p``'s: kernels that read the weight see it, the packed and folded copies do
  not.  ``Compiled.refresh()`` rebuilds them;
- ``p.data = v`` where v is another view of the *same* memory starting at the same address (``p.data =
  p.data.t()``, ``p.data.view(dtype)``): the address has not moved.  Testing shapes, strides and dtypes as
  well would cost ~150 ns per tensor and call instead of ~57.
"""
from __future__ import annotations

import functools
import operator
import threading
from typing import Any, Callable

import torch


def module_slots(model: Any) -> dict[str, tuple[dict, str, torch.Tensor]]:
    """{qualified name: (the table holding it, its key, the tensor)} of every tensor slot of `model`'s module tree
    (parameters, buffers, tensor attributes; a module reachable by several paths under each)."""
    out: dict[str, tuple[dict, str, torch.Tensor]] = {}
    if not isinstance(model, torch.nn.Module):
        return out
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for table in (mod._parameters, mod._buffers, vars(mod)):
            for key, t in table.items():
                if isinstance(t, torch.Tensor):
                    out.setdefault(f"{prefix}.{key}" if prefix else key, (table, key, t))
    return out


class ParameterWatch:
    """Tests whether a tensor of the model that a graph holds has been replaced since it was captured."""

    def __init__(self, model: Any, sources: list[tuple[str, torch.Tensor]]) -> None:
        """sources: (qualified name in `model`, the graph's constant captured from it)."""
        slots = module_slots(model)
        by_object: dict[int, list[tuple[str, dict, str]]] = {}
        for name, (table, key, t) in slots.items():
            by_object.setdefault(id(t), []).append((name, table, key))
        self.held = [t for _, t in sources]  # their storages: an address never given to another tensor meanwhile
        self.entries: list[tuple[str, dict, str, torch.Tensor, int]] = []  # (name, table, key, object, address)
        seen: set[tuple[int, str]] = set()
        for name, captured in sources:
            if name not in slots:
                continue  # not a slot of the module tree (a tensor made in forward): nothing can replace it
            obj = slots[name][2]
            for slot_name, table, key in by_object[id(obj)]:  # a tied tensor: every slot that holds it
                if (id(table), key) not in seen:
                    seen.add((id(table), key))
                    self.entries.append((slot_name, table, key, obj, captured.data_ptr()))
        env: dict[str, Any] = {}
        source = (f"def changed():\n    try:\n        return {self.condition(env, 'W')}\n"
                  "    except KeyError:  # a slot deleted (del module.weight)\n        return True\n")
        exec(compile(source, "<vtc parameter watch>", "exec"), env)  # noqa: S102 - our own text
        self._changed = env["changed"]

    def __len__(self) -> int:
        return len(self.entries)

    def condition(self, env: dict, prefix: str) -> str:
        """A Python expression, true when a watched tensor was replaced (or raising KeyError: its slot was
        deleted); the names it reads are put into env (prefixed by `prefix`)."""
        terms = []
        for i, (_, table, key, obj, address) in enumerate(self.entries):
            env[f"{prefix}d{i}"], env[f"{prefix}t{i}"] = table, obj
            terms.append(f"{prefix}d{i}[{key!r}] is not {prefix}t{i} or {prefix}t{i}.data_ptr() != {address}")
        return " or ".join(terms) or "False"

    def changed(self) -> bool:
        """Whether a watched tensor was replaced (one generated expression: no loop)."""
        return self._changed()

    def why(self) -> str:
        """What was replaced, for a message: the first tensor that was, and how."""
        for name, table, key, obj, address in self.entries:
            now = table.get(key)
            if now is not obj:
                what = "removed" if not isinstance(now, torch.Tensor) else (
                    f"replaced by another tensor ({now.dtype} {list(now.shape)})")
                return f"{name} was {what}"
            if obj.data_ptr() != address:
                return f"{name} was given other memory ({obj.dtype} {list(obj.shape)}: p.data = t, module.to(...))"
        return "nothing"


def watch(model: Any, graph) -> ParameterWatch | None:
    """The watch of the module tensors `graph` was captured from (``graph.meta["const_sources"]``: {constant
    name: qualified name}, made by ``vtc.frontend.torch_export.export_graph``), or None when there are none."""
    names = graph.meta.get("const_sources") or {}
    if not names or not isinstance(model, torch.nn.Module):
        return None
    sources = [(names[v.name], v.data) for v in graph.consts if v.name in names and isinstance(v.data, torch.Tensor)]
    w = ParameterWatch(model, sources)
    return w if len(w) else None


class ConstCopy:
    """A constant the compiled graph holds as a copy computed from the model's tensors (``sources``): a contiguous
    copy of a non-contiguous parameter (``vtc.runtime.executor``), a weight behind a movement chain or a value a
    compute op makes from the model's tensors (weight normalisation, T5's position bias), folded once
    (``vtc.ir.fold.fold_weight_chains``).  ``refresh()`` (each call, before any kernel) computes it again, into the
    same memory, where a source's version counter moved since: an in-place change (``load_state_dict``, ``p.mul_``
    under ``no_grad``) reaches the next call.  The copy's own version counter then moves too, so the packed copies
    made of it (``vtc.runtime.packed``) are packed again.  One object per copy, shared by the executors that hold
    it: the first call after a change computes it again, the others find it current."""

    def __init__(self, sources: tuple[torch.Tensor, ...], compute: Callable[[], torch.Tensor]) -> None:
        """`value`: ``compute()`` (the sources' tensors in, a tensor of them out) in memory of its own, contiguous."""
        self.sources, self.compute, self.lock = sources, compute, threading.RLock()
        # the sum of the sources' version counters (each only grows: the sum moves where one of them moved), one
        # attribute read for one source (~0.1 us a call, 1 thread)
        self.version = (functools.partial(_VERSION, sources[0]) if len(sources) == 1
                        else functools.partial(_version_sum, sources))
        self.seen = self.version()  # read first: a change while it is computed is seen at the next call
        with torch.no_grad():
            self.value = compute().clone(memory_format=torch.contiguous_format)

    def refresh(self) -> None:
        """Computes the copy again where a source changed in place since it was computed."""
        if self.version() != self.seen:
            with self.lock:
                if self.version() != self.seen:
                    self.compute_again()

    def compute_again(self) -> None:
        """Computes the copy again, into the same memory, whatever the version counters say (a new graph taking a
        copy another holds, ``vtc.ir.fold``: a write through ``p.data`` moved none of them)."""
        with self.lock:
            seen = self.version()
            with torch.no_grad():
                self.value.copy_(self.compute())
            self.seen = seen


_VERSION = operator.attrgetter("_version")


def _version_sum(sources: tuple[torch.Tensor, ...]) -> int:
    return sum(map(_VERSION, sources))
