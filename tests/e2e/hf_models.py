"""Small transformers architectures with random weights (never from_pretrained, no hub access) for the
model-coverage sweep (tests/e2e/test_models.py, docs/robustness.md "Model coverage sweep").

MODELS maps a name to a factory ``make(batch, seq) -> (model, inputs)``: 2 layers, hidden 64-128, the model in
eval mode, inputs random (token ids in [1, vocab), images and features from randn)."""
from __future__ import annotations

import torch
import transformers as tf

V = 97  # vocabulary


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(1, V, (batch, seq))


def _eval(model: torch.nn.Module) -> torch.nn.Module:
    return model.eval()


def _decoder(cls, cfg_cls, **extra):
    """A causal LM with GQA (4 query heads, 2 KV heads of 16)."""
    def make(batch, seq):
        cfg = cfg_cls(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False,
                      **extra)
        return _eval(cls(cfg)), (_ids(batch, seq),)
    return make


def _llama_padded(batch, seq):
    model, (ids,) = _decoder(tf.LlamaForCausalLM, tf.LlamaConfig)(batch, seq)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, : seq // 3] = 0  # left padding of the first row
    return model, (ids, mask)


def _lm(cls, cfg_cls, **config):
    """A causal LM of `cls` from `cfg_cls(vocab_size=V, use_cache=False, **config)`."""
    def make(batch, seq):
        return _eval(cls(cfg_cls(vocab_size=V, use_cache=False, **config))), (_ids(batch, seq),)
    return make


def _mixtral(batch, seq):
    cfg = tf.MixtralConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128, use_cache=False)
    return _eval(tf.MixtralForCausalLM(cfg)), (_ids(batch, seq),)


def _encoder(cls, cfg_cls, **extra):
    def make(batch, seq):
        cfg = cfg_cls(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=128, **extra)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[-1, seq - seq // 3:] = 0  # right padding of the last row
        return _eval(cls(cfg)), (_ids(batch, seq), mask)
    return make


def _distilbert(batch, seq):
    cfg = tf.DistilBertConfig(vocab_size=V, dim=64, hidden_dim=128, n_layers=2, n_heads=4,
                              max_position_embeddings=128)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - seq // 3:] = 0
    return _eval(tf.DistilBertModel(cfg)), (_ids(batch, seq), mask)


def _t5_encoder(batch, seq):
    cfg = tf.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, use_cache=False)
    return _eval(tf.T5EncoderModel(cfg)), (_ids(batch, seq),)


def _image(size: int, channels: int = 3):
    def inputs(batch):
        return (torch.randn(batch, channels, size, size),)
    return inputs


def _vit(batch, seq):
    cfg = tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                       image_size=24, patch_size=8)
    return _eval(tf.ViTModel(cfg, add_pooling_layer=False)), _image(24)(batch)


def _clip_vision(batch, seq):
    cfg = tf.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              image_size=24, patch_size=8)
    return _eval(tf.CLIPVisionModel(cfg)), _image(24)(batch)


def _convnext(batch, seq):
    cfg = tf.ConvNextConfig(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32)
    return _eval(tf.ConvNextModel(cfg)), _image(32)(batch)


def _swin(batch, seq):
    cfg = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4)
    return _eval(tf.SwinModel(cfg)), _image(32)(batch)


def _whisper_encoder(batch, seq):
    cfg = tf.WhisperConfig(vocab_size=V, d_model=64, encoder_layers=2, encoder_attention_heads=4,
                           decoder_layers=1, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                           num_mel_bins=16, max_source_positions=16, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, decoder_start_token_id=1)
    return _eval(tf.WhisperModel(cfg).get_encoder()), (torch.randn(batch, 16, 32),)


MODELS = {
    "llama": _decoder(tf.LlamaForCausalLM, tf.LlamaConfig),
    "llama_padded": _llama_padded,
    "mistral": _decoder(tf.MistralForCausalLM, tf.MistralConfig, sliding_window=5),
    "qwen2": _decoder(tf.Qwen2ForCausalLM, tf.Qwen2Config),
    "qwen3": _decoder(tf.Qwen3ForCausalLM, tf.Qwen3Config, head_dim=16),
    "phi3": _decoder(tf.Phi3ForCausalLM, tf.Phi3Config, pad_token_id=0),
    "gemma2": _decoder(tf.Gemma2ForCausalLM, tf.Gemma2Config, head_dim=16, sliding_window=5),
    "gemma3": _decoder(tf.Gemma3ForCausalLM, tf.Gemma3TextConfig, head_dim=16, sliding_window=5),
    "olmo2": _decoder(tf.Olmo2ForCausalLM, tf.Olmo2Config),
    "starcoder2": _decoder(tf.Starcoder2ForCausalLM, tf.Starcoder2Config),
    "mixtral": _mixtral,
    "gpt2": _lm(tf.GPT2LMHeadModel, tf.GPT2Config, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                bos_token_id=0, eos_token_id=0),
    "gpt_neox": _lm(tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128, rotary_pct=0.25),
    "opt": _lm(tf.OPTForCausalLM, tf.OPTConfig, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64),
    "phi": _lm(tf.PhiForCausalLM, tf.PhiConfig, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=128, partial_rotary_factor=0.5),
    "falcon": _lm(tf.FalconForCausalLM, tf.FalconConfig, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  new_decoder_architecture=True, num_kv_heads=2),
    "bloom": _lm(tf.BloomForCausalLM, tf.BloomConfig, hidden_size=64, n_layer=2, n_head=4),
    "gptj": _lm(tf.GPTJForCausalLM, tf.GPTJConfig, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=128),
    "bert": _encoder(tf.BertModel, tf.BertConfig),
    "roberta": _encoder(tf.RobertaModel, tf.RobertaConfig, pad_token_id=0),
    "electra": _encoder(tf.ElectraModel, tf.ElectraConfig, embedding_size=32),
    "albert": _encoder(tf.AlbertModel, tf.AlbertConfig, embedding_size=32),
    "deberta_v2": _encoder(tf.DebertaV2Model, tf.DebertaV2Config),
    "distilbert": _distilbert,
    "t5_encoder": _t5_encoder,
    "vit": _vit,
    "clip_vision": _clip_vision,
    "convnext": _convnext,
    "swin": _swin,
    "whisper_encoder": _whisper_encoder,
}
