"""A new length of a decode loop (a cache that grows by one token per step) is an instantiation of the symbolic
graph: what does not depend on the length is not worked out again.

- a kernel whose IR is the previous specialization's (the MLP, the norms, the projections) takes that source,
  without generating it again; a size-free kernel built once is not built (or looked up on disk) again;
- the plan's mappings of movement nodes whose op, arguments and shapes did not change are reused
  (``plan_keeping(memo=...)``), and equal those composed afresh;
- results are bit-identical to a fresh compile at that length and close to eager.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree

import vtc
import vtc.codegen.cpp
import vtc.runtime.executor
from vtc.plan.virtualize import plan_keeping
from vtc.runtime import generic

TOL = dict(rtol=1e-4, atol=1e-4)
pytestmark = pytest.mark.filterwarnings("ignore::vtc.NewSizesWarning")  # a new length per call, on purpose


@pytest.fixture(autouse=True)
def _fresh_templates():
    generic._TEMPLATES.clear()
    generic._SIZE_FREE.clear()
    yield
    generic._TEMPLATES.clear()
    generic._SIZE_FREE.clear()


class _Counter:
    """Counts calls of cpp.generate and of executor.build_kernels (the constant kernels' build)."""

    def __init__(self, monkeypatch):
        self.generated, self.built = 0, 0
        gen, build = vtc.codegen.cpp.generate, vtc.runtime.executor.build_kernels

        def generate(k):
            self.generated += 1
            return gen(k)

        def build_kernels(steps):
            self.built += len(steps)
            return build(steps)

        monkeypatch.setattr(vtc.codegen.cpp, "generate", generate)
        monkeypatch.setattr(vtc.runtime.executor, "build_kernels", build_kernels)

    def reset(self):
        self.generated, self.built = 0, 0


def _decode(tok, past, w1, w2):
    """A token's MLP and norm (nothing depends on the cache length) next to attention over a cat-grown cache."""
    h = torch.relu(tok @ w1) @ w2 + tok  # [B, 1, D]
    h = h / h.square().mean(-1, keepdim=True).add(1e-6).sqrt()
    kv = torch.cat([past, h], dim=1)  # [B, P+1, D]
    att = torch.softmax(h @ kv.transpose(1, 2) * 0.125, dim=-1) @ kv
    return (att @ w1) @ w2 + h, kv


def _inputs(p, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, 32, generator=g), torch.randn(2, p, 32, generator=g)


def test_a_new_length_generates_only_the_kernels_whose_ir_changed_and_builds_none(monkeypatch):
    """Before: every new length generated every kernel's source (and the size-free ones twice) and built the
    size-free kernels again (a disk-cache lookup and a library load per kernel)."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(32, 48, generator=g) / 6, torch.randn(48, 32, generator=g) / 7
    fn = lambda tok, past: _decode(tok, past, w1, w2)  # noqa: E731
    compiled = vtc.compile(fn, _inputs(9, 0))
    count = _Counter(monkeypatch)
    for p in (10, 11, 12):  # 10: the symbolic capture, fit; 11, 12: instantiations
        x = _inputs(p, p)
        for got, want in zip(compiled(*x), fn(*x)):
            torch.testing.assert_close(got, want, **TOL)
    for p in (13, 14, 15, 33, 40):
        x = _inputs(p, p)
        count.reset()
        got = compiled(*x)
        for a, b in zip(got, fn(*x)):
            torch.testing.assert_close(a, b, **TOL)
        spec = compiled._specs[next(reversed(compiled._specs))]
        n_kernels = sum(s.kind == "kernel" for s in spec.executor.steps)
        assert count.built == 0, f"length {p}: {count.built} size-free kernels built again"
        assert 0 < count.generated < n_kernels, f"length {p}: {count.generated} of {n_kernels} kernels generated"
        if p in (15, 40):  # bit-identical to a fresh compile whose first new size is this one (no memo, no
            fresh = vtc.compile(fn, _inputs(9, 0))  # previous sources)
            for a, b in zip(got, fresh(*x)):
                assert torch.equal(a, b)
    assert compiled._dynamic.sources_reused > 0 and not compiled._dynamic.why_not


def test_a_kernel_whose_ir_changed_is_generated_again(monkeypatch):
    """The previous specialization's source is taken only for an equal IR; another IR (a structure that differs
    at this size) is generated, and so matched against the templates or built, as before."""
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(32, 48, generator=g) / 6, torch.randn(48, 32, generator=g) / 7
    fn = lambda tok, past: _decode(tok, past, w1, w2)  # noqa: E731
    compiled = vtc.compile(fn, _inputs(9, 0), dynamic=True)
    compiled(*_inputs(12, 2))
    spec = compiled._specs[next(reversed(compiled._specs))]
    kstep = next(s.kernel.step for s in spec.executor.steps if s.kind == "kernel")
    k = kstep.kernel
    count = _Counter(monkeypatch)
    builder = generic.GenericKernels(("s0",), (12,), (1,), lambda s: None, lambda s: True,
                                     previous={k.name: (k, "SOURCE", None)})
    assert builder._source(copy.copy(k)) == ("SOURCE", None) and count.generated == 0  # equal IR: reused
    other = dataclasses.replace(k, domain=tuple(d + 1 for d in k.domain))
    src, _ = builder._source(other)
    assert count.generated == 1 and src != "SOURCE" and f"void {k.name}(" in src


def test_a_changed_code_generator_switch_generates_every_kernel_again(monkeypatch):
    """The same IR may generate other code under another module switch (gemm.PACKED_B changes a GEMM's calling
    convention): the previous sources are reused only under the switches they were made with."""
    import vtc.codegen.gemm

    g = torch.Generator().manual_seed(5)
    w1, w2 = torch.randn(32, 48, generator=g) / 6, torch.randn(48, 32, generator=g) / 7
    fn = lambda tok, past: _decode(tok, past, w1, w2)  # noqa: E731
    compiled = vtc.compile(fn, _inputs(9, 0))
    for p in (10, 11, 12):
        compiled(*_inputs(p, p))
    count = _Counter(monkeypatch)
    monkeypatch.setattr(vtc.codegen.gemm, "PACKED_B", not vtc.codegen.gemm.PACKED_B)
    x = _inputs(13, 13)
    for a, b in zip(compiled(*x), fn(*x)):
        torch.testing.assert_close(a, b, **TOL)
    spec = compiled._specs[next(reversed(compiled._specs))]
    assert count.generated >= sum(s.kind == "kernel" for s in spec.executor.steps)


def test_the_plan_memo_gives_the_plan_composed_afresh():
    """plan_keeping(memo=...) over a symbolic graph's instantiations equals plan_keeping without it: the same
    mappings (hash-consed, so equal structures are equal) and realizations; the nodes whose shapes changed
    (the cat, the transpose of the cache) are composed again."""
    g = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(32, 48, generator=g) / 6, torch.randn(48, 32, generator=g) / 7
    fn = lambda tok, past: _decode(tok, past, w1, w2)  # noqa: E731
    compiled = vtc.compile(fn, _inputs(9, 0))
    compiled(*_inputs(12, 2))
    dyn = compiled._dynamic
    first = dyn.first_plan
    memo: dict = {}
    reused = 0
    for p in (12, 13, 13, 20, 5, 64):
        graph = dyn.sg.instantiate(dyn.sg.bind(list(_inputs(p, 0))))
        before = {k: v for k, v in memo.items() if k != "strided"}
        got = plan_keeping(graph, first.mode, dict(first.kept), dict(first.pushed), memo=memo)
        want = plan_keeping(graph, first.mode, dict(first.kept), dict(first.pushed))
        assert got.mappings == want.mappings and got.realized == want.realized
        assert got.kept == want.kept and got.needs == want.needs and got.pushed == want.pushed
        reused += sum(before.get(k) is v for k, v in memo.items() if k != "strided")
    assert reused > 0


def test_node_inputs_are_pytrees_leaves_in_order():
    """Node.inputs walks tuples, lists and dicts itself (it is called thousands of times per lowering): the same
    Values, in the same order, as pytree.tree_leaves, namedtuples and other pytree nodes included."""
    import collections

    from vtc.ir.graph import Node, Value, _leaves

    nt = collections.namedtuple("nt", "a b")
    a, b, c = (Value(n, (2,), torch.float32) for n in "abc")
    trees = [((a, [b, {"x": c, "y": (a, 3)}], None), {"k": [b, 6]}), (torch.Size([2, 3]), nt(c, [a])),
             (collections.OrderedDict(z=b, y=a),), ([], {}, ()), ((torch.float32, "s", 1.5, c),)]
    for tree in trees:
        assert list(_leaves(tree)) == pytree.tree_leaves(tree)
    node = Node("n", torch.ops.aten.add.Tensor, (a, [b, a]), {"other": c, "alpha": nt(b, 1)},
                (Value("o", (2,), torch.float32),), "compute")
    assert [v.name for v in node.inputs] == ["a", "b", "c"]


def test_a_transformers_decode_loop_with_a_dynamic_cache_stays_right_and_builds_nothing(monkeypatch):
    """HF Llama, a DynamicCache growing every step: logits as eager's at every length; from the third new length
    on, no kernel is built and at most half the kernels are generated again (11 of 22 since vtc.dynamic folds RoPE's
    cos and sin, session 24: 12 of 25 before)."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        first = model(torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(3)))
    tok = first.logits[:, -1:].argmax(-1)
    step = vtc.compile(model, (tok,), {"cache": copy.deepcopy(first.past_key_values)})
    want_cache, got_cache = copy.deepcopy(first.past_key_values), copy.deepcopy(first.past_key_values)
    count = _Counter(monkeypatch)
    for i in range(7):
        count.reset()
        with torch.no_grad():
            want = model(tok, cache=want_cache)
        got = step(tok, cache=got_cache)
        torch.testing.assert_close(got.logits, want.logits, **TOL)
        assert got.past_key_values.get_seq_length() == 8 + i
        if i >= 3:
            n_kernels = sum(s.kind == "kernel" for s in step._specs[next(reversed(step._specs))].executor.steps)
            assert count.built == 0 and count.generated <= n_kernels / 2, (i, count.built, count.generated, n_kernels)
        want_cache, got_cache = want.past_key_values, got.past_key_values
        tok = want.logits[:, -1:].argmax(-1)
    assert step._dynamic.sources_reused > 0 and not step._dynamic.why_not


