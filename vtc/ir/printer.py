"""Canonical text form of a Graph, and its parser (print(parse(print(g))) == print(g)).

    graph(%x: f32[1, 8, 64], %w: f32[64, 64] const) {
      %permute: f32[1, 64, 8] = movement aten.permute.default(%x, [0, 2, 1])
      %split_0: f32[1, 4], %split_1: f32[1, 4] = movement aten.split_with_sizes.default(%y, [4, 4], 1)
      return (%permute, %split_1)
    }

The header lists the user inputs, then the consts (marked ``const``), one per line
when they do not fit on one.  A node line gives its outputs with their types, its
kind and its op, then the ATen arguments as Python literals (``%name`` for a value,
``inf``/``nan``, ``torch.float32``, ``torch.device('cpu')``, ``torch.strided``...) and
keyword arguments as ``name=value``.  A node is named after its only output, or
after its first output ``<name>_0`` minus ``_0``; otherwise ``  # node <name>``
ends the line.  Names that are not ``[\\w.]+`` are quoted: ``%"a b"``.
Const tensors are not printed: ``parse_graph`` takes them in ``consts``.
"""
from __future__ import annotations

import ast
import importlib
import json
import math
import re
from typing import Any

import torch

from vtc.ir.graph import Graph, Node, Value, op_name

DTYPE_SHORT: dict[torch.dtype, str] = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}
SHORT_DTYPE = {v: k for k, v in DTYPE_SHORT.items()}
_PLAIN_NAME = re.compile(r"[\w.]+")
_NAME = r'%(?:[\w.]+|"(?:[^"\\]|\\.)*")'
_STRING = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""
_MAX_HEADER = 100


# ----------------------------------------------------------------------------- printing

def print_graph(graph: Graph) -> str:
    """The canonical text form of ``graph`` (deterministic; parseable by ``parse_graph``)."""
    params = [_decl(v) for v in graph.inputs] + [_decl(v) + " const" for v in graph.consts]
    one_line = f"graph({', '.join(params)}) {{"
    if len(one_line) <= _MAX_HEADER or not params:
        lines = [one_line]
    else:
        lines = ["graph("] + [f"    {p}," for p in params[:-1]] + [f"    {params[-1]}", ") {"]
    for node in graph.nodes:
        lines.append("  " + print_node(node))
    lines.append(f"  return ({', '.join(_ref(v) for v in graph.outputs)})")
    lines.append("}")
    return "\n".join(lines) + "\n"


def print_node(node: Node) -> str:
    """One node as ``%out: f32[2, 3] = kind op(args)`` (no indentation)."""
    args = [format_arg(a) for a in node.args] + [f"{k}={format_arg(v)}" for k, v in node.kwargs.items()]
    line = f"{', '.join(_decl(v) for v in node.outputs)} = {node.kind} {_target_name(node.target)}({', '.join(args)})"
    if node.name != _default_node_name([v.name for v in node.outputs]):
        line += f"  # node {node.name}"
    return line


def format_type(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    """``f32[1, 8, 64]``; ``f32[]`` for a scalar."""
    return f"{DTYPE_SHORT.get(dtype) or str(dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"


def format_arg(a: Any) -> str:
    """One ATen argument as a parseable Python literal (``%name`` for a Value)."""
    if isinstance(a, Value):
        return _ref(a)
    if a is None or isinstance(a, (bool, int, str)):
        return repr(a)
    if isinstance(a, float):
        return repr(a) if math.isfinite(a) else ("nan" if math.isnan(a) else ("inf" if a > 0 else "-inf"))
    if isinstance(a, complex):
        return f"complex({format_arg(a.real)}, {format_arg(a.imag)})"
    if isinstance(a, list):
        return f"[{', '.join(format_arg(x) for x in a)}]"
    if isinstance(a, tuple):
        return f"({format_arg(a[0])},)" if len(a) == 1 else f"({', '.join(format_arg(x) for x in a)})"
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)  # torch.float32, torch.strided, torch.contiguous_format
    if isinstance(a, torch.device):
        return f"torch.device({str(a)!r})"
    raise ValueError(f"cannot print argument {a!r} of type {type(a).__name__}")


def _decl(v: Value) -> str:
    return f"{_ref(v)}: {format_type(v.shape, v.dtype)}"


def _ref(v: Value) -> str:
    return "%" + (v.name if _PLAIN_NAME.fullmatch(v.name) else json.dumps(v.name))


def _default_node_name(out_names: list[str]) -> str | None:
    if len(out_names) == 1:
        return out_names[0]
    if out_names and out_names[0].endswith("_0"):
        return out_names[0][:-2]
    return None


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return op_name(target)
    return f"{target.__module__}.{target.__qualname__}"


# ----------------------------------------------------------------------------- parsing

