"""A disk cache of cost-model plans, keyed by everything the planner reads.

The greedy planner (and its memory objective) is a pure function of the graph's
structure, the options, the machine figures and vtc's own code: it reads node
kinds, ATen ops and their non-tensor arguments, value names, shapes and dtypes —
never the values of const tensors (weights).  So the key is the sha256 of

- ``print_graph(graph)``: the canonical text form, which holds exactly those
  (a graph whose text cannot be printed, or with a node whose target is not an
  ATen/custom ``OpOverload``, is not cached), and which outputs the model writes
  back into its inputs (``graph.meta["input_mutations"]``: such scatters are pushed);
- the plan options (``plan``, ``backend``, ``objective``, ``max_slowdown``,
  ``gemm``), the machine figures (``vtc.plan.cost.machine()``) but its two
  timed 2-thread figures (bandwidth, GEMM rate), the prices of
  ``vtc.plan.cost.CostModel`` (its numeric class attributes), the torch
  version, ``PLAN_CACHE_FORMAT`` and a digest of every ``.py`` file of the vtc
  package (a changed planner or cost model never reads an old entry).

The timed figures are in the entry instead: it is a hit only where each of them
that the plan reads (``timed_read``) is within ``cost.TIMED_SPREAD`` of the
current figure (the spread of quiet measurements of one machine).  Measured
while other processes kept the cores busy, they are provisional and a later
process measures them again (``cost._measure_timed_again``), in the middle of a
warm compile; keyed on their exact values, every such re-measurement missed the
plan and made it again (7.2 s of a 16.0 s warm compile of a 4-layer Llama,
docs/compile_time.md).  A plan made from figures beyond the spread (a quiet
figure after busy ones) is still made again, and overwrites the entry.  A hit's
decisions keep the estimated savings they were made with.

A changed model therefore misses: new weights do not change the plan (and are
not part of it), other code or other shapes change the text.  Plans that time
variants (``plan="measured"``, a ``measure_budget_s``) and plans made with a
caller's own ``CostModel`` are not cached.

An entry is ``<cache dir>/plans/<key>.json`` (written to a temporary file and
renamed): the kept and the pushed movement ops with their reasons, the decision log, the
objective and the notes — JSON, never pickle, so reading an entry runs no
code.  A hit rebuilds the ``Plan`` with ``plan_keeping`` on the current graph;
an entry that does not fit it (unreadable, or naming a node the graph lacks)
is a miss and is overwritten.  ``stats`` counts hits, misses and stores in this
process (the tests read it).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch

from vtc.ir.graph import Graph
from vtc.plan.cost import TIMED_FIGURES
from vtc.plan.virtualize import Plan, plan_keeping

PLAN_CACHE_FORMAT = 2
KEY_OPTIONS = ("plan", "backend", "objective", "max_slowdown", "gemm", "push")
stats: Counter = Counter()  # "hit", "miss", "store", "uncacheable" in this process


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the relative path and bytes of every .py file of the vtc package (once per process)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cacheable(options: dict) -> bool:
    """Whether a plan made under `options` may come from (and go to) the cache: greedy, nothing timed."""
    return options.get("plan", "greedy") == "greedy" and not options.get("measure_budget_s")


def timed_read(options: dict) -> tuple[str, ...]:
    """The timed machine figures a cacheable plan under `options` depends on: the bandwidth prices every movement
    term; the GEMM rate only the compute nodes (``CostModel.node``), the part of the latency no plan changes
    (``Estimator.compute``), which no saving reads and only objective="memory" (its latency budget) does."""
    return TIMED_FIGURES if options.get("objective", "latency") == "memory" else ("bandwidth_gbs",)


def plan_key(graph: Graph, options: dict) -> str | None:
    """The cache key of `graph` planned under `options`, or None when the graph cannot be keyed."""
    from vtc.ir.printer import print_graph
    from vtc.plan.cost import CostModel, machine

    if not all(isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes):
        return None
    try:
        text = print_graph(graph)
    except ValueError:  # an argument the text form cannot print
        return None
    prices = sorted((k, v) for k, v in vars(CostModel).items() if isinstance(v, (int, float)))
    figures = {k: v for k, v in asdict(machine()).items() if k not in TIMED_FIGURES}
    blob = json.dumps([PLAN_CACHE_FORMAT, torch.__version__, code_digest(), figures, prices,
                       [[k, options.get(k)] for k in KEY_OPTIONS], text, graph.meta.get("input_mutations", ())],
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _path(key: str) -> Path:
    from vtc.runtime.cbuild import cache_dir

    d = cache_dir() / "plans"
    d.mkdir(mode=0o700, exist_ok=True)
    return d / f"{key}.json"


def load(graph: Graph, options: dict) -> tuple[Plan | None, str | None]:
    """(the cached plan of `graph`, its key); (None, key) on a miss, (None, None) when not cacheable.  An entry
    made from timed figures beyond TIMED_SPREAD of the current ones is a miss."""
    from vtc.plan.cost import machine, same_timed_figures

    key = plan_key(graph, options) if cacheable(options) else None
    if key is None:
        stats["uncacheable"] += 1
        return None, None
    try:
        entry = json.loads(_path(key).read_text())
        if not same_timed_figures(entry["timed"], asdict(machine()), timed_read(options)):
            raise ValueError("entry made from other timed machine figures")
        plan = _plan_from(graph, entry)
    except (OSError, ValueError, KeyError, TypeError):
        stats["miss"] += 1
        return None, key
    stats["hit"] += 1
    return plan, key


def store(key: str, plan: Plan) -> None:
    """Writes `plan` under `key` (atomically), with the timed machine figures it was made from; a failure to write
    only costs the next compile a plan."""
    from vtc.plan.cost import machine

    entry = {"timed": {k: getattr(machine(), k) for k in TIMED_FIGURES},
             "mode": plan.mode, "kept": plan.kept, "pushed": plan.pushed, "objective": plan.objective,
             "notes": list(plan.notes),
             "decisions": [asdict(d) for d in plan.decisions]}
    try:
        path = _path(key)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
        stats["store"] += 1
    except OSError:
        pass


def _plan_from(graph: Graph, entry: dict) -> Plan:
    """The Plan an entry describes, rebuilt on `graph`; ValueError when it names what the graph lacks."""
    from vtc.plan.cost import Saving
    from vtc.plan.greedy import Decision

    movement = {n.name for n in graph.nodes if n.kind == "movement"}
    kept, pushed = entry["kept"], entry["pushed"]
    if not isinstance(kept, dict) or not set(kept) <= movement:
        raise ValueError("entry keeps ops the graph does not have")
    if not isinstance(pushed, dict) or not set(pushed) <= movement:
        raise ValueError("entry pushes ops the graph does not have")
    decisions = []
    for d in entry["decisions"]:
        if d["op"] not in movement:
            raise ValueError(f"entry decides on {d['op']!r}, which the graph does not have")
        decisions.append(Decision(**{**d, "saving": Saving(**d["saving"])}))
    plan = plan_keeping(graph, entry["mode"], {k: str(v) for k, v in kept.items()},
                        push={k: str(v) for k, v in pushed.items()})
    plan.decisions, plan.objective, plan.notes = decisions, entry["objective"], list(entry["notes"])
    return plan
