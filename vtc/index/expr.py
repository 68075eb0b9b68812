"""The index algebra: a small closed set of integer expressions with ranges.

Every expression is immutable and hash-consed (equal means identical, so ``is``
and ``==`` agree and dictionaries keyed by expressions are cheap).  Every node
carries an inclusive integer range ``[lo, hi]`` computed when it is built;
variables get theirs from the dimension they index, loads from the declared
range of the index tensor.  The smart constructors simplify as they build, and
simplification uses the ranges (``x // 8`` is ``0`` when ``0 <= x < 8``).

Node kinds (``op``):
  var(name, extent)        a loop index in [0, extent-1]
  const(v)                 an integer
  sum(c, ((atom, k), ...)) c + sum(k * atom): the canonical linear form
  mul(a, b)                a product of two non-constant expressions
  floordiv(a, d) / mod(a, d)   floor division / floor modulo by a constant d > 0
  min(a, b) / max(a, b)
  select(p, a, b)          a if p else b
  lt(a, b) / eq(a, b) / and(a, b) / or(a, b) / not(a)   predicates (0 or 1)
  load(tensor, (i, ...), lo, hi)   an element of an integer index tensor

Division and modulo are only by positive constants: that is all data movement
needs.  The linear form merges the digits of a reshape: ``(x // d) % m`` and
``(x // (d*m)) % m2`` with matching coefficients fuse into ``(x // d) % (m*m2)``
(TVM's iter-split fusion), which is what lets split-then-merge reshapes vanish.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, Iterable, Mapping as TMapping

import torch

INF = math.inf

_TABLE: "weakref.WeakValueDictionary[tuple, Expr]" = weakref.WeakValueDictionary()


class Expr:
    """An immutable, hash-consed integer expression with an inclusive range [lo, hi]."""

    __slots__ = ("op", "args", "lo", "hi", "_str", "__weakref__")

    op: str
    args: tuple
    lo: float
    hi: float

    def __new__(cls, op: str, args: tuple, lo: float, hi: float) -> "Expr":
        key = (op, args)
        hit = _TABLE.get(key)
        if hit is not None:
            return hit
        self = object.__new__(cls)
        self.op, self.args, self.lo, self.hi, self._str = op, args, lo, hi, None
        _TABLE[key] = self
        return self

    # hash-consed: identity is equality, object's own __hash__ / __eq__ (C slots; Python ones here were called
    # ~26,000 times per new length of a decode step, every key of the table hashing its arguments)

    def __reduce__(self):
        raise TypeError("vtc index expressions are not picklable; print them instead")

    # arithmetic sugar -------------------------------------------------------
    def __add__(self, o): return add(self, o)
    def __radd__(self, o): return add(o, self)
    def __sub__(self, o): return add(self, mul(o, -1))
    def __rsub__(self, o): return add(o, mul(self, -1))
    def __mul__(self, o): return mul(self, o)
    def __rmul__(self, o): return mul(o, self)
    def __neg__(self): return mul(self, -1)
    def __floordiv__(self, o): return floordiv(self, o)
    def __mod__(self, o): return mod(self, o)

    @property
    def is_const(self) -> bool:
        return self.op == "const"

    @property
    def value(self) -> int:
        if self.op != "const":
            raise ValueError(f"{self} is not a constant")
        return self.args[0]

    def __repr__(self) -> str:
        return to_str(self)


ExprLike = Expr | int


def lift(x: ExprLike) -> Expr:
    """An int (or bool) as a constant; an Expr unchanged."""
    if isinstance(x, Expr):
        return x
    if isinstance(x, bool):
        return const(int(x))
    if isinstance(x, int):
        return const(x)
    try:
        import operator

        return const(operator.index(x))
    except TypeError:
        raise TypeError(f"cannot use {x!r} ({type(x).__name__}) as an index expression") from None


def const(v: int) -> Expr:
    """The integer constant v."""
    v = int(v)
    return Expr("const", (v,), v, v)


def var(name: str, extent: int) -> Expr:
    """A loop index named `name` ranging over [0, extent-1]; the constant 0 when extent is 1."""
    if extent < 1:
        raise ValueError(f"variable {name!r} needs an extent >= 1, got {extent}")
    if extent == 1:  # canonical: x + 0 and x must be the same expression
        return const(0)
    return Expr("var", (name, int(extent)), 0, int(extent) - 1)


TRUE = const(1)
FALSE = const(0)


# ---------------------------------------------------------------------------
# linear form
def _terms(e: Expr) -> tuple[int, dict[Expr, int]]:
    """e as (constant, {atom: coefficient})."""
    if e.op == "const":
        return e.value, {}
    if e.op == "sum":
        c, ts = e.args
        return c, dict(ts)
    return 0, {e: 1}


def _atom_key(a: Expr) -> str:
    return to_str(a)


def _digit(a: Expr) -> tuple[Expr, int, float]:
    """a as (x // d) % m with m possibly INF: the digit view used to fuse reshapes."""
    if a.op == "floordiv":
        x, d = a.args
        return x, d, INF
    if a.op == "mod":
        x, m = a.args
        if x.op == "floordiv":
            return x.args[0], x.args[1], m
        return x, 1, m
    return a, 1, INF


def _from_digit(x: Expr, d: int, m: float) -> Expr:
    y = floordiv(x, d) if d != 1 else x
    return y if m == INF else mod(y, int(m))


def _fuse_digits(terms: dict[Expr, int]) -> dict[Expr, int]:
    """Merges k*((x//d)%m) + k*m*((x//(d*m))%m2) into k*((x//d)%(m*m2)) until none is left."""
    changed = True
    while changed:
        changed = False
        items = list(terms.items())
        for i, (a1, k1) in enumerate(items):
            x1, d1, m1 = _digit(a1)
            if m1 == INF:
                continue
            for a2, k2 in items:
                if a2 is a1:
                    continue
                x2, d2, m2 = _digit(a2)
                if x2 is x1 and d2 == d1 * m1 and k2 == k1 * m1:
                    del terms[a1], terms[a2]
                    fused = _from_digit(x1, d1, m1 * m2)
                    c, ts = _terms(mul(fused, k1))
                    if c:
                        terms[const(1)] = terms.get(const(1), 0) + c  # folded out below
                    for a, k in ts.items():
                        terms[a] = terms.get(a, 0) + k
                        if terms[a] == 0:
                            del terms[a]
                    changed = True
                    break
            if changed:
                break
    return terms


def _make_sum(c: int, terms: dict[Expr, int]) -> Expr:
    one = const(1)
    if one in terms:
        c += terms.pop(one)
    for a in [a for a in terms if a.lo == a.hi]:  # an atom whose range is one value is that value
        c += terms.pop(a) * int(a.lo)
    terms = {a: k for a, k in terms.items() if k != 0}
    if terms:
        terms = _fuse_digits(terms)
        if one in terms:
            c += terms.pop(one)
    if not terms:
        return const(c)
    if c == 0 and len(terms) == 1:
        (a, k), = terms.items()
        if k == 1:
            return a
    ts = tuple(sorted(terms.items(), key=lambda t: _atom_key(t[0])))
    lo = c + sum(k * (a.lo if k > 0 else a.hi) for a, k in ts)
    hi = c + sum(k * (a.hi if k > 0 else a.lo) for a, k in ts)
    return Expr("sum", (c, ts), lo, hi)


def add(a: ExprLike, b: ExprLike) -> Expr:
    """a + b."""
    a, b = lift(a), lift(b)
    ca, ta = _terms(a)
    cb, tb = _terms(b)
    for atom, k in tb.items():
        ta[atom] = ta.get(atom, 0) + k
    return _make_sum(ca + cb, ta)


def mul(a: ExprLike, b: ExprLike) -> Expr:
    """a * b (a product of two non-constants stays a `mul` atom)."""
    a, b = lift(a), lift(b)
    if b.is_const:
        a, b = b, a
    if a.is_const:
        k = a.value
        if k == 0:
            return const(0)
        c, ts = _terms(b)
        return _make_sum(c * k, {atom: kk * k for atom, kk in ts.items()})
    if _atom_key(a) > _atom_key(b):
        a, b = b, a
    corners = [a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi]
    corners = [0 if math.isnan(x) else x for x in corners]
    return Expr("mul", (a, b), min(corners), max(corners))


def _positive_divisor(d: ExprLike, what: str) -> int:
    d = lift(d)
    if not d.is_const or d.value <= 0:
        raise ValueError(f"{what} needs a positive constant divisor, got {d}")
    return d.value


def _floor(x: float, d: int) -> float:
    return x if math.isinf(x) else x // d


def _split_multiple(c: int, terms: dict[Expr, int], d: int) -> tuple[int, Expr, Expr] | None:
    """(g, y, r) with c + terms == g*y + r, g > 1 dividing d and 0 <= r < g; the largest such g."""
    for g in sorted({math.gcd(d, k) for k in terms.values()} - {1}, reverse=True):
        y = {t: k // g for t, k in terms.items() if k % g == 0}
        rest = {t: k for t, k in terms.items() if k % g != 0}
        r = _make_sum(c, dict(rest))
        if y and r.lo >= 0 and r.hi < g:
            return g, _make_sum(0, y), r
    return None


def floordiv(a: ExprLike, d: ExprLike) -> Expr:
    """floor(a / d) for a constant d > 0."""
    a, d = lift(a), _positive_divisor(d, "floordiv")
    if d == 1:
        return a
    if a.is_const:
        return const(a.value // d)
    if _floor(a.lo, d) == _floor(a.hi, d):
        return const(int(a.lo // d))
    if a.op == "floordiv":
        return floordiv(a.args[0], a.args[1] * d)
    if a.op == "mod":
        x, m = _digit(a)[0], a.args[1]
        if m % d == 0:
            xd = _digit(a)[1]
            return _from_digit(x, xd * d, m // d)
    if a.op == "sum":
        c, terms = _terms(a)
        out = {t: k // d for t, k in terms.items() if k % d == 0}
        rest = {t: k for t, k in terms.items() if k % d != 0}
        q = c // d
        r = c % d
        if out or q:
            return add(_make_sum(q, out), floordiv(_make_sum(r, rest), d))
        split = _split_multiple(c, terms, d)
        if split:  # floor((g*y + r) / d) == floor(y / (d/g)) when g | d and 0 <= r < g
            g, y, _ = split
            return floordiv(y, d // g)
    return Expr("floordiv", (a, d), _floor(a.lo, d), _floor(a.hi, d))


def mod(a: ExprLike, m: ExprLike) -> Expr:
    """a mod m (floor modulo, result in [0, m-1]) for a constant m > 0."""
    a, m = lift(a), _positive_divisor(m, "mod")
    if m == 1:
        return const(0)
    if a.is_const:
        return const(a.value % m)
    if a.lo >= 0 and a.hi < m:
        return a
    if a.op == "mod" and a.args[1] % m == 0:
        return mod(a.args[0], m)
    if a.op == "sum":
        c, terms = _terms(a)
        inner = [t for t in terms if t.op == "mod" and t.args[1] % m == 0]
        if inner:  # (k*(y % M) + z) mod m == (k*y + z) mod m when m | M
            out = _make_sum(c, {t: k for t, k in terms.items() if t not in inner})
            for t in inner:
                out = add(out, mul(t.args[0], terms[t]))
            return mod(out, m)
        rest = {t: k for t, k in terms.items() if k % m != 0}
        r = c % m
        if len(rest) != len(terms) or r != c:
            return mod(_make_sum(r, rest), m)
        split = _split_multiple(c, terms, m)
        if split:  # (g*y + r) mod m == g*(y mod m/g) + r when g | m and 0 <= r < g
            g, y, rem = split
            return add(mul(mod(y, m // g), g), rem)
    lo, hi = 0, m - 1
    if a.lo >= 0 and a.hi - a.lo < m and a.lo % m <= a.hi % m:
        lo, hi = a.lo % m, a.hi % m
    return Expr("mod", (a, m), lo, hi)


def min_(a: ExprLike, b: ExprLike) -> Expr:
    """min(a, b)."""
    a, b = lift(a), lift(b)
    if a is b or a.hi <= b.lo:
        return a
    if b.hi <= a.lo:
        return b
    if _atom_key(a) > _atom_key(b):
        a, b = b, a
    return Expr("min", (a, b), min(a.lo, b.lo), min(a.hi, b.hi))


def max_(a: ExprLike, b: ExprLike) -> Expr:
    """max(a, b)."""
    a, b = lift(a), lift(b)
    if a is b or a.lo >= b.hi:
        return a
    if b.lo >= a.hi:
        return b
    if _atom_key(a) > _atom_key(b):
        a, b = b, a
    return Expr("max", (a, b), max(a.lo, b.lo), max(a.hi, b.hi))


def clamp(a: ExprLike, lo: ExprLike, hi: ExprLike) -> Expr:
    """min(max(a, lo), hi)."""
    return min_(max_(a, lo), hi)


# ---------------------------------------------------------------------------
# predicates (values 0 / 1)
def lt(a: ExprLike, b: ExprLike) -> Expr:
    """a < b."""
    a, b = lift(a), lift(b)
    d = add(a, mul(b, -1))
    if d.hi < 0:
        return TRUE
    if d.lo >= 0:
        return FALSE
    a, b = _sides(d)
    return Expr("lt", (a, b), 0, 1)


def _sides(d: Expr) -> tuple[Expr, Expr]:
    """(a, b) with a - b == d, constants on one side, the first variable term positive."""
    c, terms = _terms(d)
    first = min(terms, key=_atom_key)
    if terms[first] > 0:
        return _make_sum(0, terms), const(-c)
    return const(c), _make_sum(0, {t: -k for t, k in terms.items()})


def le(a: ExprLike, b: ExprLike) -> Expr:
    """a <= b."""
    return lt(a, add(b, 1))


def ge(a: ExprLike, b: ExprLike) -> Expr:
    """a >= b."""
    return lt(add(b, -1), a)


def gt(a: ExprLike, b: ExprLike) -> Expr:
    """a > b."""
    return lt(b, a)


def eq(a: ExprLike, b: ExprLike) -> Expr:
    """a == b."""
    a, b = lift(a), lift(b)
    d = add(a, mul(b, -1))
    if d.is_const:
        return TRUE if d.value == 0 else FALSE
    if d.lo > 0 or d.hi < 0:
        return FALSE
    a, b = _sides(d)
    if a.is_const:
        a, b = b, a
    return Expr("eq", (a, b), 0, 1)


def and_(*ps: ExprLike) -> Expr:
    """The conjunction of predicates."""
    return _join("and", TRUE, FALSE, ps)


def or_(*ps: ExprLike) -> Expr:
    """The disjunction of predicates."""
    return _join("or", FALSE, TRUE, ps)


def _join(op: str, unit: Expr, zero: Expr, ps) -> Expr:
    """Predicates `ps` joined by `op` ("and" / "or"): `zero` decides it (FALSE for "and"), `unit` is left out, a
    predicate the same as the join so far adds nothing; the two sides of each join in one order."""
    out = unit
    for p in map(lift, ps):
        if p is zero or out is zero:
            return zero
        if p is unit or p is out:
            continue
        if out is unit:
            out = p
            continue
        a, b = (out, p) if _atom_key(out) <= _atom_key(p) else (p, out)
        out = Expr(op, (a, b), 0, 1)
    return out


def not_(p: ExprLike) -> Expr:
    """The negation of a predicate."""
    p = lift(p)
    if p.is_const:
        return FALSE if p.value else TRUE
    if p.op == "not":
        return p.args[0]
    if p.op == "lt":  # not (a < b)  ==  b <= a  ==  b < a + 1
        return lt(p.args[1], add(p.args[0], 1))
    return Expr("not", (p,), 0, 1)


def select(p: ExprLike, a: ExprLike, b: ExprLike) -> Expr:
    """a if p else b."""
    p, a, b = lift(p), lift(a), lift(b)
    if p.is_const:
        return a if p.value else b
    if a is b:
        return a
    return Expr("select", (p, a, b), min(a.lo, b.lo), max(a.hi, b.hi))


def load(tensor: str, index: Iterable[ExprLike], lo: int, hi: int) -> Expr:
    """tensor[index...], an element of an integer index tensor known to lie in [lo, hi]."""
    index = tuple(lift(i) for i in index)
    return Expr("load", (tensor, index, int(lo), int(hi)), int(lo), int(hi))


# ---------------------------------------------------------------------------
# traversal, substitution, evaluation, printing
def _rebuild(e: Expr, f: Callable[[Expr], Expr]) -> Expr:
    """e with f applied to its immediate sub-expressions, re-simplified."""
    op, a = e.op, e.args
    if op in ("var", "const"):
        return e
    if op == "sum":
        c, ts = a
        out = const(c)
        for atom, k in ts:
            out = add(out, mul(f(atom), k))
        return out
    if op == "mul":
        return mul(f(a[0]), f(a[1]))
    if op == "floordiv":
        return floordiv(f(a[0]), a[1])
    if op == "mod":
        return mod(f(a[0]), a[1])
    if op == "load":
        return load(a[0], [f(i) for i in a[1]], a[2], a[3])
    ctor = {"min": min_, "max": max_, "select": select, "lt": lt, "eq": eq,
            "and": and_, "or": or_, "not": not_}[op]
    return ctor(*(f(x) for x in a))


def subs(e: Expr, env: TMapping[str, ExprLike]) -> Expr:
    """e with each variable named in env replaced (simultaneously) by its expression."""
    env = {k: lift(v) for k, v in env.items()}
    memo: dict[Expr, Expr] = {}

    def go(x: Expr) -> Expr:
        r = memo.get(x)
        if r is None:
            r = env.get(x.args[0], x) if x.op == "var" else _rebuild(x, go)
            memo[x] = r
        return r

    r = go(e)
    del go  # go holds itself through its cell: a cycle that only the garbage collector would free
    return r


def replace_loads(e: Expr, fn: Callable[[str, tuple[Expr, ...]], Expr | None]) -> Expr:
    """e with each load(t, idx) replaced by fn(t, idx) where that is not None."""
    memo: dict[Expr, Expr] = {}

    def go(x: Expr) -> Expr:
        r = memo.get(x)
        if r is None:
            if x.op == "load":
                idx = tuple(go(i) for i in x.args[1])
                r = fn(x.args[0], idx)
                r = load(x.args[0], idx, x.args[2], x.args[3]) if r is None else r
            else:
                r = _rebuild(x, go)
            memo[x] = r
        return r

    r = go(e)
    del go  # the cycle through its cell, as in subs
    return r


def walk(e: Expr) -> Iterable[Expr]:
    """Every sub-expression of e, each once (e first)."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        if x.op == "sum":
            stack.extend(atom for atom, _ in x.args[1])
        elif x.op == "load":
            stack.extend(x.args[1])
        elif x.op not in ("var", "const"):
            stack.extend(y for y in x.args if isinstance(y, Expr))


def free_vars(e: Expr) -> set[str]:
    """Names of the variables in e."""
    return {x.args[0] for x in walk(e) if x.op == "var"}


def loads(e: Expr) -> set[str]:
    """Names of the index tensors e loads from."""
    return {x.args[0] for x in walk(e) if x.op == "load"}


def evaluate(e: Expr, env: TMapping[str, torch.Tensor | int],
             tensors: TMapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """e evaluated elementwise on int64 tensors (variables broadcast against each other).

    Loads clamp their index into the tensor's bounds, so evaluating a masked-off
    piece never reads out of bounds; range checks of index tensors happen before.
    """
    tensors = tensors or {}
    memo: dict[int, torch.Tensor] = {}

    def go(x: Expr) -> torch.Tensor:
        r = memo.get(id(x))
        if r is not None:
            return r
        op, a = x.op, x.args
        if op == "const":
            r = torch.tensor(a[0], dtype=torch.int64)
        elif op == "var":
            if a[0] not in env:
                raise KeyError(f"no value for index variable {a[0]!r} in {sorted(env)}")
            r = torch.as_tensor(env[a[0]], dtype=torch.int64)
        elif op == "sum":
            r = torch.tensor(a[0], dtype=torch.int64)
            for atom, k in a[1]:
                r = r + go(atom) * k
        elif op == "mul":
            r = go(a[0]) * go(a[1])
        elif op == "floordiv":
            r = torch.div(go(a[0]), a[1], rounding_mode="floor")
        elif op == "mod":
            r = torch.remainder(go(a[0]), a[1])
        elif op == "min":
            r = torch.minimum(go(a[0]), go(a[1]))
        elif op == "max":
            r = torch.maximum(go(a[0]), go(a[1]))
        elif op == "select":
            r = torch.where(go(a[0]).bool(), go(a[1]), go(a[2]))
        elif op == "lt":
            r = (go(a[0]) < go(a[1])).long()
        elif op == "eq":
            r = (go(a[0]) == go(a[1])).long()
        elif op == "and":
            r = (go(a[0]).bool() & go(a[1]).bool()).long()
        elif op == "or":
            r = (go(a[0]).bool() | go(a[1]).bool()).long()
        elif op == "not":
            r = (~go(a[0]).bool()).long()
        elif op == "load":
            name, index = a[0], a[1]
            if name not in tensors:
                raise KeyError(f"no index tensor {name!r} among {sorted(tensors)}")
            t = tensors[name]
            if len(index) != t.dim():
                raise ValueError(f"load from {name!r} with {len(index)} indices, tensor has shape {tuple(t.shape)}")
            idx = [go(i).clamp(0, max(s - 1, 0)) for i, s in zip(index, t.shape)]
            idx = torch.broadcast_tensors(*idx) if idx else ()
            r = t[tuple(idx)].to(torch.int64) if idx else t.reshape(()).to(torch.int64)
        else:  # pragma: no cover - the constructors make no other ops
            raise AssertionError(op)
        memo[id(x)] = r
        return r

    r = go(e)
    del go  # the cycle through its cell, as in subs
    return r


def to_str(e: Expr) -> str:
    """The canonical text of e (equal expressions print equal)."""
    if e._str is None:
        e._str = _format(e)
    return e._str


def _format(e: Expr) -> str:
    op, a = e.op, e.args
    if op == "const":
        return str(a[0])
    if op == "var":
        return a[0]
    if op == "sum":
        c, ts = a
        parts = []
        for atom, k in ts:
            s = to_str(atom)
            parts.append(s if k == 1 else f"-{s}" if k == -1 else f"{k}*{s}")
        if c:
            parts.append(str(c))
        out = parts[0]
        for p in parts[1:]:
            out += f" - {p[1:]}" if p.startswith("-") else f" + {p}"
        return f"({out})"
    if op == "mul":
        return f"{to_str(a[0])}*{to_str(a[1])}"
    if op == "floordiv":
        return f"({to_str(a[0])} // {a[1]})"
    if op == "mod":
        return f"({to_str(a[0])} % {a[1]})"
    if op in ("min", "max"):
        return f"{op}({to_str(a[0])}, {to_str(a[1])})"
    if op == "select":
        return f"({to_str(a[0])} ? {to_str(a[1])} : {to_str(a[2])})"
    if op == "lt":
        return f"({to_str(a[0])} < {to_str(a[1])})"
    if op == "eq":
        return f"({to_str(a[0])} == {to_str(a[1])})"
    if op == "and":
        return f"({to_str(a[0])} && {to_str(a[1])})"
    if op == "or":
        return f"({to_str(a[0])} || {to_str(a[1])})"
    if op == "not":
        return f"!{to_str(a[0])}"
    if op == "load":
        return f"{a[0]}[{', '.join(to_str(i) for i in a[1])}]"
    raise AssertionError(op)


def affine(e: Expr) -> tuple[int, dict[str, int]] | None:
    """(offset, {var name: coefficient}) when e is affine in its variables, else None."""
    c, terms = _terms(e)
    coeffs: dict[str, int] = {}
    for atom, k in terms.items():
        if atom.op != "var":
            return None
        coeffs[atom.args[0]] = k
    return c, coeffs
