"""Single convolutions of the unit workloads timed side by side: eager, ONNX Runtime and vtc, per call.

    PYTHONPATH=$PWD python -m bench.conv_side_by_side [evit_expand,shuffle_dw_s2,...]

Each case is one convolution with what follows it in its unit (batch norm,
activation), at the unit's shape (EfficientViT-B1 stage 3 at 28x28,
ShuffleNetV2 x1.0 at 28/14/7).  Calls are interleaved system by system, N
(env, default 40) rounds after warm-up calls (bench.gemm_side_by_side.time_side_by_side: a round
repeats a fast call to at least 20 ms); the median is printed with
the ratio of the best other system to vtc.  T (env, default 1) threads; CPU=1
times each call by the calling thread's CPU time (use with T=1 on a loaded
machine, like bench/units_side_by_side.py); PANELS=1 adds vtc with the dot and broadcast forms of small maps
off (vtc.codegen.conv_t, conv_bcast), the packed-panel implicit GEMM; BCAST=0 turns the broadcast form
(vtc.codegen.conv_bcast) off for "vtc"; GOTO=1 adds vtc with vtc.codegen.gemm's loops for
the implicit GEMM instead of vtc.codegen.conv_panels'.  A profile aid, not the benchmark.
"""
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

T = int(os.environ.get("T", 1))
torch.set_num_threads(T)
clk = time.thread_time if os.environ.get("CPU") else time.perf_counter

import vtc  # noqa: E402
from bench.gemm_side_by_side import time_side_by_side  # noqa: E402
from bench.systems import Context, _eager, _onnxruntime  # noqa: E402


def _conv(cin, cout, k=1, stride=1, groups=1, bn=True, act=None, bias=False):
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=bias)]
    if bn:
        layers.append(nn.BatchNorm2d(cout))
    if act is not None:
        layers.append(act())
    m = nn.Sequential(*layers).eval()
    for b in m.modules():
        if isinstance(b, nn.BatchNorm2d):
            b.running_mean.normal_(0, 0.1)
            b.running_var.uniform_(0.5, 1.5)
    return m


CASES = {  # name: (module, input shape)
    "evit_qkv": (lambda: _conv(128, 384, bn=False, bias=True), (1, 128, 28, 28)),
    "evit_expand": (lambda: _conv(128, 512, act=nn.Hardswish), (1, 128, 28, 28)),
    "evit_point": (lambda: _conv(512, 128), (1, 512, 28, 28)),
    "evit_dw5": (lambda: _conv(384, 384, 5, groups=384, bn=False), (1, 384, 28, 28)),
    "evit_dw3": (lambda: _conv(512, 512, 3, groups=512, act=nn.Hardswish), (1, 512, 28, 28)),
    "evit_group": (lambda: _conv(384, 384, groups=24, bn=False), (1, 384, 28, 28)),
    "shuffle_pw28": (lambda: _conv(58, 58, act=nn.ReLU), (1, 58, 28, 28)),
    "shuffle_pw14": (lambda: _conv(116, 116, act=nn.ReLU), (1, 116, 14, 14)),
    "shuffle_pw7": (lambda: _conv(232, 232, act=nn.ReLU), (1, 232, 7, 7)),
    "shuffle_dw28": (lambda: _conv(58, 58, 3, groups=58), (1, 58, 28, 28)),
    "shuffle_dw_s2": (lambda: _conv(116, 116, 3, 2, groups=116), (1, 116, 28, 28)),
    "shuffle_last": (lambda: _conv(464, 1024, act=nn.ReLU), (1, 464, 7, 7)),
    "wide_14": (lambda: _conv(464, 1024, act=nn.ReLU), (1, 464, 14, 14)),
    "wide_7_b16": (lambda: _conv(512, 512, act=nn.ReLU), (16, 512, 7, 7)),
    "wide_3x3_7": (lambda: _conv(256, 256, 3, act=nn.ReLU), (1, 256, 7, 7)),
    "wide_3x3_14": (lambda: _conv(256, 256, 3, act=nn.ReLU), (1, 256, 14, 14)),
    "shuffle_stem": (lambda: _conv(3, 24, 3, 2, act=nn.ReLU), (1, 3, 224, 224)),
    "shuffle_last_b16": (lambda: _conv(464, 1024, act=nn.ReLU), (16, 464, 7, 7)),
    "shuffle_s4_pw14": (lambda: _conv(232, 232, act=nn.ReLU), (1, 232, 14, 14)),  # stage 4's first unit
    "shuffle_dw7_s2": (lambda: _conv(232, 232, 3, 2, groups=232), (1, 232, 14, 14)),
    "shuffle_dw7": (lambda: _conv(232, 232, 3, groups=232), (1, 232, 7, 7)),
    # YOLOv11 C3k2(128, 128, n=1, c3k=True) at 40x40 (bench/workloads/c3k2.py): its convs, each + BN + SiLU
    "c3k2_cv2": (lambda: _conv(192, 128, act=nn.SiLU), (1, 192, 40, 40)),  # the projection over the cat
    "c3k2_cv1": (lambda: _conv(128, 128, act=nn.SiLU), (1, 128, 40, 40)),
    "c3k2_3x3": (lambda: _conv(32, 32, 3, act=nn.SiLU), (1, 32, 40, 40)),  # the bottlenecks' convs
    "c3k2_c3k_cv1": (lambda: _conv(64, 32, act=nn.SiLU), (1, 64, 40, 40)),  # C3k's cv1 / cv2
    "c3k2_c3k_cv3": (lambda: _conv(64, 64, act=nn.SiLU), (1, 64, 40, 40)),
    "c3k2_cv2_b16": (lambda: _conv(192, 128, act=nn.SiLU), (16, 192, 40, 40)),
    "c3k2_3x3_b16": (lambda: _conv(32, 32, 3, act=nn.SiLU), (16, 32, 40, 40)),
}


