"""Sizes as kernel arguments: a new sequence length / batch / cache length does not run the C++ compiler.

The compiler-run counter ``cbuild.compile_count`` proves it; every result is compared with eager torch on
random inputs.  Size classes where a kernel cannot be generic (size 1, which torch.export specialises;
a register-tiled transpose that appears above 32) recompile and stay correct.
"""
from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest
import torch

import vtc
import vtc.dynamic
from vtc.runtime import cbuild, generic

sys.path.insert(0, str(Path(__file__).parents[2]))
from bench.workloads.llama3 import Llama3Layer  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)
pytestmark = pytest.mark.usefixtures("private_cache")


def _layer_inputs(b: int, s: int, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, 64, generator=g), torch.randn(b, 2, t, 16, generator=g),
            torch.randn(b, 2, t, 16, generator=g), torch.arange(t - s, t))


def _close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_llama_layer_new_sequence_batch_and_cache_lengths_do_not_compile():
    torch.manual_seed(0)
    model = Llama3Layer(hidden=64, heads=4, kv_heads=2, inter=96).eval()
    first = _layer_inputs(2, 12, 24, 0)
    compiled = vtc.compile(model, first, dynamic=True)
    with torch.no_grad():
        _close(compiled(*first), model(*first))
    built = cbuild.compile_count
    for b, s, t in [(2, 17, 40), (3, 12, 31), (4, 9, 9), (2, 127, 130)]:  # prefill: batch*seq > 16
        x = _layer_inputs(b, s, t, seed=s)
        with torch.no_grad():
            _close(compiled(*x), model(*x))
    assert cbuild.compile_count == built, "a new size ran the C++ compiler"
    dyn = compiled._dynamic
    assert dyn.kernels["generic"] > 0 and not dyn.why_not
    # decode at batch 1 is built for its sizes, and right: torch.export assumed sizes >= 2, so it is
    # captured again (other classes that recompile: a skinny GEMM, batch*seq <= 16; fewer queries than a tile)
    for b, s, t in [(1, 1, 20)]:
        x = _layer_inputs(b, s, t, seed=s)
        with torch.no_grad():
            _close(compiled(*x), model(*x))
    assert any("outside the captured range" in w for w in dyn.why_not)


def _movement(x, past):
    """cat along the varying dim, a slice by a varying length, a reshape splitting it, softmax over it."""
    kv = torch.cat([past, x], dim=1)  # [B, P+S, D]
    recent = kv[:, -x.shape[1]:]  # the last S rows
    halves = kv.reshape(kv.shape[0], -1, 2, kv.shape[2]).sum(2)  # needs P+S even: export asserts it
    return torch.softmax(recent * 2, dim=-1) + x, halves, torch.softmax(kv, dim=1), kv.transpose(1, 2) + 1


def test_size_dependent_mappings_first_static_then_generic():
    g = torch.Generator().manual_seed(1)
    make = lambda b, p, s: (torch.randn(b, s, 24, generator=g), torch.randn(b, p, 24, generator=g))  # noqa: E731
    first = make(2, 6, 4)
    compiled = vtc.compile(_movement, first)  # static until a size changes
    _close(compiled(*first), _movement(*first))
    second = make(3, 9, 5)  # new sizes: the symbolic capture (these dims dynamic) and generic kernels are made
    _close(compiled(*second), _movement(*second))
    assert compiled._dynamic and compiled._dynamic.kernels["generic"] > 0
    built = cbuild.compile_count
    for b, p, s in [(2, 14, 2), (2, 3, 17), (4, 21, 7)]:
        x = make(b, p, s)
        _close(compiled(*x), _movement(*x))
    assert cbuild.compile_count == built
    odd = make(2, 4, 3)  # P+S odd: the reshape cannot run; eager raises, and so do we
    with pytest.raises(RuntimeError):
        _movement(*odd)
    with pytest.raises(Exception):
        compiled(*odd)


def _decode_like(tok, past, w):
    """A token's projection and norm (nothing depends on the cache length) next to attention over the cache."""
    h = torch.relu(tok @ w) * 2 + 1  # [B, 1, D]: the same kernel text at every cache length
    h = h / h.square().mean(-1, keepdim=True).add(1e-6).sqrt()
    kv = torch.cat([past, h], dim=1)  # [B, P+1, D]
    return torch.softmax(h @ kv.transpose(1, 2), dim=-1) @ kv, kv


