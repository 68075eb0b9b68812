"""The fast capture (one make_fx trace) gives torch.export's graph, and refuses what it does not handle."""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from vtc.frontend import core_export, fx_capture
from vtc.frontend.torch_export import CaptureError, export_graph, flatten_inputs, graph_from_fx
from vtc.ir.graph import Graph, Value
from vtc.runtime.reference import run_graph

from .capture_checks import check_capture, random_like
from .test_core_export import MODELS, _canonical_text, _graph_of, _llama


def _fast_graph(model, args, kwargs=None) -> Graph:
    gm, weights, in_spec, out_spec, consts = fx_capture.capture(model, args, kwargs)
    graph = graph_from_fx(gm, weights, in_spec, out_spec)
    graph.meta["input_consts"] = consts
    return graph


def _as_fast_capture_makes_it(graph: Graph) -> Graph:
    """torch.export's graph as the fast capture makes it: a clone without memory format (eval-mode dropout) and
    an alias are their input, and a tensor tied to two names (an LM head and its embedding) is one const."""
    first: dict[int, object] = {}
    alias: dict[str, object] = {}
    consts = []
    for v in graph.consts:
        kept = first.setdefault(v.data.data_ptr(), v)
        if kept is v:
            consts.append(v)
        alias[v.name] = kept
    nodes = []
    for n in graph.nodes:
        source = n.inputs[0] if n.inputs else None
        if (n.op == "aten.clone.default" and not n.kwargs and source.kind != "const") or n.op == "aten.alias.default":
            alias[n.outputs[0].name] = alias.get(source.name, source)
            continue
        n.args, n.kwargs = pytree.tree_map(lambda a: alias.get(a.name, a) if isinstance(a, Value) else a,
                                           (n.args, n.kwargs))
        nodes.append(n)
    outputs = [alias.get(v.name, v) for v in graph.outputs]
    return Graph(graph.inputs, consts, nodes, outputs, graph.in_spec, graph.out_spec, graph.meta)


def _consts_in_one_order(graph: Graph, model: torch.nn.Module) -> Graph:
    """Consts other than parameters and buffers (lifted constants) after those, by shape and values."""
    state = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    lifted = sorted((v for v in graph.consts if v.data.data_ptr() not in state),
                    key=lambda v: (v.shape, v.data.flatten()[:8].tolist()))
    graph.consts = [v for v in graph.consts if v.data.data_ptr() in state] + lifted
    return graph


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fast_capture_gives_torch_exports_graph(name):
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    model.eval()
    fast = _fast_graph(model, args, kwargs)
    with torch.no_grad():
        exported = _graph_of(core_export.one_pass(model, args, kwargs))
    assert fast.in_spec == exported.in_spec and fast.out_spec == exported.out_spec
    assert [v.name for v in fast.inputs] == [v.name for v in exported.inputs]  # named after forward's parameters
    expected = _canonical_text(_consts_in_one_order(_as_fast_capture_makes_it(exported), model), model)
    assert _canonical_text(_consts_in_one_order(fast, model), model) == expected


def test_export_graph_takes_the_fast_capture_and_matches_eager():
    torch.manual_seed(0)
    model, args, _ = _llama()
    graph = check_capture(model, args)  # every check of the frontend, eager comparison on fresh inputs
    assert graph.meta["capture"] == fx_capture.CAPTURE
    assert {v.name for v in graph.consts} >= {"p_model_embed_tokens_weight", "b_model_rotary_emb_inv_freq"}
    model, args, kwargs = MODELS["mixed"]()
    model.eval()
    graph = export_graph(model, args, kwargs)
    assert graph.meta["capture"] == fx_capture.CAPTURE
    fresh_args, fresh_kwargs = (random_like(args[0]),), {"scale": random_like(kwargs["scale"])}
    with torch.no_grad():
        expected = model(*fresh_args, **fresh_kwargs)
    got = run_graph(graph, flatten_inputs(graph, fresh_args, fresh_kwargs))[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


class _BufferAddsInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x):
        self.count.add_(1)
        return x * self.count


class _BufferReassigned(_BufferAddsInPlace):
    def forward(self, x):
        self.count = self.count + 1
        return x * self.count


