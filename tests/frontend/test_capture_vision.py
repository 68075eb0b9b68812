"""torch.export capture of a tiny Swin (transformers, random weights) and a small conv net."""
from __future__ import annotations

import torch
import transformers as tf

from vtc.frontend import fx_capture

from .capture_checks import check_capture


class ConvNet(torch.nn.Module):
    """Conv + BN + ReLU + max pool, a channel shuffle, a grouped conv residual, avg pool + linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.fc = torch.nn.Linear(8, 10)
        with torch.no_grad():  # non-trivial running statistics
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv1(x))), 2)
        b, c, h, w = y.shape
        y = y.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w)  # channel shuffle
        y = y + torch.sigmoid(self.conv2(y))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1))


def test_swin():
    torch.manual_seed(0)
    cfg = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2)
    graph = check_capture(tf.SwinForImageClassification(cfg), (torch.randn(1, 3, 32, 32),))
    assert graph.out_spec.type is tf.models.swin.modeling_swin.SwinImageClassifierOutput
    assert graph.meta["capture"] == fx_capture.CAPTURE  # its pooler's as_strided_ (was: torch.export, slower)


def test_convnet_and_multi_output_ops():
    torch.manual_seed(0)
    graph = check_capture(ConvNet(), (torch.randn(1, 3, 32, 32),))
    bn = [n for n in graph.nodes if "batch_norm" in n.op]
    assert len(bn) == 1 and len(bn[0].outputs) == 3  # the unused mean/rstd outputs still get Values
    assert [v.name for v in bn[0].outputs] == [f"{bn[0].name}_{i}" for i in range(3)]
    assert {n.op for n in graph.nodes} >= {"aten.convolution.default", "aten.max_pool2d_with_indices.default"}
