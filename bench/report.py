"""Renders a benchmark JSON (bench/harness.py) into BENCHMARKS.md and a PNG chart; never edits numbers.

Every figure in the markdown is computed here from the raw numbers in the JSON:
latency = median (min-max) of the timed calls; vtc's speed-up = the best other
system's median / the headline vtc variant's median (the most advanced variant
that ran: vtc-measured, else vtc-greedy, else vtc-all); peak memory = VmHWM minus
RSS before one inference in a fresh process; memory vs eager = 1 - vtc / eager.
The goal of issue 6 is checked on the five units.

    python bench/report.py [RESULT.json] [--markdown BENCHMARKS.md] [--chart bench/results/speedup.png]

Without a JSON it takes the newest full-run JSON in bench/results/.  Needs no
torch; the chart needs matplotlib (without it the markdown says so).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import OrderedDict
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
GROUP_TITLES = OrderedDict([("unit", "The paper's five units"), ("model", "Whole small models"),
                            ("attention", "FlashTensor attention variants"),
                            ("micro", "Movement-chain micro-benchmarks"), ("smoke", "Smoke workload")])
GOAL = {"geomean_speedup": 1.5, "min_speedup": 1.0, "mean_memory_reduction": 0.30}
SHORT = {"inductor-max-autotune": "inductor max-autotune", "onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}


# ----------------------------------------------------------------------------- figures


def _ok(r: dict | None) -> bool:
    return bool(r) and r.get("status") == "ok" and r.get("median_s") is not None


def _mem(r: dict | None) -> int | None:
    m = (r or {}).get("memory") or {}
    return m.get("peak_delta_bytes") if m.get("status") == "ok" else None


def headline(entry: dict, data: dict) -> str | None:
    """The vtc variant that speaks for vtc on this workload (the most advanced one that ran)."""
    name = None
    for s in data.get("vtc_headline_order", ()):
        if _ok(entry["results"].get(s)):
            name = s
    return name


def summarize(entry: dict, data: dict) -> dict:
    """Derived figures of one workload: best other system, vtc's speed-up, memory vs eager, movement."""
    res = entry["results"]
    others = [(s, res[s]["median_s"]) for s in data.get("others", ()) if _ok(res.get(s))]
    best = min(others, key=lambda x: x[1]) if others else (None, None)
    v = headline(entry, data)
    out = {"best_other": best[0], "best_other_s": best[1], "vtc": v, "vtc_s": res[v]["median_s"] if v else None,
           "speedup": None, "speedups": {}, "memory_reduction": None, "best_other_memory_reduction": None}
    for s in data.get("vtc_variants", ()):
        if _ok(res.get(s)) and best[1]:
            out["speedups"][s] = best[1] / res[s]["median_s"]
    if v and best[1]:
        out["speedup"] = out["speedups"][v]
    if _ok(res.get("eager")) and v:
        out["speedup_vs_eager"] = res["eager"]["median_s"] / res[v]["median_s"]
    eager_mem = _mem(res.get("eager"))
    if eager_mem and v and _mem(res[v]) is not None:
        out["memory_reduction"] = 1.0 - _mem(res[v]) / eager_mem
    if eager_mem and best[0] and _mem(res[best[0]]) is not None:
        out["best_other_memory_reduction"] = 1.0 - _mem(res[best[0]]) / eager_mem
    rep = (res.get(v or "", {}).get("vtc") or {}).get("report")
    if rep:
        out["movement"] = {"removed": rep["eliminated_movement_ops"], "total": rep["movement_ops"],
                           "materialized_bytes": rep["materialized_movement_bytes"], "gathers": rep.get("gathers"),
                           "views": rep.get("views"), "fallbacks": len(rep.get("fallback_ops", []))}
    none_rep = (res.get("vtc-none", {}).get("vtc") or {}).get("report")
    if none_rep:
        out["movement_none_bytes"] = none_rep["materialized_movement_bytes"]
    return out


