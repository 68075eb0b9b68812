"""float16 / bfloat16 accuracy of vtc against eager, both measured against a float64 reference.

    PYTHONPATH=$PWD python bench/low_precision.py attention      # SDPA cases, torch's math-SDPA switch off and on
    PYTHONPATH=$PWD python bench/low_precision.py ops            # reductions, norms, softmax, pointwise composites
    PYTHONPATH=$PWD python bench/low_precision.py mixtral 16     # tiny Mixtral (tests/e2e/hf_models.py), 16 seeds

Each line: max / mean absolute error against the reference of eager, ``vtc.compile`` and
``torch.compile(backend="vtc")`` (docs/robustness.md, "Low-precision attention")."""
from __future__ import annotations

import copy
import statistics
import sys
import warnings

import torch
import torch.nn.functional as F

import vtc

DTYPES = (torch.bfloat16, torch.float16)


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _err(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (y.double() - ref.double()).abs()
    return d.max().item(), d.mean().item()


def _row(label: str, model, args, ref) -> str:
    eager = model(*args)
    got = vtc.compile(model, tuple(args))(*args)
    torch._dynamo.reset()
    tc = torch.compile(model, backend="vtc")(*args)
    cells = " | ".join(f"{k} {a:.2e}/{b:.2e}" for k, (a, b) in
                       (("eager", _err(eager, ref)), ("vtc", _err(got, ref)), ("tc", _err(tc, ref))))
    return f"{label:44} {cells} | vtc-eager max {(got.double() - eager.double()).abs().max().item():.1e}"


def attention() -> None:
    cases = {"causal": (True, False, False, 33, 33), "mask": (False, True, False, 33, 33),
             "gqa": (True, False, True, 33, 33), "decode": (False, False, False, 1, 200)}
    old = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        for switch in (False, True):
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(switch)
            for dt in DTYPES:
                for name, (causal, mask, gqa, queries, keys) in cases.items():
                    torch.manual_seed(0)
                    kv = 2 if gqa else 8
                    args = [(torch.randn(2, 8, queries, 64) * 2).to(dt), (torch.randn(2, kv, keys, 64) * 2).to(dt),
                            torch.randn(2, kv, keys, 64).to(dt)]
                    if mask:
                        args.append(torch.randn(2, 1, queries, keys).to(dt))
                    model = _Fn(lambda q, k, v, m=None, c=causal, g=gqa:
                                F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c, enable_gqa=g))
                    ref = model(*[a.double() for a in args])
                    print(_row(f"switch={int(switch)} {str(dt)[6:]} {name}", model, args, ref), flush=True)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(old)


def ops() -> None:
    n = 4096
    cases = {
        "sum": lambda x: x.sum(-1), "mean": lambda x: x.mean(-1), "var": lambda x: x.var(-1),
        "var_mean": lambda x: torch.var_mean(x, -1)[0],
        "std_mean": lambda x: torch.std_mean(x.view(2, 64, 64), (1, 2))[0],
        "vector_norm": lambda x: torch.linalg.vector_norm(x, dim=-1), "logsumexp": lambda x: torch.logsumexp(x, -1),
        "cumsum": lambda x: x.cumsum(-1), "softmax": lambda x: F.softmax(x, -1),
        "log_softmax": lambda x: F.log_softmax(x, -1), "layer_norm": lambda x: F.layer_norm(x, (n,)),
        "rms_norm": lambda x: F.rms_norm(x, (n,), torch.ones(n, dtype=x.dtype), 1e-6),
        "group_norm": lambda x: F.group_norm(x.view(2, 16, n // 16), 4),
        "instance_norm": lambda x: F.instance_norm(x.view(2, 16, n // 16)),
        "normalize": lambda x: F.normalize(x, dim=-1),
        "cross_entropy": lambda x: F.cross_entropy(x.view(64, 128), torch.arange(64) % 128),
        "addmm": lambda x: torch.addmm(x[:, :64], x[:, 64:128], x[0].reshape(64, 64) * 0.1),
        "gelu_tanh": lambda x: F.gelu(x * 3, approximate="tanh"), "silu": lambda x: F.silu(x * 3),
        "mish": lambda x: F.mish(x * 3), "softplus": lambda x: F.softplus(x * 3),
        "lerp": lambda x: torch.lerp(x, x.flip(-1), 0.3), "logit": lambda x: torch.logit(torch.sigmoid(x)),
        "interp_bicubic": lambda x: F.interpolate(x.view(2, 4, 32, 32), scale_factor=2, mode="bicubic"),
        "adaptive_avg_pool": lambda x: F.adaptive_avg_pool2d(x.view(2, 4, 32, 32), 5),
    }
    for dt in DTYPES:
        for name, fn in cases.items():
            torch.manual_seed(0)
            x = (torch.randn(2, n) + 0.5).to(dt)
            model = _Fn(fn)
            print(_row(f"{str(dt)[6:]} {name}", model, [x], model(x.double())), flush=True)


def mixtral(seeds: int) -> None:
    sys.path.insert(0, "tests/e2e")
    from hf_models import MODELS

    for dt in DTYPES:
        rows = []
        for seed in range(seeds):
            torch.manual_seed(seed)
            model, inputs = MODELS["mixtral"](3, 33)
            model = model.to(dt)
            with torch.no_grad():  # float32 reference: torch's grouped_mm has no float64
                ref = copy.deepcopy(model).float()(*inputs).logits
                eager = model(*inputs).logits
            got = vtc.compile(model, inputs)(*inputs).logits
            rows.append((_err(eager, ref), _err(got, ref)))
            print(f"{str(dt)[6:]} seed {seed}: eager {rows[-1][0][0]:.2e}/{rows[-1][0][1]:.2e} "
                  f"vtc {rows[-1][1][0]:.2e}/{rows[-1][1][1]:.2e}", flush=True)
        for i, who in enumerate(("eager", "vtc")):
            tops = [r[i][0] for r in rows]
            print(f"{str(dt)[6:]} {who}: max err worst {max(tops):.2e} median {statistics.median(tops):.2e}, "
                  f"{sum(t > 1e-2 for t in tops)}/{seeds} seeds above 1e-2, mean err "
                  f"{statistics.mean(r[i][1] for r in rows):.2e}", flush=True)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    torch._dynamo.config.cache_size_limit = 256
    what = sys.argv[1] if len(sys.argv) > 1 else "attention"
    {"attention": attention, "ops": ops}.get(what, lambda: mixtral(int(sys.argv[2]) if len(sys.argv) > 2 else 8))()
