"""A new length of a decode loop, session 17: what is not worked out again, and that the answers stay exact.

- a kernel whose source depends on the length (a cache's cat, attention over it, a projection stored into it) is
  generated at every new length, but matched against the template that served it at the previous length by
  rendering that template at the new sizes and comparing texts (``Template.render``): no parse, no probe, no
  build;
- ``index.mapping.linear_offset`` keeps its answers (exact: hash-consed expressions and ints), bounded by two
  generations that ``vtc.dynamic`` rotates once per size;
- results close to eager at lengths 1, 17, 127 (and others), bit-identical to a fresh compile.
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

import vtc
import vtc.dynamic
from vtc.index import mapping
from vtc.index.expr import const, var
from vtc.runtime import generic

from .test_new_length_cost import TOL, _Counter, _decode, _fresh_templates, _inputs  # noqa: F401 - an autouse fixture

pytestmark = pytest.mark.filterwarnings("ignore::vtc.NewSizesWarning")  # a new length per call, on purpose


def _fn(seed):
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(32, 48, generator=g) / 6, torch.randn(48, 32, generator=g) / 7
    return lambda tok, past: _decode(tok, past, w1, w2)


class _Calls:
    """Counts calls of a module function looked up at call time (monkeypatched)."""

    def __init__(self, monkeypatch, owner, name):
        self.n = 0
        f = getattr(owner, name)

        def counted(*a, **k):
            self.n += 1
            return f(*a, **k)

        monkeypatch.setattr(owner, name, counted)


def test_a_new_length_renders_the_previous_template_parses_nothing_and_probes_nothing(monkeypatch):
    """Before: every kernel source generated at a new length was parsed (its integer literals cut out) and looked
    up among the templates by the digest of its text (3 parses per length for this model; 22 for the 4-layer
    Llama)."""
    fn = _fn(0)
    compiled = vtc.compile(fn, _inputs(9, 0))
    for p in (10, 11):  # 10: the symbolic capture and the fit; 11: the first instantiation
        compiled(*_inputs(p, p))
    count = _Counter(monkeypatch)
    parses = _Calls(monkeypatch, generic, "parse")
    probes = _Calls(monkeypatch, vtc.dynamic.DynamicSizes, "_probe")  # the lowerings at other sizes (a fit)
    builds = _Calls(monkeypatch, generic.GenericKernels, "_load")  # templates compiled
    dyn = compiled._dynamic
    for p in (12, 13, 17, 33, 40):
        count.reset()
        rendered, reused = dyn.templates_rendered, dyn.sources_reused
        x = _inputs(p, p)
        got = compiled(*x)
        for a, b in zip(got, fn(*x)):
            torch.testing.assert_close(a, b, **TOL)
        spec = compiled._specs[next(reversed(compiled._specs))]
        n_kernels = sum(s.kind == "kernel" for s in spec.executor.steps)
        assert count.generated > 0 and dyn.templates_rendered - rendered == count.generated, (
            f"length {p}: {count.generated} sources generated, {dyn.templates_rendered - rendered} rendered")
        assert dyn.sources_reused - reused == n_kernels - count.generated
        assert count.built == 0 and parses.n == 0 and probes.n == 0 and builds.n == 0, (
            f"length {p}: {count.built} kernels built, {parses.n} sources parsed, {probes.n} probes, "
            f"{builds.n} template builds")
    assert all(k.fn is not None for ts in generic._TEMPLATES.values() for k in ts)


def test_a_template_whose_text_does_not_render_falls_back_to_the_parse(monkeypatch):
    """Render is only a shortcut: a text that is not the previous template's rendering goes through parse and the
    template table as before (here every rendering is made to fail), with the same results."""
    fn = _fn(1)
    compiled = vtc.compile(fn, _inputs(9, 0))
    want = [compiled(*_inputs(p, p)) for p in (10, 11, 12)]
    monkeypatch.setattr(generic.Template, "render", lambda self, sizes: None)
    generic._TEMPLATES.clear()
    generic._SIZE_FREE.clear()
    other = vtc.compile(fn, _inputs(9, 0))
    parses = None
    for k, p in enumerate((10, 11, 12)):
        if k == 2:
            parses = _Calls(monkeypatch, generic, "parse")
        for a, b in zip(other(*_inputs(p, p)), want[k]):
            assert torch.equal(a, b)
    assert parses.n > 0 and other._dynamic.templates_rendered == 0


def _template(src_body: str, literals) -> generic.Template:
    src = "// head\n" + generic._opening("k") + src_body
    p = generic.parse(src, "k")
    return generic.Template("k", p, tuple(literals))


def test_render_is_the_source_that_matches():
    """render(sizes) is the text whose parse matches the template at sizes; None where a value would not read
    back as the same literal (negative; 0 before an x: a hex prefix). The LL suffix and the literals that do not
    vary stay as fitted. (Fails before: no Template.render.)"""
    lin = generic.Poly((((1,), 1), ((0,), -3)), 1)  # s0 - 3
    two = generic.Poly((((1,), 2),), 1)  # 2 * s0
    t = _template("  int64_t a = 5x;\n  int64_t b = 7LL + 4;\n  float c = 1.5f;\n}\n", [lin, two, None])
    assert t.parsed.values == (5, 7, 4)
    for s0 in range(0, 12):
        r = t.render((s0,))
        if s0 < 3 or s0 == 3:  # negative, or 0 followed by x
            assert r is None
            continue
        assert r == f"// head\n{generic._opening('k')}  int64_t a = {s0 - 3}x;\n  int64_t b = {2 * s0}LL + 4;\n" \
                    "  float c = 1.5f;\n}\n"
        assert t.matches(generic.parse(r, "k"), (s0,))
    # the other way round: a text that matches renders to itself unless an LL suffix differs (then: parse path)
    plain = generic.parse("// head\n" + generic._opening("k") + "  int64_t a = 9x;\n  int64_t b = 24 + 4;\n"
                          "  float c = 1.5f;\n}\n", "k")
    assert t.matches(plain, (12,)) and t.render((12,)) != "// head\n" + plain.func


def test_render_of_the_fitted_templates_matches_their_parse():
    """For every template fitted on the decode model, at many sizes: render's text parses to a match (a
    random-size sweep over the real kernels: cat, attention, GEMM stored into the cache)."""
    fn = _fn(2)
    compiled = vtc.compile(fn, _inputs(9, 0))
    for p in (10, 11):
        compiled(*_inputs(p, p))
    templates = [t for ts in generic._TEMPLATES.values() for t in ts]
    assert templates
    rng = random.Random(0)
    for t, s0 in itertools.product(templates, [2, 3, 17, 127, 4096] + [rng.randrange(2, 1 << 20) for _ in range(8)]):
        r = t.render((s0,))
        if r is not None:
            p = generic.parse(r, t.name)
            assert p is not None and t.matches(p, (s0,)), (t.name, s0)


@pytest.mark.parametrize("order", [(17, 1, 127, 2, 18), (1, 127, 17)])
def test_lengths_1_17_127_close_to_eager_and_bit_identical_to_a_fresh_compile(order):
    fn = _fn(3)
    compiled = vtc.compile(fn, _inputs(9, 0))
    for p in order:
        x = _inputs(p, 100 + p)
        got = compiled(*x)
        for a, b in zip(got, fn(*x)):
            torch.testing.assert_close(a, b, **TOL)
        if p in (17, 127) and order[0] == 17:
            fresh = vtc.compile(fn, x)
            for a, b in zip(got, fresh(*x)):
                assert torch.equal(a, b)


def _exprs(rng, n):
    i = [var(f"i{k}", rng.randrange(1, 9)) for k in range(n)]
    return tuple(e if rng.random() < 0.7 else e * rng.randrange(1, 4) + rng.randrange(0, 3) for e in i)


def test_linear_offset_memo_is_exact_and_bounded(monkeypatch):
    """Answers are the very expressions computed afresh (hash-consed); keys of other types (bool, numpy ints,
    int indices) are computed and not kept; two generations of at most LINEAR_MEMO answers; a rotation keeps
    what was asked since the last one. (Fails before: no memo, no rotate_linear_offsets.)"""
    monkeypatch.setattr(mapping, "LINEAR_MEMO", 16)
    monkeypatch.setattr(mapping, "_linear", [{}, {}])
    rng = random.Random(1)
    keys = []
    for _ in range(200):
        n = rng.randrange(1, 5)
        idx, shape = _exprs(rng, n), tuple(rng.randrange(1, 70) for _ in range(n))
        got = mapping.linear_offset(idx, shape)
        assert got is mapping._linear_offset(idx, shape)
        assert mapping.linear_offset(list(idx), list(shape)) is got  # iterables of any kind: the same key
        assert sum(map(len, mapping._linear)) <= 32
        keys.append((idx, shape))
    idx, shape = keys[-1]
    odd = [(idx, tuple(np.int64(s) for s in shape)), (idx, tuple(bool(s == 1) or s for s in shape)),
           ((*idx[:-1], 1), shape)]
    for i, s in odd:
        before = sum(map(len, mapping._linear))
        assert mapping.linear_offset(i, s) is mapping._linear_offset(tuple(i), tuple(s))
        assert sum(map(len, mapping._linear)) == before
    asked = keys[-1]
    mapping.rotate_linear_offsets()
    mapping.linear_offset(*asked)
    mapping.rotate_linear_offsets()
    assert list(mapping._linear[1]) == [asked] and not mapping._linear[0]
    mapping.rotate_linear_offsets()
    assert not any(mapping._linear)
    assert mapping.linear_offset((const(0),), (5,)) is const(0)


def test_a_decode_loop_keeps_the_offsets_of_its_last_size_only():
    """vtc.dynamic rotates the memo once per size: over many lengths it holds what the last size asked for."""
    fn = _fn(4)
    compiled = vtc.compile(fn, _inputs(9, 0))
    held = []
    for p in range(10, 30):
        compiled(*_inputs(p, p))
        held.append(sum(map(len, mapping._linear)))
    assert max(held[5:]) <= max(held[2:5]) + 2, held