def geomean(xs: list[float]) -> float | None:
    """Geometric mean (None for no values)."""
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def goal_status(data: dict) -> dict:
    """Issue 6's goal on the unit workloads: geomean speed-up, slowest unit, mean memory reduction vs eager."""
    units = [e for e in data["workloads"] if e["group"] == "unit"]
    sums = [summarize(e, data) for e in units]
    sp = [s["speedup"] for s in sums if s["speedup"]]
    mem = [s["memory_reduction"] for s in sums if s["memory_reduction"] is not None]
    g = geomean(sp)
    out = {"units": len(units), "with_speedup": len(sp), "geomean_speedup": g, "min_speedup": min(sp) if sp else None,
           "mean_memory_reduction": sum(mem) / len(mem) if mem else None, "with_memory": len(mem)}
    out["met"] = {
        "geomean_speedup": g is not None and len(sp) == len(units) and g >= GOAL["geomean_speedup"],
        "min_speedup": bool(sp) and len(sp) == len(units) and min(sp) >= GOAL["min_speedup"],
        "mean_memory_reduction": out["mean_memory_reduction"] is not None and len(mem) == len(units)
        and out["mean_memory_reduction"] >= GOAL["mean_memory_reduction"],
    }
    return out


# ----------------------------------------------------------------------------- formatting


def _ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _mb(b: float | None) -> str:
    if b is None:
        return "-"
    return f"{b / 2**20:.1f}" if b < 100 * 2**20 else f"{b / 2**20:.0f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.0f}%"


def _less(r: float | None) -> str:
    """A reduction vs eager as words: 0.3 -> '30% less', -0.1 -> '10% more'."""
    if r is None:
        return "-"
    return f"{abs(r) * 100:.0f}% {'less' if r >= 0 else 'more'}"


class Failures:
    """Numbers failures by (system, reason) so tables can point at one list."""

    def __init__(self):
        self.items: OrderedDict[tuple[str, str, str], list[str]] = OrderedDict()

    def ref(self, system: str, r: dict, workload: str) -> str:
        key = (system, r.get("status", "failed"), (r.get("reason") or "").strip() or "no reason recorded")
        self.items.setdefault(key, []).append(workload)
        return f"{key[1]} [F{list(self.items).index(key) + 1}]"

    def lines(self) -> list[str]:
        out = []
        for i, ((system, status, reason), ws) in enumerate(self.items.items(), 1):
            out.append(f"- **F{i}** `{system}` {status} on {len(ws)} workload{'s' * (len(ws) > 1)} "
                       f"({', '.join(ws)}): {reason}")
        return out


def _cell(system: str, r: dict | None, workload: str, fails: Failures) -> str:
    if not r:
        return "-"
    if _ok(r):
        return f"{_ms(r['median_s'])} ({_ms(r['min_s'])}-{_ms(r['max_s'])})"
    if r.get("status") in ("n/a", "skipped"):
        return r["status"]
    return fails.ref(system, r, workload)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _shown_systems(data: dict) -> tuple[list[str], list[str]]:
    """(systems that ran somewhere, vtc variants that were n/a everywhere)."""
    shown, hidden = [], []
    for s in data["systems"]:
        statuses = {e["results"].get(s, {}).get("status") for e in data["workloads"]}
        if s.startswith("vtc-") and statuses <= {"n/a", None}:
            hidden.append(s)
        else:
            shown.append(s)
    return shown, hidden


# ----------------------------------------------------------------------------- markdown


