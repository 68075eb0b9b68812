"""GEMM benchmarks (group ``gemm``, not in a plain ``vtc bench``): vtc's generated GEMM against torch.matmul
(MKL/oneDNN) and ONNX Runtime's MatMul (MLAS), float32.

- ``gemm_square_<n>``: a @ b on contiguous n x n operands, n = 64 .. 2048;
- ``gemm_skinny_m<m>``: x @ W^T of an nn.Linear(4096, 4096) for m = 1, 4, 16 rows (decoding);
- ``gemm_<name>_m<M>_k<K>_n<N>``: x @ W^T of llama_model's nn.Linear layers (``logits``: 128 x 512 @
  512 x 32000, half of llama_model's time; ``mlp_up``, ``mlp_down``, ``proj``, ``kv``);
- ``gemm_prefill_<name>_m256_k<K>_n<N>``: x @ W^T of the prefill units' nn.Linear layers (256 tokens: llama3's
  ``up`` / ``down`` / ``proj`` / ``kv``, gemma2's ``gemma_up`` / ``gemma_down`` / ``gemma_kv``);
- operands made by movement ops, where torch needs a copy first unless the mapping is a strided view:
  ``gemm_transposed`` (a.t() @ b: a strided view), ``gemm_gqa_scores`` (q @ repeat_kv(k)^T over a 2048-token
  cache, 4 query heads per KV head), ``gemm_cat`` (cat([a, b], 1) @ w) and ``gemm_gather_rows``
  (table[idx] @ w);
- ``gemm_virtual_<kind>_m<M>_k<K>_n<N>``: A a virtual cat (along M, along K, along M of a 16-batch bmm),
  embedding rows or gathered columns (``vtc.codegen.gemm_pack`` packs it by runs), and
  ``gemm_virtual_conv1x1_cat`` (a channel cat before a 1x1 convolution): docs/gemm.md;
- bf16 (``vtc.codegen.gemm_bf16``; torch's bf16 GEMM uses AMX tiles where the CPU has them;
  ``bench/gemm_bf16_side_by_side.py`` sets bf16 beside float32): ``gemm_bf16_square_1024``,
  ``gemm_bf16_skinny_m<m>`` (x @ W^T, 4096 x 4096 weight) and ``gemm_bf16_gqa_scores_q<n>`` (n query tokens
  against repeat_kv(k) over a 2048-token cache).

The vtc variants that matter here: ``vtc-all`` (gemm="auto": the per-node choice), ``vtc-gemm-vtc`` (every
GEMM generated) and ``vtc-gemm-torch`` (every GEMM through torch, a virtual operand that is not a strided
view copied first: "materialise + library").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import Workload, in_dtype, randn
from .micro import Fn


def _square(n: int):
    return lambda quick: (Fn(lambda m, a, b: a @ b, f"square_{n}"), (randn(n, n, seed=1), randn(n, n, seed=2)))


def _skinny(m: int):
    def build(quick: bool):
        h = 1024 if quick else 4096
        lin = nn.Linear(h, h, bias=False)
        return lin, (randn(m, h, seed=3),)
    return build


def _linear(m: int, k: int, n: int):
    """x [m x k] @ W^T of an nn.Linear(k, n) without bias (llama_model's projections and logits)."""
    def build(quick: bool):
        mm, kk, nn_ = (min(m, 64), min(k, 256), min(n, 1024)) if quick else (m, k, n)
        return nn.Linear(kk, nn_, bias=False), (randn(mm, kk, seed=3),)
    return build


# llama_model (prefill of 128 tokens, hidden 512, MLP 1376, vocabulary 32000): logits, MLP up / down, attention
LINEAR = [("logits", 128, 512, 32000), ("mlp_up", 128, 512, 1376), ("mlp_down", 128, 1376, 512),
          ("proj", 128, 512, 512), ("kv", 128, 512, 128)]
# the prefill units (256 tokens, hidden 1024): llama3's MLP 3584 and K / V of 4 x 64, gemma2's MLP 4096 and K / V of
# 4 x 128; q / o projections 1024 -> 1024 in both
PREFILL = [("up", 256, 1024, 3584), ("down", 256, 3584, 1024), ("proj", 256, 1024, 1024), ("kv", 256, 1024, 256),
           ("gemma_up", 256, 1024, 4096), ("gemma_down", 256, 4096, 1024), ("gemma_kv", 256, 1024, 512)]


def _transposed(quick: bool):
    n = 256 if quick else 1024
    return Fn(lambda m, a, b: a.t() @ b, "transposed"), (randn(n, n, seed=1), randn(n, n, seed=2))


def _gqa_scores(quick: bool):
    t = 256 if quick else 2048
    q, k = randn(1, 32, 16, 128, seed=1), randn(1, 8, t, 128, seed=2)

    def f(m, q, k):
        kk = k[:, :, None].expand(1, 8, 4, t, 128).reshape(1, 32, t, 128)  # repeat_kv
        return q @ kk.transpose(-1, -2)
    return Fn(f, "gqa_scores"), (q, k)


def _cat(quick: bool):
    n = 256 if quick else 1024
    return Fn(lambda m, a, b, w: torch.cat([a, b], 1) @ w, "cat"), (
        randn(n // 2, n // 2, seed=1), randn(n // 2, n // 2, seed=2), randn(n, n, seed=3))


def _gather_rows(quick: bool):
    n = 256 if quick else 1024
    idx = torch.randint(0, 4 * n, (n // 2,), generator=torch.Generator().manual_seed(4))
    return Fn(lambda m, t, i, w: t[i] @ w, "gather_rows"), (randn(4 * n, n, seed=1), idx, randn(n, n, seed=2))


def _virtual_a(kind: str, m: int, k: int, n: int):
    """A GEMM whose A is a virtual cat / gathered operand (vtc.codegen.gemm_pack packs it by runs)."""
    def build(quick: bool):
        mm, kk, nn = (min(m, 64), min(k, 256), min(n, 256)) if quick else (m, k, n)
        g = torch.Generator().manual_seed(4)
        w = randn(kk, nn, seed=3)
        if kind == "cat_rows":
            return Fn(lambda _, a, b, w: torch.cat([a, b], 0) @ w, kind), (
                randn(mm // 2, kk, seed=1), randn(mm - mm // 2, kk, seed=2), w)
        if kind == "cat_k":
            return Fn(lambda _, a, b, w: torch.cat([a, b], 1) @ w, kind), (
                randn(mm, kk // 2, seed=1), randn(mm, kk - kk // 2, seed=2), w)
        if kind == "embedding":  # a vocabulary of 8192 rows
            return Fn(lambda _, i, t, w: F.embedding(i, t) @ w, kind), (
                torch.randint(0, 8192, (mm,), generator=g), randn(8192, kk, seed=1), w)
        if kind == "gather_cols":
            return Fn(lambda _, x, p, w: x[:, p] @ w, kind), (randn(mm, kk, seed=1), torch.randperm(kk, generator=g), w)
        if kind == "bmm_cat_b16":  # 16 heads, rows of two sources (e.g. a cached prefix and new tokens)
            return Fn(lambda _, a, b, w: torch.bmm(torch.cat([a, b], 1), w), kind), (
                randn(16, mm // 2, kk, seed=1), randn(16, mm - mm // 2, kk, seed=2), randn(16, kk, nn, seed=3))
        raise ValueError(kind)
    return build


def _conv1x1_cat(quick: bool):
    c, hw = (64, 14) if quick else (256, 28)
    return Fn(lambda _, a, b, w: F.conv2d(torch.cat([a, b], 1), w), "conv1x1_cat"), (
        randn(1, c // 2, hw, hw, seed=1), randn(1, c // 2, hw, hw, seed=2), randn(c, c, 1, 1, seed=3))


VIRTUAL_A = [("cat_rows", 256, 1024, 1024), ("cat_rows", 512, 2048, 512), ("cat_k", 256, 1024, 1024),
             ("cat_k", 512, 2048, 512), ("embedding", 64, 2048, 2048), ("embedding", 512, 1024, 1024),
             ("gather_cols", 256, 1024, 1024), ("bmm_cat_b16", 128, 512, 512)]


def _bf16(build):
    return in_dtype(build, torch.bfloat16)


def _gqa_scores_q(n: int):
    def build(quick: bool):
        t = 256 if quick else 2048
        q, k = randn(1, 32, n, 128, seed=1), randn(1, 8, t, 128, seed=2)

        def f(m, q, k):
            return q @ k[:, :, None].expand(1, 8, 4, t, 128).reshape(1, 32, t, 128).transpose(-1, -2)
        return Fn(f, f"gqa_scores_q{n}"), (q, k)
    return build


WORKLOADS = [
    *[Workload(f"gemm_square_{n}", "gemm", f"a @ b, contiguous {n}x{n} float32", _square(n), in_quick=n <= 256,
               default=False, params=dict(m=n, n=n, k=n)) for n in (64, 256, 512, 1024, 2048)],
    *[Workload(f"gemm_skinny_m{m}", "gemm", f"x @ W^T (nn.Linear 4096 -> 4096, no bias), {m} rows", _skinny(m),
               in_quick=m == 1, default=False, params=dict(m=m, n=4096, k=4096)) for m in (1, 4, 16)],
    *[Workload(f"gemm_{name}_m{m}_k{k}_n{n}", "gemm", f"x @ W^T (nn.Linear {k} -> {n}, no bias), {m} rows: "
               f"llama_model's {name}", _linear(m, k, n), default=False, params=dict(m=m, n=n, k=k))
      for name, m, k, n in LINEAR],
    *[Workload(f"gemm_prefill_{name}_m{m}_k{k}_n{n}", "gemm", f"x @ W^T (nn.Linear {k} -> {n}, no bias), {m} rows: "
               f"the prefill units' {name}", _linear(m, k, n), default=False, params=dict(m=m, n=n, k=k))
      for name, m, k, n in PREFILL],
    Workload("gemm_transposed", "gemm", "a.t() @ b, 1024^3 (a strided view)", _transposed, default=False),
    Workload("gemm_gqa_scores", "gemm", "q @ repeat_kv(k)^T: 32 query heads x 16 tokens, 8 KV heads x 2048",
             _gqa_scores, in_quick=True, default=False),
    Workload("gemm_cat", "gemm", "cat([a, b], 1) @ w, 512x1024 @ 1024x1024", _cat, default=False),
    Workload("gemm_gather_rows", "gemm", "table[idx] @ w, 512 rows of a 4096x1024 table @ 1024x1024",
             _gather_rows, default=False),
    *[Workload(f"gemm_virtual_{kind}_m{m}_k{k}_n{n}", "gemm", f"{kind}: A [{m} x {k}] virtual (cat / gathered) "
               f"@ [{k} x {n}]", _virtual_a(kind, m, k, n), default=False, params=dict(m=m, n=n, k=k))
      for kind, m, k, n in VIRTUAL_A],
    Workload("gemm_virtual_conv1x1_cat", "gemm", "conv2d 1x1 of cat([a, b], channels): 256 -> 256 channels, 28x28",
             _conv1x1_cat, default=False),
    Workload("gemm_bf16_square_1024", "gemm", "a @ b, contiguous 1024x1024 bf16", _bf16(_square(1024)),
             default=False),
    *[Workload(f"gemm_bf16_skinny_m{m}", "gemm", f"x @ W^T (nn.Linear 4096 -> 4096, no bias), {m} rows, bf16",
               _bf16(_skinny(m)), default=False) for m in (1, 4, 16)],
    *[Workload(f"gemm_bf16_gqa_scores_q{n}", "gemm", f"q @ repeat_kv(k)^T in bf16: 32 query heads x {n} tokens, "
               f"8 KV heads x 2048", _bf16(_gqa_scores_q(n)), default=False) for n in (1, 16)],
]