class _InputAddsInPlace(torch.nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2


class _AttributeAssigned(torch.nn.Module):
    def forward(self, x):
        self.last = x * 2
        return self.last + 1


class _ConstantAddsInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.ones(3)  # a plain tensor attribute, not a buffer

    def forward(self, x):
        self.table.add_(1)
        return x * self.table


@pytest.mark.parametrize("model", [_BufferAddsInPlace(), _BufferReassigned(), _AttributeAssigned(),
                                   _ConstantAddsInPlace()], ids=lambda m: type(m).__name__)
def test_state_mutation_is_refused_and_left_to_torch_export(model):
    x = torch.randn(2, 3)
    before = {k: v.clone() for k, v in [*model.named_buffers(), *vars(model).items()]
              if isinstance(v, torch.Tensor)}
    with pytest.raises(fx_capture.Refused):
        fx_capture.capture(model, (x,), None)
    after = {k: v for k, v in [*model.named_buffers(), *vars(model).items()] if isinstance(v, torch.Tensor)}
    assert set(after) == set(before) and not hasattr(model, "last")  # the model is left as it was
    for k, v in after.items():
        assert type(v) is torch.Tensor and torch.equal(v, before[k]), k
    try:
        graph = export_graph(model, (x,))
    except CaptureError:
        return  # torch.export's answer: state mutation is not supported
    assert graph.meta["capture"] != fx_capture.CAPTURE and graph.meta["fast_capture_refused"]
    with torch.no_grad():
        expected = type(model)()(x.clone())
    torch.testing.assert_close(run_graph(graph, [x.clone()])[0], expected)


def test_an_input_changed_in_place_becomes_an_output_written_back():
    """(Refused before, like the model's own state.)  The user's input is the caller's: the graph returns its new
    value and the compiled call writes it back (tests/frontend/test_input_mutation.py)."""
    gm, _, _, _, _ = fx_capture.capture(_InputAddsInPlace(), (torch.randn(2, 3),), None)
    assert gm.meta["input_mutations"] == (0,)
    assert not [nd for nd in gm.graph.nodes if nd.op == "call_function" and nd.target._schema.is_mutable]


def test_data_dependent_control_flow_is_refused():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x - 1

    with pytest.raises(fx_capture.Refused, match="data-dependent|Data dependent|GuardOnDataDependent"):
        fx_capture.capture(Branchy(), (torch.randn(3),), None)


def test_non_tensor_inputs_are_specialised_like_torch_export():
    def fn(x, *, k: int, mode: str = "add"):
        return x + k if mode == "add" else x * k

    graph = export_graph(fn, (torch.randn(2, 3),), {"k": 3, "mode": "mul"})
    assert graph.meta["capture"] == fx_capture.CAPTURE
    x = torch.randn(2, 3)
    torch.testing.assert_close(run_graph(graph, flatten_inputs(graph, (x,), {"k": 3, "mode": "mul"}))[0], x * 3)
    with pytest.raises(ValueError, match="was 3 when captured, received 4"):
        flatten_inputs(graph, (x,), {"k": 4, "mode": "mul"})
    with pytest.raises(fx_capture.Refused, match="non-tensor inputs of types"):
        fx_capture.capture(torch.nn.Identity(), (x, [object()]), None)


_OUTSIDE = torch.ones(3)  # a real tensor outside the module tree


class _OutsideTensorAddsInPlace(torch.nn.Module):
    def forward(self, x):
        _OUTSIDE.add_(1)
        return x * _OUTSIDE


def test_a_real_tensor_from_outside_the_model_is_refused():
    """(The trace, like torch.export's, still applies the in-place op to that tensor once: known, not fixed.)"""
    with pytest.raises(fx_capture.Refused, match="FakeTensor"):
        fx_capture.capture(_OutsideTensorAddsInPlace(), (torch.randn(2, 3),), None)


@pytest.mark.parametrize("how", ["method", "partial"])
def test_a_forward_replaced_on_the_instance_takes_the_fast_capture_and_leaves_the_module_as_it_was(how):
    import functools
    import types

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.l(x)

    def scaled(mod, x):
        return mod.l(x) * 3

    torch.manual_seed(7)
    m = M().eval()
    m.forward = types.MethodType(scaled, m) if how == "method" else functools.partial(scaled, m)
    before = (m.forward, m.l, m.l.weight)
    x = torch.randn(4, 8)
    graph = export_graph(m, (x,))
    assert graph.meta["capture"] == fx_capture.CAPTURE  # was: bound to the module, not its copy: torch.export
    torch.testing.assert_close(run_graph(graph, [x])[0], m(x))
    assert (m.forward, m.l, m.l.weight) == before and type(m.l.weight) is torch.nn.Parameter


class _Pooled(torch.nn.Module):
    """Swin's head: layer norm, then ``AdaptiveAvgPool1d(1)`` over the tokens, whose decomposition leaves an
    ``as_strided_`` on its mean after functionalization."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.pool = torch.nn.AdaptiveAvgPool1d(1)

    def forward(self, x):
        y = self.norm(x)
        return y, torch.flatten(self.pool(y.transpose(1, 2)), 1)


def test_an_in_place_view_of_a_computed_tensor_takes_the_fast_capture_as_torch_export_captures_it():
    """(Refused before as state mutation, so torch.export captured Swin-T: a second, slower trace.)"""
    torch.manual_seed(0)
    model, x = _Pooled().eval(), torch.randn(1, 8, 16)
    fast = _fast_graph(model, (x,))
    with torch.no_grad():
        exported = _graph_of(core_export.one_pass(model, (x,), None))
    assert "aten.as_strided.default" in [n.op for n in fast.nodes]
    assert _canonical_text(fast, model) == _canonical_text(_as_fast_capture_makes_it(exported), model)
    graph = check_capture(model, (x,))  # eager comparison on fresh inputs
    assert graph.meta["capture"] == fx_capture.CAPTURE


class _InputTransposedInPlace(torch.nn.Module):
    def forward(self, x):
        x.t_()
        return x + 1


def test_an_in_place_view_of_an_input_is_still_refused():
    with pytest.raises(fx_capture.Refused, match="state mutation"):
        fx_capture.capture(_InputTransposedInPlace(), (torch.randn(2, 3),), None)
