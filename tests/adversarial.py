"""Helpers of the adversarial tests (tests/test_adversarial_*.py, session 17): random chains of movement ops
drawn by hypothesis, each op valid for the shape it receives, described as text for the failure message.

A chain is drawn through ``Draw``, which asks hypothesis for every choice (so a failing example shrinks to a
short chain on small sizes) and keeps the choices' description for ``note``."""
from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck
from hypothesis import strategies as st

import vtc

# few examples, the same every run (CI sees the chains a developer saw), no deadline: a kernel build takes seconds
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

SIZES = (1, 2, 3, 5, 8, 17)
F32_TOL = dict(rtol=1e-4, atol=1e-4)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)  # each op's result rounded to bf16: a few ulps after a reduction

Op = tuple[str, Callable[[torch.Tensor], torch.Tensor]]


class Draw:
    """random.Random's few methods, each choice drawn from hypothesis's `data`."""

    def __init__(self, data) -> None:
        self.data = data

    def choice(self, seq: Sequence):
        return self.data.draw(st.sampled_from(list(seq)))

    def randrange(self, a: int, b: int | None = None) -> int:
        lo, hi = (0, a) if b is None else (a, b)
        return self.data.draw(st.integers(lo, hi - 1))

    def sample(self, seq: Sequence, k: int) -> list:
        return self.data.draw(st.permutations(list(seq)))[:k]

    def permutation(self, n: int) -> list[int]:
        return self.data.draw(st.permutations(list(range(n))))


MOVES = ("transpose", "permute", "slice", "narrow", "flip", "roll", "pad", "cat", "index_select", "chunk",
         "expand", "merge", "split", "gather")