def test_kernels_the_same_at_every_size_are_not_probed_again(monkeypatch):
    """A decode loop brings a new cache length every step.  Kernels that do not depend on it (a token's
    projection, its norm) have no template to fit; they used to make every new length lower the whole graph
    again at up to five probe sizes (a 1-layer Llama step with a DynamicCache: 0.23 s, after: 0.04 s)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 32, generator=g) / 6
    make = lambda p: (torch.randn(2, 1, 32, generator=g), torch.randn(2, p, 32, generator=g))  # noqa: E731
    fn = lambda tok, past: _decode_like(tok, past, w)  # noqa: E731
    x = make(9)
    compiled = vtc.compile(fn, x)
    _close(compiled(*x), fn(*x))
    probes = []
    real = vtc.dynamic.DynamicSizes._probe
    monkeypatch.setattr(vtc.dynamic.DynamicSizes, "_probe",
                        lambda self, sizes: probes.append(sizes) or real(self, sizes))
    for p in (10, 11):  # 10: the symbolic capture and the templates' fit, 11: its first instantiation
        x = make(p)
        _close(compiled(*x), fn(*x))
    fitted = len(probes)
    assert fitted > 0 and generic._SIZE_FREE, "the size-free kernels were not recognised"
    for p in (12, 13, 20, 31):
        x = make(p)
        _close(compiled(*x), fn(*x))
    assert len(probes) == fitted, f"new cache lengths lowered the graph again at probe sizes: {probes[fitted:]}"


def test_a_new_size_at_every_call_warns_once(monkeypatch):
    """A decode loop with a growing cache makes a specialization per step: after NEW_SIZES_WARN_AT of them the user
    is told once, with the fix (a StaticCache)."""
    import warnings

    import vtc.compiler

    monkeypatch.setattr(vtc.compiler, "NEW_SIZES_WARN_AT", 3)
    fn = lambda x, past: torch.cat([past, x], 1).softmax(-1)  # noqa: E731
    make = lambda p: (torch.randn(2, 1, 8), torch.randn(2, p, 8))  # noqa: E731
    compiled = vtc.compile(fn, make(4))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for p in (5, 6, 5, 7, 8, 9):  # 5 again: no new specialization
            x = make(p)
            _close([compiled(*x)], [fn(*x)])
    said = [w for w in seen if issubclass(w.category, vtc.NewSizesWarning)]
    assert len(said) == 1 and "StaticCache" in str(said[0].message)


def test_kernel_that_cannot_be_generic_recompiles_correctly():
    def f(x, y):
        return x.transpose(-1, -2) * 2 + y  # from 16 x 16 up: register-tiled transposes, another loop nest

    g = torch.Generator().manual_seed(2)
    make = lambda n: (torch.randn(3, n, n + 1, generator=g), torch.randn(3, n + 1, n, generator=g))  # noqa: E731
    x = make(17)
    compiled = vtc.compile(f, x, dynamic=True)
    torch.testing.assert_close(compiled(*x), f(*x), **TOL)
    built = cbuild.compile_count
    for n in (127, 100, 16):
        x = make(n)
        torch.testing.assert_close(compiled(*x), f(*x), **TOL)
    assert cbuild.compile_count == built  # the tiled kernel takes its sizes (tile counts too) as arguments
    x = make(8)  # below a tile: a plain loop nest, built for it
    torch.testing.assert_close(compiled(*x), f(*x), **TOL)
    assert cbuild.compile_count > built
    built = cbuild.compile_count
    x = make(5)
    torch.testing.assert_close(compiled(*x), f(*x), **TOL)
    assert cbuild.compile_count == built


def test_torch_compile_backend_specializes_symbolic_graph_without_compiling():
    torch._dynamo.reset()
    lin = torch.nn.Linear(16, 16)

    def f(x):
        y = lin(x).transpose(1, 2)  # [B, 16, S]
        return torch.softmax(y, dim=-1).transpose(1, 2) * x + torch.cat([x, x], dim=1)[:, : x.shape[1]]

    def check(b: int, s: int) -> int:
        """Compiler runs of one call at batch b, length s (the result checked against eager)."""
        x = torch.randn(b, s, 16, generator=g)
        before = cbuild.compile_count
        torch.testing.assert_close(fn(x), f(x), **TOL)
        return cbuild.compile_count - before

    g = torch.Generator().manual_seed(3)
    fn = torch.compile(f, backend="vtc")
    with torch.no_grad():
        # dynamo: static first (vtc builds it: the backend really runs vtc), then a graph with a symbolic S;
        # lengths stay >= 16 (one transpose-tile size class)
        assert check(2, 20) > 0
        assert check(2, 24) > 0
        assert [check(2, s) for s in (33, 127, 61)] == [0, 0, 0]
        assert check(3, 61) > 0  # a new batch: dynamo re-traces with B symbolic too, built once
        assert [check(b, s) for b, s in ((4, 40), (3, 100), (2, 17))] == [0, 0, 0]
    torch._dynamo.reset()



def test_torch_compile_backend_keeps_at_most_max_specializations(monkeypatch):
    """The backend's specializations of one symbolic graph are an LRU bounded like vtc.compile's."""
    import vtc.compiler
    import vtc.dynamic

    runners = []

    def recording(*a, **k):
        run = real(*a, **k)
        runners.append(run)
        return run

    real = vtc.dynamic.backend_runner
    monkeypatch.setattr(vtc.dynamic, "backend_runner", recording)
    monkeypatch.setitem(vtc.compiler.OPTIONS, "max_specializations", 2)
    torch._dynamo.reset()

    def f(x):
        return torch.relu(x.transpose(0, 1)) + 1.0

    fn = torch.compile(f, backend="vtc")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for s in (20, 24, 33, 40, 50, 24, 33):
            x = torch.randn(s, 16, generator=g)
            torch.testing.assert_close(fn(x), f(x), **TOL)
    torch._dynamo.reset()
    assert len(runners) == 1 and runners[0] is not None
    assert [key[-1] for key in runners[0].specializations] == [(24, 16), (33, 16)]  # the 2 most recent sizes


def test_keyword_inputs_take_the_dynamic_path():
    """New sizes given as keyword arguments instantiate the symbolic graph (no compiler run) and stay exact."""

    class M(torch.nn.Module):
        def forward(self, x, *, bias, scale=2.0):
            return torch.softmax(x.transpose(1, 2) * scale, dim=-1) + bias.transpose(1, 2)

    m = M()
    g = torch.Generator().manual_seed(11)

    def inputs(s: int):
        return torch.randn(2, s, 16, generator=g), torch.randn(2, s, 16, generator=g)

    x, b = inputs(20)
    compiled = vtc.compile(m, (x,), {"bias": b})
    torch.testing.assert_close(compiled(x, bias=b), m(x, bias=b), **TOL)
    x, b = inputs(24)  # first new size: symbolic capture, templates fitted
    torch.testing.assert_close(compiled(x, bias=b), m(x, bias=b), **TOL)
    assert compiled._dynamic not in (None, False)
    built = cbuild.compile_count
    for s in (33, 61, 127):
        x, b = inputs(s)
        torch.testing.assert_close(compiled(x, bias=b), m(x, bias=b), **TOL)
    assert cbuild.compile_count == built


# ----------------------------------------------------------------------------- the template machinery

def test_interpolate_recovers_integer_polynomials():
    rnd = random.Random(0)
    for _ in range(100):
        k = rnd.randint(1, 3)
        deg = [rnd.randint(0, 2) for _ in range(k)]
        base = [rnd.randint(2, 40) for _ in range(k)]
        step = rnd.randint(1, 4)
        coef = {e: rnd.randint(-9, 9) for e in itertools.product(*[range(d + 1) for d in deg])}

        def f(s):
            return sum(c * eval_monomial(s, e) for e, c in coef.items())

        grid = itertools.product(*[range(d + 1) for d in deg])
        vals = {o: f([b + step * x for b, x in zip(base, o)]) for o in grid}
        p = generic.interpolate(base, deg, vals, step)
        for _ in range(5):
            s = [rnd.randint(1, 300) for _ in range(k)]  # values below the int64 guard
            assert p.at(s) == f(s)


def eval_monomial(s, e):
    out = 1
    for x, n in zip(s, e):
        out *= x ** n
    return out


def test_poly_refuses_overflow_and_inexact_division():
    p = generic.interpolate([4], [2], {(0,): 6, (1,): 10, (2,): 15})  # s*(s-1)/2
    assert p.denom == 2 and p.at([10]) == 45
    assert generic.Poly((((1,), 1),), 2).at([3]) is None  # s / 2 at an odd size
    assert generic.Poly((((2,), 1 << 40),), 1).at([1 << 12]) is None  # would overflow int64 arithmetic


def _src(body: str) -> str:
    return 'extern "C" void k_x(void* const* bufs, int nthreads) {\n' + body + "}\n"


def test_template_matches_only_the_same_text_and_literals():
    at = generic.parse(_src("  for (int64_t i = 0; i < 24; ++i) b0[i * 3] = 1.5f;\n"), "k_x")
    probes = {(0,): at, (1,): generic.parse(_src("  for (int64_t i = 0; i < 27; ++i) b0[i * 3] = 1.5f;\n"), "k_x")}
    t = generic.fit("k_x", at, probes, [8], [1], 1)
    assert t is not None and "vtc_s0" in t.source and "bufs[1]" in t.source
    assert t.matches(generic.parse(_src("  for (int64_t i = 0; i < 300; ++i) b0[i * 3] = 1.5f;\n"), "k_x"), [100])
    assert not t.matches(generic.parse(_src("  for (int64_t i = 0; i < 301; ++i) b0[i * 3] = 1.5f;\n"), "k_x"), [100])
    assert not t.matches(generic.parse(_src("  for (int64_t i = 0; i < 300; ++i) b0[i * 4] = 1.5f;\n"), "k_x"), [100])
    other = generic.parse(_src("  for (int64_t i = 0; i < 300; ++i) b0[i] = 1.5f;\n"), "k_x")
    assert not t.matches(other, [100])  # another skeleton


def test_array_sizes_and_pragma_arguments_stay_constant():
    at = generic.parse(_src("  float sc[4][24];\n  #pragma omp simd safelen(24)\n"), "k_x")
    nxt = generic.parse(_src("  float sc[4][27];\n  #pragma omp simd safelen(27)\n"), "k_x")
    assert generic.fit("k_x", at, {(0,): at, (1,): nxt}, [8], [1], 1) is None
    at = generic.parse(_src("  #pragma omp parallel for if(24 >= 32768)\n"), "k_x")
    nxt = generic.parse(_src("  #pragma omp parallel for if(27 >= 32768)\n"), "k_x")
    assert generic.fit("k_x", at, {(0,): at, (1,): nxt}, [8], [1], 1) is not None
    f1 = generic.parse(_src("  b0[0] = 24 * 0.125f;\n"), "k_x")  # a float that varies (a mean): not generic
    f2 = generic.parse(_src("  b0[0] = 27 * 0.111f;\n"), "k_x")
    assert generic.fit("k_x", f1, {(0,): f1, (1,): f2}, [8], [1], 1) is None


class _Windows(torch.nn.Module):
    """Pads the sequence to a multiple of 4 when it is not one (a Python branch on a size), then averages
    windows of 4 tokens: torch.export captures one branch and guards it ("S % 4 == 0")."""

    def forward(self, x):
        if x.shape[1] % 4 != 0:
            x = torch.nn.functional.pad(x, (0, 0, 0, 4 - x.shape[1] % 4))
        return x.view(x.shape[0], -1, 4, x.shape[2]).mean(2)


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_size_outside_the_captures_guards_is_captured_again(dynamic):
    model = _Windows()
    compiled = vtc.compile(model, (torch.randn(2, 8, 3),), dynamic=dynamic)
    for s in (12, 16, 10, 6, 20, 7):  # 10, 6 and 7 take the other branch than 8, 12, 16 and 20
        x = torch.randn(2, s, 3)
        want = model(x)
        got = compiled(x)
        assert got.shape == want.shape, f"S={s}: {list(got.shape)} vs eager {list(want.shape)}"
        torch.testing.assert_close(got, want, **TOL)


def _parse_token_by_token(source: str, name: str):
    """generic.parse as it was before session 14: every C token matched in turn, integer literals kept."""
    import re

    token = re.compile(r"[A-Za-z_]\w*|0[xX][0-9a-fA-F]+|\d+\.\d*(?:[eE][+-]?\d+)?[fF]?|\d+[eE][+-]?\d+[fF]?"
                       r"|(\d+)(?:LL)?")
    at = source.find(generic._opening(name))
    head, func = source[:at], source[at:]
    spans, values, parts, last = [], [], [], 0
    for m in token.finditer(func, len(generic._opening(name))):
        if m.group(1) is not None:
            spans.append((m.start(), m.end()))
            values.append(int(m.group(1)))
            parts.append(func[last:m.start()])
            last = m.end()
    parts.append(func[last:])
    return generic.Parsed(head, "#".join(parts), tuple(spans), tuple(values), func)


def test_parse_finds_the_integer_literals_a_token_by_token_scan_finds():
    """parse skips the other tokens inside the regex engine (~2x faster on a decode step's 500 KB of kernels);
    it must cut every text exactly as the token-by-token scan did: identifiers with digits, hex, floats with
    exponents, LL suffixes, a '.5', non-ASCII letters and digits."""
    toks = ["a", "b1", "_x", "x1e", "e", "E", "LL", "L", "0x1F", "0X", "12", "3LL", "4L", "1.5", "2.", "1e5", "1e+5",
            "3.0e-2f", "7f", ".", ".5", "+", "-", " ", "\n", "(", ")", "[", "9", "00", "0", "é", "٣", "x٣", "#"]
    rng = random.Random(0)
    bodies = ["  for (int64_t i = 0; i < 24LL; ++i) b0[i * 3 + 0x10] = 1.5e-3f * b1[i % 7];\n"]
    bodies += ["".join(rng.choice(toks) for _ in range(rng.randint(0, 30))) for _ in range(3000)]
    for body in bodies:
        src = _src(body)
        assert generic.parse(src, "k_x") == _parse_token_by_token(src, "k_x"), repr(body)


def test_torch_compile_backend_specializes_one_new_size_at_a_time_from_threads(monkeypatch):
    """Threads calling a torch.compile(backend="vtc") graph at new sizes at once (dynamo runs compiled graphs
    outside its lock) reach the backend runner together: its DynamicSizes is not thread-safe (its probe memo,
    rotated by one thread while another's lowering used it, raised a KeyError: fuzz6), so the runner makes one
    specialization at a time.  The second thread's specialization is let in while the first waits for it: without
    the runner's lock both are inside at once."""
    import threading

    import vtc.compiler
    import vtc.dynamic

    inside, most, met = [0], [0], []
    meet = threading.Barrier(2, timeout=2.0)
    real = vtc.dynamic.DynamicSizes.specialization

    def waiting(self, leaves):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            if len(met) < 2:
                met.append(1)
                try:
                    meet.wait()  # the other thread's specialization, if it can start meanwhile
                except threading.BrokenBarrierError:
                    pass
            return real(self, leaves)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(vtc.dynamic.DynamicSizes, "specialization", waiting)
    monkeypatch.setitem(vtc.compiler.OPTIONS, "max_specializations", 1)  # every new size evicts the last one
    torch._dynamo.reset()

    def f(x):
        return torch.softmax(x.transpose(0, 1) * 2.0, -1) + 1.0

    fn = torch.compile(f, backend="vtc", dynamic=True)
    g = torch.Generator().manual_seed(7)
    xs = {s: torch.randn(s, 16, generator=g) for s in (20, 24, 33)}
    errors = []

    def call(s: int) -> None:
        try:
            with torch.no_grad():  # (grad mode is the thread's own: dynamo would compile another graph for it)
                torch.testing.assert_close(fn(xs[s]), f(xs[s]), **TOL)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{s}: {type(e).__name__}: {e}")

    with torch.no_grad():
        call(20)  # dynamo's capture with a symbolic size, and the first specialization
        met.clear()
        ts = [threading.Thread(target=call, args=(s,)) for s in (24, 33)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for s in (20, 24, 33):
            call(s)
    torch._dynamo.reset()
    assert not errors, errors
    assert most[0] == 1, "two specializations of one symbolic graph ran at once"
