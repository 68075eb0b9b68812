"""A constant weight behind a movement chain that is not a strided view, folded once (vtc.ir.fold.fold_weight_chains).

x @ f(W)^T with f a flip, roll, cat of two weights, gather of W's columns (advanced index, index_select) or pad,
and a convolution on a cat of two weights: the chain's result becomes a constant copy
(``vtc.runtime.weights.ConstCopy``) that the packed-once paths take as they take a plain W (the same GEMM path and
the same number of packed copies as the model on W itself; before, the chains ran the dot path on W read through
the mapping or packed it per call: every path assertion here fails before).  A change in place of any constant the
chain reads (``p.mul_`` under ``no_grad``, ``load_state_dict``, the gather's index buffer) is seen at the next call,
through the fast call, the call plan and the executor's reference path; a parameter replaced (``p.data = t``) makes
``vtc.Compiled`` capture again.  A budget too small for the copy leaves the chain as it was (why in the graph's
``weight_chains_not_folded``).  All against torch eager on random weights.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import vtc
from vtc import PackedBudgetWarning
from vtc.codegen import conv_bcast, conv_t
from vtc.runtime import packed

from tests.codegen.util import ROW_TOL, gen, rand

pytestmark = pytest.mark.skipif(not conv_t.has_avx512() or not packed.CONV_ENABLED,
                                reason="the generated kernels' packed weights are AVX-512 only")
TOL = dict(rtol=1e-4, atol=1e-4)
CHAINS = ("flip", "roll", "cat", "index", "index_select", "pad")


class Chain(torch.nn.Module):
    """F.linear(x, f(W), b): W [N, K] (for "cat" two weights of N / 2 rows, for "pad" N - 3 rows)."""

    def __init__(self, kind: str, n: int, seed: int, k: int = 300) -> None:
        super().__init__()
        g = gen(seed)
        self.kind = kind
        rows = n // 2 if kind == "cat" else n - 3 if kind == "pad" else n
        self.w = torch.nn.Parameter(rand((rows, k), g) / k ** 0.5)
        if kind == "cat":
            self.w2 = torch.nn.Parameter(rand((n - rows, k), g) / k ** 0.5)
        self.register_buffer("perm", torch.randperm(k, generator=g))
        self.b = torch.nn.Parameter(rand((n,), g))

    def weight(self) -> torch.Tensor:
        w = self.w
        return {"plain": lambda: w, "flip": lambda: w.flip(0), "roll": lambda: w.roll(3, 0),
                "cat": lambda: torch.cat([w, self.w2], 0) if self.kind == "cat" else w,
                "index": lambda: w[:, self.perm], "index_select": lambda: w.index_select(1, self.perm),
                "pad": lambda: F.pad(w, (0, 0, 0, 3))}[self.kind]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(), self.b)


def _plan(compiled):
    return compiled._first.executor.call_plan()


def _paths(compiled) -> list[tuple[str, str, str]]:
    return [(q["choice"], q["path"], q["library"]) for q in compiled.report.to_dict()["gemm"]]


def _copies(compiled) -> int:
    counts = _plan(compiled).counts
    return counts["packed_weights"] + counts["packed_conv_weights"]


def _check(compiled, model, x) -> None:
    """The fast call, the call plan and the reference path (run_steps) against eager."""
    want = model(x)
    torch.testing.assert_close(compiled(x), want, **TOL)
    torch.testing.assert_close(_plan(compiled)([x])[0], want, **TOL)
    torch.testing.assert_close(compiled._first.executor.run_steps([x])[0], want, **TOL)


# (gemm mode, rows, N, K, the path): the generated kernel on W packed once for a few rows (skinny_packed) and for
# more (the panels), torch's mm on MKL's packed weight
CASES = [(kind, shape) for shape in (("vtc", 5, 256, 300, ("vtc", "skinny_packed", "")),
                                     ("torch", 40, 256, 300, ("torch", "", "mkl_packed"))) for kind in CHAINS]
CASES += [(kind, ("vtc", 40, 600, 1027, ("vtc", "panels", ""))) for kind in ("roll", "cat")]


@pytest.mark.parametrize("kind,shape", CASES, ids=[f"{k}-{s[0]}-{s[1]}x{s[2]}x{s[3]}" for k, s in CASES])
def test_a_chain_takes_the_plain_weights_path_and_follows_changes(kind, shape):
    """The path and the packed copies of the model on a plain W; before: the dot path, the panels packing B per
    call, torch's mm on W copied per call, and no packed copy."""
    mode, rows, n, k, path = shape
    model, plain = Chain(kind, n, 1, k), Chain("plain", n, 1, k)
    x = rand((rows, k), gen(2))
    with torch.no_grad():
        compiled, on_w = vtc.compile(model, (x,), gemm=mode), vtc.compile(plain, (x,), gemm=mode)
        _check(compiled, model, x)
        assert _paths(compiled) == _paths(on_w) == [path]
        assert _copies(compiled) == _copies(on_w) >= 1, _plan(compiled).why_not_packed
        packing = compiled.report.to_dict()["packing"]
        assert packing["folded_weight_chains"] == 1 and packing["folded_bytes"] == 4 * n * k
        assert not any(
            n.kind == "movement" and n.op != "aten.permute.default" for n in compiled._first.graph.nodes)
        model.w.mul_(-2.0)
        _check(compiled, model, x)
        state = {**model.state_dict(), "w": rand(tuple(model.w.shape), gen(3))}
        if kind == "cat":
            state["w2"] = rand(tuple(model.w2.shape), gen(4))
        model.load_state_dict(state)
        _check(compiled, model, x)
        if kind == "cat":  # the second weight alone
            model.w2.add_(0.5)
            _check(compiled, model, x)
        if kind.startswith("index"):  # the index buffer changed in place
            model.perm.copy_(torch.randperm(k, generator=gen(5)))
            _check(compiled, model, x)


