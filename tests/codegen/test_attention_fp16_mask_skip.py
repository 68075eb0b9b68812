"""Key blocks that an additive float16 ``finfo.min`` mask hides, skipped by the tiled attention kernel
(``flash.bounded_block_check``): transformers' eager attention in float16 adds the mask (-65504) in float16, above
``flash.HIDDEN``, so the float32 masks' check skips none of them.  A block is skipped only where each of its scores,
bounded from the queries' and keys' magnitudes, lies far enough below the row's running max that the kernel's exp
gives exactly 0: the result is the unskipped kernel's, bit for bit (``BOUNDED_SKIP`` off), on random inputs,
scores near the float16 limits, rows that see one key and rows that see none, and within test_decode_fp16's
tolerance of eager.  Before the change no kernel held the check (``kbm_``, the per-call key bounds)."""
from __future__ import annotations

import pytest
import torch

from bench.workloads import llama3

from vtc.codegen import flash
from vtc.codegen.cpp import generate

from .test_decode_fp16 import _assert_close, _repeat_kv
from .util import compile_cpu, gen, kernels, rand, torch_threads

H = torch.float16
MIN = torch.finfo(H).min


def _eager(ratio: int):
    """transformers' eager_attention_forward in float16: scores scaled, an additive float16 mask, the softmax in
    float32 cast back to float16."""
    def fn(q, k, v, mask):
        scores = torch.matmul(q, _repeat_kv(k, ratio).transpose(2, 3)) * q.shape[3] ** -0.5 + mask
        p = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        return torch.matmul(p, _repeat_kv(v, ratio))
    return fn


def _run_both(fn, args, monkeypatch):
    """fn compiled with and without the bounded skip: (with, without, the kernel source with)."""
    out, source = [], None
    for on in (True, False):
        monkeypatch.setattr(flash, "BOUNDED_SKIP", on)
        c = compile_cpu(fn, args)
        (att,) = kernels(c)
        assert att.tiled
        if on:
            source = generate(att)
        out.append(c(*args))
    return out[0], out[1], source


def _causal(s: int, t: int) -> torch.Tensor:
    return llama3.causal_mask(torch.arange(t - s, t), t, None, H)


def _holes(s: int, t: int, g, empty_row: bool) -> torch.Tensor:
    """finfo.min at random keys, over every row past key 128 (a block hidden from every row: skipped), over keys
    64.. but one for row 5 (the block is seen); `empty_row`: row 7 sees no key (eager's softmax over the masked
    scores; every block of its tile is then computed)."""
    mask = torch.where(torch.rand((s, t), generator=g) < 0.1, MIN, 0.0).to(H)
    mask[:, 128:] = MIN
    mask[5] = MIN
    mask[5, 70] = 0.0
    if empty_row:
        mask[7] = MIN
    return mask[None, None]


# (name, queries, keys, magnitude of q and k, mask)
CASES = [
    ("causal", 200, 200, 1.0, "causal"),
    ("causal_chunk", 70, 260, 3.0, "causal"),
    ("large_scores", 130, 130, 12.0, "causal"),  # dot products in the thousands, blocks still skipped
    ("huge_scores", 130, 130, 30.0, "causal"),  # near the float16 limit (or past it): the bound overflows, no skip
    ("holes", 64, 200, 1.0, "holes"),
    ("one_key_rows", 64, 200, 6.0, "holes"),
    ("empty_row", 64, 200, 1.0, "empty_row"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_float16_mask_skips_hidden_blocks_bit_for_bit(case, monkeypatch):
    name, s, t, mag, kind = case
    g = gen(800 + CASES.index(case))
    q, k, v = rand((1, 4, s, 64), g, H) * mag, rand((1, 2, t, 64), g, H) * mag, rand((1, 2, t, 64), g, H)
    mask = _causal(s, t) if kind == "causal" else _holes(s, t, g, kind == "empty_row")
    fn = _eager(2)
    with torch_threads(1):
        got, unskipped, source = _run_both(fn, (q, k, v, mask), monkeypatch)
        want = fn(q, k, v, mask)
    assert "kbm_" in source and "th_[q]" in source
    assert torch.equal(got, unskipped)
    if not want.isfinite().all():  # eager's float16 scores overflowed
        assert torch.equal(got.isnan(), want.isnan())
        return
    exact = fn(q.double(), k.double(), v.double(), mask.double())
    _assert_close(got, want, exact, v.abs().max().item())


def test_float32_mask_keeps_the_hidden_check_alone():
    """A float32 finfo.min mask lies below HIDDEN: no bounded check in its kernel."""
    g = gen(820)
    q, k, v = rand((1, 2, 70, 32), g), rand((1, 2, 70, 32), g), rand((1, 2, 70, 32), g)
    mask = llama3.causal_mask(torch.arange(70), 70, None, torch.float32)
    fn = _eager(1)
    c = compile_cpu(fn, (q, k, v, mask))
    (att,) = kernels(c)
    assert att.tiled and "kbm_" not in generate(att)
    torch.testing.assert_close(c(q, k, v, mask), fn(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_bounded_term_refuses_chains_it_cannot_bound():
    """The chain must be monotone in the dot product, read once (a square, a soft-cap's tanh, 2 / it, a cast to
    bool: no check)."""
    from vtc.codegen.kernel_ir import Scalar, const

    acc = Scalar.make("acc", ("score",), torch.float32)
    m = Scalar.make("load", ("mask", ()), H)

    def chain(x):
        return Scalar.make("cast", (Scalar.make("binary", ("add", Scalar.make("cast", (x,), H), m), H),), torch.float32)

    scaled = Scalar.make("binary", ("mul", acc, const(0.125, torch.float32)), torch.float32)
    assert flash.bounded_term(chain(scaled)) is Scalar.make("cast", (scaled,), H)
    assert flash.bounded_term(chain(Scalar.make("binary", ("mul", acc, acc), torch.float32))) is None
    assert flash.bounded_term(chain(Scalar.make("unary", ("tanh", acc), torch.float32))) is None
    inverse = Scalar.make("binary", ("div", const(2.0, torch.float32), acc), torch.float32)
    assert flash.bounded_term(chain(inverse)) is None
    as_bool = Scalar.make("cast", (Scalar.make("cast", (acc,), torch.bool),), torch.float32)
    assert flash.bounded_term(chain(as_bool)) is None
