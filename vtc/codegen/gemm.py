"""GEMM kernels: float32 (and float16) mm / bmm / addmm / baddbmm whose operands are read through their mappings.

On a CPU a fast GEMM copies its operands anyway: into small *packed panels*
that stay in cache (Goto's algorithm).  Contiguity is needed only there, so
the pack loops read A and B through their composed mappings (``value_at``:
virtual tensors, inlined pointwise producers) and a transpose, expand (GQA:
query head h reads KV head h // group), cat, slice, pad or gather in front of
a GEMM moves no data through main memory.

The kernel (``kind="gemm"`` in the kernel IR) runs the BLIS loops.  The
output is cut into blocks (batch x NC-column chunk x MC-row block) and each
thread takes a contiguous range of them, as many as the others (the larger of
M and N is split into a multiple of the thread count; no synchronisation).
Per chunk and KC-deep slice of the reduction a thread packs the KC x NC block
of B into NR-column panels once, for all its row blocks (a plain strided B
panel by panel in the first row strip, the next panel's source prefetched
while the strip's tile computes: ``LAZY_B``); per row block it
packs the MC x KC block of A into MR-row panels (row-major A by 16 x 16
register transposes), then a register-blocked micro-kernel (MR x NR
accumulators in vector registers, broadcast-FMA; AVX-512 12 x 32, AVX2 6 x 16
or scalar 4 x 8, chosen by the preprocessor; partial tiles by masked columns
and 8/4/2/1-row kernels) adds their product into the block, an A micro-panel
held in L1 while the B panels stream from L2.  Skinny GEMMs (M <= 16) read B
in place: dot products against a transposed weight (decode's x @ W^T), or B's
rows as the micro-kernel's panels.  x @ W^T with 12 <= M <= 128 (a Linear
layer over a prefill's tokens, the logits) runs transposed, C^T = W @ A^T:
W's rows are the broadcast operand, read in place (no B pack), A^T is packed
once per thread and each tile is transposed in registers on its way into C
(``kernel_path``: "weight_rows").  When a block is done an epilogue applies
what the store's scalar says: ``alpha * acc + beta * bias`` (``acc("gemm")``
is the product).

A pack loop reads a plain strided operand (an affine offset into one buffer)
through a pointer with constant strides, in the loop order that walks the
unit stride; any other mapping is emitted as its scalar expression.

``choose`` is the policy and ``estimate_us`` its cost model (rates measured
on this CPU): under ``gemm="auto"`` a GEMM with an operand torch would have to
copy first runs here unless copy + torch's kernel is estimated cheaper (a
large GEMM behind a small copy); one whose operands are all physical or
zero-copy strided views runs here only where the generated kernel is
estimated at least as fast as torch's (decode's skinny x @ W^T; MKL stays
slightly ahead on large contiguous squares on the Intel CPUs the rates were
measured on; where the machine's figures, ``vtc.plan.cost.machine()``, show
torch's GEMM slower than the generated one, as MKL is on AMD EPYC, its rates
are scaled by ``vtc.plan.cost.library_gemm_speed``).  float16 GEMMs run
this kernel: their operands widened to float32 as the packs read them (the strided branches and the dot path
through ``vtc_widen16``, any other mapping through the general emitter; a constant B packed once, widened, into
the float32 panels: ``F16_PACKED_B``), the float32 sums kept in a scratch C and
rounded to float16 once per element by the epilogue (``narrowed``), as eager's float16 GEMM accumulates in
float32 and rounds once; torch's float16 GEMM has no fast path on CPUs without float16 instructions
(``f16_estimate_us``).  Other dtypes run through torch, the reason in the report; bf16 mm / bmm on strided
operands have a kernel of their own where the CPU has AVX512_BF16 (``vtc.codegen.gemm_bf16``).
``Lowering.gemm_choices`` keeps
every decision with both estimates for the report.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from vtc.codegen import kernel_ir as K
from vtc.codegen.kernel_ir import Buffer, Kernel, Scalar, Store, scalars_under
from vtc.index.expr import Expr, _terms, free_vars, lift, loads, subs, var
from vtc.codegen import gemm_bf16, gemm_dot, gemm_inline, gemm_pack
from vtc.codegen.conv_bcast import PACKED_FLAG  # the call plan sets it for every weight packed once
from vtc.codegen.gemm_push import pushed_bytes
from vtc.plan.cost import library_gemm_speed
from vtc.runtime import packed
from vtc.index.mapping import linear_offset
from vtc.ir.graph import Node, Value
from vtc.virtual.movement import bind

GEMM_OPS = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default")
GEMM_MODES = ("auto", "vtc", "torch")
ACC = "gemm"  # name of the accumulator the epilogue scalar reads
SKINNY_M = 16  # rows up to which "auto" considers the generated kernel for strided operands too
F16 = torch.float16  # computed by the float32 kernel: operands widened as the packs read them, C rounded once


@dataclass
class GemmOperands:
    """What a gemm kernel multiplies: A at (batch, m, r) and B at (batch, r, n), as scalars."""

    a: Scalar
    b: Scalar
    batch: int
    m: int
    n: int
    k: int
    vars: tuple[str, str, str]  # C names of the batch, row and column index ("" for no batch)
    pack_b: Callable | None = None  # (emitter, self, indent) -> C lines packing B instead of _pack_b (conv im2col)
    runtime: str = ""  # C++ helpers that pack_b's lines call (guarded against a second definition)
    out_layout: tuple[Expr, int] | None = None  # (offset of a batch, row stride) of the first store's buffer when
    #   the kernel accumulates into a pushed op's output (vtc.codegen.gemm_push); None: its own [batch, M, N]
    dtype: torch.dtype = torch.float32  # of A, B and the result: float32 (a float16 GEMM's too: its operands are
    #   widened casts, its result ``narrowed``), or bfloat16 (vtc.codegen.gemm_bf16)
    generate: Callable | None = None  # (kernel) -> its C++ source, for a kernel of another form than the
    #   packed panels (a convolution over a small map as dot products: vtc.codegen.conv_t)


@dataclass
class GemmChoice:
    """The decision for one GEMM node, with both estimated costs (microseconds)."""

    node: str
    op: str
    shape: tuple[int, int, int, int]  # batch, M, N, K
    choice: str  # "vtc" | "torch"
    why: str
    vtc_us: float
    torch_us: float
    copy_bytes: int  # bytes torch's path materialises first (operands that are not strided views)
    stores_into: list[str] = field(default_factory=list)  # pushed ops whose output the kernel stores into
    #                                                       (vtc.codegen.gemm_push)
    a_packing: str = ""  # how the generated kernel packs a virtual A: "runs", "columns" or "elements"
    #                      (vtc.codegen.gemm_pack.a_packing); "" when A is physical or a strided view
    library: str = ""  # choice "torch": "mkl_packed" where the call plan runs it on its constant weight packed
    #                    once (vtc.runtime.packed), "" for torch's op as it is
    path: str = ""  # the generated kernel's loops (``kernel_path``): "panels", "weight_rows", "dot", "packed_dot"
    #                 (vtc.codegen.gemm_dot), "b_rows" or "skinny_packed" (vtc_skinny_packed on W packed once);
    #                 a convolution's "panels" or "conv_dot" (vtc.codegen.conv_t); "" when torch runs it

    def to_dict(self) -> dict:
        return asdict(self)


# -- cost model ---------------------------------------------------------------
# Rates on 2 threads of the Sapphire Rapids-class CPU this was tuned on (AVX-512, 2 MB L2 per core), from
# single-thread CPU times (python -m bench.gemm_side_by_side --threads 1 --clock cpu, and direct kernel
# calls: the machine is shared, so CPU time is the figure that does not move with the load): large
# contiguous squares run at ~139 GFLOPS per thread here, MKL at ~144.  A skinny GEMM (M <= 16) costs
# reading B plus its flops at a lower rate: 4096 x 4096 weights, 1 / 4 / 16 rows, took 3.65 / 4.5 / 8.0 ms
# on the dot-product path (B = W^T) against torch's 3.8 / 7.9 / 11.7 ms (ONNX Runtime 4.5 / 5.8 / 9.2):
# ~20 GB/s of B for both, then ~116 vs ~64 GFLOPS; B read in place row by row (unit stride along n) ~6 GB/s
# and ~21 GFLOPS.  A copy kernel moves ~5 GB/s of read + write per thread.  Only ratios and the launch
# cost decide a choice.
VTC_GFLOPS = 280.0
TORCH_GFLOPS = 290.0
SKINNY = {"dot": (40.0, 232.0), "rows": (12.0, 42.0), "torch": (41.0, 128.0)}  # (GB/s of B, GFLOPS), M <= 16
# M <= WIDE_ROWS_M against a row-major B: vtc_ukr_rows (1 and 2 x 4096 @ 4096 x 4096 in 2.6-2.8 ms, 1 thread, Zen 5:
# ~24 GB/s of B where the 32-column panels read ~11)
SKINNY["wide_rows"] = (24.0, 232.0)
# 1..SKINNY_M rows on W packed once (vtc_skinny_packed, kernel_path SKINNY_PACKED_PATH): the dot path's rates scaled
# by what Zen 5 measured against it (1 thread, CPU time, 2 / 8 x 4096 -> 4096: ~47 GB/s of W and ~188 GFLOPS
# against the dot path's ~38 and ~133, docs/gemm.md, session 15), the flops capped at the panels' rate
SKINNY["packed"] = (50.0, 280.0)
COPY_GBPS = 10.0  # a generated copy kernel: bytes read + written per second
MAPPED_PACK_NS = 0.5  # extra per packed element read through a mapping that is not a strided load
CALL_US = 5.0  # one kernel launch by the executor
TILE = (12, 32)  # the AVX-512 micro-kernel's MR x NR: a partial tile costs a full one
# on physical / strided operands the generated kernel must be estimated this much cheaper than torch's
# (estimates closer than that are within their error: the library keeps those)
MIN_SAVING = (10.0, 0.05)  # microseconds, and fraction of torch's estimate
# (a float16 GEMM where torch's has no fast path: the fraction only.  A small one (1 x 128 -> 64 .. 256 of a
# decode step, estimated 5.5 / 6.2 us generated / torch) is no faster in torch, and there it is a torch op between
# kernels that keeps its pointwise readers apart: a float16 Llama-3 decode layer at hidden 128 ran 205 us with its
# 7 projections in torch, 109 us generated (1 thread, CPU time; docs/gemm.md, helper dec16))


# Shape-aware terms (the llama shapes, M = 32 .. 384 x W^T, squares and bmm_cat_b16 at 1 thread, CPU time, per
# thread here: halved / doubled for 2): both libraries pay per element of B on top of the flops (packing it,
# reading W from memory): ~0.45 ns for the generated panels (16 x 16 transposes of a weight, zero tails),
# ~0.35 for MKL; the "weight_rows" path reads W in place (~0.1 ns) at ~148 GFLOPS over its transposed tiles
# (12 columns x 32 rows).  (Copies of a few MB measured 6-24 GB/s per thread in the same runs: COPY_GBPS stays.)
B_ELEM_NS = {"panels": 0.225, "weight_rows": 0.05, "torch": 0.175}  # per element of B, 2 threads
WT_GFLOPS = 296.0


def estimate_us(batch: int, m: int, n: int, k: int, *, copies: tuple[int, ...] = (), mapped_elems: int = 0,
                b_unit_stride: str = "n", path: str | None = None,
                torch_b_packed: bool = False, torch_speed: float = 1.0, b_packed: bool = False) -> tuple[float, float]:
    """(generated kernel, torch) estimated microseconds for one call.

    torch's side pays one copy kernel per operand that is not a strided view (`copies`: their bytes,
    read and written); the generated kernel pays for packing `mapped_elems` elements through mappings
    that are not plain strided loads, and for partial MR x NR tiles.  A skinny GEMM (m <= SKINNY_M) pays
    for reading B and its flops at the skinny rates: `b_unit_stride` "k" (B = W^T: the dot-product path)
    or "n" says which.  `path` ("panels" or "weight_rows", ``kernel_path``) adds the shape-aware terms:
    per element of B (packed by both libraries, read in place by weight_rows; a cost that the flops of
    few rows do not hide) and the weight_rows rate over its transposed tiles; None (convolutions) keeps
    the flat rates.  `torch_b_packed`: torch's side runs on its weight packed once (vtc.runtime.packed) and
    pays no per-element B term.  `torch_speed` scales torch's GEMM rates (vtc.plan.cost.library_gemm_speed:
    0.5 where torch's GEMM runs at half the rates assumed here).  `b_packed`: the generated kernel gets its B
    packed once by the call plan (``_packed_path``): "panels" pays no per-element B term, and `path`
    SKINNY_PACKED_PATH takes the packed skinny rates.
    """
    torch_b_ns = 0.0 if torch_b_packed else B_ELEM_NS["torch"] / torch_speed
    torch_gflops = TORCH_GFLOPS * torch_speed
    flops = 2.0 * batch * m * n * k
    b_bytes = 4.0 * batch * k * n
    if m <= SKINNY_M and path != "weight_rows":
        rows = "wide_rows" if WIDE_ROWS and m <= WIDE_ROWS_M else "rows"
        mine = "packed" if path == SKINNY_PACKED_PATH else "dot" if b_unit_stride == "k" else rows
        (vbw, vrate), (tbw, trate) = SKINNY[mine], SKINNY["torch"]
        vtc = b_bytes / (vbw * 1e3) + flops / (vrate * 1e3)
        lib = b_bytes / (tbw * torch_speed * 1e3) + flops / (trate * torch_speed * 1e3)
    elif path == "weight_rows":  # tiles of 12 columns (W's rows) x 32 rows (A^T's panel; 16 for m <= 16)
        width = 16 if m <= 16 else 32
        used = m / (-(-m // width) * width) * n / (-(-n // 12) * 12)
        vtc = flops / (WT_GFLOPS * 1e3 * used) + batch * k * n * B_ELEM_NS["weight_rows"] * 1e-3
        lib = flops / (torch_gflops * 1e3) + batch * k * n * torch_b_ns * 1e-3
    else:
        mr, nr = TILE
        used = m / (-(-m // mr) * mr) * n / (-(-n // nr) * nr)
        vtc = flops / (VTC_GFLOPS * 1e3 * used)
        lib = flops / (torch_gflops * 1e3)
        if path is not None:
            vtc += 0.0 if b_packed else batch * k * n * B_ELEM_NS["panels"] * 1e-3
            lib += batch * k * n * torch_b_ns * 1e-3
    vtc += mapped_elems * MAPPED_PACK_NS * 1e-3 + CALL_US
    lib += sum(CALL_US + 2 * b / (COPY_GBPS * 1e3) for b in copies) + CALL_US
    return vtc, lib


# float16 (the float32 kernel on widened operands, ``narrowed``): torch's float16 GEMMs on CPUs without AVX512_FP16
# / AMX-FP16 are slow (torch 2.13 on Zen 4, 1 thread, CPU time, bench/fp16_side_by_side.py): F.linear (mm / addmm,
# B = W^T) runs ~11-18 GFLOPS (512^3: 14.7 ms, 128 x 1024 -> 1024: 17.4 ms, 17 x 301 -> 45: 41 us), its skinny
# products read W at ~16 GB/s (1 x 1024 -> 4096: 0.53 ms); a bmm ~4-4.5 GFLOPS (16 x 256 x 256 @ 256 x 64: 33 ms),
# an mm with any other B (x @ W, W [K, N]) 0.6-3 (128 x 1024 @ 1024 x 1024: 264 ms, 16 x 1024 @ 1024 x 4096:
# 220 ms, 512^3: 93 ms).  Rates for 2 threads.
F16_TORCH_GFLOPS = {"linear": 24.0, "bmm": 8.0, "other": 4.0}  # mm / addmm with B = W^T, bmm, any other mm
F16_TORCH_GBPS = 32.0  # bytes of a float16 B read by a skinny (M <= SKINNY_M) product
# an element of a float16 operand that is not a strided view, packed one by one through its mapping and widened
# (vtc.codegen.gemm_pack's packs by runs read float32 only): q @ cat(k_past, k)^T, 16 x (1 x 64 @ 64 x 256), took
# 0.68-0.77 ms, ~2.6 ns an element of B at 1 thread (float32 by runs: 0.26 ms)
F16_MAPPED_PACK_NS = 1.3
F16_FAST_FLAGS = ("avx512_fp16", "amx_fp16")  # CPU flags with which oneDNN has float16 kernels: there torch's float16
#                                             GEMM is taken as fast as its float32 one (the float32 estimate)


@functools.lru_cache(maxsize=None)
def _torch_f16_fast() -> bool:
    """Whether this CPU has a float16 GEMM instruction set that torch's oneDNN uses (``F16_FAST_FLAGS``)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return any(x in flags for x in F16_FAST_FLAGS)


def f16_estimate_us(batch: int, m: int, n: int, k: int, *, copies: tuple[int, ...] = (), mapped_elems: int = 0,
                    b_unit_stride: str = "n", kind: str = "other", b_packed: bool = False) -> tuple[float, float]:
    """(generated kernel, torch) estimated microseconds for one float16 GEMM: the generated side as float32's
    panels (or the dot path: `b_unit_stride` "k" at M <= SKINNY_M) with `mapped_elems` packed one by one
    (F16_MAPPED_PACK_NS), torch's at its float16 rate of `kind` (above), or at float32's where the CPU has
    float16 GEMM instructions (``_torch_f16_fast``).  `b_packed`: B a constant the call plan packs once, widened."""
    skinny = m <= SKINNY_M and b_packed  # vtc_skinny_packed on the widened copy
    vtc, lib = estimate_us(batch, m, n, k, copies=copies, b_unit_stride=b_unit_stride,
                           path=SKINNY_PACKED_PATH if skinny else "panels", b_packed=b_packed)
    vtc += mapped_elems * F16_MAPPED_PACK_NS * 1e-3
    if m <= SKINNY_M and b_unit_stride == "k" and not skinny:  # the dot path reads the float16 weight: half float32's bytes
        vtc -= 2.0 * batch * k * n / (SKINNY["dot"][0] * 1e3)
    if _torch_f16_fast():
        return vtc, lib
    rate = F16_TORCH_GFLOPS[kind]
    lib = 2.0 * batch * m * n * k / (rate * 1e3) + CALL_US
    lib += 2.0 * batch * k * n / (F16_TORCH_GBPS * 1e3) if m <= SKINNY_M else 0.0
    lib += sum(CALL_US + 2 * b / (COPY_GBPS * 1e3) for b in copies)
    return vtc, lib


def _f16_b_packed(low, a: Value, b: Value, m: int, b_stride: str) -> bool:
    """Whether the call plan packs float16 GEMM's constant B once, widened (``_packed_spec``, ``_skinny_spec``)."""
    if not _constant_b(low, b) or needs_copy(low, a):
        return False
    if m <= SKINNY_M:
        return b_stride == "k" and SKINNY_PACKED and _skinny_packed_rows(m, 4 * b.shape[-1] * b.shape[-2], f16=True)
    return PACKED_B


def could_generate(n: Node) -> bool:
    """Whether the generated kernel can run float32 GEMM node n (``_unsupported`` says nothing against it), so that
    under gemm="auto" ``choose`` weighs packing a virtual operand through its mapping against torch on a copy of
    it.  For the planner's estimate (``vtc.plan.cost.Estimator.packs_through``), which has no lowering: bf16
    GEMMs, whose kernel asks more of the CPU and the operands (``gemm_bf16.why_not``), count as not."""
    if n.op not in GEMM_OPS:
        return False
    args = bind(n.target, n.args, n.kwargs)
    vals = [v for v in args.values() if isinstance(v, Value)] + list(n.outputs)
    return all(v.dtype == torch.float32 for v in vals) and not _unsupported(n, args, None)


