"""`vtc analyze kv_factory:make`: the KV-cache graph of the planner tests as a model factory."""
from __future__ import annotations

import sys
from pathlib import Path


def make():
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from tests.plan.graphs import kv_cache_update, kv_inputs

    return kv_cache_update, kv_inputs()
