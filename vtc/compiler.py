"""The public entry points: ``vtc.compile`` and the ``Compiled`` object it returns.

The pipeline, as named stages::

    capture (torch.export -> graph IR) -> plan (which tensors are virtual)
      -> schedule (executor steps, liveness) -> report

``Compiled`` keeps one specialisation per input shape signature: a call with
new sizes of the same rank is an instantiation of a symbolic capture whose
kernels take the sizes that vary as arguments (``vtc.dynamic``: no tracing and
no C++ compiler run once the symbolic graph exists); inputs it does not fit
are captured again for their sizes.  Inputs are checked
against the graph: their number, dtypes and ranks, with expected and received
values in the error.
"""
from __future__ import annotations

import functools
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from vtc.codegen.gemm import GEMM_MODES
from vtc.frontend.torch_export import (CAPTURE_LOCK, CaptureError, ConstantInputChanged, InputShapeError, export_graph,
                                      flatten_inputs, mutation_guard, takes_a_cache, unflatten_outputs,
                                      update_caches_in_place)
from vtc.ir.fold import fold_constants
from vtc.ir.graph import Graph
from vtc.plan.planners import OBJECTIVES, make_plan
from vtc.plan.report import Report, build_report
from vtc.plan.virtualize import Plan
from vtc.runtime.callplan import MISS, fast_call
from vtc.runtime.executor import Executor
from vtc.runtime.reference import check_inputs
from vtc.runtime.weights import watch as watch_parameters

PLANS = ("greedy", "all", "none", "measured")  # vtc.plan.planners.make_plan makes each one
OPTIONS = {"plan": "greedy", "backend": "cpu", "oracle": False, "max_specializations": 8,
           "objective": "latency", "max_slowdown": 0.05, "measure_budget_s": None, "gemm": "auto",
           "push": True, "dynamic": None}  # dynamic: None (symbolic from the first new size on), True, False
BACKENDS = ("torch", "cpu")


@dataclass
class Specialization:
    """A graph captured for one input shape signature, planned and scheduled."""

    graph: Graph
    plan: Plan
    executor: Executor
    report: Report

    @functools.cached_property
    def guard(self) -> Callable[[list[torch.Tensor]], None] | None:
        """The test of a call's flat inputs run before its kernels where forward changes an input in place
        (``vtc.frontend.torch_export.mutation_guard``); None where it changes none."""
        return mutation_guard(self.graph)

    @functools.cached_property
    def plain_inputs(self) -> bool:
        """Whether the graph's inputs are exactly its positional tensors (no kwargs, no constants)."""
        graph = self.graph
        spec = pytree.tree_structure(((torch.empty(0),) * len(graph.inputs), {}))
        return graph.in_spec == spec and not graph.meta.get("input_consts")

    @functools.cached_property
    def exact_signature(self) -> tuple[tuple | None, bool]:
        """((dtype, shape) per input, None where the inputs are not plain positional tensors; whether the graph
        returns one plain output): the calls Compiled's fast call is made for.  Kept on the capture, so that a
        signature and the plan it checks the inputs of come from the same capture."""
        graph = self.graph
        inputs = tuple((v.dtype, torch.Size(v.shape)) for v in graph.inputs) if self.plain_inputs else None
        single = (len(graph.outputs) == 1 and not graph.meta.get("output_consts")
                  and not graph.meta.get("input_mutations")
                  and (graph.out_spec is None or isinstance(graph.out_spec, pytree.TreeSpec) and graph.out_spec.is_leaf()))
        return inputs, single

    @functools.cached_property
    def inputs_hold_a_cache(self) -> bool:
        """Whether the inputs hold a transformers KV cache (Compiled._caches)."""
        return takes_a_cache(self.graph.in_spec)

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's flat outputs for its flat inputs `tensors` (checked against the graph), inputs that
        forward changes in place written back: ``guard``'s test first, so that a refused call changed nothing."""
        guard = self.guard
        if guard is not None:
            guard(tensors)
        return unflatten_outputs(self.graph, self.executor(tensors), tensors)


