"""The ``torch.compile`` backend ``"vtc"``: dynamo graph -> ATen (aot_autograd) -> vtc Graph.

Dynamo hands each captured subgraph (graph breaks split a model into several)
to the backend as an FX graph of torch-level calls.  ``aot_autograd`` lowers it
to core ATen (``core_aten_decompositions``); its forward/inference graph, whose
placeholders are the parameters followed by the user inputs, goes through
``graph_from_fx`` (every placeholder an ``input`` Value) and then
``vtc.compiler.compile_graph``.  A graph with symbolic sizes (dynamo makes one
when a second shape arrives) runs through ``vtc.dynamic.backend_runner``: one
specialization per size, with size-generic kernels, compiled at its first call.
Backward graphs run eagerly.  A subgraph that vtc cannot represent (non-tensor
results) runs eagerly with a warning.  aot_autograd calls the forward compiler
with its FakeTensorMode still active: vtc compiles outside it
(``unset_fake_temporarily``), since the planner and the machine figures run real
torch ops (a fake ``nonzero`` raised, and dynamo then ran the whole graph eagerly
after splitting it up, minutes on a 4-layer Llama).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from vtc.frontend import decomp
from vtc.frontend.torch_export import CaptureError, graph_from_fx
from vtc.ir.graph import Graph


def _compile_graph(graph: Graph) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from vtc.compiler import compile_graph  # late: vtc.compiler imports this package

    with unset_fake_temporarily(), torch._guards.tracing(None):  # real tensors for the planner's probes and the
        return compile_graph(graph)  # machine figures; no dynamo context for the captures those figures make


def compile_fx(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """aot_autograd's forward compiler: an ATen GraphModule -> a boxed callable running it with vtc."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the graph's tensor constants (a literal in forward) are real tensors
        return _compile_fx(gm, example_inputs)


def _compile_fx(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
    if any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
            isinstance(d, torch.SymInt) for d in x.shape)) for x in example_inputs):
        from vtc.compiler import OPTIONS
        from vtc.dynamic import backend_runner

        run = backend_runner(gm, example_inputs, dict(OPTIONS))
        if run is not None:
            run._boxed_call = True  # type: ignore[attr-defined]
            return run
    try:
        graph = graph_from_fx(gm)
    except CaptureError as e:
        warnings.warn(f"vtc: running a subgraph eagerly: {e}", stacklevel=2)
        return make_boxed_func(gm.forward)
    fn = _compile_graph(graph)
    consts = graph.meta["output_consts"]
    n_out = len(graph.outputs) + len(consts)

    def run(args: list) -> list:
        flat = fn(list(args))
        args.clear()  # boxed calling convention: let the inputs be freed
        it = iter(flat)
        return [consts[i] if i in consts else next(it) for i in range(n_out)]

    run._boxed_call = True  # type: ignore[attr-defined]
    run.vtc_graph = graph  # type: ignore[attr-defined]
    return run


def _eager(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
    return make_boxed_func(gm.forward)


vtc_backend = aot_autograd(
    fw_compiler=compile_fx,
    bw_compiler=_eager,
    decompositions=decomp.core_aten_decompositions,  # called lazily by aot_autograd
)

if "vtc" not in torch._dynamo.backends.registry._COMPILER_FNS:
    torch._dynamo.register_backend(vtc_backend, name="vtc")
