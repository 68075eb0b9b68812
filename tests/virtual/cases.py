"""Small example calls of every movement op, shared by the pull and push tests.

Each case is a pytest param (target, args, kwargs) with a readable id.  Tensors
are made once, from a fixed seed; index tensors are in range unless a test
says otherwise, and scatter-like indices are unique.
"""
from __future__ import annotations

import pytest
import torch

from .harness import random_tensor

A = torch.ops.aten
_GEN = torch.Generator().manual_seed(0)


def T(*shape, dtype=torch.float32):
    """A random tensor of this shape (fixed seed)."""
    return random_tensor(shape, dtype, _GEN)


def I(*shape, high, low=0):
    """A random int64 index tensor with values in [low, high)."""
    return torch.randint(low, high, shape, generator=_GEN)


def U(n, *shape):
    """Unique int64 indices in [0, n) of this shape."""
    k = 1
    for s in shape:
        k *= s
    return torch.randperm(n, generator=_GEN)[:k].reshape(shape)


def case(id, target, *args, **kwargs):
    """One call of target, as a pytest param."""
    return pytest.param(target, args, kwargs, id=id)


F32, I64, BOOL = torch.float32, torch.int64, torch.bool

PULL_CASES = [
    # views
    case("view-split-merge", A.view.default, T(6, 4), [2, 3, 4]),
    case("view-merge", A.view.default, T(2, 3, 5), [6, 5]),
    case("view-int", A.view.default, T(3, 4, dtype=I64), [12]),
    case("view_copy", A.view_copy.default, T(3, 4), [4, 3]),
    case("_unsafe_view", A._unsafe_view.default, T(3, 4), [2, 6]),
    case("reshape-1", A.reshape.default, T(1, 7, 1), [7]),
    case("_reshape_alias", A._reshape_alias.default, T(3, 4), [4, 3], [3, 1]),
    case("view_as", A.view_as.default, T(3, 4), T(6, 2)),
    case("reshape_as", A.reshape_as.default, T(3, 4), T(2, 2, 3)),
    case("flatten", A.flatten.using_ints, T(2, 3, 5), 1, -1),
    case("unflatten", A.unflatten.int, T(2, 15), -1, [3, 5]),
    case("squeeze-all", A.squeeze.default, T(1, 3, 1, 5)),
    case("squeeze-dim-neg", A.squeeze.dim, T(3, 1), -1),
    case("squeeze-dims", A.squeeze.dims, T(1, 3, 1), [0, 2]),
    case("squeeze_copy", A.squeeze_copy.dim, T(1, 3), 0),
    case("unsqueeze-neg", A.unsqueeze.default, T(3, 5), -1),
    case("unsqueeze_copy", A.unsqueeze_copy.default, T(3), 0),
    case("permute", A.permute.default, T(2, 3, 5), [2, 0, 1]),
    case("permute-neg-int", A.permute.default, T(2, 3, 5, dtype=I64), [-1, -3, -2]),
    case("permute-bool", A.permute.default, T(3, 1, 2, dtype=BOOL), [1, 2, 0]),
    case("permute_copy", A.permute_copy.default, T(3, 2), [1, 0]),
    case("transpose-neg", A.transpose.int, T(2, 3, 5), -1, 0),
    case("transpose_copy", A.transpose_copy.int, T(2, 3), 0, 1),
    case("swapaxes", A.swapaxes.default, T(2, 3, 5), 0, 2),
    case("t", A.t.default, T(3, 5)),
    case("t-1d", A.t.default, T(5)),
    case("t_copy", A.t_copy.default, T(1, 3)),
    case("movedim-int", A.movedim.int, T(2, 3, 5), 0, -1),
    case("movedim-list", A.movedim.intlist, T(2, 3, 5, 7), [3, 0], [0, 2]),
    case("expand", A.expand.default, T(3, 1), [2, 3, 5]),
    case("expand-1", A.expand.default, T(1, 1), [1, 4]),
    case("expand_copy", A.expand_copy.default, T(1, 3), [-1, 3]),
    case("expand_as", A.expand_as.default, T(5), T(3, 5)),
    case("clone", A.clone.default, T(3, 5)),
    case("contiguous", A.contiguous.default, T(3)),
    case("alias", A.alias.default, T(2, 3)),
    case("alias_copy", A.alias_copy.default, T(2, 3)),
    case("detach", A.detach.default, T(2, 3)),
    case("detach_copy", A.detach_copy.default, T(2, 3, dtype=BOOL)),
    case("lift_fresh_copy", A.lift_fresh_copy.default, T(3)),
    case("_to_copy", A._to_copy.default, T(2, 3)),
    # slicing and selecting
    case("slice-step", A.slice.Tensor, T(3, 11), 1, 1, 10, 3),
    case("slice-neg-start", A.slice.Tensor, T(7, 3), 0, -4),
    case("slice-end-beyond", A.slice.Tensor, T(5), 0, 2, 100),
    case("slice-empty", A.slice.Tensor, T(5, 3), 0, 4, 2),
    case("slice_copy", A.slice_copy.Tensor, T(5, 3), -1, 1, 3),
    case("select", A.select.int, T(3, 5), 1, 2),
    case("select-neg", A.select.int, T(3, 5, 2), -2, -1),
    case("select-1d", A.select.int, T(5, dtype=I64), 0, 4),
    case("select_copy", A.select_copy.int, T(3, 5), 0, 1),
    case("narrow", A.narrow.default, T(3, 7), 1, 2, 4),
    case("narrow-neg", A.narrow.default, T(7, 3), 0, -3, 2),
    case("narrow-tensor", A.narrow.Tensor, T(3, 7), -1, torch.tensor(3), 4),
    case("narrow_copy", A.narrow_copy.default, T(5), 0, 1, 3),
    case("split", A.split.Tensor, T(7, 3), 3),
    case("split-neg-dim", A.split.Tensor, T(3, 5), 2, -1),
    case("split-sizes", A.split.sizes, T(3, 5), [1, 4], 1),
    case("split_copy", A.split_copy.Tensor, T(5), 2),
    case("split_with_sizes", A.split_with_sizes.default, T(6, 2), [1, 0, 5]),
    case("split_with_sizes_copy", A.split_with_sizes_copy.default, T(2, 6), [3, 3], -1),
    case("chunk", A.chunk.default, T(7, 3), 3),
    case("chunk-fewer", A.chunk.default, T(2, 3), 4, 1),
    case("unbind", A.unbind.int, T(3, 5)),
    case("unbind-neg-1", A.unbind.int, T(3, 1), -1),
    case("unbind_copy", A.unbind_copy.int, T(2, 3, 5, dtype=I64), 1),
    case("diagonal", A.diagonal.default, T(3, 5)),
    case("diagonal-offset", A.diagonal.default, T(4, 3), 1),
    case("diagonal-neg-offset", A.diagonal.default, T(4, 3), -2),
    case("diagonal-dims", A.diagonal.default, T(2, 3, 5), 1, 2, 0),
    case("diagonal-neg-dims", A.diagonal.default, T(3, 2, 3), 0, -1, 0),
    case("diagonal-empty", A.diagonal.default, T(3, 5), 5),
    case("diagonal_copy", A.diagonal_copy.default, T(3, 3), -1),
    case("as_strided", A.as_strided.default, T(3, 5), [3, 3], [5, 1], 1),
    case("as_strided-overlap", A.as_strided.default, T(10), [4, 3], [2, 1]),
    case("as_strided-zero-stride", A.as_strided.default, T(2, 3), [2, 2, 3], [3, 0, 1]),
    case("as_strided_copy", A.as_strided_copy.default, T(12), [3, 2], [1, 3], 2),
    case("unfold", A.unfold.default, T(3, 7), 1, 3, 2),
    case("unfold-whole", A.unfold.default, T(5, 2), 0, 5, 1),
    case("unfold-neg-dim", A.unfold.default, T(2, 6, 3), -2, 2, 3),
    case("unfold-0d", A.unfold.default, torch.tensor(3.0), 0, 1, 1),
    case("unfold_copy", A.unfold_copy.default, T(5), 0, 2, 1),
    # joining and repeating
    case("cat", A.cat.default, [T(2, 3), T(1, 3), T(4, 3)]),
    case("cat-neg-dim", A.cat.default, [T(3, 1), T(3, 2)], -1),
    case("cat-legacy-empty", A.cat.default, [T(2, 3), torch.empty(0), T(1, 3)]),
    case("cat-bool", A.cat.default, [T(2, dtype=BOOL), T(3, dtype=BOOL)]),
    case("stack", A.stack.default, [T(3, 5), T(3, 5), T(3, 5)]),
    case("stack-neg", A.stack.default, [T(3, 2), T(3, 2)], -1),
    case("stack-mid", A.stack.default, [T(3, 2, dtype=I64)], 1),
    case("constant_pad_nd", A.constant_pad_nd.default, T(3, 5), [1, 2, 0, 1], 1.5),
    case("constant_pad_nd-crop", A.constant_pad_nd.default, T(3, 5), [-1, 2]),
    case("constant_pad_nd-int", A.constant_pad_nd.default, T(3, dtype=I64), [2, 1], 7),
    case("repeat", A.repeat.default, T(2, 3), [2, 1, 3]),
    case("repeat-1", A.repeat.default, T(1, 3), [3, 1]),
    case("repeat-bool", A.repeat.default, T(3, dtype=BOOL), [2]),
    case("tile-short", A.tile.default, T(2, 3), [2]),
    case("tile-long", A.tile.default, T(3), [2, 1, 2]),
    case("repeat_interleave-flat", A.repeat_interleave.self_int, T(2, 3), 2),
    case("repeat_interleave-dim", A.repeat_interleave.self_int, T(2, 3), 3, -1),
    case("repeat_interleave-1", A.repeat_interleave.self_int, T(3, 1), 1, 0),
    case("flip", A.flip.default, T(3, 5, 2), [0, -1]),
    case("flip-none", A.flip.default, T(3), []),
    case("roll", A.roll.default, T(3, 5), [1, -2], [0, 1]),
    case("roll-flat", A.roll.default, T(3, 5), [7]),
    case("roll-big-shift", A.roll.default, T(3, 5, dtype=I64), [-11], [-1]),
    case("pixel_shuffle", A.pixel_shuffle.default, T(1, 8, 2, 3), 2),
    case("pixel_shuffle-3", A.pixel_shuffle.default, T(2, 9, 1, 2), 3),
    case("pixel_shuffle-nobatch", A.pixel_shuffle.default, T(4, 3, 1), 2),
    case("pixel_unshuffle", A.pixel_unshuffle.default, T(1, 2, 4, 6), 2),
    case("pixel_unshuffle-3", A.pixel_unshuffle.default, T(3, 3, 3), 3),
    # gathers
    case("index_select", A.index_select.default, T(5, 3), 0, I(4, high=5)),
    case("index_select-neg-dim", A.index_select.default, T(3, 5), -1, I(7, high=5)),
    case("index_select-0d", A.index_select.default, T(3, 5), 1, torch.tensor(2)),
    case("embedding", A.embedding.default, T(7, 3), I(2, 5, high=7)),
    case("gather", A.gather.default, T(3, 5), 1, I(3, 4, high=5)),
    case("gather-small-index", A.gather.default, T(4, 5), 0, I(2, 3, high=4)),
    case("gather-neg-dim-int", A.gather.default, T(2, 3, 5, dtype=I64), -1, I(2, 3, 7, high=5)),
    case("gather-bool", A.gather.default, T(3, 5, dtype=BOOL), 0, I(2, 5, high=3)),
    case("take", A.take.default, T(3, 5), I(2, 4, high=15, low=-15)),
    case("take-0d", A.take.default, T(3, 5), torch.tensor(-1)),
    case("index-one", A.index.Tensor, T(5, 3), [I(4, high=5)]),
    case("index-neg-values", A.index.Tensor, T(5, 3), [I(2, 3, high=5, low=-5)]),
    case("index-middle", A.index.Tensor, T(2, 5, 3), [None, I(4, high=5)]),
    case("index-broadcast", A.index.Tensor, T(3, 5, 2), [I(4, 1, high=3), I(6, high=5)]),
    case("index-adjacent-middle", A.index.Tensor, T(2, 3, 5, 4), [None, I(6, high=3), I(1, 6, high=5, low=-5)]),
    case("index-non-adjacent", A.index.Tensor, T(3, 2, 5, 4), [I(2, 3, high=3), None, I(3, high=5)]),
    case("index-0d", A.index.Tensor, T(3, 5), [None, torch.tensor(-2)]),
    case("index-all", A.index.Tensor, T(3, 5), [I(4, high=3), I(4, high=5)]),
    case("index-int32", A.index.Tensor, T(3, 5, dtype=I64), [I(4, high=3).int()]),
    # scatters (unique indices)
    case("index_put", A.index_put.default, T(5, 3), [U(5, 2)], T(2, 3)),
    case("index_put-bcast-values", A.index_put.default, T(5, 3), [U(5, 3)], T(1)),
    case("index_put-neg", A.index_put.default, T(5, 3), [U(5, 3) - 5], T(3, 1)),
    case("index_put-middle", A.index_put.default, T(2, 5, 3), [None, U(5, 2, 2)], T(2, 2, 2, 3)),
    case("index_put-two", A.index_put.default, T(3, 4, 2),
         [torch.tensor([[0], [2]]), torch.tensor([1, 3, 0])], T(2, 3, 2)),
    case("index_put-non-adjacent", A.index_put.default, T(3, 2, 5),
         [torch.tensor([0, 2]), None, torch.tensor([4, -1])], T(2)),
    case("index_put-kv-cache", A.index_put.default, T(1, 2, 8, 4), [None, None, torch.tensor([5, 6])], T(1, 2, 2, 4)),
    case("index_put-int", A.index_put.default, T(5, dtype=I64), [U(5, 3)], T(3, dtype=I64)),
    case("index_put-bool", A.index_put.default, T(4, 3, dtype=BOOL), [U(4, 2)], T(3, dtype=BOOL)),
    case("index_copy", A.index_copy.default, T(5, 3), 0, U(5, 3), T(3, 3)),
    case("index_copy-neg-dim", A.index_copy.default, T(2, 5), -1, U(5, 2), T(2, 2)),
    case("scatter", A.scatter.src, T(3, 5), 1, torch.stack([U(5, 3) for _ in range(2)]), T(2, 4)),
    case("scatter-dim0", A.scatter.src, T(4, 3), 0, torch.stack([U(4, 2) for _ in range(3)], 1), T(2, 3)),
    case("scatter-value", A.scatter.value, T(3, 5), -1, torch.stack([U(5, 2) for _ in range(3)]), 2.5),
    case("slice_scatter", A.slice_scatter.default, T(7, 3), T(3, 3), 0, 1, 7, 2),
    case("slice_scatter-neg", A.slice_scatter.default, T(3, 7), T(3, 2), -1, -3, -1),
    case("slice_scatter-default", A.slice_scatter.default, T(3, 5), T(3, 5)),
    case("slice_scatter-step3", A.slice_scatter.default, T(2, 8), T(2, 3), 1, 0, None, 3),
    case("select_scatter", A.select_scatter.default, T(3, 5), T(5), 0, 1),
    # empty and 0-dim
    case("cat-zero-rows", A.cat.default, [T(2, 3), T(0, 3), T(1, 3)]),
    case("index_select-empty", A.index_select.default, T(5, 3), 0, I(0, high=5)),
    case("gather-0d", A.gather.default, torch.tensor(2.5), 0, torch.tensor(0)),
    case("gather-empty", A.gather.default, T(3, 5), 1, I(3, 0, high=5)),
    case("repeat-0", A.repeat.default, T(2, 3), [0, 2]),
    case("repeat_interleave-0", A.repeat_interleave.self_int, T(2, 3), 0, 1),
    case("index_put-empty", A.index_put.default, T(5, 3), [I(0, high=5)], T(1)),
    case("index-empty", A.index.Tensor, T(5, 3), [I(0, high=5)]),
    case("take-empty", A.take.default, T(5, 3), I(0, high=5)),
    case("permute-0d", A.permute.default, torch.tensor(1.5), []),
    case("view-0d", A.view.default, torch.tensor(1.5), [1, 1]),
    case("expand-0d", A.expand.default, torch.tensor(1.5), [3]),
    case("roll-size-1", A.roll.default, T(1, 3), [2], [0]),
    case("select_scatter-neg", A.select_scatter.default, T(3, 5, 2), T(3, 2), -2, -1),
]