def draw_chain(r: Draw, shape: Sequence[int], n: int, keep_rank: bool = False,
               max_numel: int = 6000) -> tuple[list[Op], list[int]]:
    """n movement ops (fewer where a drawn op does not fit the shape it gets) and the chain's output shape."""
    ops: list[Op] = []
    shape = list(shape)
    probe = torch.empty(shape)
    kinds = [k for k in MOVES if not (keep_rank and k in ("merge", "split"))]
    for _ in range(n):
        rank, k = len(shape), r.choice(kinds)
        d = r.randrange(rank)
        if k == "transpose" and rank >= 2:
            a, b = r.sample(range(rank), 2)
            op = (f"transpose({a}, {b})", lambda t, a=a, b=b: t.transpose(a, b))
        elif k == "permute" and rank >= 2:
            p = r.permutation(rank)
            op = (f"permute{tuple(p)}", lambda t, p=p: t.permute(*p))
        elif k == "slice" and shape[d] >= 2:
            s0, step = r.randrange(2), r.choice([1, 2, 3])
            op = (f"[{':, ' * d}{s0}::{step}]", lambda t, d=d, s0=s0, step=step: t[(slice(None),) * d + (slice(s0, None, step),)])
        elif k == "narrow" and shape[d] >= 2:
            s0 = r.randrange(shape[d] - 1)
            ln = r.randrange(1, shape[d] - s0 + 1)
            op = (f"narrow({d}, {s0}, {ln})", lambda t, d=d, s0=s0, ln=ln: t.narrow(d, s0, ln))
        elif k == "flip":
            op = (f"flip({d})", lambda t, d=d: t.flip(d))
        elif k == "roll":
            s = r.randrange(-3, 4)
            op = (f"roll({s}, {d})", lambda t, d=d, s=s: t.roll(s, d))
        elif k == "pad":
            lo, hi, val = r.randrange(3), r.randrange(3), r.choice([0.0, 1.5])
            pads = [0, 0] * (rank - 1 - d) + [lo, hi]
            op = (f"pad({pads}, value={val})", lambda t, pads=pads, val=val: F.pad(t, pads, value=val))
        elif k == "cat":
            op = (f"cat([t, t.flip({d}) * 1.5], {d})", lambda t, d=d: torch.cat([t, t.flip(d) * 1.5], d))
        elif k == "index_select":
            idx = [r.randrange(shape[d]) for _ in range(r.randrange(1, 5))]
            it = torch.tensor(idx)
            op = (f"index_select({d}, {idx})", lambda t, d=d, it=it: t.index_select(d, it))
        elif k == "gather" and rank >= 1:
            g = torch.Generator().manual_seed(r.randrange(1000))
            m = r.randrange(1, 4)
            ishape = shape[:d] + [m] + shape[d + 1:]
            it = torch.randint(0, shape[d], ishape, generator=g)
            op = (f"gather({d}, randint(0, {shape[d]}, {ishape}))", lambda t, d=d, it=it: t.gather(d, it))
        elif k == "chunk" and shape[d] >= 2:
            c, j = r.choice([2, 3]), r.randrange(2)
            op = (f"chunk({c}, {d})[{j}]", lambda t, d=d, c=c, j=j: t.chunk(c, d)[min(j, len(t.chunk(c, d)) - 1)])
        elif k == "expand" and 1 in shape:
            dd, e = shape.index(1), r.choice([2, 3])
            op = (f"expand(dim {dd} -> {e})", lambda t, dd=dd, e=e: t.expand(*[e if i == dd else -1 for i in range(t.dim())]))
        elif k == "merge" and rank >= 2:
            a = r.randrange(rank - 1)
            ns = shape[:a] + [shape[a] * shape[a + 1]] + shape[a + 2:]
            op = (f"reshape({ns})", lambda t, ns=ns: t.reshape(ns))
        elif k == "split" and rank <= 4:
            divs = [q for q in range(2, shape[d]) if shape[d] % q == 0]
            if not divs:
                continue
            q = r.choice(divs)
            ns = shape[:d] + [q, shape[d] // q] + shape[d + 1:]
            op = (f"reshape({ns})", lambda t, ns=ns: t.reshape(ns))
        else:
            continue
        out = op[1](probe)
        if out.numel() == 0 or out.numel() > max_numel or out.dim() == 0:
            continue
        probe, shape = out, list(out.shape)
        ops.append(op)
    return ops, shape


def run_chain(ops: Sequence[Op], t: torch.Tensor) -> torch.Tensor:
    for _, f in ops:
        t = f(t)
    return t


def describe(ops: Sequence[Op]) -> str:
    return "x" + "".join(f".{d}" if not d.startswith("[") else d for d, _ in ops)


def rand(shape: Sequence[int], g: torch.Generator, dtype=torch.float32, noncontiguous: bool = False) -> torch.Tensor:
    """Values of magnitude in [0.25, 2) with a random sign (never zero); `noncontiguous`: a transposed layout."""
    shape = list(shape)
    base = shape[::-1] if noncontiguous else shape
    mag = torch.rand(base, generator=g) * 1.75 + 0.25
    sign = torch.where(torch.rand(base, generator=g) < 0.5, -1.0, 1.0)
    x = (mag * sign).to(dtype)
    return x.permute(*reversed(range(len(shape)))) if noncontiguous else x


def close(got, want, dtype, what: str = "") -> None:
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got, want, **tol, equal_nan=True, msg=lambda m: f"{what}\n{m}")


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close_outputs(got, want, tol: dict, what: str = "") -> None:
    """Each output (a tensor, or a tuple of them) equal to eager's in dtype and, within `tol`, in value."""
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype, f"{what} output {k}: dtype {a.dtype}, eager's {b.dtype}"
        torch.testing.assert_close(a, b, **tol, equal_nan=True, msg=lambda m, k=k: f"{what} output {k}\n{m}")


def check_outputs(fn, inputs, tol=F32_TOL, what="", torch_compile=False, **options):
    """vtc.compile(fn) on `inputs`, twice (the second call takes the fast call) against eager; torch.compile too."""
    want = fn(*inputs)
    compiled = vtc.compile(fn, inputs, **options)
    close_outputs(compiled(*inputs), want, tol, what)
    close_outputs(compiled(*inputs), want, tol, what + " (second call)")
    if torch_compile:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            close_outputs(torch.compile(fn, backend="vtc")(*inputs), want, tol, what + " (torch.compile)")
    return compiled
