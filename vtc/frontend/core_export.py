"""torch.export straight to core ATen in one trace (what ``export(...).run_decompositions()`` gives in two).

``torch.export.export(strict=False)`` traces the model into the training IR
(pre-dispatch ATen); ``run_decompositions()`` then traces that graph a second
time through aot_autograd with torch's core-ATen decomposition table.  Each
trace runs every op on fake tensors under functionalization, so the two cost
about the same, and on a 4-layer Llama the pair is most of vtc's warm compile.

``export_core_aten`` traces once: torch.export's own non-strict entry
(``torch.export._trace._export`` with ``pre_dispatch=False``, the aot_autograd
trace) with the same decomposition table that ``run_decompositions()`` uses,
split the way it splits it (CompositeImplicitAutograd overrides plumbed
through ``_override_composite_implicit_decomp``, the rest handed to the
trace as its ``decomp_table``).  The graph is the two-pass graph without its
``_assert_tensor_metadata`` nodes, which vtc drops anyway, and up to node
names (``tests/frontend/test_core_export.py`` compares the two on several
models).  One op escapes the table in a single trace: the tracer records the
``lift_fresh_copy`` of a tensor made in ``forward`` (``torch.tensor(...)``)
without decomposing it; it becomes the ``clone`` that the second trace makes
of it.

These are torch-private entry points (torch is pinned, see pyproject.toml):
when one is missing, or the one-pass trace raises, the documented two-pass
path runs instead; ``graph.meta["capture"]`` says which one made the graph.
The one trace needs ``_export``'s choice of ``_export_to_aten_ir`` to carry the
table: that module attribute is swapped for the duration of the call, under a
lock (torch.export itself keeps module globals and is not reentrant).
"""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

import torch

from vtc.frontend import decomp

ONE_PASS = "torch.export to core ATen in one trace"
TWO_PASS = "torch.export + run_decompositions"
_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _private() -> tuple | None:
    """(torch.export._trace, torch.export.exported_program, the original _export_to_aten_ir) when the
    one-pass entry points exist with the parameters used here, else None."""
    try:
        from torch.export import _trace, exported_program
    except ImportError:
        return None
    names = [(_trace, "_export"), (_trace, "_export_to_aten_ir"),
             (exported_program, "_split_decomp_table_to_cia_and_python_decomp"),
             (exported_program, "_override_composite_implicit_decomp"), (exported_program, "default_decompositions")]
    if not all(callable(getattr(m, n, None)) for m, n in names):
        return None
    try:
        params = inspect.signature(_trace._export_to_aten_ir).parameters
        export_params = inspect.signature(_trace._export).parameters
    except (TypeError, ValueError):
        return None
    if "decomp_table" not in params or "pre_dispatch" not in export_params or "strict" not in export_params:
        return None
    return _trace, exported_program, _trace._export_to_aten_ir


@functools.lru_cache(maxsize=1)
def _tables() -> tuple[dict, dict]:
    """torch's default core-ATen table split as run_decompositions splits it: (CIA overrides, the rest).

    Computed once per process (run_decompositions computes it per call: a quarter of a second); vtc's
    overrides (``vtc.frontend.decomp``) in place."""
    _, ep_mod, _ = _private()
    table = decomp.with_overrides(ep_mod.default_decompositions().materialize())
    return ep_mod._split_decomp_table_to_cia_and_python_decomp(dict(table))


def two_pass(model: torch.nn.Module, args: tuple, kwargs: dict | None) -> torch.export.ExportedProgram:
    """The documented path: ``torch.export.export(strict=False).run_decompositions()`` (with vtc's overrides)."""
    return torch.export.export(model, args, kwargs, strict=False).run_decompositions(decomp.export_decompositions())


def one_pass(model: torch.nn.Module, args: tuple, kwargs: dict | None) -> torch.export.ExportedProgram:
    """One non-strict aot_autograd trace of `model` with the core-ATen decompositions (raises when the
    private entry points are missing)."""
    private = _private()
    if private is None:
        raise RuntimeError("torch.export's one-pass entry points are not there in torch " + torch.__version__)
    trace, ep_mod, to_aten_ir = private
    cia, rest = _tables()
    with _lock:
        trace._export_to_aten_ir = functools.partial(to_aten_ir, decomp_table=rest)
        try:
            with ep_mod._override_composite_implicit_decomp(cia):
                ep = trace._export(model, args, kwargs, strict=False, pre_dispatch=False)
        finally:
            trace._export_to_aten_ir = to_aten_ir
    for n in ep.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.lift_fresh_copy.default:
            n.target = torch.ops.aten.clone.default  # what the core table makes of it (a copy)
    return ep


def export_core_aten(model: torch.nn.Module, args: tuple, kwargs: dict | None) -> tuple[Any, str]:
    """(ExportedProgram in core ATen, which path made it): one trace, else the two-pass path.

    When the one trace raises, the two-pass path runs; if that raises too, its error is the one raised
    (it is what torch.export documents)."""
    if _private() is not None:
        try:
            return one_pass(model, args, kwargs), ONE_PASS
        except Exception as e:  # noqa: BLE001 - the documented path decides whether the model exports
            why = f"{TWO_PASS} (the one trace failed: {type(e).__name__}: {str(e).strip()[:200]})"
            return two_pass(model, args, kwargs), why
    return two_pass(model, args, kwargs), TWO_PASS
