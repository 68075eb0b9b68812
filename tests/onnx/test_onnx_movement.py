"""Every ONNX data-movement op, on random shapes and attributes, against onnxruntime.

Each case also checks that the op was lowered to ATen *movement* nodes that the
plan made virtual (fate "virtual", "view" or "gather", never "kept"), and that
plan="none" keeps them physical with the same results.
"""
from __future__ import annotations

import numpy as np
import pytest

from onnx_helpers import assert_virtual_movement, check, fates, model, node

SEEDS = range(4)
BIG = np.iinfo(np.int64).max


def rng_of(seed: int, salt: str) -> np.random.Generator:
    return np.random.default_rng([seed, sum(map(ord, salt))])


def randn(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def rand_shape(rng, lo=1, hi=4, size_lo=1, size_hi=5):
    return tuple(int(s) for s in rng.integers(size_lo, size_hi + 1, size=int(rng.integers(lo, hi + 1))))


def i64(*v):
    return np.array(v, dtype=np.int64)


def run_case(m, feeds, allow=(), onnx_name="op"):
    c = check(m, feeds)
    assert_virtual_movement(c, onnx_name, allow)
    none = c.replan(plan="none")
    assert set(fates(none, onnx_name).values()) == {"kept"}
    got = none(feeds)
    for a, b in zip(got, c(feeds)):
        np.testing.assert_array_equal(a, b)
    return c


@pytest.mark.parametrize("seed", SEEDS)
def test_transpose(seed):
    rng = rng_of(seed, "transpose")
    shape = rand_shape(rng, 2, 5)
    x = randn(rng, shape)
    perm = [int(p) for p in rng.permutation(len(shape))]
    attrs = {"perm": perm} if seed % 2 == 0 else {}
    c = run_case(model([node("Transpose", ["x"], ["y"], **attrs)], {"x": x}, ["y"]), {"x": x})
    assert [n.op for n in c.graph.nodes] == ["aten.permute.default"]


@pytest.mark.parametrize("seed", SEEDS)
def test_reshape(seed):
    rng = rng_of(seed, "reshape")
    shape = list(rand_shape(rng, 2, 4, 1, 4))
    x = randn(rng, shape)
    target = list(shape)
    k = int(rng.integers(0, len(target) - 1))  # merge two adjacent dims
    target[k:k + 2] = [target[k] * target[k + 1]]
    if rng.random() < 0.5:
        target.append(1)
    target[int(rng.integers(0, len(target)))] = -1
    if target[0] == shape[0] and target[0] != -1:
        target[0] = 0  # copy dim 0 from the input
    m = model([node("Reshape", ["x", "s"], ["y"])], {"x": x}, ["y"], {"s": i64(*target)})
    c = run_case(m, {"x": x})
    assert [n.op for n in c.graph.nodes] == ["aten.view.default"]


@pytest.mark.parametrize("seed", SEEDS)
def test_flatten_squeeze_unsqueeze(seed):
    rng = rng_of(seed, "flatten")
    shape = list(rand_shape(rng, 2, 4))
    shape.insert(int(rng.integers(0, len(shape) + 1)), 1)
    x = randn(rng, shape)
    r = len(shape)
    axis = int(rng.integers(-r, r + 1))
    c = run_case(model([node("Flatten", ["x"], ["y"], axis=axis)], {"x": x}, ["y"]), {"x": x})
    ones = [k for k, s in enumerate(shape) if s == 1]
    sq = model([node("Squeeze", ["x", "a"], ["y"])], {"x": x}, ["y"], {"a": i64(ones[0] - r)})
    run_case(sq, {"x": x})
    run_case(model([node("Squeeze", ["x"], ["y"])], {"x": x}, ["y"]), {"x": x})  # every size-1 dim
    axes = sorted({int(a) for a in rng.integers(-(r + 2), r + 2, size=2)})
    un = model([node("Unsqueeze", ["x", "a"], ["y"])], {"x": x}, ["y"], {"a": i64(*axes)})
    c = run_case(un, {"x": x})
    assert c.graph.nodes[0].op == "aten.view.default"


@pytest.mark.parametrize("seed", range(6))
def test_slice(seed):
    rng = rng_of(seed, "slice")
    shape = rand_shape(rng, 1, 4, 1, 7)
    x = randn(rng, shape)
    r = len(shape)
    axes = [int(a) for a in rng.permutation(r)[: int(rng.integers(1, r + 1))]]
    starts, ends, steps = [], [], []
    for a in axes:
        n = shape[a]
        step = int(rng.choice([1, 2, 3, -1, -2]))
        s = int(rng.integers(-n - 2, n + 2))
        e = int(rng.choice([int(rng.integers(-n - 2, n + 2)), BIG if step > 0 else -BIG]))
        starts.append(s), ends.append(e), steps.append(step)
    axes = [a - r if rng.random() < 0.3 else a for a in axes]
    m = model([node("Slice", ["x", "s", "e", "a", "t"], ["y"])], {"x": x}, ["y"],
              {"s": i64(*starts), "e": i64(*ends), "a": i64(*axes), "t": i64(*steps)})
    c = run_case(m, {"x": x})
    assert {n.op for n in c.graph.nodes} <= {"aten.slice.Tensor", "aten.index_select.default", "aten.alias.default"}


def test_slice_negative_step_full_reverse():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    m = model([node("Slice", ["x", "s", "e", "a", "t"], ["y"])], {"x": x}, ["y"],
              {"s": i64(-1), "e": i64(-BIG), "a": i64(2), "t": i64(-1)})
    c = run_case(m, {"x": x})
    assert "aten.index_select.default" in [n.op for n in c.graph.nodes]


@pytest.mark.parametrize("seed", SEEDS)
def test_split(seed):
    rng = rng_of(seed, "split")
    shape = rand_shape(rng, 1, 3, 2, 7)
    x = randn(rng, shape)
    axis = int(rng.integers(0, len(shape)))
    n = shape[axis]
    if seed % 2:  # opset 13: sizes as an input
        cut = sorted({int(v) for v in rng.integers(1, n, size=2)}) if n > 1 else []
        sizes = np.diff([0, *cut, n]).astype(np.int64)
        outs = [f"y{k}" for k in range(len(sizes))]
        m = model([node("Split", ["x", "s"], outs, axis=axis - len(shape))], {"x": x}, outs, {"s": sizes}, opset=13)
    else:  # opset 18: num_outputs, uneven last chunk
        num = int(rng.integers(1, n + 1))
        outs = [f"y{k}" for k in range(num)]
        if -(-n // num) * (num - 1) >= n:  # not a valid uneven split: use equal chunks
            num = 1
            outs = ["y0"]
        m = model([node("Split", ["x"], outs, axis=axis, num_outputs=num)], {"x": x}, outs)
    c = run_case(m, {"x": x})
    assert c.graph.nodes[0].op == "aten.split_with_sizes.default"


@pytest.mark.parametrize("seed", SEEDS)
def test_concat(seed):
    rng = rng_of(seed, "concat")
    shape = list(rand_shape(rng, 1, 4))
    axis = int(rng.integers(0, len(shape)))
    parts, feeds, inits = [], {}, {}
    for k in range(int(rng.integers(2, 4))):
        s = list(shape)
        s[axis] = int(rng.integers(1, 4))
        (inits if k == 1 else feeds)[f"x{k}"] = randn(rng, s)
        parts.append(f"x{k}")
    m = model([node("Concat", parts, ["y"], axis=axis - len(shape) if seed % 2 else axis)], feeds, ["y"], inits)
    c = run_case(m, feeds)
    assert c.graph.nodes[0].op == "aten.cat.default"


@pytest.mark.parametrize("seed", SEEDS)
def test_expand_and_tile(seed):
    rng = rng_of(seed, "expand")
    shape = [int(s) if rng.random() < 0.5 else 1 for s in rand_shape(rng, 1, 3)]
    x = randn(rng, shape)
    target = [int(rng.integers(2, 4)) if s == 1 else (s if rng.random() < 0.7 else 1) for s in shape]
    target = [int(rng.integers(1, 3))] * int(rng.integers(0, 2)) + target
    run_case(model([node("Expand", ["x", "s"], ["y"])], {"x": x}, ["y"], {"s": i64(*target)}), {"x": x})
    reps = [int(v) for v in rng.integers(1, 4, size=len(shape))]
    c = run_case(model([node("Tile", ["x", "r"], ["y"])], {"x": x}, ["y"], {"r": i64(*reps)}), {"x": x})
    assert c.graph.nodes[0].op == "aten.repeat.default"


@pytest.mark.parametrize("seed", SEEDS)
def test_gather(seed):
    rng = rng_of(seed, "gather")
    shape = rand_shape(rng, 1, 3, 2, 5)
    x = randn(rng, shape)
    axis = int(rng.integers(0, len(shape)))
    n = shape[axis]
    ishape = [(), (3,), (2, 3)][seed % 3]
    idx = rng.integers(-n, n, size=ishape).astype(np.int64)
    # constant indices (negative ones normalised): select / index_select / index
    c = run_case(model([node("Gather", ["x", "i"], ["y"], axis=axis)], {"x": x}, ["y"], {"i": idx}), {"x": x})
    expect = {0: "aten.select.int", 1: "aten.index_select.default", 2: "aten.index.Tensor"}[len(ishape)]
    assert c.graph.nodes[0].op == expect
    # runtime indices (negative values wrap): index.Tensor
    feeds = {"x": x, "i": idx}
    c = run_case(model([node("Gather", ["x", "i"], ["y"], axis=axis - len(shape))], feeds, ["y"]), feeds)
    assert c.graph.nodes[0].op == "aten.index.Tensor"


def test_gather_embedding_table():
    rng = rng_of(0, "embed")
    table = randn(rng, (10, 4))
    ids = rng.integers(0, 10, size=(2, 3)).astype(np.int64)
    c = run_case(model([node("Gather", ["w", "ids"], ["y"])], {"ids": ids}, ["y"], {"w": table}), {"ids": ids})
    assert c.graph.consts[0].shape == (10, 4)


@pytest.mark.parametrize("seed", SEEDS)
def test_gather_elements(seed):
    rng = rng_of(seed, "gather_elements")
    shape = rand_shape(rng, 1, 3, 2, 5)
    x = randn(rng, shape)
    axis = int(rng.integers(0, len(shape)))
    ishape = [int(rng.integers(1, s + 1)) for s in shape]
    ishape[axis] = int(rng.integers(1, 6))
    idx = rng.integers(-shape[axis], shape[axis], size=ishape).astype(np.int64)
    run_case(model([node("GatherElements", ["x", "i"], ["y"], axis=axis)], {"x": x}, ["y"], {"i": idx}), {"x": x})
    feeds = {"x": x, "i": idx}
    c = run_case(model([node("GatherElements", ["x", "i"], ["y"], axis=axis)], feeds, ["y"]), feeds,
                 allow=("aten.remainder.Scalar",))
    assert [n.op for n in c.graph.nodes][-1] == "aten.gather.default"


@pytest.mark.parametrize("seed", SEEDS)
def test_gather_nd(seed):
    rng = rng_of(seed, "gather_nd")
    b = seed % 2
    shape = (3, 4, 5, 2)
    x = randn(rng, shape)
    k = int(rng.integers(1, 3))
    ishape = ([shape[0]] if b else []) + [2] + [k]
    idx = np.stack([rng.integers(-shape[b + j], shape[b + j], size=ishape[:-1]) for j in range(k)], -1)
    feeds = {"x": x, "i": idx.astype(np.int64)}
    c = run_case(model([node("GatherND", ["x", "i"], ["y"], batch_dims=b)], feeds, ["y"]), feeds)
    assert c.graph.nodes[-1].op == "aten.index.Tensor"


@pytest.mark.parametrize("seed", SEEDS)
def test_scatter_nd(seed):
    rng = rng_of(seed, "scatter_nd")
    shape = (6, 3, 4)
    data = randn(rng, shape)
    k = 1 + seed % 2
    flat = rng.permutation(int(np.prod(shape[:k])))[:3]  # unique positions
    idx = np.stack(np.unravel_index(flat, shape[:k]), -1).astype(np.int64)
    upd = randn(rng, (3, *shape[k:]))
    feeds = {"d": data, "i": idx, "u": upd}
    c = run_case(model([node("ScatterND", ["d", "i", "u"], ["y"])], feeds, ["y"]), feeds)
    assert c.graph.nodes[-1].op == "aten.index_put.default"


@pytest.mark.parametrize("seed", SEEDS)
def test_scatter_elements(seed):
    rng = rng_of(seed, "scatter_elements")
    shape = (4, 5)
    axis = seed % 2
    data = randn(rng, shape)
    other = 1 - axis
    m_ = int(rng.integers(1, shape[axis] + 1))
    idx = np.stack([rng.permutation(shape[axis])[:m_] for _ in range(shape[other])], other)  # unique per line
    idx = (idx - shape[axis] * (rng.random(idx.shape) < 0.3)).astype(np.int64)  # some negative
    upd = randn(rng, idx.shape)
    run_case(model([node("ScatterElements", ["d", "i", "u"], ["y"], axis=axis)], {"d": data, "u": upd}, ["y"],
                   {"i": idx}), {"d": data, "u": upd})


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "wrap"])
@pytest.mark.parametrize("seed", range(3))
def test_pad(mode, seed):
    rng = rng_of(seed, "pad" + mode)
    shape = rand_shape(rng, 1, 4, 3, 5)
    x = randn(rng, shape)
    r = len(shape)
    pads = [int(v) for v in rng.integers(-1 if mode == "constant" else 0, 3, size=2 * r)]
    inits = {"p": i64(*pads), "v": np.array(1.5, dtype=np.float32)}
    ins = ["x", "p", "v"] if mode == "constant" else ["x", "p"]
    c = run_case(model([node("Pad", ins, ["y"], mode=mode)], {"x": x}, ["y"], inits), {"x": x})
    if mode == "constant":
        assert c.graph.nodes[0].op == "aten.constant_pad_nd.default"
    # opset 18: pads of some axes only
    a = int(rng.integers(0, r))
    m = model([node("Pad", ["x", "p", "", "a"], ["y"], mode=mode)], {"x": x}, ["y"],
              {"p": i64(1, 2), "a": i64(a - r)})
    run_case(m, {"x": x})


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_and_back(mode):
    rng = rng_of(0, mode)
    x = randn(rng, (2, 12, 3, 4))
    c = run_case(model([node("DepthToSpace", ["x"], ["y"], blocksize=2, mode=mode)], {"x": x}, ["y"]), {"x": x})
    if mode == "CRD":
        assert c.graph.nodes[0].op == "aten.pixel_shuffle.default"
    y = randn(rng, (2, 3, 4, 6))
    run_case(model([node("SpaceToDepth", ["y"], ["z"], blocksize=2)], {"y": y}, ["z"]), {"y": y})


