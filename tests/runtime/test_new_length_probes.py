"""A new length of a decode loop does not probe again the op definitions of nodes whose signature did not change
(``vtc.dynamic.ProbeMemo``, read by ``vtc.codegen.lower.Lowering._probe``), nor make again the meta tensors of
shapes the previous instantiation had (``vtc.frontend.symbolic._AtSizes``); results stay those of a fresh compile.
"""
from __future__ import annotations

import pytest
import torch

import vtc
import vtc.codegen.lower as lower
import vtc.codegen.ops as ops

from .test_new_length_cost import _fresh_templates  # noqa: F401 - an autouse fixture: no template of another test

TOL = dict(rtol=1e-4, atol=1e-4)
pytestmark = pytest.mark.filterwarnings("ignore::vtc.NewSizesWarning")  # a new length per call, on purpose


def _decode(tok, past, w1, w2):
    """A token's MLP, norm and max (nothing depends on the cache length) next to attention over a cat-grown
    cache (the softmax, the scale: their shapes change with the length)."""
    h = torch.relu(tok @ w1) @ w2 + tok  # [B, 1, D]
    h = h / h.square().mean(-1, keepdim=True).add(1e-6).sqrt()
    kv = torch.cat([past, h], dim=1)  # [B, P+1, D]
    att = torch.softmax(h @ kv.transpose(1, 2) * 0.125, dim=-1) @ kv
    return (att @ w1) @ w2 + h * tok.max(), kv


def _inputs(p, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, 32, generator=g), torch.randn(2, p, 32, generator=g)


def _model(seed):
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(32, 48, generator=g) / 6, torch.randn(48, 32, generator=g) / 7
    return lambda tok, past: _decode(tok, past, w1, w2)


class _Probes:
    """Counts the op definitions run against placeholder loads (``_ProbeCtx``), per node name."""

    def __init__(self, monkeypatch):
        self.names: list[str] = []
        init = lower._ProbeCtx.__init__

        def counted(ctx, node):
            self.names.append(node.name)
            init(ctx, node)

        monkeypatch.setattr(lower._ProbeCtx, "__init__", counted)


def test_a_new_length_probes_only_the_nodes_whose_signature_changed(monkeypatch):
    """Before: every new length ran every pointwise and row node's definition again (171 probes per length of
    the 4-layer Llama, ~2.4 ms); now only the nodes whose shapes changed (here the scores' scale and softmax)."""
    fn = _model(0)
    compiled = vtc.compile(fn, _inputs(9, 0))
    for p in (10, 11, 12):  # 10: the symbolic capture, fit; 11, 12: instantiations
        compiled(*_inputs(p, p))
    probes = _Probes(monkeypatch)
    for p in (13, 14, 31):
        probes.names.clear()
        x = _inputs(p, p)
        got = compiled(*x)
        for a, b in zip(got, fn(*x)):
            torch.testing.assert_close(a, b, **TOL)
        spec = compiled._specs[next(reversed(compiled._specs))]
        kinds = sum(1 for n in spec.graph.nodes if ops.lookup(ops.POINTWISE, n.target) or ops.lookup(ops.ROW, n.target))
        probed = [n for n in probes.names if n in {m.name for m in spec.graph.nodes}]
        assert 0 < len(probed) < kinds / 2, (p, probed, kinds)
        assert not any("relu" in n or "add" in n for n in probed), probed  # the MLP's shapes did not change
    assert compiled._dynamic.probed.hits > 0
    fresh = vtc.compile(fn, _inputs(9, 0))  # no memo: bit-identical
    for a, b in zip(got, fresh(*x)):
        assert torch.equal(a, b)


