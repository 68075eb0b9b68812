"""Every movement op's pull mapping, evaluated at every output index and compared with torch."""
from __future__ import annotations

import pytest
import torch

from vtc.index.mapping import compose
from vtc.virtual.ops import base_name
from vtc.virtual.movement import PULLS, Src, derive_index_tensors, pull
from vtc.virtual.ops import MOVEMENT_OPS, packet_name

from .cases import PULL_CASES, A, I, T, U
from .harness import check_pull, pull_of, realize


@pytest.mark.parametrize("target,args,kwargs", PULL_CASES)
def test_pull(target, args, kwargs):
    check_pull(target, args, kwargs)


def test_every_movement_op_has_a_pull():
    missing = sorted(n for n in MOVEMENT_OPS if base_name(n) not in PULLS)
    assert not missing, f"movement ops without a pull mapping: {missing}"


def test_every_pull_is_tested():
    tested = {base_name(packet_name(p.values[0])) for p in PULL_CASES}
    untested = sorted({base_name(n) for n in MOVEMENT_OPS} - tested)
    assert not untested, f"movement ops with no pull case: {untested}"


def test_index_copy_is_not_a_copy_twin_of_index():
    assert base_name("index_copy") == "index_copy"
    assert base_name("permute_copy") == "permute"


# ---------------------------------------------------------------------------
# index tensors out of range: the mapping's checks raise IndexError naming the op and the value
BAD_INDEX = [
    pytest.param(A.gather.default, (T(3, 5), 1, I(3, 2, high=5)), "t1", torch.tensor([[0, 7]] * 3),
                 r"gather: index 7 is out of range \[0, 4\]", id="gather"),
    pytest.param(A.index_select.default, (T(5, 3), 0, I(2, high=5)), "t1", torch.tensor([1, -1]),
                 r"index_select: index -1 is out of range \[0, 4\]", id="index_select"),
    pytest.param(A.embedding.default, (T(7, 3), I(2, high=7)), "t1", torch.tensor([7, 0]),
                 r"embedding: index 7 is out of range \[0, 6\]", id="embedding"),
    pytest.param(A.take.default, (T(3, 5), I(2, high=15)), "t1", torch.tensor([3, -16]),
                 r"take: index -16 is out of range \[-15, 14\]", id="take"),
    pytest.param(A.index.Tensor, (T(3, 5), [None, I(2, high=5)]), "t1", torch.tensor([5, 0]),
                 r"index: index 5 is out of range \[-5, 4\]", id="index"),
    pytest.param(A.index_put.default, (T(5, 3), [U(5, 2)], T(2, 3)), "t1", torch.tensor([0, -6]),
                 r"index_put: index -6 is out of range \[-5, 4\]", id="index_put"),
    pytest.param(A.index_copy.default, (T(5, 3), 0, U(5, 2), T(2, 3)), "t1", torch.tensor([5, 0]),
                 r"index_copy: index 5 is out of range \[0, 4\]", id="index_copy"),
    pytest.param(A.scatter.src, (T(3, 5), 1, U(5, 3, 1), T(3, 1)), "t1", torch.tensor([[0], [9], [1]]),
                 r"scatter: index 9 is out of range \[0, 4\]", id="scatter"),
    pytest.param(A.narrow.Tensor, (T(3, 7), 1, torch.tensor(1), 4), "t1", torch.tensor(4),
                 r"narrow: index 4 is out of range \[0, 3\]", id="narrow-tensor-start"),
]


@pytest.mark.parametrize("target,args,name,bad,message", BAD_INDEX)
def test_out_of_range_index_raises(target, args, name, bad, message):
    (m, *_), _, env = pull_of(target, args)
    with pytest.raises(IndexError, match=message):
        realize(m, {**env, name: bad})


@pytest.mark.parametrize("target,args,kwargs,message", [
    pytest.param(A.index.Tensor, (T(3, 5), [torch.tensor([True, False, True])]), {}, "boolean mask", id="index-mask"),
    pytest.param(A.index_put.default, (T(3, 5), [torch.tensor([True, False, False])], T(1)), {},
                 "boolean mask", id="index_put-mask"),
    pytest.param(A.index_put.default, (T(3, 5), [U(3, 2)], T(1), True), {}, "accumulate", id="index_put-accumulate"),
    pytest.param(A.repeat_interleave.self_Tensor, (T(3), torch.tensor([1, 2, 1])), {}, "repeats tensor",
                 id="repeat_interleave-tensor"),
    pytest.param(A.scatter.reduce, (T(3, 5), 1, U(5, 3, 1), T(3, 1)), {"reduce": "add"}, "reduce",
                 id="scatter-reduce"),
])
def test_unsupported_forms_say_why(target, args, kwargs, message):
    with pytest.raises(NotImplementedError, match=message):
        pull_of(target, args, kwargs)


# ---------------------------------------------------------------------------
# derived index tensors
def test_inverse_index_marks_unwritten_with_minus_one_and_last_writer_wins():
    (m,), _, env = pull_of(A.index_put.default, (T(5), [torch.tensor([3, 1, 3])], T(3)))
    assert set(m.index_tensors) == {"t1", "inverse(t1)"}
    assert derive_index_tensors(m, env)["inverse(t1)"].tolist() == [-1, 1, -1, 2, -1]


def test_inverse_along_a_dim():
    (m,), _, env = pull_of(A.scatter.src, (T(2, 4), 1, torch.tensor([[3, 0], [1, 2]]), T(2, 2)))
    assert derive_index_tensors(m, env)["inverse_dim1(t1)"].tolist() == [[1, -1, -1, 0], [-1, 0, 1, -1]]


