"""Values computed from the model's tensors folded under ``vtc.dynamic`` too, and one copy per recipe (session 24).

Before session 24 the size-generic path (``vtc.dynamic``) folded nothing: a weight normalisation or ``W * s`` ran at
every call of every size.  It now folds the values whose shapes do not vary with the sizes (the same nodes at every
size, so the first size's plan replays by node name and the kernels fitted from probes fit); a value whose shape
varies (a table [S, D] from an arange of S) stays computed.  The specializations of one model (vtc.dynamic's sizes,
concrete captures of new sizes) share one copy of a value folded by the same recipe from the same tensors, where
each made its own before.  Every test fails before session 24; all against torch eager on random inputs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.parametrizations import weight_norm

import vtc
from vtc.runtime import cbuild, packed

from tests.codegen.util import gen, rand

pytestmark = [pytest.mark.skipif(not packed.CONV_ENABLED, reason="VTC_PACKED_WEIGHTS=0: no constant copies"),
              pytest.mark.usefixtures("quiet")]
TOL = dict(rtol=1e-4, atol=1e-4)


class Mixed(torch.nn.Module):
    """A weight-normalised Linear, a position term [S, 40] from an arange of the row count (its shape varies), and
    a Linear on W * s."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(30)
        g = gen(31)
        self.lin = weight_norm(torch.nn.Linear(48, 40))
        self.w = torch.nn.Parameter(rand((40, 40), g) / 7)
        self.s = torch.nn.Parameter(rand((40, 1), g))
        self.t = torch.nn.Parameter(rand((1, 40), g))

    def forward(self, x):
        pos = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * self.t
        return F.linear(self.lin(x) + pos, self.w * self.s)


def _ops(spec) -> list[str]:
    return [n.op.split(".")[1] for n in spec.graph.nodes]


def _close(compiled, model, rows: int, seed: int) -> None:
    x = rand((rows, 48), gen(seed))
    torch.testing.assert_close(compiled(x), model(x), **TOL)


def test_a_dynamic_model_folds_the_values_of_fixed_shape_once_for_every_size(private_cache):
    model = Mixed().eval()
    with torch.no_grad():
        compiled = vtc.compile(model, (rand((6, 48), gen(32)),), dynamic=True)
        for i, rows in enumerate((6, 9, 13)):
            _close(compiled, model, rows, 33 + i)
        built = cbuild.compile_count
        for i, rows in enumerate((21, 5, 30)):
            _close(compiled, model, rows, 36 + i)
        assert cbuild.compile_count == built, "a new size ran the C++ compiler"
        specs = list(compiled._specs.values())
        assert len(specs) == 6 and all(type(s).__name__ == "SizeSpecialization" for s in specs)
        for spec in specs:  # the norm, the division and both products folded; the position term computed
            assert sorted(_ops(spec)) == ["add", "addmm", "arange", "mm", "mul", "permute", "permute", "slice",
                                          "unsqueeze"]
            assert spec.report.to_dict()["packing"]["folded_nodes"] == 4
            assert spec.report.to_dict()["packing"]["folded_weight_chains"] == 2
        copies = [tuple(s.graph.meta["const_copies"].values()) for s in specs]
        assert all(c == copies[0] for c in copies)  # the very same two ConstCopy objects
        model.s.mul_(-2.0)  # in place: every size sees it
        model.lin.parametrizations.weight.original1.mul_(1.5)
        for i, rows in enumerate((6, 13, 17)):
            _close(compiled, model, rows, 40 + i)
        model.lin.parametrizations.weight.original0.data.mul_(0.5)  # not seen by a copy (README): refresh()
        compiled.refresh()
        for i, rows in enumerate((6, 9)):
            _close(compiled, model, rows, 43 + i)


def test_the_static_specializations_of_two_sizes_share_one_copy():
    """dynamic=False: each size is captured on its own; the folded weight (and MKL's packed copy of it) is one."""
    torch.manual_seed(45)
    model = weight_norm(torch.nn.Linear(64, 96)).eval()
    with torch.no_grad():
        compiled = vtc.compile(model, (rand((40, 64), gen(46)),), dynamic=False)
        for i, rows in enumerate((40, 56, 40)):
            x = rand((rows, 64), gen(47 + i))
            torch.testing.assert_close(compiled(x), model(x), **TOL)
        first, second = compiled._specs.values()
        assert [n.op for n in first.graph.nodes] == [n.op for n in second.graph.nodes]  # the fold on both
        (a,), (b,) = first.graph.meta["const_copies"].values(), second.graph.meta["const_copies"].values()
        assert a is b
        model.parametrizations.weight.original0.add_(0.25)
        for i, rows in enumerate((56, 40)):
            x = rand((rows, 64), gen(50 + i))
            torch.testing.assert_close(compiled(x), model(x), **TOL)
