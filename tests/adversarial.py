"""Helpers of the adversarial tests (tests/test_adversarial_*.py, session 17): random chains of movement ops
drawn by hypothesis, each op valid for the shape it receives, described as text for the failure message.

A chain is drawn through ``Draw``, which asks hypothesis for every choice (so a failing example shrinks to a
short chain on small sizes) and keeps the choices' description for ``note``."""
from __future__ import annotations

import argparse
import json
import math
import time
import traceback
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


INTO_KINDS = ("transpose", "permute", "narrow", "step", "cat", "index_select", "gather", "roll", "flip", "pad",
              "expand", "flatten", "unflatten", "shuffle", "pointwise")


def draw_chain_into(r, out: Sequence[int], depth: int, row: int | None = None, dynamic: bool = False,
                    max_numel: int = 1 << 21) -> tuple[list[int], list[Op], int | None]:
    """A chain drawn backwards from the shape a consumer wants (draw_chain draws forwards from an input's): (the
    input's shape, `depth` ops or fewer from it to a tensor of shape `out`, the input's dim that becomes `row`).
    `dynamic`: dim `row` of `out` varies between calls, so no op depends on its size.  `r`: a Draw (or a
    random.Random with a permutation method).  A narrow of the last dim may read rows 1024 / 2048 floats apart."""
    ops: list[Op] = []
    shape = list(out)
    for _ in range(depth):
        step = _front_op(r, shape, row, dynamic)
        if step is None:
            continue
        ins, op, row_in = step
        if 0 in ins or math.prod(ins) > max_numel or len(ins) > 5:
            continue
        ops.insert(0, op)
        shape, row = ins, row_in
    return shape, ops, row


def _short(xs: list) -> str:
    return str(xs) if len(xs) <= 8 else f"[{', '.join(map(str, xs[:8]))}, ... {len(xs)}]"


