"""Attention in one kernel (vtc.codegen.attention) against torch eager.

bmm(q, kᵀ) -> scale / soft-cap / mask -> softmax -> bmm(p, v), with GQA
(repeat_kv: expand + reshape), decode (one query) and prefill shapes, odd key
lengths, causal / sliding-window masks built from aranges (read as index
predicates, no mask tensor) and additive mask inputs.  Each case asserts that
the whole pattern is one attention kernel, that no bmm ran through torch and
that no byte of movement was materialised (the expanded K and V are read
through their mappings).  Where the pattern does not match (another reader of
the probabilities or the scores, float64, softmax over another dim) the nodes
run as before and the result still matches.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bench.workloads import gemma2, llama3

from vtc.codegen import flash
from vtc.codegen.cpp import generate

from .util import compile_cpu, executor, gen, kernels, rand, report, steps

TOL = dict(rtol=1e-4, atol=2e-5)
WINDOW = 8


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' repeat_kv: [B, KV, T, D] -> [B, KV*n_rep, T, D] by expand + reshape."""
    b, kv, t, d = x.shape
    return x if n_rep == 1 else x[:, :, None].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d)


def attention(ratio: int, mask: str, softcap: float | None, scale_op: str):
    """Eager GQA attention; the queries sit at the last S of T positions (T < S: rows with nothing to see)."""
    def fn(q, k, v, *extra):
        s, t, d = q.shape[2], k.shape[2], q.shape[3]
        keys, values = repeat_kv(k, ratio), repeat_kv(v, ratio)
        scores = torch.matmul(q, keys.transpose(2, 3))
        scores = scores * d ** -0.5 if scale_op == "mul" else scores / math.sqrt(d)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(s) + (t - s)
        kv = torch.arange(t)
        if mask == "causal":
            scores = scores.masked_fill(kv[None, :] > pos[:, None], float("-inf"))
        elif mask == "window":
            hidden = (kv[None, :] > pos[:, None]) | (kv[None, :] <= pos[:, None] - WINDOW)
            scores = scores + torch.zeros(()).masked_fill(hidden, torch.finfo(torch.float32).min)
        elif mask == "window_inf":  # -inf: key blocks out of every query's window are not visited
            hidden = (kv[None, :] > pos[:, None]) | (kv[None, :] <= pos[:, None] - WINDOW)
            scores = scores.masked_fill(hidden, float("-inf"))
        elif mask == "additive":
            scores = scores + extra[0]
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    return fn


# (GQA ratio, batch, queries S, keys T, head dim D, mask, soft-cap, scale op)
CASES = [
    (4, 1, 1, 300, 64, "causal", None, "mul"),  # decode
    (4, 2, 1, 127, 16, "additive", None, "div"),
    (2, 1, 3, 17, 64, "window", None, "mul"),
    (1, 2, 17, 17, 16, "causal", 50.0, "div"),  # Gemma-2 soft-cap, prefill
    (1, 1, 17, 300, 64, "none", None, "mul"),
    (2, 2, 1, 1, 16, "causal", None, "mul"),  # one key
    (4, 1, 3, 1, 64, "additive", None, "div"),
    (2, 1, 17, 127, 64, "window", 30.0, "mul"),
    (1, 1, 3, 300, 16, "additive", None, "mul"),
    (4, 2, 17, 300, 16, "causal", None, "div"),
    (1, 2, 1, 17, 64, "window", None, "div"),
    (4, 1, 17, 1, 16, "none", 50.0, "mul"),
    (2, 1, 3, 127, 16, "causal", None, "mul"),  # T < S is covered by (4, 1, 3, 1): fully masked rows give NaN
    (2, 1, 1, 127, 24, "causal", None, "mul"),  # head dim not a multiple of the vector width
    (1, 1, 127, 127, 64, "causal", None, "mul"),  # prefill tiles: 2 of 64 queries, causal key blocks skipped
    (2, 16, 17, 127, 16, "causal", None, "div"),  # batch 16
    (1, 1, 127, 300, 16, "window_inf", None, "mul"),  # key blocks before every query's window skipped
    (4, 16, 1, 127, 16, "causal", None, "mul"),  # decode, batch 16
]


