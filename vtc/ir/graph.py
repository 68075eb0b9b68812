"""vtc's graph IR: values with static shapes and dtypes, nodes that call ATen ops.

A node keeps the ATen call it came from (``target`` plus ``args``/``kwargs`` with
``Value`` objects where tensors go), so that any node can always be run by the
framework.  ``kind`` says what vtc knows about it:

- ``movement``: a data-movement op (every output element is one input element);
  ``vtc.virtual.movement`` defines its pull/push mapping.
- ``compute``: an op vtc knows the maths of (pointwise, reduction, GEMM, ...).
- ``fallback``: an op vtc does not know; it is run by torch and reported.

Values of kind ``input`` are the user's inputs, ``const`` ones hold a tensor
(parameters, buffers, lifted constants), ``node`` ones are produced by a node.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree

NODE_KINDS = ("movement", "compute", "fallback")


@dataclass(eq=False)
class Value:
    """A tensor in the graph: a name, a static shape and a dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = "node"  # "input" | "const" | "node"
    producer: "Node | None" = None
    data: torch.Tensor | None = None  # the tensor of a "const" value

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def __repr__(self) -> str:
        return f"%{self.name}"


def _itemsize(dtype: torch.dtype) -> int:
    """Bytes per element (``torch.dtype.itemsize``; a 0-d tensor's element size took ~3 us: ~600 calls per new
    length of a decode step, vtc.runtime.segment's sizes of every value)."""
    size = getattr(dtype, "itemsize", None)
    return size if isinstance(size, int) else torch.empty((), dtype=dtype).element_size()


@dataclass(eq=False)
class Node:
    """One ATen call. ``args``/``kwargs`` hold ``Value`` objects where tensors go."""

    name: str
    target: Any  # a torch OpOverload (torch.ops.aten.permute.default) or a callable
    args: tuple
    kwargs: dict
    outputs: tuple[Value, ...]
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in NODE_KINDS:
            raise ValueError(f"node {self.name}: kind {self.kind!r} is not one of {NODE_KINDS}")
        for v in self.outputs:
            v.producer = self

    @property
    def op(self) -> str:
        """The op's printable name, e.g. ``aten.permute.default``."""
        return op_name(self.target)

    @property
    def inputs(self) -> list[Value]:
        """Tensor operands in argument order, each once."""
        seen: dict[int, Value] = {}
        _values_into(self.args, seen)
        _values_into(self.kwargs, seen)
        return list(seen.values())

    def run(self, env: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Runs the framework op on concrete tensors looked up by value name."""
        args, kwargs = pytree.tree_map(
            lambda x: env[x.name] if isinstance(x, Value) else x, (self.args, self.kwargs)
        )
        out = self.target(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return (out,)
        return tuple(out)


def _leaves(tree: Any):
    """``pytree.tree_leaves(tree)`` in order, walking plain tuples, lists and dicts itself (Node.inputs is called
    thousands of times per lowering); any other pytree node goes to pytree."""
    t = type(tree)
    if t is tuple or t is list:
        for x in tree:
            yield from _leaves(x)
    elif t is dict:
        for x in tree.values():
            yield from _leaves(x)
    elif t in pytree.SUPPORTED_NODES or pytree.is_namedtuple_class(t):
        yield from pytree.tree_leaves(tree)
    else:
        yield tree


# leaf types of node arguments that are never pytree nodes: _values_into tests them before asking pytree
_ATOMS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


def _values_into(tree: Any, seen: dict[int, Value]) -> None:
    """The Values among ``_leaves(tree)``, in order, added to `seen` (by id, first occurrence kept): Node.inputs,
    ~1,500 calls per lowering of a decode step, without a generator per level or pytree's test per leaf."""
    t = type(tree)
    if t is Value:
        seen.setdefault(id(tree), tree)
    elif t is tuple or t is list:
        for x in tree:
            _values_into(x, seen)
    elif t is dict:
        for x in tree.values():
            _values_into(x, seen)
    elif t not in _ATOMS:
        for leaf in _leaves(tree):
            if isinstance(leaf, Value):
                seen.setdefault(id(leaf), leaf)


def op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


@dataclass(eq=False)
class Graph:
    """A topologically ordered list of nodes between flat lists of inputs and outputs."""

    inputs: list[Value]
    consts: list[Value]
    nodes: list[Node]
    outputs: list[Value]
    in_spec: Any = None  # pytree spec of (args, kwargs) as the user passes them
    out_spec: Any = None  # pytree spec of what the model returns
    meta: dict = field(default_factory=dict)

    def values(self) -> Iterator[Value]:
        yield from self.inputs
        yield from self.consts
        for n in self.nodes:
            yield from n.outputs

    def users(self) -> dict[str, list[Node]]:
        """Value name -> nodes that read it, in graph order."""
        out: dict[str, list[Node]] = {v.name: [] for v in self.values()}
        for n in self.nodes:
            for v in n.inputs:
                out[v.name].append(n)
        return out

    def __str__(self) -> str:
        from vtc.ir.printer import print_graph

        return print_graph(self)
