"""Kernels with the same code (the layers of a model) are compiled once; libraries are balanced for the cores."""
from __future__ import annotations

import torch

import vtc
from vtc.runtime.executor import KERNELS_PER_LIBRARY, distinct_sources, libraries


def _symbols(compiled) -> list[str]:
    return [s.kernel.fn.__name__ for s in compiled._first.executor.steps if s.kind == "kernel"]


def test_kernels_that_differ_only_by_name_share_one_function_and_stay_correct():
    def f(x):
        a = torch.relu(x.t() * 2.0)
        b = torch.relu(a.t() * 2.0)  # a's kernel under another name: shared
        c = torch.relu(b.t() * 3.0)  # another constant: its own function
        d = torch.relu(c.t()[:, 1:] * 2.0)  # another shape: its own function
        return a, b, c, d

    for n in (17, 3):
        x = torch.randn(n, n)
        compiled = vtc.compile(f, (x,))
        symbols = _symbols(compiled)
        assert len(symbols) == 4 and len(set(symbols)) == 3 and symbols[0] == symbols[1], symbols
        for _ in range(2):
            x = torch.randn(n, n)
            for got, want in zip(compiled(x), f(x)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_distinct_sources_replace_only_the_kernels_own_name():
    texts = ['extern "C" void k_a(...) { x = 2; }', 'extern "C" void k_b(...) { x = 2; }',
             'extern "C" void k_a_1(...) { x = 2; }', 'extern "C" void k_c(...) { k_a(); }',
             'extern "C" void k_d(...) { k_a(); }', 'extern "C" void k_e(...) { k_e_tab[0] = 2; }',
             'extern "C" void k_f(...) { k_f_tab[0] = 2; }']
    assert distinct_sources(texts, ["k_a", "k_b", "k_a_1", "k_c", "k_d", "k_e", "k_f"]) == [0, 0, 0, 3, 3, 5, 6]


def test_libraries_use_every_core_and_respect_the_size_limit():
    texts = ["x" * n for n in (900, 100, 100, 100, 500, 300)]
    units = libraries(texts, list(range(6)), jobs=2)
    assert len(units) == 2 and sorted(k for u in units for k in u) == list(range(6))
    assert [sum(len(texts[k]) for k in u) for u in units] == [1000, 1000]
    assert libraries(texts, [1, 2], jobs=8) == [[1], [2]] and libraries(texts, [], jobs=2) == []
    many = ["x"] * (3 * KERNELS_PER_LIBRARY + 1)
    units = libraries(many, list(range(len(many))), jobs=1)
    assert len(units) == 4 and max(len(u) for u in units) <= KERNELS_PER_LIBRARY