def _inputs(ratio, b, s, t, d, mask, seed):
    g = gen(seed)
    kvh = 2
    args = [rand((b, kvh * ratio, s, d), g, low=0.1, high=1.0), rand((b, kvh, t, d), g, low=0.1, high=1.0),
            rand((b, kvh, t, d), g)]
    if mask == "additive":
        args.append(rand((b, 1, s, t), g, low=0.0, high=3.0))
    return tuple(args)


def attention_kernels(compiled) -> list:
    return [k for k in kernels(compiled) if k.kind == "attention"]


def compile_and_call(fn, inputs: tuple, threads: int):
    """(compiled, its result) with torch (and so the kernels) on `threads` threads for the compile and call."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled = compile_cpu(fn, inputs)
        return compiled, compiled(*inputs)
    finally:
        torch.set_num_threads(saved)


def assert_one_attention_kernel(compiled) -> None:
    """The pattern is one generated kernel: no bmm / softmax through torch, no movement materialised."""
    att = attention_kernels(compiled)
    assert len(att) == 1, f"attention kernels: {[k.source_nodes for k in att]}; " \
                          f"why not: {executor(compiled).lowering.why_not_attention}"
    assert [s.node.op for s in steps(compiled, "run")] == []
    assert [k for k in kernels(compiled) if k.kind == "copy"] == []
    assert report(compiled)["materialized_movement_bytes"] == 0, compiled.report


@pytest.mark.parametrize("case", CASES, ids=lambda c: "r{}_b{}_s{}_t{}_d{}_{}_cap{}_{}".format(*c))
def test_attention_matches_eager_in_one_kernel(case):
    ratio, b, s, t, d, mask, softcap, scale_op = case
    fn = attention(ratio, mask, softcap, scale_op)
    inputs = _inputs(ratio, b, s, t, d, mask, seed=CASES.index(case))
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), equal_nan=True, **TOL)
    assert_one_attention_kernel(compiled)


def test_causal_and_window_masks_bound_the_visited_keys():
    """The tiled kernel visits only key blocks that some query of a tile can see (vtc.codegen.flash.key_range)."""
    from vtc.codegen.flash import key_range

    for mask, lows, highs in (("causal", 0, 1), ("window_inf", 1, 1), ("none", 0, 0), ("window", 0, 0)):
        fn = attention(1, mask, None, "mul")
        inputs = _inputs(1, 1, 17, 40, 16, mask, seed=4)
        compiled = compile_cpu(fn, inputs)
        torch.testing.assert_close(compiled(*inputs), fn(*inputs), equal_nan=True, **TOL)
        (k,) = attention_kernels(compiled)
        assert k.tiled
        lo, hi = key_range(k.score)
        assert (len(lo), len(hi)) == (lows, highs), (mask, lo, hi)
        if mask == "causal":  # query i1 sits at position i1 + 40 - 17: keys r < i1 + 24 are visible
            assert hi == [(24, 1)]


@pytest.mark.parametrize("s, t, ratio", [(17, 40, 1), (127, 200, 2), (1, 64, 4), (1, 300, 2)],
                         ids=["prefill", "prefill_gqa", "decode", "decode_long"])
def test_masked_inf_and_nan_value_rows_stay_out(s, t, ratio):
    """A static cache holding inf / NaN past the positions the queries see (uninitialised slots): masked,
    so the output equals that of a clean cache (torch's matmul would spread the NaN)."""
    def fn(q, k, v):
        d = q.shape[3]
        scores = torch.matmul(q, repeat_kv(k, ratio).transpose(2, 3)) * d ** -0.5
        pos, kv = torch.arange(q.shape[2]) + 20, torch.arange(k.shape[2])
        scores = scores.masked_fill(kv[None, :] > pos[:, None], float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), repeat_kv(v, ratio))
    g = gen(17)
    q, k, v = rand((1, 2 * ratio, s, 64), g), rand((1, 2, t, 64), g), rand((1, 2, t, 64), g)
    k_bad, v_bad = k.clone(), v.clone()
    seen = s + 20
    k_bad[:, :, seen:] = float("nan")
    v_bad[:, :, seen:] = float("nan")
    v_bad[:, 1, seen::3] = float("inf")
    compiled = compile_cpu(fn, (q, k_bad, v_bad))
    got = compiled(q, k_bad, v_bad)
    assert_one_attention_kernel(compiled)
    torch.testing.assert_close(got, fn(q, k, v), **TOL)


