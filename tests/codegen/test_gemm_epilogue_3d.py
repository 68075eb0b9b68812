"""A Linear on a 3-D input ([batch, tokens, d]) takes its pointwise reader as the GEMM's epilogue
(vtc.codegen.lower ``_epilogues`` / ``_reader_index``).

torch traces it as view -> addmm / mm -> view (or matmul on 3-D: view -> mm -> _unsafe_view), so the reader
(GELU, SiLU, a bias add, a residual add, SwiGLU's mul, a scale) has the shape [batch, tokens, n] and reads
the GEMM's [batch * tokens, n] result through the view.  The GEMM kernel now stores the reader's value
(the view keeps the row-major order, so the reader's element at the GEMM's (row, col) is at the same offset),
in float32 and bf16: one kernel, no pointwise kernel over the whole output.  Every test checks the kernel
list (the GEMM kernel's source nodes hold the reader, no "pointwise" kernel left) and the values against
eager; the fusion tests fail before the change (the reader was a kernel of its own).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import gemm_bf16

from .util import compile_cpu, gen, kernels, rand, steps, torch_threads

F32_TOL = dict(rtol=1e-4, atol=1e-4)
BF16_TOL = dict(rtol=1.6e-2, atol=1e-1)
BF = torch.bfloat16
needs_bf16 = pytest.mark.skipif(bool(gemm_bf16.support()), reason=f"no bf16 GEMM here: {gemm_bf16.support()}")


def _compiled(fn, inputs, tol, threads=None, **options):
    c = compile_cpu(fn, inputs, gemm="vtc", **options)
    with torch_threads(threads):
        got, want = c(*inputs), fn(*inputs)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **tol)
    assert [s.node.op for s in steps(c, "run")] == []
    return c


def _kinds(c) -> list[tuple[str, list[str]]]:
    return [(k.kind, list(k.source_nodes)) for k in kernels(c)]


def _fused(c, n_gemms: int = 1) -> list[list[str]]:
    """Only GEMM kernels (n_gemms of them), no pointwise kernel; the source nodes of each."""
    ks = _kinds(c)
    assert [k for k, _ in ks] == ["gemm"] * n_gemms, ks
    return [src for _, src in ks]


def gelu_new(x):
    """GPT-2's activation (transformers' NewGELUActivation), as its pointwise ops."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


CASES = [(1, 3), (2, 17)]


@pytest.mark.parametrize("act,b,t", [("gelu", 1, 3), ("gelu", 2, 17), ("silu", 1, 1), ("gelu_tanh", 1, 17)])
def test_linear_3d_activation_is_one_kernel(act, b, t):
    """F.linear(x [b, t, 37]) with bias, then an activation: addmm with the activation in its store."""
    fn_act = {"gelu": F.gelu, "silu": F.silu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}[act]
    g = gen(100 * b + t)
    x, w, bias = rand((b, t, 37), g), rand((45, 37), g), rand((45,), g)
    c = _compiled(lambda x, w, bias: fn_act(F.linear(x, w, bias)), (x, w, bias), F32_TOL)
    (src,) = _fused(c)
    assert src[0] == "addmm" and len(src) == 2, src


@pytest.mark.parametrize("b,t", CASES)
def test_gpt2_conv1d_gelu_new_is_one_kernel(b, t):
    """GPT-2's Conv1D (addmm(bias, x.view(-1, d), W).view(b, t, n)) and gelu_new (mul, pow, add, tanh: the view
    read by three ops, all inlined into one reader): one kernel."""
    g = gen(7 * b + t)
    x, w, bias = rand((b, t, 40), g), rand((40, 67), g), rand((67,), g)

    def fn(x, w, bias):
        y = torch.addmm(bias, x.view(-1, x.size(-1)), w).view(*x.shape[:-1], w.shape[1])
        return gelu_new(y)

    c = _compiled(fn, (x, w, bias), F32_TOL)
    _fused(c)


@pytest.mark.parametrize("b,t", CASES)
def test_bias_scale_residual_broadcast(b, t):
    """Linear without bias, then a bias [n], a per-token scale [b, t, 1] and a residual [b, t, n]: the broadcast
    operands read at the reader's index, which is the GEMM's (row, col); matmul on 3-D (x @ w)."""
    g = gen(3 * b + t)
    x, w = rand((b, t, 33), g), rand((33, 29), g)
    bias, s, r = rand((29,), g), rand((b, t, 1), g), rand((b, t, 29), g)
    c = _compiled(lambda x, w, bias, s, r: (x @ w + bias) * s + r, (x, w, bias, s, r), F32_TOL)
    _fused(c)


@pytest.mark.parametrize("b,t", [(2, 17)])
def test_swiglu_and_residual(b, t):
    """Llama's silu(gate(x)) * up(x) is the epilogue of one of the two GEMMs (the other's result stored, read
    there); in the whole MLP with its residual, down(silu(gate(x)) * up(x)) + x, the residual add is the down
    projection's epilogue (the mul, read by the down GEMM alone, is its A pack's here): GEMM kernels only."""
    g = gen(b + t)
    x = rand((b, t, 24), g)
    wg, wu, wd = rand((40, 24), g, high=0.5), rand((40, 24), g, high=0.5), rand((24, 40), g, high=0.5)
    c = _compiled(lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu), (x, wg, wu), F32_TOL)
    srcs = _fused(c, 2)
    assert sorted(len(s) for s in srcs) == [1, 2], srcs  # one mm, one mm + the mul (silu inlined into it)

    def mlp(x, wg, wu, wd):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd) + x

    srcs = _fused(_compiled(mlp, (x, wg, wu, wd), F32_TOL), 3)
    assert srcs[-1][-1] == "add", srcs


