"""Tests for the built-in model zoo."""

from pathlib import Path

import pytest
import torch

from vtc import zoo
from vtc.zoo.shufflenet import WIDTHS, ShuffleUnit, channel_shuffle, shufflenet_v2

EXPECTED_SHAPES = {  # tiny: batch 2, seq 8, vocab 128, hidden 64, images 32x32
    "llama": (2, 8, 128),
    "gpt2": (2, 8, 128),
    "gemma2": (2, 8, 128),
    "swin": (2, 16, 64),
    "shufflenet": (2, 1000),
    "llama_layer": (2, 8, 64),
}


def _first(out):
    return out if isinstance(out, torch.Tensor) else out[0]


@pytest.fixture(scope="module", params=zoo.NAMES)
def tiny(request):
    return request.param, *zoo.load(request.param, "tiny")


def test_names_cover_expected():
    assert set(zoo.NAMES) == set(EXPECTED_SHAPES)


def test_tiny_runs_eagerly(tiny):
    name, model, inputs = tiny
    assert not model.training
    assert isinstance(inputs, tuple) and inputs
    assert all(x.ne(0).any() for x in inputs)
    with torch.no_grad():
        out = _first(model(*inputs))
    assert out.shape == EXPECTED_SHAPES[name]
    assert torch.isfinite(out).all()


def test_tiny_exports(tiny):
    name, model, inputs = tiny
    ep = torch.export.export(model, inputs, strict=False).run_decompositions()
    assert sum(n.op == "call_function" for n in ep.graph.nodes) > 20
    with torch.no_grad():
        torch.testing.assert_close(_first(ep.module()(*inputs)), _first(model(*inputs)), rtol=1e-4, atol=1e-4)


def test_load_is_deterministic():
    m1, (x1,) = zoo.load("llama", "tiny")
    m2, (x2,) = zoo.load("llama", "tiny")
    assert torch.equal(x1, x2)
    with torch.no_grad():
        assert torch.equal(m1(x1)[0], m2(x2)[0])


def test_transformers_configs():
    for name in ("llama", "gpt2", "gemma2"):
        model, (ids,) = zoo.load(name, "tiny")
        cfg = model.config
        assert cfg._attn_implementation == "eager" and cfg.use_cache is False
        assert ids.dtype == torch.long and 0 <= ids.min() and ids.max() < cfg.vocab_size
        for tok in (cfg.bos_token_id, cfg.eos_token_id):
            assert tok is None or 0 <= tok < cfg.vocab_size
    llama = zoo.load("llama", "small")[0].config
    assert llama.num_key_value_heads < llama.num_attention_heads  # GQA


def test_gemma2_sliding_window_matters():
    model, (ids,) = zoo.load("gemma2", "tiny")
    w = model.config.sliding_window
    assert w < ids.shape[1]
    with torch.no_grad():
        local = model(ids)[0]
        model.config.sliding_window = 10 * ids.shape[1]
        full = model(ids)[0]
    torch.testing.assert_close(local[:, :w], full[:, :w])  # windows agree until they fill
    assert not torch.allclose(local[:, w:], full[:, w:])


def test_shufflenet_param_counts():
    # Reference counts of the paper's architecture (as in torchvision's shufflenet_v2_x*).
    expected = {0.5: 1_366_792, 1.0: 2_278_604, 1.5: 3_503_624, 2.0: 7_393_996}
    for width, n in expected.items():
        got = sum(p.numel() for p in shufflenet_v2(width).parameters())
        assert abs(got - n) <= 0.01 * n and got == n, (width, got)
    with pytest.raises(ValueError, match="0.75"):
        shufflenet_v2(0.75)
    assert set(WIDTHS) == set(expected)


def test_channel_shuffle_interleaves():
    x = torch.arange(6.0).view(1, 6, 1, 1)
    assert channel_shuffle(x, 2).flatten().tolist() == [0, 3, 1, 4, 2, 5]
    assert channel_shuffle(x, 3).flatten().tolist() == [0, 2, 4, 1, 3, 5]
    y = torch.randn(2, 8, 3, 3)
    assert torch.equal(channel_shuffle(channel_shuffle(y, 2), 4), y)  # inverse shuffle


def test_shuffle_unit():
    x = torch.randn(2, 16, 8, 8)
    unit = ShuffleUnit(16, 16, 1).eval()
    with torch.no_grad():
        y = unit(x)
        assert y.shape == x.shape
        assert torch.equal(y[:, 0::2], x[:, :8])  # the split-off half passes through, interleaved
        assert ShuffleUnit(16, 48, 2).eval()(x).shape == (2, 48, 4, 4)


def test_unknown_name_and_size():
    with pytest.raises(ValueError, match="resnet9000") as e:
        zoo.load("resnet9000")
    assert all(n in str(e.value) for n in zoo.NAMES)
    with pytest.raises(ValueError, match="huge") as e:
        zoo.load("llama", "huge")
    assert "tiny" in str(e.value) and "small" in str(e.value)


def test_factory_spec(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    model, (x,) = zoo.load("zoo_factory:make", "tiny")
    assert x.shape == (2, 4) and model(x).shape == (2, 3) and not model.training
    model, (x,) = zoo.load("zoo_factory:make")
    assert x.shape == (2, 8)
    model, (x,) = zoo.load("zoo_factory:make_with_attr")
    assert model(x).shape == (1, 2)


@pytest.mark.parametrize(
    "spec, msg",
    [
        ("no_such_pkg_xyz.mod:make", "cannot import module 'no_such_pkg_xyz.mod'"),
        ("zoo_factory:missing", "no callable 'missing'"),
        ("zoo_factory:not_callable", "no callable 'not_callable'"),
        ("zoo_factory:make_bad", "must return"),
        (":make", "pkg.module:factory"),
    ],
)
def test_bad_factory_spec(monkeypatch, spec, msg):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        zoo.load(spec)
