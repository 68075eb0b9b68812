"""A differential fuzz campaign (session 24) over the fast paths of sessions 21-23, and its CI sample.

Each case is drawn from its seed (``Case``), compiled by vtc and compared with torch eager:
- ``conv``: a Conv2d in float16 (two thirds) or float32 of drawn channels (1, 3, 8, 17, 24, 58...), kernel,
  stride, padding and groups (depthwise too), channels_last at times, then a batch norm, a ReLU, a max / avg pool
  at times; the broadcast, direct, panel and dot forms (conv_bcast, conv_direct, conv_panels, conv_t) with F16C
  row narrowing, float16 depthwise and pools;
- ``attn``: float16 (or float32) attention as transformers writes it (bmm, scale, a causal or additive mask,
  softmax, bmm; GQA by expand + reshape), q / k / v from Linears, a KV cache the new keys and values are
  concatenated to (GEMMs storing into a pushed cat), the cache returned too; 1 query (decode) or a few;
- ``fold``: values computed from parameters (vtc.ir.fold.fold_weight_chains): weight_norm, ``W * s``, a LoRA
  merge ``W + B @ A * scale``, RoPE tables from an ``inv_freq`` buffer, a T5-like bucketed position bias, two
  modules of the same recipe on different parameters, a weight behind a movement chain;
- ``gemm``: a Linear (float32 or float16) on a constant weight at rows 1, 2, 11, 12, 16, 17, 31, 32, 49, 128, 129
  (weight_rows / skinny_packed / panels), weights just below, at and above 512 KB
  (gemm.SKINNY_PACKED_WT_MIN_BYTES) and, at times, gemm.WT_PACKED_MAX_BYTES patched down to just below or above
  the weight's size (as tests/runtime/test_packed_gemm_weights.py does);
each input behind a drawn movement chain (tests.adversarial.draw_chain_into: transpose, permute, narrow, strided
slice, cat, index_select, gather, roll, flip, pad, expand, channel shuffle, a pointwise op).  After the first
call: the call again, new values, in-place changes of the parameters (``mul_``, a slice's ``add_``, ``copy_``,
a batch norm's running statistics) each followed by a call, and for a dynamic row count other row counts.

Tolerances (``close``): float32 rtol 1e-4 and atol 1e-4 of the output's largest magnitude (a few 1e-6 apart:
sums in another order); float16: two float16 units in the last place of eager's element plus 2^-9 of the
output's largest magnitude (tests/codegen/test_decode_fp16.py's: vtc and eager round each result once, their
float32 sums in another order may round to neighbouring float16s, and a batch norm or softmax after it carries
that on); a wrong answer is off by about the output's magnitude.

The campaign, by hand (not collected by pytest):
    VTC_CACHE_DIR=/tmp/vtc-cache-x nice -n 19 .venv/bin/python -m tests.test_adversarial_fast_paths3 \\
        --kind conv --seed 1 --cases 100          # --case 17 -v: one case again, its model printed
CI runs ``CI_CASES`` seeds of each kind."""
from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Callable
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F

import vtc
from tests.adversarial import draw_chain_into, rand, run_campaign, run_chain, run_described
from tests.codegen.util import kernels, torch_threads
from tests.fuzz_campaign import Rand
from vtc.codegen import gemm

H = torch.float16
Op = tuple[str, Callable[[torch.Tensor], torch.Tensor]]


def _text(ops: list[Op]) -> str:
    return "".join(f".{d}" for d, _ in ops)


def _ulp16(x: torch.Tensor) -> torch.Tensor:
    mag = x.double().abs().clamp_min(2.0 ** -14)
    return torch.exp2(torch.floor(torch.log2(mag)) - 10)


