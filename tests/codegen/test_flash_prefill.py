"""Prefill flash tiles: Qᵀ packed 16 queries at a time through a register transpose, and the additive mask's
hidden-block check as vector code (docs/prefill.md), against eager on odd query counts."""
from __future__ import annotations

import pytest
import torch

from vtc.codegen.cpp import generate

from .test_attention import TOL, _inputs, assert_one_attention_kernel, attention, attention_kernels
from .util import compile_cpu


# (GQA ratio, batch, queries = keys S, head dim D, mask, soft-cap): S = 1, 17, 127, 257 fill 1-5 tiles of 64
# queries (257: a last tile of one query on 16 lanes); D = 40 is not a whole number of vectors (Qᵀ's rows
# padded with zeros to 48); "window" is a finfo.min additive mask (key blocks skipped at run time)
CASES = [
    (2, 1, 1, 64, "causal", None),
    (2, 16, 17, 40, "window", None),
    (4, 1, 127, 64, "window", 50.0),
    (2, 1, 257, 40, "causal", None),
    (1, 1, 257, 128, "window", 30.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "r{}_b{}_s{}_d{}_{}_cap{}".format(*c))
def test_prefill_tiles_match_eager(case):
    ratio, b, s, d, mask, cap = case
    fn = attention(ratio, mask, cap, "mul")
    inputs = _inputs(ratio, b, s, s, d, mask, seed=s + d)
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
    assert_one_attention_kernel(compiled)
    (k,) = attention_kernels(compiled)
    src = generate(k)
    if s == 1:  # one query per head: the GQA-decode form, not tiles
        assert not k.tiled
        return
    assert k.tiled and "vtc_flash_transpose16(&qr[0][d0]" in src
    if mask == "window":  # the check ORs into an int: no branch in its omp simd loop
        assert "seen |= !(" in src and "seen || " not in src