def check_options(options: dict) -> dict:
    """Options with defaults filled in; unknown names or values raise with the valid ones."""
    bad = sorted(set(options) - set(OPTIONS))
    if bad:
        raise TypeError(f"unknown vtc.compile option(s) {bad}; valid options: {sorted(OPTIONS)}")
    out = {**OPTIONS, **options}
    if out["plan"] not in PLANS:
        raise ValueError(f"plan={out['plan']!r} is not one of {sorted(PLANS)}")
    if out["backend"] not in BACKENDS:
        raise ValueError(f"backend={out['backend']!r} is not one of {list(BACKENDS)}")
    if out["gemm"] not in GEMM_MODES:
        raise ValueError(f"gemm={out['gemm']!r} is not one of {list(GEMM_MODES)}")
    if out["objective"] not in OBJECTIVES:
        raise ValueError(f"objective={out['objective']!r} is not one of {list(OBJECTIVES)}")
    if out["objective"] != "latency" and out["plan"] in ("all", "none"):
        raise ValueError(f"objective={out['objective']!r} needs plan='greedy' or 'measured', not "
                         f"plan={out['plan']!r}")
    for name in ("max_slowdown", "measure_budget_s"):
        x = out[name]
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0):
            raise ValueError(f"{name}={x!r} must be a number >= 0")
    if out["dynamic"] not in (None, True, False):
        raise ValueError(f"dynamic={out['dynamic']!r} is not one of None, True, False")
    if not isinstance(out["push"], bool):
        raise ValueError(f"push={out['push']!r} must be True or False")
    if out["oracle"]:
        out["backend"] = "torch"  # the oracle realises every virtual tensor by a gather, outside kernels
    return out


def specialize(graph: Graph, options: dict, plan: Plan | None = None, kernel_builder=None) -> Specialization:
    """Plans (for the backend that runs the plan) and schedules a captured graph.

    `plan` replaces the planner's; `kernel_builder` the executor's kernel build (size-generic kernels).
    """
    if plan is None and kernel_builder is None:  # not the size-generic path, whose plans are replayed by node name
        graph = fold_constants(graph)
    plan = make_plan(graph, options) if plan is None else plan
    executor = Executor(graph, plan, oracle=options["oracle"], backend=options["backend"], gemm=options["gemm"],
                        kernel_builder=kernel_builder)
    report = build_report(graph, plan, executor)
    warn_fallbacks(report.fallback_ops)
    return Specialization(graph, plan, executor, report)


class FallbackWarning(UserWarning):
    """Ops of the model that vtc runs through the framework (torch or onnxruntime), not generated kernels."""


class NewSizesWarning(UserWarning):
    """A compiled model keeps being called with new input sizes, each of which costs a specialization."""


NEW_SIZES_WARN_AT = 8  # new input sizes after the example's at which Compiled warns (once)


def warn_fallbacks(ops: list[str]) -> None:
    """One FallbackWarning naming the ops vtc does not lower (shown once per distinct list of ops)."""
    if ops:
        names = sorted(set(ops))
        warnings.warn(f"vtc: {len(names)} op(s) without a generated kernel run through the framework: "
                      f"{', '.join(names)} (report.fallback_ops)", FallbackWarning, stacklevel=3)


def compile_graph(graph: Graph, **options) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """A callable running an already captured graph (flat tensors in, flat tensors out)."""
    spec = specialize(graph, check_options(options))

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        check_inputs(graph, list(inputs))
        return spec.executor(list(inputs))

    run.report = spec.report  # type: ignore[attr-defined]
    return run


