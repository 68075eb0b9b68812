"""Whole small models: transformers Llama, GPT-2 and Swin-T from configs, and ShuffleNetV2 x1.0.

Random weights, ``use_cache=False`` and eager attention (what exports with
torch.export), batch 1.  Language models run one forward over 128 tokens.
Sizes: Llama with 4 layers of hidden 512 (8 heads, 2 KV heads, MLP 1408,
vocab 32000); GPT-2 small's width (768, 12 heads) with 4 of its 12 layers and
its vocabulary (50257); Swin-T's real config (embed 96, depths [2,2,6,2], heads
[3,6,12,24], window 7, 224x224); ShuffleNetV2 x1.0 at 224x224.  The ``_fp16``
twins of Llama and ShuffleNetV2 run the same models in float16 (weights and
inputs cast), named only: torch's float16 GEMMs and convolutions on a CPU
without an fp16 fast path are 5-25x slower than its float32 ones.
"""
from __future__ import annotations

import torch

from . import Workload, in_dtype, randn

_HF = dict(use_cache=False, attn_implementation="eager", tie_word_embeddings=False)


def _ids(vocab: int, seq: int) -> tuple[torch.Tensor]:
    return (torch.randint(1, vocab, (1, seq), generator=torch.Generator().manual_seed(1)),)


def _llama(quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    seq = 32 if quick else 128
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=2 if quick else 4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                      rope_theta=500000.0, bos_token_id=1, eos_token_id=2, **_HF)
    return LlamaForCausalLM(cfg), _ids(32000, seq)


def _gpt2(quick: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    seq = 32 if quick else 128
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=2 if quick else 4, n_head=12,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_HF)
    return GPT2LMHeadModel(cfg), _ids(50257, seq)


def _swin(quick: bool):
    from transformers import SwinConfig, SwinModel

    if quick:
        cfg = SwinConfig(image_size=112, patch_size=4, embed_dim=48, depths=[2, 2, 2], num_heads=[2, 4, 8], window_size=7,
                         drop_path_rate=0.0, attn_implementation="eager")
        return SwinModel(cfg), (randn(1, 3, 112, 112),)
    cfg = SwinConfig(image_size=224, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                     window_size=7, drop_path_rate=0.0, attn_implementation="eager")
    return SwinModel(cfg), (randn(1, 3, 224, 224),)


def _shufflenet(quick: bool):
    from vtc.zoo.shufflenet import shufflenet_v2

    side = 112 if quick else 224
    return shufflenet_v2(1.0), (randn(1, 3, side, side),)


WORKLOADS = [
    Workload("llama_model", "model", "transformers Llama, 4 layers, hidden 512, GQA 8/2, vocab 32000, 128 tokens",
             _llama, params=dict(batch=1, seq=128, layers=4, hidden=512)),
    Workload("gpt2_model", "model", "transformers GPT-2 (width 768, 12 heads, 4 of 12 layers, vocab 50257), 128 tokens",
             _gpt2, params=dict(batch=1, seq=128, layers=4, hidden=768)),
    Workload("swin_t_model", "model", "transformers Swin-T (embed 96, depths 2/2/6/2, heads 3/6/12/24), 224x224",
             _swin, params=dict(batch=1, image=224)),
    Workload("shufflenet_v2_model", "model", "ShuffleNetV2 x1.0 (vtc.zoo), 224x224", _shufflenet, in_quick=False,
             params=dict(batch=1, image=224)),
    Workload("llama_model_fp16", "model", "llama_model in float16", in_dtype(_llama, torch.float16), default=False,
             params=dict(batch=1, seq=128, layers=4, hidden=512, dtype="float16")),
    Workload("shufflenet_v2_model_fp16", "model", "shufflenet_v2_model in float16", in_dtype(_shufflenet, torch.float16),
             default=False, params=dict(batch=1, image=224, dtype="float16")),
]
