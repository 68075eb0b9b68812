"""Compile time of vtc and torch.compile (Inductor) on one workload, cold and warm cache.

Each measurement runs in a fresh process (nothing cached in memory):

- ``vtc cold``: ``vtc.compile`` + first call with an empty cache (``VTC_CACHE_DIR`` a new
  directory), so every kernel is generated and built by the C++ compiler and the plan is made;
- ``vtc warm``: the same with the cache the cold run filled (kernels loaded, plan looked up);
- ``vtc-dynamo cold`` / ``warm``: ``torch.compile(model, backend="vtc")`` + first call (dynamo
  and aot_autograd capture the graph, vtc does the rest), with an empty / the filled cache;
- ``inductor cold`` / ``warm``: ``torch.compile(model)`` + first call with an empty /
  the filled ``TORCHINDUCTOR_CACHE_DIR`` (and a fresh Triton/FX cache under it).

``total_s`` (compile + first call) is the figure to compare: torch.compile compiles lazily,
in the first call.  Systems are measured alternately (cold runs of every system, then warm
runs, the order reversed on every other repeat) so that all see the same load, and the
summary gives medians and each system's ratio to torch.compile's.  ``--baseline DIR``
adds ``vtc-baseline``: vtc imported from another checkout (e.g. the main branch), to compare
a change with what it changes in the same conditions.  The vtc runs also time their stages
(capture, plan, and within it ``machine``, the measurement of the machine that a fresh cache
directory makes, lowering, kernel build and load, report) by wrapping the stage functions, and
every run records its CPU seconds (``total_cpu_s``, the C++ compiler runs included) and
``setup_s``, the seconds before compiling (importing torch, transformers and vtc, building
the model).  Results go to ``bench/results/compile_time.json`` with the command, the
machine's load (``uptime``) before and after, and the thread count.

    python -m bench.compile_time [--workload llama_model] [--threads 2] [--repeat 1]
                                 [--systems vtc,inductor] [--baseline /path/to/other/checkout]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULT = BENCH_DIR / "results" / "compile_time.json"
TAG = "VTC_COMPILE_TIME "


def _child(system: str, workload: str, threads: int) -> dict:
    """Runs in the measuring process: builds the workload, compiles it, calls it once; returns timings."""
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    from bench import workloads as W

    model, inputs = W.get(workload).build()
    stages: dict[str, float] = {}
    kernels = None
    if system.startswith("vtc"):
        import vtc
        import vtc.codegen.lower as L
        import vtc.compiler as C
        import vtc.runtime.executor as E

        def timed(name, fn):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    stages[name] = stages.get(name, 0.0) + time.perf_counter() - t0
            return wrapper

        import vtc.plan.cost as cost

        C.export_graph = timed("capture", C.export_graph)
        C.make_plan = timed("plan", C.make_plan)
        cost._machine = timed("machine", cost._machine)  # inside plan: measuring the machine (a fresh cache)
        L.lower = timed("lower", L.lower)
        E.build_kernels = timed("build_kernels", E.build_kernels)
        C.build_report = timed("report", C.build_report)
    setup_s = time.perf_counter() - t_start
    cpu0 = _cpu_s()
    t0 = time.perf_counter()
    if system in ("vtc", "vtc-baseline"):
        compiled = vtc.compile(model, inputs)
        kernels = compiled.report.kernels
    else:
        compiled = torch.compile(model, backend="vtc" if system == "vtc-dynamo" else "inductor")
    capture = getattr(getattr(compiled, "graph", None), "meta", {}).get("capture")
    compile_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    with torch.no_grad():
        compiled(*inputs)
    first_call_s = time.perf_counter() - t1
    return dict(compile_s=compile_s, first_call_s=first_call_s, total_s=compile_s + first_call_s,
                total_cpu_s=_cpu_s() - cpu0, setup_s=setup_s, stages=stages, kernels=kernels, capture=capture)


def _cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for (vtc's C++ compiler runs; not the
    worker processes Inductor keeps running)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _measure(system: str, workload: str, threads: int, env: dict, root: Path = BENCH_DIR.parent) -> dict:
    """One fresh process measuring `system` (vtc and bench imported from `root`); its result dict."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", system, "--workload", workload,
           "--threads", str(threads)]  # this file's child, whatever checkout `root` is
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=1800)
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            out = json.loads(line[len(TAG):])
            out["process_wall_s"] = wall
            return out
    raise RuntimeError(f"{system} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="llama_model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="cold/warm pairs per system")
    p.add_argument("--systems", default="vtc,inductor", help="of vtc, vtc-dynamo, inductor")
    p.add_argument("--baseline", help="a checkout whose vtc is measured too, as vtc-baseline")
    p.add_argument("--out", default=str(RESULT))
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(TAG + json.dumps(_child(a.child, a.workload, a.threads)), flush=True)
        return 0
    systems = a.systems.split(",") + (["vtc-baseline"] if a.baseline else [])
    result = {"command": " ".join([Path(sys.executable).name, "-m", "bench.compile_time", *(argv or sys.argv[1:])]),
              "workload": a.workload, "threads": a.threads, "uptime_before": _uptime(), "runs": {}}
    for r in range(a.repeat):
        with tempfile.TemporaryDirectory(prefix="vtc-ct-") as tmp:
            order = systems if r % 2 == 0 else systems[::-1]
            for state in ("cold", "warm"):
                for system in order:
                    cache = os.path.join(tmp, system)
                    root = Path(a.baseline) if system == "vtc-baseline" else BENCH_DIR.parent
                    env = {**os.environ, "PYTHONPATH": str(root)}
                    if system.startswith("vtc"):
                        env["VTC_CACHE_DIR"] = cache
                    else:
                        env["TORCHINDUCTOR_CACHE_DIR"] = cache
                        env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
                    load = _uptime().split("load average:")[-1].strip()
                    run = _measure(system, a.workload, a.threads, env, root)
                    run["load_before"] = load
                    result["runs"].setdefault(system, {"cold": [], "warm": []})[state].append(run)
                    stages = {k: round(v, 2) for k, v in run["stages"].items()}
                    print(f"{system:12s} {state}: compile {run['compile_s']:.2f} s + first call "
                          f"{run['first_call_s']:.2f} s = {run['total_s']:.2f} s, {run['total_cpu_s']:.1f} s CPU "
                          f"(setup {run['setup_s']:.1f} s, "
                          f"load {load})  {stages or ''}", flush=True)
    result["summary"] = _summary(result["runs"])
    result["uptime_after"] = _uptime()
    for line in result["summary"]["lines"]:
        print(line)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}\n{result['uptime_before']}\n{result['uptime_after']}")
    return 0


def _summary(runs: dict) -> dict:
    """Median compile, first call, total and stage seconds per system and state; totals over torch.compile's."""
    import statistics

    out: dict = {"lines": []}
    for system, states in runs.items():
        for state, rs in states.items():
            if not rs:
                continue
            med = {k: statistics.median(r[k] for r in rs)
                   for k in ("compile_s", "first_call_s", "total_s", "total_cpu_s")}
            stages = {k: round(statistics.median(r["stages"].get(k, 0.0) for r in rs), 3) for k in rs[0]["stages"]}
            ind = runs.get("inductor", {}).get(state)
            ratio = med["total_s"] / statistics.median(r["total_s"] for r in ind) if ind else None
            out.setdefault(system, {})[state] = {**med, "stages": stages, "over_inductor": ratio, "runs": len(rs)}
            out["lines"].append(f"{system:12s} {state}: total {med['total_s']:.2f} s (compile {med['compile_s']:.2f}, "
                                f"CPU {med['total_cpu_s']:.1f} s)"
                                + (f", {ratio:.2f}x torch.compile's" if ratio is not None else "") + f" {stages}")
    return out


if __name__ == "__main__":
    sys.exit(main())