def test_identity_and_dropout():
    x = randn(rng_of(0, "id"), (3, 4))
    c = run_case(model([node("Identity", ["x"], ["y"])], {"x": x}, ["y"]), {"x": x})
    assert c.graph.nodes[0].op == "aten.alias.default"
    run_case(model([node("Dropout", ["x"], ["y"])], {"x": x}, ["y"]), {"x": x})


CTMS = ["half_pixel", "asymmetric", "pytorch_half_pixel", "align_corners"]
NEAREST = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]


@pytest.mark.parametrize("ctm", CTMS)
def test_resize_nearest(ctm):
    for k, mode in enumerate(NEAREST):
        rng = rng_of(k, ctm + mode)
        x = randn(rng, (1, 2, int(rng.integers(2, 7)), int(rng.integers(2, 7))))
        attrs = dict(mode="nearest", coordinate_transformation_mode=ctm, nearest_mode=mode)
        if k % 2:  # sizes (up and down)
            sizes = i64(1, 2, int(rng.integers(1, 10)), int(rng.integers(1, 10)))
            m = model([node("Resize", ["x", "", "", "sz"], ["y"], **attrs)], {"x": x}, ["y"], {"sz": sizes},
                      opset=19)
        else:  # scales, not integers
            scales = np.array([1, 1, rng.choice([0.5, 0.75, 1.5, 2.0, 2.5, 3.0]), rng.choice([0.6, 1.7, 2.0])],
                              dtype=np.float32)
            m = model([node("Resize", ["x", "", "sc"], ["y"], **attrs)], {"x": x}, ["y"], {"sc": scales},
                      opset=19)
        c = run_case(m, {"x": x})
        assert {n.op for n in c.graph.nodes} <= {"aten.index_select.default", "aten.alias.default"}