WHY = """\
What vtc runs at the commit of this run (see README.md): pointwise ops and
reductions become generated C++/OpenMP kernels that read virtual tensors
through their composed mappings, with single-use producers inlined (an
RMSNorm is one row kernel; an NCHW kernel walks whole H x W planes as one
vector loop, a batch norm's per-channel scale computed once per plane; row
sums add into 16 partial sums); a call runs its steps through a plan of
numbered slots set up at the first call, index checks inside the kernel's C
call; bmm -> softmax -> bmm attention is one generated flash kernel reading
Q, K and V through their mappings (prefill: 16, 32 or 64 queries, or the
queries of a GQA group's heads, as vector lanes, key blocks a causal mask
hides skipped, and at run time those an additive finfo.min / -inf mask
hides; GQA decode: the heads of a KV group share every K/V read of the
cache, keys split across threads when there are few groups): attn_causal,
attn_gqa_* and the decode units are where vtc leads; a GEMM whose operand
torch would have to copy (a cat, gathered rows, a transpose; packed by runs)
and a skinny decode GEMM estimated faster, and every convolution but wide
ones on large maps, are generated GEMMs that pack through the mapping (a
convolution's im2col packed by runs with vector loads), with bias / norm /
activation in their epilogue (per-row terms computed once per row);
depthwise convolutions and max pools are vector kernels plane by plane; a
producer of a cat or KV-cache update (a GEMM included: the new V of a decode
step) stores into its output; the cost model prices a cat read element by
element through a transpose, so greedy keeps EfficientViT's q/k/v cat
physical (its convolutions store into it); outputs of 1 MB and more are
written with streaming stores where the kernel's working set exceeds the
last-level cache; convolutions over maps of up to 256 pixels are dot
products or broadcast tiles with the weight read in place or packed once;
kernel outputs that only kernels read live in a per-call arena.  How torch's
float32 GEMM compares with the generated one is measured once per machine.
Same machine as the last run (an AMD EPYC Zen 4, AVX-512 on 256-bit
units).  Since the last run (vm-2026-12-02-092042): a Linear on MKL's
packed weight is priced with the packed-weight ratio at any row count
(swin_t_model's 76 Linears all generated); float16 pointwise loops as
AVX-512 code (not in these float32 workloads); the layer norm's mean
summed shifted by the row's first element; a gathered table larger than
L2 prefetched 16 rows ahead into L2, and transposed tiles beyond the LLC
2 blocks ahead; the permuted softmax keeps a block's exp terms in a
128 KB buffer and prefetches the next block (micro_permute_softmax_64mb
11.1 -> 6.94 ms: 0.98x -> 2.79x of ONNX Runtime).  efficientvit_b1 went
from a tie with ONNX Runtime to 1.46x (vtc-greedy 4.22 -> 2.88 ms; vtc-all
4.39 here).  The sub-millisecond rows move both ways by more than any
change in their kernels (shufflenet_unit_b1 vtc-greedy 0.132 -> 0.254 ms,
minimum 0.132; c3k2_b1 1.56 -> 1.75; shufflenet_v2_model 3.13 -> 2.65).
Where vtc loses here: swin_t_model, 0.91x of OpenVINO (65.6 vs 59.8 ms;
58.0 vs 50.6 in the last run): at 1 thread the two are level (docs/
prefill.md, session 26), so the gap is how vtc's steps use the second
thread (serial bias gathers and roll indices, layer norms 1.28x).
The prefill units stay GEMM-bound near OpenVINO.  On a loaded machine the
libgomp threads' spin-wait between kernels costs vtc more than OpenVINO's
TBB pool (docs/prefill.md, session 16); each timed block records how long
the process's threads waited for a core ("waited" in the JSON).
Peak memory is where virtual tensors help most: chains that stay virtual
allocate nothing."""


def shortfall_lines(data: dict) -> list[str]:
    """Per unit that misses the goal: vtc vs the best other system and what vtc still moves."""
    out = []
    for e in data["workloads"]:
        if e["group"] != "unit":
            continue
        s = summarize(e, data)
        if s["speedup"] is None:
            out.append(f"- `{e['name']}`: no vtc speed-up ({'vtc failed' if not s['vtc'] else 'no other system ran'}).")
            continue
        if s["speedup"] >= GOAL["min_speedup"]:
            continue
        mv = s.get("movement") or {}
        out.append(f"- `{e['name']}`: {s['vtc']} {_ms(s['vtc_s'])} ms vs {SHORT.get(s['best_other'], s['best_other'])} "
                   f"{_ms(s['best_other_s'])} ms ({_x(s['speedup'])}); {mv.get('removed', '?')}/{mv.get('total', '?')} "
                   f"movement ops removed, {_mb(mv.get('materialized_bytes'))} MiB of movement still materialised per "
                   f"call (vs {_mb(s.get('movement_none_bytes'))} MiB with plan=none); peak memory "
                   f"{_less(s['memory_reduction'])} than eager")
    return out


