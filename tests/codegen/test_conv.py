"""Convolutions in generated kernels (vtc/codegen/conv.py), against torch.

Depthwise convolutions are pointwise kernels; the others implicit GEMMs over a
virtual im2col (the generated GEMM packs straight from the input).

A depthwise convolution reads its input through any mapping in front of it
(channel shuffle, split, pad, cat), and the batch norm / activation after it
are computed in the same kernel.  The tests check the values on random shapes
(odd sizes, strides, padding, dilation, channel multipliers), that the whole
pattern is one generated kernel with no movement materialised, and that a
convolution that is not depthwise is left to torch with the reason recorded.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from .util import (ROW_TOL, as_tuple, assert_all_generated, assert_matches_eager, assert_no_movement, case_seed,
                   channel_shuffle, compile_cpu, gen, kernels, rand, report)

# (batch, channels, multiplier, kernel, stride, padding, dilation, height, width)
CASES = [
    (1, 1, 1, 3, 1, 1, 1, 1, 1),
    (2, 3, 1, 3, 1, 1, 1, 17, 17),
    (1, 8, 2, 3, 2, 1, 1, 16, 15),
    (2, 5, 1, 5, 1, 2, 2, 13, 11),
    (1, 4, 1, 3, 2, 0, 1, 9, 9),
    (3, 6, 1, 1, 1, 0, 1, 7, 3),
    (1, 3, 3, (3, 5), (1, 2), (1, 2), 1, 12, 127),
    (16, 4, 1, 7, 1, 3, 1, 8, 8),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}c{}m{}k{}s{}p{}d{}_{}x{}".format(*c))
def test_depthwise_conv_bn_relu_is_one_kernel(case):
    b, c, mult, k, s, p, d, h, w = case
    g = gen(hash(case) % 1000)
    weight, bias = rand((c * mult, 1, *((k, k) if isinstance(k, int) else k)), g), rand((c * mult,), g)
    mean, var = rand((c * mult,), g), rand((c * mult,), g, positive=True)
    gamma, beta = rand((c * mult,), g), rand((c * mult,), g)

    def fn(x):
        y = F.conv2d(x, weight, bias, s, p, d, groups=c)
        return torch.relu(F.batch_norm(y, mean, var, gamma, beta, training=False, eps=1e-5))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,), plan="all")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_all_generated(compiled)
    assert [kn.kind for kn in kernels(compiled)] == ["pointwise"]


MOVEMENT = {
    "channel_shuffle": lambda x: channel_shuffle(x),
    "split": lambda x: x.chunk(2, dim=1)[1],
    "pad": lambda x: F.pad(x, (1, 2, 0, 1)),
    "cat": lambda x: torch.cat([x, x.flip(1)], dim=1),
    "slice_hw": lambda x: x[:, :, 1:, ::2],
    "permute_nhwc": lambda x: x.permute(0, 3, 1, 2),  # an NHWC tensor read as NCHW
}


@pytest.mark.parametrize("name", sorted(MOVEMENT))
def test_movement_in_front_of_a_depthwise_conv_moves_nothing(name):
    g = gen(7)
    move = MOVEMENT[name]
    x = rand((2, 6, 10, 6), g) if name == "permute_nhwc" else rand((2, 6, 9, 10), g)
    c = move(x).shape[1]
    weight = rand((c, 1, 3, 3), g)

    def fn(x):
        return F.conv2d(torch.relu(move(x)), weight, None, 1, 1, groups=c)

    compiled = compile_cpu(fn, (x,), plan="all")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_no_movement(compiled)
    assert_all_generated(compiled)
    # the relu reads through the movement; it is not inlined into the conv (it would run once per tap)
    assert [k.source_nodes for k in kernels(compiled)] == [["relu"], ["convolution"]]


# (batch, in channels, out channels, kernel, stride, padding, dilation, groups, height, width)
DENSE = [
    (1, 2, 1, 1, 1, 0, 1, 1, 1, 1),
    (2, 8, 6, 1, 1, 0, 1, 1, 9, 9),
    (1, 6, 4, 3, 1, 1, 1, 1, 17, 17),
    (2, 6, 9, 3, 2, 1, 1, 3, 16, 15),
    (1, 4, 5, (3, 5), (2, 1), (1, 2), (1, 2), 1, 13, 13),
    (16, 4, 4, 3, 1, 1, 1, 2, 7, 7),
    (1, 3, 17, 7, 2, 3, 1, 1, 33, 3),
    (1, 32, 130, 3, 1, 1, 1, 1, 12, 12),  # more than one row and column block of the GEMM
]


@pytest.mark.parametrize("case", DENSE, ids=lambda c: "b{}c{}o{}k{}s{}p{}d{}g{}_{}x{}".format(*c))
def test_dense_conv_as_implicit_gemm(case):
    b, c, o, k, s, p, d, groups, h, w = case
    g = gen(case_seed(case, 997))
    kk = (k, k) if isinstance(k, int) else k
    weight, bias = rand((o, c // groups, *kk), g), rand((o,), g)

    def fn(x):
        return F.silu(F.conv2d(x, weight, bias, s, p, d, groups))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_all_generated(compiled)
    assert [(kn.kind, kn.source_nodes) for kn in kernels(compiled)] == [("gemm", ["convolution", "mul"])]  # silu = x * sigmoid(x)


@pytest.mark.parametrize("name", sorted(MOVEMENT))
def test_movement_in_front_of_a_dense_conv_is_packed_through(name):
    """The implicit GEMM (gemm="vtc") packs any input through its mapping: nothing is materialised."""
    g = gen(11)
    move = MOVEMENT[name]
    x = rand((2, 6, 10, 6), g) if name == "permute_nhwc" else rand((2, 6, 9, 10), g)
    c = move(x).shape[1]
    weight = rand((5, c, 3, 3), g)

    def fn(x):
        return F.conv2d(move(x), weight, None, 1, 1)

    compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert [q["choice"] for q in report(compiled)["gemm"]] == ["vtc"]
    assert_no_movement(compiled)
    assert_all_generated(compiled)
    auto = compile_cpu(fn, (x,), plan="all")  # not a wide convolution: generated under gemm="auto" too
    assert [q["choice"] for q in report(auto)["gemm"]] == ["vtc"]
    assert report(auto)["materialized_movement_bytes"] == 0


def test_channel_shuffle_conv_moves_nothing():
    """The issue's pattern: a channel shuffle in front of a 1x1 convolution (ShuffleNet)."""
    g = gen(12)
    weight, bias = rand((8, 8, 1, 1), g), rand((8,), g)

    def fn(x):
        return torch.relu(F.conv2d(channel_shuffle(x), weight, bias))

    x = rand((2, 8, 7, 7), g)
    compiled = compile_cpu(fn, (x,), plan="all")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_no_movement(compiled)
    assert [q["choice"] for q in report(compiled)["gemm"]] == ["vtc"]
    torch_path = compile_cpu(fn, (x,), plan="all", gemm="torch")
    assert_matches_eager(torch_path, fn, (x,), **ROW_TOL)
    assert report(torch_path)["materialized_movement_bytes"] == x.nbytes  # the shuffle copied for torch


