"""Size-generic kernels: one compiled kernel serves every size of the dims that vary.

The code generator works on concrete sizes (the index algebra simplifies with
them), so a kernel's C source holds its sizes, strides and loop bounds as
integer literals.  A *template* is that source with the literals that depend
on the varying sizes replaced by expressions of size arguments
(``vtc_s0, vtc_s1, ...``, read from one more pointer after the buffers):

- **fit**: the graph is lowered at a few probe sizes around the current ones
  (a grid of ``degree + 1`` values per symbol, where ``degree`` is the most
  dims of one tensor depending on that symbol, so strides like ``H*S*S`` fit).
  Sources whose text, integer literals aside, differs between probes (another
  loop structure, a simplification that only holds for some sizes) get no
  template.  Each literal is interpolated (Newton forward differences, exact
  integers) by a polynomial in the symbols: ``(c0 + c1*s0 + c2*s0*s0 ...) / d``;
  float literals must not vary.
- **verify**: a template is used for a concrete kernel only when their text is
  the same with every literal masked, and every literal of the concrete source
  equals the template's polynomial at the current sizes (no int64 overflow on
  the way).  The template then computes exactly what the concrete kernel
  would: a template is never trusted beyond the sizes it was checked at.
  A kernel that fails this (size 1 folds loops away; tile counts are not
  polynomials) is built with its constants, as before.  At a later size, the
  template that served a kernel at the previous size is tried first by
  rendering it at the new sizes (``Template.render``) and comparing that text
  with the concrete source: equal texts are a match without parsing.

The template's source is the same for every size, so it is compiled once (and
found in the on-disk cache, keyed by source, by later processes); templates
and their loaded functions are kept per process in ``_TEMPLATES``.
"""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import math
import re
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Sequence

# C tokens that are not integer literals (identifiers, hex and float literals, runs of other characters), in the
# order they are tried at each position; an integer literal is then the next token that none of them matches
_NOT_INT = r"[A-Za-z_]\w*|0[xX][0-9a-fA-F]+|\d+\.\d*(?:[eE][+-]?\d+)?[fF]?|\d+[eE][+-]?\d+[fF]?|[^A-Za-z_\d]+"
# one match per integer literal (group 1: with its LL suffix, group 2: its digits), the tokens before it skipped
# inside the regex engine (possessive: never re-split), and a last match at the end of the text with no group
_INT = re.compile(rf"(?:{_NOT_INT})*+(?:((\d+)(?:LL)?)|\Z)")
_FLOAT = re.compile(r"\d+\.\d*(?:[eE][+-]?\d+)?[fF]?|\d+[eE][+-]?\d+[fF]?")
_ARRAY_DECL = re.compile(r"^\s*(?:alignas\(\d+\)\s*)?(?:const\s+)?[A-Za-z_][\w:<>]*\s+(?:__restrict\s+)?[A-Za-z_]\w*\s*\[")
MAX_DEGREE = 3  # per symbol
MAX_PROBES = 36  # grid points of one fit (lowerings of the whole graph)
PROBE_STEPS = (1, -1, 2, -2, 4)  # distances between probe sizes, tried in turn for the kernels not fitted yet
_LIMIT = 1 << 62  # every term of a size expression must stay below this in magnitude (int64 arithmetic)


def _opening(name: str) -> str:
    return f'extern "C" void {name}(void* const* bufs, int nthreads) {{\n'


@dataclass(frozen=True)
class Parsed:
    """A kernel source cut into what must match exactly and its integer literals."""

    head: str  # everything before the function (preludes, helpers): must not vary
    skeleton: str  # the function with every integer literal replaced by '#'
    spans: tuple[tuple[int, int], ...]  # the literals' (start, end) in the function text
    values: tuple[int, ...]
    func: str


def parse(source: str, name: str) -> Parsed | None:
    """`source` of kernel `name` cut at its function; None when the function is not found."""
    at = source.find(_opening(name))
    if at < 0:
        return None
    head, func = source[:at], source[at:]
    spans, values, parts, last = [], [], [], 0
    body_start = len(_opening(name))
    for m in _INT.finditer(func, body_start):
        if m.lastindex is None:
            continue
        start, end = m.span(1)
        spans.append((start, end))
        values.append(int(m.group(2)))
        parts.append(func[last:start])
        last = end
    parts.append(func[last:])
    return Parsed(head, "#".join(parts), tuple(spans), tuple(values), func)


