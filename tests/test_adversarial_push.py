"""Adversarial tests (session 17) of the store side: GEMMs and kernels storing straight into a cat / slice_scatter
output that is also a graph output and read again, a fused QKV projection stored into KV caches grown by cat
(new lengths, batch 3, one and five new tokens), a 3-D Linear's epilogue with a transposed residual, bf16 rows
gathered in front of a Linear.  Compared with torch eager; none of these found a wrong answer in session 17."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import vtc
from tests.adversarial import BF16_TOL, F32_TOL, rand


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check(fn, inputs, calls=(), tol=F32_TOL, **options):
    compiled = vtc.compile(fn, inputs, **options)
    for args in [inputs, *calls]:
        got, want = compiled(*args), fn(*args)
        for k, (gv, wv) in enumerate(zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want)))):
            torch.testing.assert_close(gv, wv, **tol, msg=lambda m, k=k: f"output {k}, inputs "
                                       f"{[list(a.shape) for a in args]}: {m}")


def test_a_cat_of_gemms_that_is_an_output_and_read_again():
    g = _g(1)
    w1, w2 = rand((5, 7), g), rand((3, 7), g)

    def fn(x):
        c = torch.cat([x @ w1.t(), x.flip(0) @ w2.t()], 1)
        return c, c.sum(0), c[:, ::2]

    _check(fn, (rand((17, 7), g),), gemm="vtc")


def test_gemms_stored_into_a_slice_scatter_with_a_step():
    g = _g(2)
    w = rand((3, 7), g)

    def fn(x, y):
        return torch.slice_scatter(x, (y @ w.t()).sigmoid(), 1, 0, 6, 2), torch.slice_scatter(x, y @ w.t(), 1, 2, 5)

    _check(fn, (rand((6, 6), g), rand((6, 7), g)), gemm="vtc")


def test_a_fused_qkv_projection_into_kv_caches_at_new_lengths():
    g = _g(3)
    qkv = nn.Linear(16, 48)

    def fn(x, kc, vc):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in qkv(x).split(16, -1))
        k, v = torch.cat([kc, k], 2), torch.cat([vc, v], 2)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 16), k, v

    _check(fn, (rand((3, 1, 16), g), rand((3, 2, 9, 8), g), rand((3, 2, 9, 8), g)),
           calls=[(rand((3, 1, 16), g), rand((3, 2, 10, 8), g), rand((3, 2, 10, 8), g)),
                  (rand((3, 5, 16), g), rand((3, 2, 10, 8), g), rand((3, 2, 10, 8), g))], gemm="vtc")


def test_a_3d_linear_epilogue_with_a_transposed_residual_float32_and_bf16():
    g = _g(4)
    lin = nn.Linear(17, 33)
    _check(lambda x, r: F.gelu(lin(x)) + r.transpose(0, 1), (rand((3, 5, 17), g), rand((5, 3, 33), g)), gemm="vtc")
    lin16 = nn.Linear(17, 33).to(torch.bfloat16)
    _check(lambda x, r: F.silu(lin16(x)) + r.transpose(0, 1),
           (rand((3, 5, 17), g, torch.bfloat16), rand((5, 3, 33), g, torch.bfloat16)), tol=BF16_TOL)
    _check(lambda x, i: lin16(x[i]), (rand((20, 17), g, torch.bfloat16), torch.tensor([3, 3, 0, 19])), tol=BF16_TOL)