def ablation(data: dict) -> list[list[str]]:
    """Rows per group: geomean time ratios that separate the effect of kernels and of virtual tensors."""
    pairs = [("vtc-torch", "vtc-all", "generated kernels (vtc-torch → vtc-all)"),
             ("vtc-none", "vtc-all", "virtual tensors (vtc-none → vtc-all)"),
             ("vtc-all", "vtc-greedy", "planner (vtc-all → vtc-greedy)"),
             ("vtc-all", "vtc-measured", "measured planner (vtc-all → vtc-measured)"),
             ("eager", "vtc-all", "vtc-all vs eager")]
    groups = [g for g in GROUP_TITLES if any(e["group"] == g for e in data["workloads"])]
    rows = []
    for a, b, label in pairs:
        row = [label]
        for g in groups:
            both = [e["results"] for e in data["workloads"]
                    if e["group"] == g and _ok(e["results"].get(a)) and _ok(e["results"].get(b))]
            same = [a == "vtc-all" and _same_plan(res[a], res[b]) for res in both]  # the planner rows
            r = [1.0 if s else res[a]["median_s"] / res[b]["median_s"] for res, s in zip(both, same)]
            row.append((_x(geomean(r)) + (f" ({sum(same)}/{len(r)} same plan)" if any(same) else "")) if r else "-")
        if any(c != "-" for c in row[1:]):
            rows.append(row)
    return [["speed-up of"] + [GROUP_TITLES[g] for g in groups]] + rows


def _same_plan(a: dict, b: dict) -> bool:
    """Two vtc variants whose planners decided alike (``bench.systems.plan_key``): they run the same kernels,
    so the difference of their medians is the machine's, not the planner's."""
    ka, kb = ((r.get("vtc") or {}).get("report", {}).get("plan_key") for r in (a, b))
    return ka is not None and ka == kb


def load_warning(data: dict) -> str:
    """A line when the machine was shared (load above its cores) or fewer threads than cores were used."""
    m = data["machine"]
    cores, threads = m.get("cores") or 1, m.get("threads") or 1
    loads = [x for e in data["workloads"] for x in (e.get("load_avg") or [])[:1]] + (m.get("load_avg_start") or [])[:1]
    parts = []
    if loads and max(loads) > cores * 0.75:
        parts.append(f"the machine was shared during this run (1-minute load average {min(loads):.1f}-{max(loads):.1f} "
                     f"on {cores} cores), so every latency is noisy and the min-max ranges are wide")
    if threads < cores:
        parts.append(f"every system ran with {threads} thread{'s' * (threads > 1)} of {cores} cores (`--threads "
                     f"{threads}`): with other processes competing, multi-threaded OpenMP regions wait for "
                     "descheduled threads and their times swing by 10-100x, which would measure the load, not the systems")
    return ("> **Caveat:** " + "; ".join(parts) + ".") if parts else ""


METHOD = """\
- **Latency**: median of the timed calls (min-max in brackets), in ms, per call of
  the whole workload, after warm-up.  All systems of a workload are prepared
  first and then timed *interleaved*: rounds in which each system (rotating
  order) makes one untimed call then a block of timed calls, so that load from
  other processes falls on all of them alike.  Threads pinned to the thread
  count below for torch (`torch.set_num_threads`), ONNX Runtime
  (`intra_op_num_threads`, sequential) and OpenVINO (`INFERENCE_NUM_THREADS`,
  one stream, latency hint, **f32 precision** — it would choose bf16 on this
  AMX CPU otherwise).
- **Correctness**: every system's outputs are compared with eager first
  (relative error ≤ 1e-3 of the output's largest magnitude; ≤ 0.1% of boolean
  outputs may flip); a system that disagrees is shown as failed, not timed.
- **Speed-up**: the best other system's median / the vtc variant's median
  (> 1 means vtc is faster).  The headline vtc variant is the most advanced one
  that ran (vtc-measured, else vtc-greedy, else vtc-all); `vtc-none`
  (every movement op materialised) is the ablation.
- **Peak memory**: a fresh process per (workload, system) with
  `MALLOC_MMAP_THRESHOLD_=65536` (freed memory goes back to the OS), two warm-up
  calls, the peak-RSS mark reset by writing `5` to `/proc/self/clear_refs`,
  one inference, then VmHWM minus the RSS before that inference: the transient
  memory of one inference including its outputs, with weights and inputs
  already resident.  ONNX Runtime runs with its CPU memory arena off here.
  Buffers a runtime allocates once at compile time and keeps (OpenVINO's
  pre-planned intermediate memory) are not in this delta.
- **Compile**: time to first result = prepare (torch.compile wrapper / ONNX
  session / OpenVINO compile / `vtc.compile`) + first call, in seconds, with
  Inductor's on-disk cache as the machine had it.  ONNX export time is listed
  separately.  vtc's cold compile runs against an empty kernel cache of its
  own (`VTC_CACHE_DIR` per workload); the warm one is the memory probe's
  compile in a fresh process on that filled cache (capture and planning
  again, kernels loaded instead of built — but also the first-use costs of
  torch.export in a new process, so it can exceed the cold figure, whose
  process had already exported other workloads); a second `vtc.compile` in
  the same process is listed too.
- **Movement**: from the report of the headline vtc variant: movement ops
  eliminated (virtual or zero-copy view) / movement ops in the graph, and the
  bytes still materialised per call by gathers and kept movement ops, against
  `plan="none"` (every movement op run)."""