def test_gemm_auto_leaves_wide_convolutions_to_torch_with_the_reason():
    """gemm="auto": a wide convolution (output channels x channels x taps per group >= conv.WIDE) on a
    physical input and a map of at least conv.WIDE_PIXELS runs through torch; a narrower one, one on a
    small map, or one behind a channel shuffle, is generated."""
    g = gen(3)
    wide, narrow = rand((256, 64, 3, 3), g) * 0.1, rand((4, 3, 3, 3), g)

    def fn(x):
        return F.conv2d(x, wide, None, 1, 1), F.conv2d(x[:, :6], narrow, None, 1, 1, groups=2)

    x = rand((1, 64, 28, 29), g)
    compiled = compile_cpu(fn, (x,), plan="all")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    first, second = report(compiled)["gemm"]
    assert first["choice"] == "torch" and "wide" in first["why"] and "physical" in first["why"], first
    assert first["shape"] == (1, 256, 812, 576)  # batch x group, M, output pixels, K = channels x taps
    assert second["choice"] == "vtc" and second["shape"] == (2, 2, 812, 27), second

    small = rand((1, 64, 3, 5), g)
    compiled = compile_cpu(fn, (small,), plan="all")
    assert_matches_eager(compiled, fn, (small,), **ROW_TOL)
    first, _ = report(compiled)["gemm"]
    assert first["choice"] == "vtc" and "small map (3x5" in first["why"], first

    def shuffled(x):
        return F.conv2d(channel_shuffle(x), wide, None, 1, 1)

    compiled = compile_cpu(shuffled, (x,), plan="all")
    assert_matches_eager(compiled, shuffled, (x,), **ROW_TOL)
    [choice] = report(compiled)["gemm"]  # behind a shuffle: copy + torch's convolution, or the implicit GEMM
    assert "strided view" in choice["why"] and choice["copy_bytes"] == x.nbytes, choice
    assert choice["choice"] == ("vtc" if choice["vtc_us"] <= choice["torch_us"] else "torch"), choice
    assert report(compiled)["materialized_movement_bytes"] == (0 if choice["choice"] == "vtc" else x.nbytes)


