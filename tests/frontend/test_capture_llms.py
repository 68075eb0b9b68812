"""torch.export capture of tiny transformers LLMs (random weights): Llama (GQA), GPT-2, Gemma-2."""
from __future__ import annotations

import torch
import transformers as tf

from .capture_checks import check_capture

IDS = (torch.randint(1, 128, (1, 8)),)


def test_llama_gqa():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    graph = check_capture(tf.LlamaForCausalLM(cfg), IDS)
    assert graph.out_spec.type is tf.modeling_outputs.CausalLMOutputWithPast
    k_proj = next(v for v in graph.consts if "k_proj" in v.name)
    assert k_proj.shape == (2 * 16, 64)  # GQA: 2 kv heads of 16 against 4 query heads


def test_gpt2():
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    check_capture(tf.GPT2LMHeadModel(cfg), IDS)


def test_gemma2():
    torch.manual_seed(0)
    cfg = tf.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          sliding_window=4, use_cache=False)
    graph = check_capture(tf.Gemma2ForCausalLM(cfg), IDS)
    assert any(n.op == "aten.tanh.default" for n in graph.nodes)  # the logit soft-cap