def test_decode_with_keys_through_a_scale_and_a_value_dim_of_no_whole_vector():
    """GQA decode whose K is scaled in front of the kernel (read through its expression: packed per block)
    and whose value dim (24) is not a multiple of the vector width (padded)."""
    def fn(q, k, v):
        scores = torch.matmul(q, (repeat_kv(k, 4) * 0.5).transpose(2, 3))
        return torch.matmul(torch.softmax(scores, dim=-1), repeat_kv(v, 4))
    g = gen(19)
    inputs = (rand((3, 8, 1, 32), g), rand((3, 2, 131, 32), g), rand((3, 2, 131, 24), g))
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
    assert_one_attention_kernel(compiled)
    (k,) = attention_kernels(compiled)
    assert k.shared_rows == 4 and not k.tiled


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("position, zero_empty", [(700, False), (1400, False), (-1, True)],
                         ids=["second_split_masked", "both_splits", "empty_rows"])
def test_decode_keys_split_across_threads(threads, position, zero_empty):
    """One GQA group (1 KV head) and 1500 keys: fewer row blocks than twice the threads, so the keys are
    split (flash-decoding) and the splits' partial softmax results merged; a split whose keys are all
    masked adds nothing, and a row with no visible key gives 0 (SDPA's guard)."""
    def fn(q, k, v):
        pos, kv = torch.tensor([position]), torch.arange(k.shape[2])
        mask = kv[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    g = gen(23)
    inputs = (rand((1, 4, 1, 64), g), rand((1, 1, 1500, 64), g), rand((1, 1, 1500, 64), g))
    compiled, got = compile_and_call(fn, inputs, threads)
    torch.testing.assert_close(got, fn(*inputs), **TOL)
    assert_one_attention_kernel(compiled)
    if zero_empty:
        assert got.abs().max() == 0


def test_masks_are_index_predicates_not_tensors():
    """A causal or sliding-window mask made of aranges and compares is computed in the kernel: no mask read."""
    for mask in ("causal", "window"):
        fn = attention(4, mask, None, "mul")
        inputs = _inputs(4, 1, 3, 17, 16, mask, seed=3)
        compiled = compile_cpu(fn, inputs)
        (k,) = attention_kernels(compiled)
        assert {b.name for b in k.inputs} == {v.name for v in compiled.graph.inputs}  # q, k, v only


def test_gqa_decode_attention_reads_the_cache_without_an_expanded_copy():
    """The issue's test: GQA decode attention (32 query heads over 8 KV heads) moves no byte."""
    fn = attention(4, "causal", None, "mul")
    g = gen(11)
    inputs = (rand((1, 32, 1, 64), g, low=0.1, high=1.0), rand((1, 8, 256, 64), g, low=0.1, high=1.0),
              rand((1, 8, 256, 64), g))
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
    assert_one_attention_kernel(compiled)
    (k,) = attention_kernels(compiled)
    assert {b.shape for b in k.inputs} == {(1, 32, 1, 64), (1, 8, 256, 64)}  # nothing of [1, 32, 256, 64]
    assert k.shared_rows == 4 and not k.tiled  # the 4 query heads of a KV head read each K/V row once


def test_prefill_attention_is_tiled():
    """Many queries per head: Kᵀ blocks packed once per block of 8 queries, scores in vector registers."""
    fn = attention(2, "causal", None, "mul")
    inputs = _inputs(2, 1, 17, 127, 64, "causal", seed=21)
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
    (k,) = attention_kernels(compiled)
    assert k.tiled


@pytest.mark.parametrize("b, s", [(1, 127), (16, 17)])
def test_prefill_reads_transposed_sliced_and_concatenated_operands(b, s):
    """Prefill tiles over virtual operands: q and k from [B, S, H, D] projections through transposes, k a
    slice of a longer cache (read in place, row stride H*D), v a cat of the cache and new rows (no
    strided view: packed per key block through its mapping), causal with an offset."""
    def fn(q_bshd, k_cache, v_cache, v_new):
        t = s + 5
        q = q_bshd.transpose(1, 2)
        k = k_cache[:, :t].transpose(1, 2)
        v = torch.cat([v_cache[:, :, :5], v_new], dim=2)
        scores = torch.matmul(q, repeat_kv(k, 2).transpose(2, 3)) / 8.0
        pos, kv = torch.arange(s) + 5, torch.arange(t)
        scores = scores.masked_fill(kv[None, :] > pos[:, None], float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), repeat_kv(v, 2))
    g = gen(29)
    inputs = (rand((b, s, 4, 64), g), rand((b, s + 40, 2, 64), g), rand((b, 2, 9, 64), g), rand((b, 2, s, 64), g))
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
    assert_one_attention_kernel(compiled)
    (k,) = attention_kernels(compiled)
    assert k.tiled


