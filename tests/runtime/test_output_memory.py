"""A compiled call's outputs own their memory, as torch's results of the same ops do.

A removed movement op at the end of a graph (``x.clone()``, ``.contiguous()``, ``cat([x])``), a graph
input or constant returned as it is, or one value returned twice used to come back as a view of the
caller's input, of the model's weight or of another output: a caller changing one in place changed the
other, or the next call's result.
"""
from __future__ import annotations

import pytest
import torch

import vtc

W = torch.randn(3, 4)


class Model(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.w = torch.nn.Parameter(W.clone())
        self.fn = fn

    def forward(self, x):
        return self.fn(self, x)


CASES = {  # name -> forward(model, x) with x of shape (2, 3, 4)
    "clone": lambda m, x: x.clone(),
    "contiguous_of_permute": lambda m, x: x.permute(0, 2, 1).contiguous(),
    "cat_of_one": lambda m, x: torch.cat([x]),
    "slice_clone": lambda m, x: x[1:].clone(),
    "input_and_its_clone": lambda m, x: (x, x.clone()),
    "value_and_its_clone": lambda m, x: ((x + 1), (x + 1).clone()),
    "weight_transposed_contiguous": lambda m, x: m.w.t().contiguous(),
    "tensor_literal": lambda m, x: (x.sum(), torch.tensor([1.0, 2.0, 3.0])),
}


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_share_no_memory_with_inputs_weights_or_each_other(name):
    model = Model(CASES[name])
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        want = [t.clone() for t in _flat(model(x))]
        got = _flat(compiled(x))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
        assert g.is_contiguous(), f"{name}: output of strides {g.stride()} is not contiguous"
    x_before, w_before = x.clone(), model.w.detach().clone()
    for g in got:  # the caller changes every output in place
        g.mul_(0).add_(7)
    torch.testing.assert_close(x, x_before, msg=f"{name}: changing an output changed the input")
    torch.testing.assert_close(model.w.detach(), w_before, msg=f"{name}: changing an output changed the weight")
    with torch.no_grad():
        again = _flat(compiled(x))
    for g, w in zip(again, want):
        torch.testing.assert_close(g, w, msg=lambda m: f"{name}: the next call changed: {m}")


def test_a_model_whose_outputs_are_kernel_buffers_checks_nothing_per_call():
    compiled = vtc.compile(lambda x: (x.permute(0, 2, 1) + 1).softmax(-1), (torch.randn(2, 3, 4),))
    assert compiled._first.executor.call_plan().own_outputs is None
