"""Movement micro-benchmarks timed side by side in one process: eager, torch.compile and vtc (plan="all").

Like ``bench.gemm_side_by_side`` (whose interleaved timer it uses): every system runs once per round,
round after round, so each sees the same load on a shared machine; the line per workload gives the
median and the minimum per system and the ratios to vtc (of medians, then of minimums), with the load
average; at the end, torch's read and copy bandwidth on 64 MB (the floor of a memory-bound chain).  Each vtc result is checked against eager first; Dynamo is reset before each workload (the
micro modules share one ``forward``, so without a reset the 9th workload would hit Dynamo's recompile
limit and "torch.compile" would silently run eagerly)::

    python -m bench.micro_side_by_side micro_gelu_64mb micro_permute_softmax_64mb [--systems eager,vtc]
    python -m bench.micro_side_by_side micro --out bench/results/chains.json   # a group, results to a file
    python -m bench.micro_side_by_side micro_gelu_1mb --threads 1 --clock cpu   # CPU time: stays put under load
    python -m bench.micro_side_by_side micro_cat_relu_8mb --per-call          # individual calls: p10 / p50
    python -m bench.micro_side_by_side --compare before.json after.json        # markdown table of the ratios

``--per-call`` times each call alone instead of a round of calls (``per_call_times``: blocks of 10 calls per
system, round after round; "median_ms" is the median call and "min_ms" the 10th percentile): on a shared
machine a 2-thread call that loses its core spoils only itself, not the round it is in, so the median stays
put at loads where the round medians swing by 10x.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from bench import workloads as W
from bench.gemm_side_by_side import CLOCKS, time_side_by_side


def per_call_times(fns: dict, rounds: int, block: int = 10) -> dict[str, dict]:
    """{system: {"min_ms" (10th percentile), "median_ms", "calls"}}: each call timed alone (wall time), `block`
    calls per system per round (after one untimed call), round after round."""
    samples = {name: [] for name in fns}
    for fn in fns.values():
        fn(); fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return {n: {"min_ms": sorted(s)[len(s) // 10], "median_ms": statistics.median(s), "calls": len(s)}
            for n, s in samples.items()}


def baselines(model, inputs: tuple, systems: list[str]) -> dict:
    """{"eager" / "inductor": a call of `model` on `inputs`} for those of the two named in `systems` (Dynamo reset
    first, so that an earlier workload's graphs do not count; call under ``torch.no_grad``)."""
    fns = {}
    if "eager" in systems:
        fns["eager"] = lambda: model(*inputs)
    if "inductor" in systems:
        torch._dynamo.reset()
        ci = torch.compile(model)
        ci(*inputs)
        fns["inductor"] = lambda: ci(*inputs)
    return fns


def side_by_side(name: str, systems: list[str], rounds: int = 15, clock=CLOCKS["wall"],
                 per_call: bool = False) -> dict[str, dict]:
    """{system: {"min_ms", "median_ms", "calls_per_round"}} on workload `name`, interleaved (``per_call``:
    individual calls, ``per_call_times``)."""
    import vtc

    model, inputs = W.get(name).build(False)
    with torch.no_grad():
        ref = model(*inputs)
        fns = baselines(model, inputs, systems)
        if "vtc" in systems:
            cv = vtc.compile(model, inputs, plan="all")
            torch.testing.assert_close(cv(*inputs), ref, rtol=1e-4, atol=1e-4)
            fns["vtc"] = lambda: cv(*inputs)
        return per_call_times(fns, rounds) if per_call else time_side_by_side(fns, rounds, clock)


def bandwidth(mbytes: int = 64, rounds: int = 15) -> dict[str, float]:
    """GB/s of torch reading (sum) and copying (copy_ into a warm buffer) a contiguous float32 tensor of
    `mbytes` MB, medians of interleaved rounds: the memory speed a 64 MB chain runs against."""
    x = torch.randn(mbytes << 18)
    out = torch.empty_like(x)
    times = time_side_by_side({"read": lambda: x.sum(), "copy": lambda: out.copy_(x)}, rounds)
    return {"read_gb_s": x.nbytes / times["read"]["median_ms"] / 1e6,
            "copy_gb_s": 2 * x.nbytes / times["copy"]["median_ms"] / 1e6}  # copy: bytes read + written


def _line(name: str, times: dict[str, dict]) -> str:
    cols = " ".join(f"{k} {t['median_ms']:.3f}/{t['min_ms']:.3f}" for k, t in times.items())
    v = times.get("vtc")
    ratios = " ".join(f"{k}/vtc {t['median_ms'] / v['median_ms']:.2f}x ({t['min_ms'] / v['min_ms']:.2f}x)"
                      for k, t in times.items() if k != "vtc") if v else ""
    return f"{name}: {cols} ms (median/min) | {ratios}  load {os.getloadavg()[0]:.2f}"


def compare_table(paths: list[str]) -> str:
    """A markdown table of eager/vtc and inductor/vtc (ratios of medians; > 1: vtc faster) per workload,
    one column pair per results file written with --out (e.g. before and after a change)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    names = list(dict.fromkeys(r["workload"] for run in runs for r in run["results"]))
    head = "| workload | " + " | ".join(f"eager/vtc, inductor/vtc ({Path(p).stem}, {run['commit']})"
                                        for p, run in zip(paths, runs)) + " |"
    lines = [head, "|---|" + "---|" * len(runs)]
    for name in names:
        cells = []
        for run in runs:
            t = next((r["times"] for r in run["results"] if r["workload"] == name), None)
            if t is None or "vtc" not in t:
                cells.append("-")
                continue
            v = t["vtc"]["median_ms"]
            cells.append(", ".join(f"{t[s]['median_ms'] / v:.2f}x" if s in t else "-" for s in ("eager", "inductor")))
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workloads", nargs="+", help="workload names, or a pattern / group for bench.workloads.select")
    p.add_argument("--systems", default="eager,inductor,vtc")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time, or the calling thread's CPU time (with --threads 1 only)")
    p.add_argument("--per-call", action="store_true",
                   help="time each call alone (wall time): median and 10th percentile of single calls")
    p.add_argument("--out", help="also write the results (with command, commit and load) to this JSON file")
    p.add_argument("--compare", action="store_true",
                   help="the positional arguments are --out files: print their ratios side by side, run nothing")
    args = p.parse_args(argv)
    if args.compare:
        print(compare_table(args.workloads))
        return 0
    if args.per_call and args.clock != "wall":
        p.error("--per-call times wall time")
    if args.clock == "cpu" and args.threads != 1:
        p.error(f"--clock cpu measures the calling thread only: it needs --threads 1, not {args.threads}")
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    names = [w.name for w in W.select(",".join(args.workloads))]
    load_before, results = os.getloadavg(), []
    for name in names:
        times = side_by_side(name, args.systems.split(","), args.rounds, CLOCKS[args.clock], args.per_call)
        results.append({"workload": name, "times": times})
        print(_line(name, times), flush=True)
    bw = bandwidth()
    print(f"memory: read {bw['read_gb_s']:.1f} GB/s, copy {bw['copy_gb_s']:.1f} GB/s (64 MB, torch, "
          f"{args.threads} threads)  load {os.getloadavg()[0]:.2f}")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        data = {"command": "python -m bench.micro_side_by_side " + " ".join(sys.argv[1:] if argv is None else argv),
                "commit": commit, "threads": args.threads, "clock": args.clock, "rounds": args.rounds,
                "per_call": args.per_call,
                "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpu_count": os.cpu_count(),
                "bandwidth": bw, "results": results}
        Path(args.out).write_text(json.dumps(data, indent=1))
        print(f"wrote {args.out}; load average before {load_before}, after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
