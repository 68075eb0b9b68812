"""Row kernels that store a costly per-element term once and read it back (softmax's exp).

A softmax row kernel has three passes over r: the max, the sum of
``exp(x - max)``, and the store of ``exp(x - max) * (1 / sum)``.  Emitted as
written, exp is evaluated twice per element, and in cache (a 1 MB softmax)
exp is what the kernel costs.  Torch's softmax writes ``exp(x - max)`` into
the output during the sum pass and then scales the output in place; this
module finds that pattern in any row kernel:

- the last reduction pass has a ``sum`` whose term contains a transcendental
  (exp, tanh, erf, ...: cheaper arithmetic is recomputed, a store and a
  reload would cost more);
- a per-element store (``per_r``) of the same dtype computes that term again
  inside its value;
- the kernel does not read the stored buffer (a push into a buffer it also
  reads keeps the plain form).

Then the sum pass also stores the term into that output, and the store pass
reads it back instead of recomputing it (``vtc.codegen.cpp._row_kernel``).
The values are the same floats either way: the term is computed by the same
code, stored and reloaded exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

from vtc.codegen.kernel_ir import Kernel, Reduction, Scalar, Store, scalars_under

COSTLY_UNARY = {"exp", "tanh", "erf", "sigmoid", "silu", "gelu", "gelu_tanh", "log", "expm1", "log1p",
                "exp2", "log2", "sin", "cos", "tan", "atan"}


@dataclass(frozen=True)
class StoredTerm:
    """The sum `reduction` of the last pass stores its term through `store` (index and buffer)."""

    reduction: Reduction
    store: Store


def stored_term(k: Kernel) -> StoredTerm | None:
    """The reduction term of row kernel k to store once and reuse in its per-element store, or None."""
    if k.kind != "row" or not k.phases or k.r_extent <= 1:
        return None
    loaded = {s.args[0] for s in scalars_under(k.roots()) if s.op == "load"}
    for red in k.phases[-1]:
        if red.combine != "sum" or not _costly(red.value):
            continue
        for st in k.stores:
            if (st.per_r and st.value.dtype == red.value.dtype and st.buffer.dtype == red.value.dtype
                    and st.buffer.name not in loaded and any(s is red.value for s in scalars_under([st.value]))):
                return StoredTerm(red, st)
    return None


def _costly(value: Scalar) -> bool:
    return any(s.op == "unary" and s.args[0] in COSTLY_UNARY for s in scalars_under([value]))
