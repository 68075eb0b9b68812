"""The ShuffleNetV2 unit from vtc's zoo (channel split -> branch -> concat -> channel shuffle).

``vtc.zoo.shufflenet.unit`` builds one stride-1 ``ShuffleUnit`` of the x1.0
network's second stage (116 channels, 28x28 at 224x224 input).
"""
from __future__ import annotations

from . import Workload


def _build(batch: int):
    def build(quick: bool):
        from vtc.zoo.shufflenet import unit

        return unit(channels=116, stride=1, hw=14 if quick else 28, batch=batch)
    return build


WORKLOADS = [
    Workload("shufflenet_unit_b1", "unit", "ShuffleNetV2 x1.0 stage-2 unit (116 ch, 28x28, stride 1), batch 1",
             _build(1), in_quick=True, params=dict(batch=1, channels=116, hw=28)),
    Workload("shufflenet_unit_b16", "unit", "ShuffleNetV2 x1.0 stage-2 unit (116 ch, 28x28, stride 1), batch 16",
             _build(16), params=dict(batch=16, channels=116, hw=28)),
]
