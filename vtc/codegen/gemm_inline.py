"""What a GEMM's choice saves on a pointwise producer: the generated kernel computes it in its pack loop.

A GEMM operand that is the output of a pointwise op (a ReLU, an activation times a gate), read by
nothing but the GEMM (through virtual movement ops only), is *inlined* when the generated kernel runs
the GEMM (vtc.codegen.lower: a single-use pointwise producer is computed inside its consumer): its
pack loop evaluates the producer per element and the value never exists in memory.  torch's kernel
needs it in memory, so the producer runs as its own kernel first: a launch, a store of the value and
its read back.  ``inlined_producer_bytes`` finds such an operand for ``vtc.codegen.gemm.choose``, which
prices that on torch's side like a copy (EfficientViT's linear attention: ``relu(q) @ (k^T v)`` with
``q`` a slice of a permuted view; torch's bmm needs ``relu(q)`` in memory, 0.8 MB at batch 1).  Only for
batched GEMMs (``OPS``): on a 2-D x @ W^T (Llama's down projection after silu(gate) * up) it would move
MKL's packed GEMM to the generated kernel at some token counts and not others (a choice that changes with
the size rebuilds kernels, vtc.runtime.generic), unmeasured there.
"""
from __future__ import annotations

import torch

from vtc.codegen.kernel_ir import scalars_under
from vtc.ir.graph import Node, Value

OPS = ("aten.bmm.default", "aten.baddbmm.default")  # the GEMMs whose choice sees an inlined producer


def behind_virtual_movement(low, v: Value) -> Value | None:
    """The first value that is not virtual on the way back from `v` through virtual movement ops with one input
    each (`v` itself when it is not virtual); None where a virtual value on the way has another producer."""
    x = v
    while low.plan.is_virtual(x.name):
        p = low.producer.get(x.name)
        ins = [i for i in p.inputs if isinstance(i, Value)] if p is not None else []
        if p is None or p.kind != "movement" or len(ins) != 1:
            return None
        x = ins[0]
    return x


def inlined_producer_bytes(low, v: Value, gemm: Node) -> tuple[str, int]:
    """(name, bytes) of the float32 pointwise value that GEMM operand `v` is (through virtual movement ops
    with one input each) when nothing but node `gemm` reads it (no graph output, no other reader through
    virtual ops): the value the generated kernel computes in its pack loop and torch's path stores first.
    ("", 0) for any other operand (physical data, a library op's result, a value read elsewhere)."""
    from vtc.codegen.ops import POINTWISE, lookup  # (ops imports the convolutions, which import vtc.codegen.gemm)

    x = behind_virtual_movement(low, v)
    if x is None:
        return "", 0
    p = low.producer.get(x.name)
    if (p is None or p.kind == "movement" or p.op == "aten.convolution.default"
            or lookup(POINTWISE, p.target) is None or len(p.outputs) != 1
            or any(y.dtype != torch.float32 for y in [*p.inputs, x])):
        return "", 0
    stack = [x]
    while stack:  # every reader of x, through virtual movement ops, is the GEMM
        y = stack.pop()
        if y.name in low.outputs or y.name in getattr(low, "index_names", set()):
            return "", 0
        for u in low.users.get(y.name, []):
            if u is gemm:
                continue
            if u.kind == "movement" and all(low.plan.is_virtual(o.name) for o in u.outputs):
                stack.extend(u.outputs)
            else:
                return "", 0
    return x.name, x.nbytes


def a_passes(low, gemm: Node, name: str) -> int:
    """How many times generated GEMM `gemm` would compute value `name` inlined into its A pack: once per
    column block of N its kernel cuts on this machine's threads (``gemm.column_blocks``: llama's down
    projection, 256 x 3584 -> 1024, once on one thread, once per thread on two, where the threads split N and
    each packs all of A).  1 where `name` is not A (through virtual movement ops with one input each), and for
    M <= SKINNY_M."""
    from vtc.codegen.gemm import SKINNY_M, _operands, column_blocks
    from vtc.plan.cost import machine
    from vtc.virtual.movement import bind

    a, b = _operands(gemm, bind(gemm.target, gemm.args, gemm.kwargs))
    x = behind_virtual_movement(low, a)
    if x is None or x.name != name:
        return 1
    batch, m, k = a.shape if len(a.shape) == 3 else (1, *a.shape)
    if m <= SKINNY_M:  # a few rows: recomputing them costs less than a kernel of their own (decode's down
        return 1       # projection, 2 threads: 1.150 -> 1.177 ms with the product stored)
    return column_blocks(batch, m, b.shape[-1], k, machine().threads)


def pack_a_along_m(em, g, ind: str) -> list[str] | None:
    """The MR-row panels of an A read through a mapping or an inlined producer (``relu(q)`` of a transposed
    view) whose every load has unit stride along the row index m and not along the reduction: per panel
    and reduction step the MR rows side by side, both the loads and the panel's stores walking their unit
    stride (the generic loop, rows outer, reads each element a row stride apart).  None for any other A."""
    from vtc.codegen.gemm_dot import unit_stride_along

    mv = g.vars[1]
    loads = [s for s in scalars_under([g.a]) if s.op == "load"]
    if not mv or not loads or not all(unit_stride_along(s, mv, em.shapes) for s in loads):
        return None
    em.forget()
    inner = ind + "      "
    temps = em.hoist([g.a], inner)
    return [f"{ind}for (int64_t ir = 0; ir < mb; ir += VTC_MR) {{  // A along its unit stride: rows side by side",
            f"{ind}  const int64_t rows = std::min<int64_t>(VTC_MR, mb - ir);",
            f"{ind}  for (int64_t pp = 0; pp < kb; ++pp) {{",
            f"{ind}    const int64_t r = k0 + pp;",
            f"{ind}    float* __restrict dst = ap + ir * kb + pp * VTC_MR;",
            f"{ind}    for (int64_t i = 0; i < rows; ++i) {{",
            f"{inner}const int64_t {mv} = m0 + ir + i;",
            *temps,
            f"{inner}dst[i] = {em.scalar(g.a)};",
            f"{ind}    }}",
            f"{ind}  }}",
            f"{ind}}}"]
