"""A row kernel's store pass computes what depends only on the row's reductions once per row
(``cpp._Emitter.hoist_invariant(..., reductions_done=True)``): a layer norm's ``1 / sqrt(var + eps)`` was a
vector sqrt and a division per element.  Against torch on odd sizes, non-contiguous (a window partition in
front), with the generated source asserting the hoist."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen.cpp import PRELUDE, generate

from .util import ROW_TOL, assert_no_movement, check, gen, kernels, rand


def _store_pass(src: str) -> str:
    """The text after the last reduction's fold: the per-row temps and the store loop."""
    return src.rsplit("_part[0] + ", 1)[-1]


@pytest.mark.parametrize("shape", [(1, 3), (3, 17), (17, 127), (127, 2)])
def test_layer_norm_rstd_once_per_row(shape):
    g = gen(21)
    x, w, b = rand(shape, g), rand(shape[-1:], g), rand(shape[-1:], g)
    fn = lambda x, w, b: F.layer_norm(x.transpose(0, 1).transpose(0, 1) * 1.5, shape[-1:], w, b)  # noqa: E731
    compiled = check(fn, (x, w, b), **ROW_TOL)
    (src,) = [generate(k).replace(PRELUDE, "") for k in kernels(compiled)]
    tail = _store_pass(src)
    per_row = re.search(r"const float (t\d+) = \(\(float\)1 / std::sqrt\(", tail)
    assert per_row, src
    loop = tail[tail.index("for (int64_t r = "):]
    assert "std::sqrt" not in loop and per_row.group(1) in loop, src


def test_window_layer_norm_rstd_once_per_row():
    g = gen(22)
    x, w, b = rand((2, 14, 21, 17), g), rand((17,), g), rand((17,), g)

    def fn(x, w, b):
        bb, h, ww, c = x.shape
        x = x.view(bb, h // 7, 7, ww // 7, 7, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 49, c)
        return F.layer_norm(x, (c,), w, b)

    compiled = check(fn, (x, w, b), **ROW_TOL)
    assert_no_movement(compiled)
    (src,) = [generate(k) for k in kernels(compiled)]
    loop = _store_pass(src)[_store_pass(src).index("for (int64_t r = "):]
    assert "std::sqrt" not in loop, src


def test_softmax_store_pass_scale_once_per_row():
    """softmax's 1 / sum: once per row, the stored exp read back in the loop."""
    g = gen(23)
    x = rand((3, 127), g)
    compiled = check(lambda x: torch.softmax(x * 2, -1), (x,), **ROW_TOL)
    (src,) = [generate(k).replace(PRELUDE, "") for k in kernels(compiled)]
    tail = src.rsplit("acc_s = acc_s + ", 1)[-1]
    assert re.search(r"const float t\d+ = \(\(float\)1 / acc_s\);", tail), src


def test_layer_norm_with_mean_and_rstd_outputs():
    """The per-row temps of the store pass and the once-per-row stores of mean and rstd in one scope."""
    g = gen(24)
    x, w, b = rand((17, 127), g), rand((127,), g), rand((127,), g)
    fn = lambda x, w, b: torch.ops.aten.native_layer_norm(x * 2, [127], w, b, 1e-5)  # noqa: E731
    compiled = check(fn, (x, w, b), **ROW_TOL)
    assert any(not st.per_r for k in kernels(compiled) for st in k.stores)
