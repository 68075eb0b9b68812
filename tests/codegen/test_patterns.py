"""The benchmark patterns of the code-generator issue, compiled with plan="all" for the CPU backend.

Each pattern is a movement chain feeding one consumer.  The assertions are the
point of the code generator: the result matches eager, no byte of movement is
materialised, nothing ran through torch, and the whole pattern is as many
kernels as expected: for most, one (the consumer's kernel, reading through the
composed mapping).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from .util import (ROW_TOL, assert_all_generated, assert_no_movement, compile_cpu, data_reads, gen,
                   graph_input_names, kernels, rand, report)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def window_partition_layer_norm(x, w, b):
    """Swin: view -> permute -> contiguous -> view into 4x4 windows, then layer norm."""
    B, H, W, C = x.shape
    ws = 4
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    windows = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws * ws, C)
    return F.layer_norm(windows, (C,), w, b)


def _patterns():
    g = gen(40)
    return {
        # id: (fn, inputs, expected kernels)
        "transpose_add": (lambda x, y: x.transpose(1, 2) + y, (rand((2, 64, 48), g), rand((2, 48, 64), g)), 1),
        "permute_softmax": (lambda x: torch.softmax(x.permute(0, 2, 1, 3), -1), (rand((2, 32, 4, 64), g),), 1),
        "cat_relu": (lambda a, b: F.relu(torch.cat([a, b], 1)), (rand((4, 24, 64), g), rand((4, 8, 64), g)), 1),
        "rotate_half_mul": (lambda x, s: rotate_half(x) * s, (rand((2, 4, 32, 64), g), rand((32, 64), g)), 1),
        # torch.export decomposes roll into arange -> add -> fmod -> index_select: the index tensor is
        # folded into the consumer's index arithmetic; see test_roll_index_is_folded_into_the_consumer
        "roll_add": (lambda x, y: torch.roll(x, 3, -1) + y, (rand((8, 256), g), rand((8, 256), g)), 1),
        "index_select_sum": (lambda x, i: x.index_select(0, i).sum(-1),
                             (rand((64, 128), g), torch.randint(0, 64, (17,), generator=g)), 1),
        "window_partition_layer_norm": (window_partition_layer_norm,
                                        (rand((2, 16, 16, 32), g), rand((32,), g), rand((32,), g)), 1),
    }


PATTERNS = _patterns()


@functools.lru_cache(maxsize=None)
def compiled_pattern(name: str):
    fn, inputs, _ = PATTERNS[name]
    return compile_cpu(fn, inputs, plan="all")


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_removes_the_movement(name):
    fn, inputs, expected_kernels = PATTERNS[name]
    compiled = compiled_pattern(name)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **ROW_TOL)
    r = report(compiled)
    assert r["plan"] == "all"
    assert r["movement_ops"] >= 1
    assert_no_movement(compiled)  # materialized_movement_bytes == 0, every movement op eliminated
    assert_all_generated(compiled)
    assert r["kernels"] == expected_kernels, compiled.report
    consumer = kernels(compiled)[-1]
    assert data_reads(compiled, consumer) <= graph_input_names(compiled)


def test_roll_index_is_folded_into_the_consumer():
    assert report(compiled_pattern("roll_add"))["kernels"] == 1


def test_plan_none_materialises_what_plan_all_removes():
    """The same pattern with plan="none" moves bytes: the zero above is the optimisation, not an accident."""
    fn, inputs, _ = PATTERNS["transpose_add"]
    compiled = compiled_pattern("transpose_add").replan(plan="none")
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **ROW_TOL)
    assert report(compiled)["materialized_movement_bytes"] == inputs[0].numel() * 4
