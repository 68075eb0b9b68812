"""Row kernels of float32 sums in blocks of rows (vtc.codegen.row_blocks, switched on here) against torch eager and
float64, and the layer norm's shifted mean (vtc.codegen.ops.SHIFTED_MEAN: no worse than twice torch's error).

Layer norms and RMS norms over rows of 1, 3, 17, 127, 96 and 192 elements, on inputs whose mean is large next to
their spread (randn * 0.1 + 100: the mean's sum and the variance are where float32 loses digits), in row counts
that leave a partial last block (5 rows, blocks of 4), read through non-contiguous mappings (a slice with a row
stride, Swin's roll + window partition, a transpose that the rows-as-lanes kernel takes instead), with the mean and
rstd outputs stored, on two threads, and built for a target without AVX-512 (the plain row kernel after ``#else``).
"""
from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch
import torch.nn.functional as F

from vtc.codegen import low_vector, row_blocks
from vtc.codegen.cpp import buffer_order, generate

from .util import assert_all_generated, compile_cpu, gen, kernels, torch_threads

WIDTHS = pytest.mark.parametrize("n", [1, 3, 17, 127, 96, 192])


@pytest.fixture(autouse=True)
def blocks_on():
    """The blocks are off by default (row_blocks.BLOCKS, module doc): on for these tests."""
    row_blocks.BLOCKS = True
    try:
        yield
    finally:
        row_blocks.BLOCKS = False


def _blocked(compiled) -> bool:
    """Whether a row kernel of `compiled` runs in blocks of rows where the target has AVX-512."""
    return any(k.kind == "row" and f"#if defined({low_vector.TARGET})" in (src := generate(k))
               and "_mm512_reduce_add_ps(p_" in src for k in kernels(compiled))


def _large_mean(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen(seed)) * 0.1 + 100


def _affine(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(seed)
    return 1 + 0.1 * torch.randn(n, generator=g), 0.1 * torch.randn(n, generator=g)


def _check_layer_norm(f, x, w, b, n: int, blocked: bool = True):
    """f(x, w, b) (a layer norm over the last dim, maybe through a mapping) compiled: in blocks of rows iff
    `blocked`; against float64 no worse than twice torch's float32 error, and within 1e-3 of torch."""
    compiled = compile_cpu(f, (x, w, b))
    assert_all_generated(compiled)
    assert _blocked(compiled) == blocked
    got, eager = compiled(x, w, b), f(x, w, b)
    exact = f(x.double(), w.double(), b.double())
    err, torch_err = (got.double() - exact).abs().max().item(), (eager.double() - exact).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"vtc {err:.3g} vs float64, torch {torch_err:.3g}"
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-3)  # float32 carries 8e-6 at 100, over a spread of 0.1
    return compiled


@WIDTHS
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_layer_norm_rows_of_a_large_mean(n, rows):
    x, (w, b) = _large_mean((rows, n), n + rows), _affine(n, n)
    _check_layer_norm(lambda x, w, b: F.layer_norm(x, (n,), w, b), x, w, b, n, blocked=n > 1)  # n = 1: no r loop


@WIDTHS
def test_blocks_give_the_plain_kernels_results(n):
    """The same sums in another order: within a few float32 steps of the one-row-at-a-time kernel."""
    x, (w, b) = _large_mean((7, n), 10 + n), _affine(n, 11 + n)
    f = lambda x, w, b: F.layer_norm(x, (n,), w, b)  # noqa: E731
    row_blocks.BLOCKS = False
    plain = compile_cpu(f, (x, w, b))
    assert not _blocked(plain)
    want = plain(x, w, b)
    row_blocks.BLOCKS = True
    torch.testing.assert_close(compile_cpu(f, (x, w, b))(x, w, b), want, rtol=0, atol=5e-4)


@pytest.mark.parametrize("n", [17, 96])
def test_rows_sliced_out_of_a_wider_tensor(n):
    """Rows 1..n of rows of n + 3 elements: each row contiguous, at an offset that is not a multiple of 16."""
    wide, (w, b) = _large_mean((6, n + 3), 20 + n), _affine(n, 21 + n)
    _check_layer_norm(lambda x, w, b: F.layer_norm(x[:, 1:n + 1], (n,), w, b), wide, w, b, n)


def test_rows_read_through_roll_and_window_partition():
    """Swin's layer norm after the roll and the 7 x 7 window partition: each row a pixel's channels."""
    c = 96

    def f(x, w, b):
        x = torch.roll(x.view(1, 14, 14, c), shifts=(-3, -3), dims=(1, 2))
        x = x.view(1, 2, 7, 2, 7, c).permute(0, 1, 3, 2, 4, 5).reshape(4, 49, c)
        return F.layer_norm(x, (c,), w, b)

    x, (w, b) = _large_mean((1, 196, c), 30), _affine(c, 31)
    _check_layer_norm(f, x, w, b, c)


