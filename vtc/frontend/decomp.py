"""vtc's changes to torch's core-ATen decomposition table (every capture path applies them).

torch decomposes ``scaled_dot_product_attention`` on CPU through
``_scaled_dot_product_flash_attention_for_cpu`` into its math form,
``_scaled_dot_product_attention_math`` (bmm, softmax, bmm).  For float16 and
bfloat16 inputs the math form computes in float32 and rounds once at the end,
as eager's fused CPU kernel accumulates in float32 — unless the process has
called ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` (a
global switch despite its name, read by the math form on every device): the
math form then computes scores, probabilities and output in the low precision,
while eager on CPU still runs its fused kernel in float32.  A model captured
under that switch gave 3-6x eager's mean error against a float64 reference
(SDPA with scores of unit size, ``bench/low_precision.py attention``;
``tests/frontend/test_low_precision.py``).

``with_overrides`` runs that one decomposition of torch's table with the
switch off for the duration of the call, so the captured graph is the one
torch makes by default (float32 scores, softmax and PV, one rounding at the
end), whatever the switch says; the switch is process-wide, and is off only
while the trace runs that decomposition.  With the switch off (torch's default)
and for float32 / float64 the graph is the one torch makes, unchanged.  The
other dtype-sensitive entries of the table (softmax, log_softmax, layer_norm,
rms_norm, group_norm, var/mean, logsumexp, norms, cumsum) already give float16
/ bfloat16 results equal to eager's (docs/robustness.md, "Low-precision
attention").
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch._decomp

_aten = torch.ops.aten


@contextlib.contextmanager
def math_sdp_in_float32() -> Iterator[None]:
    """Within: torch's math SDPA computes float16 / bfloat16 in float32 (its default), then the switch as it was."""
    get = getattr(torch._C, "_get_math_sdp_allow_fp16_bf16_reduction", None)
    set_ = getattr(torch._C, "_set_math_sdp_allow_fp16_bf16_reduction", None)
    if get is None or set_ is None or not get():
        yield
        return
    set_(False)
    try:
        yield
    finally:
        set_(True)


def _in_float32_math_sdp(fn):
    """`fn` (torch's decomposition) run with the math SDPA in float32 for float16 / bfloat16 inputs."""
    if getattr(fn, "_vtc_float32_math_sdp", False):
        return fn

    def run(*args, **kwargs):
        with math_sdp_in_float32():
            return fn(*args, **kwargs)

    run._vtc_float32_math_sdp = True  # type: ignore[attr-defined]
    return run


# ops whose decomposition reaches torch's math SDPA: eager's fused CPU kernel, float32 inside for float16 / bfloat16
FLOAT32_MATH_SDP = tuple(getattr(_aten, name).default for name in ("_scaled_dot_product_flash_attention_for_cpu",)
                         if hasattr(_aten, name))


def with_overrides(table):
    """`table` (a dict, or torch.export's CustomDecompTable) with vtc's changes: torch's decomposition of each op of
    FLOAT32_MATH_SDP in the table run with the math SDPA in float32."""
    for op in FLOAT32_MATH_SDP:
        if op in table:
            table[op] = _in_float32_math_sdp(table[op])
    return table


def core_aten_decompositions() -> dict:
    """``torch._decomp.core_aten_decompositions()`` with vtc's overrides (aot_autograd's table: torch.compile)."""
    return with_overrides(dict(torch._decomp.core_aten_decompositions()))


def export_decompositions() -> Any:
    """torch.export's default table (``run_decompositions()``'s) with vtc's overrides."""
    return with_overrides(torch.export.default_decompositions())