def close(got, want, what: str) -> None:
    """Each output equal to eager's in shape and dtype and within the module docstring's tolerances."""
    got, want = [list(v) if isinstance(v, (tuple, list)) else [v] for v in (got, want)]
    assert len(got) == len(want), f"{what}: {len(got)} outputs, eager {len(want)}"
    for j, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what} output {j}: {a.shape} {a.dtype}, eager {b.shape} {b.dtype}"
        scale = float(b.abs().max()) if b.numel() else 1.0
        if b.dtype == H:
            diff = (a.double() - b.double()).abs()
            tol = 2 * _ulp16(b) + 2.0 ** -9 * scale
            bad = ~((diff <= tol) | (a.isnan() & b.isnan()) | (a == b))
            assert not bool(bad.any()), (f"{what} output {j}: {int(bad.sum())} of {b.numel()} elements past the tolerance, "
                                         f"worst by {(diff - tol)[bad].max().item()} (largest |eager| {scale})")
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * max(1.0, scale), equal_nan=True,
                                       msg=lambda m, j=j: f"{what} output {j}\n{m}")


# -- the models -------------------------------------------------------------------------------------------------
class ConvNet(torch.nn.Module):
    def __init__(self, front: list[Op], conv: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d | None, relu: bool,
                 pool: str) -> None:
        super().__init__()
        self.front, self.conv, self.bn, self.relu, self.pool = front, conv, bn, relu, pool
        self.pool_args: dict = {}
        self.wchain: list[Op] = []

    def forward(self, x):
        x, c = run_chain(self.front, x), self.conv
        if self.wchain:  # the weight behind a movement chain (folded into a constant copy)
            y = F.conv2d(x, run_chain(self.wchain, self.w), c.bias, c.stride, c.padding, c.dilation, c.groups)
        else:
            y = c(x)
        if self.bn is not None:
            y = self.bn(y)
        if self.relu:
            y = torch.relu(y)
        if self.pool.startswith("max"):
            y = F.max_pool2d(y, **self.pool_args)
        elif self.pool.startswith("avg"):
            y = F.avg_pool2d(y, **self.pool_args)
        elif self.pool == "mean":
            y = y.mean((2, 3))
        return y


class Attention(torch.nn.Module):
    """Llama's attention as transformers writes it (eager): q / k / v Linears, the new k / v concatenated to the
    cache, repeat_kv, scores scaled and masked, softmax, the output Linear; returns (out, k cache, v cache)."""

    def __init__(self, front: list[Op], e: int, heads: int, kv_heads: int, d: int, mask: str, bias: bool) -> None:
        super().__init__()
        self.front, self.heads, self.kv_heads, self.d, self.mask = front, heads, kv_heads, d, mask
        self.q = torch.nn.Linear(e, heads * d, bias=bias)
        self.k = torch.nn.Linear(e, kv_heads * d, bias=bias)
        self.v = torch.nn.Linear(e, kv_heads * d, bias=bias)
        self.o = torch.nn.Linear(heads * d, e, bias=False)

    def forward(self, x, k_cache, v_cache):
        x = run_chain(self.front, x)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.d).transpose(1, 2)
        k = torch.cat([k_cache, self.k(x).view(b, s, self.kv_heads, self.d).transpose(1, 2)], 2)
        v = torch.cat([v_cache, self.v(x).view(b, s, self.kv_heads, self.d).transpose(1, 2)], 2)
        t, n = k.shape[2], self.heads // self.kv_heads
        kk = k[:, :, None].expand(b, self.kv_heads, n, t, self.d).reshape(b, self.heads, t, self.d)
        vv = v[:, :, None].expand(b, self.kv_heads, n, t, self.d).reshape(b, self.heads, t, self.d)
        scores = torch.matmul(q, kk.transpose(2, 3)) * self.d ** -0.5
        if self.mask != "none":
            pos, kv = torch.arange(s) + (t - s), torch.arange(t)
            hidden = kv[None, :] > pos[:, None]
            if self.mask == "causal":
                scores = scores.masked_fill(hidden, float("-inf"))
            else:  # transformers' additive mask: the dtype's minimum
                scores = scores + torch.zeros(s, t, dtype=scores.dtype).masked_fill(hidden, torch.finfo(scores.dtype).min)
        p = torch.softmax(scores, dim=-1)
        out = torch.matmul(p, vv).transpose(1, 2).reshape(b, s, self.heads * self.d)
        return self.o(out), k, v