def test_a_replaced_parameter_is_captured_again():
    model = Chain("cat", 256, 6)
    x = rand((5, 300), gen(7))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        torch.testing.assert_close(compiled(x), model(x), **TOL)
        model.w2.data = rand(tuple(model.w2.shape), gen(8))  # new memory: the copy's source is no longer w2
        torch.testing.assert_close(compiled(x), model(x), **TOL)
        model.w = torch.nn.Parameter(rand(tuple(model.w.shape), gen(9)))
        torch.testing.assert_close(compiled(x), model(x), **TOL)


class CatConv(torch.nn.Module):
    """A 1x1 convolution on the cat of two weights (the broadcast form packs a constant weight once)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = gen(seed)
        self.w1, self.w2 = torch.nn.Parameter(rand((24, 40, 1, 1), g)), torch.nn.Parameter(rand((32, 40, 1, 1), g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.conv2d(x, torch.cat([self.w1, self.w2], 0)))


def test_a_convolution_weight_behind_a_cat():
    model = CatConv(10)
    x = rand((1, 40, 7, 7), gen(11))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        assert [q["path"] for q in compiled.report.to_dict()["gemm"]] == [conv_bcast.FORM]
        assert _plan(compiled).counts["packed_conv_weights"] == 1, _plan(compiled).why_not_packed
        torch.testing.assert_close(compiled(x), model(x), **ROW_TOL)
        model.w2.mul_(-2.0)
        torch.testing.assert_close(compiled(x), model(x), **ROW_TOL)
        model.load_state_dict({"w1": rand((24, 40, 1, 1), gen(12)), "w2": rand((32, 40, 1, 1), gen(13))})
        torch.testing.assert_close(compiled(x), model(x), **ROW_TOL)
        torch.testing.assert_close(compiled._first.executor.run_steps([x])[0], model(x), **ROW_TOL)


def test_a_copy_over_the_budget_leaves_the_chain(monkeypatch):
    gc.collect()
    monkeypatch.setattr(packed, "BUDGET_BYTES", packed.HELD.bytes + 1000)  # less than the 256 x 300 copy
    model = Chain("roll", 256, 14)
    x = rand((5, 300), gen(15))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        graph = compiled._first.graph
        assert "const_copies" not in graph.meta
        assert [type(why) for why in graph.meta["weight_chains_not_folded"].values()] == [packed.OverBudget]
        with pytest.warns(PackedBudgetWarning):
            torch.testing.assert_close(compiled(x), model(x), **TOL)
        packing = compiled.report.to_dict()["packing"]
        assert packing["folded_weight_chains"] == 0 and packing["unpacked_for_budget"] >= 1
        model.w.mul_(3.0)
        torch.testing.assert_close(compiled(x), model(x), **TOL)


def test_a_weight_read_plain_and_through_a_chain():
    """W itself (its transpose) and W.flip(0) in one graph: W stays a constant, the flip a copy of its own."""
    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(rand((256, 300), gen(16)) / 300 ** 0.5)

        def forward(self, x):
            return x @ self.w.t() + x @ self.w.flip(0).t()

    model, x = Both(), rand((5, 300), gen(17))
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        torch.testing.assert_close(compiled(x), model(x), **TOL)
        assert len(compiled._first.graph.meta["const_copies"]) == 1
        model.w.mul_(-0.5)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
