"""The generated GEMM's column blocks (docs/prefill.md, "Column blocks of whole steps", helper gpt2, session 21):
block jb of tn covers steps [jb * nq_n / tn, (jb + 1) * nq_n / tn) of nq columns (``gemm._balanced_blocks``), so the
threads' column ranges differ by one step at most; before, blocks of nc columns with a short last one gave one of
2 threads 25600 of the 50257 columns of GPT-2's logits (the other 24657).

Values against torch at 1-4 threads, called directly, on N with a short last block (weight_rows, its streamed
form, the panels path), and the kernel's lines.
"""
from __future__ import annotations

import pytest
import torch

from vtc.codegen import gemm as G
from vtc.codegen.gemm import generate as generate_gemm
from vtc.runtime import cbuild

from .test_gemm import GEMM_TOL, _check, _gemm_kernels
from .util import call_gemm_kernel, gen, rand, report


def _paths(c) -> list[str]:
    return [g["path"] for g in report(c)["gemm"]]


# (M, K, N, path): N = 2100 (3 blocks of 704 on 1 thread, 4 of 528 on 2), 5000 (5 blocks of 1000 + a step), the
# panels at 200 rows (above WT_MAX_M)
CASES = [(40, 64, 2100, "weight_rows"), (128, 33, 5000, "weight_rows"), (200, 64, 2100, "panels")]


@pytest.mark.parametrize("stream", [False, True], ids=["stored", "streamed"])
@pytest.mark.parametrize("m,k,n,path", CASES, ids=[f"{m}x{k}x{n}" for m, k, n, _ in CASES])
def test_every_thread_count_covers_the_output_once(m, k, n, path, stream, monkeypatch):
    if stream and path != "weight_rows":
        pytest.skip("only weight_rows streams C")
    monkeypatch.setattr(G, "WT_STREAM_BYTES", 0 if stream else G.WT_STREAM_BYTES)
    g = gen(m + k + n)
    inputs = (rand((m, k), g), rand((n, k) if path == "weight_rows" else (k, n), g))
    fn = (lambda x, w: x @ w.t()) if path == "weight_rows" else (lambda x, w: x @ w)  # noqa: E731
    c = _check(fn, inputs, gemm="vtc")
    (kern,) = _gemm_kernels(c)
    assert _paths(c) == [path]
    src = generate_gemm(kern)
    assert ("if (wt_stream) nq = 48;" in src) == (path == "weight_rows")  # taken where C is streamed (run time)
    lib = cbuild.build(generate_gemm(kern), name="gemm_direct")
    for nthreads in (1, 2, 3, 4):
        torch.testing.assert_close(call_gemm_kernel(lib, kern, c, inputs, nthreads), fn(*inputs), **GEMM_TOL)


def test_the_kernel_cuts_blocks_by_steps():
    """Fails before (blocks of nc, the last one short): the unit loop takes its columns by steps."""
    g = gen(7)
    inputs = (rand((40, 64), g), rand((2100, 64), g))
    (kern,) = _gemm_kernels(_check(lambda x, w: x @ w.t(), inputs, gemm="vtc"))
    src = generate_gemm(kern)
    assert "n0 = jb * nq_n / tn * nq, nb = std::min<int64_t>(N, (jb + 1) * nq_n / tn * nq) - n0;" in src
    assert "const int64_t nq_n = (N + nq - 1) / nq;" in src


def test_switch_off_restores_blocks_of_nc(monkeypatch):
    monkeypatch.setattr(G, "BALANCED_BLOCKS", False)
    g = gen(8)
    inputs = (rand((40, 64), g), rand((2100, 64), g))
    (kern,) = _gemm_kernels(_check(lambda x, w: x @ w.t(), inputs, gemm="vtc"))
    assert "n0 = (grp % tn) * nc, nb = std::min<int64_t>(nc, N - n0);" in generate_gemm(kern)
