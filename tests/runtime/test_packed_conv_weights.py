"""A conv_bcast kernel's weight packed once by the call plan (vtc.runtime.packed.PackedConvWeight), against torch.

The broadcast form (vtc/codegen/conv_bcast.py) reads W^T in vectors of 16 output channels.  Where the weight is
a constant of the graph, the call plan packs it once and passes it to the kernel; a weight changed in place
after compiling (its version counter moves) is packed again before the next call.  The executor's reference
path (``run_steps``) still packs per call inside the kernel, so both layouts are checked against eager.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vtc
from vtc.codegen import conv_bcast, conv_t
from vtc.runtime import packed

from tests.codegen.util import ROW_TOL, errors_in_threads, gen, rand, torch_threads

pytestmark = pytest.mark.skipif(not conv_t.has_avx512() or not packed.CONV_ENABLED,
                                reason="the broadcast form is taken on AVX-512 targets only")


def _conv_bn_relu(c: int, o: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Conv2d(c, o, 1, bias=False), torch.nn.BatchNorm2d(o), torch.nn.ReLU()).eval()
    with torch.no_grad():
        m[1].running_mean.normal_(0, 0.1)
        m[1].running_var.uniform_(0.5, 1.5)
    return m


def _plan(compiled):
    return compiled._first.executor.call_plan()


def test_packed_layout_is_the_kernels_w_transposed():
    g = gen(3)
    w = rand((7 + 35 * 40,), g)  # rows of 33 at offset 7, 40 apart: 35 channels (three vectors, the last 3 lanes)
    p = conv_bcast.packed_layout(w, 7, 40, 35, 33)
    assert p.shape == (3, 33, 16)
    want = torch.zeros(48, 33)
    for o in range(35):
        want[o] = w[7 + o * 40: 7 + o * 40 + 33]
    torch.testing.assert_close(p, want.view(3, 16, 33).transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(232, 232, 7), (17, 40, 5), (66, 127, 3)],
                         ids=["232x232_7x7", "17x40_5x5", "66x127_3x3"])
def test_weight_packed_once_and_again_after_each_in_place_change(shape):
    c, o, h = shape
    m = _conv_bn_relu(c, o, c + o)
    x = rand((1, c, h, h), gen(o))
    with torch.no_grad():
        compiled = vtc.compile(m, (x,))
        assert [q["path"] for q in compiled.report.to_dict()["gemm"]] == [conv_bcast.FORM]
        torch.testing.assert_close(compiled(x), m(x), **ROW_TOL)
        assert _plan(compiled).counts["packed_conv_weights"] == 1, _plan(compiled).why_not_packed
        for change in (lambda w: w.mul_(-2.0).add_(0.25), lambda w: w.copy_(rand(tuple(w.shape), gen(9))),
                       lambda w: m.load_state_dict({**m.state_dict(), "0.weight": rand(tuple(w.shape), gen(10))})):
            change(m[0].weight)
            torch.testing.assert_close(compiled(x), m(x), **ROW_TOL)  # stale W^T: off by the whole change
            torch.testing.assert_close(compiled(x), m(x), **ROW_TOL)
            # the reference path (each step through run_step) packs per call inside the kernel: the same values
            torch.testing.assert_close(compiled._first.executor.run_steps([x])[0], m(x), **ROW_TOL)


def test_a_channels_last_weight_is_packed_from_its_refreshed_copy():
    torch.manual_seed(4)
    m = torch.nn.Sequential(torch.nn.Conv2d(16, 64, 3, stride=2, padding=1), torch.nn.ReLU()).eval()
    m = m.to(memory_format=torch.channels_last)  # a 3x3 stride 2 (K = 144) on 14x14: 7x7 outputs
    assert not m[0].weight.is_contiguous()
    x = rand((1, 16, 14, 14), gen(4))
    with torch.no_grad():
        compiled = vtc.compile(m, (x,))
        assert [q["path"] for q in compiled.report.to_dict()["gemm"]] == [conv_bcast.FORM]
        assert compiled._first.executor.const_copies
        torch.testing.assert_close(compiled(x), m(x), **ROW_TOL)
        assert _plan(compiled).counts["packed_conv_weights"] == 1
        m[0].weight.mul_(3.0)
        torch.testing.assert_close(compiled(x), m(x), **ROW_TOL)


def test_an_inference_weight_is_packed_per_call():
    """An inference tensor has no version counter: the kernel packs W^T itself on every call."""
    with torch.inference_mode():
        m = _conv_bn_relu(40, 56, 5)
        x = rand((1, 40, 7, 7), gen(5))
        compiled = vtc.compile(m, (x,))
        torch.testing.assert_close(compiled(x), m(x), **ROW_TOL)
    plan = _plan(compiled)
    assert plan.counts["packed_conv_weights"] == 0
    assert any("inference tensor" in why for why in plan.why_not_packed.values())


def test_threads_share_the_packed_weight_while_it_changes():
    """Four threads call one compiled convolution; between rounds the weight changes in place: every result is
    the weight of its round (the kernel never reads a buffer freed by another thread's re-pack)."""
    m = _conv_bn_relu(64, 96, 6)
    xs = [rand((1, 64, 7, 7), gen(20 + k)) for k in range(4)]
    with torch_threads(2):
        with torch.no_grad():
            compiled = vtc.compile(m, (xs[0],))
            compiled(xs[0])
            assert _plan(compiled).counts["packed_conv_weights"] == 1
            for r in range(3):
                want = [m(x) for x in xs]

                def work(k: int) -> None:
                    with torch.no_grad():
                        for _ in range(50):
                            torch.testing.assert_close(compiled(xs[k]), want[k], **ROW_TOL)

                assert errors_in_threads(work, 4) == []
                m[0].weight.mul_(-1.5)


def test_switched_off_packs_per_call(monkeypatch):
    monkeypatch.setattr(packed, "CONV_ENABLED", False)
    m = _conv_bn_relu(40, 56, 7)
    x = rand((1, 40, 7, 7), gen(7))
    with torch.no_grad():
        compiled = vtc.compile(m, (x,))
        torch.testing.assert_close(compiled(x), m(x), **ROW_TOL)
        assert _plan(compiled).counts["packed_conv_weights"] == 0
        m[0].weight.mul_(2.0)
        torch.testing.assert_close(compiled(x), m(x), **ROW_TOL)


def test_a_computed_weight_is_not_packed_once():
    """A weight that is an input of the graph (not a constant) changes per call: the kernel packs it."""
    def fn(x, w):
        return torch.relu(F.conv2d(x, w))

    g = gen(8)
    x, w = rand((1, 40, 7, 7), g), rand((56, 40, 1, 1), g)
    compiled = vtc.compile(fn, (x, w))
    if [q["path"] for q in compiled.report.to_dict()["gemm"]] != [conv_bcast.FORM]:
        pytest.skip("the convolution over an input weight does not take the broadcast form")
    torch.testing.assert_close(compiled(x, w), fn(x, w), **ROW_TOL)
    w2 = rand((56, 40, 1, 1), gen(9))
    torch.testing.assert_close(compiled(x, w2), fn(x, w2), **ROW_TOL)
    assert _plan(compiled).counts["packed_conv_weights"] == 0
