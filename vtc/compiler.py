"""The public entry points: ``vtc.compile`` and the ``Compiled`` object it returns.

The pipeline, as named stages::

    capture (torch.export -> graph IR) -> plan (which tensors are virtual)
      -> schedule (executor steps, liveness) -> report

``Compiled`` keeps one specialisation per input shape signature: a call with
new sizes of the same rank captures the model again for those sizes (a later
issue makes sizes symbolic so this needs no recompile).  Inputs are checked
against the graph: their number, dtypes and ranks, with expected and received
values in the error.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from vtc.frontend.torch_export import export_graph, flatten_inputs, unflatten_outputs
from vtc.ir.graph import Graph
from vtc.plan.report import Report, build_report
from vtc.plan.greedy import plan_greedy
from vtc.plan.virtualize import Plan, plan_all, plan_none
from vtc.runtime.executor import Executor
from vtc.runtime.reference import check_inputs

PLANS: dict[str, Callable[[Graph], Plan]] = {"all": plan_all, "none": plan_none, "greedy": plan_greedy}
OPTIONS = {"plan": "all", "backend": "cpu", "oracle": False, "max_specializations": 8}
BACKENDS = ("torch", "cpu")


@dataclass
class Specialization:
    """A graph captured for one input shape signature, planned and scheduled."""

    graph: Graph
    plan: Plan
    executor: Executor
    report: Report


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
    if out["oracle"]:
        out["backend"] = "torch"  # the oracle realises every virtual tensor by a gather, outside kernels
    return out


def specialize(graph: Graph, options: dict) -> Specialization:
    """Plans and schedules a captured graph."""
    plan = PLANS[options["plan"]](graph)
    executor = Executor(graph, plan, oracle=options["oracle"], backend=options["backend"])
    return Specialization(graph, plan, executor, build_report(graph, plan, executor))


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
        self._plain: tuple[int, bool] | None = None  # (number of inputs, captured as plain positional tensors)
        self._specs: OrderedDict[tuple, Specialization] = OrderedDict()
        self._lock = threading.Lock()
        self._args, self._kwargs = _as_args(example_inputs), dict(example_kwargs or {})
        if _graph is not None:
            self._first = specialize(_graph, self.options)
            self._specs[_signature(self._args, self._kwargs)] = self._first
        else:
            self._first = self._specialize(self._args, self._kwargs)

    def replan(self, **options) -> "Compiled":
        """The same captured graph compiled with other options (no new capture)."""
        return Compiled(self.model, self._args, self._kwargs, {**self.options, **options}, _graph=self.graph)

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
        spec = specialize(export_graph(self.model, args, kwargs), self.options)
        with self._lock:
            self._specs[key] = spec
            while len(self._specs) > self.options["max_specializations"]:
                self._specs.popitem(last=False)
        return spec

    def __call__(self, *args, **kwargs):
        graph = self._first.graph
        if not kwargs and self._plain_inputs(len(args)) and all(type(a) is torch.Tensor for a in args):
            tensors = list(args)  # what flatten_inputs returns for plain positional tensors, without pytree
        else:
            tensors = flatten_inputs(graph, args, kwargs)
        check_inputs(graph, tensors, exact_shape=False)
        spec = self._first
        if any(tuple(t.shape) != v.shape for t, v in zip(tensors, graph.inputs)):
            spec = self._specialize(args, kwargs)
        return unflatten_outputs(spec.graph, spec.executor(tensors))

    def _plain_inputs(self, n: int) -> bool:
        """Whether the captured inputs are exactly n positional tensors (no kwargs, no constants)."""
        if self._plain is None:
            graph = self._first.graph
            spec = pytree.tree_structure(((torch.empty(0),) * len(graph.inputs), {}))
            self._plain = (len(graph.inputs), graph.in_spec == spec and not graph.meta.get("input_consts"))
        return self._plain[1] and self._plain[0] == n

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

    Options: plan="all" (every movement op virtual) or "none" (ablation: every
    movement op materialised); backend="cpu" (generated C++ kernels, default)
    or "torch" (compute through torch, virtual tensors realised by views and
    gathers); oracle=True (torch backend, every virtual tensor realised by a
    gather through its composed mapping: a check of the mappings).

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
