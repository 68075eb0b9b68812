"""A small transformers Swin (shifted windows, the relative-position bias gathered from its table, the MLP's GELU)
under the greedy plan, with the machine figures of a 1-thread `vtc bench` run of Swin-T (docs/prefill.md, "Swin-T
... session 17"): the result matches eager, the GELU is no kernel of its own, and every movement op the plan keeps
is a generated copy kernel that reads a virtual input through its mapping (``Lowering.move_kernels``), not torch on
a realised view: the bias is gathered, then copied once into its permuted [heads, N, N] layout, a window
partition's clone reads through the views and permute before it."""
from __future__ import annotations

import re

import pytest
import torch

import vtc
from vtc.plan import cost

from .util import gen, torch_threads

TOL = dict(rtol=1e-4, atol=1e-4)

# the figures of this machine at 1 thread (a 2-thread set, 46.6 GB/s and 165.3 GFLOPS, gives another plan of
# equal copies: docs/prefill.md; not compiled here, for the suite's time)
FIGURES = cost.Machine(bandwidth_gbs=37.6, vector_bytes=64, threads=1, measured=True, gemm_gflops=111.9,
                       library_gemm_ratio=0.456, library_bf16_ratio=0.957)

# (image side, window, depths, heads): 14 x 14 patches in 7 x 7 windows, a plain then a shifted block (the roll's
# indices, the window partitions and merges, the relative-position bias of each); no patch merging (its cat is
# no kernel's own input: see docs/prefill.md for the larger cases that ran once)
CASE = (56, 7, [2], [2])


def _swin(side: int, window: int, depths: list[int], heads: list[int]):
    from transformers import SwinConfig, SwinModel

    torch.manual_seed(side + window)
    cfg = SwinConfig(image_size=side, patch_size=4, embed_dim=24, depths=depths, num_heads=heads, window_size=window,
                     drop_path_rate=0.0, attn_implementation="eager")
    model = SwinModel(cfg).eval()
    with torch.no_grad():  # a random bias table (transformers starts it at zeros)
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.copy_(torch.randn(p.shape, generator=gen(len(name))))
    return model, (torch.randn(1, 3, side, side, generator=gen(side)),)


def _census(c: vtc.Compiled) -> dict[str, int]:
    """Per kind of step: generated kernels by name without the number, torch runs by op."""
    out: dict[str, int] = {}
    for s in c._first.executor.steps:
        key = (re.sub(r"_\d+$", "", s.kernel.step.kernel.name) if s.kind == "kernel"
               else f"run:{s.node.op}" if s.kind == "run" else s.kind)
        out[key] = out.get(key, 0) + 1
    return out


def _bias_copies(c: vtc.Compiled) -> int:
    """Kernels on the way from a relative-position bias table to the attention kernels that read the bias."""
    chain, n = set(), 0
    for s in c._first.executor.steps:
        if s.kind == "kernel" and s.kernel.step.kernel.kind == "move":
            k = s.kernel.step.kernel
            if any("relative_position_bias_table" in b.name or b.name in chain for b in k.inputs):
                chain |= {st.buffer.name for st in k.stores}
                n += 1
    return n


def test_swin_plan_matches_eager(monkeypatch):
    """Compiled once (~25 kernels: one case, one set of figures, for the suite's time), called at 1 and 2
    threads.  Before session 17 this plan ran the window partition's clone through torch on a realised view
    (``run aten.clone``) and kept the bias's view as a third copy per block: it fails there."""
    monkeypatch.setattr(cost, "_machine", lambda: FIGURES)
    model, inputs = _swin(*CASE)
    with torch.no_grad():
        want = model(*inputs).last_hidden_state
        c = vtc.compile(model, inputs, gemm="vtc")  # every GEMM generated, as all of Swin-T's are
        for threads in (1, 2):
            with torch_threads(threads):
                torch.testing.assert_close(c(*inputs).last_hidden_state, want, **TOL)
    census = _census(c)
    # the MLP's GELU: fc1's epilogue or read by fc2's A pack, never a kernel of its own
    assert not any(k.startswith("k_gelu") for k in census), census
    # no movement op run by torch on a realised view (a window partition's clone, permute, the merge's cat)
    runs = {k: n for k, n in census.items() if k.startswith("run:") and k.split(".")[1]
            in ("clone", "permute", "cat", "view", "_unsafe_view", "expand", "unsqueeze", "index")}
    assert not runs, census
    # the relative-position bias: at most two copies per block (the gather, then into [heads, N, N]); before,
    # three where the planner kept the view (the gather, a copy for the view, the permute)
    assert _bias_copies(c) <= 2 * sum(CASE[2]), census