def test_default_plan_and_two_threads():
    """The default (greedy) plan fuses too; the epilogue over a 2-thread split of a larger product."""
    g = gen(5)
    x, w, bias = rand((2, 67, 129), g), rand((200, 129), g), rand((200,), g)
    fn = lambda x, w, bias: F.gelu(F.linear(x, w, bias))
    c = _compiled(fn, (x, w, bias), F32_TOL, threads=2, plan="greedy")
    _fused(c)


def test_split_last_dim_view():
    """A view that also splits the columns ([b * t, 48] -> [b, t, 4, 12], a head split) keeps the row-major order:
    fused, with a per-head term [4, 1] read at the column's head."""
    g = gen(6)
    x, w, hs = rand((2, 5, 16), g), rand((48, 16), g), rand((4, 1), g)
    c = _compiled(lambda x, w, hs: torch.relu(F.linear(x, w).view(2, 5, 4, 12) * hs), (x, w, hs), F32_TOL)
    _fused(c)


def test_transposed_reader_stays_a_kernel():
    """A reader through a view that changes the order (a transpose of the tokens and the columns) is not the
    GEMM's epilogue: its element at (row, col) is another one."""
    g = gen(8)
    x, w = rand((2, 7, 16), g), rand((9, 16), g)
    c = _compiled(lambda x, w: torch.relu(F.linear(x, w).transpose(1, 2)) + 1.0, (x, w), F32_TOL)
    kinds = [k for k, _ in _kinds(c)]
    assert kinds.count("gemm") == 1 and len(kinds) == 2, _kinds(c)


@needs_bf16
@pytest.mark.parametrize("act,b,t", [("gelu", 2, 17), ("silu", 1, 3)])
def test_bf16_linear_3d_activation_is_one_kernel(act, b, t):
    """The same in bf16 (vtc.codegen.gemm_bf16): one kernel."""
    fn_act = {"gelu": F.gelu, "silu": F.silu}[act]
    g = gen(200 + 10 * b + t)
    x, w, bias = rand((b, t, 37), g, BF), rand((45, 37), g, BF), rand((45,), g, BF)
    c = _compiled(lambda x, w, bias: fn_act(F.linear(x, w, bias)), (x, w, bias), BF16_TOL)
    (src,) = _fused(c)
    assert src[0] == "addmm" and len(src) == 2, src
    assert kernels(c)[0].gemm.dtype == BF


@needs_bf16
@pytest.mark.parametrize("b,t", [(1, 3)])
def test_bf16_llama_mlp_residual_and_gpt2(b, t):
    """bf16 Llama MLP + residual (three kernels) and GPT-2 Conv1D + gelu_new (one)."""
    g = gen(300 + b + t)
    x = rand((b, t, 24), g, BF)
    wg, wu, wd = (rand(s, g, BF, high=0.5) for s in [(40, 24), (40, 24), (24, 40)])
    fn = lambda x, wg, wu, wd: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd) + x
    _fused(_compiled(fn, (x, wg, wu, wd), BF16_TOL), 3)
    w, bias = rand((24, 67), g, BF), rand((67,), g, BF)

    def conv1d(x, w, bias):
        return gelu_new(torch.addmm(bias, x.view(-1, x.size(-1)), w).view(*x.shape[:-1], w.shape[1]))

    _fused(_compiled(conv1d, (x, w, bias), BF16_TOL))


@pytest.mark.parametrize("dtype,shape", [(BF, (2, 1, 67)), (torch.float16, (1, 16, 33)), (BF, (1, 67)), (BF, (37, 67))])
def test_cast_into_float32_gemm_a_is_read_in_the_pack(dtype, shape):
    """A float32 Linear (with GELU) on x.float() of a bf16 / fp16 x of at most SKINNY_M rows (decode): the A pack
    widens x's 16-bit elements, the float32 copy is never stored (one GEMM kernel; before: the cast was a kernel of
    its own, and the 3-D GELU another).  37 rows keep the copy (A's float32 paths were faster there)."""
    g = gen(sum(shape))
    x, w, bias = rand(shape, g, dtype), rand((45, shape[-1]), g), rand((45,), g)
    c = _compiled(lambda x, w, bias: F.gelu(F.linear(x.float(), w, bias)), (x, w, bias), F32_TOL)
    rows = math.prod(shape[:-1])
    assert [k for k, _ in _kinds(c)] == (["gemm"] if rows <= 16 else ["pointwise", "gemm"]), _kinds(c)


def test_cast_of_b_stays_a_kernel():
    """A weight's cast (B = w.float()) is still a kernel of its own: read in B's pack it loses the fast B paths."""
    g = gen(9)
    x, w = rand((1, 2, 67), g), rand((45, 67), g, BF)
    c = _compiled(lambda x, w: F.linear(x, w.float()), (x, w), F32_TOL)
    assert [k for k, _ in _kinds(c)] == ["pointwise", "gemm"], _kinds(c)