@dataclass(frozen=True)
class Poly:
    """An integer-valued polynomial in the size symbols: sum(coeff * prod(s_i ** e_i)) / denom."""

    terms: tuple[tuple[tuple[int, ...], int], ...]  # (exponents, integer coefficient)
    denom: int

    def at(self, sizes: Sequence[int]) -> int | None:
        """The value at `sizes`; None when a term could overflow int64 or the division is not exact."""
        total = 0
        for exps, c in self.terms:
            t = c
            for s, e in zip(sizes, exps):
                t *= s ** e
            total += t
            if abs(t) >= _LIMIT or abs(total) >= _LIMIT:  # every product and partial sum C computes
                return None
        if total % self.denom:
            return None
        return total // self.denom

    @property
    def constant(self) -> bool:
        return all(not any(e) for e, _ in self.terms)

    def c_expr(self) -> str:
        """The polynomial as int64 C arithmetic over vtc_s0, vtc_s1, ..."""
        parts = []
        for exps, c in self.terms:
            factors = [f"vtc_s{i}" for i, e in enumerate(exps) for _ in range(e)]
            parts.append("*".join([f"(int64_t){c}"] * (c != 1 or not factors) + factors))
        num = " + ".join(parts) if parts else "0"
        return f"(({num}) / {self.denom})" if self.denom != 1 else f"({num})"


def _poly_mul(a: dict, b: dict) -> dict:
    out: dict = {}
    for ea, ca in a.items():
        for eb, cb in b.items():
            e = tuple(x + y for x, y in zip(ea, eb))
            out[e] = out.get(e, 0) + ca * cb
    return {e: c for e, c in out.items() if c}


def interpolate(base: Sequence[int], degrees: Sequence[int], values: dict[tuple[int, ...], int],
                step: int | Sequence[int] = 1) -> Poly:
    """The polynomial of degree <= degrees[i] in symbol i through values[j] at sizes base + step * j
    (`step` one int, or one per symbol)."""
    k = len(base)
    steps = [step] * k if isinstance(step, int) else list(step)
    grid = list(itertools.product(*[range(d + 1) for d in degrees]))
    diff = {j: Fraction(values[j]) for j in grid}
    for axis in range(k):  # forward differences along each axis: coefficients of prod C(x_i, j_i)
        for order in range(1, degrees[axis] + 1):
            for j in sorted(grid, key=lambda t: -t[axis]):
                if j[axis] >= order:
                    prev = j[:axis] + (j[axis] - 1,) + j[axis + 1:]
                    diff[j] = diff[j] - diff[prev]
    poly: dict = {}
    zero = (0,) * k
    for j, c in diff.items():
        if c == 0:
            continue
        term = {zero: c / math.prod(math.factorial(x) for x in j)}
        for axis, n in enumerate(j):
            for m in range(n):  # C(x, n) = prod_{m<n} (x - m) / n!, x = (s - base) / step
                lin = {zero: Fraction(-base[axis] - m * steps[axis], steps[axis])}
                lin[tuple(int(i == axis) for i in range(k))] = Fraction(1, steps[axis])
                term = _poly_mul(term, lin)
        for e, v in term.items():
            poly[e] = poly.get(e, 0) + v
    poly = {e: c for e, c in poly.items() if c}
    denom = math.lcm(*[c.denominator for c in poly.values()]) if poly else 1
    terms = tuple(sorted(((e, int(c * denom)) for e, c in poly.items()), reverse=True))
    return Poly(terms, denom)


