"""The greedy's escape to groups (vtc.plan.greedy._escape) on a made-up graph of choices and savings: no test
took that path (found by mutation testing, docs/testing.md).  When no single pull saves anything, the
connected group of remaining pulls whose removal together saves most is taken, if that beats EPSILON_S."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vtc.plan.cost import Saving
from vtc.plan.greedy import EPSILON_S, Decision, Strategy, resume, select
from vtc.plan.vtog import PULL, PUSH


class Chains:
    """Pulls a, b (group 0), c (group 1), d, e (group 2); each alone saves nothing, a group saves group_s."""

    def __init__(self, group_s, alone_s=None):
        names = {"a": 0, "b": 0, "c": 1, "d": 2, "e": 2}
        self.choices = [SimpleNamespace(name=n, op=n, values=(n,), invalid=None, direction=PULL) for n in names]
        self.component = names
        self.group_s = group_s
        self.alone_s = alone_s or {}

    def conflict(self, taken, c):
        return None

    def saving(self, c, state):
        return Saving(self.alone_s.get(c.op, 0.0), "alone")

    def saving_of(self, ops, state):
        (group,) = {self.component[o] for o in ops}
        return Saving(self.group_s[group] if len(ops) > 1 else 0.0, "together")


@pytest.mark.parametrize("group_s,want", [
    ({0: 2e-6, 2: 3e-6}, ["d", "e", "a", "b"]),  # the best group first, then the other one in a later round
    ({0: 2e-6, 2: 2e-6}, ["a", "b", "d", "e"]),  # a tie: the first group
    ({0: EPSILON_S, 2: EPSILON_S / 2}, []),  # no group beats EPSILON_S
    ({0: 0.0, 2: -1e-6}, []),
])
def test_no_single_pull_pays_the_best_group_is_taken(group_s, want):
    chains = Chains({1: 5e-6, **group_s})  # c alone: a group of one is never taken as a group
    strategy = select(chains, chains)
    assert [c.name for c in strategy.chosen] == want
    for d in strategy.decisions:
        assert d.chosen == (d.op in want)
        if d.chosen:
            assert d.reason.startswith("taken with the 1 other remaining ops of its group"), d.reason


def test_single_pulls_of_equal_saving_are_taken_in_graph_order():
    chains = Chains({0: 0.0, 1: 0.0, 2: 0.0}, {"a": 1e-6, "d": 1e-6, "e": EPSILON_S})
    strategy = select(chains, chains)
    assert [c.name for c in strategy.chosen] == ["a", "d"]  # e saves no more than EPSILON_S: left
    assert [d.round for d in strategy.decisions if d.chosen] == [1, 2]


def test_resume_leaves_pulls_that_conflict_with_a_taken_push():
    """After the pushes, resume prices the pulls left again and takes those that pay, never one that conflicts
    with a chosen choice (a and b each save now; a conflicts with the push of c)."""
    chains = Chains({0: 0.0, 1: 0.0, 2: 0.0}, {"a": 1e-6, "b": 1e-6})
    pushed = SimpleNamespace(name="c", op="c", values=("c",), invalid=None, direction=PUSH)
    chains.conflict = lambda t, c: "both write c" if {t.op, c.op} == {"a", "c"} else None
    before = Strategy([pushed], [Decision("c", "c", True, Saving(1e-6, "pushed"), "pushed", PUSH, 1)])
    after = resume(chains, chains, before)
    assert [c.name for c in after.chosen] == ["c", "b"]
    assert after.decision("a") is None or not after.decision("a").chosen
    assert after.decision("c", PUSH).chosen


def test_an_invalid_choice_is_logged_once_with_its_reason():
    chains = Chains({0: 0.0, 1: 0.0, 2: 0.0}, {"a": 1e-6})
    chains.choices.append(SimpleNamespace(name="p", op="p", values=("p",), invalid="p has two readers",
                                          direction=PUSH))
    decisions = [d for d in select(chains, chains).decisions if d.op == "p"]
    assert [(d.chosen, d.reason) for d in decisions] == [(False, "p has two readers")]
