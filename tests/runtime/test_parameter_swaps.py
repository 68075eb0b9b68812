"""A parameter *replaced* after vtc.compile (another tensor, not a change in place) is seen by the next call.

``p.data = t``, ``module.to(...)`` and ``load_state_dict(..., assign=True)`` leave the compiled model's
constants, packed weights (MKL's, a generated GEMM's or convolution's panels), segment tables and folded
constants on the old storage; before session 15 every one of these tests returned the old weights' result
(a silent wrong answer).  ``vtc.runtime.weights.ParameterWatch`` tests each captured tensor's slot and address
per call; when one moved, the model is captured again.
"""
from __future__ import annotations

import os

import pytest
import torch

import vtc
from vtc import compiler
from vtc.runtime import segment

pytestmark = pytest.mark.usefixtures("quiet")
TOL = dict(rtol=1e-4, atol=1e-4)


def _counts(compiled) -> dict:
    return compiled._first.executor.call_plan().counts


def _called(model, *inputs, **options):
    """model compiled for inputs (no_grad), after one call (its fast call made)."""
    compiled = vtc.compile(model, inputs, **options)
    compiled(*inputs)
    return compiled


def _swap_all(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5


# (rows, gemm, the count that says which packed path runs): 2..8 rows: the skinny dot path on panels packed
# once (vtc_skinny_packed); 49 rows: the 17-128-row path on panels packed once; with gemm="auto" at 49 rows
# MKL's packed GEMM (where MKL is there)
@pytest.mark.parametrize("rows,gemm,count", [(1, "vtc", None), (2, "vtc", "packed_conv_weights"),
                                             (5, "vtc", "packed_conv_weights"), (8, "vtc", "packed_conv_weights"),
                                             (49, "vtc", "packed_conv_weights"), (49, "auto", "packed_weights"),
                                             (3, "auto", None)])
def test_linear_weight_replaced_by_data_assignment(rows, gemm, count):
    from vtc.codegen.conv_t import has_avx512
    from vtc.runtime import packed

    torch.manual_seed(rows)
    lin = torch.nn.Linear(96, 80).eval()
    x = torch.randn(rows, 96)
    with torch.no_grad():
        compiled = vtc.compile(lin, (x,), gemm=gemm)
        torch.testing.assert_close(compiled(x), lin(x), **TOL)
        if count == "packed_conv_weights" and has_avx512() or count == "packed_weights" and packed.ENABLED:
            assert _counts(compiled)[count] == 1, "the weight is not packed once: the test would not test that"
        for step in range(3):
            _swap_all(lin, 100 + step)
            x = torch.randn(rows, 96)
            torch.testing.assert_close(compiled(x), lin(x), **TOL)
            torch.testing.assert_close(compiled(x), lin(x), **TOL)  # the fast call made again


@pytest.mark.parametrize("kernel", [1, 3])
def test_conv_weight_replaced(kernel):
    torch.manual_seed(20 + kernel)
    conv = torch.nn.Sequential(torch.nn.Conv2d(32, 48, kernel, padding=kernel // 2), torch.nn.ReLU()).eval()
    x = torch.randn(1, 32, 10, 10)
    with torch.no_grad():
        compiled = vtc.compile(conv, (x,))
        torch.testing.assert_close(compiled(x), conv(x), **TOL)
        conv[0].weight.data = torch.randn(48, 32, kernel, kernel) * 0.2
        torch.testing.assert_close(compiled(x), conv(x), **TOL)
        conv[0].bias.data = torch.randn(48)
        torch.testing.assert_close(compiled(x), conv(x), **TOL)


class _Block(torch.nn.Module):
    """Kernels in a row (a segment: one C call for several kernels) reading weights and a scale."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(16, 32, 1), torch.nn.Conv2d(32, 16, 1)
        self.scale = torch.nn.Parameter(torch.randn(1, 16, 1, 1))

    def forward(self, x, y):
        return self.conv2(torch.relu(self.conv1(x.transpose(2, 3)))) * y * self.scale


def test_replaced_weights_in_a_segment(monkeypatch):
    monkeypatch.setattr(segment, "SEGMENTS", True)
    torch.manual_seed(30)
    m = _Block().eval()
    x, y = torch.randn(1, 16, 14, 10), torch.randn(1, 16, 10, 14)
    with torch.no_grad():
        compiled = vtc.compile(m, (x, y))
        torch.testing.assert_close(compiled(x, y), m(x, y), **TOL)
        if segment.segment_runner() is not None:
            assert _counts(compiled)["segments"] >= 1, "no segment: the test would not test one"
        m.scale.data = torch.randn(1, 16, 1, 1)
        torch.testing.assert_close(compiled(x, y), m(x, y), **TOL)
        m.conv1.weight.data = torch.randn(32, 16, 1, 1)
        m.conv2.weight.data = torch.randn(16, 32, 1, 1)
        torch.testing.assert_close(compiled(x, y), m(x, y), **TOL)
        if segment.segment_runner() is not None:
            assert _counts(compiled)["segments"] >= 1


def test_load_state_dict_with_assign():
    torch.manual_seed(40)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).eval()
    x = torch.randn(49, 64)
    with torch.no_grad():
        compiled = vtc.compile(m, (x,))
        torch.testing.assert_close(compiled(x), m(x), **TOL)
        new = {k: torch.randn_like(v) * 0.3 for k, v in m.state_dict().items()}
        m.load_state_dict(new, assign=True)
        assert m[0].weight.data_ptr() == new["0.weight"].data_ptr()  # the slot holds the new tensor
        torch.testing.assert_close(compiled(x), m(x), **TOL)
        m.load_state_dict({k: v * 2 for k, v in new.items()})  # in place, as before: seen too
        torch.testing.assert_close(compiled(x), m(x), **TOL)


def test_attribute_replaced_by_a_new_parameter():
    torch.manual_seed(41)
    lin = torch.nn.Linear(32, 24).eval()
    x = torch.randn(40, 32)
    with torch.no_grad():
        compiled = _called(lin, x)
        lin.weight = torch.nn.Parameter(torch.randn(24, 32))
        torch.testing.assert_close(compiled(x), lin(x), **TOL)


def test_module_to_another_dtype_is_captured_again_or_refused():
    """After ``module.to(torch.float64)`` the next call captures the model again for its inputs: float64 inputs run
    in float64; float32 ones raise as eager does (never the float32 weights' old result)."""
    torch.manual_seed(42)
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(50, 32)
    with torch.no_grad():
        compiled = _called(m, x)
        m.to(torch.float64)
        x64 = x.double()
        torch.testing.assert_close(compiled(x64), m(x64), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(compiled(x64), m(x64), rtol=1e-9, atol=1e-9)
        m.to(torch.float32)
        torch.testing.assert_close(compiled(x), m(x), **TOL)

        m.to(torch.float64)
        with pytest.raises(RuntimeError, match="dtype"):  # eager refuses float32 inputs too
            m(x)
        with pytest.raises((vtc.CaptureError, RuntimeError), match="dtype"):  # as eager: not the old result
            compiled(x)


def test_a_direct_kernel_reading_a_parameter():
    """A one-kernel plan whose fast call passes the constant itself (callplan.direct_kernel)."""
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s = torch.nn.Parameter(torch.randn(64))

        def forward(self, x):
            return torch.relu(x * self.s)

    torch.manual_seed(43)
    m = Scale().eval()
    x = torch.randn(8, 64)
    with torch.no_grad():
        compiled = _called(m, x)
        compiled(x)
        m.s.data = torch.randn(64)
        torch.testing.assert_close(compiled(x), m(x), **TOL)


def test_a_write_through_data_then_refresh():
    """A write through .data in place is not seen by a packed copy (README); refresh() captures again."""
    torch.manual_seed(44)
    lin = torch.nn.Linear(64, 48).eval()
    x = torch.randn(200, 64)
    with torch.no_grad():
        compiled = _called(lin, x)
        lin.weight.data.mul_(2)
        assert compiled.refresh() is compiled
        torch.testing.assert_close(compiled(x), lin(x), **TOL)


def test_a_replaced_weight_frees_the_old_one():
    torch.manual_seed(45)
    lin = torch.nn.Linear(128, 128).eval()
    x = torch.randn(64, 128)
    with torch.no_grad():
        compiled = _called(lin, x)
        old = lin.weight.untyped_storage()._weak_ref()
        lin.weight.data = torch.randn(128, 128)
        torch.testing.assert_close(compiled(x), lin(x), **TOL)
        import gc

        gc.collect()
        assert torch.UntypedStorage._expired(old), "the compiled model still holds the replaced weight"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc")
def test_ten_thousand_calls_do_not_grow_memory():
    torch.manual_seed(46)
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        compiled = vtc.compile(m, (x,))
        for _ in range(1000):
            compiled(x)
        before = _rss()
        for _ in range(10_000):
            compiled(x)
        grew = _rss() - before
        torch.testing.assert_close(compiled(x), m(x), **TOL)
    assert grew < 1 << 20, f"10,000 calls grew the resident memory by {grew} bytes"


def test_a_deleted_parameter_is_not_a_crash_of_the_check():
    torch.manual_seed(47)
    lin = torch.nn.Linear(16, 8).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        compiled = _called(lin, x)
        compiled(x)
        w = lin.weight
        del lin.weight
        with pytest.raises(Exception) as e:  # eager: AttributeError; vtc: its capture's error
            compiled(x)
        assert not isinstance(e.value, KeyError)
        lin.weight = torch.nn.Parameter(w.detach() * 3)
        torch.testing.assert_close(compiled(x), lin(x), **TOL)


def test_a_weight_replaced_after_calls_with_other_sizes():
    """Specializations for other input sizes (vtc.dynamic) are dropped with the first one."""
    torch.manual_seed(48)
    m = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.SiLU(), torch.nn.Linear(40, 24)).eval()
    with torch.no_grad():
        compiled = vtc.compile(m, (torch.randn(6, 24),))
        for rows in (6, 9, 13):
            compiled(torch.randn(rows, 24))
        _swap_all(m, 49)
        for rows in (9, 6, 13, 21):
            x = torch.randn(rows, 24)
            torch.testing.assert_close(compiled(x), m(x), **TOL)


def test_a_weight_replaced_in_a_model_captured_by_torch_export(monkeypatch):
    from vtc.frontend import torch_export

    monkeypatch.setattr(torch_export, "_fast_capture", lambda model, args, kwargs: (None, "refused by the test"))
    torch.manual_seed(50)
    m = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8)).eval()
    x = torch.randn(5, 32)
    with torch.no_grad():
        compiled = vtc.compile(m, (x,))
        assert "torch.export" in compiled.graph.meta["capture"]
        compiled(x)
        _swap_all(m, 51)
        torch.testing.assert_close(compiled(x), m(x), **TOL)


def _mlp_and_input():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    return model, torch.randn(5, 16)


def test_a_capture_again_by_another_thread_before_this_one_makes_its_fast_call(monkeypatch):
    """Thread B finds no fast call and its inputs exact; thread A, whose call saw a replaced weight, captures the
    model again before B makes its fast call.  B raised ``TypeError: 'NoneType' object is not subscriptable``
    (A's restart reset the signature B was about to read; tests/test_adversarial_fast_paths5.py swap case 16 of
    seed 1).  Now B's call runs the capture it read (the old weights: the call overlapped the swap) and its fast
    call is not kept; the next call makes the new capture's."""
    model, x = _mlp_and_input()
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        before = model(x)
        real, fired = compiler._exact, []

        def exact_then_another_thread_restarts(inputs, args):
            ok = real(inputs, args)
            if not fired:
                fired.append(True)
                model[0].weight.data = torch.randn(32, 16)  # the swap another thread's call saw
                compiled._restart(args, {}, "another thread's call saw a replaced weight")
            return ok

        monkeypatch.setattr(compiler, "_exact", exact_then_another_thread_restarts)
        torch.testing.assert_close(compiled(x), before, **TOL)
        assert fired and compiled._fast is None, "a fast call made from the old capture was kept"
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), **TOL)


