"""A differential fuzz campaign (session 27) over code no earlier campaign drew, and its CI sample.

Each case is drawn from its seed (``Case``), compiled by vtc and compared with torch eager (or onnxruntime):
- ``vector``: float16 models for vtc.codegen.low_vector (session 26: float16 pointwise loops, row kernels' store
  passes and sums as AVX-512 vector code): pointwise chains with a broadcast second operand (a float32 one at
  times), softmax / log_softmax, layer_norm, RMSNorm (in float16 or through float32), sums and means, on rows of 1,
  3, 15, 16, 17, 31, 33, 127, 513 or 1000 elements, behind a drawn chain of movement ops (transpose, strided
  slice, cat, expand, roll, narrow, ...; tests.adversarial.draw_chain_into) and a transposed input layout at
  times; the inputs with +-inf, NaN or values near float16's largest at times.  Compiled twice, the vector loops
  on and off (``low_vector.VECTOR_LOOPS``): equal bit for bit, as the module promises, and each within float16
  tolerances of eager (``close16``: a non-finite element of eager's must be the same in vtc's);
- ``linear``: Linear layers (vtc.codegen.gemm.choose's few-rows / packed pricing, MKL's packed weights,
  vtc.runtime.packed) on 1-300 rows, 2-D or 3-D inputs, bias or not, an activation and a second Linear at times,
  float32 mostly; the weights changed in place between calls (``mul_``, ``copy_``, a row block's ``zero_``, the
  bias's ``add_``, ``load_state_dict``), another row count (vtc.dynamic) and back, a change at each; then two threads
  call while a third negates the weight in place 3 times (``_flips_while_called``);
- ``threads``: ``torch.compile(backend="vtc", dynamic=True / None)`` or ``vtc.compile(dynamic=True)`` of a
  ``vector`` or ``linear`` model, called from 2-4 threads at once, each at its own new sizes (vtc.dynamic's backend
  runner, max_specializations 2 at times so that threads evict each other's sizes), then a parameter changed
  (in place or replaced) while the threads wait, then the threads again at old and new sizes;
- ``onnx16``: ``vector`` models in float16 (70%) or bfloat16 exported to ONNX with the rows dynamic, compiled by
  vtc from the ModelProto, called at 3-4 sizes one by one and then from 2-3 threads at once at other sizes, against
  onnxruntime (where its kernels run the file) or eager;
- ``dynvec``: ``vector`` models whose row length varies (1 ... 1000, one by one and back): ``vtc.compile(dynamic=True)``
  (or ``torch.compile(dynamic=True)`` at times), the size-generic kernels' vector loops (their bounds and partial
  sums fitted as polynomials of the sizes) bit for bit against the scalar ones and within tolerances of eager.
Inputs: tests.adversarial.rand (magnitudes in [0.25, 2), random signs, never zero), special values added after.
Tolerances: tests.test_adversarial_fast_paths4.close (float32 rtol 1e-4, atol 1e-4 of the largest |reference|;
float16 / bfloat16 2 ulps + 2^-(mantissa-1) of the largest |reference| per rounding step eager takes that vtc may
not); ``close16`` the same over eager's finite elements; where eager's float16 result is off, eager run in float32
on the same inputs, rounded (``_close_eager``: eager's float16 layer_norm over one element is not 0).

The campaign, by hand (not collected by pytest):
    VTC_CACHE_DIR=/tmp/vtc-cache-x nice -n 19 .venv/bin/python -m tests.test_adversarial_fast_paths6 \\
        --kind vector --seed 1 --cases 50          # --case 17 -v: one case again, its model printed
CI runs ``CI_CASES``: a few cases of seed 0 of each kind."""
from __future__ import annotations

import contextlib
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import vtc
import vtc.compiler
from tests.adversarial import draw_chain_into, rand, run_campaign, run_chain, run_described
from tests.codegen.util import kernels, torch_threads
from tests.fuzz_campaign import ExportSkipped, Rand
from tests.test_adversarial_fast_paths4 import MANTISSA, ULPS, B, H, _paths, _text, _ulp, close
from tests.test_adversarial_fast_paths5 import _ONNX_DTYPES, _in_threads, _ort_run, _ort_session
from vtc.codegen import low_vector
from vtc.codegen.cpp import generate