def _front_op(r, o: list[int], row: int | None, dynamic: bool):
    """One op whose output has shape o: (its input shape, (description, fn), the input's row dim) or None."""
    k, rank = r.choice(INTO_KINDS), len(o)
    free = [d for d in range(rank) if not (dynamic and d == row)]
    d = r.choice(free) if free else None
    i = list(o)
    if k == "transpose" and rank >= 2:
        a, b = r.sample(range(rank), 2)
        i[a], i[b] = o[b], o[a]
        return i, (f"transpose({a}, {b})", lambda t: t.transpose(a, b)), {a: b, b: a}.get(row, row)
    if k == "permute" and rank >= 2:
        p = r.permutation(rank)  # out dim j is input dim p[j]
        for j in range(rank):
            i[p[j]] = o[j]
        return i, (f"permute{tuple(p)}", lambda t: t.permute(*p)), None if row is None else p[row]
    if d is None:
        return None
    if k == "narrow":
        extra = r.choice([1, 2, 3, 7])
        if d == rank - 1 and o[d] < 2048 and r.choice([False, True]):
            extra = r.choice([w for w in (1024, 2048) if w > o[d]]) - o[d]  # rows 4 / 8 KB apart
        i[d] = o[d] + extra
        s0 = r.randrange(extra + 1)
        return i, (f"narrow({d}, {s0}, {o[d]})", lambda t: t.narrow(d, s0, o[d])), row
    if k == "step":
        s = r.choice([2, 3])
        i[d] = o[d] * s
        return i, (f"[{':, ' * d}::{s}]", lambda t: t[(slice(None),) * d + (slice(None, None, s),)]), row
    if k == "cat" and o[d] >= 2:
        a = r.randrange(1, o[d])
        b, scaled = o[d] - a, r.choice([False, True])
        i[d] = max(a, b) + 1
        n = i[d]

        def cat(t):
            second = t.narrow(d, n - b, b).flip(d)
            return torch.cat([t.narrow(d, 0, a), second * 1.5 if scaled else second], d)
        return i, (f"cat([narrow({d}, 0, {a}), narrow({d}, {n - b}, {b}).flip{' * 1.5' if scaled else ''}], {d})", cat), row
    if k == "index_select":
        i[d] = o[d] + r.randrange(4)
        idx = torch.tensor([r.randrange(i[d]) for _ in range(o[d])])
        return i, (f"index_select({d}, {_short(idx.tolist())})", lambda t: t.index_select(d, idx)), row
    if k == "gather" and not dynamic and math.prod(o) <= 1 << 16:
        i[d] = o[d] + r.randrange(3)
        idx = torch.randint(0, i[d], o, generator=torch.Generator().manual_seed(r.randrange(1 << 30)))
        return i, (f"gather({d}, randint(0, {i[d]}, {o}))", lambda t: t.gather(d, idx)), row
    if k == "roll":
        s = r.choice([-3, -1, 1, 2, 5])
        return i, (f"roll({s}, {d})", lambda t: t.roll(s, d)), row
    if k == "flip":
        return i, (f"flip({d})", lambda t: t.flip(d)), row
    if k == "pad" and (not dynamic or row != rank - 1) and o[-1] >= 3:
        lo, hi = r.randrange(3), r.randrange(3)
        lo, hi = (lo, hi) if lo + hi < o[-1] else (0, 1)
        val = r.choice([0.0, 1.5])
        i[-1] = o[-1] - lo - hi
        return i, (f"pad([{lo}, {hi}], value={val})", lambda t: F.pad(t, [lo, hi], value=val)), row
    if k == "expand" and o[d] > 1 and d != rank - 1:
        i[d] = 1
        return i, (f"expand(dim {d} -> {o[d]})", lambda t: t.expand(*[o[d] if j == d else -1 for j in range(rank)])), row
    if k == "flatten" and o[d] >= 4:
        divs = [q for q in range(2, o[d]) if o[d] % q == 0]
        if not divs:
            return None
        q = r.choice(divs)
        i[d:d + 1] = [q, o[d] // q]
        return i, (f"flatten({d}, {d + 1})", lambda t: t.flatten(d, d + 1)), row if row is None or row < d else row + 1
    if k == "unflatten" and d + 1 < rank and not (dynamic and row == d + 1):
        sizes = (o[d], o[d + 1])
        i[d:d + 2] = [o[d] * o[d + 1]]
        return i, (f"unflatten({d}, {sizes})", lambda t: t.unflatten(d, sizes)), row if row is None or row <= d else row - 1
    if k == "shuffle" and o[d] >= 4:
        gs = [g for g in (2, 3, 4) if o[d] % g == 0]
        if not gs:
            return None
        g = r.choice(gs)
        c = o[d] // g
        return i, (f"channel_shuffle({d}, {g})",
                   lambda t: t.unflatten(d, (g, c)).transpose(d, d + 1).flatten(d, d + 1)), row
    if k == "pointwise":
        f = r.choice(["relu", "affine", "sigmoid"])
        fn = {"relu": torch.relu, "affine": lambda t: t * 1.5 + 0.25, "sigmoid": torch.sigmoid}[f]
        return i, (f, fn), row
    return None


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


def run_described(case, run_case: Callable) -> None:
    """``run_case(case)`` for a CI sample of a fuzz campaign's drawn cases (tests/test_adversarial_fast_paths3.py,
    ..._4.py, ..._5.py): a wrong result's message led by ``case.describe()``, the model that gave it."""
    try:
        run_case(case)
    except AssertionError as e:
        raise AssertionError(f"{case.describe()}\n{e}") from None


def run_campaign(doc: str, kinds: Sequence[str], make_case: Callable, run_case: Callable, log: str,
                 notes: Callable = lambda case, done: case.paths, skipped: tuple = ()) -> int:
    """The command line of a fuzz campaign of drawn cases (tests/test_adversarial_fast_paths3.py, ..._4.py):
    ``--kind K --seed S --cases N [--start I]``, or ``--case I -v`` to run one again.  Each case is
    ``make_case(kind, seed, i)``, run by ``run_case``; its kind, seed, model, status (``ok`` and ``notes(case,
    done)``) and seconds are appended to ``--log`` as a JSON line.  Every exception but those of `skipped`
    (not vtc's: e.g. no exporter takes the model) is a finding.  Returns 1 when a case failed."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=kinds, default=kinds[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int, default=50)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--case", type=int)
    ap.add_argument("--log", default=log)
    ap.add_argument("-v", action="store_true")
    args = ap.parse_args()
    numbers = [args.case] if args.case is not None else range(args.start, args.start + args.cases)
    failed = 0
    for i in numbers:
        t0 = time.time()
        case = make_case(args.kind, args.seed, i)
        if args.v:
            print(case.describe(), flush=True)
        record = dict(kind=args.kind, seed=args.seed, case=i, model=case.describe())
        try:
            record["done"] = run_case(case)
            record["paths"] = case.paths
            status = "ok " + ",".join(map(str, notes(case, record["done"])))
        except skipped as e:
            status = f"skipped: {str(e)[:200]}"
        except Exception as e:  # noqa: BLE001 - every exception is a finding to look at
            failed += 1
            status = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            record["error"] = traceback.format_exc()
        record["status"], record["s"] = status, round(time.time() - t0, 1)
        with open(args.log, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"{args.kind}:{args.seed}:{i} {record['s']:6.1f}s {status}"
              f"{'' if status.startswith('ok') else '  ' + case.describe()}", flush=True)
    print(f"{len(numbers)} cases, {failed} failed")
    return 1 if failed else 0