def needs_copy(low, v) -> bool:
    """True for a virtual operand that torch cannot take as a zero-copy view (it would be copied first)."""
    if not isinstance(v, Value) or not low.plan.is_virtual(v.name):
        return False
    r = low.plan.realized.get(v.name)
    return r is None or r.strided is None


def choose(low, n: Node, mode: str) -> GemmChoice:
    """vtc or torch for GEMM node n under compile option gemm=`mode` (see the module docstring)."""
    args = bind(n.target, n.args, n.kwargs)
    a, b = _operands(n, args)
    batch, m, kk = (a.shape if len(a.shape) == 3 else (1, *a.shape))
    nn = b.shape[-1]
    batched = n.op in ("aten.bmm.default", "aten.baddbmm.default")
    unsupported = _unsupported(n, args, low)
    bias = args["self"] if n.op in ("aten.addmm.default", "aten.baddbmm.default") else None

    copies = [v for v in (a, b, bias) if v is not None and needs_copy(low, v)]
    copy_bytes = sum(v.nbytes for v in copies)
    # elements packed one by one through their mapping, where vtc.codegen.gemm_pack does not pack the operand
    # by runs (gathered rows, a cat's or pad's parts cost what a strided operand does); A once per NC
    # columns, B once per thread
    mapped = sum(_numel(v.shape) * reuse for v, reuse, how in ((a, -(-nn // 1024), gemm_pack.a_packing),
                                                               (b, 2 if m > SKINNY_M else 1, gemm_pack.b_packing))
                 if needs_copy(low, v) and how(low, v) != "runs")
    # a cat / scatter taking the result: the generated kernel stores it there, torch's is copied (gemm_push)
    pushed = tuple(pushed_bytes(low, n)) if n.op in GEMM_OPS else ()
    # the loops the kernel will run (kernel_path, from what choose can see: a plain A and B = W^T read in place)
    b_stride = _unit_stride(low, b)
    path = ("weight_rows" if WT_MIN_M <= m <= WT_MAX_M and b_stride == "k" and kk > 1 and nn > 1
            and not needs_copy(low, a) and not needs_copy(low, b) else "panels")
    # B a constant the call plan packs once for the generated kernel (_weight_packing, _packed_path)
    b_packed = _constant_b(low, b) and a.dtype == torch.float32 and not needs_copy(low, a)
    if b_packed and m <= SKINNY_M:
        b_packed = b_stride == "k" and SKINNY_PACKED and _skinny_packed_rows(m, 4 * kk * nn)
        path = SKINNY_PACKED_PATH if b_packed else path
    elif b_packed and path == "weight_rows":
        b_packed = 4 * kk * nn <= WT_PACKED_MAX_BYTES and _panels_pad_less(m)
        path = "panels" if b_packed else path
    library = packed.planned(low, n, a, b)  # "mkl_packed": torch's side runs on its weight packed once
    vtc_us, torch_us = estimate_us(batch, m, nn, kk, copies=tuple(v.nbytes for v in copies) + pushed,
                                   mapped_elems=mapped, b_unit_stride=b_stride, path=path,
                                   torch_b_packed=library == "mkl_packed",
                                   torch_speed=(speed := library_gemm_speed(rows=m, packed=library == "mkl_packed")),
                                   b_packed=b_packed and PACKED_B)
    # a single-use pointwise producer of a bmm operand: computed in the generated kernel's pack loop (once per
    # NC columns for A, per thread for B), stored and read back on torch's side (vtc.codegen.gemm_inline)
    inlined = [(gemm_inline.inlined_producer_bytes(low, v, n), reuse) for v, reuse in
               ((a, -(-nn // 1024)), (b, 2 if m > SKINNY_M else 1))
               if not needs_copy(low, v) and n.op in gemm_inline.OPS]
    inlined = [(name, nbytes, reuse) for (name, nbytes), reuse in inlined if nbytes]
    if inlined and a.dtype == torch.float32:
        vtc_us += sum(nbytes // 4 * reuse for _, nbytes, reuse in inlined) * MAPPED_PACK_NS * 1e-3
        torch_us += sum(CALL_US + 2 * nbytes / (COPY_GBPS * 1e3) for _, nbytes, _ in inlined)
    if a.dtype == F16 and not unsupported:  # widened into the float32 kernel
        speed = 1.0
        mapped = sum(_numel(v.shape) * reuse for v, reuse in ((a, -(-nn // 1024)), (b, 2 if m > SKINNY_M else 1))
                     if needs_copy(low, v))  # (none packed by runs)
        vtc_us, torch_us = f16_estimate_us(batch, m, nn, kk, copies=tuple(v.nbytes for v in copies) + pushed,
                                           mapped_elems=mapped, b_unit_stride=b_stride,
                                           kind="bmm" if batched else "linear" if b_stride == "k" else "other",
                                           b_packed=F16_PACKED_B and _f16_b_packed(low, a, b, m, b_stride))
    if a.dtype == gemm_bf16.BF16 and not unsupported:  # the bf16 kernel stores only its own result
        pushed = ()
        vtc_us, torch_us = gemm_bf16.estimate_us(batch, m, nn, kk, copies=tuple(v.nbytes for v in copies),
                                                 b_unit_stride=_unit_stride(low, b),
                                                 torch_speed=(speed := library_gemm_speed(dtype=gemm_bf16.BF16)))
    shape = (batch, m, nn, kk)

    def pick(choice: str, why: str) -> GemmChoice:
        return GemmChoice(n.name, n.op, shape, choice, why, round(vtc_us, 2), round(torch_us, 2), copy_bytes,
                          a_packing=gemm_pack.a_packing(low, a) if needs_copy(low, a) else "",
                          library=library if choice == "torch" else "")

    if unsupported:
        return pick("torch", unsupported)
    if mode == "vtc":
        return pick("vtc", "gemm='vtc' forces the generated kernel")
    if mode == "torch":
        return pick("torch", "gemm='torch' forces torch on zero-copy views")
    # a copy kernel's launch saved is sure: only the relative error of the estimates is asked for
    if pushed and not copies and torch_us - vtc_us >= MIN_SAVING[1] * torch_us:
        return pick("vtc", f"the result goes into a cat / scatter ({sum(pushed)} bytes): the generated kernel "
                           f"stores it there, torch's would be copied (estimated cheaper by a clear margin)")
    if copies:
        names = ", ".join(f"%{v.name}" for v in copies)
        if vtc_us <= torch_us:
            return pick("vtc", f"{names} is not a strided view: torch would copy {copy_bytes} bytes first; "
                               f"the generated kernel packs it through its mapping (estimated cheaper)")
        return pick("torch", f"{names} is not a strided view, but copying {copy_bytes} bytes and running "
                             f"torch's faster library kernel is estimated cheaper")
    slow_f16 = a.dtype == F16 and not _torch_f16_fast()
    if torch_us - vtc_us >= (MIN_SAVING[1] * torch_us if slow_f16 else max(MIN_SAVING[0], MIN_SAVING[1] * torch_us)):
        if inlined:
            names = ", ".join(f"%{name}" for name, _, _ in inlined)
            return pick("vtc", f"every operand is physical or a zero-copy strided view; the generated kernel "
                               f"computes {names} (a pointwise producer nothing else reads) in its pack loop, "
                               f"torch's needs it in memory ({sum(b for _, b, _ in inlined)} bytes stored and read "
                               f"back): estimated faster")
        measured = f" (torch's GEMM measured at {speed:.2f}x its assumed rate on this machine)" if speed != 1.0 else ""
        if slow_f16:
            measured = " (torch's float16 GEMM has no fast path on this CPU)"
        return pick("vtc", "every operand is physical or a zero-copy strided view; the generated kernel is "
                           f"estimated faster than torch's library kernel here{measured}")
    return pick("torch", "every operand is physical or a zero-copy strided view: torch's library kernel "
                         "(not estimated slower than the generated one by a clear margin)")


def _constant_b(low, b: Value) -> bool:
    """Whether GEMM operand B is what the call plan can pack once for the generated kernel (``_packed_path``): a
    zero-copy strided view of a constant with no batch stride (one weight for all of the kernel), float32, static
    sizes, on AVX-512."""
    from vtc.codegen.conv_t import has_avx512

    if b.dtype not in (torch.float32, F16) or not all(isinstance(d, int) for d in b.shape) or not has_avx512():
        return False
    whole, st = _of_a_constant(low, b.name)
    if whole:
        return len(b.shape) == 2
    return (st is not None and st.offset is not None
            and (len(b.shape) == 2 or st.strides[0] == 0 or b.shape[0] == 1))


def _of_a_constant(low, name: str) -> tuple[bool, Any]:
    """(whether value `name` is a constant of the graph, the strided view of a constant it is (the plan's
    realization of a virtual value) or None).  A constant that is an inference tensor counts as neither: the call
    plan does not pack it once (it has no version counter to see an in-place change by,
    vtc.runtime.packed.conv_weight_why_not), so the kernel reads it as it reads a runtime B."""
    consts = {v.name: v.data for v in low.graph.consts}
    if name in consts:
        data = consts[name]
        return not (isinstance(data, torch.Tensor) and data.is_inference()), None
    r = low.plan.realized.get(name) if low.plan.is_virtual(name) else None
    st = r.strided if r is not None else None
    if st is None or st.source not in consts:
        return False, None
    data = consts[st.source]
    return False, None if isinstance(data, torch.Tensor) and data.is_inference() else st


def _unit_stride(low, b: Value) -> str:
    """"k" when GEMM operand B ([.., K, N]) has unit stride along k (B = W^T, a transposed view), else "n"."""
    if not low.plan.is_virtual(b.name):
        return "n"
    r = low.plan.realized.get(b.name)
    if r is not None and r.strided is not None:
        return "k" if r.strided.strides[-2] == 1 else "n"
    mp = low.plan.mappings[b.name]
    if len(mp.pieces) != 1 or mp.pieces[0].source is None:
        return "n"
    piece = mp.pieces[0]
    lin = linear_offset(piece.index, mp.sources[piece.source])
    _, terms = _terms(lin)
    kvar = f"i{len(b.shape) - 2}"
    return "k" if any(atom.op == "var" and atom.args[0] == kvar and c == 1 for atom, c in terms.items()) else "n"


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _operands(n: Node, args: dict) -> tuple[Value, Value]:
    if n.op in ("aten.mm.default", "aten.bmm.default"):
        return args["self"], args["mat2"]
    if n.op == "aten.addmm.default":
        return args["mat1"], args["mat2"]
    return args["batch1"], args["batch2"]


def _unsupported(n: Node, args: dict, low) -> str:
    """Why the generated kernel cannot run node n ("" when it can)."""
    vals = [v for v in args.values() if isinstance(v, Value)] + list(n.outputs)
    if all(v.dtype == gemm_bf16.BF16 for v in vals):
        why = gemm_bf16.why_not(low, n, *_operands(n, args))
        if why:
            return why
    elif not all(v.dtype == F16 for v in vals):
        bad = [v for v in vals if v.dtype != torch.float32]
        if bad:
            return (f"dtype {bad[0].dtype} of %{bad[0].name}: the generated GEMM is float32, all bf16 or all "
                    f"float16 only")
    for key in ("alpha", "beta"):
        if key in args and not isinstance(args[key], (int, float)):
            return f"{key}={args[key]!r} is not a number"
    if any(s == 0 for v in vals for s in v.shape):
        return "an empty operand"
    return ""


# -- kernel IR ----------------------------------------------------------------
def gemm_kernel(low, n: Node) -> Kernel:
    """The gemm kernel of node n: A and B read through `low.value_at`, the epilogue as the store's scalar."""
    args = bind(n.target, n.args, n.kwargs)
    a, b = _operands(n, args)
    out = n.outputs[0]
    batched = len(out.shape) == 3
    batch, m, nn = (out.shape if batched else (1, *out.shape))
    kk = a.shape[-1]
    rv = var("r", kk)
    if batched:
        bi, mi, ni = var("i0", batch), var("i1", m), var("i2", nn)
        a_idx, b_idx, o_idx = (bi, mi, rv), (bi, rv, ni), (bi, mi, ni)
        names = ("i0", "i1", "i2")
    else:
        mi, ni = var("i0", m), var("i1", nn)
        a_idx, b_idx, o_idx = (mi, rv), (rv, ni), (mi, ni)
        names = ("", "i0", "i1")
    memo: dict = {}
    dtype = gemm_bf16.BF16 if a.dtype == gemm_bf16.BF16 else torch.float32  # bf16: packed as bf16 pairs
    sa = K.cast(low.value_at(a.name, a_idx, memo), dtype)
    sb = K.cast(low.value_at(b.name, b_idx, memo), dtype)
    value = K.acc(ACC, torch.float32)
    alpha, beta = args.get("alpha", 1), args.get("beta", 1)
    if alpha != 1:
        value = K.binary("mul", value, K.const(alpha, torch.float32))
    bias = args.get("self") if n.op in ("aten.addmm.default", "aten.baddbmm.default") else None
    if bias is not None and beta != 0:
        from vtc.codegen.lower import broadcast_index

        sbias = K.cast(low.value_at(bias.name, broadcast_index(o_idx, out.shape, bias.shape), memo), torch.float32)
        if beta != 1:
            sbias = K.binary("mul", sbias, K.const(beta, torch.float32))
        value = K.binary("add", value, sbias)
    ops = GemmOperands(sa, sb, batch, m, nn, kk, names, dtype=dtype)
    name = "k_" + "".join(c if c.isalnum() else "_" for c in n.name)
    k = Kernel(name, "gemm", tuple(out.shape), kk, [], [Store(Buffer(out.name, out.shape, out.dtype), o_idx, value)],
               source_nodes=[n.name])
    k.gemm = ops
    if n.name in getattr(low, "gemm_choices", {}):
        shapes = {x: low.values[x].shape for x in _loaded(sa, sb)}
        low.gemm_choices[n.name].path = kernel_path(ops, shapes, _packed_path(low, k, shapes))
    return k


SKINNY_PACKED_PATH = "skinny_packed"  # kernel_path where 1..SKINNY_M rows run vtc_skinny_packed on W packed once


def _packed_path(low, k: Kernel, shapes: dict) -> str:
    """The path gemm kernel k runs where the call plan passes it its weight packed once (``_weight_packing``): a
    constant of the graph (or a view of one) as the kernel's B, packed as ``generate`` asks: SKINNY_PACKED_PATH
    (vtc_skinny_packed), "panels" (the micro-kernel's panels, B not packed per call) or "weight_rows" (a float16
    W^T widened as rows, ``_f16_weight_rows``); "" where nothing is."""
    from vtc.codegen.cpp import _Emitter

    g = k.gemm
    if g.pack_b is not None or g.dtype != torch.float32 or _unwidened(g.b).op != "load":
        return ""
    em = _Emitter(k)  # (k has no inputs yet: their shapes and some pointer names for the spec functions)
    em.shapes.update(shapes)
    # and the index tensors an operand's offset loads (a constant index_select in front of B: its rows' index
    # lands in the offset's base, which the spec functions print)
    em.shapes.update({t: low._index_tensor(t)[0] for t in _index_loads(g.a, g.b) if t not in shapes})
    em.ptr.update({x: f"b{i}" for i, x in enumerate(sorted(em.shapes))})
    _, _, skinny, spec = _weight_packing(em, g)
    if spec is None:
        return ""
    whole, st = _of_a_constant(low, spec.buffer)
    if not whole and st is None:
        return ""  # a runtime B: the kernel reads it as without a packed copy
    return SKINNY_PACKED_PATH if spec is skinny else "weight_rows" if spec.layout is widened_rows else "panels"


def _index_loads(*scalars: Scalar) -> set[str]:
    """Names of the index tensors that the offsets of scalars' loads read."""
    return {t for s in scalars_under(scalars) if s.op == "load" for e in s.args[1] for t in loads(e)}


def _loaded(*scalars: Scalar) -> set[str]:
    """Names of the buffers that scalars load from (not through index tensors)."""
    return {s.args[0] for s in scalars_under(scalars) if s.op == "load"}


# -- C++ ----------------------------------------------------------------------
RUNTIME = r"""
#ifndef VTC_GEMM_RUNTIME
#define VTC_GEMM_RUNTIME
#include <cstdlib>
#include <cstring>
#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#define VTC_MR 12
#define VTC_NR 32
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VTC_MR 6
#define VTC_NR 16
#else
#define VTC_MR 4
#define VTC_NR 8
#endif
// blocking: an A block (MC x KC) and a B block (KC x NC) together fit in a 2 MB L2, a B micro-panel
// (KC x NR) in L1 while the A micro-panels stream past it
#define VTC_KC 256
#ifndef VTC_SKINNY_R
#define VTC_SKINNY_R 8  // rows of A per pass of vtc_skinny_packed (at most 8; 7-8 rows in one pass of one panel)
#endif
#ifndef VTC_SKINNY_B_IN_REG  // vtc_skinny_pk's B vectors of a step loaded once for its R rows
#define VTC_SKINNY_B_IN_REG 1
#endif
#define VTC_MC (VTC_MR * 12)
#define VTC_NC 1024

// c[R x cols] = (add ? c : 0) + a[kc x MR (R used)] * b[kc x NR (cols used)]: a is a packed panel, b either a
// packed panel (ldb = NR) or B itself (ldb = its row stride); every b row is read in full (NR floats).
// PF: while it runs, the source of the next B panel (NR columns of B at pf) is prefetched into L2, two lines
// per k step: PF 1, B row-major (row p of the panel at pf + p * pld, two lines); PF 2, B = W^T (NR rows of W
// pld floats apart, the panel's kc columns of each: line p >> 5 of the 32-float runs of row p & 31).
// LDA > 0: A read in place, a[r * LDA + p] (row-major rows of A, LDA floats apart: a compile-time constant, so
// one pointer and constant displacements) instead of a packed panel; for a small N, where each A element serves
// few tiles and packing A cost as much as the tiles' FMAs saved (vtc_ukr_a_edge)
template <int R, int PF = 0, int64_t LDA = 0>
static inline void vtc_ukr(int64_t kc, const float* __restrict a, const float* __restrict b, int64_t ldb,
                           float* __restrict c, int64_t ldc, bool add, int64_t cols,
                           const float* pf = nullptr, int64_t pld = 0) {
#if defined(__AVX512F__)
  const __mmask16 k0 = (__mmask16)(cols >= 16 ? 0xFFFFu : (1u << cols) - 1u);
  const __mmask16 k1 = (__mmask16)(cols >= 32 ? 0xFFFFu : cols <= 16 ? 0u : (1u << (cols - 16)) - 1u);
  __m512 c0[R], c1[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm_prefetch((const char*)(c + r * ldc), _MM_HINT_T0);  // both lines of the tile's row of C (read at the end)
    _mm_prefetch((const char*)(c + r * ldc + 16), _MM_HINT_T0);
    c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps();
  }
  #pragma GCC unroll 2
  for (int64_t p = 0; p < kc; ++p) {
    if constexpr (PF != 0) {
      const float* q = PF == 1 ? pf + p * pld : pf + (p & 31) * pld + (p >> 5) * 32;
      _mm_prefetch((const char*)q, _MM_HINT_T1);
      _mm_prefetch((const char*)(q + 16), _MM_HINT_T1);
    }
    const __m512 b0 = _mm512_loadu_ps(b + p * ldb), b1 = _mm512_loadu_ps(b + p * ldb + 16);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[LDA ? r * LDA + p : p * VTC_MR + r]);
      c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
      c1[r] = _mm512_fmadd_ps(av, b1, c1[r]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    if (add) { c0[r] = _mm512_add_ps(c0[r], _mm512_maskz_loadu_ps(k0, cr)); c1[r] = _mm512_add_ps(c1[r], _mm512_maskz_loadu_ps(k1, cr + 16)); }
    _mm512_mask_storeu_ps(cr, k0, c0[r]);
    _mm512_mask_storeu_ps(cr + 16, k1, c1[r]);
  }
#else
  (void)pf; (void)pld;
  alignas(64) float tmp[R * VTC_NR];
  const bool full = cols == VTC_NR;
  float* dst = full ? c : tmp;
  const int64_t ld = full ? ldc : VTC_NR;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 c0[R], c1[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { c0[r] = _mm256_setzero_ps(); c1[r] = _mm256_setzero_ps(); }
  for (int64_t p = 0; p < kc; ++p) {
    const __m256 b0 = _mm256_loadu_ps(b + p * ldb), b1 = _mm256_loadu_ps(b + p * ldb + 8);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + (LDA ? r * LDA + p : p * VTC_MR + r));
      c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* cr = dst + r * ld;
    if (full && add) { c0[r] = _mm256_add_ps(c0[r], _mm256_loadu_ps(cr)); c1[r] = _mm256_add_ps(c1[r], _mm256_loadu_ps(cr + 8)); }
    _mm256_storeu_ps(cr, c0[r]);
    _mm256_storeu_ps(cr + 8, c1[r]);
  }
#else
  float acc[R][VTC_NR] = {};
  for (int64_t p = 0; p < kc; ++p)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < VTC_NR; ++j) acc[r][j] += a[LDA ? r * LDA + p : p * VTC_MR + r] * b[p * ldb + j];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < VTC_NR; ++j) dst[r * ld + j] = (full && add ? dst[r * ld + j] : 0.0f) + acc[r][j];
#endif
  if (!full)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < cols; ++j) c[r * ldc + j] = (add ? c[r * ldc + j] : 0.0f) + tmp[r * VTC_NR + j];
#endif
}

// b[p * VTC_NR + j] = src[p * lds + j] for j < cols, 0 for cols <= j < VTC_NR: the last, narrower column panel
// of a B read in place (the micro-kernel reads NR columns)
static inline const float* vtc_pad_cols(const float* __restrict src, int64_t lds, int64_t kb, int64_t cols,
                                        float* __restrict b) {
  for (int64_t p = 0; p < kb; ++p) {
    for (int64_t j = 0; j < cols; ++j) b[p * VTC_NR + j] = src[p * lds + j];
    for (int64_t j = cols; j < VTC_NR; ++j) b[p * VTC_NR + j] = 0.0f;
  }
  return b;
}

// the micro-kernel for `rows` <= VTC_MR rows and `cols` <= VTC_NR columns: fewer rows than MR as a sum of
// 8, 4, 2 and 1-row kernels (the panel's row stride is MR in all), so only five sizes are instantiated
__attribute__((noinline)) static void vtc_ukr_edge(int rows, int64_t cols, int64_t kc, const float* a, const float* b,
                                                   int64_t ldb, float* c, int64_t ldc, bool add) {
  if (rows == VTC_MR) { vtc_ukr<VTC_MR>(kc, a, b, ldb, c, ldc, add, cols); return; }
  int r0 = 0;
#if VTC_MR > 8
  if (rows - r0 >= 8) { vtc_ukr<8>(kc, a + r0, b, ldb, c + r0 * ldc, ldc, add, cols); r0 += 8; }
#endif
  if (rows - r0 >= 4) { vtc_ukr<4>(kc, a + r0, b, ldb, c + r0 * ldc, ldc, add, cols); r0 += 4; }
  if (rows - r0 >= 2) { vtc_ukr<2>(kc, a + r0, b, ldb, c + r0 * ldc, ldc, add, cols); r0 += 2; }
  if (rows - r0 >= 1) vtc_ukr<1>(kc, a + r0, b, ldb, c + r0 * ldc, ldc, add, cols);
}

#if defined(__AVX512F__)
// vtc_ukr_rows for cols <= 16 * V (a narrow B: its rows are short runs, read one after the other): C's R x V
// vectors held in registers over all kc rows, in S = 4 / 2 / 1 sets on alternate rows at V = 1-2 / 4 / 8 (one
// set's FMA chains would be too few to hide their latency); B's rows loaded whole where cols = 16 V (and at V = 8
// prefetched PD rows ahead), masked past cols otherwise
template <bool B> struct vtc_flag { static constexpr bool value = B; };  // a compile-time flag for a generic lambda

template <int R, int V, int PD>
static inline void vtc_ukr_rows_narrow(int64_t kc, const float* __restrict a, const float* __restrict b, int64_t ldb,
                                       float* __restrict c, int64_t ldc, bool add, int64_t cols) {
  constexpr int S = V <= 2 ? 4 : V == 4 ? 2 : 1;
  __mmask16 mk[V];
  #pragma GCC unroll 8
  for (int v = 0; v < V; ++v)
    mk[v] = (__mmask16)(cols - 16 * v >= 16 ? 0xFFFFu : cols - 16 * v <= 0 ? 0u : (1u << (cols - 16 * v)) - 1u);
  __m512 acc[S][R][V];
  #pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
    #pragma GCC unroll 2
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[s][r][v] = _mm512_setzero_ps();
  const int64_t ks = kc / S * S;
  auto rows = [&](auto full) {  // rows [0, ks), S at a time; full: a tag type whose value says cols == 16 V
    for (int64_t p = 0; p < ks; p += S)
      #pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        const float* __restrict bp = b + (p + s) * ldb;
        if constexpr (decltype(full)::value && V == 8 && PD > 0) {
          if (p + s + PD < kc)
            #pragma GCC unroll 8
            for (int v = 0; v < V; ++v) _mm_prefetch((const char*)(bp + PD * ldb + 16 * v), _MM_HINT_T0);
        }
        __m512 av[R];
        #pragma GCC unroll 2
        for (int r = 0; r < R; ++r) av[r] = _mm512_set1_ps(a[(p + s) * VTC_MR + r]);
        #pragma GCC unroll 8
        for (int v = 0; v < V; ++v) {
          const __m512 bv = decltype(full)::value ? _mm512_loadu_ps(bp + 16 * v) : _mm512_maskz_loadu_ps(mk[v], bp + 16 * v);
          #pragma GCC unroll 2
          for (int r = 0; r < R; ++r) acc[s][r][v] = _mm512_fmadd_ps(av[r], bv, acc[s][r][v]);
        }
      }
  };
  if (cols == 16 * V) rows(vtc_flag<true>{}); else rows(vtc_flag<false>{});
  for (int64_t p = ks; p < kc; ++p) {  // the last kc % S rows, into the first set
    __m512 av[R];
    #pragma GCC unroll 2
    for (int r = 0; r < R; ++r) av[r] = _mm512_set1_ps(a[p * VTC_MR + r]);
    #pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const __m512 bv = _mm512_maskz_loadu_ps(mk[v], b + p * ldb + 16 * v);
      #pragma GCC unroll 2
      for (int r = 0; r < R; ++r) acc[0][r][v] = _mm512_fmadd_ps(av[r], bv, acc[0][r][v]);
    }
  }
  #pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      #pragma GCC unroll 4
      for (int s = 1; s < S; ++s) acc[0][r][v] = _mm512_add_ps(acc[0][r][v], acc[s][r][v]);
      float* cr = c + r * ldc + 16 * v;
      if (add) acc[0][r][v] = _mm512_add_ps(acc[0][r][v], _mm512_maskz_loadu_ps(mk[v], cr));
      _mm512_mask_storeu_ps(cr, mk[v], acc[0][r][v]);
    }
}

// c[r * ldc + j] (+)= sum_p a[p * VTC_MR + r] * b[p * ldb + j] for r < R, j < cols: R (1 or 2) skinny rows against a
// row-major B read in place, as ONNX Runtime's one-row kernel does it: U rows of B per pass over all the columns
// (U long sequential streams, what the hardware prefetchers follow), the R rows of C loaded, U FMAs added and
// stored back per 16 columns (C stays in L1: the caller's blocks are at most 2048 columns).  vtc_ukr's 32-column
// panels, or a block of C in registers over all of K, read each B row in 128- / 512-byte runs a row stride apart:
// a new page per k step.  The first pass stores without reading C where !add; masked past cols.
template <int R, int U>
__attribute__((noinline)) static void vtc_ukr_rows(int64_t kc, const float* __restrict a, const float* __restrict b,
                                                   int64_t ldb, float* __restrict c, int64_t ldc, bool add, int64_t cols) {
  if (cols <= 128) {  // a narrow block: C in registers (vtc_ukr_rows_narrow)
    if (cols <= 16) vtc_ukr_rows_narrow<R, 1, 16>(kc, a, b, ldb, c, ldc, add, cols);
    else if (cols <= 32) vtc_ukr_rows_narrow<R, 2, 16>(kc, a, b, ldb, c, ldc, add, cols);
    else if (cols <= 64) vtc_ukr_rows_narrow<R, 4, 16>(kc, a, b, ldb, c, ldc, add, cols);
    else vtc_ukr_rows_narrow<R, 8, 16>(kc, a, b, ldb, c, ldc, add, cols);
    return;
  }
  const int64_t jfull = cols / 16 * 16;
  const __mmask16 mt = (__mmask16)((1u << (cols - jfull)) - 1u);
  int64_t p = 0;
  for (; p + U <= kc; p += U) {
    __m512 av[U][R];
    #pragma GCC unroll 16
    for (int u = 0; u < U; ++u)
      #pragma GCC unroll 2
      for (int r = 0; r < R; ++r) av[u][r] = _mm512_set1_ps(a[(p + u) * VTC_MR + r]);
    const float* __restrict bp = b + p * ldb;
    const bool load = add || p > 0;
    for (int64_t j = 0; j < jfull; j += 16) {
      __m512 acc[R];
      #pragma GCC unroll 2
      for (int r = 0; r < R; ++r) acc[r] = load ? _mm512_loadu_ps(c + r * ldc + j) : _mm512_setzero_ps();
      #pragma GCC unroll 16
      for (int u = 0; u < U; ++u) {
        const __m512 bv = _mm512_loadu_ps(bp + u * ldb + j);
        #pragma GCC unroll 2
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(av[u][r], bv, acc[r]);
      }
      #pragma GCC unroll 2
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * ldc + j, acc[r]);
    }
    if (mt) {
      __m512 acc[R];
      #pragma GCC unroll 2
      for (int r = 0; r < R; ++r) acc[r] = load ? _mm512_maskz_loadu_ps(mt, c + r * ldc + jfull) : _mm512_setzero_ps();
      #pragma GCC unroll 16
      for (int u = 0; u < U; ++u) {
        const __m512 bv = _mm512_maskz_loadu_ps(mt, bp + u * ldb + jfull);
        #pragma GCC unroll 2
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(av[u][r], bv, acc[r]);
      }
      #pragma GCC unroll 2
      for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(c + r * ldc + jfull, mt, acc[r]);
    }
  }
  for (; p < kc; ++p) {  // the last kc % U rows, one pass each
    __m512 av[R];
    #pragma GCC unroll 2
    for (int r = 0; r < R; ++r) av[r] = _mm512_set1_ps(a[p * VTC_MR + r]);
    const float* __restrict bp = b + p * ldb;
    const bool load = add || p > 0;
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 m = j < jfull ? (__mmask16)0xFFFFu : mt;
      const __m512 bv = _mm512_maskz_loadu_ps(m, bp + j);
      #pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m512 acc = load ? _mm512_maskz_loadu_ps(m, c + r * ldc + j) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(c + r * ldc + j, m, _mm512_fmadd_ps(av[r], bv, acc));
      }
    }
  }
}

// vtc_ukr with A read in place (LDA) for `rows` <= VTC_MR rows as a sum of 12, 8, 4, 2 and 1-row kernels
template <int64_t LDA>
__attribute__((noinline)) static void vtc_ukr_a_edge(int rows, int64_t cols, int64_t kc, const float* a, const float* b,
                                                     int64_t ldb, float* c, int64_t ldc, bool add) {
  if (rows == VTC_MR) { vtc_ukr<VTC_MR, 0, LDA>(kc, a, b, ldb, c, ldc, add, cols); return; }
  int r0 = 0;
  if (rows - r0 >= 8) { vtc_ukr<8, 0, LDA>(kc, a, b, ldb, c, ldc, add, cols); r0 += 8; }
  if (rows - r0 >= 4) { vtc_ukr<4, 0, LDA>(kc, a + r0 * LDA, b, ldb, c + r0 * ldc, ldc, add, cols); r0 += 4; }
  if (rows - r0 >= 2) { vtc_ukr<2, 0, LDA>(kc, a + r0 * LDA, b, ldb, c + r0 * ldc, ldc, add, cols); r0 += 2; }
  if (rows - r0 >= 1) vtc_ukr<1, 0, LDA>(kc, a + r0 * LDA, b, ldb, c + r0 * ldc, ldc, add, cols);
}

// transposes the 16 x 16 block r[i][j] -> r[j][i] in registers
static inline void vtc_transpose16_regs(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + i + 4], 0x88);
      t[8 * h + i + 4] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// dst[c * ldd + r] = src[r * lds + c] for a 16 x 16 block
// 16 elements from p, as floats: float16 ones (a float16 GEMM's operands, vtc.codegen.gemm ``narrowed``) widened
static inline __m512 vtc_widen16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 vtc_widen16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline float vtc_widen1(const float* p) { return *p; }
static inline float vtc_widen1(const uint16_t* p) { return _cvtsh_ss(*p); }
// the first n < 16 elements from p, zeros after them: float32 by one masked load, float16 copied through a stack row
template <typename T>
static inline __m512 vtc_widen16_tail(const T* p, int64_t n) {
  if constexpr (sizeof(T) == 4) return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
  alignas(32) T t[16] = {};
  for (int64_t i = 0; i < n; ++i) t[i] = p[i];
  return vtc_widen16(t);
}
template <typename T>
static inline void vtc_transpose16(const T* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = vtc_widen16(src + i * lds);
  vtc_transpose16_regs(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ldd, r[i]);
}
// dst[p * VTC_MR + r] = src[r * lds + p] for r < rows <= VTC_MR, p < kb: an A panel from row-major rows,
// 16 x 16 blocks transposed in registers
template <typename T>
static inline void vtc_pack_a_rows(const T* __restrict src, int64_t lds, int rows, int64_t kb, float* __restrict dst) {
  int64_t p0 = 0;
  const __mmask16 keep = (__mmask16)((1u << VTC_MR) - 1u);
  for (; p0 + 16 <= kb; p0 += 16) {
    __m512 r[16];
    #pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) r[i] = i < rows ? vtc_widen16(src + i * lds + p0) : _mm512_setzero_ps();
    vtc_transpose16_regs(r);
    #pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) _mm512_mask_storeu_ps(dst + (p0 + i) * VTC_MR, keep, r[i]);
  }
  for (; p0 < kb; ++p0)
    for (int r = 0; r < rows; ++r) dst[p0 * VTC_MR + r] = vtc_widen1(src + r * lds + p0);
}

// C[j * ldc + r] (+)= sum_p w[r * LDW + p] * bt[p * VTC_NR + j] for r < R, j < cols: the transposed 12 x 32
// tile of C = A @ W^T where W (a row-major weight, rows LDW floats apart, a compile-time constant: one pointer
// and constant displacements) is read in place as the broadcast operand and A^T is the packed panel
// (vtc_pack_at); the tile is transposed in registers on its way out (once per KC slice)
template <int R, int64_t LDW, int H>
static inline void vtc_ukr_wt(int64_t kc, const float* __restrict w, const float* __restrict bt,
                              float* __restrict c, int64_t ldc, bool add, int64_t cols, const float* pf) {
  __m512 c0[R], c1[H == 2 ? R : 1];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    c0[r] = _mm512_setzero_ps();
    if constexpr (H == 2) c1[r] = _mm512_setzero_ps();
  }
  for (int64_t p0 = 0; p0 < kc; p0 += 16) {
    if (pf)  // the next strip of W into L2, a line of each row per 16 k steps
      #pragma GCC unroll 16
      for (int r = 0; r < VTC_MR; ++r) _mm_prefetch((const char*)(pf + r * LDW + p0), _MM_HINT_T1);
    const int64_t p1 = std::min<int64_t>(kc, p0 + 16);
    #pragma GCC unroll 2
    for (int64_t p = p0; p < p1; ++p) {
      const __m512 b0 = _mm512_loadu_ps(bt + p * VTC_NR);
      const __m512 b1 = H == 2 ? _mm512_loadu_ps(bt + p * VTC_NR + 16) : b0;
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 av = _mm512_set1_ps(w[r * LDW + p]);
        c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
        if constexpr (H == 2) c1[r] = _mm512_fmadd_ps(av, b1, c1[r]);
      }
    }
  }
  const __mmask16 keep = (__mmask16)((1u << R) - 1u);
  for (int h = 0; h < H; ++h) {
    const int64_t n = std::min<int64_t>(16, cols - 16 * h);
    if (n <= 0) break;
    __m512 t[16];
    #pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) t[r] = r < R ? (h ? c1[H == 2 ? r : 0] : c0[r]) : _mm512_setzero_ps();
    vtc_transpose16_regs(t);
    float* ch = c + 16 * h * ldc;
    for (int64_t j = 0; j < n; ++j) {
      __m512 v = t[j];
      if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, ch + j * ldc));
      _mm512_mask_storeu_ps(ch + j * ldc, keep, v);
    }
  }
}

// vtc_ukr_wt for `rows` <= VTC_MR weight rows (C columns) as a sum of 12, 8, 4, 2 and 1-row kernels; H = 1: the
// panels' first 16 columns only (cols <= 16: A has at most 16 rows)
template <int64_t LDW, int H>
__attribute__((noinline)) static void vtc_ukr_wt_edge(int rows, int64_t cols, int64_t kc, const float* w,
                                                      const float* bt, float* c, int64_t ldc, bool add,
                                                      const float* pf) {
  if (rows == VTC_MR) { vtc_ukr_wt<VTC_MR, LDW, H>(kc, w, bt, c, ldc, add, cols, pf); return; }
  int r0 = 0;
  if (rows - r0 >= 8) { vtc_ukr_wt<8, LDW, H>(kc, w, bt, c, ldc, add, cols, nullptr); r0 += 8; }
  if (rows - r0 >= 4) { vtc_ukr_wt<4, LDW, H>(kc, w + r0 * LDW, bt, c + r0, ldc, add, cols, nullptr); r0 += 4; }
  if (rows - r0 >= 2) { vtc_ukr_wt<2, LDW, H>(kc, w + r0 * LDW, bt, c + r0, ldc, add, cols, nullptr); r0 += 2; }
  if (rows - r0 >= 1) vtc_ukr_wt<1, LDW, H>(kc, w + r0 * LDW, bt, c + r0, ldc, add, cols, nullptr);
}

// dst[i * ldd + j] = src[i * lds + j] for i < rows, j < cols <= 48, with streaming stores (no read for ownership,
// past the caches) where a row is 48 columns starting on a cache line; then a store fence
static inline void vtc_stream_rows(const float* __restrict src, int64_t lds, float* __restrict dst, int64_t ldd,
                                   int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* s = src + i * lds;
    float* d = dst + i * ldd;
    if (cols == 48 && ((uintptr_t)d & 63) == 0) {
      _mm512_stream_ps(d, _mm512_loadu_ps(s));
      _mm512_stream_ps(d + 16, _mm512_loadu_ps(s + 16));
      _mm512_stream_ps(d + 32, _mm512_loadu_ps(s + 32));
    } else {
      for (int64_t j = 0; j < cols; j += 16) {
        const __mmask16 m = (__mmask16)(cols - j >= 16 ? 0xFFFFu : (1u << (cols - j)) - 1u);
        _mm512_mask_storeu_ps(d + j, m, _mm512_maskz_loadu_ps(m, s + j));
      }
    }
  }
  _mm_sfence();
}

// dst[p * VTC_NR + j] = src[j * lds + p] for j < cols <= VTC_NR, p < kb, zero for cols <= j < VTC_NR: an A^T
// panel (NR rows of A side by side) from row-major rows (float16 ones widened), 16 x 16 blocks transposed in registers
template <typename T>
static inline void vtc_pack_at(const T* __restrict src, int64_t lds, int64_t cols, int64_t kb, float* __restrict dst) {
  for (int64_t j0 = 0; j0 < VTC_NR; j0 += 16) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, cols - j0));
    int64_t p0 = 0;
    for (; p0 + 16 <= kb; p0 += 16) {
      __m512 r[16];
      #pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) r[i] = i < n ? vtc_widen16(src + (j0 + i) * lds + p0) : _mm512_setzero_ps();
      vtc_transpose16_regs(r);
      #pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (p0 + i) * VTC_NR + j0, r[i]);
    }
    if (p0 < kb) {  // the last kb - p0 < 16 by vtc_widen16_tail (a scalar loop here cost g++ ~1 s per float32 kernel to vectorise)
      __m512 r[16];
      #pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) r[i] = i < n ? vtc_widen16_tail(src + (j0 + i) * lds + p0, kb - p0) : _mm512_setzero_ps();
      vtc_transpose16_regs(r);
      for (int64_t i = 0; i < kb - p0; ++i) _mm512_storeu_ps(dst + (p0 + i) * VTC_NR + j0, r[i]);
    }
  }
}

// lane i = the sum of the 16 lanes of s[i], for i < 16 (a transpose-and-add tree: 30 shuffles and 15 adds)
static inline __m512 vtc_reduce16(const __m512* s) {
  __m512 a[8], b[4], c[2];
  #pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // per 128-bit block: (x0+x2, y0+y2, x1+x3, y1+y3) of x = s[2i], y = s[2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  #pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // per block: the block sums of s[4i .. 4i+3]
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  #pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // blocks 0+1 and 2+3 of b[2i], then of b[2i+1]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// c[r * ldc + j] = (add ? c : 0) + sum_p a[r * kc + p] * w[j * ldw + p] for r < R, j < J: skinny GEMMs
// against a row-major weight (B = W^T) read in place
template <int PF, int R, int J, typename TW>  // PF: floats ahead along each weight row prefetched (0: none)
static inline void vtc_dot_rows(int64_t kc, const float* __restrict a, const TW* __restrict w, int64_t ldw,
                                float* __restrict c, int64_t ldc, bool add) {
  const int64_t kf = kc / 16 * 16;
  const __mmask16 tail = (__mmask16)((1u << (kc - kf)) - 1u);
  __m512 s[R][J];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int j = 0; j < J; ++j) s[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kf; p += 16) {
    __m512 x[R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) x[r] = _mm512_loadu_ps(a + r * kc + p);
    #pragma GCC unroll 4
    for (int j = 0; j < J; ++j) {
      if constexpr (R > 1 && PF > 0)  // (one row: measured slower with it)
        _mm_prefetch((const char*)(w + j * ldw + p + PF), _MM_HINT_T0);
      const __m512 wv = vtc_widen16(w + j * ldw + p);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) s[r][j] = _mm512_fmadd_ps(x[r], wv, s[r][j]);
    }
  }
  if (tail) {
    __m512 x[R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) x[r] = _mm512_maskz_loadu_ps(tail, a + r * kc + kf);
    #pragma GCC unroll 4
    for (int j = 0; j < J; ++j) {
      const __m512 wv = vtc_widen16_tail(w + j * ldw + kf, kc - kf);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) s[r][j] = _mm512_fmadd_ps(x[r], wv, s[r][j]);
    }
  }
  if constexpr (R == 4 && J == 4) {  // the 16 sums at once: a short K (attention scores) pays no 16 reductions
    const __m512 v = vtc_reduce16(&s[0][0]);
    #pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m128 x = _mm512_extractf32x4_ps(v, r);
      _mm_storeu_ps(c + r * ldc, add ? _mm_add_ps(x, _mm_loadu_ps(c + r * ldc)) : x);
    }
  } else {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) c[r * ldc + j] = (add ? c[r * ldc + j] : 0.0f) + _mm512_reduce_add_ps(s[r][j]);
  }
}

// rows of a four at a time (16 accumulators: 8 loads per 16 FMAs), then two, then one
template <int PF, int J, typename TW>
static inline void vtc_dot(int64_t m, int64_t kc, const float* __restrict a, const TW* __restrict w, int64_t ldw,
                           float* __restrict c, int64_t ldc, bool add) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) vtc_dot_rows<PF, 4, J>(kc, a + i * kc, w, ldw, c + i * ldc, ldc, add);
  if (m - i >= 2) { vtc_dot_rows<PF, 2, J>(kc, a + i * kc, w, ldw, c + i * ldc, ldc, add); i += 2; }
  if (m - i >= 1) vtc_dot_rows<PF, 1, J>(kc, a + i * kc, w, ldw, c + i * ldc, ldc, add);
}

// columns [0, n) of a skinny tile, VTC_DOT_J weight rows at a time
template <int PF, typename TW>  // TW: float, or float16 widened as it is read (a float16 GEMM's weight)
__attribute__((noinline)) static void vtc_dot_cols(int64_t m, int64_t n, int64_t kc, const float* a, const TW* w,
                                                   int64_t ldw, float* c, int64_t ldc, bool add) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) vtc_dot<PF, 4>(m, kc, a, w + j * ldw, ldw, c + j, ldc, add);
  switch (n - j) {
    case 3: vtc_dot<PF, 3>(m, kc, a, w + j * ldw, ldw, c + j, ldc, add); break;
    case 2: vtc_dot<PF, 2>(m, kc, a, w + j * ldw, ldw, c + j, ldc, add); break;
    case 1: vtc_dot<PF, 1>(m, kc, a, w + j * ldw, ldw, c + j, ldc, add); break;
  }
}

// c[r * ldc + j] (+)= sum_p a[r * kc + p] * b[p * 32 + j % 32 + j / 32 * 32 * kc] for r < R, j < cols <= 32 * P:
// R skinny rows of A (packed as rows, kc floats each: R short streams in L1, where an MR-row panel would be read
// at 48 bytes a k step, 96 KB a 2048-deep slice from L2, next to B's stream) against P panels of a weight packed
// once (packed_panels: kc x 32 floats each, one stream per panel, no row stride to jump); each k step broadcasts
// R elements of A and loads 2 P vectors of B, each once: VTC_SKINNY_B_IN_REG keeps them in registers (GCC 12
// folded the loads into the FMAs at 2-4 rows of two panels: R x 4 loads of B a step instead of 4, the loop bound
// by the one 512-bit load a cycle of Zen 4 rather than by its one FMA a cycle; docs/gemm.md, session 28)
template <int R, int P>
static inline void vtc_skinny_pk(int64_t kc, const float* __restrict a, const float* __restrict b,
                                 float* __restrict c, int64_t ldc, bool add, int64_t cols) {
  __m512 acc[R][2 * P];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int v = 0; v < 2 * P; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kc; ++p) {
    __m512 bv[2 * P];
    #pragma GCC unroll 4
    for (int v = 0; v < 2 * P; ++v) {
      bv[v] = _mm512_loadu_ps(b + (v / 2) * 32 * kc + p * 32 + 16 * (v % 2));
#if VTC_SKINNY_B_IN_REG && (defined(__GNUC__) || defined(__clang__))
      if (R > 1) __asm__("" : "+v"(bv[v]));  // loaded once, not folded into each row's FMA
#endif
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * kc + p]);
      #pragma GCC unroll 4
      for (int v = 0; v < 2 * P; ++v) acc[r][v] = _mm512_fmadd_ps(x, bv[v], acc[r][v]);
    }
  }
  #pragma GCC unroll 4
  for (int v = 0; v < 2 * P; ++v) {
    const int64_t left = cols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mk = (__mmask16)(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float* cr = c + r * ldc + 16 * v;
      const __m512 x = add ? _mm512_add_ps(acc[r][v], _mm512_maskz_loadu_ps(mk, cr)) : acc[r][v];
      _mm512_mask_storeu_ps(cr, mk, x);
    }
  }
}

// R rows against the (one or two) panels of cols <= 64 columns: both panels at once up to 6 rows (24
// accumulators), one after the other from 7
template <int R>
static inline void vtc_skinny_pk_rows(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, bool add,
                                      int64_t cols) {
  if constexpr (R <= 6) {
    if (cols > 32) {
      vtc_skinny_pk<R, 2>(kc, a, b, c, ldc, add, cols);
      return;
    }
  }
  vtc_skinny_pk<R, 1>(kc, a, b, c, ldc, add, std::min<int64_t>(32, cols));
  if (cols > 32) vtc_skinny_pk<R, 1>(kc, a, b + 32 * kc, c + 32, ldc, add, cols - 32);
}

// C[m x n] (+)= A (m rows of kc floats, as _pack_a packs them with rows) @ B's panels packed once (the
// block at (k0, n0) of packed_panels, n0 a multiple of 32): per pair of B panels, each VTC_MR rows of A in
// equal chunks of at most VTC_SKINNY_R (9-11 rows: two chunks, the second reading the pair from L1 / L2)
__attribute__((noinline)) static void vtc_skinny_packed(int64_t m, int64_t n, int64_t kc, const float* a, const float* b,
                                                        float* c, int64_t ldc, bool add) {
  for (int64_t j = 0; j < n; j += 64) {
    const int64_t cols = std::min<int64_t>(64, n - j);
    for (int64_t i0 = 0; i0 < m; i0 += VTC_MR) {
      const int64_t pr = std::min<int64_t>(VTC_MR, m - i0), nch = (pr + VTC_SKINNY_R - 1) / VTC_SKINNY_R;
      for (int64_t h = 0; h < nch; ++h) {
        const int64_t lo = pr * h / nch, r = pr * (h + 1) / nch - lo;
        const float* ai = a + (i0 + lo) * kc;
        const float* bj = b + j * kc;
        float* ci = c + (i0 + lo) * ldc + j;
        switch (r) {
          case 8: vtc_skinny_pk_rows<8>(kc, ai, bj, ci, ldc, add, cols); break;
          case 7: vtc_skinny_pk_rows<7>(kc, ai, bj, ci, ldc, add, cols); break;
          case 6: vtc_skinny_pk_rows<6>(kc, ai, bj, ci, ldc, add, cols); break;
          case 5: vtc_skinny_pk_rows<5>(kc, ai, bj, ci, ldc, add, cols); break;
          case 4: vtc_skinny_pk_rows<4>(kc, ai, bj, ci, ldc, add, cols); break;
          case 3: vtc_skinny_pk_rows<3>(kc, ai, bj, ci, ldc, add, cols); break;
          case 2: vtc_skinny_pk_rows<2>(kc, ai, bj, ci, ldc, add, cols); break;
          default: vtc_skinny_pk_rows<1>(kc, ai, bj, ci, ldc, add, cols); break;
        }
      }
    }
  }
}
#endif

// a per-thread scratch buffer of at least n floats, 64-byte aligned, kept for the thread's lifetime; slots 0-2:
// the GEMM loops' packs and staging; 3-5: the blocks of a convolution's dot form (conv_t) or broadcast form
// (conv_bcast), which live while those kernels run the GEMM's packs into slots 0-2
static inline float* vtc_gemm_scratch(int which, int64_t n) {
  static thread_local float* buf[6] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  static thread_local int64_t cap[6] = {0, 0, 0, 0, 0, 0};
  if (cap[which] < n) {
    std::free(buf[which]);
    buf[which] = (float*)std::aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
    cap[which] = n;
  }
  return buf[which];
}
#endif
"""

MR, NC, MC_ROWS, SKINNY_NC = 12, 1024, 144, 128  # VTC_MR, VTC_NC, VTC_MC, the skinny nc on AVX-512 (tested)


def column_blocks(batch: int, m: int, n: int, k: int, threads: int, weight_rows: bool = False,
                  b_packed: bool = False) -> int:
    """How many column blocks of N generate's kernel cuts (it packs A once per block, on whichever thread takes
    it): N / NC (SKINNY_NC at M <= SKINNY_M), made a multiple of the threads where they split N; the
    arithmetic of generate's C lines on AVX-512, for the planner's inlining rule (vtc.codegen.gemm_inline);
    weight_rows: the kernel takes that path (``kernel_path``: full NC blocks at any M); b_packed: the kernel
    gets B packed once (the panels' ``bpk``: then a small B has the threads split M, ``PACKED_M_SPLIT``)."""
    nc = SKINNY_NC if m <= SKINNY_M and not weight_rows else NC
    tm, tn = -(-m // MC_ROWS), -(-n // nc)
    nt = threads if parallel_worth(batch, m, n, k) and threads > 1 else 1
    m_split = (b_packed and PACKED_M_SPLIT and not weight_rows and k * n <= PACKED_M_SPLIT_B // 4
               and PACKED_M_SPLIT_MIN_M <= m <= nt * MC_ROWS)  # one block a thread: even to a tile
    if nt > 1 and ((batch * tm * tn) % nt or (SPLIT_N_FOR_B and batch * tn < nt and n > m and not m_split)):
        if not ((m >= n or m_split) and m >= 2 * nt * (32 if weight_rows and WT_SPLIT_NR else MR)):  # else M is split
            tn = -(-tn // nt) * nt
    return tn


PARALLEL_MIN_FLOPS = 1 << 22  # about 30 us on one thread: below it, forking costs more than it saves
# B's bytes from which a GEMM with fewer flops forks all the same: a one-row x @ W^T over a 1024 x 1024 W
# (2 MFLOP, 4 MB) is a read of W, ~43 us on one thread of Zen 5 and ~29 us on two (docs/gemm.md, session 14)
PARALLEL_MIN_B_BYTES = 1 << 20


def parallel_worth(batch, m, n, k) -> bool:
    """Whether the kernel splits its work over the threads: enough flops, or enough of B to read (a skinny
    product is a read of B).  Both are products of sizes, as the C condition of ``parallel_condition``."""
    return 2 * batch * m * n * k >= PARALLEL_MIN_FLOPS or 4 * batch * n * k >= PARALLEL_MIN_B_BYTES


def parallel_condition(batch, m, n, k) -> str:
    """parallel_worth as the C condition of generate's kernels (the sizes as literals: vtc.runtime.generic
    reads each literal as a product of sizes)."""
    return f"({2 * batch * m * n * k}LL >= {PARALLEL_MIN_FLOPS}LL || {4 * batch * n * k}LL >= {PARALLEL_MIN_B_BYTES}LL)"
SKINNY_KC = 2048  # reduction block for M <= SKINNY_M (B panels of SKINNY_KC x 4 NR floats stay in L2)


def _strided(s: Scalar, g: GemmOperands, em) -> tuple[str, str, dict[str, int], Expr] | None:
    """An operand that is one load, as (buffer, per-tile offset in C, {loop var: stride}, rest); else None.

    Its offset into the buffer is split into: terms of the batch index alone (the tile's base: the GQA
    head mapping h // group lands here), constant strides of the row, column and reduction indices,
    and `rest`, every other term (a gathered row's index, a division by a non-batch index): const 0
    for a plain strided operand.
    """
    if s.op != "load":
        return None
    buf, idx = s.args
    lin = linear_offset(idx, em.shapes[buf])
    bv, mv, nv = g.vars
    c, terms = _terms(lin)
    base, rest, coeffs = lift(c), lift(0), {}
    for atom, k in terms.items():
        if atom.op == "var" and atom.args[0] in (mv, nv, "r"):
            coeffs[atom.args[0]] = k
        elif free_vars(atom) <= {bv}:
            base = base + atom * k
        else:
            rest = rest + atom * k
    return buf, em.index(base), coeffs, rest


def _unwidened(s: Scalar) -> Scalar:
    """The float16 load of an operand that is one widened to float32 (a float16 GEMM's, ``narrowed``), else s.  The
    paths that read such an operand through a pointer (the pack loops' strided branches, the dot path) widen as
    they read (``vtc_widen16`` / ``vtc_widen1``, ``_elem``); the others see a cast and take the general loops."""
    if s.op == "cast" and s.dtype == torch.float32 and s.args[0].op == "load" and s.args[0].dtype == F16:
        return s.args[0]
    return s


def _elem(load: Scalar) -> tuple[str, Callable[[str], str]]:
    """(C element type of the buffer an operand's `load` reads, C of one element of it read as a float)."""
    if load.dtype == F16:
        return "uint16_t", lambda x: f"vtc_from_f16({x})"
    return "float", lambda x: x


WT_MIN_M = 12  # from here (below: the dot-product path; at 16 rows the micro-kernel uses half its panel: H = 1)
WT_MAX_M = 128  # rows of A up to which C = A @ W^T reads W in place ("weight_rows": A^T in one L2 block)
WT_KC = 2048  # its reduction block (A^T's M x KC block stays in L2; C is touched once per block) and
WT_STREAM_BYTES = 8 << 20  # a C from this size on is stored with streaming stores (a logits GEMM's 16 MB: its
#                            transposed 12-column tile stores each read a line of C for ownership first)
WT_PACKED_MAX_BYTES = 16 << 20  # a constant W up to this size is packed once and run on the panels at 17..WT_MAX_M
#                                 rows where they pad M less (_panels_pad_less; docs/gemm.md, last section)


def _panels_pad_less(m: int) -> bool:
    """True where the panels' 12-row tiles pad m rows less than weight_rows' 32-column A^T panels (49: 60 rows
    computed against 64; 24, 100, 17; not 32, 64, 96, 128): there the panels on W packed once ran 17-30% faster
    than weight_rows on Zen 5, and at 64 / 128 rows 2-8% slower."""
    return -(-m // MR) * MR < -(-m // 32) * 32

WT_SPLIT_NR = True  # weight_rows' M split over the threads in multiples of NR (its A^T panels), not of MR
WT_GROUP = 48  # C columns staged before they are streamed out: 4 strips of 12, 3 cache lines per row
WT_GROUP_F16 = 96  # a float16 result's columns staged before its epilogue (_weight_rows): 8 strips of 12, 3 lines of
#                    float16 per row (64 and 128 ran as fast; 32 and 48, with streaming stores, slower)


def _plain(s: Scalar, g: GemmOperands, shapes: dict) -> dict[str, int] | None:
    """{row / column / reduction var: stride} of an operand that is one plain strided load (its other terms
    depend on the batch index alone); else None."""
    if s.op != "load":
        return None
    buf, idx = s.args
    _, terms = _terms(linear_offset(idx, shapes[buf]))
    bv, mv, nv = g.vars
    coeffs = {}
    for atom, c in terms.items():
        if atom.op == "var" and atom.args[0] in (mv, nv, "r"):
            coeffs[atom.args[0]] = c
        elif not free_vars(atom) <= {bv}:
            return None
    return coeffs


def kernel_path(g: GemmOperands, shapes: dict, packed: str = "") -> str:
    """The loops the generated kernel of g runs on AVX-512 (``generate``), for the report:

    - "dot": M < WT_MIN_M and B = W^T of a row-major weight: dot products against W's rows (``_dot_path``);
    - "packed_dot": M <= SKINNY_M, N and K as in vtc.codegen.gemm_dot, B with unit stride along k through any
      mapping: B^T and A packed as rows, then the dot products;
    - "b_rows": M <= SKINNY_M and B with unit stride along n: the micro-kernel reads B's rows in place (at M <= 2
      ``vtc_ukr_rows``: WIDE_U rows of B per pass over a block of up to WIDE_NC columns, C accumulated in L1:
      ``_wide_rows``);
    - "weight_rows": WT_MIN_M <= M <= WT_MAX_M, B = W^T and A a plain strided operand: the kernel computes
      C^T = W @ A^T with W's rows read in place as the broadcast operand (no B pack: a logits GEMM's weight
      is 32000 x 512, each element used only M times) and A^T packed once per thread (``_weight_rows``);
    - "panels": both operands packed into panels (Goto's algorithm);
    - `packed` (``_packed_path``) where the call plan passes B packed once: SKINNY_PACKED_PATH at 1..SKINNY_M rows
      (``vtc_skinny_packed``, instead of "dot" or "weight_rows"), "panels" (instead of "weight_rows" at rows
      that the 12-row tiles pad less, ``_panels_pad_less``).
    """
    if g.pack_b is not None or g.dtype != torch.float32:
        return "panels"
    if packed:
        return packed
    nv = g.vars[2]
    cb = _plain(g.b, g, shapes)
    if WT_MIN_M <= g.m <= WT_MAX_M and _wt_operands(g, shapes):
        return "weight_rows"
    if g.m <= SKINNY_M:
        cd = _plain(_unwidened(g.b), g, shapes)  # the dot path reads a float16 weight too (``_dot_path``)
        if cd is not None and cd.get("r", 0) == 1 and abs(cd.get(nv, 0)) != 1:
            return "dot"
        if gemm_dot.applies(g, shapes):
            return gemm_dot.PATH
        return "b_rows" if cb is not None and cb.get(nv, 0) == 1 else "panels"
    return "panels"


def _wt_operands(g: GemmOperands, shapes: dict) -> bool:
    """True where the operands allow the "weight_rows" path whatever M: float32, B = W^T of a plain strided W
    (unit stride along k, rows more than one float apart) and A a plain strided operand."""
    if g.pack_b is not None or g.dtype != torch.float32:
        return False
    cb = _plain(g.b, g, shapes)
    return (cb is not None and cb.get("r", 0) == 1 and abs(cb.get(g.vars[2], 0)) > 1
            and _plain(g.a, g, shapes) is not None)


def _weight_rows(em, g: GemmOperands, ind: str, bt: str, stream: bool, row0: str, rows_packed: bool,
                 epilogue: list[str]) -> list[str]:
    """The "weight_rows" loops (``kernel_path``) of an M block, ending the KC slice (``continue``), where the
    kernel's ``wt_rows`` holds: A^T packed into NR-column panels (once per thread and slice: skipped while
    the batch, M block and slice are those of the last pack), then per 12-row strip of W (C's columns) the
    transposed micro-kernel over the A^T panels; C staged and streamed where ``wt_stream`` holds (`stream`:
    the kernel has no epilogue to read C back).  The tests are on M at run time, so a size-generic kernel
    (vtc.runtime.generic) has the same text on both sides of WT_MAX_M.  `row0`: the block's first row in C
    (``generate``'s).  `rows_packed` (a float16 GEMM, ``_f16_weight_rows``): W is the caller's widened copy
    (``wpk``, ``widened_rows``) and A is widened as it is packed.  `epilogue` (a ``narrowed`` kernel's in one
    reduction slice): the tiles of each group of WT_GROUP_F16 columns are staged and the epilogue run over the
    group while it is in L1 / L2, storing through the caches (strips_done then skips the block's).  Nothing where the operands do not allow the
    path."""
    if not (rows_packed or _wt_operands(g, em.shapes)):
        return []
    _, mv, nv = g.vars
    a = _unwidened(g.a)
    abuf, aoff, ca, _ = _strided(a, g, em)
    sm, sk = ca.get(mv, 0), ca.get("r", 0)
    if rows_packed:
        wsrc, ldw = "wpk + n0 * K + k0", g.k
    else:
        bbuf, boff, cb, _ = _strided(g.b, g, em)
        wsrc, ldw = f"{em.ptr[bbuf]} + {boff} + n0 * {cb[nv]} + k0", cb[nv]
    elem, widen = _elem(a)
    src = f"{em.ptr[abuf]} + {aoff} + m0 * {sm} + k0 * {sk}"
    if sk == 1:
        pack = [f"{ind}    for (int64_t ir = 0; ir < mb; ir += VTC_NR)",
                f"{ind}      vtc_pack_at(src + ir * {sm}, {sm}, std::min<int64_t>(VTC_NR, mb - ir), kb, ap + ir * kb);"]
    else:
        pack = [f"{ind}    for (int64_t ir = 0; ir < mb; ir += VTC_NR)",
                f"{ind}      for (int64_t pp = 0; pp < kb; ++pp)",
                f"{ind}        for (int64_t j = 0; j < VTC_NR; ++j)",
                f"{ind}          ap[ir * kb + pp * VTC_NR + j] = ir + j < mb ? {widen(f'src[(ir + j) * {sm} + pp * {sk}]')} : 0.0f;"]
    def tile(group: int = 0) -> list[str]:
        return [f"{ind}      vtc_ukr_wt_edge<{ldw}, {1 if g.m <= SKINNY_M else 2}>((int)std::min<int64_t>(VTC_MR, "
                f"{'jg + gb' if group else 'nb'} - jr), std::min<int64_t>(VTC_NR, mb - ir), kb, w + jr * {ldw}, ap + ir * kb,",
                f"{ind}          {f'stage + ir * {group} + jr - jg, {group}' if group else 'ct + ir * LDC + jr, LDC'}, "
                f"k0 > 0, ir == 0 && jr + 2 * VTC_MR <= nb ? w + (jr + VTC_MR) * {ldw} : nullptr);"]

    def staged(group: int, done: list[str]) -> list[str]:
        return [f"{ind}  float* __restrict stage = vtc_gemm_scratch(2, mb * {group});",
                f"{ind}  for (int64_t jg = 0; jg < nb; jg += {group}) {{  // strips of W, a group's C tiles staged",
                f"{ind}    const int64_t gb = std::min<int64_t>({group}, nb - jg);",
                f"{ind}    for (int64_t jr = jg; jr < jg + gb; jr += VTC_MR)",
                f"{ind}      for (int64_t ir = 0; ir < mb; ir += VTC_NR)",
                *["  " + x for x in tile(group)],
                *done,
                f"{ind}  }}"]
    loops = [f"{ind}  for (int64_t jr = 0; jr < nb; jr += VTC_MR)  // a strip of W in L1, the A^T panels from L2",
             f"{ind}    for (int64_t ir = 0; ir < mb; ir += VTC_NR)",
             *tile()]
    if stream:  # C written by full lines, bypassing the caches: a large C is not read for ownership
        loops = [f"{ind}  if (wt_stream) {{",
                 *staged(WT_GROUP, [f"{ind}    vtc_stream_rows(stage, {WT_GROUP}, ct + jg, LDC, mb, gb);"]),
                 f"{ind}  }} else",
                 *loops]
    elif epilogue:  # (the group's rows stored through the caches: c_large's streaming stores ran ~5% slower here)
        cached = " const bool c_large = false;" if any("c_large" in x for x in epilogue) else ""
        loops = [*staged(WT_GROUP_F16, [f"{ind}    {{ const int64_t n0g = n0 + jg;  // the group through the epilogue",
                                        f"{ind}      {{ const int64_t n0 = n0g, nb = gb, LDC = {WT_GROUP_F16}; float* __restrict const ct = stage;{cached}",
                                        *epilogue,
                                        f"{ind}    }} }}"]),
                 f"{ind}  strips_done = true;"]
    return [f"{ind}#if defined(__AVX512F__)",
            f"{ind}if (wt_rows) {{",
            f"{ind}for (int64_t mi = mlo; mi < mhi; ++mi) {{",
            f"{ind}  const int64_t m0 = mi * mc, mb = std::min<int64_t>(mc, M - m0);",
            f"{ind}  float* __restrict ct = cg + {row0} * LDC;",
            f"{ind}  if (({bt} * tm + mi) * K + k0 != a_key) {{  // A^T of this block and slice not packed yet",
            f"{ind}    a_key = ({bt} * tm + mi) * K + k0;",
            f"{ind}    const {elem}* __restrict src = {src};",
            *pack,
            f"{ind}  }}",
            f"{ind}  const float* __restrict w = {wsrc};",
            *loops,
            f"{ind}}}",
            f"{ind}continue;",
            f"{ind}}}",
            f"{ind}#endif"]


def _weight_packing(em, g: GemmOperands) -> tuple:
    """(lazy, spec, skinny, packed_weight) of ``generate``: ``_lazy_b``, ``_packed_spec``, ``_skinny_spec`` (where
    spec is None) and the spec the call plan packs once (vtc.runtime.packed), or None.

    None where the weight_rows path runs (it packs no B); weight_rows rows on a constant W of at most
    WT_PACKED_MAX_BYTES: the panels on W packed once where they pad M less (the C tests the pointer, so a
    size-generic kernel or a runtime W still reads W in place); 1..SKINNY_M rows: vtc_skinny_packed where
    ``_skinny_packed_rows``; a float16 W^T at weight_rows rows (``_f16_weight_rows``): W widened as rows
    (``widened_rows``) for the weight_rows path."""
    wt = _wt_operands(g, em.shapes)
    lazy = _lazy_b(em, g) if LAZY_B else None  # (None at M <= SKINNY_M, where the dot / direct paths run)
    spec = _packed_spec(em, g, lazy)
    skinny = _skinny_spec(em, g) if spec is None else None  # the dot path's weight, packed once (_skinny_packed_rows)
    m = g.m
    wt_packed = spec is not None and wt and g.k * g.n * 4 <= WT_PACKED_MAX_BYTES and _panels_pad_less(m)
    packed_weight = None if spec is None or (wt and WT_MIN_M <= m <= WT_MAX_M and not wt_packed) else spec
    if skinny is not None and _skinny_packed_rows(m, g.k * g.n * 4, f16=_unwidened(g.b) is not g.b):
        packed_weight = skinny
    if spec is not None and _f16_weight_rows(g, em.shapes):
        packed_weight = spec._replace(layout=widened_rows)
    return lazy, spec, skinny, packed_weight


def generate(k: Kernel) -> str:
    """The C++ source of gemm kernel k (with both preludes).

    Each thread takes a contiguous range of output blocks (batch x N chunk x M block, M innermost) and
    runs the BLIS loops over it: per N chunk and KC slice of the reduction it packs the B block once (a plain
    strided B panel by panel in the first row strip: ``_lazy_b``) and reuses it for all its M blocks, packing
    each MC x KC block of A; the micro-kernel runs over the
    MR x NR tiles of the block.  Blocks are made a multiple of the thread count by splitting the larger
    of M and N, so both threads get the same work.
    """
    from vtc.codegen.cpp import OMP_TEAM, PRELUDE, _Emitter, buffer_order, buffer_pointers

    g: GemmOperands = k.gemm
    if g.generate is not None:
        return g.generate(k)
    if g.dtype == gemm_bf16.BF16:
        return gemm_bf16.generate(k)
    em = _Emitter(k)
    bv, mv, nv = g.vars
    out = k.stores[0].buffer
    lines = buffer_pointers(k, em)
    M, N, KK, B = g.m, g.n, g.k, g.batch
    # a float16 result (``narrowed``): the sums go to the thread's float32 C of its block (``_narrowed_c``), which
    # the epilogue rounds into the output
    nar = narrowed(k)
    c = "cacc" if nar else em.ptr[out.name]
    lazy, spec, skinny, packed_weight = _weight_packing(em, g)
    # a float16 W^T widened as rows by the caller: the weight_rows loops on it, the panels (packing W per block)
    # where the copy is not passed
    rows_packed = packed_weight is not None and packed_weight.layout is widened_rows
    wt = rows_packed or _wt_operands(g, em.shapes)  # the weight_rows loops are in the kernel, taken where wt_rows holds
    # a large C that nothing reads back in the kernel (no epilogue): stored past the caches where wt_stream holds
    stream = wt and not nar and g.out_layout is None and k.stores[0].value.op == "acc" and len(k.stores) == 1
    # a float16 result in one reduction slice: its epilogue run over each staged group of columns (_weight_rows)
    group_epi = rows_packed and nar and NARROWED_STRIPS and g.k <= WT_KC
    bt = bv or "bt"
    ms_not, ms_or = (" && !m_split", " || m_split") if spec is not None and PACKED_M_SPLIT else ("", "")
    if packed_weight is None:
        g.__dict__.pop("packed_weight", None)
    else:
        g.packed_weight = packed_weight
    if spec is not None or skinny is not None:  # B packed once by the caller, passed after the buffers with PACKED_FLAG set
        lines += [f"  const float* __restrict wpk = (nthreads & {PACKED_FLAG}) ? (const float*)bufs[{len(buffer_order(k))}] : nullptr;",
                  f"  nthreads &= ~{PACKED_FLAG};"]
    # the accumulator: the kernel's own [batch, M, N] buffer, or a block of a pushed op's output
    cbase, ldc = (f"{bt} * M * N", N) if g.out_layout is None else (em.index(g.out_layout[0]), g.out_layout[1])
    lines += [
        f"  const int64_t M = {M}, N = {N}, K = {KK}, BATCH = {B}{'' if nar else f', LDC = {ldc}'};",
        f"  const int nt = {parallel_condition(B, M, N, KK)} && nthreads > 1 ? nthreads : 1;",
        "  int64_t mc = VTC_MC, nc = VTC_NC, kc = VTC_KC;",
        f"  if (M <= {SKINNY_M}) {{ nc = 4 * VTC_NR; kc = {SKINNY_KC}; }}  // skinny: long contiguous runs of B per panel",
        *_wide_rows_blocking(em, g),
        *([] if not wt else [
            f"  const bool wt_rows = M >= {WT_MIN_M} && M <= {WT_MAX_M}{' && wpk' if rows_packed else ' && !wpk' if spec is not None or skinny is not None else ''};  // the weight_rows path (kernel_path)",
            *([f"  const bool wt_stream = wt_rows && K <= {WT_KC} && BATCH * M * N * 4 >= {WT_STREAM_BYTES}LL;"]
              if stream else []),
            "#if defined(__AVX512F__)",
            f"  if (wt_rows) {{ kc = {WT_KC}; mc = M; nc = VTC_NC; }}  // A^T in one block, packed once",
            "#endif"]),
        "  kc = (K + (K + kc - 1) / kc - 1) / ((K + kc - 1) / kc);  // equal KC slices: no thin last one",
        *([] if spec is None else [  # (packed_panels: packed_kc's slices, N rounded up to 32)
            "  const int64_t KCP = (K + (K + VTC_KC - 1) / VTC_KC - 1) / ((K + VTC_KC - 1) / VTC_KC), NP = (N + VTC_NR - 1) / VTC_NR * VTC_NR;",
            "  const float* __restrict bpk = wpk && kc == KCP && VTC_NR == 32 ? wpk : nullptr;  // B's panels packed once"
            if not rows_packed else "  const float* __restrict bpk = nullptr;  // (wpk: W's rows, for weight_rows)"]),
        *([] if skinny is None else [  # (packed_panels at the skinny kc: SKINNY_KC's equal slices, N rounded up to 32)
            f"  const int64_t KCS = (K + (K + {SKINNY_KC} - 1) / {SKINNY_KC} - 1) / ((K + {SKINNY_KC} - 1) / {SKINNY_KC}), NP = (N + 31) / 32 * 32;",
            "  const float* __restrict bpk = wpk && kc == KCS && nc % 32 == 0 ? wpk : nullptr;  // W's panels packed once"]),
        "  int64_t tm = (M + mc - 1) / mc, tn = (N + nc - 1) / nc;",
        # blocks of equal size (3584 columns: 4 x 896, not 3 x 1024 + 512, which gave one of 2 threads 2048)
        *(["  mc = ((M + tm - 1) / tm + VTC_MR - 1) / VTC_MR * VTC_MR; tm = (M + mc - 1) / mc;",
           "  nc = ((N + tn - 1) / tn + VTC_NR - 1) / VTC_NR * VTC_NR; tn = (N + nc - 1) / nc;"]
          if EQUAL_BLOCKS else []),
        # equal work per thread: split the larger of M and N into a multiple of nt; also where the threads would
        # share B's column blocks while B is the larger operand (N > M): each would pack all of B, so N is split
        "  int64_t mr = VTC_MR, nr = VTC_NR;  // the granularity of an M / N split",
        *([] if not (wt and WT_SPLIT_NR) else [
            "#if defined(__AVX512F__)",
            "  if (wt_rows) { mr = VTC_NR; nr = VTC_MR; }  // weight_rows: A^T's NR-column panels, W's MR-row strips",
            "#endif"]),
        # B packed once (no pack to share out) and small: the rows are split, not N (each thread packs half of A)
        *([] if spec is None or not PACKED_M_SPLIT else [
            f"  const bool m_split = bpk && K * N <= {PACKED_M_SPLIT_B // 4}LL && M >= {PACKED_M_SPLIT_MIN_M} && M <= nt * VTC_MC;"]),
        f"  if ((BATCH * tm * tn) % nt{' || (BATCH * tn < nt && N > M' + ms_not + ')' if SPLIT_N_FOR_B else ''}) {{",
        f"    if ((M >= N{ms_or}) && M >= 2 * nt * mr) {{",
        "      tm = (tm + nt - 1) / nt * nt; mc = ((M + tm - 1) / tm + mr - 1) / mr * mr; tm = (M + mc - 1) / mc;",
        "    } else {",
        "      tn = (tn + nt - 1) / nt * nt; nc = ((N + tn - 1) / tn + nr - 1) / nr * nr; tn = (N + nc - 1) / nc;",
        "    }",
        "  }",
        *(_balanced_blocks("wt_stream" if wt and stream else "wt_rows" if group_epi else "",
                           WT_GROUP_F16 if group_epi else WT_GROUP) if BALANCED_BLOCKS else []),
        *_ksplit_head(em, g),
        *(_narrowed_c() if nar else []),
        "  const int64_t units = BATCH * tn * tm;",
        *OMP_TEAM,
        "    float* __restrict ap = vtc_gemm_scratch(0, (mc + VTC_NR) * kc);",
        *(["    float* __restrict cacc = vtc_gemm_scratch(3, mg * mc * LDC);"] if nar else []),
        *(["    int64_t a_key = -1;  // (batch * tm + M block) * K + k0 of the A^T block in ap (weight_rows)"]
          if wt else []),
        *(["    int64_t s_key = -1;  // (batch * tm + M block) * K + k0 of the A panel in ap (W packed once)"]
          if skinny is not None else []),
        "    float* __restrict bp = vtc_gemm_scratch(1, kc * nc);",
        *_ksplit_rows(em, g, c),
        "    const int64_t u1 = units * (tid + 1) / nth;",
        "    for (int64_t u = units * tid / nth; u < u1;) {",
        "      const int64_t grp = u / tm, mlo = u % tm, mhi = std::min<int64_t>(tm, mlo + "
        f"{'std::min<int64_t>(mg, u1 - u)' if nar else '(u1 - u)'});",
        "      u += mhi - mlo;",
        f"      const int64_t {bt} = grp / tn;",
        *(["      const int64_t jb = grp % tn, n0 = jb * nq_n / tn * nq, nb = std::min<int64_t>(N, (jb + 1) * nq_n / tn * nq) - n0;"]
          if BALANCED_BLOCKS else ["      const int64_t n0 = (grp % tn) * nc, nb = std::min<int64_t>(nc, N - n0);"]),
        f"      float* __restrict cg = {'cacc' if nar else f'{c} + {cbase} + n0'};",
        *(["      bool strips_done = false;  // the epilogue run strip by strip (_narrowed_strips)"]
          if nar and NARROWED_STRIPS else []),
        "      for (int64_t k0 = 0; k0 < K; k0 += kc) {",
        "        const int64_t kb = std::min<int64_t>(kc, K - k0);",
    ]
    block = ["for (int64_t mi = mlo; mi < mhi; ++mi) {",
             "  const int64_t m0 = mi * mc, mb = std::min<int64_t>(mc, M - m0);",
             f"  float* __restrict ct = cg + {'(mi - mlo) * mc' if nar else 'm0'} * LDC;"]  # (_weight_rows' too)
    ind = "        "
    lines += _weight_rows(em, g, ind, bt, stream, "(mi - mlo) * mc" if nar else "m0", rows_packed,
                          _epilogue(em, k, ind + "      ") if group_epi else [])
    dot = (_dot_path(em, g, ind, block) or gemm_dot.path_lines(em, g, ind, block, _pack_a, DOT_PF)) if g.pack_b is None else []
    if skinny is not None:  # W packed once (passed where 2 <= M < WT_MIN_M): its panels read as streams
        lines += [f"{ind}#if defined(__AVX512F__)",
                  f"{ind}if (bpk) {{",
                  *[ind + "  " + x for x in block],
                  f"{ind}    if (({bt} * tm + mi) * K + k0 != s_key) {{  // A packed once per thread and slice",
                  f"{ind}      s_key = ({bt} * tm + mi) * K + k0;",
                  *_pack_a(em, g, ind + "      ", rows=True),
                  f"{ind}    }}",
                  f"{ind}    vtc_skinny_packed(mb, nb, kb, ap, bpk + k0 * NP + n0 * kb, ct, LDC, k0 > 0);",
                  f"{ind}  }}",
                  f"{ind}  continue;",
                  f"{ind}}}",
                  f"{ind}#endif"]
    if dot:
        lines += dot
    direct = _direct_b(em, g) if g.pack_b is None else None
    if direct:
        src, ldb = direct
        lines += [f"{ind}#if defined(__AVX512F__)",
                  f"{ind}const float* __restrict bsrc = {src};",
                  f"{ind}const int64_t ldb = {ldb}, bstep = 1;  // B read in place: its rows are the panel rows",
                  *_wide_rows(em, g, ind, block),
                  f"{ind}const float* __restrict btail = nb % VTC_NR ?  // the last, narrower panel zero-padded",
                  f"{ind}    vtc_pad_cols(bsrc + nb / VTC_NR * VTC_NR, ldb, kb, nb % VTC_NR, bp) : nullptr;",
                  f"{ind}#else"]
    if lazy is None and spec is not None:  # (a float16 B: packed once by the caller, else per block here)
        lines += [f"{ind}if (!bpk) {{", *(g.pack_b or _pack_b)(em, g, ind + "  "), f"{ind}}}"]
    elif lazy is None:
        lines += (g.pack_b or _pack_b)(em, g, ind)  # in scope: batch index, k0, kb, n0, nb, bp
    else:
        lines.append(f"{ind}const float* __restrict bnext = {lazy[0]};  // B's block at (k0, n0): panels packed in the first strip")
    lines += [f"{ind}const float* __restrict bsrc = bp;" if spec is None else
              f"{ind}const float* __restrict bsrc = bpk ? bpk + k0 * NP + n0 * kb : bp;",
              f"{ind}const float* __restrict btail = nullptr;",
              f"{ind}const int64_t ldb = VTC_NR, bstep = kb;"]
    if direct:
        lines.append(f"{ind}#endif")
    lines += [ind + x for x in block]
    a_in_place = _a_in_place(em, g) if direct is None else None
    if a_in_place is None:
        lines += _pack_a(em, g, ind + "  ")
    else:  # A read in place on AVX-512 (vtc_ukr_a_edge): packed elsewhere only
        lines += ["#if !defined(__AVX512F__)", *_pack_a(em, g, ind + "  "), "#endif"]
    tile = [f"{ind}      vtc_ukr_edge((int)std::min<int64_t>(VTC_MR, mb - ir), cols, kb, ap + ir * kb,",
            f"{ind}                   tail ? btail : bsrc + jr * bstep, tail ? VTC_NR : ldb, ct + ir * LDC + jr, LDC, k0 > 0);"]
    if a_in_place is not None:
        asrc, lda = a_in_place
        tile = ["#if defined(__AVX512F__)",
                f"{ind}      vtc_ukr_a_edge<{lda}>((int)std::min<int64_t>(VTC_MR, mb - ir), cols, kb, {asrc} + ir * {lda},",
                f"{ind}                   tail ? btail : bsrc + jr * bstep, tail ? VTC_NR : ldb, ct + ir * LDC + jr, LDC, k0 > 0);",
                "#else", *tile, "#endif"]
    strips = _narrowed_strips(em, k, ind + "    ") if nar and NARROWED_STRIPS else []
    lines += [
        f"{ind}  for (int64_t ir = 0; ir < mb; ir += VTC_MR) {{  // an A micro-panel stays in L1, B panels stream from L2",
        f"{ind}    for (int64_t jr = 0; jr < nb; jr += VTC_NR) {{",
        f"{ind}      const int64_t cols = std::min<int64_t>(VTC_NR, nb - jr);",
        f"{ind}      const bool tail = btail && cols < VTC_NR;",
        *([] if lazy is None else _lazy_b_panel(em, g, lazy, ind + "      ", spec is not None, a_in_place is not None)),
        *tile,
        f"{ind}    }}",
        *strips,
        f"{ind}  }}",
        f"{ind}}}",
        "      }",
    ]
    epi = _epilogue(em, k, "        ")
    if epi:
        lines += [*(["      if (!strips_done)"] if strips else []), *["      " + x for x in block], *epi, "      }"]
    lines += ["    }", "  }", *_ksplit_finish(em, k)]
    head = PRELUDE + RUNTIME + gemm_pack.RUNTIME + g.runtime
    return head + f'\nextern "C" void {k.name}(void* const* bufs, int nthreads) {{\n' + "\n".join(lines) + "\n}\n"


ROWS_THEN_PANEL = True  # A through a mapping / an inlined producer: strips computed as rows, then transposed
EQUAL_BLOCKS = True  # M and N blocks of equal size (rounded to the micro-tile), not full blocks and a thin last one
BALANCED_BLOCKS = True  # column blocks of whole steps of nq columns differing by one step at most (_balanced_blocks)


def _balanced_blocks(staged: str, group: int) -> list[str]:
    """The C lines, after the thread split, that set the column blocks' step: block jb of tn covers steps
    [jb * nq_n / tn, (jb + 1) * nq_n / tn) of nq columns, so the threads' column ranges differ by one step at
    most; blocks of nc with a short last one gave one of 2 threads 25600 of the 50257 columns of GPT-2's logits
    (the other 24657) and 16384 of Llama's 32000.  nq: the split's step nr (whole B panels; weight_rows: whole
    12-row strips of W), where the C condition `staged` holds whole staged groups of `group` columns (on cache
    lines of C: ``_weight_rows``)."""
    return ["  int64_t nq = nr;  // a column block starts on a multiple of nq",
            *([] if not staged else ["#if defined(__AVX512F__)",
                                     f"  if ({staged}) nq = {group};  // whole staged groups, on cache lines of C",
                                     "#endif"]),
            "  const int64_t nq_n = (N + nq - 1) / nq;",
            "  nc = std::max<int64_t>(nc, (nq_n + tn - 1) / tn * nq);  // the widest block"]


SPLIT_N_FOR_B = True  # threads that would share B's column blocks (B the larger operand) split N instead of M
LAZY_B = True  # B's panels packed in the block's first row strip, the next panel's source prefetched (_lazy_b);
#               False: the whole KC x NC block packed before the strips (the A/B in docs/gemm.md, last section)
PACKED_M_SPLIT = True  # B packed once and small: 2+ threads split M, not N (docs/gemm.md, helper panels2t)
PACKED_M_SPLIT_B = 1 << 18  # B's bytes (K x N floats) up to which (read whole by each thread from L2) ...
PACKED_M_SPLIT_MIN_M = 16 * MR  # ... and rows from which (at least 8 MR-row tiles a thread: little imbalance), up
#                                  to one MC block a thread (more: equal blocks, 300 rows as 84 x 3 + 48, 168 / 132)
F16_PACKED_B = True  # a float16 constant B too: the call plan packs it once widened into the same float32 panels
PACKED_B = True  # a constant B (W^T of a weight, or a row-major weight) that _lazy_b would pack per call: the kernel
#                  also takes its panels packed once by the caller (packed_panels; vtc.runtime.packed) (docs/gemm.md)


def packed_kc(k: int) -> int:
    """The KC slice the AVX-512 kernel cuts a reduction of k into where it runs the panels (``generate``'s C:
    VTC_KC = 256, equal slices; the kernel takes no packed B where its kc differs)."""
    slices = -(-k // 256)
    return -(-k // slices)


def packed_panels(w: torch.Tensor, offset: int, lda: int, rows: int, cols: int, *, kc: int, wt: bool) -> torch.Tensor:
    """B packed as the AVX-512 kernel's panels read it, from the weight rows ``W[i, j] = w.flatten()[offset +
    i * lda + j]`` (i < rows, j < cols): B = W^T (`wt`: K = cols, N = rows) or B = W (K = rows, N = cols).  Per
    KC slice (``packed_kc``) at k0, ceil(N / 32) panels of kb x 32 floats (zero past N): B[k0 + p, 32 j + c] at
    ``k0 * NP + j * 32 * kb + p * 32 + c`` (NP = N rounded up to 32), so the block at (k0, n0) starts at
    ``k0 * NP + n0 * kb``."""
    rows_ = w.detach().as_strided((rows, cols), (lda, 1), w.storage_offset() + offset)
    b = rows_.t() if wt else rows_
    kk, n = b.shape
    npad = -(-n // 32) * 32
    out = torch.zeros(kk * npad, dtype=torch.float32)  # (a float16 w widened)
    for k0 in range(0, kk, kc):
        kb = min(kc, kk - k0)
        blk = out[k0 * npad:(k0 + kb) * npad].view(npad // 32, kb, 32)
        blk[: n // 32] = b[k0:k0 + kb, : n // 32 * 32].reshape(kb, n // 32, 32).transpose(0, 1)
        if n % 32:
            blk[n // 32, :, : n % 32] = b[k0:k0 + kb, n // 32 * 32:]
    return out


def widened_rows(w: torch.Tensor, offset: int, lda: int, rows: int, cols: int) -> torch.Tensor:
    """The weight rows ``W[i, j] = w.flatten()[offset + i * lda + j]`` (i < rows, j < cols) as float32, row-major
    and contiguous: a float16 B = W^T as the weight_rows path reads it in place (``_f16_weight_rows``)."""
    rows_ = w.detach().as_strided((rows, cols), (lda, 1), w.storage_offset() + offset)
    return rows_.to(torch.float32).contiguous().reshape(-1)


def _f16_weight_rows(g: GemmOperands, shapes: dict) -> bool:
    """True where a float16 GEMM (operands widened, ``narrowed``) runs the weight_rows path on its W^T widened
    once by the call plan (``widened_rows``, where ``_packed_spec`` gives a spec): A and W plain strided float16
    loads as ``_wt_operands`` asks of float32's, WT_MIN_M..WT_MAX_M rows that the panels do not pad less (as
    float32's on W packed once).  Before, every float16 GEMM ran the panels, 128 x 512 -> 32000 (Llama's logits)
    ~2 ms behind float32's weight_rows (docs/low_precision.md, helper head16)."""
    a, b = _unwidened(g.a), _unwidened(g.b)
    if not F16_WEIGHT_ROWS or g.pack_b is not None or a is g.a or b is g.b or not WT_MIN_M <= g.m <= WT_MAX_M:
        return False
    cb = _plain(b, g, shapes)
    return (cb is not None and cb.get("r", 0) == 1 and abs(cb.get(g.vars[2], 0)) > 1
            and _plain(a, g, shapes) is not None and not _panels_pad_less(g.m))


F16_WEIGHT_ROWS = True  # a float16 W^T at weight_rows rows: widened as rows once, the weight_rows path (_f16_weight_rows)


def _packed_spec(em, g: GemmOperands, lazy: tuple[str, int, int] | None) -> packed.WeightSpec | None:
    """What a caller may pack once and pass with PACKED_FLAG (``vtc.runtime.packed.PackedConvWeight``'s spec:
    the weight's buffer, offset, row stride, rows, columns and ``packed_panels`` as its layout), or None: B
    packed panel by panel in the first strip (``_lazy_b``) from one buffer at a constant offset with no
    batch term, static sizes, AVX-512."""
    from functools import partial

    from vtc.codegen.conv_t import has_avx512

    if lazy is None and F16_PACKED_B and g.pack_b is None and g.m > SKINNY_M and _unwidened(g.b) is not g.b:
        lazy = _b_source(em, g)  # a float16 B: packed once widened, else per block before the strips
    if not PACKED_B or lazy is None or not has_avx512() or not all(isinstance(x, int) for x in (g.m, g.n, g.k)):
        return None
    buf, idx = _unwidened(g.b).args
    c, terms = _terms(linear_offset(idx, em.shapes[buf]))
    if any(not (atom.op == "var" and atom.args[0] in (g.vars[2], "r")) for atom in terms):
        return None  # a batch or other term: not one weight for all of the kernel
    _, mode, _ = lazy
    co = {atom.args[0]: k for atom, k in terms.items()}
    sn, sk = co.get(g.vars[2], 0), co.get("r", 0)
    offset = int(c)
    if mode == 2:  # B = W^T: N rows of K floats, sn apart
        return packed.WeightSpec(buf, offset, sn, g.n, g.k, partial(packed_panels, kc=packed_kc(g.k), wt=True))
    return packed.WeightSpec(buf, offset, sk, g.k, g.n, partial(packed_panels, kc=packed_kc(g.k), wt=False))


SKINNY_PACKED = True  # the dot path's weight (B = W^T, M <= SKINNY_M) packed once into packed_panels (docs/gemm.md)
SKINNY_PACKED_MAX_M = SKINNY_M  # up to here: WT_MIN_M..SKINNY_M rows instead of weight_rows, on a W of at least
F16_SKINNY_PACKED_MIN_M = 2  # one row on a float16 W: the dot path reading it in place (half the bytes) was as fast
SKINNY_PACKED_WT_MIN_BYTES = 1 << 19  # this size (a smaller W, read in place from L2, was as fast or faster)


def _skinny_packed_rows(m: int, w_bytes: int, f16: bool = False) -> bool:
    """Whether m rows of A run vtc_skinny_packed on W packed once (a W of `w_bytes`): 2..WT_MIN_M - 1 rows (else the
    dot path), and one row (else the dot path) or WT_MIN_M..SKINNY_PACKED_MAX_M rows (else weight_rows) on a W of at
    least SKINNY_PACKED_WT_MIN_BYTES: on Zen 5, 1 thread, 16 x 1024 -> 1024 0.168 -> 0.142 ms, 12 x 1024 -> 1024
    0.170 -> 0.104, but 16 x 256 -> 256 0.0117 -> 0.0126 (docs/gemm.md, session 15); one row 1 x 1024 -> 4096 0.259
    -> 0.244, 1 x 4096 -> 1024 0.273 -> 0.236 ms, level at 512 x 512 (docs/gemm.md, session 19).  `f16`: a float16
    W (packed widened) from F16_SKINNY_PACKED_MIN_M rows only (docs/low_precision.md, helper f16pack)."""
    if m > SKINNY_PACKED_MAX_M or f16 and m < F16_SKINNY_PACKED_MIN_M:
        return False
    return 2 <= m < WT_MIN_M or w_bytes >= SKINNY_PACKED_WT_MIN_BYTES


def _skinny_spec(em, g: GemmOperands) -> packed.WeightSpec | None:
    """The spec of the dot path's weight packed once (as ``_packed_spec``'s: W's buffer, offset, row stride, N, K,
    ``packed_panels`` at the skinny kc), or None: the dot path (``_dot_path``: M <= SKINNY_M, B = W^T of a
    plain strided weight) with one weight for the whole kernel (no batch term), static sizes, AVX-512.  The
    kernel text does not depend on M; the spec is set (the call plan packs) where ``_skinny_packed_rows``."""
    from functools import partial

    from vtc.codegen.conv_t import has_avx512

    if (not SKINNY_PACKED or g.pack_b is not None or g.dtype != torch.float32 or not has_avx512()
            or not all(isinstance(x, int) for x in (g.m, g.n, g.k)) or g.m > SKINNY_M):
        return None
    nv = g.vars[2]
    load = _unwidened(g.b) if F16_PACKED_B else g.b  # (a float16 weight: packed widened)
    st = _strided(load, g, em)
    if st is None or not st[3].is_const or st[2].get("r", 0) != 1 or abs(st[2].get(nv, 0)) == 1:
        return None
    buf, idx = load.args
    c, terms = _terms(linear_offset(idx, em.shapes[buf]))
    if any(not (atom.op == "var" and atom.args[0] in (nv, "r")) for atom in terms):
        return None  # a batch or other term: not one weight for all of the kernel
    sn = {atom.args[0]: k for atom, k in terms.items()}.get(nv, 0) or (g.k if g.n == 1 else 0)  # (N = 1: no n term)
    if sn <= 0:
        return None
    kc = -(-g.k // -(-g.k // SKINNY_KC))
    return packed.WeightSpec(buf, int(c), sn, g.n, g.k, partial(packed_panels, kc=kc, wt=True))


def _lazy_b(em, g: GemmOperands) -> tuple[str, int, int] | None:
    """(pointer to B's block at (k0, n0), PF mode of vtc_ukr, the prefetch's row stride) where the block's
    B panels are packed one by one in its first row strip (``_lazy_b_panel``): B a plain strided operand that
    _pack_b packs itself, row-major (unit stride along n: PF 1) or a transposed weight (unit stride along k:
    PF 2), and M > SKINNY_M; else None (the whole block packed before the strips)."""
    if g.pack_b is not None or g.m <= SKINNY_M or gemm_pack.pack_b(em, g, "") is not None:
        return None
    return _b_source(em, g) if _unwidened(g.b) is g.b else None  # (a float16 B: its pointer is no float's)


def _b_source(em, g: GemmOperands) -> tuple[str, int, int] | None:
    """``_lazy_b``'s (pointer, PF mode, row stride) of a plain strided B (a float16 one's load), else None."""
    st = _strided(_unwidened(g.b), g, em)
    if st is None or not st[3].is_const:
        return None
    buf, off, co, _ = st
    sn, sk = co.get(g.vars[2], 0), co.get("r", 0)
    src = f"{em.ptr[buf]} + {off} + n0 * {sn} + k0 * {sk}"
    if sn == 1:
        return src, 1, sk
    return (src, 2, sn) if sk == 1 else None


A_IN_PLACE_N = 192  # from M > SKINNY_M, N up to this (static) and a row-major A: the tiles read A in place
# ... and up to this N where A's rows are not a multiple of 4 KB apart: a strip's 12 rows then fall in different
# L1 sets (4 KB a way on Zen 4 and Zen 5); 4 KB apart they share one set of 8-12 ways and evict each other
A_IN_PLACE_N_SPREAD = 512
L1_WAY_FLOATS = 1024  # 4 KB


def _a_in_place(em, g: GemmOperands) -> tuple[str, int] | None:
    """(pointer to A's block at (m0, k0), its row stride) where the panels' tiles read A in place (vtc_ukr_a_edge)
    instead of a packed panel: N static and at most A_IN_PLACE_N (each A element serves at most six tiles: a
    2048 x 2048 @ 2048 x 64 product spent ~24% of the kernel in vtc_pack_a_rows, ~0.87x ONNX Runtime's
    MatMul, which reads A in place), or at most A_IN_PLACE_N_SPREAD where A's row stride is not a multiple of
    L1_WAY_FLOATS (docs/gemm.md, helper rect), M > SKINNY_M, A one plain strided load with unit stride along k;
    else None."""
    if (not isinstance(g.n, int) or g.n > A_IN_PLACE_N_SPREAD or not isinstance(g.m, int) or g.m <= SKINNY_M
            or g.dtype != torch.float32 or gemm_pack.pack_a(em, g, "", False) is not None):
        return None
    st = _strided(g.a, g, em)
    if st is None or not st[3].is_const or st[2].get("r", 0) != 1:
        return None
    buf, off, co, _ = st
    sm = co.get(g.vars[1], 0)
    if sm <= 0 or g.n > A_IN_PLACE_N and sm % L1_WAY_FLOATS == 0:
        return None
    return f"({em.ptr[buf]} + {off} + m0 * {sm} + k0)", sm


def _lazy_b_panel(em, g: GemmOperands, lazy: tuple[str, int, int], ind: str, packed: bool = False,
                  a_in_place: bool = False) -> list[str]:
    """In the jr loop of the block's first row strip: pack B's panel jr (_pack_b's lines over NR columns at
    n0 + jr), then run its full tile with the next panel's source prefetched into L2 (vtc_ukr's PF), so the
    next pack reads from L2 while this tile's FMAs run instead of waiting on memory.  `packed`: where the
    kernel got B's panels packed once (``bpk``), no pack, and the next packed panel is prefetched (PF 1).
    `a_in_place` (``_a_in_place``): the pack only; the tiles read A in place."""
    _, mode, pld = lazy
    pack = [f"{ind}  float* __restrict const bpj = bp + jr * kb;",
            f"{ind}  const int64_t n0j = n0 + jr;",
            f"{ind}  {{ const int64_t n0 = n0j, nb = cols; float* __restrict bp = bpj;",
            *_pack_b(em, g, ind + "    "),
            f"{ind}  }}"]
    if a_in_place:  # A not packed on AVX-512 (vtc_ukr_a_edge): B's panel packed here, the tile run by the caller
        return [f"{ind}if (mi == mlo && ir == 0{' && !bpk' if packed else ''}) {{  // first strip: pack panel jr",
                *pack,
                f"{ind}}}"]
    if packed:
        pack = [f"{ind}  if (bpk && mb >= VTC_MR && jr + VTC_NR < nb) {{  // packed once: the next panel into L2",
                f"{ind}    vtc_ukr<VTC_MR, 1>(kb, ap, bsrc + jr * kb, VTC_NR, ct + jr, LDC, k0 > 0, VTC_NR,",
                f"{ind}                       bsrc + (jr + VTC_NR) * kb, VTC_NR);",
                f"{ind}    continue;",
                f"{ind}  }}",
                f"{ind}  if (!bpk) {{",
                *["  " + x for x in pack],
                f"{ind}  }}"]
    return [f"{ind}if (mi == mlo && ir == 0) {{  // first strip: pack panel jr just before its first use",
            *pack,
            f"{ind}#if defined(__AVX512F__)",
            f"{ind}  if ({'!bpk && ' if packed else ''}mb >= VTC_MR && jr + VTC_NR < nb) {{",
            f"{ind}    vtc_ukr<VTC_MR, {mode}>(kb, ap, bp + jr * kb, VTC_NR, ct + jr, LDC, k0 > 0, VTC_NR,",
            f"{ind}                         bnext + (jr + VTC_NR) * {1 if mode == 1 else pld}, {pld});",
            f"{ind}    continue;",
            f"{ind}  }}",
            f"{ind}#endif",
            f"{ind}}}"]


def _dot_path(em, g: GemmOperands, ind: str, block: list[str]) -> list[str]:
    """For M <= SKINNY_M on AVX-512 and B = a row-major weight transposed (unit stride along k): A packed
    into rows, dot products against the weight read in place (no B panel); else nothing."""
    if g.m > SKINNY_M:
        return []
    nv = g.vars[2]
    st = _strided(_unwidened(g.b), g, em)  # (a float16 weight widened as vtc_dot_cols reads it)
    if st is None or not st[3].is_const or st[2].get("r", 0) != 1 or abs(st[2].get(nv, 0)) == 1:
        return []
    buf, off, co, _ = st
    sn = co.get(nv, 0)
    src = f"{em.ptr[buf]} + {off} + n0 * {sn} + k0"
    return [f"{ind}#if defined(__AVX512F__)",
            *[ind + x for x in block],
            *_pack_a(em, g, ind + "  ", rows=True),
            f"{ind}  vtc_dot_cols<{DOT_PF}>(mb, nb, kb, ap, {src}, {sn}, ct, LDC, k0 > 0);",
            f"{ind}}}",
            f"{ind}continue;",
            f"{ind}#endif"]


def _direct_b(em, g: GemmOperands) -> tuple[str, str] | None:
    """(pointer to B's block, its row stride) where the micro-kernel reads B in place: M <= SKINNY_M (each
    B element is used by at most two A panels, so packing it would cost as much as the product) and B a
    plain strided operand with unit stride along n; else None."""
    if g.m > SKINNY_M:
        return None
    nv = g.vars[2]
    st = _strided(g.b, g, em)
    if st is None or not st[3].is_const or st[2].get(nv, 0) != 1:
        return None
    buf, off, co, _ = st
    sk = co.get("r", 0)
    return f"{em.ptr[buf]} + {off} + n0 + k0 * {sk}", str(sk)


DOT_PF = 128  # floats ahead along each weight row the dot path prefetches at 2+ rows of A (0: none)
WIDE_ROWS = True  # M <= WIDE_ROWS_M rows against a row-major B read in place: vtc_ukr_rows (U long streams of B's rows)
WIDE_ROWS_M = 2
WIDE_U = 8  # rows of B per pass over the block's columns (C read and written back once per U rows)
WIDE_NC = 2048  # the path's column block (C's rows stay in L1)
WIDE_BLOCK = SKINNY_KC * SKINNY_NC  # kc x min(N, WIDE_NC) floats at most (the skinny block's 2048 x 128, B's unused
#                                     scratch): kc only sets how much of A is packed at once (C is read back per U
#                                     rows), but a narrow B (vtc_ukr_rows_narrow) prefetches within a slice only


def _wide_rows_applies(em, g: GemmOperands) -> bool:
    """Whether generate's kernel for g has the vtc_ukr_rows loops (``_wide_rows``)."""
    return (WIDE_ROWS and isinstance(g.m, int) and g.m <= WIDE_ROWS_M and g.pack_b is None
            and _direct_b(em, g) is not None)


def _wide_rows_blocking(em, g: GemmOperands) -> list[str]:
    """The C lines that set the column block and KC slice of the vtc_ukr_rows loops (on AVX-512, where they run),
    before the thread split: each thread then takes whole blocks of up to WIDE_NC columns (N / nt where N is
    smaller), so its streams of B's rows are as long as they can be; nothing where the path does not apply."""
    if not _wide_rows_applies(em, g):
        return []
    return ["#if defined(__AVX512F__)",
            f"  nc = {WIDE_NC}; kc = std::max<int64_t>(128, {WIDE_BLOCK} / std::min<int64_t>(N, nc));"
            "  // vtc_ukr_rows over whole column blocks (_wide_rows)",
            *([f"  const bool ksplit = {_ksplit_condition()};  // the threads split K (_ksplit_rows)",
               "#else",
               "  const bool ksplit = false;"] if _ksplit_applies(em, g) else []),
            "#endif"]


WIDE_KSPLIT = True  # one column block (N <= WIDE_NC) on 2+ threads: each thread a contiguous range of B's rows over
#                     all N columns, the partial rows of C summed after the threads join (_ksplit_rows)
WIDE_KSPLIT_MIN_ROWS = 16  # rows of B per thread from which K is split


def _ksplit_applies(em, g: GemmOperands) -> bool:
    """Whether generate's kernel for g has the K-split loops of the vtc_ukr_rows path (``_ksplit_rows``): that
    path, C the kernel's own [M, N] (no pushed layout) and no batch."""
    return WIDE_KSPLIT and _wide_rows_applies(em, g) and g.out_layout is None and g.batch == 1


def _ksplit_condition() -> str:
    """The C condition under which the threads split K: 2..64 threads, one column block, enough rows each."""
    return f"nt > 1 && nt <= 64 && BATCH == 1 && N <= nc && K >= {WIDE_KSPLIT_MIN_ROWS} * nt"


def _ksplit_head(em, g: GemmOperands) -> list[str]:
    """Before the threads start (where ``_ksplit_applies``): where they split K, no units for the unit loop, and
    the array through which each thread names the row(s) of C it summed into."""
    if not _ksplit_applies(em, g):
        return []
    return ["  float* vtc_kparts[64];  // thread t's partial C (thread 0's: C itself)",
            "  int vtc_knth = 1;",
            "  if (ksplit) tn = 0;  // no column blocks: the threads split K instead (_ksplit_rows)"]


def _ksplit_rows(em, g: GemmOperands, c: str) -> list[str]:
    """In the parallel region (where ``_ksplit_applies``): where ksplit holds, thread tid runs vtc_ukr_rows over B's
    rows [kl, kh) (a multiple of WIDE_U apart, the last thread to K) and all N columns, into C (thread 0) or its B
    scratch (unused on this path): each thread reads one contiguous run of B (rows of N <= WIDE_NC floats one
    after the other) where the column split gave each thread a part of every row (1 x 1024 -> 1024: 2 KB of each
    4 KB row)."""
    if not _ksplit_applies(em, g):
        return []
    bt = g.vars[0] or "bt"
    src, ldb = _direct_b(em, g)
    block = ["for (int64_t mi = mlo; mi < mhi; ++mi) {",
             "  const int64_t m0 = mi * mc, mb = std::min<int64_t>(mc, M - m0);",
             "  float* __restrict ct = cg + m0 * LDC;"]
    ind = "        "
    em.forget()
    pack = _pack_a(em, g, ind + "  ")
    em.forget()  # temps declared in this block: not in scope for the unit loop's
    return ["#if defined(__AVX512F__)",
            "    if (ksplit) {",
            f"      const int64_t kl = K * tid / nth / {WIDE_U} * {WIDE_U}, kh = tid == nth - 1 ? K : K * (tid + 1) / nth / {WIDE_U} * {WIDE_U};",
            f"      const int64_t {bt} = 0, n0 = 0, nb = N, mlo = 0, mhi = tm;",
            f"      float* __restrict cg = tid == 0 ? {c} : bp;",
            "      vtc_kparts[tid] = cg;",
            "      if (tid == 0) vtc_knth = (int)nth;",
            "      for (int64_t k0 = kl; k0 < kh; k0 += kc) {",
            "        const int64_t kb = std::min<int64_t>(kc, kh - k0);",
            f"        const float* __restrict bsrc = {src};",
            f"        const int64_t ldb = {ldb};",
            *[ind + x for x in block],
            *pack,
            f"{ind}  vtc_ukr_rows<{g.m}, {WIDE_U}>(kb, ap, bsrc, ldb, ct, LDC, k0 > kl, nb);",
            f"{ind}}}",
            "      }",
            "    }",
            "#endif"]


def _ksplit_finish(em, k: Kernel) -> list[str]:
    """After the threads join (where ``_ksplit_applies``): where they split K, the other threads' partial rows added
    into C, then the epilogue over the whole of C, on the calling thread (M <= 2 rows of N <= WIDE_NC)."""
    g = k.gemm
    if not _ksplit_applies(em, g):
        return []
    bt = g.vars[0] or "bt"
    c = em.ptr[k.stores[0].buffer.name]
    em.forget()
    epi = _epilogue(em, k, "      ")
    em.forget()
    return ["#if defined(__AVX512F__)",
            "  if (ksplit) {  // the threads' partial sums of C (_ksplit_rows), then the epilogue",
            f"    const int64_t {bt} = 0, n0 = 0, nb = N, mlo = 0, mhi = tm;",
            f"    float* __restrict cg = {c};",
            "    for (int t = 1; t < vtc_knth; ++t) {",
            "      const float* __restrict s = vtc_kparts[t];",
            "      for (int64_t ii = 0; ii < M; ++ii)",
            "        #pragma omp simd",
            "        for (int64_t jj = 0; jj < N; ++jj) cg[ii * LDC + jj] += s[ii * LDC + jj];",
            "    }",
            *([] if not epi else ["    for (int64_t mi = mlo; mi < mhi; ++mi) {",
                                  "      const int64_t m0 = mi * mc, mb = std::min<int64_t>(mc, M - m0);",
                                  "      float* __restrict ct = cg + m0 * LDC;",
                                  *epi,
                                  "    }"]),
            "  }",
            "#endif"]


def _wide_rows(em, g: GemmOperands, ind: str, block: list[str]) -> list[str]:
    """Where B is read in place (``_direct_b``, AVX-512) and M <= WIDE_ROWS_M is a constant: per M block, A packed
    as usual and one vtc_ukr_rows call over the block's columns (WIDE_U rows of B per pass, C accumulated in L1),
    ending the KC slice; else nothing.  The blocks are WIDE_NC columns (``_wide_rows_blocking``).  Reading B by
    long runs along its rows is what counts: vtc_ukr's 32-column panels (128 bytes of a row per k step, then a
    jump of B's row stride) ran a 1 x 4096 @ 4096 x 4096 product at ~11 GB/s of B, 128-column runs with C in
    registers (sessions 13-14) at ~25, this at ~33-44 on Zen 5 (docs/gemm.md, session 15)."""
    if not _wide_rows_applies(em, g):
        return []
    return [f"{ind}{{",
            *[ind + x for x in block],
            *_pack_a(em, g, ind + "  "),
            f"{ind}  vtc_ukr_rows<{g.m}, {WIDE_U}>(kb, ap, bsrc, ldb, ct, LDC, k0 > 0, nb);",
            f"{ind}}}",
            f"{ind}}}",
            f"{ind}continue;"]


def _loop_var(name: str, start: str, ind: str) -> list[str]:
    return [f"{ind}const int64_t {name} = {start};"] if name else []


def _pack_a(em, g: GemmOperands, ind: str, rows: bool = False) -> list[str]:
    """ap[(ii / MR) * MR * kb + pp * MR + ii % MR] = A[batch, m0 + ii, k0 + pp] (the unit stride innermost);
    rows: ap[ii * kb + pp] instead (the dot-product path)."""
    base, step = ("ii * kb", "1") if rows else ("(ii / VTC_MR) * VTC_MR * kb + ii % VTC_MR", "VTC_MR")
    bv, mv, _ = g.vars
    by_runs = gemm_pack.pack_a(em, g, ind, rows)  # gathered rows, a cat's parts, gathered columns
    if by_runs is not None:
        return by_runs
    load = _unwidened(g.a)  # (a float16 A: the strided loops widen as they read, ``_elem``)
    st = _strided(load, g, em)
    if st is not None and st[3].is_const:
        buf, off, co, _ = st
        sm, sk = co.get(mv, 0), co.get("r", 0)
        src = f"{em.ptr[buf]} + {off} + m0 * {sm} + k0 * {sk}"
        et, rd = _elem(load)
        head = [f"{ind}{{ const {et}* __restrict src = {src};"]
        if not rows and sm == 1 and abs(sk) != 1:  # transposed A: MR contiguous elements per panel row
            body = [f"{ind}  for (int64_t ir = 0; ir < mb; ir += VTC_MR) {{",
                    f"{ind}    const int64_t rows = std::min<int64_t>(VTC_MR, mb - ir);",
                    f"{ind}    for (int64_t pp = 0; pp < kb; ++pp)",
                    f"{ind}      for (int64_t i = 0; i < rows; ++i) ap[ir * kb + pp * VTC_MR + i] = {rd(f'src[ir + i + pp * {sk}]')};",
                    f"{ind}  }}"]
        elif abs(sm) == 1 and abs(sk) != 1:
            body = [f"{ind}  for (int64_t pp = 0; pp < kb; ++pp)",
                    f"{ind}    for (int64_t ii = 0; ii < mb; ++ii)",
                    f"{ind}      ap[{base} + pp * {step}] = {rd(f'src[ii * {sm} + pp * {sk}]')};"]
        elif not rows and sk == 1:  # row-major A: 16 x 16 blocks transposed in registers
            body = [f"{ind}#if defined(__AVX512F__)",
                    f"{ind}  for (int64_t ir = 0; ir < mb; ir += VTC_MR)",
                    f"{ind}    vtc_pack_a_rows(src + ir * {sm}, {sm}, (int)std::min<int64_t>(VTC_MR, mb - ir), kb, ap + ir * kb);",
                    f"{ind}#else",
                    f"{ind}  for (int64_t ii = 0; ii < mb; ++ii) {{",
                    f"{ind}    float* __restrict dst = ap + {base};",
                    f"{ind}    const {et}* __restrict s = src + ii * {sm};",
                    f"{ind}    for (int64_t pp = 0; pp < kb; ++pp) dst[pp * {step}] = {rd('s[pp]')};",
                    f"{ind}  }}",
                    f"{ind}#endif"]
        else:
            body = [f"{ind}  for (int64_t ii = 0; ii < mb; ++ii) {{",
                    f"{ind}    float* __restrict dst = ap + {base};",
                    f"{ind}    const {et}* __restrict s = src + ii * {sm};",
                    f"{ind}    for (int64_t pp = 0; pp < kb; ++pp) dst[pp * {step}] = {rd(f's[pp * {sk}]')};",
                    f"{ind}  }}"]
        return head + body + [f"{ind}}}"]
    along_m = None if rows else gemm_inline.pack_a_along_m(em, g, ind)  # a transposed A through a producer
    if along_m is not None:
        return along_m
    em.forget()
    inner = ind + "    "
    temps = em.hoist([g.a], inner)
    generic = [f"{ind}for (int64_t ii = 0; ii < mb; ++ii) {{",
               *_loop_var(mv, "m0 + ii", ind + "  "),
               f"{ind}  float* __restrict dst = ap + {base};",
               f"{ind}  for (int64_t pp = 0; pp < kb; ++pp) {{",
               f"{inner}const int64_t r = k0 + pp;",
               *temps,
               f"{inner}dst[pp * {step}] = {em.scalar(g.a)};",
               f"{ind}  }}",
               f"{ind}}}"]
    if rows or not ROWS_THEN_PANEL:
        return generic
    # AVX-512: an MR-row strip computed row by row along the reduction (one vector loop per row: an inlined
    # producer's exp or sqrt vectorised, its loads walking their unit stride), then transposed into the panel
    em.forget()
    i2, i3 = ind + "    ", ind + "      "
    temps = em.hoist([g.a], i3)
    return [f"{ind}#if defined(__AVX512F__)",
            f"{ind}{{ float* __restrict a_rows = vtc_gemm_scratch(2, VTC_MR * kb);  // the strip, row-major",
            f"{ind}  for (int64_t ir = 0; ir < mb; ir += VTC_MR) {{",
            f"{ind}    const int strip = (int)std::min<int64_t>(VTC_MR, mb - ir);",
            f"{ind}    for (int i = 0; i < strip; ++i) {{",
            *_loop_var(mv, "m0 + ir + i", i2 + "  "),
            f"{i2}  float* __restrict dst = a_rows + i * kb;",
            f"{i2}  #pragma omp simd",
            f"{i2}  for (int64_t pp = 0; pp < kb; ++pp) {{",
            f"{i3}const int64_t r = k0 + pp;",
            *temps,
            f"{i3}dst[pp] = {em.scalar(g.a)};",
            f"{i2}  }}",
            f"{i2}}}",
            f"{i2}vtc_pack_a_rows(a_rows, kb, strip, kb, ap + ir * kb);",
            f"{ind}  }}",
            f"{ind}}}",
            f"{ind}#else",
            *generic,
            f"{ind}#endif"]


def _pack_b(em, g: GemmOperands, ind: str) -> list[str]:
    """bp[(jj / NR) * NR * kb + pp * NR + jj % NR] = B[batch, k0 + pp, n0 + jj], zero past nb."""
    by_runs = gemm_pack.pack_b(em, g, ind)  # a cat along K, N or the batch
    if by_runs is not None:
        return by_runs
    nv = g.vars[2]
    load = _unwidened(g.b)  # (a float16 B: the strided loops widen as they read, ``_elem``)
    st = _strided(load, g, em)
    st = st if st is not None and st[3].is_const else None
    et, rd = _elem(load)
    zero_tail = [f"{ind}if (nb % VTC_NR) {{",
                 f"{ind}  float* __restrict dst = bp + (nb / VTC_NR) * VTC_NR * kb;",
                 f"{ind}  for (int64_t pp = 0; pp < kb; ++pp)",
                 f"{ind}    for (int64_t jj = nb % VTC_NR; jj < VTC_NR; ++jj) dst[pp * VTC_NR + jj] = 0.0f;",
                 f"{ind}}}"]
    if st is not None:
        buf, off, co, _ = st
        sn, sk = co.get(nv, 0), co.get("r", 0)
        src = f"{em.ptr[buf]} + {off} + n0 * {sn} + k0 * {sk}"
        head = [f"{ind}{{ const {et}* __restrict src = {src};"]
        if abs(sn) == 1 or abs(sk) != 1:  # row-major B: each k row walked contiguously across the tile
            body = [f"{ind}  const int64_t nfull = nb / VTC_NR * VTC_NR;",
                    f"{ind}  for (int64_t pp = 0; pp < kb; ++pp) {{",
                    f"{ind}    const {et}* __restrict s = src + pp * {sk};",
                    f"{ind}    for (int64_t jr = 0; jr < nfull; jr += VTC_NR)",
                    f"{ind}      for (int64_t jj = 0; jj < VTC_NR; ++jj) bp[jr * kb + pp * VTC_NR + jj] = {rd(f's[(jr + jj) * {sn}]')};",
                    f"{ind}    for (int64_t jj = nfull; jj < nb; ++jj) bp[nfull * kb + pp * VTC_NR + jj - nfull] = {rd(f's[jj * {sn}]')};",
                    f"{ind}  }}"]
        else:  # transposed B (a Linear weight): 16 x 16 blocks transposed in registers, the rest per column
            vec = [f"{ind}  int64_t nfull = 0, kfull = 0;"]
            if sk == 1:
                vec = [f"{ind}#if defined(__AVX512F__)",
                       f"{ind}  const int64_t nfull = nb / 16 * 16, kfull = kb / 16 * 16;",
                       f"{ind}  for (int64_t j0 = 0; j0 < nfull; j0 += 16)",
                       f"{ind}    for (int64_t p0 = 0; p0 < kfull; p0 += 16)",
                       f"{ind}      vtc_transpose16(src + j0 * {sn} + p0, {sn}, "
                       f"bp + (j0 / VTC_NR) * VTC_NR * kb + p0 * VTC_NR + j0 % VTC_NR, VTC_NR);",
                       f"{ind}#else",
                       *vec,
                       f"{ind}#endif"]
            body = [*vec,
                    f"{ind}  for (int64_t jj = 0; jj < nb; ++jj) {{",
                    f"{ind}    float* __restrict dst = bp + (jj / VTC_NR) * VTC_NR * kb + jj % VTC_NR;",
                    f"{ind}    const {et}* __restrict s = src + jj * {sn};",
                    f"{ind}    for (int64_t pp = jj < nfull ? kfull : 0; pp < kb; ++pp) dst[pp * VTC_NR] = {rd(f's[pp * {sk}]')};",
                    f"{ind}  }}"]
        return head + body + [f"{ind}}}"] + zero_tail
    em.forget()
    inner = ind + "    "
    temps = em.hoist([g.b], inner)
    return [f"{ind}for (int64_t pp = 0; pp < kb; ++pp) {{",
            f"{ind}  const int64_t r = k0 + pp;",
            f"{ind}  for (int64_t jj = 0; jj < nb; ++jj) {{",
            *_loop_var(nv, "n0 + jj", inner),
            *temps,
            f"{inner}bp[(jj / VTC_NR) * VTC_NR * kb + pp * VTC_NR + jj % VTC_NR] = {em.scalar(g.b)};",
            f"{ind}  }}",
            f"{ind}}}"] + zero_tail


NARROWED_KEEP = 1 << 20  # floats of a narrowed kernel's C kept in a thread's scratch at most (4 MB): its groups of
#                          row blocks hold up to this many (but always one block)


def _narrowed_c() -> list[str]:
    """The C lines, after the blocking, that size a ``narrowed`` kernel's float32 sums: each thread sums a unit's
    block into its own C of mg row blocks of the widest column block (LDC = nc), read back by the epilogue from
    the caches; a group of the unit loop covers mg row blocks at most.  (A scratch C of the whole product, 16 MB
    for Llama's 128 x 32000 logits, was allocated and page-faulted in on every call, and its rows read back from
    memory: docs/gemm.md, helper gemm16.)"""
    return ["  const int64_t LDC = nc;  // the thread's float32 sums of a block (narrowed)",
            f"  const bool c_large = BATCH * M * N * 2 >= {NARROWED_LARGE_BYTES}LL;  // (_narrowed_rows, _narrowed_strips)",
            f"  const int64_t mg = std::max<int64_t>(1, std::min<int64_t>(tm, {NARROWED_KEEP}LL / (mc * nc)));"]


def narrowed(k: Kernel) -> bool:
    """True when float32 gemm kernel k stores a float16 result: its sums are a float32 scratch C that
    ``_epilogue`` rounds into the output once per element (as eager's fp16 GEMM, which accumulates in float32)."""
    return k.stores[0].buffer.dtype == F16


def _epilogue(em, k: Kernel, ind: str) -> list[str]:
    """Over the finished tile: out = the first store's scalar of acc (alpha, bias, beta, a fused pointwise
    consumer), into C or, where ``narrowed``, rounded into the float16 output (``_narrowed_rows`` where it can);
    then each other store (through a push mapping, vtc.codegen.gemm_push) copies the finished value where its
    predicate holds, over the columns it can hold on (``_column_run``).  Nothing when the first store is acc
    into C and there are no others."""
    from vtc.codegen.cpp import storage_ctype

    g: GemmOperands = k.gemm
    first = k.stores[0]
    value, pushes = first.value, k.stores[1:]
    if value.op == "acc" and not pushes and not narrowed(k):
        return []
    bv, mv, nv = g.vars
    inner = ind + "    "
    rows = _narrowed_rows(em, k, ind) if narrowed(k) and NARROWED_ROWS else None
    if rows is not None:
        lines = rows
    elif narrowed(k):
        out = first.buffer.name

        def store() -> str:
            at = f"{em.ptr[out]}[{em.linear(out, first.index)}]"
            if not pushes:
                return f"{at} = {em.stored(value, F16)}"
            # the pushed stores copy the value, unrounded, from the tile; each rounds it as the first store
            return f"ct[ii * LDC + jj] = {em.temps.get(id(value)) or em.unrounded(value)}; {at} = vtc_to_f16(ct[ii * LDC + jj])"
        lines = block_values(em, value, g.vars, ind, "ct[ii * LDC + jj]", store)
    elif value.op != "acc":
        lines = block_values(em, value, g.vars, ind, "ct[ii * LDC + jj]",
                             lambda: f"ct[ii * LDC + jj] = {em.scalar(value)}")
    else:
        lines = [f"{ind}for (int64_t ii = 0; ii < mb; ++ii) {{", *_loop_var(mv, "m0 + ii", ind + "  ")]
    for st in pushes:
        run = _column_run(st.when, nv, g.n)
        idx, when, cols, col = st.index, st.when, "jj = 0; jj < nb", [*_loop_var(nv, "n0 + jj", inner)]
        if run is not None:  # only columns [lo, hi) land there: loop over them, index from a column var >= 0
            lo, hi = run
            jc = var("jc", hi - lo)
            idx, when = tuple(subs(e, {nv: jc + lo}) for e in idx), None
            cols = f"jj = std::max<int64_t>(0, {lo} - n0); jj < std::min<int64_t>(nb, {hi} - n0)"
            col = [f"{inner}const int64_t jc = n0 + jj - {lo};"] if hi - lo > 1 else []
        runs = _store_runs(idx, st.buffer, run) if PUSH_RUNS else None
        if runs is not None:  # runs of d columns that land on consecutive elements: one vector copy each
            d, base = runs
            lo, hi = run
            lines += [f"{ind}  for (int64_t jj = std::max<int64_t>(0, {lo} - n0), jend = std::min<int64_t>(nb, {hi} - n0); jj < jend;) {{",
                      f"{inner}const int64_t jh = (n0 + jj - {lo}) / {d}, je0 = (n0 + jj - {lo}) % {d};",
                      f"{inner}const int64_t len = std::min<int64_t>({d} - je0, jend - jj);",
                      f"{inner}{storage_ctype(st.buffer.dtype)}* __restrict dst = {em.ptr[st.buffer.name]} + {em.linear(st.buffer.name, base)} + je0;",
                      f"{inner}const float* __restrict src = ct + ii * LDC + jj;",
                      f"{inner}#pragma omp simd",
                      f"{inner}for (int64_t e = 0; e < len; ++e) dst[e] = {_pushed_value(st, 'src[e]')};",
                      f"{inner}jj += len;",
                      f"{ind}  }}"]
            continue
        store = f"{em.ptr[st.buffer.name]}[{em.linear(st.buffer.name, idx)}] = {_pushed_value(st, 'ct[ii * LDC + jj]')};"
        lines += [f"{ind}  for (int64_t {cols}; ++jj) {{",
                  *col,
                  f"{inner}{store}" if when is None else f"{inner}if ({em.index(when)}) {store}",
                  f"{ind}  }}"]
    return lines + [f"{ind}}}"]


NARROWED_ROWS = True  # a narrowed kernel's float16 result rounded and stored by rows (_narrowed_rows)
NARROWED_LARGE_BYTES = 4 << 20  # a float16 result from this size on: stored with streaming stores, by strips
NARROWED_STRIPS = True  # ... a large one on the panels path a row strip at a time as its last KC slice ends (_narrowed_strips)


def _narrowed_strips(em, k: Kernel, ind: str) -> list[str]:
    """In the panels path's row strip loop of a ``narrowed`` kernel with a large result (c_large: from
    NARROWED_LARGE_BYTES): after the strip's tiles of the last KC slice, ``_epilogue`` over the strip's VTC_MR
    rows of C while they are in the caches (strips_done then skips the block's epilogue after the slices, which
    the other paths and smaller results run).  After the whole block (128 rows of 1024 columns: 512 KB), the B
    panels streamed since (1 MB a slice) push C out of the 1 MB L2 of the Zen 4 this ran on (docs/gemm.md,
    helper gemm16: with the streaming stores, Llama's float16 logits GEMM ran ~4% faster; neither alone was
    clear of the noise, nor a change on the MLP's GEMMs, which keep the block's epilogue)."""
    epi = _epilogue(em, k, ind + "  ")
    return [f"{ind}if (c_large && k0 + kb >= K) {{  // the strip's rows are finished: through the epilogue while in cache",
            f"{ind}  const int64_t m0s = m0 + ir, mbs = std::min<int64_t>(VTC_MR, mb - ir);",
            f"{ind}  float* __restrict const cts = ct + ir * LDC;",
            f"{ind}  {{ const int64_t m0 = m0s, mb = mbs; float* __restrict const ct = cts;",
            *epi,
            f"{ind}  }}",
            f"{ind}  strips_done = true;",
            f"{ind}}}"]


def _narrowed_rows(em, k: Kernel, ind: str) -> list[str] | None:
    """``_epilogue``'s first store of a ``narrowed`` kernel whose float16 elements are consecutive along the
    columns, without a predicate, by rows of vector conversions (vecmath's ``vtc_round_f16_n`` and
    ``vtc_to_f16_n``; the loop's are calls, one per 16 elements): where every read of acc rounds it to float16
    (a residual add or SiLU * up on the GEMM's float16 result), the row of C is rounded in place first; the
    value of each column goes into C unrounded (as the pushed stores read it) and the row is narrowed into the
    output.  Opens the row loop, as ``block_values``; None where the store is not such a row."""
    first, (_, mv, nv) = k.stores[0], k.gemm.vars
    if first.when is not None or not nv:
        return None
    _, terms = _terms(linear_offset(first.index, first.buffer.shape))
    along = [(atom, c) for atom, c in terms.items() if nv in free_vars(atom)]
    if len(along) != 1 or along[0][0].op != "var" or along[0][1] != 1:
        return None
    value = first.value
    rounded = None if value.op == "acc" else K.acc_rounded([value])
    to_row = [f"{ind}  {{ {_loop_var(nv, 'n0', '')[0]} "
              f"(c_large ? vtc_to_f16_n_stream : vtc_to_f16_n)"
              f"(&{em.ptr[first.buffer.name]}[{em.linear(first.buffer.name, first.index)}], ct + ii * LDC, nb); }}"]
    if value.op == "acc":
        return [f"{ind}for (int64_t ii = 0; ii < mb; ++ii) {{", *_loop_var(mv, "m0 + ii", ind + "  "), *to_row]
    value = rounded[0] if rounded else value
    before = [f"{ind}  vtc_round_f16_n(ct + ii * LDC, nb);"] if rounded else []
    lines = block_values(em, value, k.gemm.vars, ind, "ct[ii * LDC + jj]",
                         lambda: f"ct[ii * LDC + jj] = {em.temps.get(id(value)) or em.unrounded(value)}", before)
    return lines + to_row


def _pushed_value(st: Store, x: str) -> str:
    """C float x (a finished element of the tile) as an element of pushed store st's buffer (float16: rounded)."""
    from vtc.codegen.cpp import ctype

    return f"vtc_to_f16({x})" if st.buffer.dtype == F16 else f"({ctype(st.buffer.dtype)}){x}"


PUSH_RUNS = True  # a pushed store whose columns land in runs of d consecutive elements copies each run as a vector


def _store_runs(idx: tuple, buf: Buffer, run: tuple[int, int] | None) -> tuple[int, tuple] | None:
    """(d, index at the run's start) where pushed store index `idx` (of the column var jc over [0, hi - lo)) lands
    columns jc = d * jh + je, je < d, on consecutive elements of `buf` (the V projection pushed into a KV cache:
    jc % hd and jc / hd, d = hd): the index with jc replaced by d * jh (jh the C variable of the run); None
    where no such d (a divisor of the columns' count that the index divides or takes the remainder by) does it."""
    from vtc.index.expr import walk

    if run is None or run[1] - run[0] < 16:
        return None
    n = run[1] - run[0]
    off = linear_offset(idx, buf.shape)
    if "jc" not in free_vars(off):
        return None
    ds = sorted({e.args[1] for e in walk(off) if e.op in ("mod", "floordiv") and isinstance(e.args[1], int)
                 and "jc" in free_vars(e.args[0])}, reverse=True)
    for d in ds:
        if d < 16 or n % d:
            continue
        jh, je = var("jh", n // d), var("je", d)
        at = subs(off, {"jc": jh * d + je})
        if "jc" in free_vars(at) or subs(at, {"je": lift(0)}) + je != at:
            continue  # jc left over, or not one element per column along je
        return d, tuple(subs(lift(e), {"jc": jh * d}) for e in idx)
    return None


def block_values(em, value: Scalar, gvars: tuple, ind: str, acc: str, store: Callable[[], str],
                 before: list[str] = ()) -> list[str]:
    """C opening a loop over the rows ii < mb of a finished block (its first element at (m0, n0)) that evaluates
    `value` of the GEMM's sum (``acc_`` read from `acc`) for every column jj < nb and runs `store()` (a C
    statement, made after the value's temporaries are named); the row loop's brace is left open.  The terms
    that do not depend on the column are computed once per row (a batch norm's w / sqrt(var + eps) per element
    took a third of a 1x1 conv).  `before`: C lines at the start of each row.  The float32 GEMM's and the bf16
    GEMM's epilogues (vtc.codegen.gemm_bf16)."""
    _, mv, nv = gvars
    inner = ind + "    "
    lines = [f"{ind}for (int64_t ii = 0; ii < mb; ++ii) {{", *_loop_var(mv, "m0 + ii", ind + "  "), *before]
    em.forget()
    lines += em.hoist_invariant([value], {nv}, ind + "  ")
    temps = em.hoist([value], inner)
    return lines + [f"{ind}  #pragma omp simd",
                    f"{ind}  for (int64_t jj = 0; jj < nb; ++jj) {{",
                    *_loop_var(nv, "n0 + jj", inner),
                    f"{inner}const float acc_{ACC} = {acc};",
                    *temps,
                    f"{inner}{store()};",
                    f"{ind}  }}"]


def _column_run(when: Expr | None, nv: str, n: int) -> tuple[int, int] | None:
    """[lo, hi): the columns where predicate `when` of the column index `nv` alone holds, when they are one run
    (a split's part); None when it depends on another index or holds on several runs."""
    from vtc.index.expr import evaluate

    if when is None:
        return (0, n) if n > 1 else None
    if not nv or free_vars(when) != {nv}:
        return None
    hold = evaluate(when, {nv: torch.arange(n)}, {}).bool().expand(n)
    at = torch.nonzero(hold).flatten()
    if at.numel() == 0:
        return None
    lo, hi = int(at[0]), int(at[-1]) + 1
    return (lo, hi) if int(hold.sum()) == hi - lo else None