KINDS = ("vector", "linear", "threads", "onnx16", "dynvec")
LAST = (1, 3, 15, 16, 17, 31, 33, 127, 513, 1000)
ROWS = (1, 2, 3, 5, 8, 17)
LIN_ROWS = (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 200, 256, 300)
LIN_DIMS = (1, 3, 16, 17, 31, 64, 100, 127, 256, 300, 512)
VEC_OPS = {
    "add": lambda x, y: x + y, "mul": lambda x, y: x * y, "sub_scalar": lambda x, y: x * 0.75 - 1.25,
    "div": lambda x, y: x / (y.abs() + 0.25), "neg": lambda x, y: -x, "abs": lambda x, y: x.abs(),
    "relu": lambda x, y: torch.relu(x), "exp": lambda x, y: torch.exp(x), "tanh": lambda x, y: torch.tanh(x),
    "sigmoid": lambda x, y: torch.sigmoid(x), "silu": lambda x, y: F.silu(x), "gelu": lambda x, y: F.gelu(x),
    "rsqrt": lambda x, y: torch.rsqrt(x.abs() + 0.5), "max": lambda x, y: torch.maximum(x, y),
    "min": lambda x, y: torch.minimum(x, y * 2.0), "clamp": lambda x, y: x.clamp(-1.0, 1.5),
    "square": lambda x, y: x * x, "float": lambda x, y: (x.float() * 1.5).to(x.dtype), "sqrt": lambda x, y: x.abs().sqrt(),
    "floor": lambda x, y: torch.floor(x * 4.0), "hardswish": lambda x, y: F.hardswish(x),
}
NORMS = ("softmax", "log_softmax", "layer_norm", "rms16", "rms32", "sum", "mean", "var", "pair", "outs")
SPECIALS = ("none", "none", "none", "inf", "nan", "large", "mixed")


# -- the models -------------------------------------------------------------------------------------------------
class VecNet(torch.nn.Module):
    """x -> front (movement ops) -> body (a pointwise chain with y, or a row op over the last dim)."""

    def __init__(self, body: str, front: list, last: int, ops: list[str] | None = None, f32: bool = False) -> None:
        super().__init__()
        self.body, self.front, self.ops, self.f32 = body, front, ops or [], f32
        self.affine = last > 1  # (last 1: the row length varies, vtc.compile(dynamic=True); w and b broadcast)
        self.w = torch.nn.Parameter(torch.rand(last) + 0.5)
        self.b = torch.nn.Parameter(torch.rand(last) - 0.5)

    def forward(self, x, *rest):
        x = run_chain(self.front, x)
        body = self.body
        if body == "pointwise":
            y = rest[0]
            for op in self.ops:
                x = VEC_OPS[op](x, y)
            return x + y.float() if self.f32 else x  # a float32 operand: the result float32
        w, b = self.w.to(x.dtype), self.b.to(x.dtype)
        if body == "softmax":
            return torch.softmax(x * 2.0, -1)
        if body == "log_softmax":
            return torch.log_softmax(x, -1)
        if body == "layer_norm":
            return F.layer_norm(x, [x.shape[-1]], w if self.affine else None, b if self.affine else None, 1e-5)
        if body == "rms16":
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
        if body == "rms32":  # transformers' LlamaRMSNorm
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return w * h.to(x.dtype)
        if body == "sum":
            return x.sum(-1, keepdim=True) * 0.125 + x * w
        if body == "mean":
            return x.mean(-1) * 2.0 - 1.0
        if body == "pair":  # two results of one row: a row kernel with two store passes
            return torch.softmax(x, -1), torch.log_softmax(x, -1) * w
        if body == "outs":  # a float16 and a float32 result of the same values
            y = torch.sigmoid(x) * w + b
            return y, y.float() * 3.0 - x.float()
        return x.var(-1, keepdim=True, unbiased=False) + b  # var


