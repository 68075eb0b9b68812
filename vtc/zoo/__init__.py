"""Built-in models for `vtc analyze`, the tests and the benchmarks.

`load(spec, size)` returns `(model, example_inputs)`: the model in eval mode with
deterministic random weights (never loaded from a hub) and a tuple of random inputs.

`spec` is a built-in name (see `NAMES`) or a Python path ``pkg.module:factory``.
The factory is called as ``factory(size=size)`` if it has a ``size`` parameter, else
``factory()``, and must return either ``(model, example_inputs)`` or a model object
with an ``example_inputs`` attribute.

Transformers models are built with ``use_cache=False`` and eager attention so they export
with ``torch.export``; they return ``ModelOutput``s (``out[0]`` is the logits / last hidden state).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import torch
from torch import nn

NAMES = ("llama", "gpt2", "gemma2", "swin", "shufflenet", "llama_layer")
SIZES = ("tiny", "small")
SEED = 0

# Per-size knobs for the language models (and llama_layer); _IMG is the image side per size.
_LM = {
    "tiny": dict(vocab=128, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, seq=8, window=4, batch=2),
    "small": dict(vocab=1024, hidden=256, inter=512, layers=2, heads=4, kv_heads=2, seq=32, window=16, batch=2),
}
_IMG = {"tiny": 32, "small": 64}

__all__ = ["NAMES", "SIZES", "load", "LlamaLayer"]

_HF_COMMON = dict(use_cache=False, attn_implementation="eager", tie_word_embeddings=False)


def _token_ids(p: dict) -> tuple[torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    # Start at 1 so no input is all zeros (id 0 is a typical pad id).
    return (torch.randint(1, p["vocab"], (p["batch"], p["seq"]), generator=gen),)


def _image(size: str, batch: int = 2) -> tuple[torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    return (torch.randn(batch, 3, _IMG[size], _IMG[size], generator=gen),)


def _llama_config(p: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["inter"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
        max_position_embeddings=4 * p["seq"], bos_token_id=1, eos_token_id=2, **_HF_COMMON,
    )


def _llama(size: str):
    from transformers import LlamaForCausalLM

    p = _LM[size]
    return LlamaForCausalLM(_llama_config(p)), _token_ids(p)


def _gpt2(size: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    p = _LM[size]
    cfg = GPT2Config(
        vocab_size=p["vocab"], n_positions=4 * p["seq"], n_embd=p["hidden"], n_layer=p["layers"], n_head=p["heads"],
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=p["vocab"] - 1, eos_token_id=p["vocab"] - 1,
        **_HF_COMMON,
    )
    return GPT2LMHeadModel(cfg), _token_ids(p)


def _gemma2(size: str):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    p = _LM[size]
    head_dim = p["hidden"] // p["heads"]
    cfg = Gemma2Config(
        vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["inter"],
        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
        head_dim=head_dim, query_pre_attn_scalar=head_dim, max_position_embeddings=4 * p["seq"],
        sliding_window=p["window"], layer_types=["sliding_attention", "full_attention"] * (p["layers"] // 2),
        **_HF_COMMON,
    )
    return Gemma2ForCausalLM(cfg), _token_ids(p)


def _swin(size: str):
    from transformers import SwinConfig, SwinModel

    depths, heads, embed = ((2, 2), (2, 4), 32) if size == "tiny" else ((2, 2, 2), (2, 4, 8), 64)
    cfg = SwinConfig(
        image_size=_IMG[size], patch_size=4, embed_dim=embed, depths=depths, num_heads=heads, window_size=4,
        drop_path_rate=0.0, attn_implementation="eager",
    )
    return SwinModel(cfg), _image(size)


def _shufflenet(size: str):
    from .shufflenet import shufflenet_v2

    # tiny: x0.5 with 2 units per stage (one strided, one split) for fast tests; small: the real x1.0.
    model = shufflenet_v2(0.5, repeats=(2, 2, 2)) if size == "tiny" else shufflenet_v2(1.0)
    return model, _image(size)


class LlamaLayer(nn.Module):
    """One `LlamaDecoderLayer` plus its rotary embedding and causal mask: hidden_states -> hidden_states."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Run the layer with positions 0..S-1 and a causal additive mask."""
        b, s, _ = hidden_states.shape
        pos = torch.arange(s, device=hidden_states.device).unsqueeze(0).expand(b, -1)
        cos_sin = self.rotary_emb(hidden_states, pos)
        neg = torch.finfo(hidden_states.dtype).min
        mask = torch.full((s, s), neg, dtype=hidden_states.dtype, device=hidden_states.device).triu(1)
        return self.layer(hidden_states, attention_mask=mask[None, None], position_ids=pos, position_embeddings=cos_sin)


def _llama_layer(size: str):
    p = _LM[size]
    gen = torch.Generator().manual_seed(SEED)
    return LlamaLayer(_llama_config(p)), (torch.randn(p["batch"], p["seq"], p["hidden"], generator=gen),)


_BUILDERS: dict[str, Callable[[str], tuple[Any, tuple]]] = {
    "llama": _llama, "gpt2": _gpt2, "gemma2": _gemma2, "swin": _swin,
    "shufflenet": _shufflenet, "llama_layer": _llama_layer,
}
assert tuple(_BUILDERS) == NAMES


def _from_factory(spec: str, size: str):
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"bad model spec {spec!r}: expected 'pkg.module:factory'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"model spec {spec!r}: cannot import module {mod_name!r} ({e})") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model spec {spec!r}: module {mod_name!r} has no callable {attr!r}")
    try:
        takes_size = "size" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_size = False
    out = factory(size=size) if takes_size else factory()
    if isinstance(out, tuple) and len(out) == 2:
        model, inputs = out
    elif hasattr(out, "example_inputs"):
        model, inputs = out, out.example_inputs
    else:
        raise ValueError(
            f"model spec {spec!r}: factory must return (model, example_inputs) "
            f"or a model with an `example_inputs` attribute, got {type(out).__name__}"
        )
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def load(spec: str, size: str = "small") -> tuple[nn.Module | Callable, tuple]:
    """Return (model in eval mode, example_inputs tuple) for a built-in name or 'pkg.module:factory'."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    if ":" in spec:
        model, inputs = _from_factory(spec, size)
    elif spec in _BUILDERS:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model, inputs = _BUILDERS[spec](size)
    else:
        raise ValueError(f"unknown model {spec!r}; built-in models: {', '.join(NAMES)} (or use 'pkg.module:factory')")
    if isinstance(model, nn.Module):
        model.eval()
    return model, inputs
