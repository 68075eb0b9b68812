"""A Gemma-2 decoder layer written as a plain nn.Module (local sliding-window or global attention).

Structure as in transformers' ``Gemma2DecoderLayer``: RMSNorm with (1 + weight),
pre- and post-attention norms, pre- and post-feed-forward norms, GQA, RoPE,
scores scaled by query_pre_attn_scalar**-0.5, attention logit soft-cap
``tanh(s / 50) * 50``, a causal mask that local layers narrow to a sliding
window, GeGLU MLP (gelu-tanh).  The KV cache is updated out of place with
``index_copy`` like the Llama-3 layer (see llama3.py for why).

Sizes are scaled to a 2-core CPU (hidden 1024, 8 heads of 128, 4 KV heads,
MLP 4096; Gemma-2 2B has hidden 2304, 8 heads of 256, 4 KV heads).  Sliding
window: 512 for decode with a cache of 1024, 128 for prefill of 256.
"""
from __future__ import annotations

import torch
from torch import nn

from . import Workload
from .llama3 import Rotary, attention_inputs, causal_mask, layer_inputs


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm: x / rms(x) * (1 + weight)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class Gemma2Layer(nn.Module):
    """(hidden [B,S,H], k_cache, v_cache [B,KV,T,D], cache_position [S]) -> (hidden, k_cache, v_cache)."""

    def __init__(self, hidden: int = 1024, heads: int = 8, kv_heads: int = 4, head_dim: int = 128,
                 inter: int = 4096, window: int | None = None, softcap: float = 50.0, theta: float = 10000.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.window, self.softcap, self.scaling = window, softcap, head_dim ** -0.5
        self.input_layernorm = GemmaRMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_attention_layernorm = GemmaRMSNorm(hidden)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden)
        self.rotary = Rotary(head_dim, theta)

    def forward(self, x, k_cache, v_cache, cache_position):
        b, s, _ = x.shape
        d = self.head_dim
        residual = x
        q, keys, values, k_cache, v_cache = attention_inputs(self, self.input_layernorm(x), k_cache, v_cache,
                                                             cache_position)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scaling
        scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores + causal_mask(cache_position, k_cache.shape[2], self.window, scores.dtype)
        probs = torch.softmax(scores, dim=-1)
        attn = torch.matmul(probs, values).transpose(1, 2).reshape(b, s, self.heads * d)
        x = residual + self.post_attention_layernorm(self.o_proj(attn))
        h = self.pre_feedforward_layernorm(x)
        h = self.down_proj(nn.functional.gelu(self.gate_proj(h), approximate="tanh") * self.up_proj(h))
        return x + self.post_feedforward_layernorm(h), k_cache, v_cache


def _decode(batch: int, local: bool):
    def build(quick: bool):
        cache = 256 if quick else 1024
        return Gemma2Layer(window=cache // 2 if local else None), layer_inputs(batch, 1, cache, 1024, 4, 128, cache - 24)
    return build


def _prefill(local: bool):
    def build(quick: bool):
        seq = 64 if quick else 256
        return Gemma2Layer(window=seq // 2 if local else None), layer_inputs(1, seq, seq, 1024, 4, 128, 0)
    return build


_CFG = "hidden 1024, 8 heads x 128, 4 KV heads, MLP 4096, soft-cap 50"
WORKLOADS = [
    Workload("gemma2_local_decode_b1", "unit", f"Gemma-2 local (window 512) layer, decode, KV cache 1024, batch 1 ({_CFG})",
             _decode(1, True), params=dict(batch=1, seq=1, cache=1024, window=512)),
    Workload("gemma2_local_decode_b16", "unit", f"Gemma-2 local (window 512) layer, decode, KV cache 1024, batch 16 ({_CFG})",
             _decode(16, True), params=dict(batch=16, seq=1, cache=1024, window=512)),
    Workload("gemma2_global_decode_b1", "unit", f"Gemma-2 global layer, decode, KV cache 1024, batch 1 ({_CFG})",
             _decode(1, False), default=False, params=dict(batch=1, seq=1, cache=1024)),
    Workload("gemma2_global_decode_b16", "unit", f"Gemma-2 global layer, decode, KV cache 1024, batch 16 ({_CFG})",
             _decode(16, False), default=False, params=dict(batch=16, seq=1, cache=1024)),
    Workload("gemma2_local_prefill_b1", "unit", f"Gemma-2 local (window 128) layer, prefill 256, batch 1 ({_CFG})",
             _prefill(True), params=dict(batch=1, seq=256, window=128)),
    Workload("gemma2_global_prefill_b1", "unit", f"Gemma-2 global layer, prefill 256, batch 1 ({_CFG})",
             _prefill(False), params=dict(batch=1, seq=256)),
]