class LinNet(torch.nn.Module):
    """Linear(k, n) [activation] [Linear(n, n2), or `tied`: the first's weight transposed, back to k] on x [rows, k]
    or [b, rows, k]."""

    def __init__(self, k: int, n: int, bias: bool, act: str, n2: int | None, bias2: bool, tied: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(k, n, bias=bias)
        self.act, self.tied = act, tied
        self.lin2 = torch.nn.Linear(n, n2, bias=bias2) if n2 else None

    def forward(self, x):
        y = self.lin(x)
        y = {"none": lambda t: t, "relu": torch.relu, "gelu": F.gelu, "silu": F.silu}[self.act](y)
        if self.tied:  # (a tied decoder: the weight read through a transpose, folded or packed once)
            return F.linear(y, self.lin.weight.t())
        return self.lin2(y) if self.lin2 is not None else y


# -- the cases --------------------------------------------------------------------------------------------------
class Case:
    """One drawn case: model, input shapes (row_dims: the dim of each that varies), dtype, what to call, description."""

    def __init__(self, kind: str, seed: int, case: int) -> None:
        self.kind, self.seed = kind, (seed << 20) + case + 7919 * KINDS.index(kind)
        r = self.r = Rand(self.seed)
        torch.manual_seed(r.randrange(1 << 30))
        self.threads = r.choice([1, 2])
        self.gemm = r.choice(["auto", "auto", "vtc"])
        self.plan = r.choice(["greedy", "greedy", "all"])
        self.ops, self.special, self.noncontiguous = 1, "none", False
        self.rows, self.other_rows, self.dynamic = 1, [], False
        self.paths: list[str] = []
        getattr(self, "_make_" + kind)(r)
        self.model.eval().to(self.dtype)
        for p in self.model.parameters():
            p.requires_grad_(False)

    def _vector_model(self, r: Rand, dynamic: bool) -> None:
        """A VecNet on x [b, rows, last] (rows: dim 1 of the body's input, varying when `dynamic`)."""
        body = r.choice(["pointwise", "pointwise", *NORMS])
        last = r.choice(LAST)
        b, self.rows = r.choice([1, 2, 3]), r.choice(ROWS)
        ops, f32 = None, False
        want = [b, self.rows, last]
        if body == "pointwise":
            ops = [r.choice(list(VEC_OPS)) for _ in range(r.randrange(1, 6))]
            f32 = self.dtype == H and r.random() < 0.25
            self.ops = len(ops) + (2 if "float" in ops else 0)
        else:
            self.ops = 6 if body in ("var", "rms16", "layer_norm") else 4
        depth = r.choice([0, 0, 1, 2, 3])
        shape, front, row = draw_chain_into(r, want, depth, row=1, dynamic=dynamic, max_numel=1 << 18)
        self.model = VecNet(body, front, last, ops, f32)
        self.shapes, self.row_dims = [shape], [row if dynamic else None]  # (a static chain may merge the rows)
        if body == "pointwise":
            second, second_row = r.choice([(want, 1), ([1, 1, last], None), ([b, self.rows, 1], 1), ([self.rows, last], 0),
                                           ([last], None)])
            self.shapes.append(second)
            self.row_dims.append(second_row if dynamic else None)
        self.special = r.choice(SPECIALS)
        self.noncontiguous = r.random() < 0.2
        self.notes = (f"{body}{' ' + str(ops) if ops else ''}{' + float32 y' if f32 else ''}, rows of {last}; inputs "
                      f"{self.shapes} (row dims {self.row_dims}){' transposed layout' if self.noncontiguous else ''}, "
                      f"special {self.special}: x{_text(front)}")

    def _make_vector(self, r: Rand) -> None:
        self.dtype = H
        self._vector_model(r, dynamic=False)
        self.notes += f", plan {self.plan}"

    def _linear_model(self, r: Rand) -> None:
        self.dtype = r.choice([torch.float32] * 4 + [H, B])
        k, n = r.choice(LIN_DIMS), r.choice(LIN_DIMS)
        bias, act = r.random() < 0.6, r.choice(["none", "none", "relu", "gelu", "silu"])
        n2 = r.choice(LIN_DIMS) if r.random() < 0.3 else None
        tied = n2 is None and r.random() < 0.2
        self.model = LinNet(k, n, bias, act, n2, r.random() < 0.5, tied)
        self.rows = r.choice(LIN_ROWS)
        three = r.random() < 0.4
        self.shapes, self.row_dims = ([[r.choice([1, 2, 3]), self.rows, k]], [1]) if three else ([[self.rows, k]], [0])
        self.ops = 2 if self.dtype == torch.float32 else 3 + (act != "none") + 2 * (n2 is not None or tied)
        second = f", Linear({n}, {n2})" if n2 else ", the weight tied back" if tied else ""
        self.notes = f"Linear({k}, {n}, bias {bias}), {act}{second} on {self.shapes}"

    def _make_linear(self, r: Rand) -> None:
        self._linear_model(r)
        self.changes = [r.choice(["mul_", "copy_", "zero_rows", "bias_add_", "load_state_dict"])
                        for _ in range(r.randrange(2, 5))]
        self.other_rows = [m for m in [r.choice(LIN_ROWS)] if m != self.rows]
        self.notes += f", then {self.changes}, rows {self.other_rows} and back"

    def _make_threads(self, r: Rand) -> None:
        self.dtype = H
        if r.random() < 0.5:
            self.dtype = r.choice([H, H, B])
            self._vector_model(r, dynamic=True)
            self.notes, self.special = self.notes.replace(f"special {self.special}", "no specials"), "none"
        else:
            self._linear_model(r)
        self.compiler = r.choice(["torch.compile", "torch.compile", "vtc.compile"])
        self.torch_dynamic = r.choice([True, True, None])
        self.max_specs = r.choice([2, 8])
        self.n_threads = r.choice([2, 3, 4])
        self.grad_threads = r.random() < 0.2
        pool = [m for m in (ROWS if isinstance(self.model, VecNet) else LIN_ROWS) if m not in (self.rows, 1)]
        r.shuffle(pool)
        self.other_rows = pool[:6]
        self.change = r.choice(["mul_", "copy_", "data", "setattr"])
        self.notes += (f"; {self.compiler}{f'(dynamic={self.torch_dynamic})' if self.compiler == 'torch.compile' else ''}, "
                       f"max_specializations {self.max_specs}, {self.n_threads} threads{' in grad mode' if self.grad_threads else ''}"
                       f" at {self.other_rows}, then a parameter's {self.change}")

    def _make_dynvec(self, r: Rand) -> None:
        """A VecNet whose row length (the last dim) varies: vtc.compile(dynamic=True), size-generic kernels."""
        self.dtype = H
        body = r.choice(["pointwise", "pointwise", *NORMS])
        lengths = list(LAST)
        r.shuffle(lengths)
        self.rows, self.other_rows = lengths[0], lengths[1:r.choice([4, 5, 6])]
        b, m = r.choice([1, 2, 3]), r.choice(ROWS)
        want = [b, m, self.rows]
        ops = None
        if body == "pointwise":
            ops = [r.choice(list(VEC_OPS)) for _ in range(r.randrange(1, 6))]
            self.ops = len(ops) + (2 if "float" in ops else 0)
        else:
            self.ops = 6 if body in ("var", "rms16", "layer_norm") else 4
        shape, front, row = draw_chain_into(r, want, r.choice([0, 0, 1, 2]), row=2, dynamic=True, max_numel=1 << 18)
        self.model = VecNet(body, front, 1, ops)
        self.shapes, self.row_dims = [shape], [row]
        if body == "pointwise":
            second, second_row = r.choice([(want, 2), ([self.rows], 0), ([b, m, 1], None), ([1, 1, 1], None)])
            self.shapes.append(second)
            self.row_dims.append(second_row)
        self.special = r.choice(SPECIALS)
        self.torch_compile = r.random() < 0.3
        self.notes = (f"{body}{' ' + str(ops) if ops else ''}, rows of {self.rows} then {self.other_rows}; inputs "
                      f"{self.shapes} (dims {self.row_dims} vary), special {self.special}: x{_text(front)}"
                      f"{', torch.compile(dynamic=True)' if self.torch_compile else ''}")

    def _make_onnx16(self, r: Rand) -> None:
        self.dtype = H if r.random() < 0.7 else B
        self.dynamic = True
        self._vector_model(r, dynamic=True)
        self.notes, self.special = self.notes.replace(f"special {self.special}", "no specials"), "none"
        sizes = [m for m in ROWS + (4, 33) if m != self.rows]
        r.shuffle(sizes)
        self.other_rows = sizes[:r.choice([2, 3])]
        self.thread_rows = sizes[3:3 + r.choice([2, 3])]
        self.notes += f"; sizes {self.other_rows}, then threads at {self.thread_rows}"

    def inputs(self, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for j, (shape, row) in enumerate(zip(self.shapes, self.row_dims)):
            shape = list(shape)
            if row is not None:
                shape[row] = rows
            t = rand(shape, g, self.dtype, noncontiguous=self.noncontiguous and j == 0 and len(shape) >= 2)
            out.append(with_specials(t, g, self.special))
        return tuple(out)

    def describe(self) -> str:
        return f"{self.kind} {str(self.dtype)[6:]}: {self.notes}; gemm {self.gemm}, threads {self.threads}"


def with_specials(t: torch.Tensor, g: torch.Generator, special: str) -> torch.Tensor:
    """t (its layout kept) with about 2% of its elements made +-inf / NaN / half the dtype's largest (``special``;
    "mixed": all three), or t itself ("none")."""
    if special == "none" or t.numel() == 0:
        return t
    out = t.clone()  # (the same strides: a transposed layout stays one)
    count = max(1, t.numel() // 50)
    at = tuple(torch.randint(0, size, (count,), generator=g) for size in t.shape)
    big = torch.finfo(t.dtype).max / 2
    pick = {"inf": [float("inf"), float("-inf")], "nan": [float("nan")], "large": [big, -big],
            "mixed": [float("inf"), float("-inf"), float("nan"), big, -big]}[special]
    out[at] = torch.tensor([pick[j % len(pick)] for j in range(count)], dtype=t.dtype)
    return out


def close16(got, want, what: str, ops: int, dtype: torch.dtype = H) -> None:
    """``close`` over eager's finite elements, every non-finite one the same in vtc's (inf of its sign, or NaN); the
    tolerance of `dtype` (a float32 result of float16 ops: float16's)."""
    got, want = [list(v) if isinstance(v, (tuple, list)) else [v] for v in (got, want)]
    assert len(got) == len(want), f"{what}: {len(got)} outputs, reference {len(want)}"
    for j, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what} output {j}: {a.shape} {a.dtype}, reference {b.shape} {b.dtype}"
        fin = torch.isfinite(b)
        same = (a == b) | (a.isnan() & b.isnan())
        bad = ~fin & ~same
        assert not bool(bad.any()), (f"{what} output {j}: {int(bad.sum())} of {b.numel()} non-finite reference elements "
                                     f"differ: got {a[bad][:6].tolist()}, eager {b[bad][:6].tolist()}")
        if bool(fin.all()):
            close(a, b, f"{what} output {j}", ops, dtype)
            continue
        a, b = a[fin], b[fin]
        if b.numel() == 0:
            continue
        scale = float(b.double().abs().max())
        low = dtype
        if low in MANTISSA:
            diff = (a.double() - b.double()).abs()
            tol = ULPS * ops * _ulp(b, low) + 2.0 ** -(MANTISSA[low] - 1) * ops * scale
            worse = ~((diff <= tol) | (a == b))
            assert not bool(worse.any()), (f"{what} output {j}: {int(worse.sum())} of {b.numel()} finite elements past "
                                           f"the tolerance, worst by {(diff - tol)[worse].max().item()} (largest "
                                           f"|reference| {scale}); got {a[worse][:4].tolist()}, eager {b[worse][:4].tolist()}")
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * max(1.0, scale), equal_nan=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) \
        if t.is_floating_point() else t


def same_bits(a, b, what: str) -> None:
    """a and b equal bit for bit, but that any NaN equals any NaN (its sign and payload are not kept: a sum's
    NaN from inf + -inf is -NaN in the scalar loop, +NaN in the vector one and in eager, the order of an add's
    operands, which gcc may swap, deciding it)."""
    a, b = [list(v) if isinstance(v, (tuple, list)) else [v] for v in (a, b)]
    for j, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what} output {j}: {x.dtype} {x.shape} vs {y.dtype} {y.shape}"
        differ = (_bits(x) != _bits(y)) & ~(x.isnan() & y.isnan())
        if bool(differ.any()):
            at = differ.nonzero()[:4].tolist()
            raise AssertionError(f"{what} output {j}: {int(differ.sum())} of {x.numel()} elements differ in their bits, "
                                 f"at {at}: vector {[x[tuple(i)].item() for i in at]}, scalar {[y[tuple(i)].item() for i in at]}")