def test_scale_on_keys_is_recomputed_and_rope_is_stored_once():
    """A scale or cast in front of K is recomputed at each read; a RoPE (two tensor operands) is a kernel of its own."""
    def fn(q, k, v, cos, sin):
        k_rot = k * cos + torch.cat((-k[..., 8:], k[..., :8]), -1) * sin
        scaled = repeat_kv(k_rot, 2) * 0.25
        return torch.softmax(q @ scaled.transpose(2, 3), -1) @ repeat_kv(v, 2)
    g = gen(5)
    inputs = (rand((1, 4, 3, 16), g), rand((1, 2, 17, 16), g), rand((1, 2, 17, 16), g), rand((17, 16), g),
              rand((17, 16), g))
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
    (k,) = attention_kernels(compiled)
    stored = {kn.stores[0].buffer.name: kn for kn in kernels(compiled) if kn.kind == "pointwise"}
    assert len(stored) == 1 and next(iter(stored.values())).domain == (1, 2, 17, 16)  # RoPE'd K, not expanded
    assert set(stored) <= {b.name for b in k.inputs}


def h2o(q, k, v):
    p = torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1)
    return p @ v, p.sum(-2)


def keyformer_like(q, k, v):
    s = q @ k.transpose(-1, -2)
    return torch.softmax(s, -1) @ v, s.amax(-1)


def float64(q, k, v):
    return torch.softmax((q.double() @ k.double().transpose(-1, -2)), -1) @ v.double()


def softmax_over_queries(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), -2) @ v


@pytest.mark.parametrize("fn, why", [(h2o, "is read by 2 nodes"), (keyformer_like, "also read by"),
                                     (float64, "float32 or float16 only"), (softmax_over_queries, "not the last")],
                         ids=["h2o_column_sums", "scores_read_twice", "float64", "softmax_dim_-2"])
def test_patterns_that_are_not_one_attention_kernel_run_as_before(fn, why):
    g = gen(9)
    inputs = (rand((2, 4, 17, 16), g, low=0.1, high=1.0), rand((2, 4, 17, 16), g, low=0.1, high=1.0),
              rand((2, 4, 17, 16), g))
    compiled = compile_cpu(fn, inputs)
    want, got = fn(*inputs), compiled(*inputs)
    for gt, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(gt, w, **TOL)
    assert attention_kernels(compiled) == []
    reasons = list(executor(compiled).lowering.why_not_attention.values())
    assert any(why in r for r in reasons), reasons


