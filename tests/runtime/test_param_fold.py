"""Values computed from the model's tensors alone, folded once (vtc.ir.fold.fold_weight_chains).

Weight normalisation (w = g * v / ||v||, a convolution's and a Linear's), ``W * s``, ``W.t() * scale``, a LoRA merge
``W + B @ A``, CLIP's ``logit_scale.exp()`` and T5's relative position bias (bucketed aranges, an embedding of a
parameter) read no graph input: vtc computed them on every call.  Each becomes a constant copy
(``vtc.runtime.weights.ConstCopy``) computed once with torch and again at a call where one of the tensors it reads
changed in place; a parameter replaced (``p.data = t``) makes ``vtc.Compiled`` capture again.  A value that reads a
graph input stays computed, and so does one above ``vtc.ir.fold.MAX_BYTES`` (a GEMM's or convolution's weight
excepted: it is held against the packed-weight budget, as a weight behind a movement chain is).  Every test fails
before the fold of computed values (session 23): the folded nodes were in the compiled graph and the report's
``folded_nodes`` did not exist.  All against torch eager on random inputs and weights.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.parametrizations import weight_norm

import vtc
from vtc.ir import fold
from vtc.runtime import packed

from tests.codegen.util import gen, rand

pytestmark = [pytest.mark.skipif(not packed.CONV_ENABLED, reason="VTC_PACKED_WEIGHTS=0: no constant copies"),
              pytest.mark.usefixtures("quiet")]
TOL = dict(rtol=1e-4, atol=1e-4)


def _ops(compiled) -> list[str]:
    return [n.op.split(".")[1] for n in compiled._first.graph.nodes]


def _packing(compiled) -> dict:
    return compiled.report.to_dict()["packing"]


def _check(compiled, model, *inputs, tol=TOL) -> None:
    """The fast call, the call plan and the reference path (run_steps) against eager."""
    want = model(*inputs)
    torch.testing.assert_close(compiled(*inputs), want, **tol)
    torch.testing.assert_close(compiled._first.executor.call_plan()(list(inputs))[0], want, **tol)
    torch.testing.assert_close(compiled._first.executor.run_steps(list(inputs))[0], want, **tol)


def _folded(compiled, copies: int, nodes: int) -> None:
    packing = _packing(compiled)
    assert (packing["folded_weight_chains"], packing["folded_nodes"]) == (copies, nodes), packing
    assert len(compiled._first.graph.meta["const_copies"]) == copies


def _conv_wn(seed: int) -> torch.nn.Module:
    """Wav2Vec2's positional convolution: grouped, kernel 5, weight_norm over the kernel dim."""
    torch.manual_seed(seed)
    return weight_norm(torch.nn.Conv1d(32, 32, 5, padding=2, groups=4), dim=2).eval()


def test_weight_norm_convolution():
    model, x = _conv_wn(1), rand((2, 32, 40), gen(2))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        _check(compiled, model, x)
        assert _ops(compiled) == ["convolution"]  # the norm, the division and the product folded
        _folded(compiled, 1, 3)
        model.parametrizations.weight.original1.mul_(-1.5)  # v
        _check(compiled, model, x)
        model.parametrizations.weight.original0.add_(0.5)  # g
        _check(compiled, model, x)
        model.load_state_dict({k: rand(tuple(t.shape), gen(3)) for k, t in model.state_dict().items()})
        _check(compiled, model, x)
        model.parametrizations.weight.original1.data = rand((32, 8, 5), gen(4))  # replaced: captured again
        _check(compiled, model, x)


def test_weight_norm_linear_is_packed_once():
    torch.manual_seed(5)
    model, x = weight_norm(torch.nn.Linear(96, 80)).eval(), rand((40, 96), gen(6))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        _check(compiled, model, x)
        assert _ops(compiled) == ["permute", "addmm"]
        _folded(compiled, 1, 3)
        counts = compiled._first.executor.call_plan().counts
        if packed.ENABLED:
            assert counts["packed_weights"] + counts["packed_conv_weights"] == 1, counts
        model.parametrizations.weight.original0.mul_(2.0)
        _check(compiled, model, x)
        model.parametrizations.weight.original0.data = rand((80, 1), gen(7))
        _check(compiled, model, x)
        model.parametrizations.weight.original1.data.mul_(-2.0)  # not seen by a copy (README): refresh()
        compiled.refresh()
        _check(compiled, model, x)


