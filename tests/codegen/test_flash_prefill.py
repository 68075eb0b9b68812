"""Prefill flash tiles: Qᵀ packed 16 queries at a time through a register transpose, and the additive mask's
hidden-block check as vector code (docs/prefill.md), against eager on odd query counts."""
from __future__ import annotations

import re

import pytest
import torch

from bench.workloads import llama3

from vtc.codegen.cpp import generate

from .test_attention import TOL, _inputs, assert_one_attention_kernel, attention, attention_kernels, repeat_kv
from .util import compile_cpu, gen, rand


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


def cache_position_attention(ratio: int, window: int | None, cap: float | None):
    """The llama3 / gemma2 layers' attention: GQA, scale, soft-cap, an additive finfo.min mask built from
    the `cache_position` input (causal, or a sliding window)."""
    def fn(q, k, v, cache_position):
        scores = torch.matmul(q, repeat_kv(k, ratio).transpose(2, 3)) * q.shape[3] ** -0.5
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        scores = scores + llama3.causal_mask(cache_position, k.shape[2], window, scores.dtype)
        return torch.matmul(torch.softmax(scores, dim=-1), repeat_kv(v, ratio))
    return fn


# (GQA ratio, batch, queries S, keys T, head dim D, window, soft-cap, positions): "last" puts the queries at
# the last S of the T positions, "perm" at S distinct random ones (each lane's position read back right)
LANE_CASES = [
    (4, 1, 127, 127, 64, None, None, "last"),
    (2, 16, 17, 40, 40, 8, 50.0, "last"),
    (1, 1, 257, 257, 128, 100, 30.0, "last"),
    (2, 1, 257, 300, 40, None, None, "perm"),
]


@pytest.mark.parametrize("case", LANE_CASES, ids=lambda c: "r{}_b{}_s{}_t{}_d{}_w{}_cap{}_{}".format(*c))
def test_cache_position_mask_is_read_once_per_tile(case):
    """The mask's ``cache_position[query]`` does not depend on the key: the tile reads it once per query
    into a lane array (``lq0``), the score chain and the hidden-block check compare the key with that, no
    gather per key (before: ``b1[i1]`` in both, for every key)."""
    ratio, b, s, t, d, window, cap, where = case
    fn = cache_position_attention(ratio, window, cap)
    g = gen(s + d + t)
    q, k, v = rand((b, 2 * ratio, s, d), g), rand((b, 2, t, d), g), rand((b, 2, t, d), g)
    pos = torch.arange(t - s, t) if where == "last" else torch.randperm(t, generator=g)[:s]
    compiled = compile_cpu(fn, (q, k, v, pos))
    torch.testing.assert_close(compiled(q, k, v, pos), fn(q, k, v, pos), **TOL)
    assert_one_attention_kernel(compiled)
    (kern,) = attention_kernels(compiled)
    src = generate(kern)
    assert "lq0[q] = " in src, src
    pos_ptr = re.search(r"lq0\[q\] = (b\d+)\[i1\];", src).group(1)
    chain = [x for x in src.splitlines() if re.match(r"\s*(st\[t\]\[q\] = |seen \|= )", x)]
    assert len(chain) == 2 and all("lq0[q]" in x and f"{pos_ptr}[" not in x for x in chain), chain
    if window is not None:
        assert "lq1[q] = " in src


# (GQA ratio, batch, S, head dim, mask, soft-cap): a causal block on the diagonal (the first queries of the
# tile see its first keys only), a window's first block (the last queries see its last keys only)
TRIM_CASES = [
    (2, 1, 127, 64, "causal", None),
    (1, 1, 257, 128, "window", 30.0),
    (4, 16, 17, 40, "window_inf", None),
    (2, 1, 70, 40, "none", 50.0),  # no mask: every key is seen, no bookkeeping
]


