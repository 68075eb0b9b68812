"""FlashTensor's attention variants (PPoPP'25): causal attention plus the extra reductions KV-cache
eviction policies compute over the attention probabilities.

Each module takes q, k, v [B, H, S, D] and returns the attention output and
(where the variant has one) its extra score tensor:

- ``causal``: plain causal softmax attention;
- ``h2o``: column sums of the probabilities (accumulated attention per key);
- ``roco``: column sums and column sums of squares (mean and variance per key);
- ``keyformer``: column sums of a Gumbel-softmax of the logits (fixed noise, temperature 1.5);
- ``snapkv``: attention of the last 32 queries (observation window) summed per key, average-pooled (kernel 7);
- ``corm``: per key, whether any query's probability exceeds 1/S (thresholded any());
- ``softcap``: Gemma-2's logit soft-cap ``tanh(s / 50) * 50`` before the mask.

The causal mask is built in the graph from indices (FlashTensor turns such a
constant into a predicate).  B=1, 8 heads of 64, sequence 1024 (quick: 512); ``attn_causal_2048``
and ``attn_h2o_2048`` run at 2048 when named (``--workloads all``).

``attn_gqa_decode_<T>`` is the decode step of issue 4: one query token of 32 heads over a static KV
cache of T positions with 8 KV heads of 64 (Llama-3 8B's attention), the way transformers writes it
(``repeat_kv`` expand + reshape, matmul, scale, additive mask from ``cache_position``, softmax,
matmul, heads back to [B, 1, H*D]).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import Workload, randn


class Attention(nn.Module):
    """Causal attention and one of FlashTensor's extra score reductions."""

    def __init__(self, variant: str, seq: int):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown attention variant {variant!r}; valid: {', '.join(VARIANTS)}")
        self.variant, self.window, self.tau, self.softcap = variant, 32, 1.5, 50.0
        if variant == "keyformer":
            u = torch.rand(seq, seq, generator=torch.Generator().manual_seed(7)).clamp_(1e-6, 1 - 1e-6)
            self.register_buffer("gumbel", -torch.log(-torch.log(u)))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        s = q.shape[-2]
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        if self.variant == "softcap":
            scores = torch.tanh(scores / self.softcap) * self.softcap
        idx = torch.arange(s, device=q.device)
        masked = idx[None, :] > idx[:, None]
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v)
        if self.variant in ("causal", "softcap"):
            return out
        if self.variant == "h2o":
            return out, probs.sum(dim=-2)
        if self.variant == "roco":
            return out, probs.sum(dim=-2), (probs * probs).sum(dim=-2)
        if self.variant == "keyformer":
            g = torch.softmax((scores + self.gumbel) / self.tau, dim=-1)
            return out, g.sum(dim=-2)
        if self.variant == "snapkv":
            votes = probs[:, :, -self.window:, :].sum(dim=-2)
            return out, F.avg_pool1d(votes, kernel_size=7, stride=1, padding=3)
        return out, (probs > 1.0 / s).any(dim=-2)  # corm


VARIANTS = ("causal", "h2o", "roco", "keyformer", "snapkv", "corm", "softcap")


class GQADecode(nn.Module):
    """(q [B,H,1,D], k_cache, v_cache [B,KV,T,D], cache_position [1]) -> attention output [B, 1, H*D]."""

    def __init__(self, heads: int = 32, kv_heads: int = 8):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads

    def forward(self, q, k_cache, v_cache, cache_position):
        from .llama3 import causal_mask, repeat_kv

        b, h, s, d = q.shape
        n_rep = self.heads // self.kv_heads
        keys, values = repeat_kv(k_cache, n_rep), repeat_kv(v_cache, n_rep)
        scores = torch.matmul(q, keys.transpose(2, 3)) * d ** -0.5
        scores = scores + causal_mask(cache_position, k_cache.shape[2], None, scores.dtype)
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, values).transpose(1, 2).reshape(b, s, h * d)


def _gqa_decode(cache: int, batch: int = 1, heads: int = 32, kv_heads: int = 8, head_dim: int = 64):
    def build(quick: bool):
        t = min(cache, 1024) if quick else cache
        return GQADecode(heads, kv_heads), (randn(batch, heads, 1, head_dim, seed=1),
                                            randn(batch, kv_heads, t, head_dim, seed=2),
                                            randn(batch, kv_heads, t, head_dim, seed=3), torch.tensor([t - 24]))
    return build


def _build(variant: str, full_seq: int = 1024):
    def build(quick: bool):
        seq = 512 if quick else full_seq
        return Attention(variant, seq), (randn(1, 8, seq, 64, seed=1), randn(1, 8, seq, 64, seed=2),
                                         randn(1, 8, seq, 64, seed=3))
    return build


_DESC = {"causal": "plain causal attention", "h2o": "H2O: + column sums of probabilities",
         "roco": "RoCo: + column sums and squared sums", "keyformer": "Keyformer: + Gumbel-softmax column sums",
         "snapkv": "SnapKV: + pooled scores of a 32-query observation window",
         "corm": "CORM: + any(prob > 1/S) per key", "softcap": "Gemma-2 soft-capped causal attention"}
WORKLOADS = [
    Workload(f"attn_{v}", "attention", f"{_DESC[v]} (B1, 8 heads x 64, seq 1024)", _build(v),
             in_quick=v == "h2o", params=dict(batch=1, heads=8, head_dim=64, seq=1024))
    for v in VARIANTS
] + [
    Workload(f"attn_{v}_2048", "attention", f"{_DESC[v]} (B1, 8 heads x 64, seq 2048)", _build(v, 2048),
             default=False, params=dict(batch=1, heads=8, head_dim=64, seq=2048))
    for v in ("causal", "h2o")
] + [
    Workload(f"attn_gqa_decode_{t}", "attention",
             f"GQA decode attention, 32 query heads over 8 KV heads x 64, static cache {t} (B1)",
             _gqa_decode(t), in_quick=t == 1024, params=dict(batch=1, heads=32, kv_heads=8, head_dim=64, cache=t))
    for t in (1024, 4096)
]