@dataclass
class Template:
    """A kernel's source with its size-dependent literals as expressions of the size arguments."""

    name: str
    parsed: Parsed  # the source it was fitted at (head and skeleton)
    literals: tuple  # per literal: a Poly, or None for a literal that does not vary
    source: str = ""
    fn: object = None
    _cuts: list | None = field(default=None, repr=False, compare=False)  # render's pieces, made when first used

    def render(self, sizes: Sequence[int]) -> str | None:
        """The concrete source this template is at `sizes` (its varying literals written as their values; the
        literals that do not vary, ``LL`` suffixes and everything else as at the fit), or None where a value
        would not be an integer literal that ``parse`` reads back at the same place: not an int, negative, or
        0 followed by ``x`` / ``X`` (a hex prefix).  So ``source == t.render(sizes)`` implies
        ``t.matches(parse(source), sizes)`` (same head, same skeleton, every literal the template's value),
        without parsing the source (``GenericKernels.build``)."""
        p, cuts = self.parsed, self._cuts
        if cuts is None:
            cuts = self._cuts = _cuts(p, self.literals)
        out = [p.head]
        for text, lit, suffix, after in cuts:
            out.append(text)
            if lit is not None:
                v = lit.at(sizes)
                if v is None or v < 0 or (v == 0 and after and after in "xX"):
                    return None
                out.append(f"{v}{suffix}")
        return "".join(out)

    def matches(self, p: Parsed, sizes: Sequence[int]) -> bool:
        """True when concrete source `p` is this template at `sizes` (same text, every literal equal)."""
        if p.skeleton != self.parsed.skeleton or p.head != self.parsed.head:
            return False
        for lit, v, v0 in zip(self.literals, p.values, self.parsed.values):
            if (v != v0) if lit is None else (lit.at(sizes) != v):
                return False
        return True


def _cuts(p: Parsed, literals: Sequence) -> list:
    """Template.render's pieces of p.func: (the text up to the next varying literal, inclusive of the literals
    that do not vary; its Poly or None at the end; its suffix after the digits; the character after it)."""
    out, last = [], 0
    for (start, end), lit in zip(p.spans, literals):
        if lit is None:
            continue
        digits = start
        while digits < end and p.func[digits].isdigit():
            digits += 1
        out.append((p.func[last:start], lit, p.func[digits:end], p.func[end:end + 1]))
        last = end
    out.append((p.func[last:], None, "", ""))
    return out


def fit(name: str, at: Parsed, probes: dict[tuple[int, ...], Parsed], base: Sequence[int],
        degrees: Sequence[int], n_buffers: int, step: int | Sequence[int] = 1) -> Template | None:
    """A template of kernel `name` from its sources at base + step * offset (offset -> source), or None."""
    if any(p is None or p.skeleton != at.skeleton or p.head != at.head
           for p in probes.values()):
        return None
    floats = _FLOAT.findall(at.func)
    if any(_FLOAT.findall(p.func) != floats for p in probes.values()):
        return None  # a float literal depends on the sizes (a mean over a varying dim): not generic
    literals = []
    for i, v0 in enumerate(at.values):
        vals = {off: p.values[i] for off, p in probes.items()}
        if all(v == v0 for v in vals.values()):
            literals.append(None)
            continue
        if not _may_vary(at.func, at.spans[i][0]):
            return None  # an array size or a pragma argument must stay a compile-time constant
        poly = interpolate(base, degrees, vals, step)
        if poly.at(base) != v0:
            return None
        literals.append(poly)
    if all(x is None for x in literals):
        return None  # nothing depends on the sizes: the concrete kernel is already generic
    t = Template(name, at, tuple(literals))
    t.source = _emit(at, literals, name, len(base), n_buffers)
    return t


def _may_vary(func: str, pos: int) -> bool:
    """Whether the literal at `pos` may become a run-time expression: not an array size, not a
    ``#pragma`` argument other than inside its ``if(...)`` clause."""
    start = func.rfind("\n", 0, pos) + 1
    end = func.find("\n", pos)
    line = func[start:end if end >= 0 else len(func)]
    if _ARRAY_DECL.match(line):
        return False
    if line.lstrip().startswith("#pragma"):
        clause = line.find(" if(")
        return 0 <= clause < pos - start and line.find(")", clause) > 0 and _closes_after(line, clause, pos - start)
    return True


def _closes_after(line: str, open_at: int, pos: int) -> bool:
    """Whether the parenthesis opened at line[open_at:] ("... if(") is still open at `pos`."""
    depth = 0
    for i in range(line.index("(", open_at), pos):
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        if depth == 0:
            return False
    return True