def test_a_capture_again_for_other_sizes_while_a_call_checks_its_inputs(monkeypatch):
    """As above, but thread A's call, of other input sizes, captures the model again for its sizes while B checks
    its inputs.  Before session 26 the input signature was kept on Compiled and computed from whichever capture
    was current: B could store the old capture's signature next to A's capture, and the fast call then checked
    inputs against the old shapes and ran a plan made for the new ones (its kernels take no size check).  The
    signature now lives on the capture (``Specialization.exact_signature``), so a fast call checks the shapes of
    the plan it runs, and it is kept only for the capture it was made from."""
    model, x = _mlp_and_input()
    x9 = torch.randn(9, 16)
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        real, fired = compiler._exact, []

        def exact_then_another_thread_restarts(inputs, args):
            ok = real(inputs, args)
            if not fired:
                fired.append(True)
                model[0].weight.data = torch.randn(32, 16)
                compiled._restart((x9,), {}, "another thread's call of 9 rows saw a replaced weight")
            return ok

        monkeypatch.setattr(compiler, "_exact", exact_then_another_thread_restarts)
        compiled(x)  # this call overlapped the swap: either weights' result
        assert fired and compiled._fast is None, "a fast call made from the old capture was kept"
        assert compiled._first.exact_signature[0][0][1] == (9, 16)
        for inputs in (x9, x, x9, x):
            torch.testing.assert_close(compiled(inputs), model(inputs), **TOL)
        assert compiled._fast is not None


