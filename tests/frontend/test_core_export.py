"""The one-trace core-ATen export gives the graph of export(...).run_decompositions(), op for op."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch.export import _trace

from vtc.frontend import core_export, fx_capture
from vtc.frontend.torch_export import CaptureError, export_graph, graph_from_fx
from vtc.ir.printer import print_graph
from vtc.zoo.shufflenet import shufflenet_v2

from .capture_checks import check_capture


def _graph_of(ep: torch.export.ExportedProgram):
    """The vtc graph of an ExportedProgram, as export_graph builds it (consts from the signature)."""
    from torch.export.graph_signature import InputKind

    consts = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            consts[spec.arg.name] = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[
                spec.target]
    return graph_from_fx(ep.graph_module, consts, ep.call_spec.in_spec, ep.call_spec.out_spec)


def _canonical_text(graph, model: torch.nn.Module) -> str:
    """The graph's text with nodes and their results named by position, each parameter/buffer const by the first
    state-dict name of its tensor (tied weights, e.g. Gemma-2's embedding and LM head, get either name
    from export), other consts by position; then the first values of each const."""
    first: dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        first.setdefault(t.data_ptr(), "w_" + name.replace(".", "_"))
    for k, v in enumerate(graph.consts):
        v.name = first.get(v.data.data_ptr(), f"c{k}")
    for k, v in enumerate(v for n in graph.nodes for v in n.outputs):
        v.name = f"v{k}"
    for k, n in enumerate(graph.nodes):
        n.name = f"n{k}"
    return print_graph(graph) + "\n".join(f"{v.name}: {v.data.flatten()[:8].tolist()}" for v in graph.consts)


class Mixed(torch.nn.Module):
    """In-place ops, a non-persistent buffer, a lifted constant, a tensor made in forward, kwargs."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.register_buffer("scratch", torch.randn(6), persistent=False)
        self.table = torch.randn(6)

    def forward(self, x, *, scale=None):
        y = self.norm(self.lin(x)).transpose(0, 1).contiguous()
        y.add_(1.0).mul_(self.scratch[:, None])
        y = torch.nn.functional.gelu(y, approximate="tanh") + torch.tensor([0.5])
        z = torch.cat([y.t(), x], dim=0).softmax(-1) * self.table
        return z if scale is None else z * scale


def _llama():
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return tf.LlamaForCausalLM(cfg), (torch.randint(1, 128, (1, 9)),), None


def _gpt2():
    cfg = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg), (torch.randint(1, 128, (1, 7)),), None


def _gemma2():
    cfg = tf.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          sliding_window=4, use_cache=False)
    return tf.Gemma2ForCausalLM(cfg), (torch.randint(1, 128, (1, 8)),), None


MODELS = {
    "llama": _llama,
    "gpt2": _gpt2,
    "gemma2": _gemma2,
    "shufflenet": lambda: (shufflenet_v2(0.5), (torch.randn(1, 3, 33, 33),), None),
    "mixed": lambda: (Mixed(), (torch.randn(3, 6),), {"scale": torch.randn(1)}),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_trace_gives_the_two_pass_graph(name):
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    model.eval()
    with torch.no_grad():
        one = _graph_of(core_export.one_pass(model, args, kwargs))
        two = _graph_of(core_export.two_pass(model, args, kwargs))
    assert _canonical_text(one, model) == _canonical_text(two, model)


@pytest.fixture
def without_fast_capture(monkeypatch):
    """export_graph as it runs when the fast capture (vtc.frontend.fx_capture) refuses a model."""
    def refuse(*a, **k):
        raise fx_capture.Refused("switched off by the test")

    monkeypatch.setattr(fx_capture, "capture", refuse)


def test_export_graph_uses_one_trace_and_stays_correct(without_fast_capture):
    torch.manual_seed(0)
    model, args, kwargs = MODELS["mixed"]()
    graph = export_graph(model.eval(), args, kwargs)
    assert graph.meta["capture"] == core_export.ONE_PASS
    model, args, _ = _llama()
    graph = check_capture(model, args)  # every check of the frontend, eager comparison on fresh inputs
    assert graph.meta["capture"] == core_export.ONE_PASS


def test_a_failing_one_trace_falls_back_to_the_documented_path(monkeypatch, without_fast_capture):
    def broken(*a, **k):
        raise RuntimeError("one-pass entry point changed")

    monkeypatch.setattr(core_export, "one_pass", broken)
    graph = export_graph(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
    assert graph.meta["capture"].startswith(core_export.TWO_PASS)
    assert "one-pass entry point changed" in graph.meta["capture"]
    assert _trace._export_to_aten_ir is core_export._private()[2]  # the swapped attribute is put back


def test_a_model_that_does_not_export_still_raises_capture_error():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x - 1

    with pytest.raises(CaptureError, match="Branchy"):
        export_graph(Branchy(), (torch.randn(3),))
    assert _trace._export_to_aten_ir is core_export._private()[2]  # the swapped attribute is put back