def render_markdown(data: dict, json_rel: str, chart_rel: str | None, chart_note: str = "") -> str:
    """The whole BENCHMARKS.md text for one result JSON."""
    m, st = data["machine"], data["settings"]
    shown, hidden = _shown_systems(data)
    fails = Failures()
    goal = goal_status(data)
    L: list[str] = ["# vtc benchmarks", ""]
    L += [f"Generated by `bench/report.py` from [`{json_rel}`]({json_rel}) — do not edit by hand; "
          "rerun the command below to refresh.", ""]
    L += ["## Goal (issue 6) and where vtc stands", ""]
    L += [f"On the paper's five units (batch 1 and 16): geomean speed-up ≥ {GOAL['geomean_speedup']}x over the best "
          f"other system, no unit slower than {GOAL['min_speedup']}x, peak memory ≥ {GOAL['mean_memory_reduction']:.0%} "
          "below eager on average.", ""]
    g = goal
    L += _table(["criterion", "goal", "measured", "met"], [
        ["geomean speed-up over best other (units)", f"≥ {GOAL['geomean_speedup']}x",
         f"{_x(g['geomean_speedup'])} ({g['with_speedup']}/{g['units']} units ran)", _yes(g["met"]["geomean_speedup"])],
        ["slowest unit", f"≥ {GOAL['min_speedup']}x", _x(g["min_speedup"]), _yes(g["met"]["min_speedup"])],
        ["mean peak-memory reduction vs eager (units)", f"≥ {GOAL['mean_memory_reduction']:.0%}",
         f"{_less(g['mean_memory_reduction'])} ({g['with_memory']}/{g['units']} units measured)",
         _yes(g["met"]["mean_memory_reduction"])],
    ])
    L += [""]
    warn = load_warning(data)
    if warn:
        L += [warn, ""]
    short = shortfall_lines(data)
    L += ["**Where vtc falls short.** " + (f"{len(short)} of {g['units']} units are slower with vtc than with the best "
                                           "other system:" if short else "No unit is slower than the best other system.")]
    L += short + ["", ("What separates the effects (geomean ratios of medians, > 1 = the second is faster; "
                         "in the planner rows a workload whose plan is vtc-all's counts 1.00x):"), ""]
    L += _table(ablation(data)[0], ablation(data)[1:])
    L += ["", "**Why.** " + WHY, ""]
    if data["settings"].get("quick"):
        L += ["> This is a `--quick` run: small sizes, few runs, no memory probes unless asked for.", ""]
    L += ["## Machine and command", ""]
    v = m.get("versions", {})
    L += [f"- **CPU**: {m.get('cpu')}, {m.get('cores')} cores, {_mb(m.get('memory_bytes') or 0)} MiB RAM; "
          f"**threads**: {m.get('threads')}",
          f"- **load average** at start {_load(m.get('load_avg_start'))}, at end {_load(data.get('load_avg_end'))} "
          "(1/5/15 min; above the core count means other processes competed for the CPU)",
          f"- **versions**: torch {v.get('torch')}, ONNX Runtime {v.get('onnxruntime')}, OpenVINO {v.get('openvino')}, "
          f"onnx {v.get('onnx')}, transformers {v.get('transformers')}, vtc {v.get('vtc')}, Python {m.get('python')}",
          f"- **run**: {data.get('created')}, wall time {_dur(data.get('wall_s'))}, git "
          f"{(m.get('git') or {}).get('commit', '?')[:12]}{' (dirty tree)' if (m.get('git') or {}).get('dirty') else ''}",
          f"- **settings**: {st['runs']} timed runs per system (blocks of {st['block']}, {st['warmup']} warm-up), "
          f"memory probes for {', '.join(st.get('memory_groups') or []) or 'none'}, a system whose {st['runs']} calls would "
          f"take over {st.get('max_timing_s', 0):.0f} s gets fewer (at least {st.get('min_runs', st['runs'])}), prepare time limit {st['prepare_timeout_s']:.0f} s",
          "", "```", data.get("command", "?"), "```", ""]
    ran = {e["name"] for e in data["workloads"]}
    left_out = [n for n in data.get("default_workloads", []) if n not in ran]
    if left_out:
        L += [f"This run left out {len(left_out)} of the {len(data['default_workloads'])} workloads of a plain run: "
              f"{', '.join(f'`{n}`' for n in left_out)}.", ""]
    if hidden:
        reasons = {e["results"][s].get("reason") for s in hidden for e in data["workloads"] if s in e["results"]}
        L += [f"Not shown: {', '.join(hidden)} — n/a on every workload ({'; '.join(sorted(r for r in reasons if r))}).", ""]
    if chart_rel:
        L += [f"![vtc speed-up over the best other system and peak memory vs eager]({chart_rel})", ""]
    elif chart_note:
        L += [f"_No chart: {chart_note}_", ""]

    groups = [g for g in GROUP_TITLES if any(e["group"] == g for e in data["workloads"])]
    L += ["## Latency (ms, median and min-max)", ""]
    for grp in groups:
        es = [e for e in data["workloads"] if e["group"] == grp]
        L += [f"### {GROUP_TITLES[grp]}", ""]
        rows = []
        for e in es:
            s = summarize(e, data)
            rows.append([f"`{e['name']}`"] + [_cell(x, e["results"].get(x), e["name"], fails) for x in shown]
                        + [SHORT.get(s["best_other"], s["best_other"] or "-"),
                           f"**{_x(s['speedup'])}**" + (f" ({s['vtc']})" if s["vtc"] and s["vtc"] != "vtc-all" else ""),
                           _x(s.get("speedup_vs_eager"))])
        L += _table(["workload"] + [SHORT.get(x, x) for x in shown] + ["best other", "vtc speed-up", "vtc vs eager"], rows)
        if grp == "unit":
            L += ["", f"Geomean vtc speed-up over the best other system on the units: **{_x(goal['geomean_speedup'])}**."]
        sp = [summarize(e, data)["speedup"] for e in es]
        if grp != "unit" and any(sp):
            L += ["", f"Geomean vtc speed-up over the best other system: **{_x(geomean([x for x in sp if x]))}**."]
        L += [""]

    mem_groups = [g for g in groups if any(e["group"] == g and any("memory" in r for r in e["results"].values())
                                            for e in data["workloads"])]
    if mem_groups:
        skipped = [GROUP_TITLES[g].lower() for g in groups if g not in mem_groups]
        L += ["## Peak memory of one inference (MiB above the RSS before it)", ""]
        if skipped:
            L += [f"Not measured in this run: {', '.join(skipped)} (memory probes cost a fresh process per system; "
                  "`--memory` runs them everywhere).", ""]
        if st.get("memory_systems"):
            L += [f"Probed systems: {', '.join(st['memory_systems'])} (others: `-`).", ""]
        for grp in mem_groups:
            es = [e for e in data["workloads"] if e["group"] == grp]
            L += [f"### {GROUP_TITLES[grp]}", ""]
            rows = []
            for e in es:
                s = summarize(e, data)
                cells = []
                for x in shown:
                    r = e["results"].get(x) or {}
                    mm = r.get("memory")
                    if mm is None:
                        cells.append("-")
                    elif mm.get("status") == "ok":
                        cells.append(_mb(mm["peak_delta_bytes"]))
                    else:
                        cells.append(fails.ref(x + " (memory probe)", mm, e["name"]))
                rows.append([f"`{e['name']}`"] + cells + [_less(s["memory_reduction"]),
                                                          _less(s["best_other_memory_reduction"])])
            L += _table(["workload"] + [SHORT.get(x, x) for x in shown]
                        + ["headline vtc vs eager", "best other (by latency) vs eager"], rows)
            L += [""]
        L += [f"Mean peak memory of the headline vtc variant on the units: **{_less(goal['mean_memory_reduction'])} "
              "than eager**.", ""]

    L += ["## Movement removed and compile time", ""]
    L += ["Movement figures are from the headline vtc variant's report; materialised movement is per call "
          "(`plan=none` → headline). vtc compile: cold = first `vtc.compile` of the workload against an empty "
          "kernel cache; warm cache = the memory probe's `vtc.compile` in a fresh process on the filled cache "
          "(`-` where no probe ran); again = a second `vtc.compile` in the same process. Other systems: time to "
          "first result = prepare + first call (see Method).", ""]
    comp_sys = [x for x in shown if not x.startswith("vtc-")]
    rows = []
    for e in data["workloads"]:
        s = summarize(e, data)
        mv = s.get("movement")
        vres = e["results"].get(s["vtc"] or "", {}).get("vtc") or {}
        row = [f"`{e['name']}`",
               f"{mv['removed']}/{mv['total']}" if mv else "-",
               f"{_mb(s.get('movement_none_bytes'))} → {_mb(mv['materialized_bytes'])}" if mv else "-",
               f"{mv['gathers']} / {mv['views']}" if mv else "-",
               " / ".join("-" if vres.get(k) is None else f"{vres[k]:.2f}"
                          for k in ("compile_cold_s", "compile_fresh_process_s", "compile_warm_s")) if vres else "-"]
        for x in comp_sys:
            r = e["results"].get(x) or {}
            row.append(f"{r['compile_s']:.2f}" if r.get("status") == "ok" and r.get("compile_s") is not None else "-")
        ex = e.get("export") or {}
        row.append(f"{ex['export_s']:.1f} ({ex['exporter']})" if ex.get("export_s") is not None else
                   ("failed" if ex.get("error") else "-"))
        rows.append(row)
    L += _table(["workload", "movement ops removed", "materialised MiB (none → vtc)", "chains realised: gather / view",
                 "vtc compile (s): cold / warm cache, fresh process / again, same process"]
                + [f"{SHORT.get(x, x)} first result (s)" for x in comp_sys] + ["ONNX export (s)"], rows)
    L += [""]

    L += ["## Failures", ""]
    L += fails.lines() or ["None."]
    L += ["", "## Workloads", ""]
    for e in data["workloads"]:
        shapes = ", ".join(f"{'x'.join(map(str, i['shape'])) or 'scalar'} {i['dtype']}" for i in e.get("inputs", []))
        note = f" _{e['notes']}_" if e.get("notes") else ""
        L.append(f"- `{e['name']}` ({e['group']}): {e['desc']}; inputs {shapes or '-'}; "
                 f"weights {_mb(e.get('param_bytes'))} MiB.{note}")
    L += ["", "## Method", "", METHOD, ""]
    return "\n".join(L)


