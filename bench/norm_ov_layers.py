"""OpenVINO's own per-layer times (PERF_COUNT, 1 thread) for a chain of 8 LayerNorms at one of Swin-T's widths.

    PYTHONPATH=$PWD python bench/norm_ov_layers.py s1      # [3136, 96]; shapes as bench/norm_side_by_side.py

Prints the call's thread CPU time (200 calls) and each executed layer's real time: OpenVINO runs a layer norm as
an MVN node and a Subgraph (the scale and shift).
"""
import sys
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import openvino as ov  # noqa: E402

from bench.norm_side_by_side import SHAPES, Chain  # noqa: E402
from bench.systems import Context  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "s1"
rows, c = SHAPES[name]
torch.manual_seed(0)
model, x = Chain(c, 8, False).eval(), torch.randn(1, rows, c) * 0.1 + 100
path = Context("ln", model, (x,), 1, Path(tempfile.mkdtemp())).onnx()
config = {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
          "NUM_STREAMS": 1, "PERF_COUNT": True}
req = ov.Core().compile_model(str(path), "CPU", config).create_infer_request()
arrays = [x.numpy()]
for _ in range(50):
    req.infer(arrays, share_inputs=True)
t0 = time.thread_time()
for _ in range(200):
    req.infer(arrays, share_inputs=True)
print(f"{name} [{rows}, {c}] x 8: call {(time.thread_time() - t0) / 200 * 1e3:.3f} ms (thread CPU time)")
for p in req.profiling_info:
    if p.real_time.total_seconds() > 0:
        print(f"  {p.node_name:24s} {p.node_type:10s} {p.exec_type:16s} {p.real_time.total_seconds() * 1e3:.3f} ms")
