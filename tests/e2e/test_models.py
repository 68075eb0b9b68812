"""The model-coverage sweep: transformers architectures from small configs with random weights (never
from_pretrained), compiled by vtc and compared with eager (docs/robustness.md, "Model coverage sweep").

Each architecture runs at batch 3 and an odd sequence length (7); the expected fallback ops are listed, so
a new fallback (or a crash, or a wrong result) fails here.  The suite runs one architecture per family of code
paths (SUITE, 2-4 s of CPU each with an empty kernel cache); ``VTC_MODEL_SWEEP=all`` runs every one of hf_models.MODELS.  The larger sweep
(batch 1 and 3, sequence 33, torch.compile, bf16, new sizes, generate) is in the doc."""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import transformers as tf

import vtc

from hf_models import MODELS

TOL = dict(rtol=1e-4, atol=1e-4)

# ops that run through torch, by architecture (any other fallback fails the sweep)
FALLBACKS = {
    # transformers' MoE: histc counts the tokens per expert, its grouped_mm_fallback custom op loops over the
    # experts with data-dependent row ranges (offs.tolist())
    "mixtral": {"aten.empty_permuted.default", "aten.histc.default", "transformers.grouped_mm_fallback.default"},
}


def _main(out):
    """The output a user reads first: logits, else the last hidden state."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return getattr(out, key)
    return out[0]


# GQA + RoPE + RMSNorm, soft-cap + sliding window, MoE, padding mask, relative position bias, audio convolutions
# (gpt2 and swin run in tests/zoo and tests/onnx)
SUITE = ("llama", "gemma2", "mixtral", "bert", "t5_encoder", "whisper_encoder")
assert set(SUITE) <= set(MODELS)


@pytest.mark.parametrize("name", sorted(MODELS) if os.environ.get("VTC_MODEL_SWEEP") == "all" else SUITE)
def test_architecture_matches_eager(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name](3, 7)
    with torch.no_grad():
        want = model(*inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc.FallbackWarning)
        c = vtc.compile(model, inputs)
    got = c(*inputs)
    torch.testing.assert_close(_main(got), _main(want), **TOL)
    assert set(c.report.fallback_ops) == FALLBACKS.get(name, set())


def _llama_with_default_cache():
    """A causal LM as a user builds it (one layer: these tests compile twice): the config's default use_cache=True,
    so forward returns a DynamicCache."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    assert cfg.use_cache
    return tf.LlamaForCausalLM(cfg).eval()


def _assert_same_cache(got, want):
    assert type(got) is type(want) and got.get_seq_length() == want.get_seq_length()
    assert len(got.layers) == len(want.layers)
    for g, w in zip(got.layers, want.layers):
        torch.testing.assert_close(g.keys, w.keys, **TOL)
        torch.testing.assert_close(g.values, w.values, **TOL)


def test_a_causal_lm_returning_its_kv_cache_compiles_and_the_cache_feeds_the_next_step():
    """Before: CaptureError "Found <class 'transformers.cache_utils.DynamicCache'> in output, which is not a
    known type" for every causal LM built with the default use_cache=True."""
    model = _llama_with_default_cache()
    ids = torch.randint(1, 97, (2, 7))
    with torch.no_grad():
        want = model(ids)
    c = vtc.compile(model, (ids,))
    got = c(ids)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    _assert_same_cache(got.past_key_values, want.past_key_values)

    # a decode step that takes the cache vtc returned
    nxt = torch.randint(1, 97, (2, 1))
    with torch.no_grad():
        want2 = model(nxt, past_key_values=want.past_key_values)
    step = vtc.compile(model, (nxt,), {"past_key_values": got.past_key_values})
    got2 = step(nxt, past_key_values=got.past_key_values)
    torch.testing.assert_close(got2.logits, want2.logits, **TOL)
    _assert_same_cache(got2.past_key_values, want2.past_key_values)
    assert got2.past_key_values.get_seq_length() == 8


def test_decode_steps_with_a_growing_kv_cache_reuse_one_symbolic_capture(monkeypatch):
    """A cache input whose length grows by one each step is captured once with symbolic sizes.  Before: the
    symbolic capture failed ("Node type mismatch; expected list, got DynamicCache": the dynamic_shapes were
    built by the cache's own unflatten), so every step captured, planned and built its kernels again."""
    import vtc.compiler

    model = _llama_with_default_cache()
    with torch.no_grad():
        cache = model(torch.randint(1, 97, (2, 7))).past_key_values
    tok = torch.randint(1, 97, (2, 1))
    step = vtc.compile(model, (tok,), {"cache": copy.deepcopy(cache)})
    captures = []
    real = vtc.compiler.export_graph
    monkeypatch.setattr(vtc.compiler, "export_graph", lambda *a, **k: captures.append(1) or real(*a, **k))
    want_cache, got_cache = cache, copy.deepcopy(cache)  # eager appends to the cache it is given
    for length in (8, 9):  # 8: the symbolic capture, 9: an instantiation of it
        with torch.no_grad():
            want = model(tok, cache=want_cache)
        got = step(tok, cache=got_cache)
        torch.testing.assert_close(got.logits, want.logits, **TOL)
        _assert_same_cache(got.past_key_values, want.past_key_values)
        assert got.past_key_values.get_seq_length() == length
        want_cache, got_cache = want.past_key_values, got.past_key_values
        tok = want.logits[:, -1:].argmax(-1)
    assert captures == []  # no concrete capture per length


def test_a_cache_passed_in_is_appended_to_and_returned_as_eager_does():
    """transformers' idiom: ``cache = DynamicCache(); model(ids, cache=cache); model(nxt, cache=cache)``.
    Before: the compiled call returned a new cache and left the one given as it was, so the second call
    attended to a stale cache (a silent wrong answer)."""
    model = _llama_with_default_cache()
    ids, nxt = torch.randint(1, 97, (2, 7)), torch.randint(1, 97, (2, 1))
    want_cache, got_cache = tf.DynamicCache(config=model.config), tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=want_cache)
        want = model(nxt, cache=want_cache)
    step = vtc.compile(model, (nxt,), {"cache": copy.deepcopy(want_cache)})
    vtc.compile(model, (ids,), {"cache": tf.DynamicCache(config=model.config)})(ids, cache=got_cache)
    assert got_cache.get_seq_length() == 7
    got = step(nxt, cache=got_cache)
    assert got.past_key_values is got_cache
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    _assert_same_cache(got_cache, want_cache)
