"""Behaviour of vtc.index.mapping that no test in tests/index or tests/virtual pinned (found by mutation
testing, docs/testing.md): each test fails when one small change to mapping.py is made."""
from __future__ import annotations

import pytest
import torch

from vtc.index.expr import TRUE, const, evaluate, lt, var
from vtc.index.mapping import (IndexCheck, Mapping, Piece, Strided, compose, gather, identity, linear_offset,
                               out_vars)
from vtc.virtual.movement import Src, pull

aten = torch.ops.aten


def grid(shape):
    n = len(shape)
    return {f"i{k}": torch.arange(s).reshape([s if j == k else 1 for j in range(n)]) for k, s in enumerate(shape)}


@pytest.mark.parametrize("shape", [(5,), (2, 3), (3, 1, 4), (2, 3, 2, 2)])
def test_linear_offset_of_every_index_is_its_row_major_position(shape):
    got = evaluate(linear_offset(out_vars(shape), shape), grid(shape))
    want = torch.arange(torch.Size(shape).numel()).reshape(shape)
    assert torch.equal(torch.broadcast_to(got, shape), want)


def test_linear_offset_of_a_shifted_index():
    x = var("x", 3)
    assert evaluate(linear_offset((x + 1, 2 * x), (4, 6)), {"x": torch.arange(3)}).tolist() == [6, 14, 22]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bool])
def test_index_check_accepts_both_bounds(dtype):
    lo, hi = (0, 1) if dtype == torch.bool else (-2, 4)
    IndexCheck("t", lo, hi, "op").run(torch.tensor([hi, lo, hi, lo]).to(dtype))
    IndexCheck("t", lo, hi, "op").run(torch.tensor([], dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_index_check_names_the_first_value_out_of_range(dtype):
    t = torch.tensor([4, -2, 7, -3]).to(dtype)  # both bounds appear before the bad values
    with pytest.raises(IndexError, match=r"^gather: index 7 is out of range \[-2, 4\] \(index tensor 't'\)$"):
        IndexCheck("t", -2, 4, "gather").run(t)
    with pytest.raises(IndexError, match="index -3 is out of range"):
        IndexCheck("t", -2, 4, "gather").run(t[[0, 1, 3]])


def test_index_check_of_a_float_tensor_compares_its_values_not_their_integer_parts():
    with pytest.raises(IndexError, match="out of range"):
        IndexCheck("t", -2, 4, "gather").run(torch.tensor([0.0, 4.5]))


def test_strided_gives_size_one_dims_stride_zero():
    assert identity("x", (3, 1, 4)).strided() == Strided("x", 0, (4, 0, 1))
    i0, i1, i2 = out_vars((1, 2, 1))
    m = Mapping((1, 2, 1), (Piece("x", (i1 + 1, const(3))),), {"x": (3, 5)})
    assert m.strided() == Strided("x", 8, (0, 5, 0))


def test_strided_is_none_for_a_flip_and_a_negative_offset():
    """Only views torch.as_strided can take: no negative stride, no offset before the start."""
    m = pull(aten.flip.default, (Src("x", (4, 3)), [0]), {}, [(4, 3)])[0]
    assert m.strided() is None, f"{m} gives {m.strided()}"
    (i0,) = out_vars((3,))
    shifted = Mapping((3,), (Piece("x", (i0 - 1,)),), {"x": (5,)})  # reads x[-1] at i0 = 0
    assert shifted.strided() is None, f"{shifted} gives {shifted.strided()}"
    assert Mapping((3,), (Piece("x", (i0 + 1,)),), {"x": (5,)}).strided() == Strided("x", 1, (1,))


def test_compose_through_an_inner_padding():
    """A permute of a padded tensor: the inner mapping's fill piece survives composition (no source)."""
    x = torch.randn(2, 3)
    pad = pull(aten.constant_pad_nd.default, (Src("x", (2, 3)), [1, 1], 0.5), {}, [(2, 5)])[0]
    perm = pull(aten.permute.default, (Src("p", (2, 5)), [1, 0]), {}, [(5, 2)])[0]
    m = compose(perm, {"p": pad})
    assert m.sources == {"x": (2, 3)} and m.pieces[-1].source is None
    assert torch.equal(gather(m, {"x": x}), torch.nn.functional.pad(x, [1, 1], value=0.5).t())


# second audit (docs/testing.md): gather, the oracle of every mapping test
def test_gather_of_a_mapping_that_only_fills_takes_the_last_fill_s_type():
    """No source to take the dtype from: the fill of the last piece (the one that applies everywhere else)
    decides, as torch.tensor(fill) would."""
    i0 = var("i0", 4)
    m = Mapping((4, 2), (Piece(None, (), lt(i0, 1), 1), Piece(None, (), TRUE, 2.5)), {})
    got = gather(m, {})
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.tensor([[1.0, 1.0]] + [[2.5, 2.5]] * 3))
    ints = gather(Mapping((3,), (Piece(None, (), TRUE, 7),), {}), {})
    assert ints.dtype == torch.int64 and ints.tolist() == [7, 7, 7]