def test_rows_read_across_a_transpose_take_the_lanes_kernel():
    """A row that steps through memory (x.t()): rows as vector lanes (vtc.codegen.lanes), not blocks."""
    x, (w, b) = _large_mean((96, 10), 40), _affine(96, 41)
    _check_layer_norm(lambda x, w, b: F.layer_norm(x.t(), (96,), w, b), x, w, b, 96, blocked=False)


def test_rows_longer_than_max_r_stay_one_at_a_time():
    n = row_blocks.MAX_R + 1
    x, (w, b) = _large_mean((5, n), 50), _affine(n, 51)
    _check_layer_norm(lambda x, w, b: F.layer_norm(x, (n,), w, b), x, w, b, n, blocked=False)


@WIDTHS
def test_rms_norm_rows(n):
    x, (w, _) = _large_mean((5, n), 60 + n), _affine(n, 61 + n)
    f = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # noqa: E731
    compiled = compile_cpu(f, (x, w))
    assert _blocked(compiled) == (n > 1)
    torch.testing.assert_close(compiled(x, w), f(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [3, 96])
def test_mean_and_rstd_outputs(n):
    """native_layer_norm's three outputs: the row's mean and 1 / std stored once per row of the block."""
    x, (w, b) = _large_mean((5, n), 70 + n), _affine(n, 71 + n)
    f = lambda x, w, b: torch.ops.aten.native_layer_norm(x, [n], w, b, 1e-5)  # noqa: E731
    compiled = compile_cpu(f, (x, w, b))
    assert _blocked(compiled)
    for got, want, atol in zip(compiled(x, w, b), f(x, w, b), (1e-3, 1e-5, 1e-2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)


def test_two_threads_split_the_blocks():
    n, rows = 96, 401  # 101 blocks, the last of one row; 38 K elements: above PARALLEL_MIN_WORK
    x, (w, b) = _large_mean((rows, n), 80), _affine(n, 81)
    with torch_threads(2):
        _check_layer_norm(lambda x, w, b: F.layer_norm(x, (n,), w, b), x, w, b, n)


def test_a_target_without_avx512_builds_the_plain_kernel(tmp_path):
    """The kernel's source built for AVX2 (no ``VTC_V16``): the one-row-at-a-time kernel after ``#else``, the
    same results within float32 steps of the host's blocks."""
    from vtc.runtime import cbuild

    n = 17
    x, (w, b) = _large_mean((5, n), 90), _affine(n, 91)
    compiled = compile_cpu(lambda x, w, b: F.layer_norm(x, (n,), w, b), (x, w, b))
    (k,) = kernels(compiled)
    assert _blocked(compiled)
    info = cbuild.compiler_info()
    src, so = tmp_path / "k.cpp", tmp_path / "k-avx2.so"
    src.write_text(generate(k))
    flags = [f for f in info.flags if not f.startswith("-march")] + ["-march=x86-64-v3"]
    subprocess.run([*info.command, str(src), "-o", str(so), *flags], check=True, capture_output=True)
    fn = getattr(ctypes.CDLL(str(so)), k.name)
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int], None
    env = dict(zip([v.name for v in compiled.graph.inputs], (x, w, b)))
    out = torch.empty(k.stores[0].buffer.shape)
    tensors = [env[buf.name] if buf.name in env else out for buf in buffer_order(k)]
    fn((ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors]), 1)
    torch.testing.assert_close(out, compiled(x, w, b), rtol=0, atol=5e-4)


def test_new_row_counts_reuse_the_size_generic_kernel():
    """The block count is (rows + 3) / 4 in the source, a polynomial of the sizes: new row counts (a partial last
    block or none) run the kernel built once, without the C++ compiler."""
    import vtc
    from vtc.runtime import cbuild

    n = 96
    (w, b) = _affine(n, 100)
    f = lambda x, w, b: F.layer_norm(x, (n,), w, b)  # noqa: E731
    compiled = vtc.compile(f, (_large_mean((2, 7, n), 101), w, b), dynamic=True)
    x = _large_mean((3, 9, n), 102)  # new sizes: the symbolic capture and the generic kernels are made
    torch.testing.assert_close(compiled(x, w, b), f(x, w, b), rtol=0, atol=1e-3)
    assert _blocked(compiled)
    built = cbuild.compile_count
    for shape in [(2, 5, n), (4, 13, n), (5, 4, n)]:
        x = _large_mean(shape, sum(shape))
        torch.testing.assert_close(compiled(x, w, b), f(x, w, b), rtol=0, atol=1e-3)
    assert cbuild.compile_count == built, "a new row count ran the C++ compiler"
