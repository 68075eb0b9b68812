"""A Llama-3 decoder layer written as a plain nn.Module, with a StaticCache-style KV cache.

Structure as in transformers' ``LlamaDecoderLayer``: RMSNorm, q/k/v/o
projections, rotate_half RoPE (theta 500000), GQA through repeat_kv
(expand + reshape), softmax attention with an additive causal mask over the
whole cache, SwiGLU MLP.  The KV cache is updated with ``index_copy`` at
``cache_position`` as ``StaticCache.update`` does, but out of place: the cache
comes in as an input and the updated cache goes out as an output (what an ONNX
export of StaticCache is, a ScatterND), because vtc does not capture in-place
buffer mutation.  Every system runs this same module.

Sizes are scaled to a 2-core CPU (hidden 1024, 16 heads of 64, 4 KV heads,
MLP 3584: the 8B model's head dim, GQA ratio 4 and MLP ratio 3.5).
"""
from __future__ import annotations

import torch
from torch import nn

from . import Workload, in_dtype, randn


class RMSNorm(nn.Module):
    """Llama RMSNorm: x / rms(x) * weight."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim (slice + neg + cat)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, KV, T, D] -> [B, KV*n_rep, T, D] by expand + reshape (transformers' repeat_kv)."""
    b, kv, t, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d)


class Rotary(nn.Module):
    """cos/sin tables for integer positions: cat(freqs, freqs) as in transformers."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def causal_mask(cache_position: torch.Tensor, kv_len: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive [S, T] mask: query at position p sees keys 0..p (and only the last `window` of them)."""
    kv = torch.arange(kv_len, device=cache_position.device)
    masked = kv[None, :] > cache_position[:, None]
    if window is not None:
        masked = masked | (kv[None, :] <= cache_position[:, None] - window)
    return torch.zeros((), dtype=dtype).masked_fill(masked, torch.finfo(dtype).min)


def attention_inputs(layer: nn.Module, h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_position: torch.Tensor):
    """q, repeated keys and values, and the updated caches: projections, RoPE, StaticCache index_copy, repeat_kv."""
    b, s, _ = h.shape
    d = layer.head_dim
    if hasattr(layer, "qkv_proj"):  # one fused projection, split
        q, k, v = layer.qkv_proj(h).split([layer.heads * d, layer.kv_heads * d, layer.kv_heads * d], dim=-1)
    else:
        q, k, v = layer.q_proj(h), layer.k_proj(h), layer.v_proj(h)
    q = q.view(b, s, layer.heads, d).transpose(1, 2)
    k = k.view(b, s, layer.kv_heads, d).transpose(1, 2)
    v = v.view(b, s, layer.kv_heads, d).transpose(1, 2)
    cos, sin = (t.to(h.dtype) for t in layer.rotary(cache_position))  # float32 tables, in h's dtype as transformers'
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache = k_cache.index_copy(2, cache_position, k)
    v_cache = v_cache.index_copy(2, cache_position, v)
    n_rep = layer.heads // layer.kv_heads
    return q, repeat_kv(k_cache, n_rep), repeat_kv(v_cache, n_rep), k_cache, v_cache


