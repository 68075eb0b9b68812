"""Every movement op feeding every kernel kind: the movement is read through its mapping.

For each movement op (a builder returning a virtual tensor from the inputs)
one function is compiled that feeds the result to five consumers: pointwise
add, pointwise mul, a sum over the last dim, a softmax and a layer norm over the
last dim, and returns only the consumers' results (so the movement's result is never a
graph output).  Each movement test checks every consumer's result against
eager and that nothing moved data:

- ``materialized_movement_bytes == 0`` (no gather, copy kernel or kept op),
- no step ran through torch,
- the consumer's kernel reads the movement's *sources* (graph inputs, plus the
  index tensors of its mapping), never a materialised intermediate.

The five consumers share one compile (and one shared library) per movement op,
so the matrix costs 30 compiles rather than 150; a failure lists every failing
(movement, consumer) pair.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .util import (ROW_TOL, assert_all_generated, assert_no_movement, compile_cpu, data_reads, gen,
                   graph_input_names, kernel_storing, rand, report)


def _inputs(seed: int):
    g = gen(seed)
    a = rand((3, 17, 10), g)
    return g, a


def _movements():
    """(id, builder, inputs): each builder returns a tensor made only by movement ops."""
    g, a = _inputs(30)
    idx = torch.randint(0, 3, (5,), generator=g)
    uniq = torch.randperm(17, generator=g)[:4]  # unique: index_copy / index_put are then pure movement
    return [
        ("permute", lambda a: a.permute(2, 0, 1), (a,)),
        ("transpose", lambda a: a.transpose(0, 1), (a,)),
        # inner dims over 32 both ways: pointwise readers loop in square tiles, with partial edge tiles
        ("transpose_tiled", lambda b: b.transpose(1, 2), (rand((3, 127, 33), g),)),
        ("reshape_of_transposed", lambda a: a.transpose(1, 2).reshape(3, 5, 34), (a,)),
        ("view_of_transposed", lambda a: a.transpose(0, 2).contiguous().view(10, 51), (a,)),
        ("slice_step", lambda a: a[:, 1::2, ::3], (a,)),
        ("select", lambda a: a[:, 3], (a,)),
        ("narrow", lambda a: a.narrow(2, 2, 7), (a,)),
        ("expand", lambda b: b.expand(3, 17, 10), (rand((3, 1, 10), g),)),
        ("unsqueeze_squeeze", lambda a: a[:, :1].squeeze(1).unsqueeze(0), (a,)),
        ("cat", lambda a, b: torch.cat([a, b], 2), (a, rand((3, 17, 5), g))),
        ("cat_middle", lambda a, b: torch.cat([b, a], 1), (a, rand((3, 2, 10), g))),
        ("stack", lambda a, b: torch.stack([a, b], 1), (a, rand((3, 17, 10), g))),
        ("split", lambda a: a.split([4, 6], 2)[1], (a,)),
        ("chunk", lambda a: a.chunk(3, 1)[2], (a,)),
        ("flip", lambda a: a.flip(0, 2), (a,)),
        ("roll", lambda a: a.roll(3, 2), (a,)),
        ("roll_two_dims", lambda a: a.roll((1, -5), (0, 1)), (a,)),
        ("constant_pad", lambda a: F.pad(a, (2, 3, 1, 0), value=0.5), (a,)),
        ("repeat", lambda a: a.repeat(2, 1, 3), (a,)),
        ("index_select", lambda a, i: a.index_select(0, i), (a, idx)),
        ("gather", lambda a, i: a.gather(2, i), (a, torch.randint(0, 10, (3, 17, 6), generator=g))),
        ("embedding", lambda w, i: F.embedding(i, w), (rand((17, 10), g), torch.randint(0, 17, (3, 7), generator=g))),
        ("index_tensor", lambda a, i, j: a[:, i, j], (a, torch.randint(0, 17, (4,), generator=g),
                                                      torch.randint(0, 10, (4,), generator=g))),
        ("pixel_shuffle", lambda x: F.pixel_shuffle(x, 2), (rand((2, 8, 3, 5), g),)),
        ("diagonal", lambda a: a.diagonal(0, 1, 2), (a,)),
        ("unfold", lambda a: a.unfold(1, 4, 3), (a,)),
        ("index_copy", lambda a, i, s: a.index_copy(1, i, s), (a, uniq, rand((3, 4, 10), g))),
        ("index_put", lambda a, i, s: a.index_put((i,), s), (a, torch.randperm(3, generator=g)[:2],
                                                             rand((2, 17, 10), g))),
        ("slice_scatter", lambda a, s: torch.slice_scatter(a, s, 2, 1, 10, 3), (a, rand((3, 17, 3), g))),
    ]


MOVEMENTS = {name: (build, inputs) for name, build, inputs in _movements()}

CONSUMERS = {
    "add": lambda y: y + 1.5,
    "mul": lambda y: y * y,
    "sum_last": lambda y: y.sum(-1),
    "softmax": lambda y: torch.softmax(y, -1),
    "layer_norm": lambda y: F.layer_norm(y, y.shape[-1:]),
}
CONSUMER_KIND = {"add": "pointwise", "mul": "pointwise", "sum_last": "row", "softmax": "row", "layer_norm": "row"}


@pytest.mark.parametrize("movement", list(MOVEMENTS))
def test_movement_read_through_by_every_consumer(movement):
    build, inputs = MOVEMENTS[movement]

    def f(*xs):
        y = build(*xs)
        return tuple(c(y) for c in CONSUMERS.values())

    compiled = compile_cpu(f, inputs)
    want, got = f(*inputs), compiled(*inputs)
    assert report(compiled)["movement_ops"] >= 1  # the builder was captured as movement ops
    assert_all_generated(compiled)
    assert_no_movement(compiled)  # materialized_movement_bytes == 0: nothing moved for any consumer
    failures = []
    for k, consumer in enumerate(CONSUMERS):
        try:
            torch.testing.assert_close(got[k], want[k], **ROW_TOL)
            kernel = kernel_storing(compiled, k)
            assert kernel.kind == CONSUMER_KIND[consumer], kernel.kind
            # the consumer reads the movement's sources directly, through the composed mapping
            reads = data_reads(compiled, kernel)
            assert reads <= graph_input_names(compiled), f"{kernel.name} reads intermediates {reads}"
        except AssertionError as e:
            failures.append(f"{movement} -> {consumer}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("plan", ["all", "greedy", "none"])
def test_every_movement_in_bfloat16(plan):
    """Every movement in bfloat16, its result and read by an op: torch's results, bit for bit, under every plan
    (a KeyError from the C type table was raised here before).  bfloat16 has generated code now
    (docs/low_precision.md): virtual values that must exist are copied by generated kernels, not gathered by
    torch (before: every such value was, with the reason in why_torch)."""
    names = list(MOVEMENTS)
    flat, spans = [], []
    for name in names:
        inputs = [x.bfloat16() if x.is_floating_point() else x for x in MOVEMENTS[name][1]]
        spans.append((len(flat), len(flat) + len(inputs)))
        flat.extend(inputs)

    def f(*xs):
        outs = []
        for name, (lo, hi) in zip(names, spans):
            y = MOVEMENTS[name][0](*xs[lo:hi])
            outs += [y, y + 1]  # the movement's result itself and read by an op (through torch in bf16)
        return tuple(outs)

    compiled = compile_cpu(f, tuple(flat), plan=plan)
    for k, (w, g) in enumerate(zip(f(*flat), compiled(*flat))):
        assert g.dtype == torch.bfloat16, names[k // 2]
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m, k=k: f"{names[k // 2]}: {m}")
    why = compiled._first.executor.lowering.why_torch
    assert not any("has no generated code" in w for w in why.values()), why
    assert [s for s in compiled._first.executor.steps if s.kind == "gather"] == []
