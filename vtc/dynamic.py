"""New sizes without tracing or compiling again: symbolic capture + size-generic kernels.

``Compiled`` (``vtc.compile``) starts with static sizes.  When a call brings
new sizes of the same rank (or from the start with ``dynamic=True``), the model
is captured once more with torch.export, the dims that changed marked
``Dim.AUTO`` (``vtc.frontend.symbolic``); every later size is an
*instantiation* of that symbolic graph (tenths of a second, no tracing).  The
``torch.compile`` backend gets the symbolic graph from dynamo directly.

``DynamicSizes.specialization(leaves)`` then plans, lowers and builds one
concrete specialization; its kernels come from ``vtc.runtime.generic``:
size-generic templates, fitted from lowerings at probe sizes and checked
against the concrete source, so two sizes share one compiled kernel and the
C++ compiler does not run again.  The plan decisions of the first size
(which movement ops stay physical) are reused for the later ones and for the
probes, so that every size gets the same kernels; the planner's report of the
first size is kept with them.

Inputs that do not fit the symbolic graph (a size outside torch's range, e.g.
1 where export assumed >= 2; a static dim changed) fall back to a concrete
capture, with the reason in ``DynamicSizes.why_not``.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from vtc.codegen.cpp import MERGE_INNER_DIMS
from vtc.codegen.lower import PROBED
from vtc.codegen.ops import C_TYPES, POINTWISE, ROW, lookup
from vtc.codegen.stream import STREAM_STORES
from vtc.compiler import Specialization, warn_fallbacks
from vtc.frontend.symbolic import NotInstantiable, SymbolicGraph, dynamic_dims, export_symbolic
from vtc.frontend.torch_export import CaptureError
from vtc.index.mapping import rotate_linear_offsets
from vtc.ir.fold import fold_constants
from vtc.ir.graph import Graph
from vtc.plan.report import Report, build_report, fallback_ops
from vtc.plan.virtualize import Plan, _arg_key, _NoKey, plan_keeping, plan_none
from vtc.runtime.executor import Executor
from vtc.runtime.generic import GenericKernels, codegen_switches

MAX_MISSES = 256  # reasons kept (the latest): a decode loop brings a new size every step


@dataclass
class PushSummary:
    """The answers of ``codegen.push.Pusher`` that the report reads (``plan.report._push_why``)."""

    copies: set = field(default_factory=set)
    why_copied: dict = field(default_factory=dict)
    by_gemm: dict = field(default_factory=dict)
    by_attention: dict = field(default_factory=dict)
    copy_through: dict = field(default_factory=dict)


@dataclass
class LoweringSummary:
    """What a size's specialization keeps of its lowering once its kernels are built: the answers of
    ``codegen.lower.Lowering`` that are read later (the call plan reads ``gemm_choices``, the report
    ``defects`` and ``push``; the ``why_*`` dicts say why an op runs through torch).  The whole lowering (~1,000
    objects of per-node working state for the 4-layer Llama) would live as long as the specialization."""

    why_torch: dict = field(default_factory=dict)
    defects: dict = field(default_factory=dict)
    gemm_choices: dict = field(default_factory=dict)
    why_not_attention: dict = field(default_factory=dict)
    push: PushSummary = field(default_factory=PushSummary)

    @classmethod
    def of(cls, low) -> "LoweringSummary":
        push = getattr(low, "push", None)
        return cls(**{f: dict(getattr(low, f, None) or {}) for f in cls.__dataclass_fields__ if f != "push"},
                   push=PushSummary(**{f: type(getattr(PushSummary(), f))(getattr(push, f, None) or ())
                                       for f in PushSummary.__dataclass_fields__}))


class ProbeMemo:
    """``vtc.codegen.lower.Lowering._probe``'s answers by node signature, kept between the lowerings of one symbolic
    graph at several sizes (set through ``vtc.codegen.lower.PROBED``).  The signature is everything a probe reads: the node's name,
    its ATen target and the definition it looks up (a definition registered anew is another key), its arguments
    with each Value as name, shape and dtype (Python scalars by type and value, floats by ``repr``; an argument of
    any other type, such as a tensor, gives no key and the node is probed), its outputs' names, shapes and dtypes,
    and the kind.  (Which extra outputs are read is checked before the memo.)  Only NotSupported answers and
    successes are kept; any other exception (a defect of a definition) is raised again by probing again.

    The owner keeps it only while the code generators' switches (``generic.codegen_switches``: module constants
    such as ``ops.EXTREME_MAX_ELEMENTS`` that definitions read) and the C types are what they were, and calls
    ``rotate`` once per size: an answer not asked for during the last two sizes is dropped, so a node whose shapes
    change at every size does not make it grow.  An answer found keeps its first key (a key built per lookup and
    stored anew would be ~900 more objects per size for the garbage collector to move to its oldest generation)."""

    def __init__(self) -> None:
        self.answers: dict = {}  # key -> (answer, the size count at which it was last asked for)
        self.age = 0  # sizes so far (rotate)
        self.hits = 0
        self.probed = 0

    def key(self, n: Node, kind: str):
        table = POINTWISE if kind == "pointwise" else ROW
        try:
            return (n.name, n.target, lookup(table, n.target), kind, _arg_key(n.args), _arg_key(n.kwargs),
                    tuple((o.name, tuple(o.shape), o.dtype) for o in n.outputs))
        except _NoKey:
            return None

    def get(self, key):
        hit = self.answers.get(key)
        if hit is None:
            return None
        if hit[1] != self.age:
            self.answers[key] = (hit[0], self.age)  # an existing key: the dict keeps its first key object
        self.hits += 1
        return hit[0]

    def put(self, key, answer) -> None:
        self.probed += 1
        self.answers[key] = (answer, self.age)

    def rotate(self) -> None:
        self.age += 1
        old = [k for k, (_, age) in self.answers.items() if age < self.age - 2]
        for k in old:
            del self.answers[k]


class SizeSpecialization(Specialization):
    """A specialization of the symbolic graph at one size; its report is made when first read (2-3 ms and ~350
    objects per new length of the 4-layer Llama, which a decode loop never reads: ``Compiled.report`` is the
    example's)."""

    def __init__(self, graph: Graph, plan: Plan, executor) -> None:  # noqa: D107 - not the dataclass's
        self.graph, self.plan, self.executor, self._report = graph, plan, executor, None

    @property
    def report(self) -> Report:
        if self._report is None:
            self._report = build_report(self.graph, self.plan, self.executor)
        return self._report


class DynamicSizes:
    """A symbolic graph and the specializations made from it (plans reused, kernels size-generic)."""

    def __init__(self, sgraph: SymbolicGraph, options: dict, dims: list[set[int]] | None = None) -> None:
        self.sg, self.options, self.dims = sgraph, options, dims  # dims: per input leaf, the ones marked dynamic
        self.symbols = tuple(str(s) for s in sgraph.symbols)
        self.degrees = tuple(sgraph.degree[s] for s in sgraph.symbols)
        self.first_plan: Plan | None = None
        self._memo: dict = {}  # plan_keeping's mappings of the nodes whose sizes do not vary (vtc.plan.virtualize)
        self._sources: dict = {}  # the last specialization's kernel sources by IR (GenericKernels.previous)
        self.sources_reused = 0  # kernels of all specializations whose source was taken from the previous one
        self.templates_rendered = 0  # kernels matched by the previous size's template without parsing their source
        self.why_not: deque[str] = deque(maxlen=MAX_MISSES)  # the latest inputs that did not fit, and why
        self.kernels = {"generic": 0, "constant": 0, "fitted": 0}  # kernel counts over all specializations
        self.misses: deque[str] = deque(maxlen=MAX_MISSES)  # the latest kernels that found no template: why
        self.probed = ProbeMemo()  # Lowering._probe's answers by node signature (vtc.codegen.lower.PROBED)
        self._probed_under: tuple | None = None  # the code generators' switches and C types it holds answers under
        self.varying = _size_varying(sgraph.gm)  # the nodes whose output shapes vary with the sizes: not folded

    def _instantiate(self, sizes: dict) -> Graph:
        """The graph at these sizes with the values of a fixed shape computed from constants folded (``vtc.ir.fold``):
        the same nodes fold at every size (their shapes and whether they fit ``MAX_BYTES`` do not change), so the
        first size's plan decisions, replayed by node name, and the kernels fitted from probes hold at the others.
        A folded copy is shared by the sizes (``fold._SHARED``).  Values whose shapes vary (a RoPE table [S, D],
        T5's position bias [1, H, S, S]) stay computed: a copy per size, and whether one fits would change."""
        graph = self.sg.instantiate(sizes)
        graph.meta["size_varying"] = self.varying
        return fold_constants(graph)

    def _plan(self, graph: Graph) -> Plan:
        """The first size's plan from the planner; later sizes keep the same movement ops physical."""
        from vtc.plan.planners import make_plan

        if self.first_plan is None:
            self.first_plan = make_plan(graph, self.options)
            return self.first_plan
        return self._replay(graph)

    def _replay(self, graph: Graph) -> Plan:
        first = self.first_plan
        plan = plan_none(graph) if first.mode == "none" else plan_keeping(graph, first.mode, dict(first.kept),
                                                                           dict(first.pushed), memo=self._memo)
        plan.decisions, plan.objective = first.decisions, first.objective
        plan.notes = [*first.notes, "plan decisions reused from the first size of this symbolic graph"]
        return plan

    def _valid(self, sizes: tuple[int, ...]) -> bool:
        return all(lo <= v <= hi for v, (lo, hi) in zip(sizes, (self.sg.ranges.get(s, (0, float("inf")))
                                                                 for s in self.sg.symbols)))

    def _probe(self, sizes: tuple[int, ...]) -> dict[str, str] | None:
        """Kernel name -> C++ source of the graph at other sizes, under the same plan decisions."""
        from vtc.codegen.cpp import generate
        from vtc.codegen.lower import lower

        try:
            graph = self._instantiate(dict(zip(self.sg.symbols, sizes)))
            _, steps = lower(graph, self._replay(graph), gemm=self.options["gemm"])
            return {s.kernel.name: generate(s.kernel) for kind, s in steps if kind == "kernel"}
        except Exception:  # a probe that cannot be made only means no template: the kernel keeps its constants
            return None

    def specialization(self, leaves: list[Any]):
        """The planned, built specialization for these flat user inputs (NotInstantiable if they do not fit)."""
        env = self.sg.bind(leaves)
        sizes = tuple(env[s] for s in self.sg.symbols)
        graph = self._instantiate(env)
        flat_rows = MERGE_INNER_DIMS.set(False)  # one kernel text for every size (see vtc.codegen.cpp)
        plain_stores = STREAM_STORES.set(False)  # likewise (see vtc.codegen.stream)
        switches = codegen_switches()  # under the two settings above, as GenericKernels.build reads them
        under = (switches, frozenset(C_TYPES.items()))
        if under != self._probed_under:  # a definition may read a module constant: probe everything again
            self.probed, self._probed_under = ProbeMemo(), under
        self.probed.rotate()
        rotate_linear_offsets()  # keeps the offsets asked for at the last size
        probed = PROBED.set(self.probed)
        builder = GenericKernels(self.symbols, sizes, self.degrees, self._probe, self._valid, previous=self._sources,
                                 switches=switches)
        try:
            first = self.first_plan is None  # the planner's size: it keeps its whole lowering, to be looked into
            plan = self._plan(graph)
            o = self.options  # compiler.specialize's executor, with the size-generic kernel builder
            executor = Executor(graph, plan, oracle=o["oracle"], backend=o["backend"], gemm=o["gemm"],
                                kernel_builder=builder.build)
        finally:
            PROBED.reset(probed)
            STREAM_STORES.reset(plain_stores)
            MERGE_INNER_DIMS.reset(flat_rows)
        if not first:
            executor.lowering = LoweringSummary.of(executor.lowering)
        warn_fallbacks(fallback_ops(graph, executor))  # what specialize's report would have warned of
        spec = SizeSpecialization(graph, plan, executor)
        for k, v in builder.stats.items():
            self.kernels[k] += v
        self.sources_reused += builder.reused
        self.templates_rendered += builder.rendered
        self.misses.extend(builder.misses)
        return spec


def _size_varying(gm: torch.fx.GraphModule) -> frozenset[str]:
    """The names of the nodes of symbolic graph `gm` with an output whose shape depends on a symbol."""
    return frozenset(n.name for n in gm.graph.nodes
                     if any(isinstance(t, torch.Tensor) and not all(isinstance(d, int) for d in t.shape)
                            for t in pytree.tree_leaves(n.meta.get("val"))))


def dynamic_specialization(compiled, args: tuple, kwargs: dict):
    """``Compiled``'s specialization for new inputs through its symbolic graph, or None (capture them concretely).

    The symbolic graph is made on the first call whose sizes differ from the example inputs (or at once
    with ``dynamic=True``), with the dims that changed marked dynamic.
    """
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    dyn = getattr(compiled, "_dynamic", None)
    if dyn is False:
        return None
    first = pytree.tree_leaves((tuple(compiled._args), dict(compiled._kwargs)))
    if len(first) != len(leaves) or any(not isinstance(a, torch.Tensor) and (type(a) is not type(b) or a != b)
                                        for a, b in zip(first, leaves)):
        return None  # a non-tensor input has another value: the symbolic graph holds the example's
    changed = dynamic_dims(first, leaves)
    if dyn is None and compiled.options["dynamic"] is True:
        dyn = _capture(compiled, None, (args, kwargs), None)
    elif dyn is None or (dyn.dims is not None and any(c - d for c, d in zip(changed, dyn.dims))):
        if not any(changed):
            return None  # the example's sizes: the static capture
        dims = [c | d for c, d in zip(changed, dyn.dims)] if dyn is not None else changed
        # export needs a dynamic dim's example size to be >= 2: take the call whose changed sizes are
        small = any(isinstance(x, torch.Tensor) and any(x.shape[d] < 2 for d in ds) for x, ds in zip(leaves, dims))
        dyn = _capture(compiled, dims, (compiled._args, compiled._kwargs) if small else (args, kwargs), dyn)
    if dyn is False:
        return None
    try:
        return dyn.specialization(leaves)
    except NotInstantiable as e:
        dyn.why_not.append(str(e))
        return None


def _capture(compiled, dims, example, previous):
    """A new DynamicSizes for `compiled` with `dims` dynamic (None: all), stored on it; previous's if it fails."""
    try:
        dyn = DynamicSizes(export_symbolic(compiled.model, example[0], example[1], dims), compiled.options, dims)
    except CaptureError as e:
        compiled._dynamic_why = str(e)
        dyn = previous if previous is not None else False
        if previous is not None:
            previous.dims = dims  # not tried again: inputs it cannot bind are captured for their sizes
    if previous is not None and dyn is not previous:
        dyn.why_not, dyn.first_plan = previous.why_not, previous.first_plan
    compiled._dynamic = dyn
    return dyn


def backend_runner(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict):
    """The torch.compile backend's callable for a graph with symbolic sizes: one specialization per size.

    Returns a function of the boxed inputs (tensors and SymInt values as ints) -> flat outputs
    including non-tensor ones, or None when the graph cannot be instantiated.
    """
    shape_env = None
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            shape_env = x.node.shape_env
        elif isinstance(x, torch.Tensor) and getattr(x, "fake_mode", None) is not None:
            shape_env = x.fake_mode.shape_env
        if shape_env is not None:
            break
    ranges = dict(shape_env.var_to_range) if shape_env is not None else {}
    try:
        dyn = DynamicSizes(SymbolicGraph(gm, ranges=ranges), options)
    except CaptureError:
        return None
    specs: OrderedDict[tuple, Any] = OrderedDict()  # the most recently used max_specializations sizes
    # threads calling at once (dynamo runs the compiled graph outside its lock): the table under `table`; new sizes
    # specialized one at a time, as Compiled does under CAPTURE_LOCK (a DynamicSizes is not thread-safe: its probe
    # memo dropped answers while another thread's lowering read them, a KeyError)
    table, building = threading.Lock(), threading.Lock()

    def run(args: list) -> list:
        key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        with table:
            spec = specs.get(key)
            if spec is not None:
                specs.move_to_end(key)
        if spec is None:
            with building:
                with table:
                    spec = specs.get(key)  # another thread made it while this one waited
                if spec is None:
                    spec = dyn.specialization(list(args))
                    with table:
                        specs[key] = spec
                        while len(specs) > options["max_specializations"]:
                            specs.popitem(last=False)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        flat = spec.executor(tensors)
        consts = spec.graph.meta["output_consts"]
        it = iter(flat)
        return [consts[i] if i in consts else next(it) for i in range(len(flat) + len(consts))]

    run.dynamic = dyn  # type: ignore[attr-defined]
    run.specializations = specs  # type: ignore[attr-defined]
    return run
