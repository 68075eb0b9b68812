"""Canonical forms of the index algebra that no other test pinned (found by mutation testing, docs/testing.md).

Each test here fails when one rewrite rule of ``vtc.index.expr`` is dropped or weakened while every other
test still passes: the value stays right (tests/index/test_expr.py proves that on every index), but the
expression no longer takes the form that digit fusion, hash-consing and ``Mapping.strided`` rely on.
Every form is also checked against a brute-force evaluation on every value of its variables.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vtc.index import expr as E
from vtc.index.expr import const, evaluate, floordiv, mod, var

RULES = settings(max_examples=150, deadline=None, derandomize=True)


def values(e, n: int) -> list[int]:
    """e at x = 0 .. n-1 (e over the one variable x)."""
    return torch.broadcast_to(evaluate(e, {"x": torch.arange(n)}), (n,)).tolist()


@RULES
@given(st.integers(2, 200), st.integers(1, 4), st.integers(2, 5), st.integers(2, 5))
def test_floordiv_of_a_digit_is_a_higher_digit(n, d0, d, k):
    """((x // d0) % (d*k)) // d is (x // (d0*d)) % k: the digit of a digit (reshape of a reshaped dim)."""
    x = var("x", n)
    digit = (x // d0) % (d * k)
    got = digit // d
    want = (x // (d0 * d)) % k
    assert got is want, f"{digit} // {d} is {got}, want {want}"
    assert values(got, n) == [v // d0 % (d * k) // d for v in range(n)]


def test_floordiv_of_a_digit_by_a_non_divisor_stays_a_floordiv():
    x = var("x", 40)
    e = (x % 12) // 5
    assert e.op == "floordiv" and e.args == (x % 12, 5)
    assert values(e, 40) == [v % 12 // 5 for v in range(40)]


def test_digits_of_a_mod_base_fuse():
    """2*((x % 4) // 2) + x % 2 is x % 4: the digits of a dim that was itself cut out with a mod."""
    x = var("x", 20)
    assert 2 * ((x % 4) // 2) + x % 2 is x % 4
    assert 6 * ((x % 12) // 6) + 3 * ((x % 6) // 3) + x % 3 is x % 12


@RULES
@given(st.integers(2, 200), st.integers(1, 4), st.integers(2, 6), st.integers(1, 4))
def test_mod_of_a_mod_by_a_divisor_is_one_mod(n, d0, m, k):
    """((x // d0) % (m*k)) % m is (x // d0) % m."""
    x = var("x", n)
    inner = (x // d0) % (m * k)
    assert inner % m is (x // d0) % m, f"({inner}) % {m} is {inner % m}"
    assert values(inner % m, n) == [v // d0 % m for v in range(n)]


def test_mod_by_one_is_zero():
    x, y = var("x", 5), var("y", 3)
    assert mod(x, 1) is const(0)
    assert mod(x * y, 1) is const(0)
    assert floordiv(x * y, 1) is x * y


@pytest.mark.parametrize("lo,hi,m,want", [(20, 24, 16, (4, 8)), (16, 31, 16, (0, 15)), (14, 17, 16, (0, 15)),
                                          (3, 5, 2, (0, 1)), (33, 35, 8, (1, 3)), (20, 20, 16, (4, 4))])
def test_range_of_a_mod_that_does_not_wrap(lo, hi, m, want):
    """a % m lies in [a.lo % m, a.hi % m] when a's range fits in one period of m without wrapping."""
    x = var("x", hi + 1)
    for a in (E.max_(x, lo), E.load("t", (x,), lo, hi)):
        e = a % m
        assert (e.lo, e.hi) == want, f"{e} claims [{e.lo}, {e.hi}]"
        got = evaluate(e, {"x": torch.arange(hi + 1)}, {"t": torch.arange(hi + 1).clamp(lo, hi)})
        assert want[0] <= int(got.min()) and int(got.max()) <= want[1]


def test_ranges_of_min_and_max_are_tight():
    x, y = var("x", 10), var("y", 5)  # x in [0, 9], y + 3 in [3, 7]
    lo_hi = lambda e: (e.lo, e.hi)  # noqa: E731
    assert lo_hi(E.min_(x, y + 3)) == (0, 7)
    assert lo_hi(E.max_(x, y + 3)) == (3, 9)
    assert lo_hi(E.min_(x - 5, 2 - y)) == (-5, 2)
    assert lo_hi(E.max_(x - 5, 2 - y)) == (-2, 4)


def test_a_fused_digit_fuses_again_in_the_same_sum():
    """Adding the middle digit to (low digit + high digit) fuses twice in one sum: x % 30 (digits 2, 3, 5)."""
    x = var("x", 60)
    low_and_high = x % 2 + 6 * ((x // 6) % 5)
    middle = 2 * ((x // 2) % 3)
    assert low_and_high + middle is x % 30
    assert middle + low_and_high is x % 30
    assert values(low_and_high + middle, 60) == [v % 30 for v in range(60)]


def test_an_atom_of_one_value_folds_into_the_constant():
    """A load whose range is one value (an index tensor into a dim of size 1, or a checked constant) is that value."""
    x = var("x", 4)
    assert 2 * E.load("t", (x,), 5, 5) + x is x + 10
    assert x - E.load("t", (x,), 5, 5) is x - 5
    assert 3 * E.load("u", (x,), 0, 0) + x is x


def test_a_fused_digit_cancels_an_equal_term():
    """x % 6 - (x % 2 + 2*((x // 2) % 3)) is 0: the fused digit meets its negative in the same sum."""
    x = var("x", 40)
    assert x % 6 - x % 2 - 2 * ((x // 2) % 3) is const(0)
    assert 3 * (x // 6) + x % 6 - x % 2 - 2 * ((x // 2) % 3) is 3 * (x // 6)


def test_a_constant_decides_a_conjunction_or_disjunction():
    x, y = var("x", 8), var("y", 8)
    p, q = E.lt(x, 3), E.lt(y, 5)
    for args in ((E.FALSE, p), (p, E.FALSE), (p, q, E.FALSE), (E.FALSE, p, q)):
        assert E.and_(*args) is E.FALSE, args
    for args in ((E.TRUE, p), (p, E.TRUE), (p, q, E.TRUE), (E.TRUE, p, q)):
        assert E.or_(*args) is E.TRUE, args
    assert E.and_(E.TRUE, p) is p and E.or_(E.FALSE, p) is p


def test_predicates_range_over_zero_and_one():
    x, y = var("x", 8), var("y", 8)
    p, q = E.lt(x, 3), E.lt(y, 5)
    env = {"x": torch.arange(8)[:, None], "y": torch.arange(8)[None, :]}
    for e in (E.and_(p, q), E.or_(p, q), E.not_(E.eq(x, y)), E.eq(x, y)):
        assert (e.lo, e.hi) == (0, 1), f"{e} claims [{e.lo}, {e.hi}]"
        assert set(evaluate(e, env).unique().tolist()) == {0, 1}
