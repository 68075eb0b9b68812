"""Small hand-built graphs with a known best strategy, shared by the planner tests."""
from __future__ import annotations

import torch

from vtc.frontend.torch_export import export_graph


def capture(fn, *inputs):
    """(graph, inputs) of fn captured by torch.export."""
    return export_graph(fn, inputs), inputs


def node(graph, op: str, k: int = 0):
    """The k-th node of `graph` whose ATen packet is `op` ("permute", "cat", ...)."""
    hits = [n for n in graph.nodes if n.op.split(".")[1 if n.op.startswith("aten.") else 0] == op]
    assert len(hits) > k, f"no {op} #{k} in {[n.op for n in graph.nodes]}"
    return hits[k]


def two_cats(x, y, z):
    """relu(x) goes into two concatenations that are graph outputs: it can be written into one of them."""
    c = x.relu()
    return torch.cat([c, y], 0), torch.cat([c, z], 1)


def cat_read_by_kernel(a, d):
    """A concatenation read by a generated kernel: each output index reads a or d."""
    return torch.cat([a, d], 1) * 2.0


def bmm_strided_operand(a, b):
    """bmm whose right operand is a permute of b [N, K, B]: strides (1, B, K*B), no BLAS layout."""
    return torch.bmm(a, b.permute(2, 1, 0))


def mm_transposed_weight(x, w):
    """x @ w.t(): the transposed weight is a column-major GEMM operand (BLAS takes it as is)."""
    return x @ w.t()


def reshape_read_by_kernel(x):
    """A contiguous reshape read by a kernel, and one handed to a GEMM."""
    y = x.reshape(8, 32)
    return y.sin(), y @ torch.ones(32, 4)


S, H, D, T = 4, 2, 8, 1024  # a 64 KB cache: reading through the update pays for deriving its inverse


def kv_cache_update(x, w, k_cache, v_cache, pos):
    """The paper's Llama example: QKV projection -> split -> reshape -> KV-cache update -> attention."""
    qkv = x @ w
    q, k, v = qkv.split(H * D, dim=-1)
    q, k, v = q.reshape(S, H, D), k.reshape(S, H, D), v.reshape(S, H, D)
    kc = k_cache.index_copy(0, pos, k)
    vc = v_cache.index_copy(0, pos, v)
    scores = (q.unsqueeze(1) * kc.unsqueeze(0)).sum(-1)
    p = scores.softmax(1)
    return (p.unsqueeze(-1) * vc.unsqueeze(0)).sum(1)


def kv_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(S, 32, generator=g), torch.randn(32, 3 * H * D, generator=g),
            torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.tensor([3, 4, 5, 6]))


def channel_shuffle(x, w1, w2):
    """Two branches -> cat -> channel shuffle (view, transpose, clone, view) -> conv: only the whole chain pays."""
    a = torch.conv2d(x, w1).relu()
    b = torch.conv2d(x, w2).relu()
    y = torch.cat([a, b], 1)
    n, c, h, w_ = y.shape
    y = y.view(n, 2, c // 2, h, w_).transpose(1, 2).contiguous().view(n, c, h, w_)
    return torch.conv2d(y, torch.ones(4, c, 1, 1))


def pointwise_chain(x, y, z):
    """A chain of pointwise ops whose buffers grow by broadcasting: [4, 8] -> [2, 4, 8] -> [3, 2, 4, 8]."""
    a = x + 1.0
    b = a * y
    c = b + z
    return c.exp()


def slice_holds_source(a, w):
    """x = exp(a) [256, 256] is read by a row sum and by a small slice that is read last.

    Virtual, the slice keeps all of x alive while the GEMM's [256, 1024] result is
    allocated; kept, x dies after the slice copies its 4 KB.
    """
    x = a.exp()
    t = x.sum(1, keepdim=True)
    s = x[:, :4]
    y = a @ w
    return (y * t).sum(1, keepdim=True) + s


B, R, KV, T2, D2 = 2, 4, 2, 64, 32


def repeat_kv_attention(q, k, v):
    """GQA decode as in the Llama-3 bench unit: keys and values repeated (expand -> clone -> reshape) for
    R query heads per KV head, both before the first GEMM (so both repeated copies are live together)."""
    ke = k.unsqueeze(2).expand(B, KV, R, T2, D2).clone().reshape(B * KV * R, T2, D2)
    ve = v.unsqueeze(2).expand(B, KV, R, T2, D2).clone().reshape(B * KV * R, T2, D2)
    p = torch.bmm(q, ke.transpose(1, 2)).softmax(-1)
    return torch.bmm(p, ve)


def repeat_kv_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B * KV * R, 1, D2, generator=g), torch.randn(B, KV, T2, D2, generator=g),
            torch.randn(B, KV, T2, D2, generator=g))


VB, VH, VT, VD = 8, 4, 2048, 128  # a 32 MiB cache: torch allocates its copy in fresh pages


def v_cache_update(x, w, k, v_cache, pos):
    """Decode's value path: a GEMM's result -> view -> transpose -> index_copy into a returned V cache, read
    by attention.  No kernel computes the new values (a GEMM does, in front of two movement ops)."""
    v = (x @ w).view(VB, 1, VH, VD).transpose(1, 2)
    vc = v_cache.index_copy(2, pos, v)
    p = torch.softmax(k @ vc.transpose(2, 3), -1)
    return p @ vc, vc


def v_cache_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(VB, 1, 64, generator=g), torch.randn(64, VH * VD, generator=g),
            torch.randn(VB, VH, 1, VD, generator=g), torch.randn(VB, VH, VT, VD, generator=g), torch.tensor([100]))