def parse_graph(text: str, consts: dict[str, torch.Tensor] | None = None) -> Graph:
    """Parses ``print_graph`` output; const values get their tensor from ``consts`` when given."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    end = next((i for i, ln in enumerate(lines) if ln.rstrip().endswith(") {")), None)
    if not lines or not lines[0].startswith("graph(") or end is None:
        raise ValueError(f"not a vtc graph: the text must start with 'graph(...) {{', got {lines[:1]!r}")
    header = " ".join(ln.strip() for ln in lines[: end + 1])[len("graph("): -len(") {")]
    env: dict[str, Value] = {}
    inputs, const_vals = [], []
    for m in re.finditer(rf"({_NAME}):\s*([\w]+\[[^\]]*\])(\s+const)?", header):
        name, (shape, dtype) = _name(m.group(1)), _parse_type(m.group(2))
        if m.group(3):
            data = None if consts is None else consts.get(name)
            if data is not None and (tuple(data.shape) != shape or data.dtype != dtype):
                raise ValueError(f"const %{name}: declared {format_type(shape, dtype)}, "
                                 f"tensor given is {format_type(tuple(data.shape), data.dtype)}")
            v = Value(name, shape, dtype, "const", data=data)
            const_vals.append(v)
        else:
            v = Value(name, shape, dtype, "input")
            inputs.append(v)
        env[name] = v
    nodes: list[Node] = []
    outputs: list[Value] = []
    for lineno, line in enumerate(lines[end + 1:], start=end + 2):
        s = line.strip()
        try:
            if s == "}":
                break
            if s.startswith("return"):
                inner = s[len("return"):].strip()
                if not (inner.startswith("(") and inner.endswith(")")):
                    raise ValueError("expected 'return (%a, %b)'")
                outputs = [_lookup(env, _name(n)) for n in re.findall(_NAME, inner)]
                continue
            nodes.append(_parse_node(s, env))
        except (ValueError, SyntaxError, AttributeError, KeyError) as e:
            raise ValueError(f"line {lineno}: {e}\n  {line}") from e
    return Graph(inputs, const_vals, nodes, outputs)


def _parse_node(s: str, env: dict[str, Value]) -> Node:
    node_name = None
    m = re.search(r"\s+# node (\S+)$", s)
    if m:
        node_name, s = m.group(1), s[: m.start()]
    m = re.match(rf"^((?:{_NAME}:\s*\w+\[[^\]]*\](?:,\s*)?)+)\s*=\s*(\w+)\s+([\w.]+)\((.*)\)$", s)
    if not m:
        raise ValueError("expected '%out: type = kind op(args)'")
    outs = [Value(_name(o.group(1)), *_parse_type(o.group(2)))
            for o in re.finditer(rf"({_NAME}):\s*(\w+\[[^\]]*\])", m.group(1))]
    target = resolve_op(m.group(3))
    args, kwargs = _parse_args(m.group(4), env)
    for v in outs:
        if v.name in env:
            raise ValueError(f"value %{v.name} is defined twice")
        env[v.name] = v
    name = node_name or _default_node_name([v.name for v in outs])
    return Node(name, target, args, kwargs, tuple(outs), m.group(2))


def _parse_type(t: str) -> tuple[tuple[int, ...], torch.dtype]:
    m = re.fullmatch(r"(\w+)\[([^\]]*)\]", t.strip())
    if not m:
        raise ValueError(f"bad type {t!r}, expected e.g. f32[1, 8]")
    dt = SHORT_DTYPE.get(m.group(1)) or getattr(torch, m.group(1), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {m.group(1)!r} in {t!r}")
    return tuple(int(x) for x in m.group(2).split(",") if x.strip()), dt


def _name(ref: str) -> str:
    return json.loads(ref[1:]) if ref[1:].startswith('"') else ref[1:]


def _lookup(env: dict[str, Value], name: str) -> Value:
    if name not in env:
        raise ValueError(f"%{name} is used before it is defined")
    return env[name]


def resolve_op(name: str) -> Any:
    """``aten.permute.default`` -> ``torch.ops.aten.permute.default``; ``module.fn`` -> that function."""
    parts = name.split(".")
    if len(parts) == 3 and hasattr(torch.ops, parts[0]):
        try:
            return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
        except (AttributeError, RuntimeError):
            pass
    for i in range(len(parts) - 1, 0, -1):  # a Python callable: module path + qualname
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ValueError(f"unknown op {name!r}")


def _parse_args(text: str, env: dict[str, Value]) -> tuple[tuple, dict]:
    refs: list[Value] = []

    def sub(m: re.Match) -> str:
        if m.group(0)[0] != "%":
            return m.group(0)  # a string literal, left alone
        refs.append(_lookup(env, _name(m.group(0))))
        return f"__vtc_ref{len(refs) - 1}"

    src = re.sub(rf"{_STRING}|{_NAME}", sub, text)
    call = ast.parse(f"f({src})", mode="eval").body
    ev = _Eval(refs)
    return tuple(ev(a) for a in call.args), {k.arg: ev(k.value) for k in call.keywords}


class _Eval:
    """Evaluates the literal subset of Python that ``format_arg`` writes."""

    NAMES = {"inf": math.inf, "nan": math.nan, "True": True, "False": False, "None": None}

    def __init__(self, refs: list[Value]):
        self.refs = refs

    def __call__(self, n: ast.AST) -> Any:
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.List):
            return [self(x) for x in n.elts]
        if isinstance(n, ast.Tuple):
            return tuple(self(x) for x in n.elts)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = self(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.Name):
            if n.id.startswith("__vtc_ref"):
                return self.refs[int(n.id[len("__vtc_ref"):])]
            if n.id in self.NAMES:
                return self.NAMES[n.id]
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "torch":
            v = getattr(torch, n.attr, None)
            if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
                return v
        if isinstance(n, ast.Call) and not n.keywords:
            f = ast.unparse(n.func)
            if f == "torch.device":
                return torch.device(*[self(a) for a in n.args])
            if f == "complex":
                return complex(*[self(a) for a in n.args])
        raise ValueError(f"cannot parse argument {ast.unparse(n)!r}")