def main(names: list[str], rounds: int) -> None:
    for name in names:
        build, shape = CASES[name]
        torch.manual_seed(0)
        model, x = build(), torch.randn(shape)
        ctx = Context(name, model, (x,), T, Path(tempfile.mkdtemp()))
        from vtc.codegen import conv_bcast

        conv_bcast.ENABLED = os.environ.get("BCAST") != "0"
        c = vtc.compile(model, (x,))
        conv_bcast.ENABLED = True
        with torch.no_grad():
            err = (c(x) - model(x)).abs().max().item()
        if err > 1e-3:
            raise AssertionError(f"{name}: max error {err}")
        fns = {"eager": _eager(ctx).fn, "onnxruntime": _onnxruntime(ctx).fn, "vtc": lambda: c(x)}
        if os.environ.get("PANELS"):  # also vtc with the dot form of small maps off (vtc.codegen.conv_t)
            from vtc.codegen import conv_bcast, conv_t

            keep, conv_t.MAX_PIXELS, conv_bcast.MAX_PIXELS = (conv_t.MAX_PIXELS, conv_bcast.MAX_PIXELS), 0, 0
            try:
                panels = vtc.compile(model, (x,))
            finally:
                conv_t.MAX_PIXELS, conv_bcast.MAX_PIXELS = keep
            fns["vtc-panels"] = lambda: panels(x)
        if os.environ.get("GOTO"):  # also vtc with the GEMM's own loops for its convolutions (not conv_panels)
            from vtc.codegen import conv_panels

            conv_panels.ENABLED = False
            try:
                goto = vtc.compile(model, (x,))
            finally:
                conv_panels.ENABLED = True
            fns["vtc-goto"] = lambda: goto(x)
        with torch.no_grad():
            times = time_side_by_side(fns, rounds, clk)
        ms = {s: t["median_ms"] for s, t in times.items()}
        best = min(v for s, v in ms.items() if not s.startswith("vtc"))
        print(f"{name:14s} " + "  ".join(f"{s} {v:.3f}" for s, v in ms.items()) +
              f"   best other / vtc: {best / ms['vtc']:.2f}x", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES), int(os.environ.get("N", 40)))
