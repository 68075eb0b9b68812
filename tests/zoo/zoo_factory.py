"""Example user factories for `vtc.zoo.load('zoo_factory:...')`."""

import torch
from torch import nn


def make(size: str = "small"):
    """Return (model, example_inputs); the width depends on size."""
    width = 4 if size == "tiny" else 8
    gen = torch.Generator().manual_seed(0)
    return nn.Sequential(nn.Linear(width, 3), nn.ReLU()), (torch.randn(2, width, generator=gen),)


def make_with_attr():
    """Return a model carrying its own example_inputs attribute."""
    model = nn.Linear(5, 2)
    model.example_inputs = torch.randn(1, 5, generator=torch.Generator().manual_seed(0))
    return model


def make_bad():
    """Return something load() cannot use."""
    return 42


not_callable = 3