def test_a_probe_answer_is_dropped_when_a_code_generator_constant_changes(monkeypatch):
    """A definition may read a module constant (``ops.EXTREME_MAX_ELEMENTS``: torch.max(x) of more elements runs
    through torch): the memo is kept only under the switches its answers were made under. With the memo kept
    regardless, the max of 64 elements would stay a generated kernel after the limit went down to 8."""
    fn = _model(1)
    compiled = vtc.compile(fn, _inputs(9, 0))
    for p in (10, 11, 12):
        compiled(*_inputs(p, p))
    spec = compiled._specs[next(reversed(compiled._specs))]
    assert not any("max" in why for why in spec.executor.lowering.why_torch.values())
    monkeypatch.setattr(ops, "EXTREME_MAX_ELEMENTS", 8)
    x = _inputs(13, 13)
    for a, b in zip(compiled(*x), fn(*x)):
        torch.testing.assert_close(a, b, **TOL)
    spec = compiled._specs[next(reversed(compiled._specs))]
    assert any("64 elements" in why for why in spec.executor.lowering.why_torch.values()), \
        spec.executor.lowering.why_torch


def test_a_not_supported_answer_is_remembered_with_its_message(monkeypatch):
    """A node left to torch by its definition (NotSupported) is left to torch at the next lengths too, for the
    same reason, without running the definition again."""
    monkeypatch.setattr(ops, "EXTREME_MAX_ELEMENTS", 8)
    fn = _model(2)
    compiled = vtc.compile(fn, _inputs(9, 0))
    for p in (10, 11, 12):
        compiled(*_inputs(p, p))
    whys = []
    probes = _Probes(monkeypatch)
    for p in (13, 14):
        x = _inputs(p, p)
        for a, b in zip(compiled(*x), fn(*x)):
            torch.testing.assert_close(a, b, **TOL)
        spec = compiled._specs[next(reversed(compiled._specs))]
        whys.append({k: v for k, v in spec.executor.lowering.why_torch.items() if "elements" in v})
        max_node = next(iter(whys[-1]))
        assert max_node not in probes.names
    assert whys[0] == whys[1] and len(whys[0]) == 1


def test_the_memo_holds_the_answers_of_the_last_two_lengths_only():
    """A node whose shapes change at every length adds a key per length: rotate() keeps the memo from growing."""
    fn = _model(3)
    compiled = vtc.compile(fn, _inputs(9, 0))
    sizes = []
    for p in range(10, 18):
        compiled(*_inputs(p, p))
        memo = compiled._dynamic.probed
        sizes.append(len(memo.answers))
    assert max(sizes[3:]) == min(sizes[3:]), sizes


def test_an_instantiation_takes_the_previous_ones_meta_tensors_and_gives_the_same_graph():
    """The meta tensors (shape, dtype) of a symbolic graph's nodes at the sizes are taken from the previous
    instantiation where that shape recurs; the graph is the one instantiated without them."""
    fn = _model(4)
    compiled = vtc.compile(fn, _inputs(9, 0))
    compiled(*_inputs(10, 10))
    sg = compiled._dynamic.sg
    (sym,) = sg.symbols

    def shapes(g):
        return [(v.name, v.shape, v.dtype, v.kind) for v in g.values()]

    a = sg.instantiate({sym: 13})
    metas = dict(sg._metas)
    b = sg.instantiate({sym: 14})
    reused = [t for k, t in sg._metas.items() if metas.get(k) is t]
    assert reused and len(reused) < len(sg._metas)
    sg._metas = None
    assert shapes(sg.instantiate({sym: 14})) == shapes(b)
    assert shapes(sg.instantiate({sym: 13})) == shapes(a)


def test_a_values_bytes_are_worked_out_without_making_a_tensor(monkeypatch):
    """``Value.nbytes`` made a 0-d tensor for its element size (~3 us, ~600 times per new length of a decode step:
    the call plan's segments size every value); now ``dtype.itemsize``, equal to the tensor's element size."""
    from vtc.ir.graph import Value

    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.int8, torch.uint8,
              torch.int16, torch.int32, torch.int64, torch.complex64, torch.float8_e4m3fn]
    want = [torch.empty((3, 5), dtype=d).nbytes for d in dtypes]
    made = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or empty(*a, **k))
    assert [Value("x", (3, 5), d).nbytes for d in dtypes] == want
    assert not made


