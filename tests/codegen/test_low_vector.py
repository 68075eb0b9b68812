"""float16 pointwise loops and row kernels' sums and store passes as AVX-512 vector code (``vtc.codegen.low_vector``): 16 lanes
a step, the conversions inline (``vtc_v16_*``), where the scalar loop called the conversions' simd clones out of
line for every 16 elements; the scalar loop kept under ``#else`` for targets without AVX-512 / F16C.  bfloat16
kernels keep the scalar loop (its conversions are inline already).

Each case against eager on random inputs (sizes 1, 3, 17, 127; sliced, transposed and strided operands) and, bit
for bit, against the scalar loop (``VECTOR_LOOPS`` off).  The form checks (``_vector``) fail on the code before
(no vector loop: every widening in the loop a ``vtc_from_f16`` call).  A loop of one element whose store does
not move along it keeps the scalar form (size 1: the form is not checked).
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen import low_vector
from vtc.codegen.cpp import generate

from .util import assert_all_generated, assert_matches_eager, compile_cpu, gen, kernels, rand

F = torch.nn.functional
TOL = {torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
SIZES = pytest.mark.parametrize("n", [1, 3, 17, 127])
_SCALAR_CALLS = ("vtc_from_f16(", "vtc_round_f16(", "vtc_to_f16(", "vtc_from_bf16(", "vtc_round_bf16(", "vtc_to_bf16(")


def _vector_blocks(src: str) -> list[str]:
    """The text of each ``#if defined(VTC_V16)`` block of a kernel's body."""
    body = src.split('extern "C" void')[-1]
    return [part.split("#else")[0] for part in body.split(f"#if defined({low_vector.TARGET})")[1:]]


def _vector(compiled, kinds=("pointwise", "row")) -> bool:
    """Every kernel of `kinds` has a vector loop, with no scalar conversion call in it."""
    srcs = [generate(k) for k in kernels(compiled) if k.kind in kinds]
    blocks = [_vector_blocks(s) for s in srcs]
    return bool(srcs) and all(bs and not any(c in b for b in bs for c in _SCALAR_CALLS) for bs in blocks)


def _check(fn, inputs, dtype, vector: bool | None = True, **tol):
    """fn compiled with and without the vector loops: equal bit for bit, within tolerance of eager; the vector
    form where `vector` (and the kernels are float16), none where it is False or the kernels are bfloat16."""
    low_vector.VECTOR_LOOPS = False
    try:
        scalar = compile_cpu(fn, inputs)(*inputs)
    finally:
        low_vector.VECTOR_LOOPS = True
    compiled = compile_cpu(fn, inputs)
    assert_all_generated(compiled)
    assert_matches_eager(compiled, fn, inputs, **(tol or TOL[dtype]))
    assert torch.equal(compiled(*inputs), scalar)
    if vector is not None:
        vector = vector and dtype == torch.float16
        srcs = [generate(k) for k in kernels(compiled)]
        assert _vector(compiled) if vector else not any(_vector_blocks(s) for s in srcs), "\n".join(srcs)
    return compiled


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@DTYPES
@pytest.mark.parametrize("d", [6, 34, 128])
def test_rope(d, dtype):
    g = gen(d)
    x = rand((1, 2, 9, d), g, dtype)
    _check(rope, (x, rand((1, 1, 9, d), g, dtype), rand((1, 1, 9, d), g, dtype)), dtype)


@DTYPES
@SIZES
def test_add_mul_gelu_chain(n, dtype):
    g = gen(n + 1)
    x, y = rand((5, n), g, dtype), rand((5, n), g, dtype)
    _check(lambda x, y: F.gelu(x + y) * y - x * 0.5, (x, y), dtype, vector=n > 1 or None)


@DTYPES
@SIZES
def test_silu_times_broadcast_row(n, dtype):
    g = gen(n + 2)
    x, w = rand((3, 4, n), g, dtype), rand((n,), g, dtype)
    _check(lambda x, w: F.silu(x) * w + torch.exp(-x), (x, w), dtype, vector=n > 1 or None)


@SIZES
def test_float16_with_a_float32_operand(n):
    g = gen(n + 3)
    x, y = rand((7, n), g, torch.float16), rand((7, n), g, torch.float32)
    _check(lambda x, y: (x * 3.0 + y).to(torch.float16) / (x.float() + 4.0), (x, y), torch.float16, vector=n > 1 or None)


@DTYPES
@pytest.mark.parametrize("n", [3, 17, 127])
def test_sliced_operand(n, dtype):
    """A column slice: each row's run starts at an offset, its loads still contiguous."""
    g = gen(n + 4)
    x, y = rand((6, n + 5), g, dtype), rand((6, n), g, dtype)
    _check(lambda x, y: torch.sigmoid(x[:, 2:n + 2]) * y, (x, y), dtype)


