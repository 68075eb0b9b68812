"""float16 GEMMs as generated kernels (vtc.codegen.gemm ``narrowed``): mm / bmm / addmm / baddbmm on float16
operands, widened to float32 as the pack loops (or the dot path) read them, summed in float32, rounded to float16
once per output element, as eager's float16 GEMM on CPU does (it accumulates in float32 and adds addmm's bias
before its one rounding: 99.95% of a 64 x 96 addmm equal the float64 value rounded once, 73% the product rounded
first then the bias added).  Products large enough that the generated kernel is clearly faster are compiled
under gemm="auto", the smallest (where torch's takes as long: ~6 us) under gemm="vtc"; either way the report's
choice must be the generated kernel (all of them ran torch's float16 GEMM before: "the generated GEMM is float32
(or all bf16) only").  torch.baddbmm is not here: the frontend's decomposition runs it as a float32 bmm of
widened operands.

Tolerance (``_assert_fp16_close``): every element within one float16 unit in the last place of eager's plus
2^-16 of the sum of the products' magnitudes (both sum in float32, in other orders: where the sum cancels, the
float32 rounding is a sizable part of a small result's ulp), and at least 97% of the elements equal to eager's
bit for bit; a result rounded twice (the product, then the bias or an op) is ~27% off and fails it.
``_rounded_once`` checks the bias case against float64 directly."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .util import compile_cpu, gen, kernels, rand, report, steps, torch_threads

H = torch.float16
SAME_AT_LEAST = 0.97  # fraction of elements equal to eager's bit for bit


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """float16's unit in the last place at the magnitude of x (subnormal spacing below 2^-14)."""
    mag = x.float().abs().clamp_min(2.0 ** -14)
    return torch.exp2(torch.floor(torch.log2(mag)) - 10)