def test_node_inputs_ask_pytree_only_about_other_containers(monkeypatch):
    """Node.inputs (~1,500 calls per lowering of a decode step) asked pytree whether every leaf (each int of a
    view's sizes, each Value) is a namedtuple; Values, plain containers and atoms are now walked without it, and
    the result is pytree's leaves' Values in order, each once."""
    import collections

    import torch.utils._pytree as pytree

    from vtc.ir.graph import Node, Value

    a, b, c = (Value(n, (2,), torch.float32) for n in "abc")
    nt = collections.namedtuple("nt", "p q")
    node = Node("n", torch.ops.aten.view.default, (a, [1, 1, 8, 64], (b, a, None, 2.5, torch.float32)),
                {"x": c, "y": [b, "s", True]}, (Value("o", (2,), torch.float32),), "movement")
    asked = []
    is_nt = pytree.is_namedtuple_class
    monkeypatch.setattr(pytree, "is_namedtuple_class", lambda t: asked.append(t) or is_nt(t))
    assert [v.name for v in node.inputs] == ["a", "b", "c"]
    assert not asked
    other = Node("m", torch.ops.aten.add.Tensor, (nt(c, [a]), torch.Size([2])), {"o": collections.OrderedDict(z=b)},
                 (Value("o2", (2,), torch.float32),), "compute")
    leaves = pytree.tree_leaves((other.args, other.kwargs))
    assert [v.name for v in other.inputs] == [x.name for x in leaves if isinstance(x, Value)] == ["c", "a", "b"]


def test_hash_consed_nodes_hash_and_compare_in_c():
    """Index expressions and kernel-IR scalars are hash-consed (identity is equality): object's own __hash__ and
    __eq__ say that without a Python call (their Python versions were called ~26,000 times per new length)."""
    from vtc.codegen.kernel_ir import Scalar, const
    from vtc.index.expr import Expr, var

    assert Expr.__hash__ is object.__hash__ and Expr.__eq__ is object.__eq__
    assert Scalar.__hash__ is object.__hash__ and Scalar.__eq__ is object.__eq__
    a, b = var("i", 4) * 3 + 1, var("i", 4) * 3 + 1
    assert a is b and a == b and {a: 1}[b] == 1 and a != var("i", 4) and a != 1
    x = const(1.5, torch.float32)
    assert x is const(1.5, torch.float32) and x != const(2.5, torch.float32) and x != 1.5


def test_arg_keys_of_exact_types_are_the_keys_of_the_general_walk():
    """plan_keeping's and the probe memo's ``_arg_key`` takes the common exact types first (Values, tuples, lists,
    ints...); the keys are those of the isinstance walk it falls back to (subclasses: namedtuples, torch.Size,
    bool vs int, -0.0 vs 0.0), and a tensor still gives no key.  (A guard: this passes before the change too.)"""
    import collections

    from vtc.ir.graph import Value
    from vtc.plan.virtualize import _arg_key, _NoKey

    def general(a):
        if isinstance(a, Value):
            return ("%", a.name, tuple(a.shape), a.dtype)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, *map(general, a))
        if isinstance(a, dict):
            return ("{", *((k, general(v)) for k, v in a.items()))
        if isinstance(a, float):
            return ("float", repr(a))
        return (type(a).__name__, a)

    v = Value("a", (1, 8, 64), torch.float32)
    nt = collections.namedtuple("nt", "x y")
    cases = [(v, [1, 1, 8, 64]), (v, -1, True, None, 2.5, -0.0, 0.0, float("nan"), "s", torch.float32),
             {"dim": 1, "x": [v, (v, 3)], "d": torch.device("cpu")}, (nt(1, [v]),), (torch.Size([1, 2]), False, 0),
             (torch.contiguous_format, torch.strided)]
    for c in cases:
        assert repr(_arg_key(c)) == repr(general(c))
    assert _arg_key((True,)) != _arg_key((1,)) and _arg_key((-0.0,)) != _arg_key((0.0,))
    with pytest.raises(_NoKey):
        _arg_key((v, [torch.ones(1)]))
