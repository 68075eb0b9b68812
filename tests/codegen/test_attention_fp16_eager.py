"""transformers' eager attention in float16, ``softmax(scores, dim=-1, dtype=torch.float32).to(torch.float16)``
(aten: float16 scores and score chain, ``_to_copy`` to float32, ``_softmax`` in float32, ``_to_copy`` back to
float16, the PV bmm in float16): one attention kernel, as the float16 softmax of the same scores.

Eager rounds the probabilities to float16 in both forms (its float16 softmax computes in float32 and rounds its
result), so the kernel computes the cast form exactly as the float16 one: the same kernel and the same result, bit
for bit.  Against eager: the tolerance of test_decode_fp16 (``_assert_close``: 2 float16 ulps of eager's plus
2^-9 of the largest |v|, and no further from the float64 result on average).  Before this change the float32
softmax of float16 scores was "not attention": the two bmm, the softmax and the two casts ran as five kernels.
"""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from bench.workloads import llama3

from vtc.codegen.cpp import generate

from .test_decode_fp16 import _assert_close, _attention
from .util import compile_cpu, executor, gen, kernels, rand, report, steps, torch_threads

H = torch.float16


def _eager_attention(ratio: int, position: int | None):
    """transformers' eager_attention_forward (test_decode_fp16._attention: GQA, the scores scaled, a causal or an
    additive finfo.min mask) with its softmax in float32, cast back to float16."""
    return _attention(ratio, position,
                      lambda scores: torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype))


def _assert_one_attention_kernel(c) -> None:
    assert [x.kind for x in kernels(c)] == ["attention"], \
        ([x.name for x in kernels(c)], executor(c).lowering.why_not_attention)
    assert [x.node.op for x in steps(c, "run")] == []
    assert report(c)["materialized_movement_bytes"] == 0


def _form(att) -> str:
    return "tiled" if att.tiled else "shared" if att.shared_rows else "blocks"


# (GQA ratio, batch, queries, keys, head dim, additive mask at, threads, the kernel's form)
CASES = [
    (4, 1, 70, 70, 64, None, 1, "tiled"),  # prefill, causal
    (4, 1, 9, 130, 64, 129, 1, "tiled"),  # a chunk of 9 queries: the GQA group's heads share the tile lanes
    (4, 1, 1, 300, 64, 250, 1, "shared"),  # decode, one GQA group per task
    (4, 2, 1, 1500, 64, 1400, 2, "shared"),  # decode, keys split across threads
    (1, 2, 3, 17, 16, None, 1, "blocks"),  # rows in blocks (no shared rows, not tiled)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "r{}_b{}_s{}_t{}_d{}_pos{}_th{}_{}".format(*c))
def test_float32_softmax_cast_to_float16_is_one_attention_kernel(case):
    ratio, b, s, t, d, position, threads, form = case
    g = gen(500 + CASES.index(case))
    q, k, v = rand((b, 2 * ratio, s, d), g, H), rand((b, 2, t, d), g, H), rand((b, 2, t, d), g, H)
    fn, same_dtype = _eager_attention(ratio, position), _attention(ratio, position)
    with torch_threads(threads):
        c, c16 = compile_cpu(fn, (q, k, v)), compile_cpu(same_dtype, (q, k, v))
        got, got16, want = c(q, k, v), c16(q, k, v), fn(q, k, v)
    _assert_one_attention_kernel(c)
    (att,), (att16,) = kernels(c), kernels(c16)
    assert _form(att) == form
    assert generate(att).replace(att.name, "") == generate(att16).replace(att16.name, "")
    assert torch.equal(got, got16)
    _assert_close(got, want, fn(q.double(), k.double(), v.double()), v.abs().max().item())


def test_other_readers_of_the_float32_probabilities_keep_them():
    """The float32 probabilities also returned: not one attention kernel (the softmax's output is needed)."""
    g = gen(510)
    q, k, v = rand((1, 2, 20, 16), g, H), rand((1, 2, 20, 16), g, H), rand((1, 2, 20, 16), g, H)

    def fn(q, k, v):
        p = torch.softmax(q @ k.transpose(2, 3), dim=-1, dtype=torch.float32)
        return p.to(H) @ v, p

    c = compile_cpu(fn, (q, k, v))
    assert [x.kind for x in kernels(c)].count("attention") == 0
    for o, w in zip(c(q, k, v), fn(q, k, v)):
        torch.testing.assert_close(o, w, rtol=2e-3, atol=2e-3)


def test_transformers_llama_eager_float16_has_one_attention_kernel_per_layer():
    """A float16 LlamaForCausalLM with attn_implementation="eager" (2 layers, GQA 4 / 2 heads, 2 x 24 tokens,
    causal): each layer's attention one kernel (prefill tiles, q's RoPE inlined and packed in two loops without a
    branch, flash.head_dim_pieces), no softmax kernel; the logits within 2 float16 ulps of eager's
    plus 2^-9 of their largest magnitude (as test_gemm_fp16's end-to-end Llama) and no further from the float64
    model's on average."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                         attn_implementation="eager")
    model = tf.LlamaForCausalLM(cfg).eval().half()
    ids = torch.randint(1, 300, (2, 24))
    c = compile_cpu(model, (ids,))
    with torch.no_grad():
        got, want = c(ids).logits, model(ids).logits
        exact = copy.deepcopy(model).double()(ids).logits
    names = [x.name for x in kernels(c)]
    att = [x for x in kernels(c) if x.kind == "attention"]
    assert len(att) == 2, (names, executor(c).lowering.why_not_attention)
    for x in att:  # q's RoPE read inline: Qᵀ packed per half of the head dim, rotate_half's choice decided in each
        assert x.tiled and "qr[j][d + 16] = " in generate(x)
    assert not [n for n in names if "softmax" in n or "bmm" in n.replace("attn_bmm", "")], names
    _assert_close(got, want, exact, want.abs().max().item())
