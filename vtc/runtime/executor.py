"""Runs a planned graph: compute ops through torch, virtual tensors through their mappings.

The executor is a flat list of steps built once at compile time:

- ``run``: a compute, fallback or kept-physical movement node, called through
  the framework op (``Node.run``);
- ``view``: a virtual value whose composed mapping is a strided view, handed to
  its readers as a zero-copy ``as_strided`` view of its source;
- ``gather``: any other virtual value that something reads, realised by one
  gather from its physical sources (``vtc.index.mapping.gather``).

With ``oracle=True`` every realisation is a gather, so the result checks the
composed mappings themselves (the tests run both).  Each step also lists the
values whose last reader it is; they are dropped from the environment right
after, and ``peak_bytes`` is the largest total of live intermediate buffers.
Calls share no mutable state but the pool of large kernel output buffers
(``vtc.runtime.buffers``, locked), so one executor may run in several threads.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import re
from dataclasses import dataclass

import torch

from vtc.index.mapping import gather
from vtc.ir.graph import Graph, Node, Value
from vtc.plan.virtualize import Plan, Realization
from vtc.runtime.buffers import BufferPool
from vtc.runtime.checks import check_range
from vtc.runtime.weights import ConstCopy
from vtc.virtual.movement import derive_index_tensors, has_derived_index_tensors


@dataclass
class Step:
    """One thing the executor does: run a node, call a kernel, or make a virtual value physical."""

    kind: str  # "run" | "view" | "gather" | "kernel" | "alias" (a view that is not a virtual value's)
    node: Node | None = None
    realization: Realization | None = None
    kernel: "CompiledKernel | None" = None
    out_bytes: int = 0  # bytes of the buffers this step allocates
    frees: tuple[str, ...] = ()  # values whose last reader is this step

    @property
    def reads(self) -> list[str]:
        if self.node is not None:
            return [v.name for v in self.node.inputs]
        if self.kernel is not None:
            return self.kernel.reads
        m = self.realization.mapping
        return [*m.sources, *m.index_tensors]

    @property
    def writes(self) -> list[str]:
        if self.node is not None:
            return [v.name for v in self.node.outputs]
        if self.kernel is not None:
            return [b.name for b in self.kernel.outputs]
        return [self.realization.value]


class Executor:
    """Runs `graph` under `plan`; a call maps flat input tensors to flat output tensors.

    backend="torch" runs compute through torch and realises virtual tensors by
    views and gathers; backend="cpu" runs generated C++ kernels (vtc.codegen)
    and torch only for library nodes.
    """

    def __init__(self, graph: Graph, plan: Plan, oracle: bool = False, backend: str = "torch",
                 gemm: str = "auto", build: bool = True, kernel_builder=None) -> None:
        self.graph, self.plan, self.oracle, self.backend, self.gemm = graph, plan, oracle, backend, gemm
        self.build = build  # False: steps and liveness only (a planner's peak estimate); kernels not compiled
        self.kernel_builder = kernel_builder  # (kernel steps, executor) -> CompiledKernels; None: build_kernels
        self.values: dict[str, Value] = {v.name: v for v in graph.values()}
        # constants that are copies, computed again where their sources changed in place since the last call:
        # contiguous copies of non-contiguous constants (a channels_last or transposed parameter; an inference
        # tensor has no version counter: it is not refreshed) and weights behind movement chains folded once
        # (vtc.ir.fold.fold_weight_chains)
        copied = {v.name: ConstCopy((v.data,), lambda t=v.data: t) for v in graph.consts
                  if not v.data.is_contiguous() and not v.data.is_inference()}
        self.consts = {v.name: copied[v.name].value if v.name in copied else v.data.contiguous() for v in graph.consts}
        self.const_copies = [*copied.values(), *graph.meta.get("const_copies", {}).values()]
        self.lowering = None
        self.pool = BufferPool()  # large kernel outputs recycled across steps and calls (vtc.runtime.buffers)
        self.steps = self._schedule_cpu() if backend == "cpu" else self._schedule()
        self.peak_bytes = self._liveness()
        self._call_plan = None  # vtc.runtime.callplan.CallPlan: the steps set up for fast calls, on the first call
        self.packing: dict = {}  # the weights its call plan packed once, set when the plan is built (the report's)

    # -- building -------------------------------------------------------------
    def _realize_step(self, name: str) -> Step:
        """A view or gather step for virtual value `name` (torch backend)."""
        r = self.plan.realized[name]
        kind = "gather" if self.oracle or r.strided is None else "view"
        nbytes = self.values[name].nbytes if kind == "gather" else 0
        return Step(kind, realization=r, out_bytes=nbytes)

    def _schedule(self) -> list[Step]:
        steps: list[Step] = []
        for n in self.graph.nodes:
            for name in self.plan.needs.get(n.name, ()):
                if not any(s.realization is not None and s.realization.value == name for s in steps):
                    steps.append(self._realize_step(name))
            if n.kind == "movement" and n.name not in self.plan.kept:
                continue  # virtual: read through its mapping by whoever realises it
            steps.append(Step("run", node=n, out_bytes=sum(v.nbytes for v in n.outputs)))
        done = {s.realization.value for s in steps if s.realization is not None}
        for v in self.graph.outputs:
            if self.plan.is_virtual(v.name) and v.name not in done:
                steps.append(self._realize_step(v.name))
                done.add(v.name)
        return steps

    def _schedule_cpu(self) -> list[Step]:
        """Steps from the code generator's lowering; every kernel built (in parallel) before returning (in a
        ``kernels_built_together`` block: at its end)."""
        from vtc.codegen.lower import lower

        self.lowering, lowered = lower(self.graph, self.plan, gemm=self.gemm)
        ksteps = [payload for kind, payload in lowered if kind == "kernel"]
        if not self.build:
            built = [CompiledKernel(k, None) for k in ksteps]
        else:  # size-generic kernels (vtc.runtime.generic) when a builder is given
            built = self.kernel_builder(ksteps, self) if self.kernel_builder else build_kernels(ksteps)
        compiled = dict(zip((id(k) for k in ksteps), built))
        steps: list[Step] = []
        for kind, payload in lowered:
            if kind == "run":
                steps.append(Step("run", node=payload, out_bytes=sum(v.nbytes for v in payload.outputs)))
            elif kind == "view":
                steps.append(Step("view", realization=self.plan.realized[payload]))
            elif kind == "alias":  # an output stored into the input it replaces (vtc.codegen.push._in_place)
                steps.append(Step("alias", realization=payload))
            elif kind == "gather":
                steps.append(Step("gather", realization=payload, out_bytes=self.values[payload.value].nbytes))
            else:
                ck = compiled[id(payload)]
                steps.append(Step("kernel", kernel=ck, out_bytes=sum(b.nbytes for b in ck.outputs)))
        return steps

    def _liveness(self) -> int:
        """Sets each step's frees and returns the peak bytes of live intermediate buffers."""
        keep = {v.name for v in self.graph.outputs} | {v.name for v in self.graph.inputs} | set(self.consts)
        last: dict[str, int] = {}
        for k, s in enumerate(self.steps):
            for name in s.reads:
                last[name] = k
        held: dict[int, list[str]] = {}  # step -> view sources whose storage a view holds until that step
        for k, s in enumerate(self.steps):
            if s.kind in ("view", "alias") and s.realization.strided is not None:
                src, view = s.realization.strided.source, s.realization.value
                end = len(self.steps) if view in keep else last.get(view, k)
                if end > last.get(src, -1):
                    last[src] = end
                    held.setdefault(end, []).append(src)
        sizes: dict[str, int] = {}
        live = peak = 0
        for k, s in enumerate(self.steps):
            for name in s.writes:
                nbytes = self.values[name].nbytes if s.out_bytes else 0
                sizes[name] = nbytes
                live += nbytes
                last.setdefault(name, k)
            peak = max(peak, live)
            frees = tuple(n for n in s.reads + s.writes + held.get(k, []) if last.get(n) == k and n not in keep)
            s.frees = tuple(dict.fromkeys(frees))
            live -= sum(sizes.get(n, 0) for n in s.frees)
        return peak

    # -- running --------------------------------------------------------------
    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.build:
            raise RuntimeError("this Executor was made with build=False (schedule and peak only): it cannot run")
        return self.call_plan()(inputs)

    def call_plan(self):
        """The steps set up for fast calls (``vtc.runtime.callplan.CallPlan``), built on the first call."""
        plan = self._call_plan
        if plan is None:
            from vtc.runtime.callplan import CallPlan

            unbuilt = [s.kernel.step.kernel.name for s in self.steps if s.kind == "kernel" and s.kernel.fn is None]
            if unbuilt:  # (a plan made now would keep their null addresses after they are built)
                raise RuntimeError(f"kernels {', '.join(unbuilt[:3])}{' ...' if len(unbuilt) > 3 else ''} are not "
                                   "built: this executor was made with build=False, or inside a kernels_built_together "
                                   "block, which builds them when it ends (call the model after the block)")

            plan = self._call_plan = CallPlan(self)  # two threads may both build one: each is complete
        return plan

    def refresh_const_copies(self) -> None:
        """Computes a constant copy again where its sources changed in place since the last call."""
        for c in self.const_copies:
            c.refresh()

    def run_steps(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """A call step by step through ``run_step`` (what ``CallPlan`` does faster; the reference for its tests)."""
        self.refresh_const_copies()
        env: dict[str, torch.Tensor] = dict(self.consts)
        for v, t in zip(self.graph.inputs, inputs):
            env[v.name] = t
        for s in self.steps:
            self.run_step(s, env)
            for name in s.frees:
                env.pop(name, None)
        return [env[v.name] for v in self.graph.outputs]

    def run_step(self, s: Step, env: dict[str, torch.Tensor]) -> None:
        """Runs one step on the tensors in `env`, putting its results there."""
        if s.kind == "run":
            outs = s.node.run(env)
            if s.node.kind == "movement":  # kept physical: really materialised, never an alias
                outs = [_own(t, [env[v.name] for v in s.node.inputs]) for t in outs]
            for v, t in zip(s.node.outputs, outs):
                env[v.name] = t
        elif s.kind == "kernel":
            for b, t in zip(s.kernel.outputs, s.kernel(env, self.pool)):
                env[b.name] = t
        else:
            env[s.realization.value] = self._realize(s, env)

    def _realize(self, s: Step, env: dict[str, torch.Tensor]) -> torch.Tensor:
        m = s.realization.mapping
        if s.kind in ("view", "alias"):
            for c in m.checks:
                c.run(env[c.tensor])
            st = s.realization.strided
            src = env[st.source].contiguous()
            return src.as_strided(m.shape, st.strides, src.storage_offset() + st.offset)
        tensors = {k: env[k] for k in [*m.sources, *m.index_tensors] if k in env}
        tensors.update(derive_index_tensors(m, tensors))
        return gather(m, tensors, self.values[s.realization.value].dtype)


def _own(t: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    """t, copied into its own contiguous buffer when it aliases one of `inputs`."""
    ptr = t.untyped_storage().data_ptr()
    if any(x.untyped_storage().data_ptr() == ptr for x in inputs):
        return t.clone(memory_format=torch.contiguous_format)
    return t


class CompiledKernel:
    """A generated kernel loaded from its shared library, called on tensors looked up by name."""

    def __init__(self, step, fn, sizes: tuple[int, ...] | None = None) -> None:
        from vtc.codegen.cpp import buffer_order

        self.step, self.fn = step, fn  # fn None: not built (build=False, or a kernels_built_together block's)
        k = step.kernel
        self.order = buffer_order(k)
        given = len(k.inputs)  # the kernel's inputs, incl. a buffer it writes into in place (vtc.codegen.push)
        self.outputs, self.inputs = self.order[given:], self.order[:given]
        derived_from = [n for m in step.derived for n in m.index_tensors] + [c.tensor for c in step.checks]
        self.reads = list(dict.fromkeys([b.name for b in self.inputs] + derived_from))
        # what a call needs, computed once: per call only lookups, one check per input, the ctypes call
        self._inputs = [(b.name, torch.Size(b.shape), b.dtype) for b in self.inputs]
        self._outputs = [(torch.Size(b.shape), b.dtype) for b in self.outputs]
        self._pointers = ctypes.c_void_p * len(self.order)
        # a size-generic kernel (vtc.runtime.generic) reads its sizes from one more pointer after the buffers
        self._sizes = () if sizes is None else (torch.tensor(sizes, dtype=torch.int64),)
        if sizes is not None:
            self._pointers = ctypes.c_void_p * (len(self.order) + 1)
        # mappings whose derived index tensors a call computes: those the kernel loads (a kernel that loads a
        # mapping's real index tensor only, e.g. computing pos + 1 from an index_copy_'s pos, derives nothing)
        self._loaded = frozenset(b.name for b in self.inputs)
        self._derived = [m for m in step.derived if has_derived_index_tensors(m, self._loaded)]
        self._plain = not step.checks and not self._derived  # reads env as it is

    def __call__(self, env: dict[str, torch.Tensor], pool: "BufferPool | None" = None) -> list[torch.Tensor]:
        k = self.step
        local = env
        if not self._plain:
            for c in k.checks:
                check_range(c, env[c.tensor])
            if self._derived:
                local = {b.name: env[b.name] for b in self.inputs if b.name in env}
            for m in self._derived:
                local.update(derive_index_tensors(m, {**{n: env[n] for n in m.index_tensors if n in env}, **local},
                                                  self._loaded))
        tensors = []
        for name, shape, dtype in self._inputs:
            t = local[name]
            if t.dtype != dtype or t.shape != shape:
                raise RuntimeError(f"kernel {k.kernel.name}: buffer {name} is {t.dtype} {list(t.shape)}, "
                                   f"generated for {dtype} {list(shape)}")
            tensors.append(t if t.is_contiguous() else t.contiguous())
        empty = pool.empty if pool is not None else torch.empty
        outs = [empty(shape, dtype=dtype) for shape, dtype in self._outputs]
        tensors += outs
        self.fn(self._pointers(*[t.data_ptr() for t in [*tensors, *self._sizes]]), torch.get_num_threads())
        return outs


KERNELS_PER_LIBRARY = 24
# each graph's kernels that build_kernels leaves to the end of a kernels_built_together block (None outside one)
_waiting: contextvars.ContextVar[list[list[CompiledKernel]] | None] = contextvars.ContextVar("vtc_waiting",
                                                                                           default=None)


def build_kernels(steps: list) -> list[CompiledKernel]:
    """Generates, compiles (in parallel, cached on disk) and loads the kernels of `steps` (in a
    ``kernels_built_together`` block: at the end of the block).

    Kernels whose sources are the same text but for their name (the layers of a model) are compiled
    once: the later ones call the first one's function (``distinct_sources``)."""
    waiting = _waiting.get()
    if waiting is not None:
        kernels = [CompiledKernel(s, None) for s in steps]
        waiting.append(kernels)
        return kernels
    return _build_graphs([steps])[0]


def _build_graphs(graphs: list[list]) -> list[list[CompiledKernel]]:
    """``build_kernels`` of each graph's kernel steps, all in one ``cbuild.build_many``: each graph's kernels in
    translation units of their own (two graphs' kernels can have the same name)."""
    from vtc.codegen.cpp import PRELUDE, generate
    from vtc.runtime import cbuild

    units, sources = [], []
    for steps in graphs:
        texts = [generate(s.kernel).replace(PRELUDE, "") for s in steps]
        first = distinct_sources(texts, [s.kernel.name for s in steps])
        chunks = libraries(texts, sorted(set(first)), cbuild.build_jobs())
        units.append((first, chunks, len(sources)))
        sources += [PRELUDE + "".join(texts[i] for i in chunk) for chunk in chunks]
    libs = cbuild.build_many(sources, name="vtc")
    out = []
    for steps, (first, chunks, start) in zip(graphs, units):
        lib_of = {i: lib for chunk, lib in zip(chunks, libs[start:]) for i in chunk}
        kernels = []
        for s, i in zip(steps, first):
            fn = getattr(lib_of[i], steps[i].kernel.name)
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int], None
            kernels.append(CompiledKernel(s, fn))
        out.append(kernels)
    return out


@contextlib.contextmanager
def kernels_built_together():
    """Within the block ``build_kernels`` builds nothing: the kernels of every executor made in it are built when
    the block ends, all in one parallel build (``cbuild.build_many``), as one graph's kernels are (the GEMMs of
    ``vtc.plan.cost._measure_ratios``' small graphs).  An executor made in the block runs only after
    it; a kernel that does not build raises ``KernelBuildError`` at the end of the block."""
    waiting: list[list[CompiledKernel]] = []
    token = _waiting.set(waiting)
    try:
        yield
    finally:
        _waiting.reset(token)
    for kernels, built in zip(waiting, _build_graphs([[k.step for k in ks] for ks in waiting])):
        for kernel, b in zip(kernels, built):
            kernel.fn = b.fn


def libraries(texts: list[str], kernels: list[int], jobs: int) -> list[list[int]]:
    """`kernels` (indices into `texts`) grouped into translation units: at least one per compiler job (up to
    one per kernel), so that they build in parallel, at most KERNELS_PER_LIBRARY kernels each, balanced by
    source length (the longest first, each into the shortest unit that has room); in index order within one."""
    if not kernels:
        return []
    n = max(-(-len(kernels) // KERNELS_PER_LIBRARY), min(len(kernels), max(1, jobs)))
    units: list[list[int]] = [[] for _ in range(n)]
    length = [0] * n
    for k in sorted(kernels, key=lambda k: (-len(texts[k]), k)):
        u = min((u for u in range(n) if len(units[u]) < KERNELS_PER_LIBRARY), key=lambda u: (length[u], u))
        units[u].append(k)
        length[u] += len(texts[k])
    return [sorted(u) for u in units]


def distinct_sources(texts: list[str], names: list[str]) -> list[int]:
    """For each kernel source, the index of the first one that is the same text once each kernel's own name
    (a whole word: its function, its namespace) is replaced by one placeholder.  Such kernels are the same
    code, so one compiled function serves all of them (a kernel keeps no state between calls but
    constant tables and per-thread scratch buffers, which the same code sets up the same way)."""
    seen: dict[str, int] = {}
    out = []
    for k, (text, name) in enumerate(zip(texts, names)):
        canonical = re.sub(rf"\b{re.escape(name)}\b", "@kernel@", text)
        out.append(seen.setdefault(canonical, k))
    return out