def _magnitude(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a| @ |b| in float64: the sum of the magnitudes of each output's products."""
    return a.double().abs() @ b.double().abs()


def _assert_fp16_close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    diff = (got.double() - want.double()).abs()
    tol = _ulp(want).double() + 2.0 ** -16 * magnitude
    assert bool((diff <= tol).all()), f"past the tolerance: {(diff - tol).max().item()} (max diff {diff.max().item()})"
    same = (got == want).float().mean().item()
    assert same >= SAME_AT_LEAST, f"only {same:.4f} of the elements equal eager's"


def _rounded_once(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Fraction of got equal to the float64 value rounded to float16 once."""
    return (got == exact.to(H)).float().mean().item()


def _generated(fn, inputs, magnitude, *, gemm: str = "auto", threads: int | None = None, kinds=("gemm",)):
    """fn compiled under `gemm`: its GEMMs generated (the report's choice "vtc"), nothing through torch, the kernels
    `kinds`; the result matches eager at float16's tolerance (`magnitude`: of the sums, ``_magnitude``)."""
    c = compile_cpu(fn, inputs, gemm=gemm)
    with torch_threads(threads):
        got, want = c(*inputs), fn(*inputs)
    choices = [(g["choice"], g["why"]) for g in report(c)["gemm"]]
    assert choices and all(ch == "vtc" for ch, _ in choices), choices
    assert [s.node.op for s in steps(c, "run")] == []
    assert tuple(k.kind for k in kernels(c)) == kinds, [k.kind for k in kernels(c)]
    _assert_fp16_close(got, want, magnitude)
    return c, got, want


@pytest.mark.parametrize("m", [1, 3, 17, 127])
def test_fp16_linear_with_bias(m):
    """F.linear with bias (addmm, B = W^T): the dot path reading the float16 weight in place (m <= 16) and the
    panels; K odd, N not a multiple of 32 (and large enough that one row is clearly faster generated: a 1 x 301
    -> 45 product takes ~5.5 us either way, and "auto" leaves torch those); the bias added before the one
    rounding."""
    g = gen(60 + m)
    x, w, b = rand((m, 301), g, H), rand((600, 301), g, H), rand((600,), g, H)
    c, got, want = _generated(lambda x, w, b: F.linear(x, w, b), (x, w, b), _magnitude(x, w.t()) + b.double().abs())
    assert report(c)["gemm"][0]["path"] == ("dot" if m <= 16 else "panels")
    exact = x.double() @ w.double().t() + b.double()
    assert _rounded_once(got, exact) >= 0.99 and _rounded_once(want, exact) >= 0.99


@pytest.mark.parametrize("m", [1, 17])
def test_fp16_mm_row_major_b(m):
    """x @ W with W [K, N] row-major (torch's float16 kernel is slowest there: 0.6 GFLOPS): B widened into the
    panels."""
    g = gen(70 + m)
    x, w = rand((m, 130), g, H), rand((130, 300), g, H)
    _generated(lambda x, w: x @ w, (x, w), _magnitude(x, w))


@pytest.mark.parametrize("batch", [1, 16])
def test_fp16_bmm_transposed_operand(batch):
    """q @ k^T per head: B a transposed view read along k, A sliced (every other feature dropped)."""
    g = gen(80 + batch)
    q, k = rand((batch, 33, 128), g, H), rand((batch, 40, 64), g, H)
    _generated(lambda q, k: q[:, :, ::2] @ k.transpose(1, 2), (q, k), _magnitude(q[:, :, ::2], k.transpose(1, 2)))


def test_fp16_bmm_cat_and_gqa_operands():
    """A a cat along the rows, B the GQA expansion of 2 KV heads over 8 query heads (expand + reshape: head h
    reads KV head h // 4), both read through their mappings; then the scores' transpose as A of a second bmm."""
    g = gen(90)
    a1, a2 = rand((8, 10, 32), g, H), rand((8, 7, 32), g, H)
    kv = rand((1, 2, 32, 24), g, H)

    def fn(a1, a2, kv):
        a = torch.cat([a1, a2], dim=1)  # [8, 17, 32]
        b = kv[:, :, None].expand(1, 2, 4, 32, 24).reshape(8, 32, 24)
        s = a @ b  # [8, 17, 24]
        return s.transpose(1, 2) @ a  # [8, 24, 32]

    a = torch.cat([a1, a2], dim=1)
    b = kv[:, :, None].expand(1, 2, 4, 32, 24).reshape(8, 32, 24)
    # the second product reads the first one's float16 result, where a sum in another order may round one ulp
    # (2^-10 relative) apart: 2^6 x the tolerance's 2^-16 of its magnitude
    magnitude = 2.0 ** 6 * _magnitude(_magnitude(a, b).transpose(1, 2), a)
    _generated(fn, (a1, a2, kv), magnitude, kinds=("gemm", "gemm"))


@pytest.mark.parametrize("m", [3, 40])
def test_fp16_linear_epilogue(m):
    """Linear + GELU + residual: one kernel, the product rounded to float16 before the GELU and each op rounded
    as eager rounds it (the epilogue as bf16's, vtc.codegen.gemm_bf16)."""
    g = gen(100 + m)
    x, w, b, r = rand((m, 96), g, H), rand((80, 96), g, H), rand((80,), g, H), rand((m, 80), g, H)
    _generated(lambda x, w, b, r: F.gelu(F.linear(x, w, b)) + r, (x, w, b, r),
               _magnitude(x, w.t()) + b.double().abs() + r.double().abs(), gemm="auto" if m > 16 else "vtc")


def test_fp16_mm_into_float32():
    """An mm whose one reader casts it to float32 and scales it: the float32 epilogue reads the product rounded
    to float16 (as eager's .float() of the float16 result)."""
    g = gen(110)
    x, w = rand((64, 200), g, H), rand((200, 96), g, H)
    c = compile_cpu(lambda x, w: (x @ w).float() * 2, (x, w))
    got, want = c(x, w), (x @ w).float() * 2
    assert [k.kind for k in kernels(c)] == ["gemm"] and [g["choice"] for g in report(c)["gemm"]] == ["vtc"]
    assert got.dtype == torch.float32
    _assert_fp16_close((got / 2).to(H), (want / 2).to(H), _magnitude(x, w))
    assert bool(((got / 2).to(H).float() == got / 2).all())  # the product was rounded to float16 first


@pytest.mark.parametrize("threads", [2, 3])
def test_fp16_threads(threads):
    """Products that fork: the panels (128 x 256 -> 200) and the dot path (8 rows -> 1024) on 2-3 threads."""
    g = gen(120 + threads)
    x, w, b = rand((128, 256), g, H), rand((200, 256), g, H), rand((200,), g, H)
    _generated(lambda x, w, b: F.linear(x, w, b), (x, w, b), _magnitude(x, w.t()) + b.double().abs(), threads=threads)
    x, w = rand((8, 256), g, H), rand((1024, 256), g, H)
    _generated(lambda x, w: F.linear(x, w), (x, w), _magnitude(x, w.t()), threads=threads)


def test_fp16_large_result():
    """A result past NARROWED_KEEP floats (300 x 4000): its float32 sums in each thread's C of its blocks
    (``_narrowed_c``); called twice."""
    g = gen(125)
    x, w = rand((300, 256), g, H), rand((4000, 256), g, H)
    c, _, want = _generated(lambda x, w: F.linear(x, w), (x, w), _magnitude(x, w.t()))
    _assert_fp16_close(c(x, w), want, _magnitude(x, w.t()))


def test_fp16_llama_end_to_end():
    """A float16 transformers LlamaForCausalLM (2 layers, hidden 256, GQA 4 / 2 heads, 2 x 16 tokens) compiled end
    to end under gemm="auto": every GEMM generated, the logits within 2 float16 ulps of eager's plus 2^-9 of their
    largest magnitude (two layers of float16 roundings in other orders).  (The hf_models factories' hidden 64 at a
    few tokens are products of ~10 us, which "auto" leaves to torch.)"""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    model = tf.LlamaForCausalLM(cfg).eval().half()
    ids = torch.randint(1, 300, (2, 16))
    c = compile_cpu(model, (ids,))
    with torch.no_grad():
        got, want = c(ids).logits, model(ids).logits
    gemms = report(c)["gemm"]
    assert len(gemms) == 15 and all(g["choice"] == "vtc" for g in gemms), [(g["choice"], g["why"]) for g in gemms]
    assert not [s.node.op for s in steps(c, "run") if "mm" in s.node.op]
    assert got.dtype == H
    diff = (got.double() - want.double()).abs()
    tol = 2 * _ulp(want).double() + 2.0 ** -9 * want.double().abs().max()
    assert bool((diff <= tol).all()), diff.max().item()


# -- float16 convolutions: vtc.codegen.conv's implicit GEMM on the panels, widened the same way ----------------
def _conv_magnitude(x, w, **kw) -> torch.Tensor:
    return F.conv2d(x.double().abs(), w.double().abs(), **kw)


@pytest.mark.parametrize("case", ["3x3", "1x1", "grouped_stride2_relu", "shuffled_input"])
def test_fp16_conv2d(case):
    """Non-depthwise float16 convolutions (torch's took 11-23x its float32 time here): a 3x3 "same" one with bias,
    a 1x1, a grouped stride-2 one with a ReLU epilogue, one reading a channel shuffle through its mapping; one
    kernel each, the im2col widened by the pack, the result rounded once."""
    g = gen(130 + len(case))
    if case == "3x3":
        x, w, b = rand((2, 16, 13, 13), g, H), rand((24, 16, 3, 3), g, H), rand((24,), g, H)
        fn = lambda x, w, b: F.conv2d(x, w, b, padding=1)  # noqa: E731
        mag = _conv_magnitude(x, w, padding=1) + b.double().abs()[:, None, None]
        inputs = (x, w, b)
    elif case == "1x1":
        x, w = rand((1, 40, 14, 14), g, H), rand((36, 40, 1, 1), g, H)
        fn, mag, inputs = (lambda x, w: F.conv2d(x, w)), _conv_magnitude(x, w), (x, w)
    elif case == "grouped_stride2_relu":
        x, w, b = rand((2, 24, 17, 17), g, H), rand((48, 12, 3, 3), g, H), rand((48,), g, H)
        fn = lambda x, w, b: F.relu(F.conv2d(x, w, b, stride=2, padding=1, groups=2))  # noqa: E731
        mag = _conv_magnitude(x, w, stride=2, padding=1, groups=2) + b.double().abs()[:, None, None]
        inputs = (x, w, b)
    else:
        x, w = rand((1, 32, 12, 12), g, H), rand((32, 32, 1, 1), g, H)

        def fn(x, w):
            y = x.view(1, 2, 16, 12, 12).transpose(1, 2).reshape(1, 32, 12, 12)  # ShuffleNet's channel shuffle
            return F.conv2d(y, w)

        mag = _conv_magnitude(x.view(1, 2, 16, 12, 12).transpose(1, 2).reshape(1, 32, 12, 12), w)
        inputs = (x, w)
    c = compile_cpu(fn, inputs)
    got, want = c(*inputs), fn(*inputs)
    assert [(g["choice"], g["path"]) for g in report(c)["gemm"]] == [("vtc", "panels")]
    assert [k.kind for k in kernels(c)] == ["gemm"] and [s.node.op for s in steps(c, "run")] == []
    _assert_fp16_close(got, want, mag)


def test_fp16_conv_epilogue():
    """Conv2d with bias + SiLU + a residual add in float16: one kernel, the convolution rounded to float16 before
    the SiLU and each op rounded as eager rounds it.  (A float16 BatchNorm2d after a convolution:
    tests/codegen/test_pool_low_precision.py.)"""
    g = gen(140)
    x, w, b, r = rand((1, 16, 20, 20), g, H), rand((32, 16, 3, 3), g, H), rand((32,), g, H), rand((1, 32, 20, 20), g, H)
    fn = lambda x, w, b, r: F.silu(F.conv2d(x, w, b, padding=1)) + r  # noqa: E731
    c = compile_cpu(fn, (x, w, b, r))
    got, want = c(x, w, b, r), fn(x, w, b, r)
    assert [g["choice"] for g in report(c)["gemm"]] == ["vtc"]
    assert [k.kind for k in kernels(c)] == ["gemm"] and [s.node.op for s in steps(c, "run")] == []
    _assert_fp16_close(got, want, _conv_magnitude(x, w, padding=1) + b.double().abs()[:, None, None] + r.double().abs())