@pytest.mark.parametrize("case", TRIM_CASES, ids=lambda c: "r{}_b{}_s{}_d{}_{}_cap{}".format(*c))
def test_pv_visits_the_keys_with_a_probability(case):
    """The PV micro-kernel of a query step runs from the first to one past the last key of the block whose
    probability is not 0 for one of its queries (``plo`` / ``phi``, kept by the softmax): masked keys
    before and after are not read (before: every key of the block, p = 0 included).  Without a mask the
    bookkeeping is not emitted."""
    ratio, b, s, d, mask, cap = case
    fn = attention(ratio, mask, cap, "mul")
    inputs = _inputs(ratio, b, s, s, d, mask, seed=3 * s + d)
    compiled = compile_cpu(fn, inputs)
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
    (kern,) = attention_kernels(compiled)
    src = generate(kern)
    trimmed = mask != "none"
    assert kern.tiled and ("for (int64_t t = t_lo; t < t_hi; ++t) {" in src) == trimmed
    assert ("plo[q] = lo_ < plo[q] ? lo_ : plo[q]; phi[q] = hi_ > phi[q] ? hi_ : phi[q];" in src) == trimmed


def _fma_memory_operands(src: str) -> int:
    """FMAs of the kernel's assembly that read a whole vector from memory other than the stack (a micro-kernel
    operand folded into each of its uses; embedded broadcasts `{1to16}` and spill reloads do not count)."""
    import subprocess
    import tempfile
    from pathlib import Path

    from vtc.runtime.cbuild import compiler_info

    info = compiler_info()
    with tempfile.TemporaryDirectory(prefix="vtc-asm-") as tmp:
        path = Path(tmp, "kernel.cpp")
        path.write_text(src)
        out = Path(tmp, "kernel.s")
        subprocess.run([*info.command, str(path), "-S", "-o", str(out), *[f for f in info.flags if f != "-shared"]],
                       check=True, capture_output=True)
        asm = out.read_text()
    return sum(1 for line in asm.splitlines() if re.match(r"\s*vfn?madd\d+ps\s", line) and "(" in line
               and "1to" not in line and "%rsp" not in line and "%rbp" not in line)


@pytest.mark.parametrize("d,ratio", [(64, 4), (128, 2), (40, 1)])
def test_micro_kernel_operands_stay_in_registers(d, ratio):
    """The score step's Qᵀ vectors and the PV step's V vectors are loaded once per key (per d) and pinned to
    registers (``flash.PIN_OPERANDS``): without it gcc folded each V vector into its 4 FMAs as a memory operand
    (16 loads of 64 bytes per 16 FMAs, load-bound; llama3_prefill_b1's kernel 1.21 -> 0.82 ms at 1 thread, the
    same bits).  Against eager, and in the kernel's assembly no FMA reads a vector from memory (AVX-512)."""
    from vtc.codegen import conv_t, flash

    fn = cache_position_attention(ratio, None, None)
    g = gen(d + ratio)
    s = 129
    q, k, v = rand((1, 4 * ratio, s, d), g), rand((1, 4, s, d), g), rand((1, 4, s, d), g)
    pos = torch.arange(s)
    compiled = compile_cpu(fn, (q, k, v, pos))
    torch.testing.assert_close(compiled(q, k, v, pos), fn(q, k, v, pos), **TOL)
    (kern,) = attention_kernels(compiled)
    assert kern.tiled
    src = generate(kern)
    ev = -(-d // flash.LANES)
    assert len(re.findall(r"VTC_IN_REG\(w\d+\)", src)) == ev  # each V vector of the PV step
    assert len(re.findall(r"VTC_IN_REG\(q\d+\)", src)) == 1 + 2 + 4  # the three score micro-kernels
    if conv_t.has_avx512():  # the build's target has AVX-512 (else VTC_IN_REG is empty)
        assert _fma_memory_operands(src) == 0


@pytest.mark.parametrize("d,ratio", [(64, 4), (128, 2)])
def test_decode_pv_operands_stay_in_registers(d, ratio):
    """The GQA decode form's PV step (``shared_pv``: the group's rows x the value dim, V broadcast across the rows)
    pins its V vectors too (llama3_decode_b16's attention 2.10 -> 2.06 ms median, same bits)."""
    fn = cache_position_attention(ratio, None, None)
    g = gen(3 * d + ratio)
    t = 300
    q, k, v = rand((2, 4 * ratio, 1, d), g), rand((2, 4, t, d), g), rand((2, 4, t, d), g)
    pos = torch.tensor([t - 7])
    compiled = compile_cpu(fn, (q, k, v, pos))
    torch.testing.assert_close(compiled(q, k, v, pos), fn(q, k, v, pos), **TOL)
    (kern,) = attention_kernels(compiled)
    assert not kern.tiled
    assert len(re.findall(r"VTC_IN_REG\(w\d+\)", generate(kern))) == -(-d // 16)