class Compiled:
    """A model compiled by vtc; call it like the model."""

    def __init__(self, model: Any, example_inputs: tuple, example_kwargs: dict | None, options: dict,
                 _graph: Graph | None = None) -> None:
        self.model = model
        self.options = check_options(options)
        self._fast: Callable | None = None  # the call for inputs of _first.exact_signature (callplan.fast_call)
        self._specs: OrderedDict[tuple, Specialization] = OrderedDict()
        self._lock = threading.Lock()
        self._dynamic = None  # vtc.dynamic.DynamicSizes once sizes have varied; False when it cannot be captured
        self._new_sizes = 0  # specializations made after the first (NewSizesWarning)
        self._args, self._kwargs = _as_args(example_inputs), dict(example_kwargs or {})
        if _graph is not None:
            self._first = specialize(_graph, self.options)
            self._specs[_signature(self._args, self._kwargs)] = self._first
        else:
            self._first = self._specialize(self._args, self._kwargs)
        # the module's tensors the graph holds, tested per call for being replaced (vtc.runtime.weights)
        self._watch = watch_parameters(model, self._first.graph)

    def replan(self, **options) -> "Compiled":
        """The same captured graph compiled with other options (no new capture)."""
        merged = {**self.options, **options}
        if merged["plan"] in ("all", "none") and "objective" not in options:
            merged["objective"] = "latency"  # the objective is the cost-driven planners' (replan(plan="none"))
        return Compiled(self.model, self._args, self._kwargs, merged, _graph=self.graph)

    @property
    def report(self) -> Report:
        """The report of the graph captured from the example inputs."""
        return self._first.report

    @property
    def graph(self) -> Graph:
        """The graph captured from the example inputs."""
        return self._first.graph

    def _specialize(self, args: tuple, kwargs: dict) -> Specialization:
        key = _signature(args, kwargs)
        with self._lock:
            spec = self._specs.get(key)
            if spec is not None:
                self._specs.move_to_end(key)
                return spec
        with CAPTURE_LOCK:  # a capture swaps the module's tensors for fakes while it traces: one at a time
            with self._lock:
                spec = self._specs.get(key)  # another thread made it while this one waited
            if spec is not None:
                return spec
            if self.options["dynamic"] is not False and self.options["backend"] == "cpu":
                from vtc.dynamic import dynamic_specialization

                spec = dynamic_specialization(self, args, kwargs)  # None: these sizes need their own capture
            if spec is None:
                spec = specialize(self._capture(args, kwargs), self.options)
            with self._lock:
                self._new_sizes += bool(self._specs)  # the example's own is the first
                self._specs[key] = spec
                while len(self._specs) > self.options["max_specializations"]:
                    self._specs.popitem(last=False)
            if self._new_sizes == NEW_SIZES_WARN_AT:
                warnings.warn(
                    f"vtc: {type(self.model).__name__} has been called with {NEW_SIZES_WARN_AT} new input sizes; each "
                    "costs a specialization (planning and lowering, no C++ compile; ~50 ms for a 4-layer Llama). A "
                    "decode loop whose KV cache grows every step does this every step: transformers' StaticCache keeps "
                    "the sizes fixed (vtc updates it in place).", NewSizesWarning, stacklevel=3)
        return spec

    def _capture(self, args: tuple, kwargs: dict) -> Graph:
        """The graph captured for these inputs; InputShapeError (a ValueError) naming the dims that differ from
        the example's when the model was captured with the example and cannot be with these."""
        try:
            return export_graph(self.model, args, kwargs)
        except CaptureError as e:
            if not self._specs:
                raise  # the example inputs themselves
            graph = self._first.graph
            try:
                tensors = flatten_inputs(graph, args, kwargs)
            except Exception:  # noqa: BLE001 - the inputs' structure differs: the capture's error says more
                raise e from None
            diffs = []
            for i, (v, t) in enumerate(zip(graph.inputs, tensors)):
                dims = [d for d in range(min(t.dim(), len(v.shape))) if t.shape[d] != v.shape[d]]
                if dims:
                    what = ", ".join(f"dim {d} is {t.shape[d]}, expected {v.shape[d]}" for d in dims)
                    diffs.append(f"input {i} (%{v.name}): {what} (compiled for shape {list(v.shape)}, "
                                 f"received {list(t.shape)})")
            if not diffs:
                raise
            refused = getattr(e, "refused", "")  # the fast capture's trace error, with the concrete sizes
            cause = e.__cause__ if e.__cause__ is not None else e
            why = refused if refused.count(":") else f"{type(cause).__name__}: {cause}"
            lines = [ln.strip() for ln in why.strip().splitlines() if ln.strip()]
            raise InputShapeError(f"{'; '.join(diffs)}; the model does not run with the new sizes: "
                                  f"{lines[0] if lines else ''}") from e

    def refresh(self) -> "Compiled":
        """Captures the model again from its tensors as they are now (the kernels come from the cache on disk).

        A parameter replaced after compiling (``p.data = t``, ``module.to(...)``, ``load_state_dict(...,
        assign=True)``) is seen by the next call without this; a write through ``p.data`` in place
        (``p.data.mul_(2)``), which moves no version counter of ``p``, is not seen by the weights packed or
        folded at compile time: call ``refresh()`` after one (README)."""
        self._restart(self._args, self._kwargs, "refresh() was called")
        return self

    def _restart(self, args: tuple, kwargs: dict, why: str, stale=None) -> None:
        """Drops every specialization and captures the model again for `args` (they become the example).

        `stale`: the parameter watch that saw the change; when another thread has captured again since (the watch
        is no longer it), nothing is left to do."""
        with CAPTURE_LOCK:
            if stale is not None and self._watch is not stale:
                return
            with self._lock:
                self._specs.clear()
                self._fast, self._dynamic = None, None
                self._new_sizes = 0
            self._args, self._kwargs = args, dict(kwargs)  # the example now: a static capture, not vtc.dynamic's
            try:
                first = self._specialize(args, kwargs)
            except CaptureError as e:
                raise CaptureError(f"vtc: {why} since compiling, so the model is captured again, which "
                                   f"failed: {e}") from e
            watch = watch_parameters(self.model, first.graph)
            with self._lock:  # one step for the threads that call meanwhile (__call__'s snapshot)
                self._first, self._watch = first, watch
                self._fast = None

    def __call__(self, *args, **kwargs):
        fast = self._fast
        if fast is not None and not kwargs:  # the captured dtypes and shapes: nothing to check or flatten
            out = fast(args)  # MISS too where a parameter was replaced (the watch's test is its first line)
            if out is not MISS:
                return out
        watch = self._watch
        if watch is not None and watch.changed():  # a parameter replaced since the capture: capture again
            self._restart(args, kwargs, watch.why(), stale=watch)
        with self._lock:  # one capture's graph, plan and watch, though another thread may capture again
            first, watch = self._first, self._watch
        inputs, single = first.exact_signature
        if self._fast is None and not kwargs and _exact(inputs, args):  # the first such call: the fast call
            graph = first.graph
            post = None if single else (lambda outs, args: unflatten_outputs(graph, outs, args))
            plan, guard = first.executor.call_plan(), first.guard
            fast = fast_call(plan, inputs, post, watch, guard)[0]
            with self._lock:
                if self._first is first:  # (else the model was captured again meanwhile: its own fast call)
                    self._fast = fast
            if guard is not None:
                guard(args)
            outs = plan(args, checked=True)
            return outs[0] if single else post(outs, args)
        graph = first.graph
        if (not kwargs and first.plain_inputs and len(args) == len(graph.inputs)
                and all(type(a) is torch.Tensor for a in args)):
            tensors = list(args)  # what flatten_inputs returns for plain positional tensors, without pytree
        else:
            try:
                tensors = flatten_inputs(graph, args, kwargs)
            except ConstantInputChanged:  # a new value of a non-tensor input: a capture of its own
                spec = self._specialize(args, kwargs)
                tensors = flatten_inputs(spec.graph, args, kwargs)
                check_inputs(spec.graph, tensors, exact_shape=False)
                return _caches(spec, args, kwargs, spec.run(tensors))
        check_inputs(graph, tensors, exact_shape=False)
        spec = first
        if any(tuple(t.shape) != v.shape for t, v in zip(tensors, graph.inputs)):
            spec = self._specialize(args, kwargs)
        return _caches(spec, args, kwargs, spec.run(tensors))

    def __repr__(self) -> str:
        return f"<vtc.Compiled {type(self.model).__name__}: {self.report.summary()}>"