def test_a_nan_in_the_padding_window_is_not_read():
    """Taps in the zero padding are never loaded: a NaN just outside a sliced view does not leak in."""
    g = gen(5)
    weight = rand((3, 1, 3, 3), g)
    big = rand((1, 3, 10, 10), g)
    big[:, :, 0, :] = float("nan")  # row 0 is outside the slice below

    def fn(x):
        return F.conv2d(x[:, :, 1:, :], weight, None, 1, 1, groups=3)

    compiled = compile_cpu(fn, (big,), plan="all")
    assert_matches_eager(compiled, fn, (big,), **ROW_TOL)
    assert not compiled(big).isnan().any()


def _kernel_nodes(compiled) -> list[tuple[str, list[str]]]:
    return [(k.kind, k.source_nodes) for k in kernels(compiled)]


def test_bn_activation_and_residual_run_in_the_gemm_epilogue():
    """conv -> batch norm -> SiLU -> + residual is one kernel: the conv's output is never stored."""
    g = gen(21)
    weight, bias = rand((6, 8, 3, 3), g), rand((6,), g)
    mean, var, gamma, beta = rand((6,), g), rand((6,), g, positive=True), rand((6,), g), rand((6,), g)

    def fn(x, res):
        y = F.conv2d(channel_shuffle(x), weight, bias, 1, 1)
        return F.silu(F.batch_norm(y, mean, var, gamma, beta, False)) + res

    inputs = (rand((2, 8, 9, 9), g), rand((2, 6, 9, 9), g))
    compiled = compile_cpu(fn, inputs, plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, inputs, **ROW_TOL)
    [(kind, nodes)] = _kernel_nodes(compiled)
    assert kind == "gemm" and nodes[0] == "convolution", nodes
    assert report(compiled)["peak_memory_bytes"] == 2 * 6 * 9 * 9 * 4  # the output only: no intermediate buffer


# (batch, in channels, out channels, kernel, height, width)
BN_EPILOGUE = [(1, 2, 1, 1, 1, 1), (1, 3, 17, 3, 5, 7), (16, 17, 3, 1, 3, 17), (1, 127, 130, 1, 3, 3),
               (16, 5, 127, 3, 4, 1)]


