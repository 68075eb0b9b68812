"""vtc.compile on real architectures, checked against eager; the report states what was removed."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.utils._pytree as pytree

import vtc
from vtc import zoo

MODELS = ("llama", "gpt2", "gemma2", "swin", "shufflenet", "llama_layer")
TOL = dict(rtol=1e-4, atol=1e-4)


def assert_same(got, want):
    """Same pytree structure and types, tensors close within TOL."""
    assert type(got) is type(want), (type(got), type(want))
    g, gs = pytree.tree_flatten(got)
    w, ws = pytree.tree_flatten(want)
    assert gs == ws
    for a, b in zip(g, w):
        if isinstance(b, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b, **TOL)


@pytest.fixture(scope="module", params=MODELS)
def model_case(request):
    torch.manual_seed(0)
    model, inputs = zoo.load(request.param, size="tiny")
    for t in inputs:  # random inputs, never all zeros
        assert t.float().abs().sum() > 0
    with torch.no_grad():
        want = model(*inputs)
    return request.param, model, inputs, want, vtc.compile(model, inputs)


@pytest.mark.parametrize("options", [{}, {"oracle": True}, {"plan": "none"}], ids=["all", "oracle", "none"])
def test_model_matches_eager(model_case, options):
    name, model, inputs, want, compiled = model_case
    compiled = compiled.replan(**options)  # same captured graph, other plan
    with torch.no_grad():
        got = compiled(*inputs)
    assert_same(got, want)
    r = compiled.report.to_dict()
    for key in ("movement_ops", "eliminated_movement_ops", "materialized_movement_bytes", "kernels",
                "fallback_ops", "peak_memory_bytes"):
        assert key in r
    assert r["movement_ops"] > 0
    if options.get("plan") == "none":
        assert r["eliminated_movement_ops"] == 0
    elif not options.get("oracle"):
        assert r["eliminated_movement_ops"] > r["movement_ops"] // 2, compiled.report.summary()


def test_plan_all_moves_less_than_none(model_case):
    name, model, inputs, _, compiled = model_case
    every = compiled.report
    none = compiled.replan(plan="none").report
    assert every.materialized_movement_bytes < none.materialized_movement_bytes
    assert every.peak_memory_bytes <= none.peak_memory_bytes
    assert every.kernels < none.kernels


def test_llama_returns_model_output():
    model, inputs = zoo.load("llama", size="tiny")
    out = vtc.compile(model, inputs)(*inputs)
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert out.logits.shape == (*inputs[0].shape, model.config.vocab_size)


def test_pure_view_chain_is_free():
    """transpose -> reshape-as-view -> slice feeding mm: a strided view, no bytes moved."""
    def f(x, w):
        return x.t()[1:, :].unsqueeze(0).squeeze(0) @ w

    x, w = torch.randn(6, 9), torch.randn(6, 4)
    c = vtc.compile(f, (x, w))
    torch.testing.assert_close(c(x, w), f(x, w), **TOL)
    r = c.report.to_dict()
    assert r["materialized_movement_bytes"] == 0
    assert r["eliminated_movement_ops"] == r["movement_ops"] >= 3
    assert [ch["strided"] for ch in r["chains"]] == [True]


def test_non_view_chain_is_one_gather_or_none():
    """permute -> reshape (not a view) -> cat -> pad -> relu: one gather with torch, no movement with kernels."""
    def f(x, y):
        z = torch.cat([x.permute(1, 0, 2).reshape(4, 6), y], 0)
        return torch.nn.functional.pad(z, (1, 2)).relu()

    x, y = torch.randn(2, 4, 3), torch.randn(5, 6)
    c = vtc.compile(f, (x, y), backend="torch")
    torch.testing.assert_close(c(x, y), f(x, y), **TOL)
    r = c.report.to_dict()
    assert [ch["realized_as"] for ch in r["chains"]] == ["gather"]
    assert r["materialized_movement_bytes"] == 9 * 9 * 4  # only the final padded tensor is written
    assert r["kernels"] == 2  # one gather + relu

    c = vtc.compile(f, (x, y))  # generated kernels: relu reads through the composed mapping
    torch.testing.assert_close(c(x, y), f(x, y), **TOL)
    r = c.report.to_dict()
    assert r["materialized_movement_bytes"] == 0 and r["chains"] == []
    assert r["kernels"] == 1 and r["eliminated_movement_ops"] == r["movement_ops"] == 5


def test_wrong_inputs_raise_with_expected_and_received():
    model, inputs = zoo.load("llama", size="tiny")
    c = vtc.compile(model, inputs)
    with pytest.raises(ValueError, match="(?s)do not match the captured structure:.*expected.*received"):
        c(inputs[0], inputs[0])
    with pytest.raises(TypeError, match="expected dtype torch.int64, received torch.float32"):
        c(inputs[0].float())
    with pytest.raises(ValueError, match=r"expected rank 2.*received rank 3"):
        c(inputs[0][None])


def test_new_shape_of_same_rank_respecializes():
    model, inputs = zoo.load("llama", size="tiny")
    c = vtc.compile(model, inputs)
    longer = torch.randint(1, model.config.vocab_size, (inputs[0].shape[0], inputs[0].shape[1] + 3))
    with torch.no_grad():
        assert_same(c(longer), model(longer))
        assert_same(c(*inputs), model(*inputs))


def test_unknown_option_names_valid_ones():
    with pytest.raises(TypeError, match="unknown vtc.compile option.*'plna'.*valid options"):
        vtc.compile(lambda x: x + 1, (torch.randn(2),), plna="all")
    with pytest.raises(ValueError, match="plan='fast' is not one of"):
        vtc.compile(lambda x: x + 1, (torch.randn(2),), plan="fast")


def test_out_of_range_gather_index_raises():
    def f(w, idx):
        return torch.nn.functional.embedding(idx, w) * 2

    w, idx = torch.randn(10, 4), torch.tensor([[1, 2], [3, 4]])
    c = vtc.compile(f, (w, idx))
    torch.testing.assert_close(c(w, idx), f(w, idx))
    with pytest.raises(IndexError, match="embedding: index 10 is out of range"):
        c(w, torch.tensor([[1, 10], [3, 4]]))


def test_threads_share_a_compiled_model():
    model, inputs = zoo.load("gpt2", size="tiny")
    c = vtc.compile(model, inputs)
    xs = [torch.randint(0, model.config.vocab_size, inputs[0].shape) for _ in range(4)]
    with torch.no_grad():
        want = [model(x).logits for x in xs]
    got: dict[int, torch.Tensor] = {}

    def work(k):
        for _ in range(3):
            got[k] = c(xs[k]).logits

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        torch.testing.assert_close(got[k], want[k], **TOL)


def test_kv_cache_update_then_attention():
    """StaticCache-style index_copy into the cache, GQA expand, scores: read through one composed mapping."""
    def f(q, cache, k_new, pos):
        cache = cache.index_copy(2, pos, k_new)  # [B, KV, T, D]
        k = cache[:, :, None].expand(1, 2, 2, 16, 8).reshape(1, 4, 16, 8)  # repeat_kv
        return torch.softmax(q @ k.transpose(-1, -2), -1)

    q, cache, k_new = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 1, 8)
    pos = torch.tensor([5])
    c = vtc.compile(f, (q, cache, k_new, pos))
    for p in (5, 0, 15):
        torch.testing.assert_close(c(q, cache, k_new, torch.tensor([p])), f(q, cache, k_new, torch.tensor([p])), **TOL)
    r = c.report.to_dict()
    assert r["fallback_ops"] == [] and r["movement_ops"] >= 5
    # the updated, expanded, transposed cache is packed by the generated scores GEMM: nothing gathered
    assert [g["choice"] for g in r["gemm"]] == ["vtc"] and r["materialized_movement_bytes"] == 0
    with pytest.raises(IndexError, match="index_put: index 16 is out of range"):
        c(q, cache, k_new, torch.tensor([16]))
    lib = c.replan(gemm="torch")  # torch's bmm needs it in memory: one gather of the whole chain
    torch.testing.assert_close(lib(q, cache, k_new, pos), f(q, cache, k_new, pos), **TOL)
    # one copy of the chain: a gather, or (session 17) a kept op's copy kernel reading through the index_put
    # (index_copy decomposes to index_put), whose range check it keeps
    gathered = [ch["ops"][0] for ch in lib.report.to_dict()["chains"] if ch["realized_as"] == "gather"]
    steps = [s.kernel.step for s in lib._first.executor.steps if s.kind == "kernel"]
    through = [st.kernel.name for st in steps if st.kernel.kind == "move" and (st.checks or st.derived)]
    assert gathered == ["index_put"] or (not gathered and len(through) == 1), (gathered, through)
    assert lib.report.to_dict()["materialized_movement_bytes"] == 4 * 16 * 8 * 4
    with pytest.raises(IndexError, match="index_put: index 16 is out of range"):
        lib(q, cache, k_new, torch.tensor([16]))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_flip_is_never_a_negative_stride_view(backend):
    x = torch.randn(3, 5)
    for f in (lambda x: x.flip(-1), lambda x: x.flip(0) * 2):
        torch.testing.assert_close(vtc.compile(f, (x,), backend=backend)(x), f(x))


def test_index_put_with_index_tensors_that_are_views():
    """The index tensors are themselves virtual (columns of idx): realised before the kernel, kept alive."""
    def f(d, idx, u):
        return torch.index_put(d, (idx[:, 0], idx[:, 1]), u) * 2

    d, idx, u = torch.randn(5, 6), torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.randn(3)
    c = vtc.compile(f, (d, idx, u), plan="all")  # the greedy runs so small an update through torch (cheaper
    torch.testing.assert_close(c(d, idx, u), f(d, idx, u))  # than deriving its inverse for the kernel)
    with pytest.raises(IndexError, match="index_put: index 5 is out of range"):
        c(d, torch.tensor([[0, 1], [5, 3], [4, 5]]), u)
    greedy = c.replan(plan="greedy")
    torch.testing.assert_close(greedy(d, idx, u), f(d, idx, u))
    with pytest.raises(IndexError, match="index 5 is out of"):
        greedy(d, torch.tensor([[0, 1], [5, 3], [4, 5]]), u)


def test_an_op_without_a_generated_kernel_warns_and_is_in_the_report():
    x = torch.randn(4, 17)
    with pytest.warns(vtc.FallbackWarning, match=r"1 op\(s\) .* aten\.median\.dim"):
        compiled = vtc.compile(lambda a: a.median(-1).values * 2 + a.sum(-1), (x,))
    assert compiled.report.to_dict()["fallback_ops"] == ["aten.median.dim"]
    torch.testing.assert_close(compiled(x), x.median(-1).values * 2 + x.sum(-1), **TOL)


def test_a_model_that_vtc_lowers_whole_does_not_warn():
    import warnings

    x = torch.randn(4, 17)
    with warnings.catch_warnings():
        warnings.simplefilter("error", vtc.FallbackWarning)
        compiled = vtc.compile(lambda a: (a.softmax(-1) * 2).t() + 1, (x,))
    assert compiled.report.to_dict()["fallback_ops"] == []


def test_one_tensor_given_twice_as_example_inputs_stays_two_inputs():
    class Sub(torch.nn.Module):
        def forward(self, x, y):
            return x - y

    x = torch.randn(2, 3)
    compiled = vtc.compile(Sub(), (x, x))  # e.g. self-attention compiled as mha(x, x, x)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(compiled(a, b), a - b, **TOL)


def test_a_buffer_of_the_model_given_as_example_input_stays_an_input():
    class Shift(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("pos", torch.randn(6))

        def forward(self, x):
            return x * 2 + self.pos

    m = Shift()
    compiled = vtc.compile(m, (m.pos,))
    x = torch.randn(6)
    torch.testing.assert_close(compiled(x), m(x), **TOL)


def test_a_tensor_on_another_device_raises_naming_the_device():
    compiled = vtc.compile(lambda x: torch.nn.functional.gelu(x) * 2, (torch.randn(4, 8),))
    with pytest.raises(TypeError, match="input 0 .* compiled this graph for the CPU, received a tensor on meta"):
        compiled(torch.empty(4, 8, device="meta"))  # the kernels would read its null data pointer


def test_threads_bringing_new_sizes_at_once_capture_one_at_a_time():
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Softmax(-1)).eval()
    compiled = vtc.compile(m, (torch.randn(2, 64, 16),))
    inputs = {s: torch.randn(2, s, 16) for s in (40, 24, 33)}
    results: dict[int, object] = {}

    def call(s):
        try:
            with torch.no_grad():
                results[s] = compiled(inputs[s])
        except Exception as e:  # noqa: BLE001 - reported below
            results[s] = e

    threads = [threading.Thread(target=call, args=(s,)) for s in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with torch.no_grad():
        for s, x in inputs.items():
            assert isinstance(results[s], torch.Tensor), f"S={s}: {results[s]!r}"
            torch.testing.assert_close(results[s], m(x), **TOL)
    assert type(m[0].weight) is torch.nn.Parameter and type(m[0].weight.data) is torch.Tensor  # no fake left


def test_a_wrong_static_size_raises_one_value_error_naming_input_dim_expected_and_received(capfd):
    torch.manual_seed(4)
    m = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval()
    compiled = vtc.compile(m, (torch.randn(4, 16),))
    capfd.readouterr()
    with pytest.raises(ValueError, match=r"^input 0 \(%input_1\): dim 1 is 17, expected 16 \(compiled for shape "
                                         r"\[4, 16\], received \[4, 17\]\); the model does not run with the new "
                                         r"sizes: RuntimeError: .*\[4, 17\] X \[16, 8\]") as info:
        compiled(torch.randn(4, 17))
    assert isinstance(info.value, vtc.InputShapeError) and isinstance(info.value, vtc.CaptureError)
    assert "\n" not in str(info.value)
    assert "fake_tensor" not in "".join(capfd.readouterr())  # no traceback logged by torch's fake tensors
    x = torch.randn(6, 16)  # a size the model runs with is still fine
    torch.testing.assert_close(compiled(x), m(x), **TOL)


def test_compiling_while_another_thread_runs_the_module_eagerly_leaves_the_module_untouched():
    torch.manual_seed(5)
    m = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)]).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        want = m(x)
    stop, errors = threading.Event(), []

    def eager():
        while not stop.is_set():
            try:
                with torch.no_grad():
                    got = m(x)
                if not torch.allclose(got, want):
                    errors.append("wrong result")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"{type(e).__name__}: {e}"[:200])

    t = threading.Thread(target=eager)
    t.start()
    try:
        for plan in ("greedy", "none", "greedy"):
            compiled = vtc.compile(m, (x,), plan=plan)
    finally:
        stop.set()
        t.join()
    assert errors == []
    torch.testing.assert_close(compiled(x), want, **TOL)
    assert all(type(p) is torch.nn.Parameter and type(p.data) is torch.Tensor for p in m.parameters())