class Scaled(torch.nn.Module):
    """F.linear(x, W * s) ("rows": s per output row) or x @ (W.t() * scale) ("transposed", a scalar buffer)."""

    def __init__(self, kind: str, seed: int) -> None:
        super().__init__()
        g = gen(seed)
        self.kind = kind
        self.w = torch.nn.Parameter(rand((64, 48), g) / 48 ** 0.5)
        self.s = torch.nn.Parameter(rand((64, 1), g))
        self.register_buffer("scale", torch.tensor(0.125))

    def forward(self, x):
        if self.kind == "rows":
            return F.linear(x, self.w * self.s)
        return x @ (self.w.t() * self.scale)


@pytest.mark.parametrize("kind", ["rows", "transposed"])
def test_a_scaled_weight(kind):
    model, x = Scaled(kind, 8), rand((5, 48), gen(9))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        _check(compiled, model, x)
        assert "mul" not in _ops(compiled)
        _folded(compiled, 1, 1 if kind == "rows" else 2)  # the product (and the transpose it reads)
        (model.s if kind == "rows" else model.scale).mul_(-3.0)
        _check(compiled, model, x)
        model.w.add_(0.25)
        _check(compiled, model, x)


class LoRA(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = gen(seed)
        self.w = torch.nn.Parameter(rand((96, 64), g) / 8)
        self.b = torch.nn.Parameter(rand((96,), g))
        self.lora_a, self.lora_b = torch.nn.Parameter(rand((4, 64), g) / 8), torch.nn.Parameter(rand((96, 4), g) / 2)

    def forward(self, x):
        return F.linear(x, self.w + 0.5 * (self.lora_b @ self.lora_a), self.b)


def test_a_lora_merge():
    model, x = LoRA(10), rand((7, 64), gen(11))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        _check(compiled, model, x)
        assert "mm" not in _ops(compiled) and "add" not in _ops(compiled)
        _folded(compiled, 1, 3)
        model.lora_b.copy_(rand((96, 4), gen(12)))
        _check(compiled, model, x)
        model.lora_a.data = rand((4, 64), gen(13))
        _check(compiled, model, x)


class LogitScale(torch.nn.Module):
    """CLIP's similarity: logit_scale.exp() * a @ b^T, and a learned temperature through softplus."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.659))
        self.t = torch.nn.Parameter(torch.tensor([0.3]))

    def forward(self, a, b):
        return (self.logit_scale.exp() * a @ b.t()) / F.softplus(self.t)


def test_a_scalar_from_parameters():
    model, a, b = LogitScale(), rand((6, 16), gen(14)), rand((5, 16), gen(15))
    with torch.no_grad():
        compiled = vtc.compile(model, (a, b))
        _check(compiled, model, a, b)
        assert _ops(compiled) == ["mul", "permute", "mm", "div"]
        _folded(compiled, 2, 5)  # exp; softplus's exp, log1p, comparison and where
        model.logit_scale.add_(0.5)
        model.t.mul_(2.0)
        _check(compiled, model, a, b)


def _t5(mask: bool):
    from tests.e2e.hf_models import MODELS

    torch.manual_seed(16)
    model, (ids,) = MODELS["t5_encoder"](2, 24)
    inputs = (ids, torch.ones(2, 24, dtype=torch.long)) if mask else (ids,)
    if mask:
        inputs[1][1, 17:] = 0
    return model, inputs


def _hidden(model):
    return lambda *inputs: model(*inputs).last_hidden_state


@pytest.mark.parametrize("mask", [False, True], ids=["no-mask", "mask"])
def test_t5_relative_position_bias(mask):
    """The buckets (aranges, a log, comparisons) and the embedding of the bias table: one constant."""
    model, inputs = _t5(mask)
    bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    with torch.no_grad():
        compiled = vtc.compile(model, inputs)
        check = _hidden(model)
        torch.testing.assert_close(compiled(*inputs).last_hidden_state, check(*inputs), **TOL)
        graph = compiled._first.graph
        assert not any(n.inputs and n.inputs[0].name.endswith("relative_attention_bias_weight")
                       for n in graph.nodes), graph
        packing = _packing(compiled)
        assert packing["folded_nodes"] >= 15, packing
        if mask:  # the bias [24, 24, 4] (the reader takes its permutation as a view)
            assert [c.value.shape for c in graph.meta["const_copies"].values()] == [(24, 24, 4)]
        else:  # no mask to add: the bias where its rows are kept, [2, 4, 24, 24], made alike in both layers, the
            # same for both batch rows: held as [1, 4, 24, 24] (it was [2, 4, 24, 24] before session 24), each
            # layer reading it through an expand that stays virtual
            (copy,) = graph.meta["const_copies"].values()
            assert copy.value.shape == (1, 4, 24, 24) and packing["folded_bytes"] == 4 * 24 * 24 * 4
            assert [v.data.data_ptr() for v in graph.consts if v.shape == (1, 4, 24, 24)] == [copy.value.data_ptr()] * 2
            expands = [n for n in graph.nodes if n.op == "aten.expand.default" and n.inputs[0].kind == "const"]
            assert [n.outputs[0].shape for n in expands] == [(2, 4, 24, 24)] * 2
            assert not any(n.name in compiled._first.plan.kept for n in expands), compiled._first.plan.kept
        bias.mul_(-2.0)
        torch.testing.assert_close(compiled(*inputs).last_hidden_state, check(*inputs), **TOL)


class MaskedBias(torch.nn.Module):
    """scores + where(mask.expand(B, S, S), p, 0): the bias a pointwise op makes as a broadcast over the batch."""

    def __init__(self, s: int) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(rand((1, s, s), gen(23)))
        self.register_buffer("mask", torch.rand(1, s, 1, generator=gen(24)) > 0.3)

    def forward(self, x):
        return x + torch.where(self.mask.expand(x.shape[0], -1, x.shape[2]), self.p.exp(), 0.0)


def test_a_broadcast_is_folded_without_its_broadcast_dims():
    """The where's [3, 16, 16] is the same for every batch row: the copy is [1, 16, 16], read through an expand
    (before session 24: a [3, 16, 16] copy)."""
    model, x = MaskedBias(16), rand((3, 16, 16), gen(25))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        _check(compiled, model, x)
        _folded(compiled, 1, 4)  # the mask's expand, exp, the 0.0 (a scalar_tensor), the where
        (copy,) = compiled._first.graph.meta["const_copies"].values()
        assert copy.value.shape == (1, 16, 16)
        assert _ops(compiled) == ["expand", "add"]
        model.p.mul_(-0.5)
        _check(compiled, model, x)
        model.mask.logical_not_()
        _check(compiled, model, x)


class Shift(torch.nn.Module):
    """x + tanh(a * b): [n] from two parameters, or from a parameter and the input s (for b)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        g = gen(17)
        self.a, self.b = torch.nn.Parameter(rand((n,), g)), torch.nn.Parameter(rand((n,), g))

    def forward(self, x, s=None):
        return x + torch.tanh(self.a * (self.b if s is None else s))


def test_a_graph_input_leaves_the_value_computed():
    model, x, s = Shift(64), rand((3, 64), gen(18)), rand((64,), gen(19))
    with torch.no_grad():
        folded = vtc.compile(model, (x,))
        _check(folded, model, x)
        assert _ops(folded) == ["add"]
        _folded(folded, 1, 2)
        with_input = vtc.compile(model, (x, s))
        _check(with_input, model, x, s)
        assert _ops(with_input) == ["mul", "tanh", "add"]
        assert "const_copies" not in with_input._first.graph.meta
        model.a.mul_(-1.0)
        _check(with_input, model, x, s)
        _check(folded, model, x)


def test_a_value_above_the_limit_stays_computed(monkeypatch, budget):
    """Above MAX_BYTES (not a GEMM's weight): computed per call as before; within it, folded.  A GEMM's weight above
    MAX_BYTES but over the packed-weight budget: computed per call too."""
    x = rand((3, 1000), gen(20))
    with torch.no_grad():
        model = Shift(1000)
        assert "const_copies" in vtc.compile(model, (x,))._first.graph.meta
        monkeypatch.setattr(fold, "MAX_BYTES", 3999)  # one float short of the 1000-float value
        compiled = vtc.compile(model, (x,))
        assert "const_copies" not in compiled._first.graph.meta and "tanh" in _ops(compiled)
        _check(compiled, model, x)
        lin, y = Scaled("rows", 21), rand((5, 48), gen(22))
        assert len(vtc.compile(lin, (y,))._first.graph.meta["const_copies"]) == 1  # a weight: above MAX_BYTES
        gc.collect()  # the copies of the models compiled above given back
        budget(1000)  # less than the 64 x 48 weight
        over = vtc.compile(lin, (y,))
        assert "const_copies" not in over._first.graph.meta and "mul" in _ops(over)
        assert [type(why) for why in over._first.graph.meta["weight_chains_not_folded"].values()] == [
            packed.OverBudget]
        _check(over, lin, y)


@pytest.mark.parametrize("window, heads, shift, threads", [(5, 3, 0, 1), (3, 5, 1, 3), (5, 2, 2, 4), (3, 3, 0, 2)],
                         ids=lambda v: str(v))
def test_a_relative_position_bias_gathered_through_an_index_buffer(window, heads, shift, threads):
    """Swin's bias ``table[index]`` (a parameter gathered through an int64 buffer: a movement op, but each read of
    it loads the index and then gathers) is one constant [N * N, heads], read through its view and permutation;
    before session 28 it was computed on every call (Swin-T: 7 gather kernels a call, 4 of them on one thread).
    A change of the table or of the index buffer in place is seen at the next call; at 1-4 threads, odd sizes."""
    from tests.codegen.test_window_attention import WindowAttention
    from tests.codegen.util import torch_threads

    g = gen(40 + window + heads)
    m = WindowAttention(window * 2, window, heads, 8, shift, g, "table").eval()
    x = rand((1, window * 2, window * 2, heads * 8), g)
    n = window * window
    with torch.no_grad(), torch_threads(threads):
        compiled = vtc.compile(m, (x,))
        torch.testing.assert_close(compiled(x), m(x), **TOL)
        graph = compiled._first.graph
        assert "index" not in _ops(compiled), _ops(compiled)
        steps = compiled._first.executor.steps
        assert not any(s.kind == "kernel" and "index" in s.kernel.step.kernel.name for s in steps)
        (copy,) = [c for c in graph.meta["const_copies"].values() if c.value.shape == (n * n, heads)]
        torch.testing.assert_close(copy.value, m.table[m.index])
        m.table.mul_(-2.0)
        torch.testing.assert_close(compiled(x), m(x), **TOL)
        m.index.copy_(m.index.flip(0))  # the index buffer changed in place
        torch.testing.assert_close(compiled(x), m(x), **TOL)


def test_a_gather_through_index_arithmetic_or_a_graph_input_stays_computed():
    """Not every gather of a parameter is folded: through roll's ``(arange + s) % n`` (index arithmetic, no index
    in memory) or through an index the caller passes, the gather stays in the graph."""
    class Gathers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(rand((13, 6), gen(51)))

        def forward(self, x, ids):
            rolled = self.table.roll(3, 0)[: x.shape[0]]  # index_select through (arange + 3) % 13
            return x + rolled + self.table[ids]

    m, x, ids = Gathers().eval(), rand((9, 6), gen(52)), torch.randint(0, 13, (9,), generator=gen(53))
    with torch.no_grad():
        compiled = vtc.compile(m, (x, ids))
        _check(compiled, m, x, ids)
        assert "index" in _ops(compiled), _ops(compiled)
        assert not any(c.value.shape == (9, 6) for c in compiled._first.graph.meta.get("const_copies", {}).values())
