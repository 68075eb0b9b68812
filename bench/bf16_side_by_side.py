"""bfloat16 / float16 models and chains: eager, vtc (and Inductor) side by side, 1 thread, CPU time.

    PYTHONPATH=$PWD python bench/bf16_side_by_side.py llama [bf16|fp16]   # transformers Llama, 2 layers
    PYTHONPATH=$PWD python bench/bf16_side_by_side.py chain [bf16|fp16]   # relu(x.transpose(1, 2) + y) * 2
    PYTHONPATH=$PWD python bench/bf16_side_by_side.py norm [bf16|fp16]    # softmax / layer_norm / RMSNorm rows
    PYTHONPATH=$PWD python bench/bf16_side_by_side.py decode [bf16|fp16]  # Llama decode step, StaticCache
    PYTHONPATH=$PWD python bench/bf16_side_by_side.py linear [bf16]       # nn.Linear (+ GELU / SiLU + Linear)
    PYTHONPATH=$PWD python bench/bf16_side_by_side.py depthwise [bf16|fp16]  # depthwise convs, ShuffleNet shapes

Each line: min and median of the per-call CPU time (``time.thread_time``) over rounds of calls, the mean
distance of vtc's and eager's results to the float64 model (where inputs are all floating), and what vtc ran
through torch (the reasons of ``lowering.why_torch``, counted).  To compare two trees run it once per tree with
its ``PYTHONPATH`` (docs/low_precision.md)."""
from __future__ import annotations

import collections
import statistics
import sys
import time
import warnings

import torch

import vtc

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _time(fn, args, rounds: int = 15, calls: int = 5) -> tuple[float, float]:
    with torch.no_grad():
        for _ in range(3):
            fn(*args)
        per = []
        for _ in range(rounds):
            t = time.thread_time()
            for _ in range(calls):
                fn(*args)
            per.append((time.thread_time() - t) / calls * 1e3)
    return min(per), statistics.median(per)


def _torch_ops(c) -> str:
    why = c._first.executor.lowering.why_torch
    runs = [s.node.op for s in c._first.executor.steps if s.kind == "run"]
    kinds = collections.Counter(w.split(" of %")[0] if "has no generated code" in w else w[:40] for w in why.values())
    kernels = sum(1 for s in c._first.executor.steps if s.kind == "kernel")
    return f"{kernels} kernels, {len(runs)} torch ops; why: {dict(kinds)}"


def _side_by_side(label: str, model, args, inductor: bool = False, **options) -> None:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = model(*args)
        c = vtc.compile(model, args, **options)
        got = c(*args)
    e = (lambda t: t.logits if hasattr(t, "logits") else t)
    err = (e(got).float() - e(eager).float()).abs().max().item()
    exact = _float64(model, args)
    if exact is not None:  # mean distance to the float64 result: vtc's / eager's
        dist = [(e(t).double() - exact).abs().mean().item() for t in (got, eager)]
        label += f" [|-f64| vtc {dist[0]:.2e} eager {dist[1]:.2e}]"
    rows = {"eager": _time(model, args), "vtc": _time(c, args)}
    if inductor:
        torch._dynamo.reset()
        ind = torch.compile(model)
        with torch.no_grad():
            ind(*args)
        rows["inductor"] = _time(ind, args)
    cells = "  ".join(f"{k} {a:.3f}/{b:.3f}" for k, (a, b) in rows.items())
    print(f"{label}: ms min/median  {cells}  | vtc-eager max {err:.2e} | {_torch_ops(c)}", flush=True)


def llama(dt: torch.dtype) -> None:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, use_cache=False)
    model = tf.LlamaForCausalLM(cfg).eval().to(dt)
    ids = torch.randint(1, 1000, (1, 128))
    _side_by_side(f"llama {dt} 1x128", model, (ids,))


def decode(dt: torch.dtype) -> None:
    """One-token steps of a 2-layer Llama (hidden 256, GQA 8/2) with a StaticCache of 256 after a 16-token
    prompt, eager and vtc alternately (each its own cache, the same position every step)."""
    import copy

    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    model = tf.LlamaForCausalLM(cfg).eval().to(dt)
    base = tf.StaticCache(config=cfg, max_cache_len=256)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = model(torch.randint(1, 1000, (1, 16)), cache=base, cache_position=torch.arange(16))
        tok, pos = first.logits[:, -1:].argmax(-1), torch.tensor([16])
        c = vtc.compile(model, (tok,), {"cache": copy.deepcopy(base), "cache_position": pos})
        caches = {"eager": copy.deepcopy(base), "vtc": copy.deepcopy(base)}
        fns = {"eager": model, "vtc": c}
        err = (model(tok, cache=caches["eager"], cache_position=pos).logits.float()
               - c(tok, cache=caches["vtc"], cache_position=pos).logits.float()).abs().max().item()
        per = {k: [] for k in fns}
        for r in range(30):
            for k, fn in fns.items():
                t = time.thread_time()
                fn(tok, cache=caches[k], cache_position=pos)
                if r >= 5:
                    per[k].append((time.thread_time() - t) * 1e3)
    cells = "  ".join(f"{k} {min(v):.3f}/{statistics.median(v):.3f}" for k, v in per.items())
    print(f"decode {dt}: ms min/median  {cells}  | vtc-eager max {err:.2e} | {_torch_ops(c)}", flush=True)