def test_a_new_length_leaves_little_cyclic_garbage():
    """Each new length used to leave thousands of objects in reference cycles (a copy of the fx graph per
    instantiation, a recursive closure per index substitution), which only the garbage collector frees: a full
    collection of a process holding torch and transformers takes ~0.3 s, and came every ~8 decode steps."""
    import gc

    g = torch.Generator().manual_seed(4)
    w1, w2 = torch.randn(32, 48, generator=g) / 6, torch.randn(48, 32, generator=g) / 7
    fn = lambda tok, past: _decode(tok, past, w1, w2)  # noqa: E731
    compiled = vtc.compile(fn, _inputs(9, 0))
    for p in (10, 11, 12):
        compiled(*_inputs(p, p))
    x = _inputs(13, 13)
    gc.collect()
    gc.disable()
    try:
        got = compiled(*x)
        garbage = gc.collect()
    finally:
        gc.enable()
    for a, b in zip(got, fn(*x)):
        torch.testing.assert_close(a, b, **TOL)
    assert garbage < 500, f"{garbage} objects in reference cycles after one new length (before: ~1900)"


def test_codegen_switches_sees_a_switch_flipped_or_added_after_a_first_call(monkeypatch):
    """codegen_switches remembers each module's upper-case names (its scan of every module's names cost ~1-2 ms
    per new length); a value flipped, a name added or removed since is still seen."""
    import vtc.codegen.gemm as gemm

    before = generic.codegen_switches()
    monkeypatch.setattr(gemm, "PACKED_B", not gemm.PACKED_B)
    assert ("vtc.codegen.gemm", "PACKED_B", gemm.PACKED_B) in generic.codegen_switches()
    monkeypatch.setattr(gemm, "A_NEW_SWITCH", 3, raising=False)
    assert ("vtc.codegen.gemm", "A_NEW_SWITCH", 3) in generic.codegen_switches()
    monkeypatch.undo()
    assert generic.codegen_switches() == before