def _yes(b: bool) -> str:
    return "yes" if b else "**no**"


def _load(x) -> str:
    return "/".join(f"{v:.2f}" for v in x) if x else "?"


def _dur(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s / 60:.1f} min" if s >= 120 else f"{s:.0f} s"


# ----------------------------------------------------------------------------- chart


def render_chart(data: dict, path: Path) -> str:
    """Writes the speed-up / memory PNG; returns "" or why there is no chart."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    rows = []
    for e in data["workloads"]:
        s = summarize(e, data)
        rows.append((e["name"], e["group"], s["speedup"], s["memory_reduction"], s["best_other_memory_reduction"]))
    if not any(r[2] for r in rows):
        return "no workload has a vtc speed-up to plot"
    colors = {"unit": "tab:blue", "model": "tab:green", "attention": "tab:orange", "micro": "tab:purple",
              "smoke": "tab:gray"}
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator, NullLocator

    n = len(rows)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, max(3.0, 0.28 * n + 1.8)), sharey=True)
    ys = list(range(n))[::-1]
    sp = [r[2] or 0 for r in rows]
    a1.barh(ys, sp, color=[colors.get(r[1], "gray") for r in rows])
    a1.set_xscale("log")
    vals = [x for x in sp if x]
    lo, hi = min(vals + [0.5]) / 1.5, max(vals + [2.0]) * 1.6
    a1.set_xlim(lo, hi)
    ticks = [t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 1.5, 2, 5, 10, 20, 50) if lo <= t <= hi]
    a1.xaxis.set_major_locator(FixedLocator(ticks))
    a1.xaxis.set_minor_locator(NullLocator())
    a1.set_xticklabels([f"{t:g}x" for t in ticks])
    for y, x in zip(ys, sp):
        a1.text(x * 1.05 if x else lo * 1.05, y, f"{x:.2f}x" if x else "n/a", va="center", fontsize=6)
    a1.axvline(1.0, color="black", lw=1)
    a1.axvline(GOAL["geomean_speedup"], color="red", lw=1, ls="--")
    a1.set_yticks(ys, [r[0] for r in rows], fontsize=7)
    a1.set_xlabel("vtc speed-up over the best other system (log scale; > 1 = vtc faster)")
    groups = [g for g in colors if any(r[1] == g for r in rows)]
    a1.legend([Patch(color=colors[g]) for g in groups] + [plt.Line2D([], [], color="red", ls="--")],
              groups + [f"goal {GOAL['geomean_speedup']}x (units, geomean)"], fontsize=7, loc="lower right")
    mem = [(r[3] * 100 if r[3] is not None else 0) for r in rows]
    other = [(r[4] * 100 if r[4] is not None else 0) for r in rows]
    a2.barh([y + 0.2 for y in ys], mem, height=0.4, color=[colors.get(r[1], "gray") for r in rows], label="vtc")
    a2.barh([y - 0.2 for y in ys], other, height=0.4, color="lightgray", label="best other system (by latency)")
    for y, r in zip(ys, rows):
        if r[3] is None:
            a2.text(0, y, " not measured", va="center", fontsize=6, color="gray")
    a2.axvline(0, color="black", lw=1)
    a2.axvline(GOAL["mean_memory_reduction"] * 100, color="red", lw=1, ls="--", label="goal 30% (units, mean)")
    a2.set_xlabel("peak memory reduction vs eager (%; > 0 = less memory than eager)")
    a2.legend(fontsize=7, loc="lower right")
    m = data["machine"]
    threads = m.get("threads") or 1
    fig.suptitle(f"vtc bench {data.get('created', '')[:10]} — {m.get('cpu')}, {threads} thread{'s' * (threads > 1)}",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""


# ----------------------------------------------------------------------------- files


def _rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def write(data: dict, markdown: Path, chart: Path | None, json_path: Path) -> Path:
    """Writes the chart (if it can) and the markdown for `data`; returns the markdown path."""
    markdown.parent.mkdir(parents=True, exist_ok=True)
    note = render_chart(data, chart) if chart is not None else "no chart path given"
    chart_rel = _rel(chart, markdown.parent) if chart is not None and not note else None
    markdown.write_text(render_markdown(data, _rel(json_path, markdown.parent), chart_rel, note))
    return markdown


def newest_result(directory: Path = BENCH_DIR / "results") -> Path:
    """The newest full-run JSON in `directory`."""
    files = sorted((p for p in directory.glob("*.json") if not p.name.endswith("-quick.json")),
                   key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no benchmark JSON in {directory}; run `vtc bench` first")
    return files[-1]


def main(argv: list[str] | None = None) -> int:
    """Command line: render one JSON (default: the newest full run)."""
    p = argparse.ArgumentParser(prog="python bench/report.py", description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="?", help="result JSON (default: newest full run in bench/results)")
    p.add_argument("--markdown", default=str(REPO_ROOT / "BENCHMARKS.md"))
    p.add_argument("--chart", default=str(BENCH_DIR / "results" / "speedup.png"))
    a = p.parse_args(argv)
    path = Path(a.json) if a.json else newest_result()
    data = json.loads(path.read_text())
    if data.get("schema") != 1:
        print(f"{path}: unknown schema {data.get('schema')!r}", file=sys.stderr)
        return 2
    md = write(data, Path(a.markdown), Path(a.chart), path)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