_PUSH_FROM_PULL = {
    "view-split-merge", "view-merge", "view_copy", "_unsafe_view", "_reshape_alias", "view_as", "reshape_as",
    "alias", "detach", "reshape-1", "flatten", "unflatten", "squeeze-all",
    "unsqueeze-neg", "permute", "permute-neg-int", "permute-bool", "permute_copy", "transpose-neg",
    "swapaxes", "t", "t-1d", "clone", "contiguous", "_to_copy", "lift_fresh_copy",
    "cat", "cat-neg-dim", "cat-legacy-empty", "cat-bool", "stack", "stack-neg", "stack-mid",
    "split", "split-neg-dim", "split-sizes", "split_copy", "split_with_sizes", "split_with_sizes_copy",
    "chunk", "chunk-fewer", "unbind", "unbind-neg-1", "unbind_copy",
    "index_put", "index_put-middle", "index_put-two", "index_put-kv-cache", "index_put-int",
    "index_copy", "index_copy-neg-dim", "slice_scatter", "slice_scatter-neg", "slice_scatter-default",
    "slice_scatter-step3", "select_scatter", "select_scatter-neg",
}
PUSH_CASES = [p for p in PULL_CASES if p.id in _PUSH_FROM_PULL] + [
    case("scatter-src-as-index", A.scatter.src, T(3, 5), 1, torch.stack([U(5, 3) for _ in range(3)]), T(3, 3)),
    case("scatter-dim0", A.scatter.src, T(4, 3), 0, torch.stack([U(4, 2) for _ in range(3)], 1), T(2, 3)),
    case("index_put-non-adjacent", A.index_put.default, T(3, 2, 5),
         [torch.tensor([0, 2]), None, torch.tensor([4, -1])], T(2, 2)),
    case("index_put-neg-full", A.index_put.default, T(5, 3), [U(5, 3) - 5], T(3, 3)),
]