class FoldNet(torch.nn.Module):
    """A drawn value computed from parameters only (``recipe``), read by a GEMM or a pointwise op on x."""

    def __init__(self, front: list[Op], recipe: str, k: int, n: int, rank: int, chain: list[Op]) -> None:
        super().__init__()
        self.front, self.recipe, self.chain = front, recipe, chain
        self.w = torch.nn.Parameter(torch.randn(n, k) / k ** 0.5)
        if recipe == "weight_norm":
            self.lin = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(k, n))
        elif recipe == "scaled":
            self.s = torch.nn.Parameter(torch.rand(n, 1) + 0.5)
        elif recipe in ("lora", "lora_twice"):
            self.a = torch.nn.Parameter(torch.randn(rank, k) / k ** 0.5)
            self.b = torch.nn.Parameter(torch.randn(n, rank) / rank ** 0.5)
            if recipe == "lora_twice":  # a second module, the same recipe on other parameters
                self.w2 = torch.nn.Parameter(torch.randn(n, n) / n ** 0.5)
                self.a2 = torch.nn.Parameter(torch.randn(rank, n) / n ** 0.5)
                self.b2 = torch.nn.Parameter(torch.randn(n, rank) / rank ** 0.5)
        elif recipe == "rope":
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, k, 2).float() / k))
        elif recipe == "t5_bias":
            self.emb = torch.nn.Embedding(8, 1)
        elif recipe == "shared":  # one computed weight read twice: W * s by two GEMMs
            self.s = torch.nn.Parameter(torch.rand(1, k) + 0.5)

    def forward(self, x):
        x = run_chain(self.front, x)
        r = self.recipe
        if r == "weight_norm":
            return self.lin(x)
        if r == "scaled":
            return F.linear(x, run_chain(self.chain, self.w * self.s))
        if r == "lora":
            return F.linear(x, self.w + self.b @ self.a * 0.5)
        if r == "lora_twice":
            h = torch.relu(F.linear(x, self.w + self.b @ self.a * 0.5))
            return F.linear(h, self.w2 + self.b2 @ self.a2 * 0.5)
        if r == "chain":
            return x @ run_chain(self.chain, self.w).t()
        if r == "shared":
            ws = self.w * self.s
            return F.linear(torch.relu(F.linear(x, ws)), ws.t())
        if r == "rope":  # x [b, s, k]: the rotation of its halves by the positions' angles
            s = x.shape[-2]
            angles = torch.outer(torch.arange(s, dtype=torch.float32), self.inv_freq)
            emb = torch.cat([angles, angles], -1)
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
            half = x.shape[-1] // 2
            rot = torch.cat([-x[..., half:], x[..., :half]], -1)
            return F.linear(x * cos + rot * sin, self.w)
        # t5_bias: x [b, s, s] scores plus a bias of the bucketed relative position (a parameter's embedding)
        s = x.shape[-1]
        rel = torch.arange(s)[None, :] - torch.arange(s)[:, None]
        bucket = (rel.abs().clamp(max=3) + (rel > 0).long() * 4)
        return torch.softmax(x + self.emb(bucket)[..., 0], -1)


class Lin(torch.nn.Module):
    """F.linear(x, W, b) (W [n, k]) or, `row_major`, x @ W + b (W [k, n]: B's rows read in place)."""

    def __init__(self, front: list[Op], k: int, n: int, bias: bool, relu: bool, row_major: bool) -> None:
        super().__init__()
        self.front, self.relu, self.row_major = front, relu, row_major
        self.w = torch.nn.Parameter(torch.randn([k, n] if row_major else [n, k]) / k ** 0.5)
        self.b = torch.nn.Parameter(torch.randn(n) * 0.1) if bias else None

        self.cat_dim: int | None = None  # the result stored into a cat with a second input along this dim

    def forward(self, x, *z):
        x = run_chain(self.front, x)
        y = (x @ self.w if self.b is None else x @ self.w + self.b) if self.row_major else F.linear(x, self.w, self.b)
        y = torch.relu(y) if self.relu else y
        return y if self.cat_dim is None else torch.cat([z[0], y], self.cat_dim)