@pytest.mark.parametrize("case", BN_EPILOGUE, ids=lambda c: "b{}c{}o{}k{}_{}x{}".format(*c))
def test_batch_norm_scale_is_computed_once_per_output_channel(case):
    """conv -> batch norm -> ReLU: the per-channel scale w / sqrt(var + eps) and shift are row temps of the
    GEMM epilogue, computed before its column loop (gemm._row_temps), not once per output element."""
    b, c, o, k, h, w = case
    g = gen(sum(case))
    weight = rand((o, c, k, k), g)
    mean, var, gamma, beta = rand((o,), g), rand((o,), g, positive=True), rand((o,), g), rand((o,), g)

    def fn(x):
        return torch.relu(F.batch_norm(F.conv2d(x, weight, None, 1, k // 2), mean, var, gamma, beta, False))

    x = rand((b, c, h, w), g)
    compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    [(kind, _)] = _kernel_nodes(compiled)
    src = _sources(compiled)
    epilogue = src[src.index("const int64_t i1 = m0 + ii;"):]
    assert kind == "gemm" and "std::sqrt" in epilogue
    assert epilogue.index("std::sqrt") < epilogue.index("#pragma omp simd"), epilogue[:600]


def test_linear_epilogue_and_where_it_must_not_apply():
    g = gen(22)
    w, b = rand((40, 33), g), rand((40,), g)

    def fused(a):
        return torch.relu(F.linear(a, w, b)) * 2

    def two_readers(a):  # the GEMM result is read by two kernels: it must be stored
        y = F.linear(a, w, b)
        return torch.relu(y), y.sum(-1)

    def output_too(a):  # the GEMM result is a graph output: it must be stored
        y = F.linear(a, w, b)
        return y, torch.tanh(y)

    a = rand((5, 33), g)
    compiled = compile_cpu(fused, (a,), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fused, (a,), **ROW_TOL)
    assert [kind for kind, _ in _kernel_nodes(compiled)] == ["gemm"]
    for fn, want in ((two_readers, ["gemm", "pointwise", "row"]), (output_too, ["gemm", "pointwise"])):
        compiled = compile_cpu(fn, (a,), plan="all", gemm="vtc")
        assert_matches_eager(compiled, fn, (a,), **ROW_TOL)
        assert [kind for kind, _ in _kernel_nodes(compiled)] == want


def test_a_depthwise_conv_after_a_gemm_is_not_its_epilogue():
    """A depthwise conv reads shifted taps of its input: the 1x1 conv before it must store its output."""
    g = gen(23)
    w1, wd = rand((6, 6, 1, 1), g), rand((6, 1, 3, 3), g)

    def fn(x):
        return F.conv2d(torch.relu(F.conv2d(channel_shuffle(x), w1)), wd, None, 1, 1, groups=6)

    x = rand((1, 6, 8, 8), g)
    compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert [kn.kind for kn in kernels(compiled)] == ["gemm", "pointwise"]


# -- the im2col pack by runs and the plane-by-plane depthwise code ----------------------------------
def _sources(compiled) -> str:
    from vtc.codegen.cpp import generate

    return "\n".join(generate(k) for k in kernels(compiled))


FRONT = {
    None: lambda x: x,
    "channel_shuffle": channel_shuffle,
    "split": lambda x: x.chunk(2, dim=1)[1],
    "cat": lambda x: torch.cat([x, x.flip(1)], dim=1),
    "pad": lambda x: F.pad(x, (1, 2, 0, 1)),
}

# (batch, channels of x, out channels, kernel, stride, padding, dilation, groups, height, width, in front,
#  how the pack copies a run: vector loads at stride 1 or 2 of a plain load with unit stride along the
#  width ("run", "run2"), else an element loop ("loop"); "shifted": stride 1 with output rows as long as
#  input rows, 16 pixels per masked load across row ends, runs where the tile is not 16-aligned)
PACKED = [
    (1, 6, 5, 3, 2, 1, 1, 1, 17, 3, "cat", "run2"),  # stride 2: even lanes of two loads
    (2, 4, 3, 3, 3, 1, 1, 1, 11, 13, "split", "loop"),  # stride 3: an element loop per run
    (16, 8, 6, 3, 1, 2, 2, 2, 7, 9, "channel_shuffle", "shifted"),  # dilation, groups, batch 16
    (1, 4, 6, 3, 1, 0, 1, 1, 9, 8, "channel_shuffle", "run"),  # no padding: output rows are shorter
    (1, 8, 3, 1, 1, 0, 1, 1, 1, 127, "split", "run"),  # 1x1: one run per panel row
    (2, 5, 7, 1, 1, 0, 1, 1, 3, 17, "cat", "run"),  # 1x1 over a cat: the piece decided per row
    (1, 5, 4, (1, 3), 1, (0, 1), 1, 1, 5, 40, "pad", "loop"),  # the pad's zeros are a choice inside the run
    (16, 6, 8, 3, 1, 1, 1, 1, 17, 17, None, "shifted"),
    # more output pixels than one column block of the pack (conv.PACK_COLS): blocks of 256, then the rest
    (1, 4, 17, 3, 1, 1, 1, 1, 23, 23, "channel_shuffle", "shifted"),
    (16, 3, 5, 1, 1, 0, 1, 1, 17, 31, "cat", "run"),
    (1, 4, 3, 3, 1, 1, 1, 1, 127, 3, "pad", "loop"),
]


@pytest.mark.parametrize("case", PACKED, ids=lambda c: "b{}c{}o{}k{}s{}p{}d{}g{}_{}x{}_{}".format(*c[:11]))
def test_implicit_gemm_packs_im2col_runs_through_the_mapping(case):
    b, c, o, k, s, p, d, groups, h, w, front, copy = case
    g = gen(case_seed(case, 991))
    move = FRONT[front]
    x = rand((b, c, h, w), g)
    cin = move(x).shape[1]
    kk = (k, k) if isinstance(k, int) else k
    weight, bias = rand((o, cin // groups, *kk), g), rand((o,), g)

    def fn(x):
        return torch.relu(F.conv2d(move(x), weight, bias, s, p, d, groups))

    compiled = compile_cpu(fn, (x,), plan="all", gemm="vtc")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_no_movement(compiled)
    assert [(kn.kind, kn.source_nodes[0]) for kn in kernels(compiled)] == [("gemm", "convolution")]
    src = _sources(compiled)
    assert ["cv_masks.rows" in src, "vtc_conv_run(dst" in src, "vtc_conv_run2(dst" in src] == \
        [copy == "shifted", copy in ("run", "shifted"), copy == "run2"]


def test_implicit_gemm_never_reads_outside_a_sliced_view():
    """The masked run copies load only inside the input: a NaN just outside a sliced view does not leak in."""
    g = gen(6)
    weight = rand((4, 3, 3, 3), g)
    big = rand((2, 3, 10, 12), g)
    big[:, :, 0, :] = float("nan")  # row 0 and the last columns are outside the slice below
    big[:, :, :, 10:] = float("nan")

    def fn(x):  # rows shorter than the input's: runs
        return F.conv2d(x[:, :, 1:, :10], weight, None, 1, 1)

    def whole_rows(x):  # whole rows: shifted loads across row ends
        return F.conv2d(x[:, :, 1:, :], weight, None, 1, 1)

    big2 = rand((2, 3, 10, 12), g)
    big2[:, :, 0, :] = float("nan")
    for f, x in ((fn, big), (whole_rows, big2)):
        compiled = compile_cpu(f, (x,), plan="all", gemm="vtc")
        assert_matches_eager(compiled, f, (x,), **ROW_TOL)
        assert not any(t.isnan().any() for t in as_tuple(compiled(x)))
        assert ("cv_masks.rows" in _sources(compiled)) == (f is whole_rows)


# (batch, channels, multiplier, kernel, stride, padding, dilation, height, width, in front, emitted as)
PLANES = [
    (1, 6, 1, 3, 1, 1, 1, 28, 28, "channel_shuffle", "flat"),
    (16, 8, 1, 3, 1, 1, 1, 7, 7, "split", "flat"),  # batch 16, 7x7 maps: chunks across rows
    (2, 3, 2, 5, 1, 2, 1, 9, 17, "cat", "flat"),  # channel multiplier, a cat decided per plane
    (1, 4, 1, 3, 2, 1, 1, 17, 33, "channel_shuffle", "rows"),  # stride 2: even lanes of two loads
    (16, 3, 1, 3, 3, 1, 1, 10, 11, None, "rows"),  # stride 3: masked gathers
    (1, 3, 1, 3, 1, 2, 2, 5, 3, None, "flat"),  # dilation
    (1, 2, 1, 3, 1, 0, 1, 3, 127, None, "rows"),  # no padding: output rows shorter than input rows
    (3, 4, 1, 7, 1, 3, 1, 1, 1, None, "flat"),  # a 1x1 map: every tap but the centre in the padding
    (1, 4, 1, 3, 1, 1, 1, 6, 5, "pad", "generic"),  # a pad in front: its zeros are a choice per element
]


@pytest.mark.parametrize("case", PLANES, ids=lambda c: "b{}c{}m{}k{}s{}p{}d{}_{}x{}_{}".format(*c[:10]))
def test_depthwise_conv_plane_by_plane(case):
    b, c, mult, k, s, p, d, h, w, front, emitted = case
    g = gen(case_seed(case, 983))
    move = FRONT[front]
    x = rand((b, c, h, w), g)
    cin = move(x).shape[1]
    weight, bias = rand((cin * mult, 1, k, k), g), rand((cin * mult,), g)
    scale, shift = rand((cin * mult, 1, 1), g), rand((cin * mult, 1, 1), g)

    def fn(x):
        return F.hardswish(F.conv2d(move(x), weight, bias, s, p, d, groups=cin) * scale + shift)

    compiled = compile_cpu(fn, (x,), plan="all")
    assert_matches_eager(compiled, fn, (x,), **ROW_TOL)
    assert_no_movement(compiled)
    assert [kn.kind for kn in kernels(compiled)] == ["pointwise"]
    src = _sources(compiled)
    # (the flat form: one masked load per tap, "masks.m", or a wide one's two loads per tap row, "rmask.m")
    flat = "masks.m" in src or "rmask.m" in src
    assert {"flat": flat, "rows": "cols.m" in src, "generic": "_mm512" not in src}[emitted], src
    if emitted != "generic":  # the per-channel scale and shift are read once per plane, before its rows (or
        # before its one loop over the whole plane, vtc.codegen.depthwise._flat_epilogue)
        plane = src[src.index("for (int64_t pl = 0"):src.index("dw_sum = tmp")]
        loop = r"#pragma omp simd\n\s*for \(int64_t q = " if emitted == "flat" else r"for \(int64_t i2 = "
        assert re.search(r"const float t\d+ = .*\n\s*" + loop, plane), plane


@pytest.mark.parametrize("residual", [False, True], ids=["plane_loop", "residual_rows"])
def test_depthwise_epilogue_over_the_whole_plane_unless_it_reads_along_it(residual):
    """A flat depthwise kernel's batch norm runs as one loop over the 7x7 plane; a residual read along the plane
    keeps the loop over rows (vtc.codegen.depthwise._flat_epilogue)."""
    g = gen(77 + residual)
    x, r = rand((16, 17, 7, 7), g), rand((16, 17, 7, 7), g)
    weight, scale, shift = rand((17, 1, 3, 3), g), rand((17, 1, 1), g), rand((17, 1, 1), g)

    def fn(x, r):
        y = F.conv2d(x, weight, None, 1, 1, groups=17) * scale + shift
        return y + r if residual else y

    compiled = compile_cpu(fn, (x, r), plan="all")
    assert_matches_eager(compiled, fn, (x, r), **ROW_TOL)
    src = _sources(compiled)
    assert ("masks.m" in src or "rmask.m" in src) and ("for (int64_t q = 0; q < 49; ++q)" in src) != residual, src