def _as_args(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def _signature(args: tuple, kwargs: dict) -> tuple:
    flat, _ = pytree.tree_flatten((args, kwargs))
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in flat)


def compile(model_or_fn: Any, example_inputs: Any = (), example_kwargs: dict | None = None, **options) -> Compiled:
    """Compiles a torch module or function for these example inputs; returns a callable Compiled.

    Options: plan="greedy" (default: the cost-model planner keeps a movement op
    physical where that is estimated cheaper, see ``vtc analyze --explain``),
    "measured" (the greedy, then every uncertain choice timed both ways within
    measure_budget_s seconds, default 5), "all" (every movement op virtual) or
    "none" (ablation: every movement op materialised); objective="latency"
    (default) or "memory" (the lowest peak memory whose estimated latency is
    at most max_slowdown, default 0.05, over the latency plan's; greedy and
    measured only); backend="cpu" (generated C++ kernels, default)
    or "torch" (compute through torch, virtual tensors realised by views and
    gathers); oracle=True (torch backend, every virtual tensor realised by a
    gather through its composed mapping: a check of the mappings);
    gemm="auto" (default: a GEMM whose operand is a virtual tensor that is not
    a strided view runs as a generated kernel packing it through its mapping,
    the others through torch on zero-copy views), "vtc" (every float32 GEMM
    generated) or "torch" (every GEMM through torch, and no fused attention
    kernel, whose matmuls are its own); the choice per GEMM node
    and both estimated costs are in ``report.to_dict()["gemm"]``; push=True
    (default; backend="cpu") lets a cat or scatter be removed on the write
    side, its inputs stored into its output by the kernels that compute them
    (``vtc.codegen.push``), push=False reads every removed op through its pull
    mapping; dynamic=None (default: static sizes until a call brings new ones, then a
    symbolic capture whose kernels take the sizes as arguments, ``vtc.dynamic``),
    True (symbolic from the start) or False (capture and build again per size).

    An ONNX model (a path ending in ``.onnx`` or an ``onnx.ModelProto``) goes to
    ``vtc.frontend.onnx.compile_onnx`` (``dims={name: size}`` resolves symbolic
    dims when no example inputs are given) and returns an ``OnnxCompiled``.
    """
    import os

    is_path = isinstance(model_or_fn, (str, os.PathLike))
    if (is_path and os.fspath(model_or_fn).lower().endswith(".onnx")) or type(model_or_fn).__name__ == "ModelProto":
        from vtc.frontend.onnx import compile_onnx

        # ONNX: example inputs positionally (tuple/list) or by name (a dict, or example_kwargs)
        empty = example_inputs is None or (isinstance(example_inputs, (tuple, list)) and len(example_inputs) == 0)
        examples = (example_kwargs or None) if empty else example_inputs
        return compile_onnx(model_or_fn, examples, **options)
    if is_path or isinstance(model_or_fn, (bytes, bytearray)):
        raise TypeError(f"vtc.compile takes a torch module or function, or an ONNX model (a path ending in "
                        f".onnx or an onnx.ModelProto); received {type(model_or_fn).__name__} {model_or_fn!r:.80}")
    return Compiled(model_or_fn, example_inputs, example_kwargs, options)


def _caches(spec: Specialization, args: tuple, kwargs: dict, result: Any) -> Any:
    """`result`, where the inputs hold a transformers KV cache, with the returned cache written into the one
    given and returned as that object, as eager does (``update_caches_in_place``)."""
    return update_caches_in_place(args, kwargs, result) if spec.inputs_hold_a_cache else result


def _exact(inputs: tuple | None, args: tuple) -> bool:
    """Whether args are plain positional tensors of exactly the (dtype, shape)s `inputs` (a capture's
    ``exact_signature``; None: never).

    The common call, checked in one pass (the per-call Python cost of a small graph is
    microseconds, next to a kernel of tens of them); anything else takes the full path."""
    if inputs is None or len(args) != len(inputs):
        return False
    for t, (dt, shape) in zip(args, inputs):  # a loop: a third faster than all() over a generator
        if type(t) is not torch.Tensor or t.dtype != dt or t.shape != shape or not t.is_cpu:
            return False
    return True
