"""executor.kernels_built_together: the kernels of several compiles built in one parallel build at the end of a
block (the machine measurement's GEMMs, vtc.plan.cost._measure_ratios)."""
from __future__ import annotations

import subprocess

import pytest
import torch

import vtc
from vtc.plan import cost
from vtc.runtime import cbuild, executor
from vtc.runtime.cbuild import KernelBuildError


def _scaled_relu(x):
    return torch.relu(x.t() * 2.0)


def _scaled_relu_3(x):
    return torch.relu(x.t() * 3.0)


def _record_builds(monkeypatch) -> list[int]:
    """The number of sources of each cbuild.build_many call from now on."""
    builds = []
    build_many = cbuild.build_many

    def recorded(sources, **kwargs):
        builds.append(len(sources))
        return build_many(sources, **kwargs)

    monkeypatch.setattr(cbuild, "build_many", recorded)
    return builds


def test_the_kernels_of_the_compiles_in_the_block_are_built_at_its_end_in_one_parallel_build(tmp_path, monkeypatch):
    """Two compiles in a block (their kernels of the same name: each graph's own translation units): no
    build while they compile, one build_many of both graphs' kernels at the end, then both match eager."""
    monkeypatch.setenv("VTC_CACHE_DIR", str(tmp_path))
    builds = _record_builds(monkeypatch)
    x = torch.randn(17, 9)
    with executor.kernels_built_together():
        a = vtc.compile(_scaled_relu, (x,))
        b = vtc.compile(_scaled_relu_3, (x,))
        assert builds == []
    assert builds == [2]
    names = [[s.kernel.step.kernel.name for s in c._first.executor.steps if s.kind == "kernel"] for c in (a, b)]
    assert names[0] == names[1] and len(names[0]) == 1, names
    x = torch.randn(17, 9)
    torch.testing.assert_close(a(x), _scaled_relu(x), rtol=0, atol=0)
    torch.testing.assert_close(b(x), _scaled_relu_3(x), rtol=0, atol=0)
    with executor.kernels_built_together():  # cached now: loaded at the end of the block
        c = vtc.compile(_scaled_relu, (x,))
    torch.testing.assert_close(c(x), _scaled_relu(x), rtol=0, atol=0)


def test_a_kernel_that_does_not_build_raises_at_the_end_of_the_block(tmp_path, monkeypatch):
    monkeypatch.setenv("VTC_CACHE_DIR", str(tmp_path))
    cbuild.compiler_info()  # probed before the compiler fails
    monkeypatch.setattr(cbuild, "_run_compiler",
                        lambda cmd: subprocess.CompletedProcess(cmd, 1, "", "error: no compiler today"))
    block = executor.kernels_built_together()
    block.__enter__()
    vtc.compile(_scaled_relu, (torch.randn(5, 3),))  # nothing built yet
    with pytest.raises(KernelBuildError, match="no compiler today"):
        block.__exit__(None, None, None)


def test_the_gemm_ratios_are_compiled_again_one_by_one_where_their_build_together_fails(monkeypatch):
    """_measure_ratios: a KernelBuildError at the end of the block (one GEMM that does not build) compiles the
    ratios again outside it, where each that does not build is 0.0 (_cpu_time_ratio), and times those."""
    made = []

    class FailsAtTheEnd:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            raise KernelBuildError("the bf16 GEMM does not build")

    def timers():
        made.append(1)
        return {"library_gemm_ratio": lambda: float(len(made))}

    monkeypatch.setattr(executor, "kernels_built_together", FailsAtTheEnd)
    monkeypatch.setattr(cost, "_ratio_timers", timers)
    assert cost._measure_ratios() == {"library_gemm_ratio": 2.0} and len(made) == 2


def test_a_gemm_ratio_whose_kernel_does_not_build_is_zero(monkeypatch):
    def no_build(*args, **kwargs):
        raise KernelBuildError("the bf16 GEMM does not build")

    monkeypatch.setattr(vtc, "compile", no_build)
    assert cost._cpu_time_ratio(lambda x: x, (torch.randn(2),), None)() == 0.0


def test_a_call_inside_the_block_says_the_kernel_is_not_built_yet_and_works_after_it(tmp_path, monkeypatch):
    """A compiled model called before the block that builds its kernels ends raised "'NoneType' object is not
    callable"; it now names the kernel and the block, and the calls after the block run the built kernels."""
    monkeypatch.setenv("VTC_CACHE_DIR", str(tmp_path))
    x = torch.randn(17, 9)
    with executor.kernels_built_together():
        a = vtc.compile(_scaled_relu, (x,))
        with pytest.raises(RuntimeError, match="not built.*kernels_built_together"):
            a(x)
    for _ in range(2):
        torch.testing.assert_close(a(x), _scaled_relu(x), rtol=0, atol=0)