def test_inverse_of_broadcast_index_tensors_wraps_negatives():
    (m,), _, env = pull_of(A.index_put.default, (T(2, 3), [torch.tensor([[0], [-1]]), torch.tensor([2, 0])], T(1)))
    assert derive_index_tensors(m, env)["inverse(t1,t2)"].tolist() == [[1, -1, 0], [3, -1, 2]]


def test_derive_leaves_given_tensors_alone():
    (m,), _, env = pull_of(A.index_copy.default, (T(5), 0, U(5, 2), T(2)))
    assert derive_index_tensors(m, {**env, "inverse(t1)": torch.zeros(5)}) == {}


# ---------------------------------------------------------------------------
# golden text of mappings: what the simplifier leaves
def _one(target, *args):
    (m,), _, _ = pull_of(target, args)
    return str(m)


def _composed(outer, inner):
    """outer (reading t1) composed with inner (producing t1 from t0)."""
    return str(compose(outer[0], {"t1": inner[0]}))


def test_golden_permute():
    assert _one(A.permute.default, T(2, 3, 5), [2, 0, 1]) == "(i0, i1, i2) in [5, 2, 3] -> t0[i1, i2, i0]"


def test_golden_cat():
    assert _one(A.cat.default, [T(2, 3), T(1, 3), T(4, 3)], 0) == (
        "(i0, i1) in [7, 3] -> \n"
        "  t0[i0, i1] if (i0 < 2)\n"
        "  t1[(i0 - 2), i1] if (i0 < 3)\n"
        "  t2[(i0 - 3), i1]")


def test_golden_pad():
    assert _one(A.constant_pad_nd.default, T(3, 5), [1, 2], 0.5) == (
        "(i0, i1) in [3, 8] -> \n"
        "  t0[i0, (i1 - 1)] if ((0 < i1) && (i1 < 6))\n"
        "  fill 0.5")


def test_golden_expand():
    assert _one(A.expand.default, T(3, 1), [2, 3, 5]) == "(i0, i1, i2) in [2, 3, 5] -> t0[i1, 0]"


def test_golden_gather():
    assert _one(A.gather.default, T(3, 5), 1, I(3, 4, high=5)) == "(i0, i1) in [3, 4] -> t0[i0, t1[i0, i1]]"


def test_golden_kv_cache_index_put():
    assert _one(A.index_put.default, T(1, 2, 8, 4), [None, None, torch.tensor([5, 6])], T(1, 2, 2, 4)) == (
        "(i0, i1, i2, i3) in [1, 2, 8, 4] -> \n"
        "  t2[0, i1, inverse(t1)[i2], i3] if (-1 < inverse(t1)[i2])\n"
        "  t0[0, i1, i2, i3]")


def test_golden_strided_slice_scatter():
    assert _one(A.slice_scatter.default, T(2, 8), T(2, 3), 1, 0, None, 3) == (
        "(i0, i1) in [2, 8] -> \n"
        "  t1[i0, (i1 // 3)] if (((i1 % 3) == 0) && (i1 < 7))\n"
        "  t0[i0, i1]")


def _src_pull(target, src, *args, out):
    return pull(target, (src, *args), {}, [out])


def test_golden_view_split_then_merge_is_identity():
    inner = _src_pull(A.view.default, Src("t0", (6, 4)), [2, 3, 4], out=(2, 3, 4))
    outer = _src_pull(A.view.default, Src("t1", (2, 3, 4)), [6, 4], out=(6, 4))
    assert _composed(outer, inner) == "(i0, i1) in [6, 4] -> t0[i0, i1]"


def test_golden_permute_then_inverse_permute_is_identity():
    inner = _src_pull(A.permute.default, Src("t0", (2, 3, 5)), [2, 0, 1], out=(5, 2, 3))
    outer = _src_pull(A.permute.default, Src("t1", (5, 2, 3)), [1, 2, 0], out=(2, 3, 5))
    assert _composed(outer, inner) == "(i0, i1, i2) in [2, 3, 5] -> t0[i0, i1, i2]"


def test_golden_pixel_shuffle_then_unshuffle_is_identity():
    inner = _src_pull(A.pixel_shuffle.default, Src("t0", (1, 8, 2, 3)), 2, out=(1, 2, 4, 6))
    outer = _src_pull(A.pixel_unshuffle.default, Src("t1", (1, 2, 4, 6)), 2, out=(1, 8, 2, 3))
    assert _composed(outer, inner) == "(i0, i1, i2, i3) in [1, 8, 2, 3] -> t0[0, i1, i2, i3]"


def test_golden_channel_shuffle():
    # ShuffleNet: view (1, 2, 3, H, W) -> transpose(1, 2) -> view (1, 6, H, W)
    a = _src_pull(A.view.default, Src("t0", (1, 6, 2, 2)), [1, 2, 3, 2, 2], out=(1, 2, 3, 2, 2))
    b = _src_pull(A.transpose.int, Src("t1", (1, 2, 3, 2, 2)), 1, 2, out=(1, 3, 2, 2, 2))
    c = _src_pull(A.view.default, Src("t2", (1, 3, 2, 2, 2)), [1, 6, 2, 2], out=(1, 6, 2, 2))
    ab = compose(b[0], {"t1": a[0]})
    assert str(compose(c[0], {"t2": ab})) == (
        "(i0, i1, i2, i3) in [1, 6, 2, 2] -> t0[0, (3*(i1 % 2) + (i1 // 2)), i2, i3]")