def test_sdpa_decomposition_is_one_attention_kernel():
    """torch.export decomposes scaled_dot_product_attention into the math form (scale split over q and k,
    then ``where(row all -inf, 0, softmax)``): still one kernel, and a fully masked row gives 0 as in torch."""
    causal = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    masked = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True,  # noqa: E731
                                                               scale=0.3)
    g = gen(13)
    q, k, v = rand((2, 8, 17, 16), g), rand((2, 2, 17, 16), g), rand((2, 2, 17, 16), g)
    m = torch.rand((17, 17), generator=g) < 0.6
    m[3] = False  # nothing to attend to: torch returns 0 for this row
    for fn, inputs in ((causal, (q, k, v)), (masked, (q, k, v, m))):
        compiled = compile_cpu(fn, inputs)
        torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
        assert_one_attention_kernel(compiled)
    assert compiled(q, k, v, m)[:, :, 3].abs().max() == 0


def test_llama3_decode_layer_with_cache_update():
    """The bench Llama-3 layer (StaticCache-style index_copy, repeat_kv, causal mask from cache_position):
    the cache updates are pushed (vtc.codegen.push): the new K is stored into the fresh output by the RoPE
    kernel and the new V by the v projection's GEMM kernel (vtc.codegen.gemm_push); attention copies each
    input cache into its output block by block while reading it (vtc.codegen.decode_copy). The pull form reads the old caches and the
    token just written instead."""
    torch.manual_seed(0)
    m = llama3.Llama3Layer(hidden=256, heads=8, kv_heads=2, inter=512).eval()
    inputs = llama3.layer_inputs(2, 1, 67, 256, 2, 32, start=40)
    cache_bytes = inputs[1].numel() * 4
    for push in (True, False):
        compiled = compile_cpu(m, inputs, push=push)
        with torch.no_grad():
            torch.testing.assert_close(compiled(*inputs), m(*inputs), **TOL)
        (k,) = attention_kernels(compiled)
        read = {b.name for b in k.inputs}
        fates = {e["op"]: e["fate"] for e in report(compiled)["movement"] if "index_put" in e["op"]}
        if push:  # the attention kernel copies the input caches while reading them (vtc.codegen.decode_copy)
            assert sorted(c.base.name for c in k.copy_through) == ["k_cache", "v_cache"]
            assert set(fates.values()) == {"pushed"} and [x for x in kernels(compiled) if x.kind == "push"] == []
            # the input caches are copied once (out of place), nothing else: the new V is stored by its GEMM
            assert report(compiled)["materialized_movement_bytes"] == 2 * cache_bytes
            assert [g["stores_into"] for g in report(compiled)["gemm"] if g["stores_into"]] == [["index_put_1"]]
        else:
            assert {"k_cache", "v_cache"} <= read
            assert report(compiled)["materialized_movement_bytes"] == 2 * cache_bytes  # the updated caches


def test_gemma2_local_prefill_layer():
    """Gemma-2: soft-cap and a sliding-window causal mask, prefill of 17 tokens."""
    torch.manual_seed(0)
    m = gemma2.Gemma2Layer(hidden=128, heads=4, kv_heads=2, head_dim=32, inter=256, window=5).eval()
    inputs = llama3.layer_inputs(1, 17, 17, 128, 2, 32, start=0)
    compiled = compile_cpu(m, inputs)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), m(*inputs), **TOL)
    assert len(attention_kernels(compiled)) == 1


@pytest.mark.parametrize("d, b, packed", [(1, 1, False), (3, 16, False), (17, 1, True), (40, 16, False), (300, 1, True),
                                          (80, 1, False), (127, 16, True), (127, 1, False)])