def _vector_kernels(compiled) -> tuple[int, int]:
    """(kernels with a vector loop, kernels) of a compiled model."""
    srcs = [generate(k) for k in kernels(compiled)]
    return sum(f"#if defined({low_vector.TARGET})" in s for s in srcs), len(srcs)


# -- running a case ---------------------------------------------------------------------------------------------
def run_case(case: Case) -> list[str]:
    """The case's calls, each against the reference; the steps done (raises at the first wrong one)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch_threads(case.threads))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        return {"vector": _run_vector, "linear": _run_linear, "threads": _run_threads, "onnx16": _run_onnx16,
                "dynvec": _run_dynvec}[case.kind](case)


def _run_vector(case: Case) -> list[str]:
    """Compiled with the vector loops off, then on: bit for bit the same; each against eager."""
    m, x = case.model, case.inputs(case.rows, 1)
    x2 = case.inputs(case.rows, 2)
    want, want2 = m(*x), m(*x2)
    low_vector.VECTOR_LOOPS = False
    try:
        scalar = vtc.compile(m, x, plan=case.plan, gemm=case.gemm)
        s1, s2 = scalar(*x), scalar(*x2)
    finally:
        low_vector.VECTOR_LOOPS = True
    compiled = vtc.compile(m, x, plan=case.plan, gemm=case.gemm)
    v1, v2 = compiled(*x), compiled(*x2)
    same_bits(v1, s1, "first inputs: the vector loops against the scalar ones")
    same_bits(v2, s2, "second inputs: the vector loops against the scalar ones")
    note = _close_eager(case, v1, want, x, "first inputs") + _close_eager(case, v2, want2, x2, "second inputs")
    same_bits(compiled(*x), v1, "the call again")
    vec, total = _vector_kernels(compiled)
    case.paths = [f"vector {vec}/{total}"] + _paths(compiled)
    return ["bits", "eager"] + note


def _close_eager(case: Case, got, want, x: tuple, what: str) -> list[str]:
    """close16 against eager's result `want`, or (where that fails) against eager run in float32 on the same
    inputs and rounded to float16: eager's float16 kernels may lose what float32 keeps (a layer_norm over one
    element, 32752 in one row: eager 0.355 where the exact answer is 0); a note then."""
    try:
        close16(got, want, what, case.ops, case.dtype)
        return []
    except AssertionError as e:
        first = str(e)
    import copy

    m32 = copy.deepcopy(case.model).float()
    ref = m32(*[t.float() if t.dtype == case.dtype else t for t in x])
    ref = [r.to(w.dtype) for r, w in zip(ref if isinstance(ref, (tuple, list)) else [ref],
                                         want if isinstance(want, (tuple, list)) else [want])]
    try:
        close16(got, ref, what + " (against eager in float32)", case.ops, case.dtype)
    except AssertionError as e:
        raise AssertionError(f"{first}\n{e}") from None
    return [f"{what}: eager's float16 off"]


def _run_dynvec(case: Case) -> list[str]:
    """Row lengths one by one and back, compiled with dynamic sizes twice (the vector loops off, then on): each
    call bit for bit the same both ways and within float16 tolerances of eager."""
    m = case.model
    lengths = [case.rows, *case.other_rows, case.rows]
    xs = [case.inputs(n, 10 + j) for j, n in enumerate(lengths)]

    def make():
        if case.torch_compile:
            return torch.compile(m, backend="vtc", dynamic=True)
        return vtc.compile(m, xs[0], dynamic=True, gemm=case.gemm)

    torch._dynamo.reset()
    low_vector.VECTOR_LOOPS = False
    try:  # (a kernel is generated at a size's first call: the switch stays off for every scalar call)
        scalar = make()
        s_out = [scalar(*x) for x in xs]
    finally:
        low_vector.VECTOR_LOOPS = True
    torch._dynamo.reset()
    compiled = make()
    notes: list[str] = []
    for j, (n, x) in enumerate(zip(lengths, xs)):
        got = compiled(*x)
        same_bits(got, s_out[j], f"length {n} (call {j}): the vector loops against the scalar ones")
        notes += _close_eager(case, got, m(*x), x, f"length {n} (call {j})")
    torch._dynamo.reset()
    if not case.torch_compile:
        dyn = compiled._dynamic
        case.paths = [f"kernels {dict(dyn.kernels)}" if dyn else "no symbolic capture"]
    return [f"{len(lengths)} lengths"] + notes


def _change(how: str, model: torch.nn.Module, g: torch.Generator) -> None:
    """One in-place change of model's first Linear (``load_state_dict``: new values for every tensor)."""
    lin = model.lin
    w = lin.weight
    if how == "mul_":
        w.mul_(-2.0)
    elif how == "copy_":
        w.copy_(rand(w.shape, g, w.dtype) * 0.5)
    elif how == "zero_rows":
        w[: max(1, w.shape[0] // 2)].zero_()  # a write through a view: the base's version moves
    elif how == "bias_add_":
        (lin.bias if lin.bias is not None else w).add_(1.0)
    else:
        model.load_state_dict({k: rand(v.shape, g, v.dtype) * 0.5 for k, v in model.state_dict().items()})


def _run_linear(case: Case) -> list[str]:
    m, x = case.model, case.inputs(case.rows, 1)
    compiled = vtc.compile(m, x, gemm=case.gemm)
    close(compiled(*x), m(*x), "first call", case.ops)
    close(compiled(*x), m(*x), "the call again", case.ops)
    x2 = case.inputs(case.rows, 2)
    close(compiled(*x2), m(*x2), "new values", case.ops)
    case.paths = _paths(compiled)
    g = torch.Generator().manual_seed(case.seed)
    done = ["calls"]
    for j, how in enumerate(case.changes):
        _change(how, m, g)
        close(compiled(*x), m(*x), f"after change {j} ({how})", case.ops)
        if case.other_rows and j == 0:  # another row count, a change there, and back
            y = case.inputs(case.other_rows[0], 3)
            close(compiled(*y), m(*y), f"{case.other_rows[0]} rows", case.ops)
            _change("mul_", m, g)
            close(compiled(*y), m(*y), f"{case.other_rows[0]} rows after mul_", case.ops)
            close(compiled(*x), m(*x), f"back at {case.rows} rows", case.ops)
            done.append("rows")
    done.append(f"{len(case.changes)} changes")
    done.append(_flips_while_called(case, compiled, x))
    return done


def _flips_while_called(case: Case, compiled, x: tuple, flips: int = 3) -> str:
    """Two threads call while a third negates the first Linear's weight in place `flips` times (each once both
    callers have made 2 more calls): a call that ran wholly between two flips gives eager's result on the weight
    of then (it alternates), one that overlapped a flip finite values where eager's are; after the flips, the
    last weight's, twice."""
    import time

    m = case.model
    states = [m(*x)]
    m.lin.weight.neg_()
    states.append(m(*x))
    m.lin.weight.neg_()
    spans: list[tuple[float, float]] = []
    calls: list[list[tuple[float, float, torch.Tensor]]] = [[], []]
    stop = threading.Event()

    def made(n: int) -> None:
        first, limit = [len(c) for c in calls], time.time() + 60
        while any(len(c) < f + n for c, f in zip(calls, first)) and time.time() < limit:
            time.sleep(0.0002)

    def work(k: int) -> None:
        if k == 2:
            try:
                for _ in range(flips):
                    made(2)
                    t0 = time.perf_counter()
                    m.lin.weight.neg_()
                    spans.append((t0, time.perf_counter()))
                made(2)
            finally:
                stop.set()
            return
        while not stop.is_set():
            t0 = time.perf_counter()
            out = compiled(*x)
            calls[k].append((t0, time.perf_counter(), out))

    _in_threads(3, work)
    checked = 0
    for k in range(2):
        for t0, t1, out in calls[k]:
            before = sum(end <= t0 for _, end in spans)
            if any(start < t1 and end > t0 for start, end in spans):
                assert bool(torch.isfinite(out).eq(torch.isfinite(states[0])).all()), f"thread {k}: not finite"
                continue
            close(out, states[before % 2], f"thread {k}'s call after {before} flips", case.ops)
            checked += 1
    for j in range(2):
        close(compiled(*x), states[flips % 2], f"after the {flips} flips (call {j})", case.ops)
    return f"flips: {checked} of {sum(map(len, calls))} calls checked"


def _run_threads(case: Case) -> list[str]:
    """Threads at new sizes at once, a parameter changed while they wait, the threads again."""
    m = case.model
    sizes = [case.rows, *case.other_rows]
    xs = {(n, k): case.inputs(n, 100 * n + k) for n in sizes for k in range(case.n_threads)}
    params = [name for name, p in m.named_parameters() if p.dim() >= 1]
    name = params[case.r.randrange(len(params))]
    g = torch.Generator().manual_seed(case.seed)
    new = rand(m.get_parameter(name).shape, g, case.dtype) * 0.5
    before = {key: m(*x) for key, x in xs.items()}
    old = m.get_parameter(name).detach().clone()
    _apply_change(case.change, m, name, new)
    after = {key: m(*x) for key, x in xs.items()}
    _apply_change("copy_", m, name, old)  # (back to the first values; `case.change` again later)
    saved = vtc.compiler.OPTIONS["max_specializations"]
    vtc.compiler.OPTIONS["max_specializations"] = case.max_specs
    try:
        if case.compiler == "torch.compile":
            torch._dynamo.reset()
            compiled = torch.compile(m, backend="vtc", dynamic=case.torch_dynamic)
        else:
            compiled = vtc.compile(m, case.inputs(case.rows, 0), dynamic=True, gemm=case.gemm,
                                   max_specializations=case.max_specs)
        want = before

        def call(n: int, k: int, what: str, grad: bool = False) -> None:
            with contextlib.nullcontext() if grad else torch.no_grad():
                got = compiled(*xs[(n, k)])
            close(got, want[(n, k)], f"{what}, {n} rows", case.ops, case.dtype)

        call(case.rows, 0, "the first call")
        rounds = [case.other_rows[j::case.n_threads] or [case.rows] for j in range(case.n_threads)]
        _in_threads(case.n_threads, lambda k: [call(n, k, f"thread {k}", case.grad_threads) for n in rounds[k]])
        _in_threads(case.n_threads, lambda k: [call(n, k, f"thread {k} again", case.grad_threads)
                                               for n in rounds[(k + 1) % case.n_threads] + [case.rows]])
        _apply_change(case.change, m, name, new)
        want = after
        _in_threads(case.n_threads, lambda k: [call(n, k, f"thread {k} after the {case.change}")
                                               for n in [case.rows, *rounds[k], *rounds[(k + 2) % case.n_threads]]])
        for n in sizes:
            call(n, 0, "one by one after the threads")
        if case.compiler == "vtc.compile":
            case.paths = _paths(compiled)
    finally:
        vtc.compiler.OPTIONS["max_specializations"] = saved
        if case.compiler == "torch.compile":
            torch._dynamo.reset()
    return ["threads", "change"]


def _apply_change(how: str, m: torch.nn.Module, name: str, new: torch.Tensor) -> None:
    p = m.get_parameter(name)
    owner, leaf = m.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
    if how == "mul_":
        p.mul_(-2.0)
    elif how == "copy_":
        p.copy_(new)
    elif how == "data":
        p.data = new.clone()
    else:  # setattr
        setattr(owner, leaf, torch.nn.Parameter(new.clone(), requires_grad=False))


def _run_onnx16(case: Case) -> list[str]:
    """Exported with the rows dynamic; sizes one by one, then threads at other sizes at once; each call against
    onnxruntime (where it runs the file) or eager."""
    from tests.fuzz_campaign import export_onnx

    m, x = case.model, case.inputs(case.rows, 1)
    proto, exporter = export_onnx(case, x)
    sess, why_no_ort = _ort_session(proto)
    inits = {t.name for t in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in inits]
    used = [j for j in range(len(x)) if f"x{j}" in names]
    compiled = vtc.compile(proto, [x[j] for j in used], gemm=case.gemm)
    lock = threading.Lock()  # (onnxruntime's session and the notes: one thread at a time)
    done: list[str] = []

    def check(n: int, seed: int, what: str) -> None:
        xs = case.inputs(n, seed)
        ref = None
        if sess is not None:
            with lock:
                try:
                    ref = _ort_run(sess, {f"x{j}": xs[j] for j in used})
                except Exception as e:  # noqa: BLE001 - the file does not run at this size (or kernels lack)
                    ref = e
        try:
            got = compiled([xs[j] for j in used])
        except Exception:
            if isinstance(ref, Exception):
                with lock:
                    done.append(f"{n}: runs in neither")
                return
            raise
        for g, declared in zip(got, proto.graph.output):
            assert g.dtype == _ONNX_DTYPES[declared.type.tensor_type.elem_type], f"{what}: {g.dtype}, the file says {declared}"
        if isinstance(ref, list):
            try:
                close(got, ref, what + " (vs onnxruntime)", 2 * case.ops, case.dtype)
                with lock:
                    done.append(f"{n} ort")
                return
            except AssertionError:
                pass
        want = m(*xs)
        want = list(want) if isinstance(want, (tuple, list)) else [want]
        off = _close_eager(case, [g.to(w.dtype) for g, w in zip(got, want)], want, xs, what + " (vs eager)")
        with lock:
            done.append(f"{n} eager" + (" (eager's float16 off)" if off else ""))

    for step, n in enumerate([case.rows, *case.other_rows, case.rows]):
        check(n, 2 + step, f"size {n} (call {step})")
    rows = case.thread_rows or case.other_rows
    _in_threads(len(rows), lambda k: check(rows[k], 50 + k, f"thread {k} at size {rows[k]}"))
    case.paths = [exporter] + ([f"no ort: {why_no_ort[:40]}"] if sess is None else []) + _paths(compiled)
    return done


# -- CI: a few cases of each kind, the same every run ------------------------------------------------------------
# (kind, case) of seed 0, picked among the first few for their time (cold kernel cache, load 12, one process: 66 s
# in all, the first case's 17 s with the process's first builds)
CI_CASES = [("vector", 0), ("vector", 1), ("vector", 2), ("vector", 3), ("linear", 0), ("threads", 1), ("threads", 2),
            ("onnx16", 3), ("dynvec", 1)]


@pytest.mark.parametrize("kind,case", CI_CASES)
def test_drawn_case(kind, case):
    run_described(Case(kind, 0, case), run_case)


# -- the campaign ---------------------------------------------------------------------------------------------
def main() -> int:
    return run_campaign(__doc__, KINDS, Case, run_case, "/tmp/vtc-fuzz6.jsonl", skipped=(ExportSkipped,),
                        notes=lambda case, done: case.paths + done)


if __name__ == "__main__":
    sys.exit(main())
