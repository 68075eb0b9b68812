"""A fuzz campaign run by hand (not collected by pytest): random small models that mix the fast paths of
sessions 18-19 with movement ops in front and behind, compiled by vtc and compared with torch eager.

    VTC_CACHE_DIR=/tmp/vtc-cache-fuzz nice -n 19 .venv/bin/python -m tests.fuzz_campaign --seed 1 --cases 200
    .venv/bin/python -m tests.fuzz_campaign --seed 1 --case 17 -v     # one case again, its model printed
    ... --kind bf16 | onnx | weights                                      # the other kinds (session 21), below

A case draws (from its own seed, so it reruns alone):
- a body: Linear / two Linears / x @ W^T / x @ W (each half the time through a drawn chain on the weight: flip,
  slices, cat, gather...) / one weight read as W^T and W / bmm / conv2d / attention (GQA, causal) / a Swin-like
  window Linear / x^T * 1.5 + y on rows of 512-2048 floats; weights above and below 512 KB (the skinny packed
  path's bound), stored transposed or channels_last at times; 1..17 rows mostly (and some 20..130);
- a movement chain in front of each input (tests.adversarial.draw_chain_into, drawn backwards from the shape the
  body wants: transpose, permute, narrow (to rows 1024 / 2048 floats apart too), strided slice, cat,
  index_select, gather, roll, flip, pad, expand, flatten / unflatten, channel shuffle, a pointwise op) and one
  behind the body (tests.adversarial.draw_chain);
- options: gemm auto / vtc, plan greedy / all, 1 or 2 torch threads, grad enabled at times, inputs in a
  transposed layout at times, NaN in every input element the model does not read at times (``_poisoned``);
- what happens after the first call: the same call again (the fast call), new values, weights changed in place
  (before the first call too), new row counts (vtc's dynamic path; more sizes than it keeps), a replan, three
  Python threads at once, torch.compile(backend="vtc", dynamic=True) and vtc.compile(dynamic=True).
--kind (each its own draws for a seed; the torch kind's those of session 20):
- torch (the default): as above, float32;
- bf16: the model and inputs in bf16 or fp16 (drawn), compared with eager in the same dtype (LOW_TOL);
- onnx: the model exported (the dynamo exporter or TorchScript's, drawn, folded or not; dynamic row dims in dynamic
  cases), a quarter of the files bf16 / fp16, compiled by vtc from the ModelProto and called with torch tensors or
  numpy arrays; compared with onnxruntime and eager (``run_onnx_case``); a model no exporter takes is skipped;
- weights: bodies with a drawn chain on every weight (x @ W^T, x @ W, tied, a cat of two weights, conv2d).
Each result is compared with eager's with explicit tolerances (``_close``); an exception is a finding too.  One
line per case; failures also go, with the model's description and traceback, to the --log file (JSON lines)."""
from __future__ import annotations

import argparse
import copy
import faulthandler
import io
import logging
import json
import random
import sys
import threading
import time
import traceback
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

import vtc
from tests.adversarial import draw_chain, draw_chain_into, rand, run_chain
from tests.codegen.util import torch_threads

Op = tuple[str, Callable[[torch.Tensor], torch.Tensor]]
ROWS_FEW = list(range(1, 18))
ROWS_MORE = [20, 24, 31, 48, 49, 64, 100, 130]
BIG_K, BIG_N = [512, 1000, 1024, 2048], [128, 256, 300, 512, 600, 1024]  # K * N >= 131072 floats: >= 512 KB
SMALL_K, SMALL_N = [16, 33, 64, 96, 128, 257, 512, 1024], [1, 7, 32, 33, 64, 100, 127]


class Rand(random.Random):
    """random.Random with the one method tests.adversarial.Draw adds (draw_chain takes either)."""

    def permutation(self, n: int) -> list[int]:
        p = list(range(n))
        self.shuffle(p)
        return p


def _rows(r: Rand) -> int:
    return r.choice(ROWS_FEW) if r.random() < 0.75 else r.choice(ROWS_MORE)


def _weight_dims(r: Rand) -> tuple[int, int]:
    """(K, N): above 512 KB half the time, at most 8 MB."""
    if r.random() < 0.5:
        while True:
            k, n = r.choice(BIG_K), r.choice(BIG_N)
            if k * n >= 131072 and k * n <= 2 << 20:
                return k, n
    return r.choice(SMALL_K), r.choice(SMALL_N)