def test_gqa_decode_with_any_head_dim_uses_the_vector_micro_kernels(d, b, packed):
    """GQA decode with a head dim that is not a multiple of the vector width: q zero-padded, the last vector
    of a K / V row read in place is a masked load (nothing past the row is read), a packed row (K through a
    scale, V through a cat) zero-padded; the value dim differs from the head dim."""
    e = d + 5 if d < 100 else d

    def fn(q, k, v, v_new):
        keys = repeat_kv(k * 0.5 if packed else k, 4)
        values = repeat_kv(torch.cat([v, v_new], dim=2) if packed else v, 4)
        scores = torch.matmul(q, keys.transpose(2, 3)) * d ** -0.5
        pos, kv = torch.tensor([k.shape[2] - 3]), torch.arange(k.shape[2])
        scores = scores.masked_fill(kv[None, :] > pos[:, None], float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), values)
    g = gen(31 + d)
    t = 131
    inputs = (rand((b, 8, 1, d), g), rand((b, 2, t, d), g), rand((b, 2, t - 1 if packed else t, e), g),
              rand((b, 2, 1 if packed else 0, e), g))
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
    assert_one_attention_kernel(compiled)
    (k,) = attention_kernels(compiled)
    assert k.shared_rows == 4 and not k.tiled
    src = generate(k)
    assert "vtc_sum16(part)" in src and "reduction(+:a0" not in src  # not the omp simd dot products
    masked_loads = src.count("vtc_load16_n(") - flash.PRELUDE.count("vtc_load16_n(")  # less the prelude's definitions
    assert (masked_loads > 0) == (not packed and (d % 16 != 0 or e % 16 != 0)), masked_loads


@pytest.mark.parametrize("s, d, b, lanes", [(8, 40, 1, 16), (17, 48, 16, 32), (33, 40, 1, 64)])
def test_prefill_tile_lanes_follow_the_query_count(s, d, b, lanes):
    """A short prefill chunk runs on 16 or 32 query lanes (not 64 with idle ones), chosen at run time so that
    the kernel text is the same for every query count; a value dim of 3 vectors (40, 48: PV steps of 4
    queries, a divisor of the tile) with V read in place, a partial last vector masked."""
    fn = attention(2, "causal", None, "mul")
    inputs = _inputs(2, b, s, s + 23, d, "causal", seed=s)
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
    assert_one_attention_kernel(compiled)
    (k,) = attention_kernels(compiled)
    src = generate(k)
    assert k.tiled and k.head_group == 2 and "if (qn == 16) {" in src and "} else if (qn == 32) {" in src


@pytest.mark.parametrize("ratio, b, s, t, mask", [(4, 1, 3, 200, "causal"), (4, 16, 4, 67, "additive"),
                                                  (8, 1, 5, 130, "window_inf"), (2, 1, 7, 300, "causal")])
def test_few_queries_of_a_gqa_group_share_the_tile_lanes(ratio, b, s, t, mask):
    """Speculative decoding / a short chunk: the queries of a GQA group's heads are the lanes of one tile
    (3 queries x 4 heads: 12 lanes, K and V read once for the group), causal bounds over the tile's
    queries of several heads; 2 queries x 4 heads stay the decode form."""
    fn = attention(ratio, mask, None, "mul")
    inputs = _inputs(ratio, b, s, t, 64, mask, seed=s + t)
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
    assert_one_attention_kernel(compiled)
    (k,) = attention_kernels(compiled)
    assert k.head_group == ratio and k.tiled
    if s == 3:
        two = _inputs(4, 1, 2, 50, 64, "causal", seed=1)
        (k,) = attention_kernels(compile_cpu(attention(4, "causal", None, "mul"), two))
        assert not k.tiled and k.shared_rows == 8


MIN = torch.finfo(torch.float32).min


