"""The explain report as one self-contained HTML page (``vtc analyze MODEL --html out.html``).

A reader who has never seen the code should learn from it what happened to
every data-movement op: a table with each op's fate (virtual over which
tensors and through which composed mapping, a zero-copy view, realised by one
copy, or kept physical and why), the planner's estimated saving and, in
measured mode, the measured one; the planner's notes; and two pictures of the
graph, before (every op as captured) and after (what runs: compute ops, kept
movement ops, the views and copies that realise virtual tensors; removed ops
are gone and their readers read through mappings, drawn as dashed edges).

The pictures are inline SVG laid out here (layers by longest path from the
inputs, each layer ordered by its predecessors' mean position): no graphviz,
no script, no network.  ``page(...)`` returns the text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

from vtc.ir.graph import Graph
from vtc.plan.cost import _bytes, fmt_seconds
from vtc.plan.explain import FATES
from vtc.plan.virtualize import Plan

COLORS = {  # fill, stroke
    "compute": ("#eeeeee", "#777777"),
    "input": ("#ffffff", "#999999"),
    "virtual": ("#dff3df", "#2e8b57"),
    "view": ("#dde8fb", "#3b6fc4"),
    "gather": ("#fde2cf", "#c4622d"),
    "kept": ("#fbd3d3", "#b22222"),
}
FATE_TEXT = {**FATES, "kept": "kept physical (runs and writes its output)"}
BOX_W, BOX_H, GAP_X, GAP_Y, PAD = 150, 34, 22, 34, 20


@dataclass
class Picture:
    """A DAG to draw: boxes (id -> label lines, kind), edges (from, to, dashed), laid out by `layout`."""

    boxes: dict[str, tuple[list[str], str]] = field(default_factory=dict)
    edges: list[tuple[str, str, bool]] = field(default_factory=list)

    def box(self, key: str, lines: list[str], kind: str) -> None:
        self.boxes.setdefault(key, (lines, kind))

    def edge(self, a: str, b: str, dashed: bool = False) -> None:
        if a in self.boxes and b in self.boxes and a != b and (a, b, dashed) not in self.edges:
            self.edges.append((a, b, dashed))

    def layout(self) -> dict[str, tuple[float, float]]:
        """Box centre positions: layer = longest path from a source, order within a layer by predecessors."""
        preds: dict[str, list[str]] = {k: [] for k in self.boxes}
        for a, b, _ in self.edges:
            preds[b].append(a)
        succs: dict[str, list[str]] = {k: [] for k in self.boxes}
        for a, b, _ in self.edges:
            succs[a].append(b)
        layer: dict[str, int] = {}
        waiting = {k: len(preds[k]) for k in self.boxes}
        ready = [k for k in self.boxes if not waiting[k]]
        while ready:  # topological order (Kahn): each box one layer below its lowest predecessor
            k = ready.pop(0)
            layer[k] = 1 + max((layer[p] for p in preds[k]), default=-1)
            for b in succs[k]:
                waiting[b] -= 1
                if not waiting[b]:
                    ready.append(b)
        for k in self.boxes:  # a cycle cannot come from a graph, but never lose a box
            layer.setdefault(k, 0)
        for k in self.boxes:  # a box without predecessors (a weight's view) sits just above its first reader
            if not preds[k] and succs[k]:
                layer[k] = max(0, min(layer[b] for b in succs[k]) - 1)
        rows: dict[int, list[str]] = {}
        for k in self.boxes:
            rows.setdefault(layer[k], []).append(k)
        pos: dict[str, tuple[float, float]] = {}
        for r in sorted(rows):
            keys = rows[r]
            if r > 0:
                def mean_x(k: str, keys=keys) -> float:
                    xs = [pos[p][0] for p in preds[k] if p in pos]
                    return sum(xs) / len(xs) if xs else float(keys.index(k))
                keys = sorted(keys, key=mean_x)
            for i, k in enumerate(keys):
                pos[k] = (PAD + i * (BOX_W + GAP_X) + BOX_W / 2, PAD + r * (BOX_H + GAP_Y) + BOX_H / 2)
        return pos

    def svg(self, title: str) -> str:
        pos = self.layout()
        width = max((x for x, _ in pos.values()), default=0) + BOX_W / 2 + PAD
        height = max((y for _, y in pos.values()), default=0) + BOX_H / 2 + PAD
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
               f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{escape(title)}">',
               '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
               'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555555"/></marker></defs>']
        for a, b, dashed in self.edges:
            (x1, y1), (x2, y2) = pos[a], pos[b]
            dash = ' stroke-dasharray="5,4"' if dashed else ""
            out.append(f'<line x1="{x1:.0f}" y1="{y1 + BOX_H / 2:.0f}" x2="{x2:.0f}" y2="{y2 - BOX_H / 2:.0f}" '
                       f'stroke="#555555" stroke-width="1"{dash} marker-end="url(#arrow)"/>')
        for k, (lines, kind) in self.boxes.items():
            x, y = pos[k]
            fill, stroke = COLORS[kind]
            rx = 14 if kind == "input" else 4
            dash = ' stroke-dasharray="4,3"' if kind == "virtual" else ""
            out.append(f'<g><title>{escape(" | ".join(lines))}</title>'
                       f'<rect x="{x - BOX_W / 2:.0f}" y="{y - BOX_H / 2:.0f}" width="{BOX_W}" height="{BOX_H}" '
                       f'rx="{rx}" fill="{fill}" stroke="{stroke}"{dash}/>')
            for i, text in enumerate(lines[:2]):
                dy = (i - (min(len(lines), 2) - 1) / 2) * 13 + 4
                out.append(f'<text x="{x:.0f}" y="{y + dy:.0f}" font-size="11" text-anchor="middle" '
                           f'font-family="sans-serif">{escape(_cut(text, 24))}</text>')
            out.append("</g>")
        out.append("</svg>")
        return "\n".join(out)


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _op(node) -> str:
    return node.op.split(".")[1] if node.op.startswith("aten.") else node.op


def _inputs(pic: Picture, graph: Graph) -> None:
    """Boxes for the activation inputs (parameters, named p_* / b_* by torch.export, are left out)."""
    used = {v.name for n in graph.nodes for v in n.inputs}
    for v in graph.inputs:
        if v.name in used and not v.name.startswith(("p_", "b_")):
            pic.box("v:" + v.name, [v.name, "input"], "input")


def before_picture(graph: Graph) -> Picture:
    """The graph as captured: activation inputs and every node, movement ops in the "kept" colour."""
    pic = Picture()
    _inputs(pic, graph)
    producer: dict[str, str] = {}
    for n in graph.nodes:
        pic.box(n.name, [n.name, _op(n)], "kept" if n.kind == "movement" else "compute")
        for v in n.inputs:
            pic.edge(producer.get(v.name, "v:" + v.name), n.name)
        for o in n.outputs:
            producer[o.name] = n.name
    return pic


def after_picture(graph: Graph, plan: Plan, fates: dict[str, str]) -> Picture:
    """What runs under `plan`: compute and kept movement ops, one box per realised virtual tensor (a view or
    a copy); a reader of a virtual tensor gets a dashed edge from each physical tensor its mapping reads."""
    pic = Picture()
    _inputs(pic, graph)
    producer: dict[str, str] = {}

    def source_box(value: str) -> str:
        return producer.get(value, "v:" + value)

    def connect(value: str, reader: str) -> None:
        r = plan.realized.get(value)
        if r is not None:
            key = "r:" + value
            if key not in pic.boxes:
                kind = "view" if r.strided is not None else "gather"
                pic.box(key, ["%" + value, "zero-copy view" if kind == "view" else "one copy"], kind)
                for s in r.mapping.used_sources():
                    pic.edge(source_box(s), key, dashed=True)
            pic.edge(key, reader)
        elif plan.is_virtual(value):
            for s in plan.mappings[value].used_sources():
                pic.edge(source_box(s), reader, dashed=True)
        else:
            pic.edge(source_box(value), reader)

    for n in graph.nodes:
        if n.kind == "movement" and n.name not in plan.kept:
            continue
        kind = "kept" if n.kind == "movement" else "compute"
        pic.box(n.name, [n.name, _op(n) + (" (kept)" if kind == "kept" else "")], kind)
        for v in n.inputs:
            connect(v.name, n.name)
        for o in n.outputs:
            producer[o.name] = n.name
    for v in graph.outputs:
        if v.name in plan.realized:
            connect(v.name, "r:" + v.name)  # the output's own realisation box
    return pic


def page(graph: Graph, plan: Plan, report, baseline=None, title: str = "vtc explain") -> str:
    """The whole HTML page: summary, notes, every movement op with its fate and why, the two pictures."""
    fates = {e.node: e.fate for e in report.movement}
    pulls = {d.op: d for d in plan.decisions if d.direction == "pull"}
    moves = [n for n in graph.nodes if n.kind == "movement"]
    kept = sum(n.name in plan.kept for n in moves)
    rows = []
    for n in moves:
        fate = fates.get(n.name, "kept" if n.name in plan.kept else "virtual")
        over, mapping = "", ""
        if n.name in plan.kept:
            why = plan.kept[n.name]
        else:
            parts = []
            for o in n.outputs:
                m = plan.mappings.get(o.name)
                if m is not None:
                    srcs = ", ".join("%" + s for s in m.used_sources()) or "constants only"
                    parts.append(f"%{o.name} over {srcs}")
                    mapping += str(m) + "\n"
            over = "; ".join(parts)
            why = FATE_TEXT.get(fate, fate)
        d = pulls.get(n.name)
        est = fmt_seconds(d.saving.seconds) if d is not None else ""
        meas = fmt_seconds(d.measured) if d is not None and d.measured is not None else ""
        planner = d.reason if d is not None and n.name not in plan.kept else ""
        fill, stroke = COLORS.get(fate, COLORS["compute"])
        nbytes = sum(o.nbytes for o in n.outputs)
        shape = ", ".join(str(list(o.shape)) for o in n.outputs)
        rows.append(
            f'<tr><td><code>{escape(n.name)}</code></td><td><code>{escape(_op(n))}</code></td>'
            f'<td>{escape(shape)}<br><small>{_bytes(nbytes)}</small></td>'
            f'<td style="background:{fill};border-left:4px solid {stroke}"><b>{escape(fate)}</b></td>'
            f'<td>{escape(over)}{"<pre>" + escape(mapping.strip()) + "</pre>" if mapping else ""}</td>'
            f'<td>{escape(why)}{"<br><small>" + escape(planner) + "</small>" if planner else ""}</td>'
            f'<td>{escape(est)}</td><td>{escape(meas)}</td></tr>')
    peak = ""
    if baseline is not None:
        peak = (f"<li>peak intermediate memory: {_bytes(baseline.peak_memory_bytes)} with every movement op run "
                f"(plan=none) &rarr; {_bytes(report.peak_memory_bytes)} with this plan</li>"
                f"<li>movement written to memory per call: {_bytes(baseline.materialized_movement_bytes)} &rarr; "
                f"{_bytes(report.materialized_movement_bytes)}</li>")
    notes = "".join(f"<li>{escape(x)}</li>" for x in plan.notes)
    legend = "".join(f'<span style="background:{f};border:1px solid {s};padding:1px 6px;margin-right:8px">'
                     f'{escape(k)}</span>' for k, (f, s) in COLORS.items())
    before = before_picture(graph).svg("the graph as captured")
    after = after_picture(graph, plan, fates).svg("what runs under the plan")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #cccccc; padding: 4px 6px; vertical-align: top; text-align: left; }}
pre {{ margin: 4px 0 0 0; font-size: 11px; white-space: pre-wrap; }}
.pic {{ overflow: auto; border: 1px solid #cccccc; margin-bottom: 1.5em; }}
</style>
</head>
<body>
<h1>{escape(title)}</h1>
<p>vtc removes data-movement ops (transpose, reshape, slice, concatenation, expand, gather, KV-cache update):
their results become <i>virtual tensors</i>, index mappings that the neighbouring compute reads through, so the
moved data is never written to memory. This page lists every movement op of the graph and what the planner did
with it.</p>
<ul>
<li>plan <b>{escape(plan.mode)}</b>, objective <b>{escape(plan.objective)}</b>:
{len(moves) - kept} of {len(moves)} movement ops removed, {kept} kept physical;
{report.eliminated_movement_ops} never written to memory</li>
{peak}
{notes}
</ul>
<h2>Every movement op</h2>
<p>Fates: <b>virtual</b> &mdash; read through its composed mapping inside generated kernels;
<b>view</b> &mdash; handed to a library op as a zero-copy strided view; <b>gather</b> &mdash; realised by one copy
through its composed mapping for a reader that needs memory; <b>kept</b> &mdash; the op runs and writes its output.
The mapping gives, for each index of the virtual tensor, the physical tensor and index it reads.
Estimated saving: latency without the op removed minus latency with it (the cost model); measured: the same,
timed (plan="measured").</p>
<table>
<tr><th>op</th><th>ATen</th><th>shape</th><th>fate</th><th>virtual over (composed mapping)</th><th>why</th>
<th>estimated saving</th><th>measured saving</th></tr>
{chr(10).join(rows)}
</table>
<h2>The graph before</h2>
<p>As captured: compute ops grey, movement ops red (each one would write its output to memory).
Legend: {legend}</p>
<div class="pic">
{before}
</div>
<h2>The graph after</h2>
<p>What runs: compute ops, kept movement ops (red), the views (blue) and copies (orange) that make a virtual
tensor physical for a reader that needs memory. Removed ops are gone; a dashed edge is a read through a
mapping.</p>
<div class="pic">
{after}
</div>
</body>
</html>
"""