def _emit(p: Parsed, literals: Sequence, name: str, n_sizes: int, n_buffers: int) -> str:
    """The template's C++ source: the function reads the sizes from bufs[n_buffers]."""
    out, last = [], 0
    for (start, end), lit in zip(p.spans, literals):
        out.append(p.func[last:start])
        out.append(p.func[start:end] if lit is None else f"((int64_t){lit.c_expr()})")
        last = end
    out.append(p.func[last:])
    func = "".join(out)
    opening = _opening(name)
    loads = ", ".join(f"vtc_s{i} = vtc_sz[{i}]" for i in range(n_sizes))
    sizes = f"  const int64_t* vtc_sz = (const int64_t*)bufs[{n_buffers}];\n  const int64_t {loads};\n"
    return p.head + opening + sizes + func[len(opening):]


def _mismatch(t: Template, p: Parsed, sizes: Sequence[int]) -> str:
    """Why template t is not concrete source p at `sizes` (the first differing literal)."""
    for i, (lit, v, v0) in enumerate(zip(t.literals, p.values, t.parsed.values)):
        want = v0 if lit is None else lit.at(sizes)
        if want != v:
            line = p.func[:p.spans[i][0]].count("\n")
            return f"literal {v} on line {line} of the function, the template gives {want}"
    return "same literals"


_TEMPLATES: dict[tuple, list[Template]] = {}  # (kernel name, symbols, head + skeleton digest) -> templates
# (kernel name, symbols, digest of the whole source) of kernels whose source was the same at every probe size:
# nothing in them depends on the sizes, so the concrete kernel serves every size and needs no probing again;
# the value is its loaded function once built (None before): a later size with that text calls it, no build
_SIZE_FREE: dict[tuple, object] = {}
_LOCK = threading.Lock()


def _key(name: str, symbols: tuple[str, ...], p: Parsed) -> tuple:
    return name, symbols, hashlib.sha256((p.head + "\0" + p.skeleton).encode()).hexdigest()


def _digest_key(name: str, symbols: tuple[str, ...], head: str, func: str) -> tuple:
    return name, symbols, hashlib.sha256((head + "\0" + func).encode()).hexdigest()


_SWITCHES = "\0switches"  # GenericKernels.previous's entry: the codegen_switches() its sources were made under
_CHOSEN = "\0chosen"  # and this one: kernel name -> the template that served it (Template.render)


_UPPER: dict[int, tuple] = {}  # id of a vtc.codegen module -> (the module, the set of its names, its upper-case ones)


def codegen_switches() -> tuple:
    """The module-level switches of the code generators (upper-case bool/int/float/str constants of every
    ``vtc.codegen`` module, e.g. ``gemm.PACKED_B``, and the context variables ``MERGE_INNER_DIMS`` and
    ``STREAM_STORES``): a source is taken from the previous specialization only while they are the same, since
    the same kernel IR may generate other code (another calling convention) under another switch.

    The upper-case names of a module are remembered while the set of its names is the same; their values are
    read at every call."""
    import sys
    from contextvars import ContextVar

    out = []
    for name in sorted(n for n in list(sys.modules) if n.startswith("vtc.codegen.")):
        mod = sys.modules.get(name)
        if mod is None:
            continue
        names = vars(mod)
        known = _UPPER.get(id(mod))
        if known is None or known[0] is not mod or names.keys() != known[1]:
            keys = list(names)
            known = _UPPER[id(mod)] = (mod, frozenset(keys), tuple(k for k in keys if k.isupper()))
        for k in known[2]:
            v = names.get(k)
            if isinstance(v, (bool, int, float, str)) or isinstance(v, ContextVar):
                out.append((name, k, v.get() if isinstance(v, ContextVar) else v))
    return tuple(out)