def hf_attention(ratio: int):
    """transformers' eager attention: GQA, scale, an additive mask of 0 / finfo.min (a graph input)."""
    def fn(q, k, v, mask):
        scores = torch.matmul(q, repeat_kv(k, ratio).transpose(2, 3)) * q.shape[3] ** -0.5
        return torch.matmul(torch.softmax(scores + mask, dim=-1), repeat_kv(v, ratio))
    return fn


def hf_mask(b: int, s: int, t: int, first: int, window: int | None = None, empty_row: int | None = None):
    """[b, 1, s, t] additive mask of queries at positions first.. over t keys: 0 where seen, finfo.min where
    hidden (causal, a sliding window); `empty_row`: that query sees nothing (torch: uniform over all keys)."""
    pos, kv = torch.arange(s)[:, None] + first, torch.arange(t)[None, :]
    hidden = kv > pos
    if window is not None:
        hidden |= kv <= pos - window
    if empty_row is not None:
        hidden[empty_row] = True
    return torch.zeros(b, 1, s, t).masked_fill(hidden, MIN)


@pytest.mark.parametrize("ratio, b, s, t, first, window, empty_row", [
    (1, 1, 70, 400, 20, None, None),  # prefill: key blocks past the tile's last query hidden
    (2, 16, 17, 300, 150, 40, None),  # sliding window: blocks before the window hidden, batch 16
    (4, 1, 1, 1500, 100, None, None),  # decode, keys split across threads: the second split all hidden
    (4, 2, 1, 700, 300, None, None),  # decode, one task per group
])
def test_finfo_min_masks_skip_hidden_key_blocks(ratio, b, s, t, first, window, empty_row):
    """An additive finfo.min mask (a graph input: unknown at compile time) hides whole key blocks: they are
    skipped at run time.  The cache past the last seen position holds NaN (uninitialised slots): skipped,
    it does not reach the output, which equals torch on a clean cache (torch gives NaN on the dirty one)."""
    fn = hf_attention(ratio)
    g = gen(41 + s)
    d = 64
    q, k, v = rand((b, 2 * ratio, s, d), g), rand((b, 2, t, d), g), rand((b, 2, t, d), g)
    mask = hf_mask(b, s, t, first, window, empty_row)
    end = -(-(first + s) // 128) * 128  # the first whole decode key block past every query's last key
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, end:], v_bad[:, :, end:] = float("nan"), float("nan")
    if window is not None:  # and before every query's window
        k_bad[:, :, :64], v_bad[:, :, :64] = float("nan"), float("inf")
    compiled, got = compile_and_call(fn, (q, k_bad, v_bad, mask), 2)
    assert_one_attention_kernel(compiled)
    torch.testing.assert_close(got, fn(q, k, v, mask), **TOL)
    assert fn(q, k_bad, v_bad, mask).isnan().any()  # torch spreads the hidden NaN


@pytest.mark.parametrize("b, s, t, empty_row, threads", [(1, 70, 300, 66, 2), (16, 17, 140, 3, 1),
                                                         (1, 1, 1500, 0, 2), (1, 1, 1500, 0, 1)],
                         ids=["prefill", "prefill_b16", "decode_split", "decode"])
def test_finfo_min_mask_row_with_every_key_hidden_is_torchs_uniform_softmax(b, s, t, empty_row, threads):
    """A query whose every key is hidden by finfo.min: torch gives a uniform softmax over all the keys (the
    mean of V), not 0 or NaN.  Key blocks are skipped for the other rows, so the kernel sees that row's max
    stay at finfo.min and runs the tile (or, keys split across threads, the kernel) again without skipping."""
    fn = hf_attention(4)
    g = gen(43 + s)
    q, k, v = rand((b, 8, s, 32), g), rand((b, 2, t, 32), g), rand((b, 2, t, 32), g)
    mask = hf_mask(b, s, t, 5, None, empty_row)
    compiled, got = compile_and_call(fn, (q, k, v, mask), threads)
    assert_one_attention_kernel(compiled)
    want = fn(q, k, v, mask)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got[:, :, empty_row], repeat_kv(v, 4).mean(2), **TOL)