# -- the bodies ------------------------------------------------------------------------------------------------
class Drawn(torch.nn.Module):
    """fronts[j] applied to input j, then the body (a method name of this class), then the back chain."""

    def __init__(self, body: str, fronts: list[list[Op]], back: list[Op], **layers) -> None:
        super().__init__()
        self.body, self.fronts, self.back = body, fronts, back
        self.cfg: dict = {}
        for name, layer in layers.items():
            setattr(self, name, layer)

    def forward(self, *xs):
        ts = [run_chain(f, x) for f, x in zip(self.fronts, xs)]
        return run_chain(self.back, getattr(self, "_" + self.body)(*ts))

    def _linear(self, t):
        y = self.l1(t)
        return F.relu(y) if self.cfg.get("relu") else y

    def _mlp(self, t):
        return self.l2(F.gelu(self.l1(t)))

    def _wt(self, t):
        return t @ run_chain(self.wchain, self.w).t()

    def _w(self, t):
        return t @ run_chain(self.wchain, self.w)

    def _tied(self, t):
        w = run_chain(getattr(self, "wchain", []), self.w)
        return F.relu(t @ w.t()) @ w  # one weight read as W^T and as W (two packed layouts)

    def _catw(self, t):
        return t @ torch.cat([self.w0, run_chain(self.wchain, self.w)]).t()  # two weights as one (a fused QKV)

    def _convw(self, t):
        c = self.cfg
        return F.conv2d(t, run_chain(self.wchain, self.w), self.b, c["stride"], c["padding"], groups=c["groups"])

    def _tadd(self, a, b):
        y = a.transpose(-1, -2) * 1.5 + b  # a register-transposed pointwise kernel (tiles, LOADS_FIRST)
        return torch.where(y > 0, y, b * 0.5) if self.cfg.get("where") else y

    def _bmm(self, a, b):
        return torch.bmm(a, b)

    def _conv(self, t):
        return self.conv(t)

    def _attn(self, t):
        h, kvh, causal = self.cfg["heads"], self.cfg["kv_heads"], self.cfg["causal"]
        q = self.q(t).unflatten(-1, (h, -1)).transpose(1, 2)
        k = self.k(t).unflatten(-1, (kvh, -1)).transpose(1, 2)
        v = self.v(t).unflatten(-1, (kvh, -1)).transpose(1, 2)
        if kvh != h:
            k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o(o.transpose(1, 2).flatten(2))

    def _swin(self, t):
        ws, s = self.cfg["window"], self.cfg["shift"]
        b, hh, ww, c = t.shape
        x = t.roll((-s, -s), (1, 2)) if s else t
        x = x.view(b, hh // ws, ws, ww // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        x = self.l1(x)
        x = x.view(b, hh // ws, ww // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hh, ww, c)
        return x.roll((s, s), (1, 2)) if s else x


BODIES = ("linear", "linear", "mlp", "wt", "w", "tied", "bmm", "conv", "attn", "swin", "tadd")
KINDS = {"torch": BODIES, "bf16": BODIES, "onnx": BODIES, "weights": ("wt", "w", "tied", "catw", "convw")}
LOW_TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}  # tests.adversarial.BF16_TOL; fp16 has 3 more bits


def _text(name: str, ops: list[Op]) -> str:
    return name + "".join(f".{d}" for d, _ in ops)


def _param_of(r: Rand, shape: list[int], fan_in: int | None = None) -> torch.nn.Parameter:
    """A weight of this shape and magnitude ~1 / sqrt(fan_in) (default: its last dim), stored transposed a quarter
    of the time."""
    w = torch.randn(shape) / (fan_in or shape[-1]) ** 0.5
    if len(shape) >= 2 and r.random() < 0.25:
        w = w.transpose(-1, -2).contiguous().transpose(-1, -2)
    return torch.nn.Parameter(w)


class Case:
    """One drawn case: the model, its input shapes per row count, options and what to do after the first call."""

    def __init__(self, seed: int, case: int, kind: str = "torch") -> None:
        self.seed = (seed << 20) + case
        self.kind = kind
        r = self.r = Rand(self.seed)
        self.dtype = r.choice([torch.bfloat16, torch.float16]) if kind == "bf16" else torch.float32
        low = Rand(self.seed ^ 0xF16)  # an ONNX file in bf16 / fp16 a quarter of the time (the model's draws unchanged)
        if kind == "onnx" and low.random() < 0.25:
            self.dtype = low.choice([torch.bfloat16, torch.float16])
        self.body = r.choice(KINDS[kind])
        self.dynamic = r.random() < 0.4  # calls at other row counts (no op may depend on the row count)
        self.options = dict(gemm=r.choice(["auto", "vtc", "vtc"]), plan=r.choice(["greedy", "greedy", "all"]))
        self.threads = r.choice([1, 2])
        self.grad = r.random() < 0.15  # called with grad enabled (the parameters require grad)
        self.strided_inputs = r.random() < 0.2  # inputs in a transposed layout
        self.poison = r.random() < 0.35  # NaN in the input elements the model does not read (_poisoned)
        self.rows = _rows(r)
        self.other_rows = [m for m in {_rows(r), r.choice(ROWS_FEW)} if m != self.rows] if self.dynamic else []
        torch.manual_seed(r.randrange(1 << 30))
        self.model, self.in_shapes, self.row_dims, self.notes = getattr(self, "_make_" + self.body)(r)
        for layer in self.model.modules():  # a weight of magnitude ~1 / sqrt(K): outputs of magnitude ~1
            if isinstance(layer, torch.nn.Linear | torch.nn.Conv2d) and layer.bias is not None and r.random() < 0.3:
                layer.bias = None
        depth = r.choice([0, 1, 2, 2, 3])
        probe = self.model(*[torch.empty(s) for s in self.in_shapes])
        out = probe[0] if isinstance(probe, tuple) else probe
        if not self.dynamic and r.random() < 0.6:
            self.model.back, _ = draw_chain(r, list(out.shape), r.choice([1, 2]), max_numel=1 << 20)
        self.model.eval()
        self.depth = depth
        self.after = [a for a in ("again", "values", "weights", "replan", "threads", "torch_compile", "dynamic",
                                  "many_sizes") if a in ("again", "values") or r.random() < {
            "weights": 0.6, "replan": 0.15, "threads": 0.3, "torch_compile": 0.2, "dynamic": 0.15, "many_sizes": 0.1}[a]]
        self.weights_first = r.random() < 0.15  # a weight changed between vtc.compile and the first call
        if not self.dynamic:
            self.after = [a for a in self.after if a not in ("torch_compile", "dynamic", "many_sizes")]
        if not any(True for _ in self.model.parameters()):
            self.after = [a for a in self.after if a != "weights"]
        if kind == "onnx":  # the file's weights are constants; no grad, no torch.compile
            self.grad = False
            self.after = [a for a in self.after if a in ("again", "values", "replan", "threads")]
        self.model.to(self.dtype)
        text = self.describe()
        self.poison = self.poison and not any(w in text for w in ("relu", "where", "tied"))
        if self.body == "linear" and self.model.cfg.get("relu") or self.body == "tadd" and self.model.cfg.get("where"):
            self.poison = False

    # each _make_*: (model, input shapes at self.rows, each input's row dim, notes) with fronts drawn
    def _fronted(self, r: Rand, wants: list[list[int]], rows: list[int | None]):
        shapes, fronts, row_dims = [], [], []
        for want, row in zip(wants, rows):
            shape, ops, row_in = draw_chain_into(r, want, r.choice([0, 1, 2, 2, 3]), row, self.dynamic)
            shapes.append(shape)
            fronts.append(ops)
            row_dims.append(row_in)
        return shapes, fronts, row_dims

    def _lead(self, r: Rand) -> tuple[list[int], int]:
        """The leading dims of a Linear's input and which one is the row count."""
        if r.random() < 0.5:
            return [self.rows], 0
        return [r.choice([1, 2, 3]), self.rows], 1

    def _make_linear(self, r: Rand):
        k, n = _weight_dims(r)
        lead, row = self._lead(r)
        shapes, fronts, rows = self._fronted(r, [lead + [k]], [row])
        m = Drawn("linear", fronts, [], l1=torch.nn.Linear(k, n))
        m.cfg["relu"] = r.random() < 0.3
        return m, shapes, rows, f"Linear({k}, {n}) {4 * k * n >> 10} KB"

    def _make_mlp(self, r: Rand):
        k, n = _weight_dims(r)
        lead, row = self._lead(r)
        shapes, fronts, rows = self._fronted(r, [lead + [k]], [row])
        n2 = r.choice([k, 64, 33])
        return (Drawn("mlp", fronts, [], l1=torch.nn.Linear(k, n), l2=torch.nn.Linear(n, n2)), shapes, rows,
                f"Linear({k}, {n}) -> gelu -> Linear({n}, {n2})")

    def _make_wt(self, r: Rand):
        return self._weight_gemm(r, "wt")

    def _make_w(self, r: Rand):
        return self._weight_gemm(r, "w")

    def _weight_gemm(self, r: Rand, body: str):
        """x @ W^T ("wt", W [n, k]) or x @ W ("w", W [k, n]), W a parameter behind a drawn chain."""
        k, n = _weight_dims(r)
        lead, row = self._lead(r)
        shapes, fronts, rows = self._fronted(r, [lead + [k]], [row])
        w_shape = [n, k] if body == "wt" else [k, n]
        w, chain = self._weight(r, w_shape, self.kind == "weights")
        what = "x @ W^T" if body == "wt" else "x @ W"
        return Drawn(body, fronts, [], w=w, wchain=chain), shapes, rows, f"{what}, W {w_shape} = {_text('w', chain)}"

    @staticmethod
    def _weight(r: Rand, shape: list[int], always: bool = False,
                fan_in: int | None = None) -> tuple[torch.nn.Parameter, list[Op]]:
        """A parameter and (half the time, `always`: every time, 1-3 ops) a movement chain from it to a weight of
        `shape` (flip, slices, ...); magnitude ~1 / sqrt(fan_in) (default: the parameter's last dim)."""
        chain: list[Op] = []
        if always or r.random() < 0.5:
            depth = r.choice([1, 2, 2, 3]) if always else r.choice([1, 1, 2])
            want = shape
            shape, chain, _ = draw_chain_into(r, shape, depth, None, False, max_numel=1 << 22)
            fan_in = fan_in or (want[-1] if always else None)  # (the torch kind: its draws of session 20)
        return _param_of(r, shape, fan_in), chain

    def _make_tied(self, r: Rand):
        k, n = _weight_dims(r)
        lead, row = self._lead(r)
        shapes, fronts, rows = self._fronted(r, [lead + [k]], [row])
        if self.kind == "weights":
            w, chain = self._weight(r, [n, k], True)
            return (Drawn("tied", fronts, [], w=w, wchain=chain), shapes, rows,
                    f"relu(x @ W^T) @ W, W [{n}, {k}] = {_text('w', chain)} strides {w.stride()}")
        w = _param_of(r, [n, k])
        return Drawn("tied", fronts, [], w=w), shapes, rows, f"relu(x @ W^T) @ W, W [{n}, {k}] strides {w.stride()}"

    def _make_catw(self, r: Rand):
        k, n = _weight_dims(r)
        n0 = r.choice([1, 7, 64, n])
        lead, row = self._lead(r)
        shapes, fronts, rows = self._fronted(r, [lead + [k]], [row])
        w, chain = self._weight(r, [n, k], True)
        return (Drawn("catw", fronts, [], w0=_param_of(r, [n0, k]), w=w, wchain=chain), shapes, rows,
                f"x @ cat([W0 [{n0}, {k}], {_text('w', chain)} [{n}, {k}]])^T")

    def _make_convw(self, r: Rand):
        c, o = r.choice([3, 8, 16, 32]), r.choice([8, 16, 32, 48])
        ks, stride = r.choice([1, 3, 3, 5]), r.choice([1, 1, 2])
        groups = r.choice([1, 1, 2]) if c % 2 == 0 and o % 2 == 0 else 1
        if r.random() < 0.2 and c >= 8:
            groups, o = c, c  # depthwise
        hw = r.choice([5, 8, 14, 16, 17])
        shapes, fronts, rows = self._fronted(r, [[self.rows, c, hw, hw]], [0])
        w, chain = self._weight(r, [o, c // groups, ks, ks], True, fan_in=c // groups * ks * ks)
        m = Drawn("convw", fronts, [], w=w, wchain=chain, b=torch.nn.Parameter(torch.randn(o) * 0.1)
                  if r.random() < 0.7 else None)
        m.cfg.update(stride=stride, padding=ks // 2 if r.random() < 0.8 else 0, groups=groups)
        return (m, shapes, rows, f"conv2d(W = {_text('w', chain)} [{o}, {c // groups}, {ks}, {ks}], stride {stride}, "
                f"padding {m.cfg['padding']}, groups {groups}) on {hw}x{hw}")

    def _make_tadd(self, r: Rand):
        a, b = r.choice([17, 64, 512, 1024, 2048]), r.choice([33, 512, 1024])
        lead = [r.choice([1, 2])] if r.random() < 0.3 else []
        if self.dynamic:  # the rows: a's first dim (b's last)
            a = self.rows
        shapes, fronts, rows = self._fronted(r, [lead + [a, b], lead + [b, a]], [len(lead), len(lead) + 1])
        m = Drawn("tadd", fronts, [])
        m.cfg["where"] = r.random() < 0.3
        return m, shapes, rows, f"x0^T * 1.5 + x1, x0 {lead + [a, b]}"

    def _make_bmm(self, r: Rand):
        b = r.choice([1, 2, 3])
        k, n = r.choice([16, 33, 64, 257, 1024]), r.choice([1, 17, 32, 64, 200])
        shapes, fronts, rows = self._fronted(r, [[b, self.rows, k], [b, k, n]], [1, None])
        return Drawn("bmm", fronts, []), shapes, rows, f"bmm [{b}, M, {k}] @ [{b}, {k}, {n}]"

    def _make_conv(self, r: Rand):
        c = r.choice([3, 8, 16, 32])
        o = r.choice([8, 16, 32, 48])
        ks, stride = r.choice([1, 3, 3, 5]), r.choice([1, 1, 2])
        groups = r.choice([1, 1, 2]) if c % 2 == 0 and o % 2 == 0 else 1
        if r.random() < 0.2 and c >= 8:
            groups, o = c, c  # depthwise
        hw = r.choice([5, 8, 14, 16, 17])
        conv = torch.nn.Conv2d(c, o, ks, stride, padding=ks // 2 if r.random() < 0.8 else 0, groups=groups)
        if r.random() < 0.25:
            conv = conv.to(memory_format=torch.channels_last)  # a weight that is not contiguous
        shapes, fronts, rows = self._fronted(r, [[self.rows, c, hw, hw]], [0])  # the rows: the batch
        return (Drawn("conv", fronts, [], conv=conv), shapes, rows,
                f"Conv2d({c}, {o}, {ks}, stride {stride}, groups {groups}) on {hw}x{hw}")

    def _make_attn(self, r: Rand):
        h = r.choice([1, 2, 4])
        kvh = r.choice([g for g in (1, 2, h) if h % g == 0])
        d = r.choice([8, 16, 32, 64])
        e = h * d
        b = r.choice([1, 2])
        shapes, fronts, rows = self._fronted(r, [[b, self.rows, e]], [1])
        m = Drawn("attn", fronts, [], q=torch.nn.Linear(e, e), k=torch.nn.Linear(e, kvh * d),
                  v=torch.nn.Linear(e, kvh * d), o=torch.nn.Linear(e, e))
        m.cfg.update(heads=h, kv_heads=kvh, causal=r.random() < 0.5)
        return m, shapes, rows, f"attention {h} heads ({kvh} kv) of {d}, causal {m.cfg['causal']}"

    def _make_swin(self, r: Rand):
        self.dynamic, self.other_rows = False, []
        ws, c = r.choice([2, 4, 7]), r.choice([16, 32, 96])
        hw = ws * r.choice([1, 2])
        shapes, fronts, rows = self._fronted(r, [[r.choice([1, 2]), hw, hw, c]], [None])
        m = Drawn("swin", fronts, [], l1=torch.nn.Linear(c, c))
        m.cfg.update(window=ws, shift=r.choice([0, ws // 2]))
        return m, shapes, rows, f"swin window {ws} shift {m.cfg['shift']} on {hw}x{hw}x{c}"

    # -- inputs and the checks -------------------------------------------------------------------------------------
    def inputs(self, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for shape, row in zip(self.in_shapes, self.row_dims):
            shape = list(shape)
            if row is not None and rows != self.rows:  # (dynamic cases: no op changes the row dim's size)
                shape[row] = rows
            out.append(rand(shape, g, self.dtype, noncontiguous=self.strided_inputs))
        return self._poisoned(out) if self.poison else tuple(out)

    def _poisoned(self, xs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The inputs with NaN in every element the model does not read (its gradient exactly zero, in float64, for
        a model without relu / where): a kernel that reads past what it should, multiplying by a zero-padded panel,
        gives NaN where eager does not."""
        model = copy.deepcopy(self.model).double()
        leaves = [x.detach().double().requires_grad_() for x in xs]
        with torch.enable_grad():
            out = model(*leaves)
            outs = out if isinstance(out, tuple) else (out,)
            g = torch.Generator().manual_seed(self.seed)
            probe = sum((o * (torch.rand(o.shape, generator=g, dtype=torch.float64) + 0.5)).sum() for o in outs)
            grads = torch.autograd.grad(probe, leaves, allow_unused=True)
        return tuple(x if gr is None else x.masked_fill(gr == 0, float("nan")) for x, gr in zip(xs, grads))

    def describe(self) -> str:
        fronts = ["x%d" % j + "".join(f".{d}" for d, _ in f) for j, f in enumerate(self.model.fronts)]
        back = "".join(f".{d}" for d, _ in self.model.back)
        dtype = "" if self.dtype == torch.float32 else f"{self.dtype}; "
        return (f"{self.kind} {dtype}{self.body}: {self.notes}; rows {self.rows} (others {self.other_rows}); inputs "
                f"{[list(s) for s in self.in_shapes]}{' transposed' if self.strided_inputs else ''}; fronts {fronts}; "
                f"back y{back}; options {self.options}; threads {self.threads}; grad {self.grad}; "
                f"poison {getattr(self, 'poison', False)}; weights first {getattr(self, 'weights_first', False)}; "
                f"after {getattr(self, 'after', [])}")


def _close(got, want, what: str, other: str = "eager's", dtype: torch.dtype | None = None) -> None:
    """Each output equal to eager's (`other`'s) within rtol 1e-3 and atol 1e-4 of the output's largest magnitude
    (float32 sums of up to ~2048 products of magnitude ~1: a few 1e-6 apart; a wrong answer is off by ~1).  bf16 /
    fp16 outputs, compared with eager's in the same dtype: rtol and atol (of the largest magnitude) 2e-2 / 1e-2
    (LOW_TOL: both round each op to the dtype, GEMMs and reductions accumulating in float32 in another order,
    so an element may be an ulp (2^-8 / 2^-11) apart and a later op carry that on); `dtype`: the tolerances of
    this dtype whatever the outputs' (a bf16 / fp16 ONNX file whose exporter made its outputs float32)."""
    got, want = [list(v) if isinstance(v, (tuple, list)) else [v] for v in (got, want)]
    assert len(got) == len(want), f"{what}: {len(got)} outputs, {other} {len(want)}"
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype}, {other} {b.shape} {b.dtype}"
        rtol, scale = LOW_TOL.get(dtype or b.dtype, 1e-3), LOW_TOL.get(dtype or b.dtype, 1e-4)
        atol = scale * max(1.0, float(b.abs().max()) if b.numel() else 1.0)
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}\n{m}")


def run_case(case: Case) -> list[str]:
    """The case's calls, each against eager; returns the steps done (raises at the first wrong one)."""
    done = []
    m, rows = case.model, case.rows
    x = case.inputs(rows, 1)
    with torch.set_grad_enabled(case.grad), torch_threads(case.threads), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = vtc.compile(m, x, **case.options)
        if case.weights_first and "weights" in case.after:
            with torch.no_grad():
                _weight_changes(case)[0]()
        _close(compiled(*x), m(*x), "first call")
        done.append("first")
        for step in case.after:
            if step == "again":  # the outputs own their memory: changing them changes no input and no later call
                outs = compiled(*x)
                outs = outs if isinstance(outs, tuple) else (outs,)
                ptrs = {t.untyped_storage().data_ptr() for t in x}
                assert not any(o.untyped_storage().data_ptr() in ptrs for o in outs), "an output shares an input's memory"
                before = [t.clone() for t in x]
                for o in outs:
                    o.detach().mul_(-3.0).add_(1.0)
                for a, b in zip(x, before):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg="changing an output changed an input")
                _close(compiled(*x), m(*x), "the same call again, the last outputs changed")
            elif step == "values":
                x2 = case.inputs(rows, 2)
                _close(compiled(*x2), m(*x2), "new values")
            elif step == "weights":
                for j, change in enumerate(_weight_changes(case)):
                    with torch.no_grad():
                        change()
                    _close(compiled(*x), m(*x), f"after weight change {j}")
                    for other in case.other_rows[:1]:
                        xo = case.inputs(other, 3)
                        _close(compiled(*xo), m(*xo), f"after weight change {j}, {other} rows")
            elif step == "replan":
                other = dict(plan="all" if case.options["plan"] == "greedy" else "greedy")
                again = compiled.replan(**other)
                _close(again(*x), m(*x), f"replan {other}")
                if "weights" in case.after:
                    with torch.no_grad():
                        _weight_changes(case)[1]()
                    _close(again(*x), m(*x), f"replan {other} after a weight change")
                    _close(compiled(*x), m(*x), "the first plan after the replan's weight change")
            elif step == "many_sizes":  # more sizes than max_specializations keeps, a weight change half way
                sizes = sorted({*range(1, 18, 2), *case.other_rows, 24, 49})
                for j, n in enumerate(sizes):
                    if j == len(sizes) // 2 and "weights" in case.after:
                        with torch.no_grad():
                            _weight_changes(case)[0]()
                    xn = case.inputs(n, 7 + n)
                    _close(compiled(*xn), m(*xn), f"many sizes: {n} rows")
                _close(compiled(*x), m(*x), f"many sizes: {rows} rows again")
            elif step == "threads":
                _threads(case, lambda xs, what: _close(compiled(*xs), m(*xs), what))
            elif step == "torch_compile":
                torch._dynamo.reset()  # Drawn.forward is one code object for every case: dynamo's recompile limit
                fn = torch.compile(m, backend="vtc", dynamic=True)
                for n in [rows, *case.other_rows]:
                    xn = case.inputs(n, 4 + n)
                    _close(fn(*xn), m(*xn), f"torch.compile dynamic, {n} rows")
            elif step == "dynamic":
                dyn = vtc.compile(m, x, dynamic=True, **case.options)
                for n in [rows, *case.other_rows]:
                    xn = case.inputs(n, 5 + n)
                    _close(dyn(*xn), m(*xn), f"vtc.compile(dynamic=True), {n} rows")
            done.append(step)
        for n in case.other_rows:  # new sizes on the first compiled model (vtc's dynamic path), then the first again
            xn = case.inputs(n, 6 + n)
            _close(compiled(*xn), m(*xn), f"{n} rows")
            _close(compiled(*x), m(*x), f"{rows} rows again after {n}")
            done.append(f"rows {n}")
        case.paths = [q["path"] or q["choice"] for q in compiled.report.to_dict()["gemm"]]
    return done


class ExportSkipped(Exception):
    """The drawn model has no ONNX file that onnxruntime runs as eager does: not a finding of vtc's."""


def export_onnx(case: Case, x: tuple[torch.Tensor, ...], model: torch.nn.Module | None = None):
    """The case's model (or `model`) as an ONNX ModelProto, inputs x0, x1, ... (their row dims dynamic in dynamic cases): the
    dynamo exporter (the default, seconds) or the TorchScript one (opset 17, well under a second; half the time
    without constant folding, so a weight's chain stays ops on an initializer), drawn, the other if it fails."""
    import onnx

    model = model or case.model
    r = Rand(case.seed ^ 0x5EED)  # (draws of their own: the model's draws stay those of the torch kinds)
    fold, dynamo_first = r.random() < 0.5, r.random() < 0.5
    names = [f"x{j}" for j in range(len(x))]
    dynamic = [(n, row) for n, row in zip(names, case.row_dims) if row is not None] if case.dynamic else []

    def torchscript():
        f = io.BytesIO()
        torch.onnx.export(model, x, f, dynamo=False, input_names=names, opset_version=17,
                          dynamic_axes={n: {row: "rows"} for n, row in dynamic}, do_constant_folding=fold)
        return onnx.load_from_string(f.getvalue()), f"torchscript{'' if fold else ', not folded'}"

    def dynamo():
        rows = torch.export.Dim.DYNAMIC
        shapes = tuple({row: rows} if row is not None and case.dynamic else None for row in case.row_dims)
        return torch.onnx.export(model, x, dynamo=True, verbose=False, input_names=names,
                                 dynamic_shapes=shapes if dynamic else None).model_proto, "dynamo"

    errors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        for export in (dynamo, torchscript) if dynamo_first else (torchscript, dynamo):
            try:
                return export()
            except Exception as e:  # noqa: BLE001 - the other exporter then
                errors.append(f"{export.__name__}: {type(e).__name__}: {str(e)[:150]}")
    raise ExportSkipped("; ".join(errors))


def run_onnx_case(case: Case) -> list[str]:
    """The case's model exported to ONNX, compiled by vtc (default backend), each call compared with onnxruntime
    and with eager (both within _close's float32 tolerances).  Where onnxruntime and eager disagree the file is
    not the model (an exporter's doing): vtc is held to onnxruntime only and the case says so."""
    import onnxruntime as ort

    done = []
    m, rows = case.model, case.rows
    x = case.inputs(rows, 1)
    with torch.no_grad(), torch_threads(case.threads), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto, case.exporter = export_onnx(case, x)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.log_severity_level = 3  # its shape warnings on a dynamic case's other row counts
        inits = {t.name for t in proto.graph.initializer}
        names = [i.name for i in proto.graph.input if i.name not in inits]
        case.eager_differs, case.no_ort = False, ""
        try:  # numpy has no bf16; onnxruntime's CPU kernels lack some fp16 ops
            assert case.dtype != torch.bfloat16, "bf16 (numpy has no bf16)"
            sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - vtc then held to eager alone
            sess, case.no_ort = None, f"{type(e).__name__}: {str(e)[:80]}"

        def float32_file_differs() -> bool:
            """Whether onnxruntime on the float32 model's file (same exporter) disagrees with float32 eager: the
            exporter's doing (TorchScript's roll by more than the dim's size is the identity), not vtc's."""
            m32, x32 = copy.deepcopy(m).float(), tuple(t.float() for t in x)
            p32, _ = export_onnx(case, x32, m32)
            s32 = ort.InferenceSession(p32.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            ref = [torch.from_numpy(a) for a in s32.run(None, {n: t.contiguous().numpy() for n, t in zip(names, x32)})]
            try:
                _close(ref, m32(*x32), "onnxruntime on the float32 file vs float32 eager")
            except AssertionError:
                return True
            return False

        file_differs = sess is None and float32_file_differs()  # (not from the threads below: one export at a time)

        numpy_in = Rand(case.seed ^ 0x4E50).random() < 0.5  # the calls with numpy arrays (else torch tensors)

        def check(fn, xs, what):
            """vtc's outputs against eager's and onnxruntime's.  Where the two disagree (the exporter changed
            the model, or onnxruntime's bf16 / fp16 arithmetic differs), a float32 file is held to onnxruntime's
            result, a bf16 / fp16 one to either's."""
            want = m(*xs)
            if numpy_in and xs[0].dtype != torch.bfloat16:  # numpy in, numpy out (as onnxruntime's run)
                got = [torch.from_numpy(a) for a in fn([t.numpy() for t in xs])]
            else:
                got = fn(list(xs))
            if sess is None:
                try:
                    return _close(got, want, what + " (vs eager, no onnxruntime)", dtype=case.dtype)
                except AssertionError:
                    if not file_differs:
                        raise
                    case.eager_differs = True  # (vtc then unchecked: no reference runs the bf16 file)
                    return
            ref = [torch.from_numpy(a) for a in sess.run(None, {n: t.contiguous().numpy() for n, t in zip(names, xs)})]
            try:
                _close(ref, want, what + ": onnxruntime vs eager", dtype=case.dtype)
            except AssertionError:
                case.eager_differs = True
                if case.dtype != torch.float32:
                    try:
                        return _close(got, want, what + " (vs eager)", dtype=case.dtype)
                    except AssertionError:
                        pass
                return _close(got, ref, what + " (vs onnxruntime)", "onnxruntime's", case.dtype)
            _close(got, ref, what + " (vs onnxruntime)", "onnxruntime's", case.dtype)
            _close(got, want, what + " (vs eager)", dtype=case.dtype)

        assert len(names) == len(x), f"the file takes {names}, the model {len(x)} inputs"
        compiled = vtc.compile(proto, list(x), **case.options)
        check(compiled, x, "first call")
        done.append("first")
        for step in case.after:
            if step == "again":
                outs = compiled(list(x))
                for o in outs:
                    o.mul_(-3.0).add_(1.0)
                check(compiled, x, "the same call again, the last outputs changed")
            elif step == "values":
                check(compiled, case.inputs(rows, 2), "new values")
            elif step == "replan":
                other = dict(plan="all" if case.options["plan"] == "greedy" else "greedy")
                check(compiled.replan(**other), x, f"replan {other}")
            elif step == "threads":
                _threads(case, lambda xs, what: check(compiled, xs, what))
            done.append(step)
        for n in case.other_rows:
            check(compiled, case.inputs(n, 6 + n), f"{n} rows")
            check(compiled, x, f"{rows} rows again after {n}")
            done.append(f"rows {n}")
        case.paths = [q["path"] or q["choice"] for q in compiled.report.to_dict()["gemm"]]
    return done


def _weight_changes(case: Case) -> list[Callable[[], None]]:
    params = [p for p in case.model.parameters() if p.dim() >= 2] or list(case.model.parameters())
    p = case.r.choice(params)
    g = torch.Generator().manual_seed(case.seed)
    return [lambda: p.mul_(-2.0), lambda: p[: max(1, p.shape[0] // 3)].add_(0.5),
            lambda: p.copy_((torch.rand(p.shape, generator=g) - 0.5) / p[0].numel() ** 0.5)]


def _threads(case: Case, check: Callable[[tuple, str], None]) -> None:
    """Three Python threads at once, two calls each (check(inputs, what) calls and compares)."""
    errors: list[str] = []
    sizes = [case.rows, *case.other_rows, case.rows]
    barrier = threading.Barrier(3)

    def work(k: int) -> None:
        try:
            barrier.wait()
            for j in range(2):
                n = sizes[(k + j) % len(sizes)]
                xk = case.inputs(n, 100 + 10 * k + j)
                check(xk, f"thread {k} call {j} ({n} rows)")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, "\n".join(errors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--start", type=int, default=0, help="the first case number")
    ap.add_argument("--case", type=int, help="run this case only")
    ap.add_argument("--kind", choices=list(KINDS), default="torch",
                    help="torch: float32 torch models; bf16: bf16 / fp16 ones; onnx: exported, also vs onnxruntime; "
                         "weights: a movement chain on every GEMM / conv weight")
    ap.add_argument("--log", default="/tmp/vtc-fuzz.jsonl")
    ap.add_argument("-v", action="store_true", help="print each case's model")
    args = ap.parse_args()
    numbers = [args.case] if args.case is not None else range(args.start, args.start + args.cases)
    failed = skipped = 0
    faulthandler.enable()  # a crash (onnxruntime's session for seed 27 case 146's fp16 file) names its place
    for i in numbers:
        faulthandler.dump_traceback_later(900)  # a case that hangs shows where (each case restarts the clock)
        t0 = time.time()
        try:
            case = Case(args.seed, i, args.kind)
        except Exception as e:  # noqa: BLE001 - a drawing error of this script, not a finding
            print(f"{args.seed}:{i} DRAW-ERROR {type(e).__name__}: {e}", flush=True)
            continue
        if args.v:
            print(case.describe(), flush=True)
        record = dict(seed=args.seed, case=i, kind=args.kind, body=case.body, model=case.describe())
        try:
            record["done"] = (run_onnx_case if args.kind == "onnx" else run_case)(case)
            record["paths"] = case.paths
            status = "ok"
            if args.kind == "onnx":
                record["exporter"] = case.exporter
                notes = [case.exporter] + [f"no onnxruntime: {case.no_ort}"] * bool(case.no_ort) + [
                    "the file differs from eager"] * case.eager_differs
                status += f" ({'; '.join(notes)})"
        except ExportSkipped as e:
            skipped += 1
            status = f"EXPORT-SKIPPED {str(e)[:200]}"
        except Exception as e:  # noqa: BLE001 - every exception is a finding to look at
            failed += 1
            status = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            record["error"] = traceback.format_exc()
        record["status"], record["s"] = status, round(time.time() - t0, 1)
        with open(args.log, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"{args.seed}:{i} {case.body:6s} {record['s']:6.1f}s {status}"
              f"{'' if status.startswith('ok') else '  ' + case.describe()}", flush=True)
    print(f"{len(numbers)} cases, {failed} failed, {skipped} not exported")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