@dataclass
class GenericKernels:
    """Builds one specialization's kernels, size-generic where a template fits.

    `symbols` name the varying sizes, `sizes` are their values now, `degrees` the
    polynomial degree to fit per symbol, `probe(sizes)` the kernel sources
    (name -> C++ source) of the same graph and plan decisions at other sizes
    (None when it cannot be made), `valid(sizes)` whether probing there is allowed.
    """

    symbols: tuple[str, ...]
    sizes: tuple[int, ...]
    degrees: tuple[int, ...]
    probe: Callable[[tuple[int, ...]], dict[str, str] | None]
    valid: Callable[[tuple[int, ...]], bool]
    stats: dict = field(default_factory=lambda: {"generic": 0, "constant": 0, "fitted": 0})
    misses: list = field(default_factory=list)  # why a kernel had no matching template (then fitted or built)
    # kernel name -> (kernel IR, its source, _SIZE_FREE key) of the previous specialization (the caller keeps it;
    # updated by build): a kernel whose IR equals the previous one's has its source (the MLP, norms, projections
    # of a decode step at a new cache length), so it is not generated again
    previous: dict = field(default_factory=dict)
    reused: int = 0  # kernels whose source came from `previous`
    rendered: int = 0  # kernels matched by the previous size's template without parsing (Template.render)
    switches: tuple | None = None  # codegen_switches() now, when the caller has it (else build reads it)

    def _source(self, kernel) -> tuple[str, tuple | None]:
        """(C++ source, _SIZE_FREE key or None when its function is not found) of kernel IR `kernel`."""
        from vtc.codegen.cpp import generate

        prev = self.previous.get(kernel.name)
        # IR equality is structural (dataclasses; scalars and index expressions are hash-consed, so identity
        # is their equality); a field compared by identity (a closure) only makes two equal kernels unequal
        if prev is not None and type(prev[0]) is type(kernel) and prev[0] == kernel:
            self.reused += 1
            return prev[1], prev[2]
        src = generate(kernel)
        at = src.find(_opening(kernel.name))
        return src, (_digest_key(kernel.name, self.symbols, src[:at], src[at:]) if at >= 0 else None)

    def _probes(self, step: int, current: dict[str, str]):
        """(per-symbol steps, the kernel sources at sizes + steps * offset for every grid offset), or None.

        A symbol whose probes would leave its range at `step` goes the other way (batch 2 probes 3, 4).
        """
        degrees = [min(d, MAX_DEGREE) for d in self.degrees]
        grid = list(itertools.product(*[range(d + 1) for d in degrees]))
        if len(grid) > MAX_PROBES:
            return None
        steps = []
        for i, (b, d) in enumerate(zip(self.sizes, degrees)):
            edge = list(self.sizes)
            edge[i] = b + step * d
            steps.append(step if self.valid(tuple(edge)) else -step)
        points = {off: tuple(b + h * o for b, h, o in zip(self.sizes, steps, off)) for off in grid}
        if not all(self.valid(p) for p in points.values()):
            return None
        sources = {}
        for off, p in points.items():
            sources[off] = self.probe(p) if any(off) else current
            if sources[off] is None:
                return None
        return tuple(steps), sources

    def _load(self, templates: list[Template]) -> None:
        """Compiles new templates (chunks of KERNELS_PER_LIBRARY per library) and registers those that built."""
        from vtc.codegen.cpp import PRELUDE
        from vtc.runtime import cbuild
        from vtc.runtime.executor import KERNELS_PER_LIBRARY

        chunks = [templates[i:i + KERNELS_PER_LIBRARY] for i in range(0, len(templates), KERNELS_PER_LIBRARY)]
        sources = [PRELUDE + "".join(t.source.replace(PRELUDE, "") for t in c) for c in chunks]
        try:
            libs = cbuild.build_many(sources, name="vtcgen")
        except cbuild.KernelBuildError:  # find the chunk that fails; its templates are dropped
            libs = []
            for src in sources:
                try:
                    libs.append(cbuild.build(src, name="vtcgen"))
                except cbuild.KernelBuildError:
                    libs.append(None)
        with _LOCK:
            for chunk, lib in zip(chunks, libs):
                for t in chunk if lib is not None else ():
                    t.fn = getattr(lib, t.name)
                    t.fn.argtypes, t.fn.restype = [ctypes.c_void_p, ctypes.c_int], None
                    _TEMPLATES.setdefault(_key(t.name, self.symbols, t.parsed), []).append(t)

    def build(self, ksteps: list, executor) -> list:
        """The compiled kernels of `ksteps` (``vtc.runtime.executor.CompiledKernel``), templates first."""
        from vtc.codegen.cpp import buffer_order
        from vtc.runtime.executor import CompiledKernel, build_kernels

        switches = self.switches if self.switches is not None else codegen_switches()
        if self.previous.get(_SWITCHES) != switches:  # a code generator's switch changed: generate everything
            self.previous.clear()
        made = {id(s): self._source(s.kernel) for s in ksteps}
        sources = {i: src for i, (src, _) in made.items()}
        free_key = {i: key for i, (_, key) in made.items() if key is not None}  # _SIZE_FREE's, without parsing
        last_chosen = self.previous.get(_CHOSEN, {})
        self.previous.clear()
        self.previous.update((s.kernel.name, (s.kernel, *made[id(s)])) for s in ksteps)
        self.previous[_SWITCHES] = switches
        size_free = {i for i, k in free_key.items() if k in _SIZE_FREE}  # the same at every size: no template
        chosen: dict[int, Template] = {}
        for s in ksteps:  # the previous size's template, when the source is its text at these sizes: no parse
            t = last_chosen.get(s.kernel.name)
            if (t is not None and id(s) in free_key and id(s) not in size_free
                    and t.render(self.sizes) == sources[id(s)]):
                chosen[id(s)] = t
                self.rendered += 1
        parsed = {id(s): parse(sources[id(s)], s.kernel.name)
                  if id(s) in free_key and id(s) not in size_free and id(s) not in chosen else None for s in ksteps}
        missing = []
        for s in ksteps:
            p = parsed[id(s)]
            if p is None or id(s) in size_free:
                continue
            cands = _TEMPLATES.get(_key(s.kernel.name, self.symbols, p), ())
            for t in cands:
                if t.matches(p, self.sizes):
                    chosen[id(s)] = t
                    break
            else:
                missing.append(s)
                self.misses.append(f"{s.kernel.name} at {self.sizes}: " + (
                    _mismatch(cands[0], p, self.sizes) if cands else "no template with this text"))
        current = {s.kernel.name: sources[id(s)] for s in ksteps}
        new = []
        for step in PROBE_STEPS if missing else ():  # above the sizes first, then below (a size class's top)
            probed = self._probes(step, current)
            if probed is None:
                continue
            steps, probes = probed
            for s in list(missing):
                name = s.kernel.name
                got = {off: (parse(src[name], name) if name in src else None) for off, src in probes.items()}
                here = parsed[id(s)]
                if all(g is not None and g.head == here.head and g.func == here.func for g in got.values()):
                    with _LOCK:  # the same text at every probe size: no template, and no probing next time
                        _SIZE_FREE.setdefault(free_key[id(s)], None)
                    size_free.add(id(s))
                    missing.remove(s)
                    continue
                t = fit(name, here, got, self.sizes, [min(d, MAX_DEGREE) for d in self.degrees],
                        len(buffer_order(s.kernel)), steps)
                if t is not None and t.matches(here, self.sizes):
                    chosen[id(s)] = t
                    new.append(t)
                    missing.remove(s)
            if not missing:
                break
        self.stats["fitted"] += len(new)
        if new:
            self._load(new)
            for key in [key for key, t in chosen.items() if t.fn is None]:
                del chosen[key]  # its template did not build: the kernel keeps its constants
        constant = [s for s in ksteps if id(s) not in chosen]
        self.misses += [f"{s.kernel.name} at {self.sizes}: not generic (built with its sizes)" for s in constant
                        if id(s) not in size_free]
        # a size-free kernel built before (its whole text the same): its function, without generating it again
        loaded = {id(s): fn for s in constant if id(s) in size_free and (fn := _SIZE_FREE.get(free_key[id(s)]))}
        fresh = [s for s in constant if id(s) not in loaded]
        built = dict(zip(map(id, fresh), build_kernels(fresh)))
        built.update((i, CompiledKernel(s, loaded[i])) for s in constant if (i := id(s)) in loaded)
        with _LOCK:
            for s in fresh:
                if id(s) in size_free:
                    _SIZE_FREE[free_key[id(s)]] = built[id(s)].fn
        self.stats["generic"] += len(chosen)
        self.stats["constant"] += len(constant)
        self.previous[_CHOSEN] = {s.kernel.name: chosen[id(s)] for s in ksteps if id(s) in chosen}
        return [CompiledKernel(s, chosen[id(s)].fn, sizes=self.sizes) if id(s) in chosen else built[id(s)]
                for s in ksteps]
