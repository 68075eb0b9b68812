"""Skinny GEMMs with a long reduction as packed dot products (vtc.codegen.gemm_dot), a single-use pointwise
producer priced on torch's side and packed along its unit stride (vtc.codegen.gemm_inline), and
EfficientViT's ReLU linear attention, which uses both, against eager on random inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.workloads.efficientvit import LiteMLA
from vtc.codegen import gemm_dot

from .util import compile_cpu, gen, kernels, rand, report

GEMM_TOL = dict(rtol=1e-4, atol=2e-4)


def _check(fn, inputs, tol=GEMM_TOL, **options):
    c = compile_cpu(fn, inputs, **options)
    with torch.no_grad():
        torch.testing.assert_close(c(*inputs), fn(*inputs), **tol)
    return c


def _kv(k, v):
    """k^T [v, 1] per head: B = a padded, transposed slice (unit stride along the reduction), A = relu(k)^T."""
    return torch.matmul(F.relu(k).transpose(-1, -2), F.pad(v, (0, 1), value=1.0))


@pytest.mark.parametrize("batch,pixels,dim", [(1, 784, 16), (16, 127, 5), (1, 64, 1), (3, 257, 16)])
def test_transposed_padded_b_runs_as_packed_dot_products(batch, pixels, dim):
    """M = dim <= 16, N = dim + 1, K = pixels >= 64: dot products, both operands packed as rows through the
    transpose, slice and pad; nothing materialised."""
    g = gen(pixels + dim + batch)
    x = rand((batch, 2, 3 * dim, pixels), g)

    def fn(x):
        t = x.transpose(-1, -2)
        return _kv(t[..., dim:2 * dim], t[..., 2 * dim:])

    c = _check(fn, (x,), gemm="vtc")
    (choice,) = report(c)["gemm"]
    assert choice["path"] == gemm_dot.PATH, choice
    assert report(c)["materialized_movement_bytes"] == 0
    assert [k.kind for k in kernels(c)] == ["gemm"]  # the ReLU is computed in the pack loop


def test_packed_dot_accumulates_over_reduction_slices_and_column_blocks():
    """K = 4100 (three slices of the skinny KC), N = 64 and M = 16: the dot products add over the slices."""
    g = gen(3)
    a, b = rand((3, 16, 4100), g), rand((3, 64, 4100), g)
    c = _check(lambda a, b: torch.bmm(torch.relu(a), b.transpose(1, 2)), (a, b), tol=dict(rtol=1e-4, atol=2e-3),
               gemm="vtc")
    assert report(c)["gemm"][0]["path"] == "dot" or report(c)["gemm"][0]["path"] == gemm_dot.PATH


def test_short_reduction_or_wide_output_keeps_the_panels():
    g = gen(4)
    short = _check(lambda x: _kv(x[..., :16], x[..., 16:]), (rand((2, 40, 32), g),), gemm="vtc")
    assert report(short)["gemm"][0]["path"] != gemm_dot.PATH  # K = 40 < DOT_MIN_K
    wide = _check(lambda x, y: torch.relu(x).transpose(1, 2) @ F.pad(y, (0, 1), value=1.0),
                  (rand((2, 300, 16), g), rand((2, 300, 80), g)), gemm="vtc")
    assert report(wide)["gemm"][0]["path"] != gemm_dot.PATH  # N = 81 > DOT_MAX_N


@pytest.mark.parametrize("batch", [1, 16])
def test_pointwise_producer_of_a_transposed_a_is_computed_in_the_pack_under_auto(batch):
    """relu(q) @ kv with q a transposed slice (unit stride along M): torch would need relu(q) in memory, so
    auto generates the GEMM, whose pack computes the ReLU along the rows' unit stride (odd M, K)."""
    g = gen(5 + batch)
    heads = 24 if batch == 1 else 2  # enough work for the estimates to differ by more than their margin
    x, kv = rand((batch, heads, 7, 785), g), rand((batch, heads, 5, 6), g)

    def fn(x, kv):
        q = x.transpose(-1, -2)[..., 2:7]
        return torch.matmul(F.relu(q), kv)

    c = _check(fn, (x, kv))
    (choice,) = report(c)["gemm"]
    assert choice["choice"] == "vtc" and "%relu" in choice["why"], choice
    assert [k.kind for k in kernels(c)] == ["gemm"]
    assert report(c)["materialized_movement_bytes"] == 0