class Llama3Layer(nn.Module):
    """(hidden [B,S,H], k_cache, v_cache [B,KV,T,D], cache_position [S]) -> (hidden, k_cache, v_cache)."""

    def __init__(self, hidden: int = 1024, heads: int = 16, kv_heads: int = 4, inter: int = 3584,
                 theta: float = 500000.0, eps: float = 1e-5):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        d = self.head_dim
        self.input_layernorm = RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(hidden, heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * d, bias=False)
        self.o_proj = nn.Linear(heads * d, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.rotary = Rotary(d, theta)

    def forward(self, x, k_cache, v_cache, cache_position):
        b, s, _ = x.shape
        d = self.head_dim
        residual = x
        q, keys, values, k_cache, v_cache = attention_inputs(self, self.input_layernorm(x), k_cache, v_cache,
                                                             cache_position)
        scores = torch.matmul(q, keys.transpose(2, 3)) * d ** -0.5
        scores = scores + causal_mask(cache_position, k_cache.shape[2], None, scores.dtype)
        probs = torch.softmax(scores, dim=-1)
        attn = torch.matmul(probs, values).transpose(1, 2).reshape(b, s, self.heads * d)
        x = residual + self.o_proj(attn)
        h = self.post_attention_layernorm(x)
        x = x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, k_cache, v_cache


class Llama3FusedQKVLayer(Llama3Layer):
    """Llama3Layer with one fused q/k/v projection (Phi-3's qkv_proj, GPT-2's c_attn): x @ W_qkv^T, split."""

    def __init__(self, hidden: int = 1024, heads: int = 16, kv_heads: int = 4, **kw):
        super().__init__(hidden, heads, kv_heads, **kw)
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        del self.q_proj, self.k_proj, self.v_proj


def layer_inputs(batch: int, seq: int, cache_len: int, hidden: int, kv_heads: int, head_dim: int, start: int):
    """(hidden, k_cache, v_cache, cache_position) for `seq` new tokens at positions start..start+seq-1."""
    return (randn(batch, seq, hidden, seed=1), randn(batch, kv_heads, cache_len, head_dim, seed=2),
            randn(batch, kv_heads, cache_len, head_dim, seed=3), torch.arange(start, start + seq))


def _decode(batch: int):
    def build(quick: bool):
        cache = 256 if quick else 1024
        m = Llama3Layer()
        return m, layer_inputs(batch, 1, cache, 1024, 4, 64, start=cache - 24)
    return build


def _fused_decode(batch: int):
    def build(quick: bool):
        cache = 256 if quick else 1024
        return Llama3FusedQKVLayer(), layer_inputs(batch, 1, cache, 1024, 4, 64, start=cache - 24)
    return build


def _prefill(batch: int):
    def build(quick: bool):
        seq = 64 if quick else 256
        m = Llama3Layer()
        return m, layer_inputs(batch, seq, seq, 1024, 4, 64, start=0)
    return build


_CFG = "hidden 1024, 16 heads x 64, 4 KV heads, MLP 3584"
WORKLOADS = [
    Workload("llama3_decode_b1", "unit", f"Llama-3 layer, decode 1 token, KV cache 1024, batch 1 ({_CFG})",
             _decode(1), in_quick=True, params=dict(batch=1, seq=1, cache=1024)),
    Workload("llama3_decode_b16", "unit", f"Llama-3 layer, decode 1 token, KV cache 1024, batch 16 ({_CFG})",
             _decode(16), params=dict(batch=16, seq=1, cache=1024)),
    Workload("llama3_decode_b1_fp16", "unit", "llama3_decode_b1 in float16", in_dtype(_decode(1), torch.float16),
             default=False, params=dict(batch=1, seq=1, cache=1024, dtype="float16")),
    Workload("llama3_prefill_b1", "unit", f"Llama-3 layer, prefill 256 tokens, batch 1 ({_CFG})",
             _prefill(1), params=dict(batch=1, seq=256, cache=256),
             notes="batch 16 prefill (4096 tokens) is left out: about 1 s a call on 2 cores, too slow for 20 runs x 8 systems"),
    Workload("llama3_fused_qkv_decode_b1", "unit", f"Llama-3 layer with a fused QKV projection, decode 1 token, "
             f"KV cache 1024, batch 1 ({_CFG})", _fused_decode(1), default=False,
             params=dict(batch=1, seq=1, cache=1024)),
    Workload("llama3_fused_qkv_decode_b16", "unit", f"Llama-3 layer with a fused QKV projection, decode 1 token, "
             f"KV cache 1024, batch 16 ({_CFG})", _fused_decode(16), default=False,
             params=dict(batch=16, seq=1, cache=1024)),
]
