"""The workload registry: every benchmarked model is a `Workload` with a builder.

A builder takes ``quick`` (smaller sizes for ``vtc bench --quick``) and returns
``(model in eval mode, example_inputs)`` with deterministic random weights and
float32 inputs (``*_fp16`` and ``gemm_bf16_*`` workloads cast both with ``in_dtype``).  Groups: ``unit`` (the paper's five units), ``model`` (whole
small models), ``attention`` (FlashTensor attention variants), ``micro``
(movement-chain micro-benchmarks), ``gemm`` (vtc's GEMM vs torch and ONNX
Runtime, run only when named) and ``smoke`` (a tiny workload for the tests,
never selected unless named).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

GROUPS = ("unit", "model", "attention", "micro", "gemm", "smoke")
SEED = 0


@dataclass(frozen=True)
class Workload:
    """One benchmarked model: name, group, a one-line description and a builder."""

    name: str
    group: str
    desc: str
    builder: Callable[[bool], tuple[nn.Module, tuple]]
    in_quick: bool = False
    default: bool = True  # in a plain `vtc bench`; the others run when named, by group or with `all`
    notes: str = ""
    params: dict = field(default_factory=dict)

    def build(self, quick: bool = False) -> tuple[nn.Module, tuple]:
        """(model in eval mode, inputs), deterministic for a given `quick`."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model, inputs = self.builder(quick)
        if isinstance(model, nn.Module):
            model.eval()
        return model, tuple(inputs)


def in_dtype(build: Callable[[bool], tuple[nn.Module, tuple]], dtype: torch.dtype):
    """Builder `build` with the model's floating-point parameters and inputs cast to `dtype` (token ids stay)."""
    def cast(quick: bool):
        model, inputs = build(quick)
        return model.to(dtype), tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    return cast


def randn(*shape: int, seed: int = 1) -> torch.Tensor:
    """A deterministic float32 normal tensor."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _registry() -> dict[str, Workload]:
    from . import attention, c3k2, efficientvit, gemm, gemma2, llama3, micro, models, shufflenet_unit

    out: dict[str, Workload] = {}
    for mod in (llama3, gemma2, efficientvit, c3k2, shufflenet_unit, models, attention, micro, gemm):
        for w in mod.WORKLOADS:
            if w.name in out:
                raise ValueError(f"duplicate workload name {w.name!r}")
            if w.group not in GROUPS:
                raise ValueError(f"workload {w.name!r}: unknown group {w.group!r}")
            out[w.name] = w
    return out


_CACHE: dict[str, Workload] = {}


def all_workloads() -> dict[str, Workload]:
    """Every registered workload by name, in registry order."""
    if not _CACHE:
        _CACHE.update(_registry())
    return _CACHE


def get(name: str) -> Workload:
    """The workload called `name`; unknown names raise with the valid ones."""
    w = all_workloads().get(name)
    if w is None:
        raise ValueError(f"unknown workload {name!r}; see `vtc bench --list`")
    return w


def select(spec: str | None, quick: bool = False) -> list[Workload]:
    """Workloads for a comma list of names, globs, groups or ``all``.

    No spec: the default set (quick: the quick set).  A group name or ``all`` takes every workload of
    the group(s) (with ``quick``, only those in the quick set); ``smoke`` is only taken when named.
    """
    ws = all_workloads()
    if not spec:
        return [w for w in ws.values() if w.group != "smoke" and (w.in_quick if quick else w.default)]
    picked: list[Workload] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        group = item if item in GROUPS else item[:-1] if item.endswith("s") and item[:-1] in GROUPS else None
        if item == "all":
            hits = [w for w in ws.values() if w.group != "smoke" and (w.in_quick or not quick)]
        elif group is not None:
            hits = [w for w in ws.values() if w.group == group and (w.in_quick or not quick or group == "smoke")]
        else:
            hits = [w for n, w in ws.items() if fnmatch.fnmatchcase(n, item)]
        if not hits:
            raise ValueError(f"no workload matches {item!r}; see `vtc bench --list` (groups: {', '.join(GROUPS)}, all)")
        picked += [w for w in hits if w not in picked]
    return picked