def test_a_producer_read_elsewhere_is_not_priced_as_inlined():
    """relu(q) also returned: it must exist in memory either way, so torch's side pays nothing for it."""
    g = gen(6)
    x, kv = rand((1, 3, 7, 785), g), rand((1, 3, 5, 6), g)

    def fn(x, kv):
        r = F.relu(x.transpose(-1, -2)[..., 2:7])
        return torch.matmul(r, kv), r

    c = compile_cpu(fn, (x, kv))
    for got, want in zip(c(x, kv), fn(x, kv)):
        torch.testing.assert_close(got, want, **GEMM_TOL)
    assert "%relu" not in report(c)["gemm"][0]["why"]


@pytest.mark.parametrize("batch,hw", [(16, 9), (2, 28)])
def test_lite_linear_attention_matches_eager(batch, hw):
    """EfficientViT's LiteMLA under the default plan: k^T v as packed dot products, relu(q) (k^T v) generated
    with the ReLU in its pack, the division read by the projection's pack; nothing materialised but, at most,
    the permute in front of the projection (or the clone after it): the greedy's choice for it is a few µs either
    way and follows the machine figures (kept on the fixed ones the tests use, virtual on a measured 2-thread set at
    10 GB/s).  The view of the padded v (k^T v's B) stays virtual: kept, its copy kernel would leave torch's bmm a
    physical operand and the estimate priced both sides as that one copy, a tie left physical
    (``Estimator._pack_terms`` prices the generated GEMM's pack through the mapping instead)."""
    torch.manual_seed(batch * 100 + hw)
    m = LiteMLA(32, 16).eval()
    x = torch.randn(batch, 32, hw, hw)
    c = vtc_compile(m, x)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
    r = report(c)
    bmm = {g["node"]: g for g in r["gemm"] if g["op"] == "aten.bmm.default"}
    assert bmm["bmm"]["path"] == gemm_dot.PATH, bmm
    if hw == 28:  # on the small maps torch's bmm after the ReLU kernel is estimated as fast
        assert bmm["bmm_1"]["choice"] == "vtc" and "%relu" in bmm["bmm_1"]["why"], bmm
    # nothing materialised but, at most, one copy in front of the projection: the permute, or (since a kept
    # movement op's copy kernel reads its virtual inputs through their mappings) the clone after it
    kept = [o for o in r["movement"] if o["fate"] not in ("virtual", "view", "pushed")]
    assert len(kept) <= 1 and all(o["op"] in ("aten.permute.default", "aten.clone.default") and o["fate"] == "kept"
                                  for o in kept), kept
    assert r["materialized_movement_bytes"] == sum(o["bytes"] for o in kept)


@pytest.mark.parametrize("case", [(1, 17, 5, 1, 9, 9), (16, 3, 4, 2, 7, 7)], ids=["b1_flat", "b16_stride2"])
def test_inlined_batch_norm_in_an_im2col_pack_is_computed_once_per_panel_row(case):
    """conv1x1(hardswish(BN(x))): the BN is computed in the convolution's pack loop (one kernel), its
    per-channel w / sqrt(var + eps) hoisted out of the run loops (vtc.codegen.conv.Im2colPack._runs)."""
    from vtc.codegen.cpp import generate

    b, c, o, stride, h, w = case
    g = gen(sum(case))
    weight = rand((o, c, 1, 1), g)
    mean, var, gamma, beta = rand((c,), g), rand((c,), g, positive=True), rand((c,), g), rand((c,), g)

    def fn(x):
        return F.conv2d(F.hardswish(F.batch_norm(x, mean, var, gamma, beta, False)), weight, None, stride)

    c = _check(fn, (rand((b, c, h, w), g),), gemm="vtc")
    (k,) = kernels(c)
    src = generate(k)
    pack = src[src.index(f"extern \"C\" void {k.name}"):]
    assert k.kind == "gemm" and "std::sqrt" in pack
    assert pack.index("std::sqrt") < pack.index("for (int64_t jr = jb; jr < je; jr += VTC_NR)"), pack[:3000]


def vtc_compile(m, x, **options):
    import vtc

    return vtc.compile(m, (x,), **options)
