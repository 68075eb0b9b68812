"""Push mappings: writing each input through its push reproduces torch's outputs there."""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from vtc.virtual.ops import base_name
from vtc.virtual.movement import PUSHES, Src, push
from vtc.virtual.ops import packet_name

from .cases import PULL_CASES, PUSH_CASES, A, T, U
from .harness import check_push


@pytest.mark.parametrize("target,args,kwargs", PUSH_CASES)
def test_push(target, args, kwargs):
    check_push(target, args, kwargs)


def test_every_push_is_tested():
    tested = {base_name(packet_name(p.values[0])) for p in PUSH_CASES}
    assert not sorted(set(PUSHES) - tested - {"tensor_split"})


@pytest.mark.parametrize("target,args", [
    pytest.param(A.index_put.default, (T(5, 3), [U(5, 2)], T(3)), id="index_put-broadcast-values"),
    pytest.param(A.scatter.src, (T(3, 5), 1, U(5, 3, 1), T(3, 2)), id="scatter-src-larger-than-index"),
    pytest.param(A.expand.default, (T(3, 1), [3, 4]), id="expand"),
])
def test_no_push_where_an_input_element_lands_in_several_places_or_none(target, args):
    names = iter(range(100))
    srcs = pytree.tree_map(lambda x: Src(f"t{next(names)}", tuple(x.shape), x.dtype)
                           if isinstance(x, torch.Tensor) else x, args)
    assert push(target, srcs, {}, [target(*args).shape]) == {}


def test_split_push_is_one_mapping_over_the_input():
    (m,) = check_push(A.split_with_sizes.default, (T(6, 2), [1, 0, 5])).values()
    assert str(m) == "(i0, i1) in [6, 2] -> \n  out0[i0, i1] if (i0 < 1)\n  out2[(i0 - 1), i1]"


def test_index_put_push_loads_the_index():
    (m,) = check_push(A.index_put.default, (T(1, 2, 8, 4), [None, None, torch.tensor([5, 6])], T(1, 2, 2, 4))).values()
    assert str(m) == "(i0, i1, i2, i3) in [1, 2, 2, 4] -> out0[0, i1, ((t1[i2] < 0) ? (t1[i2] + 8) : t1[i2]), i3]"
