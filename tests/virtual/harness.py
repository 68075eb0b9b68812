"""Checks a movement op's pull (and push) mapping on every index against torch."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from vtc.index.mapping import gather
from vtc.index.expr import evaluate, walk
from vtc.virtual.movement import Src, derive_index_tensors, pull, push


def random_tensor(shape, dtype=torch.float32, gen=None):
    """Random values (never zeros) of a shape and dtype."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    return torch.randint(-100, 100, shape, generator=gen, dtype=dtype)


def _named(target, args, kwargs):
    """(args and kwargs with tensors as Src named t0, t1, ..., torch's outputs, {name: tensor})."""
    names = iter(f"t{k}" for k in range(100))
    env: dict[str, torch.Tensor] = {}

    def to_src(x):
        if isinstance(x, torch.Tensor):
            name = next(names)
            env[name] = x
            return Src(name, tuple(x.shape), x.dtype)
        return x

    sargs, skwargs = pytree.tree_map(to_src, (args, kwargs))
    expected = target(*args, **kwargs)
    expected = (expected,) if isinstance(expected, torch.Tensor) else tuple(expected)
    return sargs, skwargs, expected, env


def pull_of(target, args, kwargs=None):
    """(target's pull mappings, torch's outputs, {name: tensor}) with the tensor arguments named t0, t1, ..."""
    sargs, skwargs, expected, env = _named(target, args, kwargs or {})
    return pull(target, sargs, skwargs, [e.shape for e in expected]), expected, env


def realize(m, env):
    """The tensor mapping m describes, its derived index tensors computed first (as the executor does)."""
    return gather(m, {**env, **derive_index_tensors(m, env)})


def check_pull(target, args, kwargs=None):
    """Evaluates target's pull mappings at every output index and compares with torch; returns them."""
    maps, expected, env = pull_of(target, args, kwargs)
    assert len(maps) == len(expected)
    for m, e in zip(maps, expected):
        got = realize(m, env)
        assert got.shape == e.shape, (str(m), got.shape, e.shape)
        assert got.dtype == e.dtype, (got.dtype, e.dtype)
        torch.testing.assert_close(got, e, rtol=0, atol=0, equal_nan=True, msg=lambda s: f"{target} mapping {m}: {s}")
        assert_reads_in_bounds(m, {**env, **derive_index_tensors(m, env)})
    return maps


def assert_reads_in_bounds(m, tensors):
    """Every element is read from inside its source: gather clamps indices (a masked-off piece may point
    anywhere), so a pull that reads out of bounds where it applies would still give torch's values.  And
    every sub-expression stays in its claimed range; a load of a checked index tensor claims its check's."""
    n = len(m.shape)
    if 0 in m.shape:
        return
    venv = {f"i{k}": torch.arange(s).reshape([s if j == k else 1 for j in range(n)]) for k, s in enumerate(m.shape)}
    idx_t = {k: tensors[k] for k in m.index_tensors}
    taken = torch.zeros(m.shape, dtype=torch.bool)
    for p in m.pieces:
        mask = torch.broadcast_to(evaluate(p.when, venv, idx_t).bool(), m.shape) & ~taken
        taken = taken | mask
        if p.source is None:
            continue
        for k, (i, size) in enumerate(zip(p.index, m.sources[p.source])):
            where = torch.broadcast_to(evaluate(i, venv, idx_t), m.shape)[mask]
            assert bool(((where >= 0) & (where < size)).all()), \
                f"{m}: piece {p} reads {p.source} dim {k} (size {size}) at {sorted(set(where.tolist()))}"
        for e in (p.when, *p.index):  # the ranges the simplifier relied on hold where the piece applies
            for x in walk(e):
                v = torch.broadcast_to(evaluate(x, venv, idx_t), m.shape)[mask]
                if v.numel():
                    assert x.lo <= int(v.min()) and int(v.max()) <= x.hi, f"{m}: {x} claims [{x.lo}, {x.hi}]"
                if x.op == "load" and any(c.tensor == x.args[0] for c in m.checks):
                    assert any((c.tensor, c.lo, c.hi) == (x.args[0], x.lo, x.hi) for c in m.checks), \
                        f"{m}: {x} claims [{x.lo}, {x.hi}], its check {m.checks}"


def check_push(target, args, kwargs=None):
    """Checks each push mapping: writing input x through it into the outputs reproduces torch's outputs there."""
    sargs, skwargs, expected, env = _named(target, args, kwargs or {})
    pushes = push(target, sargs, skwargs, [e.shape for e in expected])
    assert pushes, f"{target} defines no push mapping"
    for src_name, m in pushes.items():
        x = env[src_name]
        n = len(m.shape)
        venv = {f"i{k}": torch.arange(s).reshape([s if j == k else 1 for j in range(n)]) for k, s in enumerate(m.shape)}
        idx_t = {k: env[k] for k in m.index_tensors}
        for c in m.checks:
            c.run(env[c.tensor])
        taken = torch.zeros(m.shape, dtype=torch.bool)  # the first piece whose predicate holds applies
        for p in m.pieces:
            assert p.source is not None and p.source.startswith("out")
            out = expected[int(p.source[3:])]
            assert tuple(out.shape) == m.sources[p.source], (p.source, out.shape, m.sources[p.source])
            mask = torch.broadcast_to(evaluate(p.when, venv, idx_t).bool(), m.shape) & ~taken
            taken = taken | mask
            where = [torch.broadcast_to(evaluate(i, venv, idx_t), m.shape)[mask] for i in p.index]
            for k, (w, size) in enumerate(zip(where, out.shape)):
                inside = bool(((w >= 0) & (w < size)).all())
                assert inside, f"{target} push of {src_name} {m}: dim {k} leaves [0, {size})"
            torch.testing.assert_close(out[tuple(where)], x[mask], rtol=0, atol=0,
                                       msg=lambda s: f"{target} push of {src_name} {m}: {s}")
    return pushes
