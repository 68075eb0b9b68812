"""The compute ops vtc knows, and the movement/compute/fallback classification.

Ops are keyed by their ATen packet name (``target._opname``: ``add`` for
``aten.add.Tensor``), so every overload of a known op is known.  Each compute op
has a *category* that later stages dispatch on (``pointwise`` ops map element
i of each broadcast input to element i of the output; ``reduction`` ops reduce
some axes; ``matmul``, ``conv``, ``attention``, ``norm``, ``pool``, ``scan``,
``indexed`` (sorting, accumulating scatters), ``creation`` ops are kernels of
their own).  Movement ops are decided first by
``vtc.virtual.ops.is_movement`` (op *and* arguments: ``_to_copy`` that keeps the
dtype moves data, one that casts computes); anything else that is not in the
table is a ``fallback`` and is run by torch.
"""
from __future__ import annotations

from typing import Any

import torch

from vtc.virtual.ops import is_movement

_UNARY = """abs neg exp exp2 expm1 log log2 log10 log1p sqrt rsqrt reciprocal sign sgn
    sin cos tan asin acos atan sinh cosh tanh asinh acosh atanh erf erfc erfinv
    sigmoid relu relu6 gelu silu mish hardtanh hardsigmoid hardswish elu selu celu
    leaky_relu softplus logit floor ceil round trunc frac isnan isinf isfinite
    logical_not bitwise_not square nan_to_num positive"""
_BINARY = """add sub rsub mul div true_divide floor_divide remainder fmod pow atan2
    minimum maximum fmin fmax eq ne lt le gt ge logical_and logical_or logical_xor
    bitwise_and bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift
    hypot copysign xlogy"""
_TERNARY = "where masked_fill clamp clamp_min clamp_max lerp addcmul addcdiv"
_CAST = "_to_copy to type_as fill copy"  # _to_copy reaches here only when it casts
_CREATION = """arange full full_like zeros zeros_like ones ones_like empty empty_like
    empty_strided new_zeros new_ones new_full new_empty scalar_tensor linspace
    tril triu"""  # tril/triu: a predicate on indices times the input
_REDUCTION = """sum mean amax amin max min var std var_mean std_mean prod any all
    argmax argmin logsumexp norm linalg_vector_norm count_nonzero"""
_SCAN = "cumsum cumprod"
_INDEXED = """topk sort argsort scatter_reduce scatter_add index_put index_add index_reduce scatter
    searchsorted bucketize"""  # reaches here only when not pure movement (reductions, accumulation)
_SOFTMAX = "softmax _softmax log_softmax _log_softmax _safe_softmax"
_NORM = """native_layer_norm layer_norm rms_norm _fused_rms_norm group_norm
    native_group_norm batch_norm native_batch_norm _native_batch_norm_legit
    _native_batch_norm_legit_no_training"""
_MATMUL = "mm bmm addmm baddbmm addbmm matmul linear dot vdot mv addmv einsum"
_CONV = "convolution conv1d conv2d conv3d _convolution conv_transpose1d conv_transpose2d"
_ATTENTION = """scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu
    _scaled_dot_product_attention_math _scaled_dot_product_flash_attention
    _scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention"""
_POOL = """avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d
    max_pool2d_with_indices max_pool3d_with_indices adaptive_avg_pool1d
    adaptive_avg_pool2d _adaptive_avg_pool2d adaptive_avg_pool3d _adaptive_avg_pool3d
    adaptive_max_pool2d"""

COMPUTE_OPS: dict[str, str] = {
    name: cat
    for cat, names in (
        ("pointwise", _UNARY + " " + _BINARY + " " + _TERNARY + " " + _CAST),
        ("creation", _CREATION),
        ("reduction", _REDUCTION),
        ("scan", _SCAN),
        ("indexed", _INDEXED),
        ("softmax", _SOFTMAX),
        ("norm", _NORM),
        ("matmul", _MATMUL),
        ("conv", _CONV),
        ("attention", _ATTENTION),
        ("pool", _POOL),
    )
    for name in names.split()
}
# Overloads whose category differs from their packet's: max.other is an
# elementwise maximum, where.default (one argument) is nonzero (data-dependent);
# out= overloads ("out", "dim_max", "*_out") write into an argument: not known.
_OVERLOADS: dict[tuple[str, str], str | None] = {
    ("max", "other"): "pointwise", ("min", "other"): "pointwise", ("where", "default"): None,
    ("max", "dim_max"): None, ("min", "dim_min"): None,
}


def compute_category(target: Any) -> str | None:
    """The compute category of an ATen op (``"pointwise"``, ``"matmul"``, ...), or None."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        key = (target._opname, target._overloadname)
        if key in _OVERLOADS or key[1] == "out" or key[1].endswith("_out"):
            return _OVERLOADS.get(key)
        return COMPUTE_OPS.get(target._opname)
    return None


def classify(target: Any, args: tuple, kwargs: dict) -> str:
    """``"movement"`` | ``"compute"`` | ``"fallback"`` for one ATen call (movement checked first)."""
    if is_movement(target, args, kwargs):
        return "movement"
    return "compute" if compute_category(target) is not None else "fallback"