def test_a_fast_call_made_from_the_old_capture_is_not_kept(monkeypatch):
    """Thread B makes the fast call from the capture it read; meanwhile thread A captures the model again after a
    weight was replaced.  B read the fast call's signature after A had reset it (TypeError), or, made again
    meanwhile, joined the old capture's call plan to the new capture's watch: the old weights' result on every
    later call.  Fails without the snapshot in Compiled.__call__."""
    model, x = _mlp_and_input()
    with torch.no_grad():
        compiled = vtc.compile(model, (x,))
        old = compiled._first.executor
        real, fired = old.call_plan, []

        def plan_then_another_thread_restarts():
            plan = real()
            if not fired:
                fired.append(True)
                model[0].weight.data = torch.randn(32, 16)
                compiled._restart((x,), {}, "another thread's call saw a replaced weight")
            return plan

        monkeypatch.setattr(old, "call_plan", plan_then_another_thread_restarts)
        compiled(x)  # this call overlapped the swap: either weights' result
        assert fired
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), **TOL)


def test_two_calls_that_saw_the_same_replaced_weight_capture_once(monkeypatch):
    """Two threads whose calls both saw the same replaced weight (the same stale parameter watch) each asked for a
    capture again; the second one captured the model a second time for nothing.  ``_restart(stale=watch)`` now
    returns when another thread has captured again since that watch."""
    model, x = _mlp_and_input()
    with torch.no_grad():
        compiled = _called(model, x)
        model[0].weight.data = torch.randn(32, 16)
        stale = compiled._watch
        assert stale.changed()
        real, captures = compiler.export_graph, []
        monkeypatch.setattr(compiler, "export_graph", lambda *a, **k: captures.append(1) or real(*a, **k))
        for _ in range(2):  # the second is the other thread's call, after the first captured again
            compiled._restart((x,), {}, stale.why(), stale=stale)
        assert len(captures) == 1 and compiled._watch is not stale
        torch.testing.assert_close(compiled(x), model(x), **TOL)
        compiled.refresh()  # refresh() always captures again
        assert len(captures) == 2


@pytest.mark.parametrize("how", ["data", "setattr"])
def test_a_weight_replaced_after_compiling_with_dynamic_sizes(how):
    """vtc.compile(dynamic=True) captures the model symbolically from the start: its instantiations carry the
    constants' module names too (``SymbolicGraph.const_targets``), so the watch sees a replaced weight.  Before
    (fuzz6), the watch was empty and every later call returned the old weights' result, at every size."""
    torch.manual_seed(50)
    m = torch.nn.Sequential(torch.nn.Linear(17, 40), torch.nn.ReLU(), torch.nn.Linear(40, 17)).eval()
    with torch.no_grad():
        compiled = vtc.compile(m, (torch.randn(12, 17),), dynamic=True)
        for rows in (12, 5):
            compiled(torch.randn(rows, 17))
        new = torch.randn(40, 17) * 0.5
        if how == "data":
            m[0].weight.data = new
        else:
            m[0].weight = torch.nn.Parameter(new)
        for rows in (12, 5, 9):
            x = torch.randn(rows, 17)
            torch.testing.assert_close(compiled(x), m(x), **TOL)