# -- the cases --------------------------------------------------------------------------------------------------
KINDS = ("conv", "attn", "fold", "gemm")
GEMM_ROWS = (1, 2, 11, 12, 16, 17, 31, 32, 49, 128, 129)


class Case:
    """One drawn case: model, inputs (per row count), dtype, options, patches, description."""

    def __init__(self, kind: str, seed: int, case: int) -> None:
        self.kind, self.seed = kind, (seed << 20) + case + 7919 * KINDS.index(kind)
        r = self.r = Rand(self.seed)
        torch.manual_seed(r.randrange(1 << 30))
        self.dtype = H if r.random() < 0.67 else torch.float32
        self.threads = r.choice([1, 2])
        self.gemm = r.choice(["auto", "auto", "vtc"])
        self.dynamic_compile = r.random() < 0.25  # other row counts through vtc.compile(dynamic=True) too
        self.patches: list[tuple[object, str, object]] = []
        self.row_dims: list[int | None] = []
        self.rows, self.other_rows = 1, []
        getattr(self, "_make_" + kind)(r)
        self.model.eval().to(self.dtype)

    # each _make_*: self.model, self.shapes (inputs at self.rows), self.row_dims, self.notes
    def _front(self, r: Rand, want: list[int], row: int | None = None, dynamic: bool = False):
        shape, ops, row_in = draw_chain_into(r, want, r.choice([0, 1, 2, 2, 3]), row, dynamic, max_numel=1 << 20)
        return shape, ops, row_in

    def _make_conv(self, r: Rand) -> None:
        form = r.choice(["bcast", "direct", "panels", "dot", "grouped", "depthwise", "any"])
        k, stride, pad, groups, dilation = 1, 1, 0, 1, 1
        if form == "bcast":
            c, o, hw = r.choice([8, 17, 24, 58, 116]), r.choice([8, 17, 24, 58, 116]), r.choice([3, 5, 7, 14])
        elif form == "direct":
            c, o, hw = r.choice([1, 3, 4]), r.choice([8, 16, 24, 33]), r.choice([17, 40, 64, 70])
            k, stride = r.choice([3, 5, 7]), r.choice([1, 2])
            pad = r.choice([0, k // 2])
        elif form == "panels":
            c, o, hw = r.choice([8, 24, 58]), r.choice([17, 24, 58]), r.choice([17, 28, 33])
            k = r.choice([1, 3])
            pad = k // 2
        elif form == "dot":
            c, o, hw = r.choice([127, 232, 464]), r.choice([64, 127, 256]), r.choice([3, 5, 7])
        elif form == "grouped":
            groups = r.choice([2, 3, 4])
            c, o, hw = groups * r.choice([3, 8, 12]), groups * r.choice([4, 8, 16]), r.choice([9, 17, 29])
            k, stride = 3, r.choice([1, 2])
            pad = r.choice([0, 1])
        elif form == "depthwise":
            c = r.choice([8, 17, 24, 58])
            o, groups, hw = c * r.choice([1, 1, 2]), c, r.choice([7, 14, 17, 28])
            k, stride = r.choice([3, 5]), r.choice([1, 2])
            pad = r.choice([k // 2, k // 2, 0])
        else:  # kernels, strides, paddings of two sizes, dilation
            c, o, hw = r.choice([1, 3, 17, 32]), r.choice([1, 3, 17, 32]), r.choice([1, 3, 8, 17])
            if r.random() < 0.3 and c == o:
                groups = c
            k, stride = (r.choice([1, 3]), r.choice([1, 3])), (r.choice([1, 2, 3]), r.choice([1, 2]))
            pad, dilation = (r.choice([0, 1, 2]), r.choice([0, 1])), r.choice([1, 1, 2])
            pad = tuple(max(p, (dilation * (kk - 1) + 1 - hw + 1) // 2) for p, kk in zip(pad, k))
        conv = torch.nn.Conv2d(c, o, k, stride, pad, groups=groups, bias=r.random() < 0.5,
                               dilation=dilation if form == "any" else 1)
        with torch.no_grad():
            conv.weight.mul_(r.choice([1.0, 3.0]))
        if r.random() < 0.2:
            conv = conv.to(memory_format=torch.channels_last)
        wshape, wchain, _ = draw_chain_into(r, list(conv.weight.shape), r.choice([1, 2]), max_numel=1 << 20) \
            if r.random() < 0.3 else (None, [], None)
        bn = None
        if r.random() < 0.5:
            bn = torch.nn.BatchNorm2d(o)
            with torch.no_grad():
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.uniform_(-1.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)
        n = r.choice([1, 1, 2, 3])
        out_hw = min(conv(torch.empty(1, c, hw, hw)).shape[-2:])
        pool = r.choice(["", "", "max", "avg", "mean"]) if out_hw >= 2 else ""
        self.dynamic = r.random() < 0.25
        self.rows = n
        shape, front, row = self._front(r, [n, c, hw, hw], 0, self.dynamic)
        self.other_rows = [m for m in (1, 2, 3) if m != n][:1] if self.dynamic and row is not None else []
        self.model = ConvNet(front, conv, bn, r.random() < 0.5, pool)
        if wchain:
            self.model.wchain = wchain
            self.model.w = torch.nn.Parameter(torch.randn(wshape) * conv.weight.abs().mean() * 1.25)
        if pool in ("max", "avg"):  # (kernel, stride, padding, ceil_mode[, count_include_pad])
            pk = r.choice([2, 3]) if out_hw >= 3 else 2
            args = dict(kernel_size=pk, stride=r.choice([1, 2]), padding=r.choice([0, pk // 2]),
                        ceil_mode=r.choice([False, True]))
            if pool == "avg":
                args["count_include_pad"] = r.choice([False, True])
            self.model.pool_args = args
            pool = f"{pool}{tuple(args.values())}"
        self.shapes, self.row_dims = [shape], [row]
        self.notes = (f"{form}: Conv2d({c}, {o}, {k}, stride {stride}, padding {pad}, dilation {dilation}, groups {groups}, bias "
                      f"{conv.bias is not None}) on {n}x{hw}x{hw}{', channels_last' if conv.weight.stride()[1] == 1 and c > 1 else ''}"
                      f"{', bn' if bn is not None else ''}{', relu' if self.model.relu else ''}"
                      f"{', pool ' + pool if pool else ''}; x {shape}: x{_text(front)}"
                      f"{f'; W = w{_text(wchain)} of {wshape}' if wchain else ''}")

    def _make_attn(self, r: Rand) -> None:
        heads = r.choice([1, 2, 4, 8])
        kv = r.choice([g for g in (1, 2, heads) if heads % g == 0])
        d = r.choice([16, 24, 32, 64])
        e = r.choice([32, 64, 96])
        b, s = r.choice([1, 1, 2]), r.choice([1, 1, 1, 3, 17])
        past = r.choice([0, 1, 5, 17, 127, 300])
        if past == 0 and s == 1:
            past = 3
        mask = r.choice(["causal", "additive", "none"] if s > 1 else ["none", "causal", "additive"])
        shape, front, _ = self._front(r, [b, s, e])
        self.model = Attention(front, e, heads, kv, d, mask, r.random() < 0.3)
        self.shapes = [shape, [b, kv, past, d], [b, kv, past, d]]
        self.row_dims = [None, 2, 2]  # the "rows": the cached keys (decode steps: one more each)
        self.rows = past
        self.other_rows = [m for m in (past + 1, r.choice([2, 64, 129])) if m != past] if r.random() < 0.5 else []
        self.notes = (f"{heads} heads ({kv} kv) of {d}, e {e}, batch {b}, {s} queries on {past} cached keys (others "
                      f"{self.other_rows}), mask "
                      f"{mask}; x {shape}: x{_text(front)}")

    def _make_fold(self, r: Rand) -> None:
        recipe = r.choice(["weight_norm", "scaled", "lora", "lora_twice", "chain", "shared", "rope", "t5_bias"])
        k, n = r.choice([16, 33, 64, 128, 256]), r.choice([1, 17, 48, 64, 130])
        if recipe == "rope":
            k = r.choice([16, 32, 64])
        chain: list[Op] = []
        if recipe in ("chain", "scaled"):
            wshape, chain, _ = draw_chain_into(r, [n, k], r.choice([1, 2, 3]), max_numel=1 << 20)
            self.fold_w_shape = wshape
        self.rows = r.choice([1, 3, 17, 33])
        b = r.choice([1, 2])
        want = [b, self.rows, self.rows] if recipe == "t5_bias" else [b, self.rows, k]
        self.dynamic = recipe != "t5_bias" and r.random() < 0.4  # (the RoPE tables' length is the row count)
        shape, front, row = self._front(r, want, 1, self.dynamic)
        self.other_rows = [m for m in (r.choice([1, 2, 5, 17]), r.choice([3, 33])) if m != self.rows] \
            if self.dynamic and row is not None else []
        model = FoldNet(front, recipe, k, n, r.choice([1, 4, 8]), chain)
        if chain:
            model.w = torch.nn.Parameter(torch.randn(wshape) / k ** 0.5)
            if recipe == "scaled":
                model.s = torch.nn.Parameter(torch.rand(*wshape[:-1], 1) + 0.5)
        self.model = model
        self.shapes, self.row_dims = [shape], [row if self.other_rows else None]
        if self.dtype == H and recipe in ("rope", "t5_bias"):
            self.dtype = torch.float32  # (the tables' float32 math then .to: compared as float32)
        self.notes = f"{recipe}: k {k}, n {n}, x {shape}: x{_text(front)}" + (f"; w{_text(chain)} of {list(model.w.shape)}"
                                                                            if chain else "")

    def _make_gemm(self, r: Rand) -> None:
        self.rows = r.choice(GEMM_ROWS)
        bytes_per = 2 if self.dtype == H else 4
        target = r.choice([1 << 19, 1 << 19, 1 << 17, 1 << 21]) // bytes_per  # elements of W near 512 KB
        k = r.choice([128, 256, 512, 1024, 2048])
        n = max(1, target // k + r.choice([-1, 0, 1, 7]))
        self.dynamic = r.random() < 0.3
        lead, row = ([self.rows], 0) if r.random() < 0.5 else ([r.choice([1, 2]), self.rows], 1)
        shape, front, row_in = self._front(r, lead + [k], row, self.dynamic)
        self.other_rows = [m for m in {r.choice(GEMM_ROWS), r.choice(GEMM_ROWS)} if m != self.rows] \
            if self.dynamic and row_in is not None else []
        self.model = Lin(front, k, n, r.random() < 0.5, r.random() < 0.3, r.random() < 0.25)
        if not self.model.row_major and r.random() < 0.25:  # W stored transposed
            self.model.w = torch.nn.Parameter(self.model.w.detach().t().contiguous().t())
        if r.random() < 0.3:
            self.patches.append((gemm, "WT_PACKED_MAX_BYTES", 4 * k * n + r.choice([-1, 0])))
        if r.random() < 0.2:
            self.patches.append((gemm, "SKINNY_PACKED_WT_MIN_BYTES", 4 * k * n + r.choice([0, 1])))
        self.shapes, self.row_dims = [shape], [row_in]
        if not self.other_rows and r.random() < 0.3:  # a GEMM storing into a pushed cat (a KV cache's)
            out = list(self.model(torch.empty(shape)).shape)
            self.model.cat_dim = r.choice([-1, -2])
            out[self.model.cat_dim] = r.choice([1, 3, 17])
            self.shapes.append(out)
            self.row_dims.append(None)
        stored = " x @ W" if self.model.row_major else " W^T stored" if self.model.w.stride()[0] == 1 else ""
        self.notes = (f"Linear({k}, {n}) {bytes_per * k * n} B{stored}"
                      f", rows {self.rows} (others {self.other_rows}); x {shape}: x{_text(front)}; "
                      f"patches {[(a, v) for _, a, v in self.patches]}"
                      f"{f'; cat([z {self.shapes[1]}, y], {self.model.cat_dim})' if self.model.cat_dim else ''}")

    def inputs(self, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for shape, row in zip(self.shapes, self.row_dims):
            shape = list(shape)
            if row is not None and rows != self.rows:
                shape[row] = rows
            out.append(rand(shape, g, self.dtype))
        return tuple(out)

    def describe(self) -> str:
        return (f"{self.kind} {str(self.dtype)[6:]}: {self.notes}; gemm {self.gemm}, threads {self.threads}"
                f"{', dynamic compile' if self.dynamic_compile and self.other_rows else ''}")

    def changes(self) -> list[tuple[str, Callable[[], None]]]:
        """In-place changes of the model's parameters and buffers, each followed by a call."""
        params = [(name, p) for name, p in self.model.named_parameters()]
        g = torch.Generator().manual_seed(self.seed)
        out = []
        for j in range(3):
            name, p = params[self.r.randrange(len(params))]
            what = ["mul_(-2)", "[:k].add_(0.5)", "copy_(new)"][j]
            fn = [lambda p=p: p.mul_(-2.0),
                  lambda p=p: p[: max(1, p.shape[0] // 3)].add_(0.5),
                  lambda p=p: p.copy_(((torch.rand(p.shape, generator=g) - 0.5) * 2 * p.abs().max().clamp_min(0.1)).to(p.dtype))][j]
            out.append((f"{name}.{what}", fn))
        bn = getattr(self.model, "bn", None)
        if bn is not None:
            out.append(("bn.running_var.mul_(2)", lambda: bn.running_var.mul_(2.0)))
        return out


def run_case(case: Case) -> list[str]:
    """The case's calls, each against eager; the steps done (raises at the first wrong one)."""
    done = []
    m, x = case.model, case.inputs(case.rows, 1)
    with contextlib.ExitStack() as stack:
        for obj, attr, value in case.patches:
            stack.enter_context(patch.object(obj, attr, value))
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch_threads(case.threads))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        compiled = vtc.compile(m, x, gemm=case.gemm)
        close(compiled(*x), m(*x), "first call")
        close(compiled(*x), m(*x), "the call again")
        x2 = case.inputs(case.rows, 2)
        close(compiled(*x2), m(*x2), "new values")
        done.append("calls")
        for what, change in case.changes():
            change()
            close(compiled(*x), m(*x), f"after {what}")
            done.append(what)
        for n in case.other_rows:
            xn = case.inputs(n, 3 + n)
            close(compiled(*xn), m(*xn), f"{n} rows")
            close(compiled(*x), m(*x), f"{case.rows} rows again after {n}")
            done.append(f"rows {n}")
        if case.other_rows and case.dynamic_compile:
            dyn = vtc.compile(m, x, gemm=case.gemm, dynamic=True)
            for n in [case.rows, *case.other_rows]:
                xn = case.inputs(n, 5 + n)
                close(dyn(*xn), m(*xn), f"vtc.compile(dynamic=True), {n} rows")
            case.changes()[0][1]()
            close(dyn(*x), m(*x), "vtc.compile(dynamic=True) after a change")
            done.append("dynamic")
        report = compiled.report.to_dict()
        folded = report["packing"].get("folded_nodes", 0)
        case.paths = [q["path"] or q["choice"] for q in report["gemm"]] + [f"folded {folded}"] * bool(folded) + sorted(
            {k.kind for k in kernels(compiled)} - {"gemm"}) + [f"fallback {op}" for op in report["fallback_ops"]]
    return done


# -- CI: a few cases of each kind, the same every run ------------------------------------------------------------
CI_CASES = {"conv": 4, "attn": 3, "fold": 3, "gemm": 3}


@pytest.mark.parametrize("kind,case", [(k, i) for k, n in CI_CASES.items() for i in range(n)])
def test_drawn_case(kind, case):
    run_described(Case(kind, 0, case), run_case)


# -- the campaign ---------------------------------------------------------------------------------------------
def main() -> int:
    return run_campaign(__doc__, KINDS, Case, run_case, "/tmp/vtc-fuzz3.jsonl")


if __name__ == "__main__":
    sys.exit(main())
