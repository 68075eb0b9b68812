"""A few cases of tests/fuzz_campaign.py's kinds beyond float32 torch models (session 21), so the hand-run campaign
keeps working: a bf16 model against eager in bf16, ONNX files against onnxruntime and eager (a float32 one without
constant folding, so a weight's transpose is an op on an initializer; a bf16 one, which onnxruntime cannot run,
whose TorchScript export differs from eager: roll by more than the dim's size), chains on GEMM and conv weights.
Each case compiles with vtc and compares every call with explicit tolerances (fuzz_campaign._close)."""
from __future__ import annotations

import pytest
import torch

from tests.fuzz_campaign import KINDS, Case, run_case, run_onnx_case

CASES = [("bf16", 21, 12), ("onnx", 27, 8), ("onnx", 27, 22), ("weights", 22, 10), ("weights", 22, 5)]
ONNX_NOTES = {8: ("torchscript, not folded", False), 22: ("torchscript, not folded", True)}  # (exporter, file differs)


@pytest.mark.parametrize("kind,seed,number", CASES, ids=[f"{k}-{s}-{n}" for k, s, n in CASES])
def test_a_drawn_case_of_each_kind(kind, seed, number):
    case = Case(seed, number, kind)
    assert case.body in KINDS[kind]
    if kind == "bf16":
        assert case.dtype in (torch.bfloat16, torch.float16)
    done = (run_onnx_case if kind == "onnx" else run_case)(case)
    assert done[0] == "first" and "values" in done, done
    if kind == "onnx":
        assert (case.exporter, case.eager_differs) == ONNX_NOTES[number]