def test_resize_unchanged_shape_and_other_modes():
    x = randn(rng_of(0, "resize2"), (1, 2, 3, 4))
    # no dim changes size: onnxruntime copies the input whatever the scales
    m = model([node("Resize", ["x", "", "sc"], ["y"], mode="nearest")], {"x": x}, ["y"],
              {"sc": np.array([1, 1, 1.2, 1.1], dtype=np.float32)}, opset=19)
    run_case(m, {"x": x})
    # linear interpolation and half_pixel_symmetric run through onnxruntime
    for attrs in ({"mode": "linear"}, {"mode": "nearest", "coordinate_transformation_mode": "half_pixel_symmetric"}):
        m = model([node("Resize", ["x", "", "sc"], ["y"], **attrs)], {"x": x}, ["y"],
                  {"sc": np.array([1, 1, 2.5, 1.5], dtype=np.float32)}, opset=19)
        c = check(m, {"x": x})
        assert c.report.fallback_ops == ["onnx.Resize"]


def test_resize_axes_and_aspect_ratio():
    x = randn(rng_of(0, "resize"), (1, 3, 5, 7))
    for policy in ("not_larger", "not_smaller"):
        m = model([node("Resize", ["x", "", "", "sz"], ["y"], mode="nearest", axes=[2, 3],
                        keep_aspect_ratio_policy=policy)], {"x": x}, ["y"], {"sz": i64(9, 9)}, opset=18)
        run_case(m, {"x": x})


