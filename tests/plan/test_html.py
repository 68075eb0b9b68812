"""The explain page: produced by `vtc analyze --html`, well-formed, naming every movement op and its fate."""
from __future__ import annotations

import pathlib
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import torch

import vtc
from vtc.cli import main
from vtc.plan.html import Picture, page

from .graphs import kv_cache_update, kv_inputs, repeat_kv_attention, repeat_kv_inputs

VOID = {"meta", "br", "hr", "img", "input", "link", "area", "base", "col", "embed", "source", "track", "wbr"}


class Checker(HTMLParser):
    """Checks that every non-void element is closed in order; collects the text."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        pass

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def check_page(text: str) -> tuple[str, list[ET.Element]]:
    """(visible text, parsed SVG roots) of a well-formed page; fails on any unclosed or misnested tag."""
    c = Checker()
    c.feed(text)
    c.close()
    assert not c.errors and not c.stack, (c.errors, c.stack)
    svgs = [ET.fromstring(s) for s in re.findall(r"<svg.*?</svg>", text, re.S)]
    assert len(svgs) == 2 and all(s.tag == "{http://www.w3.org/2000/svg}svg" for s in svgs)
    assert "http" not in text.replace("http://www.w3.org/2000/svg", "")  # self-contained: nothing fetched
    assert "<script" not in text
    return "".join(c.text), svgs


def test_cli_writes_a_well_formed_page_naming_every_movement_op(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    out = tmp_path / "kv.html"
    assert main(["analyze", "kv_factory:make", "--size", "tiny", "--html", str(out)]) == 0
    text, svgs = check_page(out.read_text(encoding="utf-8"))
    c = vtc.compile(kv_cache_update, kv_inputs())
    for n in c.graph.nodes:
        if n.kind == "movement":
            assert re.search(rf"{n.name}\s*{n.op.split('.')[1]}", text), n.name
    assert "index_put" in text and "%index_put over %mm, %k_cache" in text
    assert "plan greedy, objective latency" in text
    titles = {t.text for t in svgs[0].iter("{http://www.w3.org/2000/svg}title")}
    assert {f"{n.name} | {n.op.split('.')[1]}" for n in c.graph.nodes} <= titles  # every node drawn before


def test_page_shows_kept_ops_with_their_reason_and_the_measured_saving():
    inputs = repeat_kv_inputs()
    c = vtc.compile(repeat_kv_attention, inputs, plan="measured", measure_budget_s=0.5)
    plan = c._first.plan
    text, svgs = check_page(page(c.graph, plan, c.report, c.replan(plan="none").report))
    for op, why in plan.kept.items():
        assert why in text
    measured = [d for d in plan.decisions if d.measured is not None]
    assert measured and "measured saving" in text
    after = {t.text.split(" | ")[0] for t in svgs[1].iter("{http://www.w3.org/2000/svg}title")}
    removed = [n.name for n in c.graph.nodes if n.kind == "movement" and n.name not in plan.kept]
    assert removed and not set(removed) & after  # removed ops are not drawn after
    assert set(plan.kept) <= after
    assert "peak intermediate memory" in text


def test_layout_puts_every_box_below_its_predecessors():
    pic = Picture()
    for k in "abcd":
        pic.box(k, [k], "compute")
    pic.edge("a", "b")
    pic.edge("b", "d")
    pic.edge("c", "d")
    pic.edge("a", "c", dashed=True)
    pos = pic.layout()
    assert all(pos[a][1] < pos[b][1] for a, b, _ in pic.edges)
    torch.testing.assert_close(torch.tensor(pos["b"][1]), torch.tensor(pos["c"][1]))
