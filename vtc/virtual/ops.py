"""Which ATen ops are data-movement ops.

An op is a movement op when every output element equals exactly one input
element (or a constant fill, for padding).  Some ATen ops are movement ops only
for some arguments: ``_to_copy`` that keeps the dtype, ``index_put`` without
accumulation, ``scatter`` without a reduction.  ``is_movement`` decides that;
``vtc.virtual.movement`` gives each one its pull (and push) mapping.
"""
from __future__ import annotations

from typing import Any

import torch

# ATen op names (the overload packet, without ".default"/".int"/...); the _copy
# twins that functionalization produces have the same semantics.
_BASE = (
    "view", "_unsafe_view", "reshape", "_reshape_alias", "permute", "transpose", "t",
    "expand", "squeeze", "unsqueeze", "flatten", "unflatten", "movedim", "swapaxes",
    "slice", "select", "narrow", "split", "split_with_sizes", "chunk", "unbind",
    "cat", "stack", "repeat", "repeat_interleave", "tile",
    "index_select", "gather", "embedding", "index", "take",
    "index_put", "index_copy", "slice_scatter", "select_scatter", "scatter",
    "flip", "roll", "constant_pad_nd", "pixel_shuffle", "pixel_unshuffle",
    "diagonal", "as_strided", "unfold", "clone", "contiguous", "alias", "detach",
    "lift_fresh_copy", "_to_copy", "expand_as", "view_as", "reshape_as",
)
MOVEMENT_OPS: frozenset[str] = frozenset(_BASE) | frozenset(
    f"{n}_copy" for n in _BASE if not n.endswith("copy") and not n.startswith("_")
)


def packet_name(target: Any) -> str | None:
    """``aten.permute.default`` -> ``permute``; None for non-ATen callables."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target._opname
    return None


def base_name(name: str) -> str:
    """``permute_copy`` -> ``permute`` (the _copy twins share one definition)."""
    if name.endswith("_copy") and name not in _BASE and name[: -len("_copy")] in _BASE:
        return name[: -len("_copy")]
    return name


def is_movement(target: Any, args: tuple, kwargs: dict) -> bool:
    """True when this ATen call only moves data (decided by op and arguments)."""
    name = packet_name(target)
    if name is None or name not in MOVEMENT_OPS:
        return False
    name = base_name(name)
    if name == "_to_copy":
        src = args[0]
        dtype = kwargs.get("dtype", None)
        return dtype is None or dtype == getattr(src, "dtype", None)
    if name == "index_put":
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        return not accumulate
    if name == "scatter":
        if "reduce" in kwargs or target._overloadname in ("value", "value_reduce", "reduce", "value_out"):
            return False
        return target._overloadname in ("src", "default")
    if name == "repeat_interleave":
        # repeats given as a tensor make the output shape data-dependent
        return target._overloadname == "self_int"
    if name == "embedding":
        return True
    return True