def test_movement_chain_is_one_mapping():
    """Transpose -> Reshape -> Slice -> Gather: the plan eliminates all but the realised end."""
    rng = rng_of(0, "chain")
    x = randn(rng, (2, 3, 4, 5))
    nodes = [node("Transpose", ["x"], ["t"], name="t", perm=[0, 2, 1, 3]),
             node("Reshape", ["t", "s"], ["r"], name="r"),
             node("Slice", ["r", "b", "e", "a", "st"], ["sl"], name="sl"),
             node("Gather", ["sl", "i"], ["g"], name="g", axis=1),
             node("Relu", ["g"], ["y"], name="relu")]
    inits = {"s": i64(2, 12, 5), "b": i64(1), "e": i64(BIG), "a": i64(1), "st": i64(2), "i": i64(0, 2, -1)}
    m = model(nodes, {"x": x}, ["y"], inits)
    c = check(m, {"x": x})
    r = c.report
    assert r.movement_ops == 4 and r.eliminated_movement_ops >= 3, r.summary()
    assert len(r.chains) == 1 and r.chains[0].ops == ["permute", "view", "slice", "index_select"]
    check(m, {"x": x}, oracle=True)
    r = check(m, {"x": x}, backend="cpu").report  # the generated kernel reads through the composed mapping
    assert r.eliminated_movement_ops == 4 and r.materialized_movement_bytes == 0, r.summary()