def _float64(model, args):
    """model's result in float64 (a copy of it, on float64 copies of the floating inputs), or None."""
    import copy

    if any(isinstance(a, torch.Tensor) and not a.dtype.is_floating_point for a in args):
        return None
    with torch.no_grad():
        return copy.deepcopy(model).double()(*(a.double() for a in args))


class _Mlp(torch.nn.Module):
    """Linear + activation (+ Linear): an MLP block on rows of tokens."""

    def __init__(self, d: int, hidden: int, act: str, dt: torch.dtype, second: bool = True, bias: bool = True):
        super().__init__()
        self.up = torch.nn.Linear(d, hidden, bias=bias).to(dt)
        self.down = torch.nn.Linear(hidden, d).to(dt) if second else None
        self.act = {"gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu, "none": lambda t: t}[act]

    def forward(self, x):
        h = self.act(self.up(x))
        return self.down(h) if self.down is not None else h


def linear(dt: torch.dtype) -> None:
    """nn.Linear with bias alone and Linear + GELU + Linear, rows of tokens (2-D: x is [tokens, d]); vtc under
    gemm="auto" and forced (gemm="vtc")."""
    torch.manual_seed(0)
    for tokens, d, hidden, act, second, bias in [(128, 512, 2048, "none", False, True),
                                                 (128, 512, 2048, "gelu", False, True),
                                                 (128, 512, 2048, "gelu", False, False),
                                                 (128, 512, 2048, "gelu", True, True),
                                                 (8, 512, 2048, "silu", True, True)]:
        x = torch.randn(tokens, d).to(dt)
        model = _Mlp(d, hidden, act, dt, second, bias)
        what = (f"linear{'' if bias else '(no bias)'}{'+' + act if act != 'none' else ''}{'+linear' if second else ''} "
                f"{dt} {tokens}x{d}->{hidden}")
        _side_by_side(what + " gemm=vtc", model, (x,), inductor=True, gemm="vtc")
        _side_by_side(what + " gemm=auto", model, (x,))


class _Depthwise(torch.nn.Module):
    def __init__(self, c: int, k: int, stride: int, dt: torch.dtype):
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, k, stride, k // 2, groups=c, bias=True).to(dt)

    def forward(self, x):
        return self.conv(x)


def depthwise(dt: torch.dtype) -> None:
    """Depthwise convolutions of ShuffleNetV2 / MobileNetV2 shapes (batch 1): 3x3 stride 1 and 2, 5x5."""
    torch.manual_seed(0)
    for c, hw, k, stride in [(24, 56, 3, 2), (58, 28, 3, 1), (116, 28, 3, 2), (232, 7, 3, 1), (464, 7, 3, 1),
                             (144, 56, 3, 1), (240, 28, 5, 1), (96, 14, 5, 2)]:
        x = torch.randn(1, c, hw, hw).to(dt)
        _side_by_side(f"depthwise {dt} {c}x{hw}x{hw} {k}x{k}/{stride}", _Depthwise(c, k, stride, dt), (x,),
                      inductor=True)


class _Chain(torch.nn.Module):
    def forward(self, x, y):
        return torch.relu(x.transpose(1, 2) + y) * 2


class _Norms(torch.nn.Module):
    def __init__(self, n: int, dt: torch.dtype):
        super().__init__()
        self.ln = torch.nn.LayerNorm(n).to(dt)
        self.w = torch.nn.Parameter(torch.randn(n).to(dt))

    def forward(self, x):
        h = self.ln(x)
        v = h.float()
        r = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.w
        return torch.softmax(r, -1)


def chain(dt: torch.dtype) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(16, 256, 512).to(dt), torch.randn(16, 512, 256).to(dt)
    _side_by_side(f"chain {dt} 16x512x256", _Chain(), (x, y), inductor=True)


def norm(dt: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 512).to(dt)
    _side_by_side(f"norms {dt} 2048x512", _Norms(512, dt), (x,), inductor=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    which, dt = sys.argv[1], DT[sys.argv[2] if len(sys.argv) > 2 else "bf16"]
    {"llama": llama, "chain": chain, "norm": norm, "decode": decode, "linear": linear,
     "depthwise": depthwise}[which](dt)
