"""Memory (the executor's liveness, "peak X MB -> Y MB") and the explain report, in Python and in the CLI."""
from __future__ import annotations

import pathlib

import torch

import vtc
from vtc.cli import main
from vtc.plan.explain import compare_peak, explain, peak_line
from vtc.plan.greedy import plan_greedy
from vtc.runtime.executor import Executor

from .graphs import bmm_strided_operand, capture, kv_cache_update, kv_inputs, node, pointwise_chain


def test_peak_of_a_pointwise_chain_by_hand():
    """a [4,8] 128 B -> b [2,4,8] 256 B -> c [3,2,4,8] 768 B -> d = exp(c) 768 B (the output).

    Run op by op (torch backend), each buffer lives until its one reader has run:
    after a: 128; after b: 128 + 256; after c: 256 + 768; after d: 768 + 768 (c is freed after exp).
    The peak is the two largest live buffers, c and d: 1536 B.  With generated kernels the chain is one
    kernel and only d is ever stored.
    """
    g, _ = capture(pointwise_chain, torch.randn(4, 8), torch.randn(2, 4, 8), torch.randn(3, 1, 1, 1))
    plan = plan_greedy(g)
    assert Executor(g, plan, backend="torch").peak_bytes == 768 + 768
    assert Executor(g, plan, backend="cpu").peak_bytes == 768


def test_peak_line_against_plan_none():
    g, _ = capture(lambda x: (x.t().contiguous() * 2.0).reshape(-1), torch.randn(64, 32))
    none, mine = compare_peak(g, plan_greedy(g), backend="torch")
    # none: transpose, clone, product, reshape are 8 KB copies, each live next to the one before it;
    # greedy: the product reads the transpose through its mapping and the reshape is a view of it
    assert (none, mine) == (2 * 8192, 8192)
    assert peak_line(none, mine, "greedy") == "peak 0.016 MB -> 0.008 MB (-50%) (plan=none -> plan=greedy)"


def test_explain_lists_every_movement_op_with_its_fate():
    inputs = (torch.randn(2, 8, 64), torch.randn(16, 64, 2))
    c = vtc.compile(bmm_strided_operand, inputs, plan="greedy")
    base = c.replan(plan="none").report
    text = explain(c.graph, c._first.plan, c.report, base)
    p = node(c.graph, "permute")
    assert f"{p.name} (permute): kept physical: composed mapping reads stride 128 inside a GEMM operand" in text
    assert "estimated movement time: plan=none" in text and "peak " in text

    inputs = kv_inputs()
    c = vtc.compile(kv_cache_update, inputs, plan="greedy")
    text = explain(c.graph, c._first.plan, c.report)
    for n in c.graph.nodes:
        if n.kind == "movement":
            assert f"  {n.name} (" in text
    put = node(c.graph, "index_put")
    assert f"%{put.outputs[0].name} virtual over %mm, %k_cache, read through its mapping by generated kernels" in text
    assert "push alternatives" in text


def test_cli_explain(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    assert main(["analyze", "kv_factory:make", "--size", "tiny", "--plan", "greedy", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "plan=greedy (objective=latency): 10/10 movement ops removed, 0 kept physical" in out
    assert "peak " in out and "(plan=none -> plan=greedy)" in out