@DTYPES
def test_strided_and_transposed_operands_keep_the_scalar_loop(dtype):
    """Loads that do not move along the loop by one element: no vector loop (the results as before)."""
    g = gen(9)
    x, y = rand((17, 34), g, dtype), rand((17, 17), g, dtype)
    _check(lambda x, y: x[:, ::2] * y + 1.0, (x, y), dtype, vector=False)
    x, y = rand((3, 17), g, dtype), rand((17, 3), g, dtype)
    _check(lambda x, y: x.t() * y - y, (x, y), dtype, vector=False)


@DTYPES
def test_a_choice_on_a_compare_keeps_the_scalar_loop(dtype):
    g = gen(10)
    x, y = rand((4, 33), g, dtype), rand((4, 33), g, dtype)
    _check(lambda x, y: torch.where(x > 0, x * y, y - 1.0), (x, y), dtype, vector=False)


@DTYPES
@SIZES
def test_layer_norm_and_softmax_sums_and_store_passes(n, dtype):
    g = gen(n + 5)
    x, w, b = rand((3, n), g, dtype), rand((n,), g, dtype), rand((n,), g, dtype)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=2e-2, atol=2e-2)
    norm = _check(lambda x, w, b: F.layer_norm(x, (n,), w, b), (x, w, b), dtype, vector=n > 1 or None, **tol)
    soft = _check(lambda x: torch.softmax(x * 2.0, -1), (rand((2, 3, n), g, dtype),), dtype, vector=n > 1 or None,
                  **tol)
    if n > 1 and dtype == torch.float16:  # the two sums and the store pass; softmax's sum and store pass (not its max)
        assert [len(_vector_blocks(generate(k))) for c in (norm, soft) for k in kernels(c)] == [3, 2]


def test_switch_off_keeps_the_scalar_loop():
    g = gen(11)
    x, y = rand((4, 40), g, torch.float16), rand((4, 40), g, torch.float16)
    low_vector.VECTOR_LOOPS = False
    try:
        assert not any(_vector_blocks(generate(k)) for k in kernels(compile_cpu(lambda x, y: x * y + x, (x, y))))
    finally:
        low_vector.VECTOR_LOOPS = True


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "scalar"])
def test_targets_without_avx512_build_the_scalar_loop(march, tmp_path):
    """The kernel's source built for a target without AVX-512 (no ``VTC_V16``): the scalar loop, the same
    results bit for bit as the host's build."""
    import ctypes
    import subprocess

    from vtc.codegen.cpp import buffer_order
    from vtc.runtime import cbuild

    g = gen(12)
    x, y = rand((5, 37), g, torch.float16), rand((5, 37), g, torch.float16)
    compiled = compile_cpu(lambda x, y: F.gelu(x + y) * y - x * 0.5, (x, y))
    (k,) = kernels(compiled)
    assert _vector(compiled)
    info = cbuild.compiler_info()
    src, so = tmp_path / "k.cpp", tmp_path / f"k-{march}.so"
    src.write_text(generate(k))
    flags = [f for f in info.flags if not f.startswith("-march")] + [f"-march={march}"]
    subprocess.run([*info.command, str(src), "-o", str(so), *flags], check=True, capture_output=True)
    fn = getattr(ctypes.CDLL(str(so)), k.name)
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int], None
    env = dict(zip([v.name for v in compiled.graph.inputs], (x, y)))
    out = torch.empty(k.stores[0].buffer.shape, dtype=torch.float16)
    tensors = [env[b.name] if b.name in env else out for b in buffer_order(k)]
    fn((ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors]), 1)
    assert torch.equal(out, compiled(x, y))


def test_the_bit_for_bit_checks_compare_vector_code_with_scalar_code_on_an_avx512_host():
    """The kernels' C sees VTC_V16 (so the `#if` blocks the form checks find are what runs, and ``_check``'s bit
    for bit comparison is of vector code against the scalar loop) wherever the generated code targets AVX-512;
    without it every comparison here would be of the scalar loop with itself."""
    import ctypes

    from vtc.codegen.conv_t import has_avx512
    from vtc.codegen.cpp import PRELUDE
    from vtc.codegen.vecmath import LOW_PRECISION_PRELUDE
    from vtc.runtime import cbuild

    if not has_avx512():
        pytest.skip("the generated code does not target AVX-512 here: the vector loops are not compiled in")
    probe = '\nextern "C" int vtc_v16_on() {\n#if defined(VTC_V16)\n  return 1;\n#else\n  return 0;\n#endif\n}\n'
    lib = cbuild.build(PRELUDE + LOW_PRECISION_PRELUDE + probe, name="v16_probe")
    lib.vtc_v16_on.restype = ctypes.c_int
    assert lib.vtc_v16_on() == 1
